"""Speed and memory measurements, one module each, run from the repository root as `python -m benchmarks.NAME`
(`torchrun ... -m benchmarks.NAME` for the distributed ones); each writes its `docs/*.json`. What a benchmark and
`attnres bench` share (timing, the benchmark models, the suite) lives in `attnres.bench`."""
