"""`torch.compile` with its default backend, inductor (C++ codegen on CPU), where the fake (meta) kernels' strides must
agree with what the real kernels return: the operator on non-contiguous sources, the Block bank path (no grad) and a
full training step with `fullgraph=True`, each against eager.

Inductor compiles slowly (C++ through gcc), so the models are one or two decoder layers and the tests are three:
about 30 s together on two idle cores.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from attnres import depth_attention
from attnres.models import AttnResForCausalLM
from tests import TOL, assert_all_close, leaves
from tests.models import off_init_


@pytest.fixture(autouse=True)
def fresh_compile():
    """Each test lowers its graphs afresh: no graph of another test, and no stored graph of an earlier run, whose
    cache key does not cover our custom ops' fake kernels (the compiled C++ stays cached by its source)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield


class Inductor(CompileCounterWithBackend):
    """The default backend, keeping the graphs dynamo hands it, so a test can see which of our ops it traced."""

    def __init__(self):
        super().__init__("inductor")

    def ops(self) -> set[str]:
        """Our ops in the graphs, those inside an autograd Function's subgraphs (`depth_attention`'s) included."""
        modules = [m for graph in self.graphs for m in graph.modules() if isinstance(m, torch.fx.GraphModule)]
        return {str(node.target) for m in modules for node in m.graph.nodes if "attnres" in str(node.target)}


def compiled(fn, backend: Inductor | None = None):
    return torch.compile(fn, fullgraph=True, backend=backend or "inductor")


def test_operator_on_non_contiguous_sources():
    """Sources that are transposed `[T, B, d]` views and a bank row (token stride 3 d): the result is contiguous in
    eager and compiled alike, and outputs and every gradient agree."""
    d = 16
    base = torch.randn(5, 2, d)
    bank = torch.randn(2, 5, 3, d)
    w, g, o = torch.randn(d) / 2, torch.rand(d) + 0.5, torch.rand(d) + 0.5

    def step(x0, x1, b, w, g, o):
        sources = [x0.transpose(0, 1), x1.transpose(0, 1) * 2, b[:, :, 1]]
        out = depth_attention(sources, w, g, out_norm_weight=o)
        return out, (out.float().sin() * torch.arange(d)).sum()

    runs = []
    for fn in (step, compiled(step)):
        inputs = leaves(base, base.flip(0), bank, w, g, o)
        out, loss = fn(*inputs)
        assert out.is_contiguous()
        runs.append([out, *torch.autograd.grad(loss, inputs)])
    names = ["out", "source 0", "source 1", "bank", "query", "key gain", "out gain"]
    assert_all_close(names, runs[0], runs[1], TOL[torch.float32])


def test_block_bank_path_without_grad(tiny_config):
    """The fused bank ops (one-shot aggregation and phase-2 merges of phase 1 in groups) under inductor."""
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=2, residual="block", attn_res_block_size=2, attn_res_two_phase=True)
    model = AttnResForCausalLM(config)
    off_init_(model)
    ids = torch.randint(0, 64, (2, 8))
    backend = Inductor()
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        out = compiled(lambda ids: model(ids, use_cache=False).logits, backend)(ids)
    bank_ops = {"attnres.bank_aggregate.default", "attnres.depth_stats_fwd.default", "attnres.bank_merge.default"}
    assert backend.ops() == bank_ops, backend.ops()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_training_step_fullgraph(tiny_config):
    """Forward and loss in one graph, backward through AOTAutograd: the two-phase path (phase 1, then phase 2 whose
    backward recomputes its statistics), every gradient against eager."""
    torch.manual_seed(0)
    # layer 1 resumes inside the block: phase 1 scores its two points over the bank (layer 0's are one-shot)
    config = tiny_config(num_hidden_layers=2, residual="block", attn_res_block_size=2, attn_res_two_phase=True)
    model = AttnResForCausalLM(config)
    off_init_(model)
    ids = torch.randint(0, 64, (2, 8))
    runs, backend = [], Inductor()
    for fn in (lambda ids: model(ids, labels=ids).loss, compiled(lambda ids: model(ids, labels=ids).loss, backend)):
        model.zero_grad()
        loss = fn(ids)
        loss.backward()
        runs.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
    two_phase = {"attnres.depth_stats_fwd.default", "attnres.merge_prefix_fwd.default"}
    # depth_attention's Function: dynamo traces its forward and its backward (custom ops both)
    one_shot = {"attnres.depth_attention_fwd.default", "attnres.depth_attention_bwd.default"}
    assert backend.ops() == one_shot | two_phase, backend.ops()
    # torch.testing's fp32 bounds (absolute 1e-5): layer 0's attention point has one source, so its query's and key
    # gain's gradients are zero up to rounding noise, which no relative bound can compare
    for name, ref, out in zip(["loss", *(name for name, _ in model.named_parameters())], *runs):
        torch.testing.assert_close(out, ref, msg=lambda m: f"{name}: {m}")
