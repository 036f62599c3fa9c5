"""Peak memory of making the model on each rank, on 4 gloo ranks on CPU, beside one process, for each device-mesh
composition of `benchmarks.mesh_memory`:
- fresh: `attnres train`'s model built on the meta device, parallelized, then each rank allocates and initializes what
  it holds (`attnres.distributed.materialize`);
- init_from: the same, from a pretrained Llama folder of the same shape (`attnres train --init-from`): each rank loads
  what it holds of the folder's weights through transformers' loading (`attnres.distributed.load_shards`).

Per rank, from the start of the build to the parallelized, real model, less the memory resident before:
- peak resident memory (`VmHWM` of /proc/self/status, reset through /proc/self/clear_refs); it counts the pages of the
  folder's memory-mapped safetensors the rank touched, which the ranks of one machine share and the kernel may drop;
- peak private memory (`RssAnon`, sampled every millisecond by a thread): what the rank itself allocated;
and the parameter bytes it then holds. Each measurement runs in fresh processes: memory an earlier measurement freed
but kept would hide later growth.

    python -m benchmarks.construction_memory          # writes docs/construction_memory.json
    python -m benchmarks.construction_memory --dim 64 --layers 4 --vocab 256 --out /tmp/construction.json
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from attnres.bench.models import add_model_args
from benchmarks.gloo_ranks import run_on_gloo_ranks, write_record
from benchmarks.mesh_memory import COMPOSITIONS, MIB, RANKS

KINDS = ("fresh", "init_from")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--out", type=Path, default=Path("docs/construction_memory.json"), help="(default: %(default)s)")
    return p.parse_args(argv)


def _memory_status() -> dict[str, int]:
    """Resident bytes now (VmRSS), at the peak since the last reset (VmHWM), and private now (RssAnon)."""
    text = Path("/proc/self/status").read_text()
    return {key: int(kib) * 1024 for key, kib in re.findall(r"^(VmRSS|VmHWM|RssAnon):\s+(\d+) kB", text, re.M)}


class _PrivatePeak:
    """The largest `RssAnon` while the `with` block runs, sampled by a thread."""

    def __enter__(self):
        self.peak, self._done = _memory_status()["RssAnon"], threading.Event()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _memory_status()["RssAnon"])

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _memory_status()["RssAnon"])


def _config(args, kind: str, folder: str, dims: dict):
    from attnres.training import TrainConfig

    shared = dict(residual="block", block_size=2, seq_len=1024, batch_size=4, threads=1, **dims)
    if kind == "init_from":  # the architecture is the folder's
        return TrainConfig(init_from=folder, **shared)
    return TrainConfig(layers=args.layers, dim=args.dim, heads=args.heads, **shared)


def _construct(rank: int, args, kind: str, folder: str, dims: dict) -> dict:
    """Build, parallelize and make real one model on this process's group (one process when the group has one)."""
    from attnres.distributed.ranks import Ranks
    from attnres.distributed.materialize import materialize
    from attnres.distributed.mesh import build_mesh, held_bytes
    from attnres.training.init_from import load_init_from
    from attnres.training.loop import build_model
    from attnres.training.steps import training_steps

    world = dist.get_world_size()
    ranks = Ranks(rank, world) if world > 1 else Ranks()
    config = _config(args, kind, folder, dims)
    shape = config.parallel_dims(world)
    mesh = build_mesh(shape, "cpu") if world > 1 else None
    before = _memory_status()
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the resident memory now
    with _PrivatePeak() as private:
        if kind == "init_from":
            model, _, pretrained = load_init_from(config)
            training_steps(model, config, ranks, shape, mesh, lambda m: pretrained.load(m, "cpu", config.seed))
        else:
            model = build_model(config, args.vocab, device="meta")
            training_steps(model, config, ranks, shape, mesh, lambda m: materialize(m, "cpu", config.seed))
    return {"peak_rss_bytes": _memory_status()["VmHWM"] - before["VmRSS"],
            "peak_private_bytes": private.peak - before["RssAnon"], "param_bytes": held_bytes(model.parameters())}


def _save_folder(args, folder: Path) -> None:
    """A Llama folder of `attnres train`'s shape (random weights, std 0.02) with the byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnres.tokenization import byte_tokenizer
    from attnres.training import TrainConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         intermediate_size=TrainConfig(dim=args.dim).ffn_size, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        _save_folder(args, Path(tmp))
        for kind in KINDS:
            one = run_on_gloo_ranks(_construct, 1, args, kind, tmp, {})[0]
            results[kind] = {"one_process": one, "per_rank": {
                name: run_on_gloo_ranks(_construct, RANKS, args, kind, tmp, dims) for name, dims in COMPOSITIONS.items()
            }}
    print(f"d={args.dim}, {args.layers} layers, vocabulary {args.vocab}, {RANKS} gloo ranks; MiB per rank while the "
          f"model is built, parallelized and made real (peaks added; parameters held after)")
    fields = {"peak resident": "peak_rss_bytes", "peak private": "peak_private_bytes", "params": "param_bytes"}
    print(f"{'kind':<10} {'composition':<20}" + "".join(f" {title + ' (ranks)':>30}" for title in fields))
    for kind, result in results.items():
        rows = [("one process", [result["one_process"]])] + list(result["per_rank"].items())
        for name, lines in rows:
            columns = (" ".join(f"{line[field] / MIB:6.0f}" for line in lines) for field in fields.values())
            print(f"{kind:<10} {name:<20}" + "".join(f" {column:>30}" for column in columns))
    write_record("benchmarks.construction_memory", args, argv, {"ranks": RANKS, "residual": "block", "block_size": 2},
                 **results)


if __name__ == "__main__":
    main()
