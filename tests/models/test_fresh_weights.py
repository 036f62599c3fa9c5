"""No forward may serve weights older than the model's (docs/design.md section 11).

Updates that change a weight without bumping its version counter (fused optimizers, `.data` writes) or that move it
to new storage (a dtype round trip, `vector_to_parameters`) can leave a cached folded query `g * w` stale on the
no-grad path of Block models. After each update, the no-grad forward must equal the grad-enabled forward and a copy
reloaded from disk. Each case first runs a no-grad forward on the old weights, so that any cache is populated.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from attnres.models import AttnResForCausalLM

# the no-grad and grad paths and a reloaded copy differ only by fp32 rounding
TOL = dict(rtol=1e-5, atol=1e-5)

RESIDUALS = {
    "full": dict(residual="full"),
    "block": dict(residual="block", attn_res_block_size=1),
    "block-two-phase": dict(residual="block", attn_res_block_size=2, attn_res_two_phase=True),
}


def _res_params(model):
    return [p for name, p in model.named_parameters() if "_res_" in name]


def _nonzero_queries(model, seed):
    """Queries away from zero and key gains away from one: a zero query hides a stale one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("_res_norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))


def _adamw_steps(model, ids, **kind):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, **kind)
    for _ in range(2):
        model(ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()


def _data_copy(model, ids):
    gen = torch.Generator().manual_seed(7)
    for p in _res_params(model):
        p.data.copy_(p.data + torch.randn(p.shape, generator=gen))


def _load_state_dict(model, ids):
    other = AttnResForCausalLM(model.config)
    _nonzero_queries(other, seed=11)
    model.load_state_dict(other.state_dict())


def _vector_to_parameters(model, ids):
    """New AttnRes weights, every parameter written back from one flat vector (new storage, no version bump)."""
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        res = {id(p) for p in _res_params(model)}
        new = [p + torch.randn(p.shape, generator=gen) if id(p) in res else p for p in model.parameters()]
        vector_to_parameters(parameters_to_vector(new), model.parameters())


def _float64_round_trip(model, ids):
    model.to(torch.float64)
    with torch.no_grad():
        model(ids, use_cache=False)  # a forward in fp64 too, then new weights there
        for p in _res_params(model):
            p.data.mul_(-1.5)
    model.to(torch.float32)


UPDATES = {
    "fused-adamw": lambda model, ids: _adamw_steps(model, ids, fused=True),
    "foreach-adamw": lambda model, ids: _adamw_steps(model, ids, foreach=True),
    "data-copy": _data_copy,
    "load-state-dict": _load_state_dict,
    "vector-to-parameters": _vector_to_parameters,
    "float64-round-trip": _float64_round_trip,
}


@pytest.mark.parametrize("update", list(UPDATES), ids=list(UPDATES))
@pytest.mark.parametrize("residual", list(RESIDUALS), ids=list(RESIDUALS))
def test_no_grad_forward_sees_updated_weights(tiny_config, tmp_path, residual, update):
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=4, num_key_value_heads=4, **RESIDUALS[residual])
    model = AttnResForCausalLM(config).eval()
    _nonzero_queries(model, seed=1)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        old = model(ids, use_cache=False).logits  # the old weights: any cache is now populated

    UPDATES[update](model, ids)

    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    reference = model(ids, use_cache=False).logits.detach()
    model.save_pretrained(tmp_path)
    reloaded = AttnResForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        fresh = reloaded(ids, use_cache=False).logits
    assert not torch.allclose(reference, old, **TOL), "the update should change the model's output"
    torch.testing.assert_close(logits, reference, **TOL)
    torch.testing.assert_close(logits, fresh, **TOL)
