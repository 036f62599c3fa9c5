"""The results page, regenerated from the studies' committed JSON.

    python -m experiments.results            # writes docs/results.md and redraws its figures

Reads docs/budget.json, docs/query_lr.json, docs/stability.json and docs/warmup_stall.json (written by the scripts of
the same names) and docs/compare_summary*.json (`attnres compare`'s summaries, at the query lr multipliers 1 and 0.1);
every number on the page is computed here from those files, and so is every conclusion
(tests/analysis/test_results_page.py checks that the committed page matches them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from attnres.analysis.report import seed_losses
from attnres.analysis.stats import paired_gaps
from attnres.atomic import atomic_write_text
from attnres.commands import compare as compare_command
from experiments import budget, query_lr, stability
from experiments.study import verdict

ROOT = Path(__file__).resolve().parents[1]
PAPER = ("The paper (Kimi Team 2026) reports Block AttnRes (8 blocks) about 0.02 nats lower validation loss than PreNorm "
         "at every size from 194M to 528M activated parameters (at 436M: baseline 1.766, Full 1.737, Block 1.746), "
         "with far more tokens than any run here.")


def load(name: str) -> dict | None:
    path = ROOT / "docs" / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def spread(values: list[float]) -> str:
    if not values:
        return ""
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def interval(stats: dict) -> str:
    if not stats["n"]:
        return ""
    if stats["ci95"] is None:
        return f"{stats['mean']:+.4f}"
    return f"{stats['mean']:+.4f} [{stats['ci95'][0]:+.4f}, {stats['ci95'][1]:+.4f}]"


def step_time_ratios() -> dict[str, float] | None:
    return budget.step_time_ratios(ROOT / budget.STEP_TIME_JSON)


def budget_table(data: dict) -> list[str]:
    lines = ["| model | steps | tokens | seeds (standard / Block) | standard | Block | Block - standard [95%] | compute-matched [95%] |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in budget.summarise(data["runs"], step_time_ratios()):
        losses = row["val_loss"]
        lines.append(
            f"| {row['size']} | {row['budget']} | {row['tokens'] / 1e6:.2f}M "
            f"| {len(losses['standard'])} / {len(losses['block'])} "
            f"| {spread(list(losses['standard'].values()))} | {spread(list(losses['block'].values()))} "
            f"| {interval(row['gap'])} | {interval(row['compute_matched_gap'])} |"
        )
    return lines


def budget_conclusion(data: dict) -> str:
    rows = [r for r in budget.summarise(data["runs"], step_time_ratios()) if r["gap"]["ci95"] is not None]
    if not rows:
        return "Too few seeds have finished for an interval."
    below = [r for r in rows if r["gap"]["ci95"][1] < 0]
    above = [r for r in rows if r["gap"]["ci95"][0] > 0]
    ratios = sorted({f"{r['size']} {r['step_time_ratio']:.2f}x" for r in rows if r["step_time_ratio"]})
    parts = []
    if not below and not above:
        parts.append(f"No measurable difference at this scale: at all {len(rows)} (model, budget) cells the 95% "
                     "interval of the gap contains 0.")
    else:
        def cells(group: list[dict]) -> str:
            return ", ".join(f"{r['size']} {r['budget']} steps" for r in group) or "none"

        parts.append(f"The 95% interval of the gap lies below 0 (AttnRes lower) at {len(below)} of {len(rows)} "
                     f"(model, budget) cells ({cells(below)}) and above 0 at {len(above)} ({cells(above)}); "
                     "elsewhere it contains 0.")
    for size in sorted({r["size"] for r in rows}):
        mine = [r for r in rows if r["size"] == size]
        first, last = mine[0], mine[-1]
        if first is not last:
            parts.append(f"{size}: mean gap {first['gap']['mean']:+.4f} at {first['budget']} steps, "
                         f"{last['gap']['mean']:+.4f} at {last['budget']} steps.")
    matched = [r for r in rows if r["compute_matched_gap"]["ci95"] is not None]
    if matched:
        m_below = sum(r["compute_matched_gap"]["ci95"][1] < 0 for r in matched)
        m_above = sum(r["compute_matched_gap"]["ci95"][0] > 0 for r in matched)
        parts.append(f"Counting Block's step time (measured side by side: {', '.join(ratios)} standard's), "
                     f"the compute-matched interval lies below 0 at {m_below} of {len(matched)} cells and above 0 at "
                     f"{m_above}.")
    return " ".join(parts)


def query_lr_table(data: dict) -> list[str]:
    lines = ["| query lr multiplier | seeds | Block | Block - standard [95%] | reading |", "| --- | --- | --- | --- | --- |"]
    for row in query_lr.summarise(data["runs"]):
        lines.append(f"| {row['attn_res_lr_mult']:g} | {row['gap']['n']} | {spread(list(row['val_loss'].values()))} "
                     f"| {interval(row['gap'])} | {row['verdict']} |")
    return lines


def query_lr_conclusion(data: dict) -> str:
    rows = query_lr.summarise(data["runs"])
    by = {r["attn_res_lr_mult"]: {int(s): v for s, v in r["val_loss"].items()} for r in rows}
    if 0.1 not in by or len(by) < 2:
        return "Not all multipliers have finished."
    best = min(by, key=lambda m: statistics.mean(by[m].values()))
    if best == 0.1:
        return "0.1 (the `attnres train` default) has the lowest mean loss; the default stays."
    paired = paired_gaps([by[best][s] - by[0.1][s] for s in sorted(by[best]) if s in by[0.1]])
    reading = verdict(paired).replace("AttnRes lower", f"{best:g} lower").replace("standard lower", "0.1 lower")
    return (f"{best:g} has the lowest mean loss; against 0.1 (paired by seed): {interval(paired)}, {reading}. "
            + ("The default stays 0.1: the difference is not resolved." if paired["ci95"] is None
               or paired["ci95"][1] >= 0 else f"Resolved: the default should be {best:g}."))


def stability_table(data: dict) -> list[str]:
    lines = ["| warm-up | peak lr | standard | Block | Full |", "| --- | --- | --- | --- | --- |"]
    for row in stability.summarise(data["runs"]):
        cells = []
        for residual in stability.RESIDUALS:
            r = row.get(residual)
            if r is None:
                cells.append("")
            elif r["outcome"] == "diverged":
                cells.append(f"diverged (step {r['diverged_at']})")
            else:
                plateau = "never left" if r["plateau_steps"] is None else r["plateau_steps"]
                cells.append(f"{r['val_loss']:.3f} (plateau {plateau})")
        lines.append(f"| {row['warmup']} | {row['lr']:g} | " + " | ".join(cells) + " |")
    return lines


def stability_conclusion(data: dict) -> str:
    rows = stability.summarise(data["runs"])
    parts = []
    for residual in stability.RESIDUALS:
        bad = [f"lr {r['lr']:g} warm-up {r['warmup']}: {r[residual]['outcome']}" for r in rows
               if residual in r and r[residual]["outcome"] != "trained"]
        parts.append(f"{residual}: " + (", ".join(bad) if bad else "none"))
    complete = [r for r in rows if all(res in r and r[res]["outcome"] != "diverged" for res in stability.RESIDUALS)]
    wins = {res: sum(min(stability.RESIDUALS, key=lambda x: r[x]["val_loss"]) == res for r in complete)
            for res in stability.RESIDUALS}
    longest = {res: max((r[res]["plateau_steps"] or 0 for r in complete), default=0) for res in stability.RESIDUALS}
    return (f"Stuck or diverged: {'; '.join(parts)}. Lowest final loss, of the {len(complete)} settings every residual "
            f"finished: {', '.join(f'{res} {n}' for res, n in wins.items())}. Longest plateau: "
            f"{', '.join(f'{res} {n} steps' for res, n in longest.items())}. One seed per setting: differences below "
            "about 0.05 nats/byte (the seed spread in docs/warmup_stall.json) are noise.")


def compare_losses(data: dict, baseline: dict | None = None) -> dict[str, dict[int, float]]:
    """Per residual, the final validation loss by seed of a committed `attnres compare` summary. One without a
    standard run takes `baseline`'s, which must have trained the same settings: the query lr multiplier, the only
    difference allowed, does not touch the standard model."""
    losses = {res: dict(zip(data["seeds"], values)) for res, values in seed_losses(data).items()}
    if "standard" not in losses and baseline is not None:
        def settings(config: dict) -> dict:
            return {k: v for k, v in config.items() if k not in ("attn_res_lr_mult", "residual", "out")}
        if settings(data["config"]) != settings(baseline["config"]):
            raise ValueError("a compare summary without a standard run: expected its baseline's settings but the "
                             "query lr multiplier")
        losses["standard"] = compare_losses(baseline)["standard"]
    return losses


def paired(losses: dict[str, dict], residual: str) -> dict:
    """The gap of `residual` to standard, paired by key (seed, or warm-up and seed)."""
    mine, base = losses.get(residual, {}), losses["standard"]
    return paired_gaps([mine[k] - base[k] for k in sorted(base) if k in mine])


def short_budget_rows() -> list[tuple[str, str, dict, dict]]:
    """(query lr multiplier, source, Block's gap, Full's gap) at `attnres compare`'s settings."""
    rows = []
    if stall := load("warmup_stall"):
        losses: dict[str, dict] = {}
        for r in stall["runs"].values():
            if r["warmup"] >= compare_command.WARMUP:  # the warm-ups that do not stall PreNorm
                losses.setdefault(r["residual"], {})[r["warmup"], r["seed"]] = r["val_loss"]
        rows.append((f"{stall['setup']['attn_res_lr_mult']:g}", "docs/warmup_stall.json, warm-ups "
                     f"{min(w for w, _ in losses['standard'])}-{max(w for w, _ in losses['standard'])}",
                     paired(losses, "block"), paired(losses, "full") if "full" in losses else paired_gaps([])))
    if main := load("compare_summary"):
        for name, data in (("compare_summary", main), ("compare_summary_x01", load("compare_summary_x01"))):
            if data is None:
                continue
            losses = compare_losses(data, baseline=main)
            rows.append((f"{data['config']['attn_res_lr_mult']:g}", f"docs/{name}.json",
                         paired(losses, "block"), paired(losses, "full")))
    return rows


