"""Depth profiles of tiny models, and the comparison report (train, tabulate, plot, redraw)."""

import json

import pytest
import torch

from attnres.analysis import depth_profile, depth_weight_matrix
from attnres.analysis.report import SUMMARY, compare, draw, format_table
from attnres.cli import main
from attnres.models import AttnResConfig, AttnResForCausalLM
from attnres.training import TrainConfig

L = 3


def _model(residual, **overrides):
    torch.manual_seed(0)
    cfg = AttnResConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=L,
                        num_attention_heads=4, max_position_embeddings=32, residual=residual, attn_res_block_size=2,
                        **overrides)
    model = AttnResForCausalLM(cfg)
    with torch.no_grad():  # nonzero queries, so the weights are not uniform
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_()
    return model


@pytest.mark.parametrize("residual,sources", [("full", [1, 2, 3, 4, 5, 6, 7]), ("block", [1, 2, 2, 2, 2, 3, 3])])
def test_profile_counts_sources_and_weights_sum_to_one(residual, sources):
    model = _model(residual)
    ids = torch.randint(0, 64, (2, 8))
    prof = depth_profile(model, ids)
    # Full: l + 1 sources; Block (S=2): docs/design.md section 3 nvb + 1
    assert [w.numel() for w in prof.weights] == sources
    for w in prof.weights:
        assert torch.all(w > 0) and torch.allclose(w.sum(), torch.tensor(1.0), atol=1e-5)
    assert prof.mixture_rms.shape == (2 * L + 1,) and prof.output_rms.shape == (2 * L,)
    assert prof.grad_norms.shape == (2 * L,) and torch.all(prof.grad_norms > 0)
    assert all(p.grad is None for p in model.parameters())  # the profile leaves .grad alone
    mat = depth_weight_matrix(prof.weights)
    assert mat.shape == (2 * L + 1, max(sources)) and torch.isnan(mat[0, 1:]).all()


def test_profile_magnitudes_match_a_hand_computation():
    model = _model("standard")
    ids = torch.randint(0, 64, (2, 8))
    prof = depth_profile(model, ids)
    emb = model.model.embed_tokens(ids)
    assert prof.weights == []
    assert torch.allclose(prof.mixture_rms[0], emb.pow(2).mean().sqrt(), rtol=1e-5)  # the first read is the embedding
    with torch.no_grad():
        out = model(input_ids=ids, output_depth_weights=True)
    # the standard residual at point k is the embedding plus every output before it
    h = out.depth_mixtures
    assert torch.allclose(prof.mixture_rms[-1], h[-1].pow(2).mean().sqrt(), rtol=1e-5)
    steps = torch.stack([(h[k + 1] - h[k]).pow(2).mean().sqrt() for k in range(2 * L)])
    assert torch.allclose(prof.output_rms, steps, rtol=1e-4)


def test_compare_writes_table_and_pictures_and_plot_redraws(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    base = TrainConfig(data=str(corpus), max_bytes=20_000, layers=2, dim=16, heads=2, ffn=32, seq_len=16,
                       batch_size=2, steps=4, warmup=1, eval_interval=2, eval_batches=1, log_interval=1,
                       checkpoint_interval=100, progress=False, threads=1)
    out = tmp_path / "cmp"
    summary = compare(base, ["standard", "block"], out)
    assert set(summary["runs"]) == {"standard", "block"}
    assert json.loads((out / SUMMARY).read_text()) == summary
    pictures = {"loss.png", "layers.png", "depth_weights_block.png"}
    assert pictures <= {p.name for p in out.iterdir()}
    assert not (out / "depth_weights_standard.png").exists()  # the baseline has no depth weights
    table = format_table(summary)
    assert "| standard |" in table and "| block |" in table
    for name in pictures:
        (out / name).unlink()
    assert {p.name for p in draw(out)} == pictures
    assert main(["plot", "--out", str(out)]) == 0


def test_plot_of_a_folder_without_summary_fails_clearly(tmp_path, capsys):
    assert main(["plot", "--out", str(tmp_path)]) == 2
    assert "attnres compare" in capsys.readouterr().err
