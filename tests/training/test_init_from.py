"""Continued training (`init_from`): the run starts from a pretrained folder's function, exactly, with its tokenizer;
`freeze_base`; resume and final/ as in any run; conflicting settings refused."""

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from attnres.cli import main
from attnres.tokenization import byte_tokenizer
from attnres.models import convert_from_hf
from attnres.training import ByteTokenizer, TrainConfig, eval_batches, read_corpus, read_log, tokenize_and_split, train
from attnres.training.init_from import Pretrained, load_init_from
from attnres.training.optim import is_attn_res_param
from tests.training.test_loop import restore_threads  # noqa: F401 - `threads` is process-wide: give it back after

DATA = dict(data="stdlib", max_bytes=30_000, seq_len=16, batch_size=2, eval_batches=2)
FAMILIES = {  # tiny family configs whose weights are drawn wide (std 0.3), so the source is far from a uniform guess
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3", head_dim=8),
    # saved with per-expert keys under Mixtral's legacy names (`block_sparse_moe`, w1/w2/w3), fused on loading
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32),
    "qwen3, tied": dict(model_type="qwen3", head_dim=8, tie_word_embeddings=True),
}


def continued(tmp_path, source, name="run", **overrides) -> TrainConfig:
    settings = dict(DATA, init_from=str(source), residual="block", block_size=1, steps=4, warmup=1, eval_interval=2,
                    log_interval=1, checkpoint_interval=100, out=str(tmp_path / name), progress=False, threads=1)
    return TrainConfig(**{**settings, **overrides})


def family_folder(folder, family: str, hidden_size: int = 16, heads: int = 2, dtype=torch.float32, **save):
    """A tiny pretrained-looking causal LM of `family` with the byte tokenizer, saved as a transformers folder in
    `dtype` (`save`: `save_pretrained`'s options)."""
    config = AutoConfig.for_model(
        **FAMILIES[family], vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=64,
        initializer_range=0.3,
    )
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder, **save)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_folder(tmp_path_factory.mktemp("llama"), "llama")


def source_val_loss(folder) -> float:
    """The folder's own model (transformers' class, no attnres code) on the run's fixed validation batches."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    splits = tokenize_and_split(read_corpus(DATA["data"], DATA["max_bytes"]), ByteTokenizer(), 0.05)
    batches = eval_batches(splits.val, DATA["seq_len"], DATA["batch_size"], DATA["eval_batches"])
    with torch.no_grad():
        return sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in read_log(run_dir, "eval")}


@pytest.mark.parametrize("family, residual", [("llama", "standard"), ("llama", "block"), ("llama", "full"),
                                              ("qwen3", "block")])
def test_step_zero_validation_loss_is_the_source_models(tmp_path, family, residual):
    source = family_folder(tmp_path / "source", family)
    expected = source_val_loss(source)
    assert abs(expected - 5.545) > 0.3  # ln 256: a source that guesses uniformly would hide a wrong conversion
    result = train(continued(tmp_path, source, residual=residual))
    losses = val_losses(result.run_dir)
    assert losses[0] == pytest.approx(expected, rel=1e-6, abs=0)
    assert losses[4] != losses[0]  # and then it trains
    assert result.model.config.residual == residual
    assert result.model.config.base_model_type == family
    has_queries = any(is_attn_res_param(n) for n, _ in result.model.named_parameters())
    assert has_queries == (residual != "standard")


@pytest.mark.parametrize("family, save", [
    ("mixtral", {}),  # per-expert weights under legacy names, fused and renamed by transformers' loading
    ("qwen3, tied", dict(dtype=torch.bfloat16, max_shard_size="20KB")),  # bf16, in several files with an index
])
def test_the_model_is_what_convert_from_hf_gives(tmp_path, family, save):
    """Built on the meta device from the folder's config and loaded through transformers' loading, the run's model is
    `convert_from_hf` of the folder's model: every weight and buffer, the config and the generation settings."""
    source = family_folder(tmp_path / "source", family, **save)
    config = continued(tmp_path, source, residual="full")
    model, _, pretrained = load_init_from(config)
    assert all(p.is_meta for p in model.parameters())
    pretrained.load(model, "cpu", config.seed)
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    expected = convert_from_hf(original, residual="full", attn_res_block_size=config.block_size)
    assert model.config.to_dict() == expected.config.to_dict()
    assert model.generation_config.to_dict() == expected.generation_config.to_dict()
    for mine, theirs in ((model.state_dict(), expected.state_dict()), (dict(model.named_buffers()),
                                                                       dict(expected.named_buffers()))):
        assert mine.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_an_attn_res_moe_folder_loads_as_from_pretrained_does(tmp_path):
    """An AttnRes folder of an MoE family, as `save_pretrained` writes it: per-expert weights under Mixtral's legacy
    names, and the pseudo-queries beside them renamed by the same rule; loaded as `from_pretrained` loads it."""
    from attnres.models import AttnResForCausalLM
    from attnres.training.loop import build_model

    settings = dict(residual="block", block_size=1)
    model = build_model(TrainConfig(layers=2, dim=16, heads=2, ffn=16, base="mixtral", **settings,
                                    base_config=dict(num_local_experts=4, num_experts_per_tok=2)), 256)
    with torch.no_grad():  # trained-looking pseudo-queries and key gains, so that an init would not pass for them
        for name, p in model.named_parameters():
            if is_attn_res_param(name):
                p.normal_()
    folder = tmp_path / "final"
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = continued(tmp_path, folder, **settings)
    loaded, _, pretrained = load_init_from(config)
    pretrained.load(loaded, "cpu", config.seed)
    expected = AttnResForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    got = loaded.state_dict()
    assert got.keys() == expected.keys() == model.state_dict().keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor) and torch.equal(tensor, model.state_dict()[name]), name