def short_budget_table(rows: list) -> list[str]:
    lines = ["| query lr multiplier | runs | pairs | Block - standard [95%] | Full - standard [95%] |",
             "| --- | --- | --- | --- | --- |"]
    for mult, source, block, full in rows:
        lines.append(f"| {mult} | {source} | {block['n']} | {interval(block)} | {interval(full)} |")
    return lines


def short_budget_conclusion(rows: list) -> str:
    resolved, spans = [], []
    for mult, source, block, full in rows:
        for residual, stats in (("Block", block), ("Full", full)):
            if stats["ci95"] is None:
                continue
            where = f"{residual} at {mult}x ({source.split(',')[0]}, {stats['n']} pairs)"
            if stats["ci95"][0] > 0 or stats["ci95"][1] < 0:
                resolved.append(f"{where}: {verdict(stats)}")
            else:
                spans.append(where)
    return ("The 95% interval excludes 0 for " + ("; ".join(resolved) if resolved else "none of them") + ". "
            + ("It spans 0 for " + ", ".join(spans) + "." if spans else ""))


def sections() -> list[tuple[str, list[str]]]:
    """(title, lines) of every study with results."""
    out = []
    if data := load("budget"):
        out.append(("Budget: the gap against tokens and against time", [
            f"`{data['command']}`: {data['setup']['schedule'].upper()}, {data['setup']['warmup']} warm-up steps, peak lr "
            f"{data['setup']['lr']:g}, the AttnRes parameters at "
            f"{data['setup']['attn_res_lr_mult']:g}x; smaller budgets branch their decay from the largest run "
            "(`attnres train --branch-from`). Validation loss in nats per byte (mean ± std over seeds); gaps paired "
            "by seed with a 95% t interval; compute-matched: Block at B steps against standard interpolated at the "
            "steps it trains in the same time (Block's step-time ratio measured side by side, "
            f"`{(load('budget_step_time') or {}).get('command', 'not measured yet')}`).", "", *budget_table(data), "", budget_conclusion(data), "",
            "![budget](figures/budget.png)"]))
    if (rows := short_budget_rows()) and (stall := load("warmup_stall")) and (compare := load("compare_summary")):
        setup = stall["setup"]
        out.append(("Short budget: `attnres compare`'s setting", [
            f"{setup['steps']} {setup['schedule']} steps after a {compare_command.WARMUP}-step warm-up or longer, "
            f"{setup['layers']} layers, d={setup['dim']}, block size {setup['block_size']}, peak lr "
            f"{compare['config']['lr']:g} (`{stall['command']}`, `attnres compare`). Gaps in nats per byte, paired by "
            "seed (and by warm-up where several are pooled), with a 95% t interval.", "", *short_budget_table(rows),
            "", short_budget_conclusion(rows)]))
    if data := load("query_lr"):
        out.append(("Query learning rate", [
            f"`{data['command']}`: Block AttnRes at {data['setup']['size']}, {data['setup']['budget']} WSD steps "
            "(the budget study's setting), by the learning-rate multiplier of its pseudo-queries and key gains.", "",
            *query_lr_table(data), "", query_lr_conclusion(data)]))
    if data := load("stability"):
        out.append(("Stability: peak learning rate and warm-up", [
            f"`{data['command']}`: final validation loss after {data['setup']['steps']} cosine steps "
            f"({data['setup']['layers']} layers, d={data['setup']['dim']}, seed 0) and the steps spent on the plateau "
            f"between {data['setup']['plateau_band'][0]} and {data['setup']['plateau_band'][1]} nats/byte (resolution "
            "20 steps; 'never left': still above it at the end).", "", *stability_table(data), "",
            stability_conclusion(data), "", "![stability](figures/stability.png)"]))
    return out


