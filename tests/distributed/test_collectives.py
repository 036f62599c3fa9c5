"""Every collective of the package hands torch.distributed its tensors on the device the process group's backend
takes (`collective_device`): NCCL rejects CPU tensors, so a hard-coded CPU tensor breaks training on GPUs.

On 2 gloo ranks the group is made to report a backend whose device is "meta" (the fake expected device), and the
collectives are replaced by a check: each call stops with `Handed` when every tensor is on that device, with
`WrongDevice` when one is not (a meta tensor holds no values, so the call cannot go on either way)."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed.workers import run_ranks

FAKE_BACKEND = "attnres_test_meta"
CHECKED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
           "all_to_all_single", "broadcast_object_list")


class Handed(Exception):
    pass


class WrongDevice(Exception):
    pass


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _checking(name: str):
    def check(*args, **kwargs):
        devices = [t.device for t in _tensors((args, kwargs))]
        if name == "broadcast_object_list":  # its tensors are made inside, on `device`
            devices = [torch.device(kwargs.get("device") or "cpu")]
        wrong = [d for d in devices if d.type != "meta"]
        raise (WrongDevice if wrong or not devices else Handed)(f"{name}: {devices}")

    return check


def _outcome(fn) -> str:
    try:
        fn()
    except (Handed, WrongDevice) as e:
        return f"{type(e).__name__} {e}"
    return "no collective"


def every_collective(rank: int, names: tuple[str, ...]) -> dict[str, str]:
    """Each collective-using call of the package, under the fake backend: what the check said."""
    from attnres.distributed.pipeline import PipelineTrainer
    from attnres.distributed.ranks import Ranks, mean_over_ranks, on_main
    from tests.distributed.test_pipeline import CASES, build_model, make_batch

    case = next(c for c in CASES if c.ranks == 2 and c.schedule == "1f1b")
    model = build_model(case)
    trainer = PipelineTrainer(model, schedule=case.schedule, microbatches=case.microbatches)
    for p in trainer.parameters():
        p.grad = torch.ones_like(p)

    real = {name: getattr(dist, name) for name in names}
    real_backend = dist.get_backend
    dist.Backend.backend_capability[FAKE_BACKEND] = ["meta"]
    try:
        dist.get_backend = lambda group=None: FAKE_BACKEND
        for name in names:
            setattr(dist, name, _checking(name))
        ranks = Ranks(rank, 2)
        return {
            "mean_over_ranks": _outcome(lambda: mean_over_ranks(torch.tensor(2.0), ranks)),
            "on_main": _outcome(lambda: on_main(lambda: None, ranks)),
            "PipelineTrainer.step": _outcome(lambda: trainer.step(*make_batch())),
            "PipelineTrainer.clip_grad_norm_": _outcome(lambda: trainer.clip_grad_norm_(1.0)),
            # the check itself: a broadcast of a CPU tensor, whatever the backend
            "a hard-coded CPU tensor": _outcome(lambda: dist.broadcast(torch.zeros(()), src=0)),
        }
    finally:
        dist.get_backend = real_backend
        for name, fn in real.items():
            setattr(dist, name, fn)


def test_every_collective_takes_its_tensors_on_the_backends_device():
    launched = run_ranks(every_collective, 2, CHECKED, timeout_s=60.0, join_s=180.0)
    failed = {rank: value for rank, (status, value) in launched.items() if status != "ok"}
    if failed:
        pytest.fail(f"a rank failed: {failed}")
    for rank in (0, 1):
        outcomes = launched[rank][1]
        assert outcomes.pop("a hard-coded CPU tensor").startswith("WrongDevice broadcast: [device(type='cpu')]")
        for call, outcome in outcomes.items():
            assert outcome.startswith("Handed"), (rank, call, outcome)


def test_the_collective_device_follows_the_backend(monkeypatch):
    from attnres.distributed.ranks import collective_device

    for backend, want in [("gloo", "cpu"), ("nccl", "cuda"), ("xccl", "xpu")]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        assert collective_device().type == want, backend