@pytest.mark.parametrize("progress", [False, True])
def test_the_loading_bar_shows_only_where_asked_and_the_setting_is_restored(tmp_path, llama, capfd, progress):
    from transformers.utils import logging as hf_logging

    was_shown = hf_logging.is_progress_bar_enabled()  # other tests may have switched the bars off
    hf_logging.enable_progress_bar()
    try:
        model, _, pretrained = load_init_from(continued(tmp_path, llama))
        pretrained.load(model, "cpu", 0, progress=progress)
        assert ("Loading weights" in capfd.readouterr().err) == progress
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was_shown else hf_logging.disable_progress_bar)()


def test_a_folder_without_a_weight_is_refused_naming_it(tmp_path, llama):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "cut"
    shutil.copytree(llama, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        train(continued(tmp_path, folder, name="run-cut"))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="init_from: .* holds no weights transformers can read"):
        train(continued(tmp_path, folder, name="run-none"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny byte-level attnres runs from scratch with their final/: standard, and Block (block size 1)."""
    tmp = tmp_path_factory.mktemp("runs")
    settings = dict(DATA, layers=2, dim=16, heads=2, ffn=32, steps=3, warmup=1, eval_interval=3, log_interval=1,
                    progress=False, threads=1)
    return {residual: train(TrainConfig(**settings, residual=residual, block_size=1, out=str(tmp / residual)))
            for residual in ("standard", "block")}


def test_a_byte_level_runs_final_folder_continues_on_its_own_tokens(tmp_path, runs):
    """A standard run's final/ continues as Block: the byte tokenizer is kept (the same token stream), and the first
    evaluation is the source run's last."""
    source = runs["standard"].run_dir
    result = train(continued(tmp_path, source / "final", residual="block"))
    assert val_losses(result.run_dir)[0] == pytest.approx(runs["standard"].final_val_loss, rel=1e-6, abs=0)
    saved, theirs = (json.loads((d / "config.json").read_text())["data"] for d in (result.run_dir, source))
    assert saved["tokenizer"] == "bytes" and saved["fingerprint"] == theirs["fingerprint"]


def test_an_attn_res_run_continues_with_its_own_schedule_only(tmp_path, runs):
    final = runs["block"].run_dir / "final"
    result = train(continued(tmp_path, final, residual="block", block_size=1))
    assert val_losses(result.run_dir)[0] == pytest.approx(runs["block"].final_val_loss, rel=1e-6, abs=0)
    with pytest.raises(ValueError, match="trained with residual='block'"):
        train(continued(tmp_path, final, name="full", residual="full"))
    with pytest.raises(ValueError, match="attn_res_block_size"):
        train(continued(tmp_path, final, name="b2", residual="block", block_size=2))


def test_freeze_base_trains_the_attn_res_parameters_only(tmp_path, llama):
    result = train(continued(tmp_path, llama, residual="full", freeze_base=True))
    original = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).state_dict()
    moved = []
    for name, p in result.model.named_parameters():
        if is_attn_res_param(name):
            moved.append(not torch.equal(p, torch.zeros_like(p) if name.endswith("_res_proj.weight") else torch.ones_like(p)))
        else:
            assert not p.requires_grad and torch.equal(p.detach(), original[name]), name
    assert sum(moved) > len(moved) // 2  # every point's parameters but layer 0's attention side get gradients
    assert val_losses(result.run_dir)[4] < val_losses(result.run_dir)[0]


def test_a_continued_run_resumes_bit_identical_and_saves_its_final_folder(tmp_path, llama, monkeypatch):
    whole = train(continued(tmp_path, llama, name="whole"))
    train(continued(tmp_path, llama, name="stopped", stop_after=2, checkpoint_interval=2))
    with monkeypatch.context() as patch:  # a resumed run takes its weights from its checkpoint alone
        patch.setattr(Pretrained, "load", lambda *args, **kwargs: pytest.fail("the folder was read on resume"))
        resumed = train(continued(tmp_path, llama, name="stopped", resume=True, checkpoint_interval=2))
    for (name, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="train.init_from"):  # the source is part of what the run is
        train(continued(tmp_path, tmp_path / "whole" / "final", name="stopped", resume=True, checkpoint_interval=2))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "final").eval()
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, whole.model.eval()(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (dict(layers=3), "layers: the model and its tokenizer come from init_from"),
    (dict(dim=32, base="qwen3"), "base, dim: the model"),
    (dict(tokenizer="gpt2"), "tokenizer: the model"),
    (dict(residual="standard", freeze_base=True), "freeze_base: expected residual 'block' or 'full'"),
    (dict(init_from=None, freeze_base=True), "freeze_base: expected init_from too"),
])
def test_settings_that_conflict_with_the_folder_are_refused(tmp_path, llama, overrides, message):
    with pytest.raises(ValueError, match=message):
        continued(tmp_path, llama, **overrides)


