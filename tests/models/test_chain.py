"""A Full or Block model's training forward chains its aggregation points (`attnres.ops.chain`): the decoder layers
hand the chain's carrier on in their `ResidualState`, and the loss and every gradient are those of the functional
points.

The functional run is the same model with the chain switched off (`wiring.unchained_points()`). The Full models take
no phase-1 groups (`attn_res_full_group=0`), which the CPU backend would otherwise choose in their place
(tests/models/test_full_groups.py); the Block models no two-phase reads, which end a chain.
With the torch kernels both sum each source's gradient in autograd's order, so they agree bit for bit; the CPU kernel
may fuse its add differently (fp32 rounding).
"""

from __future__ import annotations

import pytest
import torch

from attnres.models import wiring
from attnres.ops import registry
from tests.models.test_checkpointing import REENTRANT, make_model, training_step

BACKENDS = ["torch", "auto"]


@pytest.fixture
def functional_points():
    """Returns a context in which the model's Full points run unchained."""
    return wiring.unchained_points


def assert_steps_agree(got, want, exact: bool, same_forward: bool = True) -> None:
    """Gradients equal (`exact`) or within fp32 rounding on the scale of each one's largest entry; the loss equal where
    both ran the same forward ops (`same_forward`), else within fp32 rounding too."""
    (loss, grads), (want_loss, want_grads) = got, want
    if same_forward:
        assert torch.equal(loss, want_loss)
    else:
        torch.testing.assert_close(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, want_grad in want_grads.items():
        assert (grads[name] is None) == (want_grad is None), name
        if want_grad is None:
            continue
        if exact:
            assert torch.equal(grads[name], want_grad), name
        else:
            torch.testing.assert_close(grads[name], want_grad, rtol=1e-5, atol=1e-5 * want_grad.abs().max().item(),
                                       msg=lambda m: f"{name}: {m}")


def carriers(model, **forward) -> list[torch.Tensor | None]:
    """The carrier each decoder layer hands on, in one forward (None where it hands on an inference state)."""
    seen = []
    hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(getattr(out, "carrier", None)))
             for layer in model.model.layers]
    try:
        model(input_ids=torch.arange(8)[None] % 64, **forward)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


BLOCK_SIZE = 2
CHAINS = {"full": dict(residual="full", attn_res_full_group=0),
          "block": dict(residual="block", attn_res_block_size=BLOCK_SIZE, attn_res_two_phase=False)}


@pytest.mark.parametrize("kind", CHAINS)
def test_a_training_forward_hands_the_carrier_from_layer_to_layer(kind):
    model = make_model(**CHAINS[kind])
    made = carriers(model)
    L = model.config.num_hidden_layers
    # Full: layer i's last point (its MLP side) reads the embedding and 2i + 1 outputs, and carries them all;
    # Block: it carries the bank rows (the embedding's, then one per completed block), not its prefix
    covered = [2 * i + 2 for i in range(L)] if kind == "full" else [i // BLOCK_SIZE + 1 for i in range(L)]
    assert [None if c is None else c.shape[0] for c in made] == covered
    assert all(c.stride()[0] == 0 and c.requires_grad for c in made)  # placeholders: their gradients carry the sums
    with torch.no_grad():
        assert carriers(model) == [None] * L  # no backward, no chain


@pytest.mark.parametrize("kind", CHAINS)
def test_the_switch_turns_the_chain_off(kind):
    model = make_model(**CHAINS[kind])
    with wiring.unchained_points():
        assert carriers(model) == [None] * model.config.num_hidden_layers
    assert carriers(model) != [None] * model.config.num_hidden_layers  # and only within it


@pytest.mark.parametrize("kind", CHAINS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_chained_training_gives_the_functional_loss_and_gradients(family, backend, kind, functional_points,
                                                                  monkeypatch):
    monkeypatch.setenv(registry.BACKEND_ENV, backend)
    model = make_model(family, **CHAINS[kind])
    with functional_points():
        want = training_step(model)
    assert_steps_agree(training_step(model), want, exact=backend == "torch")


@pytest.mark.parametrize("kind", CHAINS)
@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_checkpointed_chains_give_the_functional_gradients(use_reentrant, kind, functional_points, monkeypatch):
    """Reentrant checkpointing runs the layers without gradients and replays them with: both make the same carriers."""
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    model = make_model("llama", **CHAINS[kind])
    with functional_points():
        want = training_step(model)
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    assert_steps_agree(training_step(model), want, exact=True)



@pytest.mark.parametrize("kind", CHAINS)
def test_a_layer_run_alone_chains_unless_told_not_to(kind):
    """A layer run alone (a pipeline stage) chains its points in training; with `chained = False` (a zero-bubble stage,
    whose weight pass runs parts of the backward again, where a chained point would add into its gradient buffer once
    more) they run point by point."""
    model = make_model(**CHAINS[kind])
    hidden, kwargs = model.layer_inputs(input_ids=torch.arange(8)[None] % 64)[0]
    layer = model.model.layers[0]
    assert layer(hidden, **kwargs).carrier is not None
    layer.chained = False
    assert layer(hidden, **kwargs).carrier is None
