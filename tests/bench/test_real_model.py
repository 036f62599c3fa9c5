"""benchmarks/real_model.py's models: the conversions read the original's own weight memory and still compute its
function; the copy keeps weights of its own."""

import torch

from benchmarks import real_model


def test_conversions_share_the_originals_weights_and_compute_its_logits():
    models = real_model.load_models(real_model.SMOKE, torch.float32, "cpu", 2, family_norms=False)
    original = models[real_model.ORIGINAL]
    weights = {name: p.data_ptr() for name, p in original.named_parameters(remove_duplicate=False)}
    for name in (real_model.STANDARD, real_model.BLOCK, real_model.FULL):
        own = dict(models[name].named_parameters(remove_duplicate=False))
        assert {k: own[k].data_ptr() for k in weights} == weights, name
        assert any("_res_" in k for k in own) == (name != real_model.STANDARD)
    copied = dict(models[real_model.COPY].named_parameters())
    assert all(copied[k].data_ptr() != ptr for k, ptr in weights.items() if k in copied)

    ids = torch.randint(0, real_model.SMOKE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = original(ids).logits
        for name in (real_model.STANDARD, real_model.BLOCK, real_model.FULL):
            torch.testing.assert_close(models[name](ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_fast_norms_outlive_the_mode_switches_of_a_loaded_model(tmp_path):
    """transformers loads a model with its hub kernels on, and re-kernelizes it at `train()` (the training step) and
    `eval()`: the fast norms must still be the ones that run, as they are in the conversions."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from attnres.bench.models import _fast_rms_norm, fast_norms

    LlamaForCausalLM(LlamaConfig(**real_model.SMOKE)).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    norms = [m for m in model.modules() if type(m) is type(model.model.norm)]
    assert fast_norms(model, {type(model.model.norm)}) == len(norms) == 2 * real_model.SMOKE["num_hidden_layers"] + 1
    for switch in (model.train, model.eval, model.train):
        switch()
        assert all(norm.forward.func is _fast_rms_norm for norm in norms)


def test_the_profile_says_what_block_and_full_run_beyond_the_standard_conversion(tmp_path):
    """`--profile decode`: every model's ops per call, and Block's and Full's differences from the standard conversion,
    largest first, in which their fused reads appear and the standard's PreNorms' `rms_norm` is gone."""
    import json

    out = tmp_path / "profile.json"
    assert real_model.main(["--smoke", "--profile", "decode", "--dtypes", "fp32", "--profile-rounds", "3",
                            "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["profile_rounds"] == 3 and "rounds" not in record
    (row,) = record["results"]
    assert (row["case"], row["dtype"]) == ("decode", "fp32")
    assert set(row["self_cpu_ms"]) == set(row["ops"]) == {real_model.ORIGINAL, real_model.COPY, real_model.STANDARD,
                                                           real_model.BLOCK, real_model.FULL}
    assert row["ops"][real_model.BLOCK]["attnres_cpu::bank_aggregate"]["calls"] == 2 * 4 + 1  # 2L + 1 reads a call
    assert "attnres_cpu::bank_aggregate" not in row["ops"][real_model.STANDARD]
    assert row["ops"][real_model.STANDARD]["aten::rms_norm"]["calls"] == 2 * 4 + 1
    for name in (real_model.BLOCK, real_model.FULL):
        diff = list(row["over_standard"][name].values())
        least = real_model.PROFILE_MIN_SHARE * row["self_cpu_ms"][real_model.STANDARD]
        assert len(diff) > 1 and all(abs(a) >= abs(b) >= least - 1e-4 for a, b in zip(diff, diff[1:]))
        part = row["parts_over_standard"][name]
        assert part["fused reads (attnres_cpu::bank_aggregate)"]["ms"] > 0
        assert abs(sum(v["ms"] for k, v in part.items() if k != "in all") - part["in all"]["ms"]) < 0.1 * len(part)
        everything = row["self_cpu_ms"][name] - row["self_cpu_ms"][real_model.STANDARD]
        assert abs(part["in all"]["ms"] - everything) < 0.1


def test_the_record_names_the_cpu_and_its_bf16_instructions(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse avx512f amx_bf16 avx512_bf16\n")
    assert real_model.cpu_description(info) == "Some CPU 9000 (avx512f, avx512_bf16, amx_bf16)"
    info.write_text("model name\t: Older CPU\nflags\t\t: fpu sse avx2\n")
    assert real_model.cpu_description(info) == "Older CPU (no AVX-512)"
    assert real_model.cpu_description(tmp_path / "absent")  # the platform's name


def test_each_call_counts_the_page_faults_of_fresh_memory():
    import mmap

    def touch_fresh_pages():
        with mmap.mmap(-1, 64 * mmap.PAGESIZE) as memory:
            for page in range(64):
                memory[page * mmap.PAGESIZE] = 1

    fns, faults = real_model.counting_faults({"fresh": touch_fresh_pages, "none": lambda: None})
    for _ in range(3):
        fns["fresh"](), fns["none"]()
    assert len(faults["fresh"]) == len(faults["none"]) == 3
    assert all(f >= 64 for f in faults["fresh"]) and all(f < 64 for f in faults["none"])


def test_the_record_names_the_allocator_settings():
    assert real_model.allocator_description({}) == "the C library's malloc, default settings"
    env = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1073741824", "LD_PRELOAD": "", "HOME": "/root"}
    assert real_model.allocator_description(env) == "GLIBC_TUNABLES=glibc.malloc.trim_threshold=1073741824"


def test_a_timed_run_gives_each_models_ratio_and_page_faults(tmp_path):
    import json

    out = tmp_path / "timed.json"
    assert real_model.main(["--smoke", "--cases", "decode", "--dtypes", "fp32", "--decode-rounds", "3",
                            "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["allocator"] == real_model.allocator_description()
    (row,) = record["results"]
    names = {real_model.ORIGINAL, real_model.COPY, real_model.STANDARD, real_model.BLOCK, real_model.FULL}
    assert set(row["ms"]) == set(row["page_faults"]) == names and set(row["ratio"]) == names - {real_model.ORIGINAL}
    assert all(len(row["seconds"][name]) == 3 and row["page_faults"][name] >= 0 for name in names)
