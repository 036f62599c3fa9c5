"""FSDP2 per whole decoder layer (`apply_fsdp`) on 2 gloo ranks: a layer's full parameters exist only while it runs,
forward and backward, and the loss and every gradient equal the one-process model's (the training curve is compared in
test_data_parallel.py). A layer hands on the rows it does not change, and that later layers track, as views of its
own (Block's bank rows; a Full chain's later points track only their newest source and the carrier); without them FSDP2
would gather a layer again when the backward reaches the layer that wrote those rows, and the checks below fail."""

import pytest
import torch

from tests.distributed.workers import run_ranks

LAYERS, DIM, VOCAB, BATCH, SEQ = 4, 16, 64, 4, 8


def build_model(residual: str, activation_checkpointing: bool, tied: bool = False):
    """Random pseudo-queries and key gains (zero queries cannot see a wrong schedule); two-phase reads for Block, so
    a block's first layer scores the queries of its later layers."""
    from attnres.models import AttnResConfig, AttnResForCausalLM

    torch.manual_seed(0)
    config = AttnResConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=LAYERS, num_attention_heads=2,
        max_position_embeddings=SEQ, residual=residual, attn_res_block_size=2, attn_res_two_phase=True,
        tie_word_embeddings=tied,
    )
    model = AttnResForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "res_proj" in name:
                p.normal_(0, 0.5)
            elif "res_norm" in name:
                p.uniform_(0.5, 1.5)
    if activation_checkpointing:
        model.activation_checkpointing_enable()
    return model.train()


# (residual, activation checkpointing, tied embeddings: the embedding and the head then stay in the root group)
CASES = [(residual, ac, False) for residual in ("block", "full", "standard") for ac in (False, True)]
CASES.append(("block", False, True))
IDS = [f"{r}-{'ac' if a else 'noac'}" + ("-tied" if t else "") for r, a, t in CASES]


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


class FullParams:
    """Watches the full (gathered) parameters of every decoder layer's group, as its sublayer bodies see them: FSDP
    registers them on the modules while the group is gathered; kept here by reference, their storage is empty once
    FSDP frees them."""

    def __init__(self, model):
        self.bodies = [[getattr(layer, side.body) for side in layer.sides] for layer in model.model.layers]
        self.seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(self.bodies))}
        self.forward, self.recompute, self.backward = [], [], []  # (layer, layers whose full parameters exist then)
        self.in_backward = False
        for i, bodies in enumerate(self.bodies):
            for body in bodies:
                body.register_forward_pre_hook(
                    lambda m, args, i=i: self._at("recompute" if self.in_backward else "forward", i))
                body.register_forward_hook(lambda m, args, out, i=i: self._hook_backward(out, i))

    def alive(self) -> list[int]:
        """Decoder layers whose full parameters hold memory now."""
        return [i for i, params in self.seen.items() if any(p.untyped_storage().nbytes() for p in params)]

    def _at(self, phase: str, layer: int) -> None:
        from torch.distributed.tensor import DTensor

        for body in self.bodies[layer]:
            for p in body.parameters():
                if not isinstance(p, DTensor):
                    self.seen[layer].append(p)
        getattr(self, phase).append((layer, self.alive()))

    def _hook_backward(self, out, layer: int) -> None:
        out = out[0] if isinstance(out, tuple) else out
        if out.requires_grad:  # as the body's backward begins: after every hook on its output, FSDP's that gathers
            out.grad_fn.register_prehook(lambda grads: self.backward.append((layer, self.alive())))


def shard_and_compare(rank: int) -> dict:
    """Per case of `CASES`: when each layer's full parameters existed, and the largest difference of the loss and of
    any gradient from the one-process model on the same batch."""
    from torch.distributed.tensor import DTensor

    from attnres.distributed import apply_fsdp

    out = {}
    ids = batch()
    for residual, ac, tied in CASES:
        reference = build_model(residual, ac, tied)
        want_loss = reference(input_ids=ids, labels=ids).loss
        want_loss.backward()
        model = apply_fsdp(build_model(residual, ac, tied))
        watch = FullParams(model)
        loss = model(input_ids=ids, labels=ids).loss  # every rank the whole batch: the average is its gradient
        after_forward = watch.alive()
        watch.in_backward = True
        loss.backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in model.named_parameters()}
        # layer 0's attention-side point has one source: its parameters get no gradient, here or there
        assert all((grads[n] is None) == (p.grad is None) for n, p in reference.named_parameters())
        worst = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-8)).item()
                    for n, p in reference.named_parameters() if p.grad is not None)
        out[residual, ac, tied] = dict(
            forward=watch.forward, recompute=watch.recompute, backward=watch.backward, after_forward=after_forward,
            after_backward=watch.alive(), loss=abs(loss.item() - want_loss.item()), worst_grad=worst,
            sharded=all(isinstance(p, DTensor) and p.to_local().shape[0] <= -(-p.shape[0] // 2)
                        for p in model.parameters()),
        )
    return out


@pytest.fixture(scope="module")
def results():
    launched = run_ranks(shard_and_compare, 2, timeout_s=60.0, join_s=240.0)
    failed = {rank: value for rank, (status, value) in launched.items() if status != "ok"}
    if failed:
        pytest.fail(f"a rank failed: {failed}")
    return [launched[r][1] for r in (0, 1)]


@pytest.mark.parametrize("residual, ac, tied", CASES, ids=IDS)
def test_a_layers_full_parameters_exist_only_while_it_runs(results, residual, ac, tied):
    for per_rank in results:
        r = per_rank[residual, ac, tied]
        assert r["sharded"]  # outside forward and backward every parameter is a DTensor holding half the rows
        # forward: both bodies of layer i see exactly layer i gathered; after forward, none is
        assert r["forward"] == [(i, [i]) for i in range(LAYERS) for _ in range(2)]
        assert r["after_forward"] == []
        # backward, from the last layer to the first: layer i gathered again, at most with layer i - 1 (FSDP
        # prefetches the next group in backward order); freed again after
        assert [layer for layer, _ in r["backward"]] == [i for i in reversed(range(LAYERS)) for _ in range(2)]
        for layer, alive in r["backward"] + r["recompute"]:
            assert layer in alive and set(alive) <= {layer, layer - 1}, (layer, alive)
        # activation checkpointing runs each body's forward once more, in backward, gathered as above
        assert sorted(layer for layer, _ in r["recompute"]) == (sorted(list(range(LAYERS)) * 2) if ac else [])
        assert r["after_backward"] == []


@pytest.mark.parametrize("residual, ac, tied", CASES, ids=IDS)
def test_loss_and_gradients_equal_one_process(results, residual, ac, tied):
    for per_rank in results:
        r = per_rank[residual, ac, tied]
        assert r["loss"] <= 1e-6
        assert r["worst_grad"] <= 1e-5
