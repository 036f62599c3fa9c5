"""The layer contract (docs/design.md section 7): a decoder layer takes the residual state and returns the new one.

- a loop over the layers by hand, with the arguments the family hands them, is the model's forward;
- `hidden_states` reports what each layer reads (the mixture before its PreNorm), equal to the original model's
  hidden states for a zero-query converted model, in a forward and in `generate`;
- whole layers are what activation checkpointing recomputes: transformers' switch and torch's `checkpoint_wrapper`
  give the gradients of the plain step, and a checkpointed step keeps about what transformers' own Llama keeps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from transformers import LlamaConfig, LlamaForCausalLM

import attnres
from attnres.layers.bank import BankState
from attnres.layers.residuals import ResidualState
from attnres.models import AttnResConfig, AttnResForCausalLM
from tests.models import TINY, off_init_
from tests.models.test_checkpointing import assert_same_step, saved_bytes, training_step

IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
RESIDUALS = {
    "standard": dict(residual="standard"),
    "full": dict(residual="full"),
    "block": dict(residual="block", attn_res_block_size=2),
}
# a layer run by itself reads each point over all its sources: the model's forward too, to compare bit for bit
UNGROUPED = dict(attn_res_full_group=0)


def make_model(residual: str, **fields) -> AttnResForCausalLM:
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(**{**TINY, "num_hidden_layers": 4, **RESIDUALS[residual], **fields}))
    off_init_(model, seed=1)
    return model.eval()


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "bank"])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_a_loop_over_the_layers_is_the_models_forward(residual, grad):
    model = make_model(residual, **UNGROUPED)
    with torch.set_grad_enabled(grad):
        want = model(IDS).logits
        inputs = model.layer_inputs(input_ids=IDS)
        state = inputs[0][0]
        assert torch.equal(state, model.model.embed_tokens(IDS))
        for layer, (_, kwargs) in zip(model.model.layers, inputs):
            state = layer(state, **kwargs)
            assert type(state) is (BankState if residual == "block" and not grad else ResidualState)
        got = model.lm_head(model.model.norm(model.final_read(state)))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_layer_refuses_what_is_not_its_state():
    model = make_model("block")
    inputs = model.layer_inputs(input_ids=IDS)
    with pytest.raises(TypeError, match="decoder layer 1 takes the ResidualState that layer 0 returns"):
        model.model.layers[1](inputs[0][0], **inputs[1][1])


@pytest.mark.parametrize("residual", ["block", "full", "standard"])
def test_hidden_states_of_a_zero_query_conversion_are_the_originals(residual):
    torch.manual_seed(0)
    original = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 4, "initializer_range": 0.2})).eval()
    converted = attnres.convert_from_hf(original, residual, attn_res_block_size=2)
    with torch.no_grad():
        want = original(IDS, output_hidden_states=True).hidden_states
        got = converted(IDS, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 5
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"hidden state {i}: {m}")
    with torch.no_grad():  # selected entries, as transformers takes them
        some = converted(IDS, output_hidden_states=[0, -1]).hidden_states
    assert some[1] is None and torch.equal(some[0], got[0])
    torch.testing.assert_close(some[-1], got[-1])  # the other reads fused their PreNorm: fp32 rounding apart


@pytest.mark.parametrize("residual", ["block", "full"])
def test_hidden_states_are_what_each_layer_reads(residual):
    """Entry l is the attention-side mixture of layer l: the drafter capture of layer l - 1 and the depth mixture of
    point 2 l; the last entry is the final norm's output."""
    model = make_model(residual)
    with torch.no_grad():
        out = model(IDS, output_hidden_states=True, output_depth_weights=True, capture_layers=[0, 1, 2, 3])
        plain = model(IDS)
    L = model.config.num_hidden_layers
    for layer in range(1, L):
        assert torch.equal(out.hidden_states[layer], out.captured_hidden_states[layer - 1])
        torch.testing.assert_close(out.hidden_states[layer], out.depth_mixtures[2 * layer])
    assert torch.equal(out.hidden_states[0], model.model.embed_tokens(IDS))
    assert torch.equal(out.hidden_states[L], model.model.norm(out.captured_hidden_states[L - 1]))
    torch.testing.assert_close(out.logits, plain.logits)


def test_hidden_states_in_generate():
    model = make_model("block")
    out = model.generate(IDS, max_new_tokens=3, do_sample=False, output_hidden_states=True,
                         return_dict_in_generate=True)
    assert len(out.hidden_states) == 3
    prefill, step = out.hidden_states[0], out.hidden_states[1]
    assert len(prefill) == len(step) == 5
    assert prefill[2].shape == (2, 9, TINY["hidden_size"]) and step[2].shape == (2, 1, TINY["hidden_size"])
    with torch.no_grad():
        again = model(out.sequences[:, :10], output_hidden_states=True).hidden_states
    torch.testing.assert_close(step[2][:, 0], again[2][:, 9], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_torch_checkpoint_wrapper_on_whole_layers_gives_the_plain_gradients(residual):
    """torchtitan's way: `checkpoint_wrapper` around each decoder layer (non-reentrant)."""
    model = make_model(residual).train()
    want = training_step(model)
    wrapped = copy.deepcopy(model)
    for i, layer in enumerate(wrapped.model.layers):
        wrapped.model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    got = training_step(wrapped)
    loss, grads = got
    grads = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in grads.items()}
    assert_same_step((loss, grads), want)


# Aims, measured against transformers' own LlamaForCausalLM with its checkpointing at the same size: the standard
# residual keeps what transformers keeps, Block also its block summaries, Full every sublayer output
AIMS = {"standard": 1.1, "block": 1.6, "full": 2.2}
SIZE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
            vocab_size=128, max_position_embeddings=512)


@pytest.fixture(scope="module")
def llama_checkpointed_bytes() -> int:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SIZE)).train()
    llama.activation_checkpointing_enable()
    return saved_bytes(llama, _long_ids())


def _long_ids() -> torch.Tensor:
    return torch.randint(0, SIZE["vocab_size"], (1, 512), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("residual", RESIDUALS)
def test_checkpointed_step_keeps_about_what_transformers_llama_keeps(residual, llama_checkpointed_bytes):
    """Bytes saved for backward, a deterministic count (benchmarks/activation_memory.py gives the table)."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(**SIZE, **RESIDUALS[residual])).train()
    model.activation_checkpointing_enable()
    ratio = saved_bytes(model, _long_ids()) / llama_checkpointed_bytes
    assert ratio <= AIMS[residual], ratio


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_a_checkpointed_step_that_records_replays_the_same_reads(residual, use_reentrant):
    """Hidden states and depth weights read the mixtures unfused; the recompute in backward must read them the same
    way (else torch's checkpoint finds other saved tensors), and everything equals the step without checkpointing."""
    model = make_model(residual).train()

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=IDS, labels=IDS, output_hidden_states=True, output_depth_weights=True)
        out.loss.backward()
        return out, {name: p.grad for name, p in model.named_parameters()}

    want, want_grads = step()
    model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
    got, grads = step()
    assert_same_step((got.loss.detach(), grads), (want.loss.detach(), want_grads))
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert torch.equal(g, w)
    for g, w in zip(got.depth_mixtures, want.depth_mixtures, strict=True):
        assert torch.equal(g, w)
