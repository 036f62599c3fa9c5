"""Side-by-side comparison of residual kinds: train each on the same tokens, profile it, tabulate and plot.

A comparison folder holds one run folder per residual kind (`<out>/<residual>/`, written by `attnres.training`),
`summary.json` (the table and the depth profiles, enough to redraw every picture without the models) and the
pictures: `loss.png`, `depth_weights_<residual>.png`, `layers.png`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from attnres.analysis.plots import plot_depth_weights, plot_layer_curves, plot_loss_curves
from attnres.analysis.profile import DepthProfile, depth_profile
from attnres.training import TrainConfig, train
from attnres.training.checkpoint import atomic_write_text
from attnres.training.data import eval_batches, load_tokenizer, read_corpus, tokenize_and_split
from attnres.training.logs import read_log

SUMMARY = "summary.json"


def compare(base: TrainConfig, residuals: list[str], out: str | Path, profile_size: int = 4) -> dict:
    """Train `base` once per residual kind (same data, seed and size), profile each on one validation batch.

    Returns the summary written to `<out>/summary.json`; the pictures are drawn beside it.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    batch = profile_batch(base, profile_size)
    runs = {}
    for residual in residuals:
        config = dataclasses.replace(base, residual=residual, out=str(out / residual))
        result = train(config)
        profile = depth_profile(result.model, batch.to(next(result.model.parameters()).device))
        runs[residual] = {
            "val_loss": result.final_val_loss,
            "train_loss": result.final_train_loss,
            "num_params": result.num_params,
            "tokens_per_s": result.tokens_per_s,
            "steps": result.steps,
            "profile": profile_to_json(profile),
        }
    summary = {"config": base.to_dict(), "runs": runs}
    atomic_write_text(out / SUMMARY, json.dumps(summary, indent=1))
    draw(out)
    return summary


def profile_batch(config: TrainConfig, size: int) -> torch.Tensor:
    tokenizer = load_tokenizer(config.tokenizer, config.allow_download)
    splits = tokenize_and_split(read_corpus(config.data, config.max_bytes), tokenizer, config.val_fraction)
    return eval_batches(splits.val, config.seq_len, size, 1)[0]


def profile_to_json(p: DepthProfile) -> dict:
    return {
        "residual": p.residual,
        "weights": [w.tolist() for w in p.weights],
        "mixture_rms": p.mixture_rms.tolist(),
        "output_rms": p.output_rms.tolist(),
        "grad_norms": p.grad_norms.tolist(),
    }


def profile_from_json(d: dict) -> DepthProfile:
    return DepthProfile(
        d["residual"],
        [torch.tensor(w) for w in d["weights"]],
        torch.tensor(d["mixture_rms"]),
        torch.tensor(d["output_rms"]),
        torch.tensor(d["grad_norms"]),
    )


def load_summary(folder: str | Path) -> dict:
    path = Path(folder) / SUMMARY
    if not path.is_file():
        raise FileNotFoundError(f"folder: {folder} holds no {SUMMARY}; run `attnres compare --out {folder}` first")
    return json.loads(path.read_text(encoding="utf-8"))


def draw(folder: str | Path) -> list[Path]:
    """(Re)draw every picture of a comparison folder from its summary and run logs."""
    folder = Path(folder)
    runs = load_summary(folder)["runs"]
    curves = {
        name: {
            "train": [(r["step"], r["loss"]) for r in read_log(folder / name, "train")],
            "val": [(r["step"], r["val_loss"]) for r in read_log(folder / name, "eval")],
        }
        for name in runs
    }
    profiles = {name: profile_from_json(run["profile"]) for name, run in runs.items()}
    paths = [plot_loss_curves(curves, folder / "loss.png"), plot_layer_curves(profiles, folder / "layers.png")]
    for name, prof in profiles.items():
        if prof.weights:
            paths.append(plot_depth_weights(name, prof, folder / f"depth_weights_{name}.png"))
    return paths


def format_table(summary: dict) -> str:
    """A markdown table of the runs, with each AttnRes run's validation loss relative to the standard one."""
    runs = summary["runs"]
    base = runs.get("standard", {}).get("val_loss")
    lines = [
        "| residual | val loss | vs standard | params | tokens/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in runs.items():
        delta = "" if base is None or name == "standard" else f"{r['val_loss'] - base:+.4f}"
        lines.append(f"| {name} | {r['val_loss']:.4f} | {delta} | {r['num_params']:,} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)
