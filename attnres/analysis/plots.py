"""Pictures of a comparison run: loss curves, depth-weight heatmaps (paper fig. 8), magnitudes and gradient
norms per layer (paper fig. 5). Each function writes one PNG and returns its path."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from attnres.analysis.profile import DepthProfile, depth_weight_matrix  # noqa: E402
from attnres.layers.kinds import BLOCK  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    """Write `fig` to `path` (PNG) atomically and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)  # atomic: a reader never sees half a picture
    return path


def plot_loss_curves(curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], path: str | Path,
                     unit: str = "nats/token") -> Path:
    """`curves[run] = {"train": [(step, loss)], "val": [(step, loss)]}`: one line per run and split, the loss in
    `unit` (`report.loss_unit`)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, splits) in enumerate(curves.items()):
        color = f"C{i}"
        for split, style in (("train", "-"), ("val", "o--")):
            pts = splits.get(split) or []
            if pts:
                steps, losses = zip(*pts)
                alpha = 0.35 if split == "train" else 1.0
                ax.plot(steps, losses, style, color=color, alpha=alpha, label=f"{name} ({split})", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss ({unit})")
    ax.set_title("Training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_depth_weights(name: str, profile: DepthProfile, path: str | Path) -> Path:
    """Heatmap of mean depth weights: sources (columns) against aggregation points (rows), pre-attention and
    pre-MLP reads in separate panels; the final read is shown with the pre-attention reads."""
    mat = depth_weight_matrix(profile.weights)
    attn_rows = list(range(0, mat.shape[0], 2))  # 2i: before attention; the last (2L) is the final read
    mlp_rows = list(range(1, mat.shape[0], 2))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.35 * len(attn_rows) + 2.5), sharex=True)
    for ax, rows, title in ((axes[0], attn_rows, "pre-attention reads"), (axes[1], mlp_rows, "pre-MLP reads")):
        im = ax.imshow(mat[rows].numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        labels = [f"L{k // 2}" if k < mat.shape[0] - 1 else "final" for k in rows]
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.set_xlabel("source (0 = embedding" + (", last = current block prefix)" if profile.residual == BLOCK else ")"))
        ax.set_title(title)
    fig.colorbar(im, ax=axes, shrink=0.8, label="mean depth weight")
    fig.suptitle(f"{name}: depth-attention weights")
    return save_figure(fig, path)


def plot_layer_curves(profiles: Mapping[str, DepthProfile], path: str | Path) -> Path:
    """Per-sublayer curves side by side: RMS of each sublayer's input (pre-norm), RMS of its output, and the
    gradient norm of its parameters, one line per model."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("mixture_rms", "input magnitude (RMS of the pre-norm h)"),
        ("output_rms", "output magnitude (RMS of v_l)"),
        ("grad_norms", "gradient norm of the sublayer's parameters"),
    )
    for ax, (field, title) in zip(axes, panels):
        for i, (name, prof) in enumerate(profiles.items()):
            y = getattr(prof, field)
            ax.plot(range(len(y)), y.numpy(), marker=".", color=f"C{i}", label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("sublayer (attention, MLP alternating)")
        ax.set_yscale("log" if _spans_decades(profiles, field) else "linear")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)


def _spans_decades(profiles: Mapping[str, DepthProfile], field: str) -> bool:
    values = torch.cat([getattr(p, field) for p in profiles.values()])
    values = values[values > 0]
    return values.numel() > 0 and math.log10(values.max() / values.min()) > 1.5
