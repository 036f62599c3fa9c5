"""The model under `torch.compile`: the family's modules and the AttnRes wiring give
the same outputs and gradients as eager (training path, and the no-grad Block bank path)."""

import pytest
import torch

from attnres.models import AttnResForCausalLM
from attnres.ops import registry


@pytest.mark.parametrize("residual", ["block"])
def test_fullgraph_compile_matches_eager(tiny_config, residual, monkeypatch):
    """With the backend not yet selected in this process: the stream's two-phase decision asks for it while traced
    (a constant to dynamo: the first selection probes, and may build, the CPU kernel, which dynamo cannot trace)."""
    for cached in (registry.device_backend, registry._backend, registry._kernel):
        cached.cache_clear()
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(residual=residual, attn_res_block_size=2))
    with torch.no_grad():
        for point in model.aggregation_points():
            point.proj.weight.normal_(0.0, 0.3)
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    eager = model(ids, labels=ids)
    eager.loss.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = compiled(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, eager.logits)
    for name, p in model.named_parameters():
        if name in want:
            torch.testing.assert_close(p.grad, want[name], msg=name)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
