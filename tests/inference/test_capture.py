"""Drafter capture (docs/design.md section 5): the hidden state after decoder layer i is the pre-norm mixture the next
aggregation point forms, checked against its definition with the naive op over the schedule's sources."""

import pytest
import torch

from attnres import naive_depth_attention
from attnres.models import AttnResForCausalLM
from attnres.models.naive import schedule_sources
from tests.models.test_invariants import random_attnres_model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def sublayer_outputs(model) -> list[torch.Tensor]:
    """Hooks that record every sublayer output of the next forward, in schedule order (not cloned: the bank stream
    keeps its running prefix in a buffer of its own and never adds into a sublayer's output)."""
    outputs = []

    def keep(module, args, out):  # the family's attention returns (output, weights)
        outputs.append((out[0] if isinstance(out, tuple) else out).detach())

    for layer in model.model.layers:
        for sublayer in (layer.self_attn, layer.mlp):
            sublayer.register_forward_hook(keep)
    return outputs


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "bank"])
@pytest.mark.parametrize(
    "residual, block_size, rescale",
    [("block", 2, False), ("block", 2, True), ("block", 3, False), ("full", 1, True), ("standard", 1, False)],
    ids=lambda v: str(v),
)
def test_capture_is_the_mixture_the_next_point_forms(tiny_config, residual, block_size, rescale, grad):
    L = 5
    config = tiny_config(
        num_hidden_layers=L, residual=residual, attn_res_block_size=block_size, attn_res_rescale_mixture=rescale
    )
    model = random_attnres_model(config)
    points = model.aggregation_points()
    ids = torch.randint(0, 64, (2, 6))
    outputs = sublayer_outputs(model)
    capture = [4, 0, 2, 1]
    with torch.set_grad_enabled(grad):
        out = model(ids, capture_layers=capture)
    v = [model.model.embed_tokens(ids).detach()] + outputs
    assert len(out.captured_hidden_states) == len(capture)
    for i, captured in zip(capture, out.captured_hidden_states):
        j = 2 * (i + 1)  # the point after layer i: layer i + 1's attention side, or the final read
        if residual == "standard":
            expected = sum(v[: j + 1])  # the residual sum, the usual capture
        else:
            sources = schedule_sources(v, j, residual, block_size)
            point = points[j]
            expected = naive_depth_attention(sources, point.proj.weight, point.norm.weight, eps=point.eps)
            expected = expected * len(sources) if rescale else expected  # what the next PreNorm sees
        assert captured.shape == (2, 6, 32)
        assert rel_err(captured.detach(), expected.detach()) < 1e-5, i
        if residual == "block" and (i + 1) % block_size:
            prefix = sum(v[1 + (i + 1) // block_size * 2 * block_size : j + 1])  # the current block's partial sum
            assert rel_err(captured.detach(), prefix) > 0.1  # the drafter is not fed the prefix
    with torch.no_grad():
        plain = model(ids)
    assert plain.captured_hidden_states is None
    assert rel_err(out.logits.detach(), plain.logits) < 1e-5  # capturing does not change the model's output


@pytest.mark.parametrize("bad", [[3], [-1], [0, 0], ["1"], [True]], ids=str)
def test_capture_layers_must_be_distinct_layer_indices(tiny_config, bad):
    model = AttnResForCausalLM(tiny_config())
    with pytest.raises(ValueError, match=r"capture_layers: expected distinct decoder layer indices in \[0, 2\]"):
        model(torch.zeros(1, 3, dtype=torch.long), capture_layers=bad)
