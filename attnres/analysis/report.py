"""Side-by-side comparison of residual kinds: train each on the same tokens, profile it, tabulate and plot.

A comparison folder holds one run folder per residual kind and seed (`<out>/<residual>/` for the first seed,
`<out>/<residual>-s<seed>/` for the others, written by `attnres.training`), `summary.json` (the table, the verdict
and the depth profiles, enough to redraw every picture without the models) and the pictures: `loss.png` (first
seeds), `depth_weights_<residual>.png`, `layers.png`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from attnres.analysis.plots import plot_depth_weights, plot_layer_curves, plot_loss_curves
from attnres.analysis.profile import DepthProfile, depth_profile
from attnres.analysis.stats import t_interval, verdict
from attnres.atomic import atomic_write_text
from attnres.layers.kinds import STANDARD
from attnres.training import TrainConfig, train
from attnres.training.data import eval_batches, load_tokenizer, read_corpus, tokenize_and_split
from attnres.training.logs import read_log

SUMMARY = "summary.json"


def compare(base: TrainConfig, residuals: list[str], out: str | Path, profile_size: int = 4,
            seeds: Sequence[int] | None = None, noise_std: float | None = None, noise_dof: int | None = None,
            noise_source: str | None = None) -> dict:
    """Train `base` once per residual kind and seed (same data, size and schedule), profile each kind's first seed
    on one validation batch.

    `seeds` (default: `base.seed` alone) are run in order; the first seed of a kind trains in `<out>/<residual>/`,
    the others in `<out>/<residual>-s<seed>/`. Each kind's `val_loss` is the mean over its seeds, `seeds` the
    per-seed results. `noise_std` (with its degrees of freedom `noise_dof` and `noise_source`, where it was measured)
    is the seed standard deviation to judge the gaps by when no kind has two seeds. Returns the summary written to `<out>/summary.json` (with the
    verdict, see `judge`); the pictures are drawn beside it.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(seeds) if seeds is not None else [base.seed]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: expected one or more distinct seeds, got {seeds}")
    batch = profile_batch(base, profile_size)
    runs = {}
    for residual in residuals:
        per_seed = []
        for i, seed in enumerate(seeds):
            run_dir = out / (residual if i == 0 else f"{residual}-s{seed}")
            config = dataclasses.replace(base, residual=residual, seed=seed, out=str(run_dir))
            result = train(config)
            per_seed.append({"seed": seed, "val_loss": result.final_val_loss, "train_loss": result.final_train_loss,
                             "tokens_per_s": result.tokens_per_s, "run_dir": run_dir.name})
            if i == 0:
                num_params, steps = result.num_params, result.steps
                profile = depth_profile(result.model, batch.to(next(result.model.parameters()).device))
        runs[residual] = {
            "val_loss": statistics.mean(r["val_loss"] for r in per_seed),
            "train_loss": statistics.mean(r["train_loss"] for r in per_seed),
            "num_params": num_params,
            "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in per_seed),
            "steps": steps,
            "seeds": per_seed,
            "profile": profile_to_json(profile),
        }
    summary = {"config": dataclasses.replace(base, seed=seeds[0]).to_dict(), "seeds": seeds, "runs": runs}
    if noise_std is not None:
        summary["noise"] = {"std": noise_std, "dof": noise_dof, "source": noise_source or "given"}
    summary["verdict"] = judge(seed_losses(summary), noise_std=noise_std, noise_source=noise_source,
                               noise_dof=noise_dof,
                               budget=budget_text(summary), unit=loss_unit(base.tokenizer))
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
    summary = load_summary(folder)
    runs = summary["runs"]
    curves = {
        name: {
            "train": [(r["step"], r["loss"]) for r in read_log(folder / name, "train")],
            "val": [(r["step"], r["val_loss"]) for r in read_log(folder / name, "eval")],
        }
        for name in runs
    }
    profiles = {name: profile_from_json(run["profile"]) for name, run in runs.items()}
    unit = loss_unit(summary["config"]["tokenizer"])
    paths = [plot_loss_curves(curves, folder / "loss.png", unit), plot_layer_curves(profiles, folder / "layers.png")]
    for name, prof in profiles.items():
        if prof.weights:
            paths.append(plot_depth_weights(name, prof, folder / f"depth_weights_{name}.png"))
    return paths


def seed_losses(summary: dict) -> dict[str, list[float]]:
    """Each kind's per-seed validation losses (one value for a summary written before seeds were recorded)."""
    return {name: [s["val_loss"] for s in r["seeds"]] if r.get("seeds") else [r["val_loss"]]
            for name, r in summary["runs"].items()}


def loss_unit(tokenizer: str) -> str:
    return "nats/byte" if tokenizer == "bytes" else "nats/token"


def budget_text(summary: dict) -> str:
    c = summary["config"]
    tokens = c["steps"] * c["batch_size"] * c["seq_len"]
    return f"{c['steps']} steps ({tokens / 1e6:.2f}M tokens)"