def page() -> str:
    lines = ["# Results at small scale: AttnRes against PreNorm", "",
             "Generated by `python -m experiments.results` from the JSON beside this page. Byte-level language models "
             "on the Python standard library's sources (4 MiB, 5% held out), 16 x 128 bytes a step, one CPU thread a "
             "run.", ""]
    for title, body in sections():
        lines += [f"## {title}", "", *body, ""]
    stall = load("warmup_stall")
    if stall:
        lines += ["## Warm-up stall", "", "[warmup_stall.md](warmup_stall.md): with a 30-60 step warm-up at lr 3e-3 the PreNorm "
                  "baseline stalls on a plateau where AttnRes trains through; `attnres compare` warms up for 100 steps "
                  f"for that reason. (`{stall['command']}`)", "", "![warm-up stall](figures/warmup_stall.png)", ""]
    lines += ["## Beside the paper", "", PAPER, ""]
    return "\n".join(lines)


def draw_all() -> None:
    if data := load("budget"):
        budget.draw(data["runs"], ROOT / "docs" / "figures" / "budget.png", step_time_ratios())
    for name, module in (("query_lr", query_lr), ("stability", stability)):
        if data := load(name):
            module.draw(data["runs"], ROOT / "docs" / "figures" / f"{name}.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-figures", action="store_true", help="only the text")
    args = p.parse_args(argv)
    if not args.no_figures:
        draw_all()
    atomic_write_text(ROOT / "docs" / "results.md", page())
    print("docs/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
