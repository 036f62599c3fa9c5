"""Training studies (quality: validation loss against settings), one module each, run from the repository root as
`python -m experiments.NAME`; each writes its ledger `docs/NAME.json`, and `python -m experiments.results` makes
`docs/results.md` and its figures from them. Shared building blocks live in `attnres` (`attnres.analysis.stats`,
`attnres.training`); `experiments.study` holds what only the studies share."""