def format_table(summary: dict) -> str:
    """A markdown table of the runs: mean validation loss over seeds, the per-seed values, and each AttnRes kind's
    mean relative to the standard one."""
    losses = seed_losses(summary)
    runs = summary["runs"]
    base = statistics.mean(losses[STANDARD]) if STANDARD in losses else None
    lines = [
        "| residual | val loss (mean) | per seed | vs standard | params | tokens/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in runs.items():
        mean = statistics.mean(losses[name])
        delta = "" if base is None or name == STANDARD else f"{mean - base:+.4f}"
        per_seed = ", ".join(f"{v:.4f}" for v in losses[name])
        lines.append(f"| {name} | {mean:.4f} | {per_seed} | {delta} | {r['num_params']:,} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def pooled_seed_std(losses: Mapping[str, Sequence[float]]) -> tuple[float, int] | None:
    """The seed standard deviation pooled over the kinds (each around its own mean) and its degrees of freedom;
    None when no kind has two seeds."""
    dof = sum(len(v) - 1 for v in losses.values() if len(v) > 1)
    if dof == 0:
        return None
    ss = sum(sum((x - statistics.mean(v)) ** 2 for x in v) for v in losses.values() if len(v) > 1)
    return math.sqrt(ss / dof), dof


def judge(losses: Mapping[str, Sequence[float]], baseline: str = STANDARD, noise_std: float | None = None,
          noise_source: str | None = None, noise_dof: int | None = None, budget: str = "this budget",
          unit: str = "nats/byte") -> dict:
    """What the gaps mean, computed from the per-seed validation losses of each kind.

    The noise is the seed standard deviation `s` pooled over the kinds (its degrees of freedom: the seeds less one
    per kind), or `noise_std` with `noise_dof` (measured elsewhere, named by `noise_source`) when no kind has two
    seeds. A gap (kind mean minus baseline mean) is judged by its 95% t interval, gap +- t_{0.975, dof} s
    sqrt(1/n_kind + 1/n_baseline) (`attnres.analysis.stats`): one that spans 0 is within seed noise, another is a
    lead, reported in `unit` and in seed standard deviations. Returns `{"noise_std", "noise_source", "gaps": {kind:
    {...}}, "line"}`; `line` is the closing sentence `attnres compare` prints.
    """
    if baseline not in losses:
        return {"noise_std": None, "noise_source": None, "gaps": {},
                "line": f"No {baseline} run: nothing to compare against."}
    pooled = pooled_seed_std(losses)
    if pooled is not None:
        (std, dof), source = pooled, f"pooled over {sum(len(v) for v in losses.values())} runs, {pooled[1]} dof"
    elif noise_std is not None:
        if noise_dof is None:
            raise ValueError("noise_dof: the degrees of freedom of noise_std are needed for its t interval")
        std, dof, source = noise_std, noise_dof, noise_source or "given"
    else:
        std, dof, source = None, None, None
    n_base, base = len(losses[baseline]), statistics.mean(losses[baseline])
    gaps, parts = {}, []
    for name, values in losses.items():
        if name == baseline:
            continue
        gap = statistics.mean(values) - base
        entry = {"gap": gap, "n": len(values), "n_baseline": n_base}
        label = name.capitalize()
        if std is None:
            entry["verdict"] = "unknown"
            parts.append(f"{label} {gap:+.4f} (one seed, no seed spread to judge it by)")
        else:
            se = std * math.sqrt(1 / len(values) + 1 / n_base)
            low, high = t_interval(gap, se, dof)
            entry.update(se=se, ci95=[low, high], in_std=abs(gap) / std if std > 0 else None)
            side = verdict((low, high))
            if side == "noise":
                entry["verdict"] = "noise"
                parts.append(f"{label} {gap:+.4f}: within seed noise at this budget (95% t interval "
                             f"{low:+.4f} to {high:+.4f})")
            else:
                entry["verdict"] = "lead" if side == "below" else "behind"
                who = f"{label} leads {baseline}" if gap < 0 else f"{baseline} leads {label}"
                spreads = f"{entry['in_std']:.1f} seed spreads" if std > 0 else "no spread between the seeds"
                parts.append(f"{who} by {abs(gap):.4f} {unit} ({spreads}; 95% t interval {low:+.4f} to {high:+.4f})")
        gaps[name] = entry
    noise = f"seed spread (std) {std:.4f} {unit}, {source}" if std is not None else "no seed spread"
    counts = sorted({len(v) for v in losses.values()})
    seeds = f"{counts[0]} seed{'s' if counts[0] > 1 else ''}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} seeds"
    line = f"At {budget}, {seeds} per residual, {noise}: " + "; ".join(parts) + "."
    return {"noise_std": std, "noise_source": source, "gaps": gaps, "line": line}
