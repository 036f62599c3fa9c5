"""Outputs of a suite run: JSON, a chart of the ratios per case, and a markdown table for the README."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402

from attnres.atomic import atomic_write, atomic_write_text  # noqa: E402


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    return path


def write_chart(result: dict, path: str | Path) -> Path:
    """Horizontal bars: per case, each implementation's time over the case's reference (1 = as fast)."""
    cases = result["cases"]
    rows = [(case["name"], impl, r) for case in cases for impl, r in case["ratio"].items() if impl != case["reference"]]
    impls = list(dict.fromkeys(impl for _, impl, _ in rows))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    labels = []
    for y, (case, impl, ratio) in enumerate(rows):
        ax.barh(y, ratio, color=f"C{impls.index(impl) % 10}")
        ax.text(ratio, y, f" {ratio:.2f}", va="center", fontsize=7)
        labels.append(f"{case}  ·  {impl}")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("time / reference (torch.sum for operators, the standard model for models); lower is faster")
    ax.set_title(f"attnres bench (copy {result['copy_GB/s']:.1f} GB/s)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path


def markdown_table(result: dict) -> str:
    """One row per case and implementation: median ms, ratio to the case's reference, GB/s and share of copy."""
    lines = [
        f"Copy bandwidth {result['copy_GB/s']:.1f} GB/s; torch {result['machine']['torch']}, "
        f"{result['machine']['threads']} threads; medians of {result['config']['repeats']} (decode "
        f"{result['config']['decode_repeats']}).",
        "",
        "| case | implementation | ms | x reference | GB/s | of copy |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for case in result["cases"]:
        for impl, ms in case["ms"].items():
            is_ref = impl == case["reference"]
            gbps = f"{case['GB/s'][impl]:.1f}" if "GB/s" in case else ""
            share = f"{case['of_copy'][impl]:.0%}" if "of_copy" in case else ""
            ratio = "ref" if is_ref else f"{case['ratio'][impl]:.3f}"
            lines.append(f"| {case['name']} | {impl} | {ms:.2f} | {ratio} | {gbps} | {share} |")
    lines += [f"\n- {note}" for note in result["notes"]]
    return "\n".join(lines)
