"""A Full model's training forward in phase-1 groups (`attn_res_full_group`, docs/design.md section 4): on the CPU
backend the model chooses them by itself, its decoder layers hand the group's statistics on in their
`ResidualState`, and the loss and every gradient are those of the functional points up to rounding (another order of
the same sums); activation checkpointing replays them bit for bit (tests/models/test_checkpointing.py)."""

from __future__ import annotations

import pytest
import torch

from attnres.layers.residuals import FULL_GROUP
from attnres.models import AttnResConfig, wiring
from attnres.ops import registry
from tests.models import TINY
from tests.models.test_checkpointing import make_model, training_step
from tests.models.test_chain import assert_steps_agree


def handed_on(model) -> list[tuple[int, int] | None]:
    """The group (first point, point after the last) whose statistics each decoder layer hands on, in one forward."""
    seen = []
    hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(getattr(out, "stats", None) and out.stats[:2]))
             for layer in model.model.layers]
    try:
        model(input_ids=torch.arange(8)[None] % 64)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_the_cpu_backend_chooses_groups_and_the_portable_one_the_chain(monkeypatch):
    model = make_model(residual="full", attn_res_full_group=None, num_hidden_layers=6)  # groups [0, 8) and [8, 13)
    assert FULL_GROUP == 8
    # layer i's last point is 2i + 1: the group it belongs to goes on unless that point ends it
    assert handed_on(model) == [(0, 8), (0, 8), (0, 8), None, (8, 13), (8, 13)]
    monkeypatch.setenv(registry.BACKEND_ENV, "torch")
    assert handed_on(model) == [None] * 6
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    with torch.no_grad():
        assert handed_on(model) == [None] * 6  # no backward: the inference backend


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_model_chooses_the_chain_and_keeps_a_set_group(use_reentrant):
    """Activation checkpointing keeps each layer's input only: a group's `[tokens, d]` fp32 statistics per point would
    be most of what it keeps (tests/models/test_layer_contract.py counts the bytes)."""
    chosen = make_model(residual="full", attn_res_full_group=None)
    chosen.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    assert handed_on(chosen) == [None] * 3
    pinned = make_model(residual="full", attn_res_full_group=3)
    pinned.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    assert handed_on(pinned) == [(0, 3), (3, 6), None]


def test_a_set_group_is_taken_and_zero_runs_the_chain():
    assert handed_on(make_model(residual="full", attn_res_full_group=3)) == [(0, 3), (3, 6), None]
    assert handed_on(make_model(residual="full", attn_res_full_group=0)) == [None] * 3


@pytest.mark.parametrize("group", [None, 3])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_grouped_training_gives_the_functional_loss_and_gradients(family, group):
    model = make_model(family, "full", attn_res_full_group=group)
    with wiring.unchained_points():
        want = training_step(model)
    assert_steps_agree(training_step(model), want, exact=False, same_forward=False)  # phase 1 sums in another order


@pytest.mark.parametrize("group", [-1, 2.5, True, "8"])
def test_a_bad_group_is_named(group):
    with pytest.raises(ValueError, match="attn_res_full_group"):
        AttnResConfig(**TINY, residual="full", attn_res_full_group=group)