def test_a_missing_folder_or_a_second_model_is_refused(tmp_path, llama):
    with pytest.raises(ValueError, match="init_from: .* is not a transformers model folder"):
        train(continued(tmp_path, tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="init_from: .*holds no tokenizer"):
        no_tokenizer = tmp_path / "bare"
        AutoModelForCausalLM.from_pretrained(llama).save_pretrained(no_tokenizer)
        train(continued(tmp_path, no_tokenizer))
    with pytest.raises(ValueError, match="give either a model or init_from"):
        train(continued(tmp_path, llama), model=AutoModelForCausalLM.from_pretrained(llama))


def test_cli_continues_a_folder_and_refuses_architecture_flags(tmp_path, llama, capsys):
    out = tmp_path / "cli"
    args = ["train", "--init-from", str(llama), "--residual", "block", "--block-size", "2", "--freeze-base",
            "--max-bytes", "30000", "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--eval-batches", "1",
            "--out", str(out), "--threads", "1", "--no-progress"]
    assert main(args) == 0
    assert f"{out}: 2 steps, val loss" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())["train"]
    assert saved["init_from"] == str(llama) and saved["freeze_base"] is True
    assert main(args + ["--overwrite", "--layers", "8"]) == 2
    assert "layers: the model and its tokenizer come from init_from" in capsys.readouterr().err
