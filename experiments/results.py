"""The results page, regenerated from the studies' committed JSON.

    python -m experiments.results            # writes docs/results.md and redraws its figures

Reads docs/budget.json, docs/query_lr.json, docs/stability.json, docs/upcycle.json, docs/real_upcycle.json and
docs/warmup_stall.json
(written by the scripts of the same names) and docs/compare_summary*.json (`attnres compare`'s summaries, at the query
lr multipliers 1 and 0.1); every number on the page is computed here from those files, and so is every conclusion
(tests/analysis/test_results_page.py checks that the committed page matches them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from attnres.analysis.report import seed_losses
from attnres.analysis.stats import paired_gaps, seeds_to_resolve
from attnres.atomic import atomic_write_text
from attnres.training import TrainConfig
from attnres.commands import compare as compare_command
from experiments import budget, query_lr, real_upcycle, stability, upcycle
from experiments.study import verdict

ROOT = Path(__file__).resolve().parents[1]
PAPER = ("The paper (Kimi Team 2026) reports Block AttnRes (8 blocks) about 0.02 nats lower validation loss than PreNorm "
         "at every size from 194M to 528M activated parameters (at 436M: baseline 1.766, Full 1.737, Block 1.746), "
         "with far more tokens than any run here.")
PUBLIC_UPCYCLE = ("The public evidence on upcycling is thin: a plain AttnRes fine-tune of Qwen3-0.6B scored 54.1 on a "
                  "downstream average against 55.0 for the plain fine-tune (delta-attention-residuals).")
ARM_NAMES = {"standard": "standard", "block": "Block", "full": "Full",
             "block-frozen": "frozen-base Block (`--freeze-base`)", "standard-matched": "standard, compute-matched"}


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


def upcycle_continue_table(data: dict) -> list[str]:
    summary = data["summary"]
    losses, ratios = summary["continue_val_loss"], summary["step_time_ratio"]
    lines = ["| continued as | seeds | val loss | minus continued standard [95%] | reading | step time |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| standard | {len(losses[upcycle.STANDARD])} | {spread(list(losses[upcycle.STANDARD].values()))} "
             "|  |  | 1x |"]
    for row in summary["continue"]:
        lines.append(f"| {ARM_NAMES[row['arm']]} | {row['gap_to_standard']['n']} "
                     f"| {spread(list(losses.get(row['arm'], {}).values()))} | {interval(row['gap_to_standard'])} "
                     f"| {row['verdict']} | {ratios[row['arm']]:.2f}x |")
    return lines


def continue_rows(summary: dict) -> dict[str, dict]:
    """Each continuation arm's row of the upcycle summary (its gap to continued standard, its verdict), by arm."""
    return {r["arm"]: r for r in summary["continue"]}


def upcycle_continue_conclusion(data: dict) -> str:
    summary = data["summary"]
    rows = [r for r in summary["continue"] if r["gap_to_standard"]["ci95"] is not None]
    below = [ARM_NAMES[r["arm"]] for r in rows if r["gap_to_standard"]["ci95"][1] < 0]
    above = [ARM_NAMES[r["arm"]] for r in rows if r["gap_to_standard"]["ci95"][0] > 0]
    spans = [ARM_NAMES[r["arm"]] for r in rows if ARM_NAMES[r["arm"]] not in below + above]
    standard = summary["continue_val_loss"][upcycle.STANDARD].values()
    gain = statistics.mean(standard) - summary["pretrain_val_loss"]  # what continued standard training moved
    arms = continue_rows(summary)
    block, full = arms[upcycle.BLOCK]["gap_to_standard"], arms[upcycle.FULL]["gap_to_standard"]
    matched = summary["compute_matched"]
    return (f"Converted at step 0, every continuation starts at the pretrained model's loss (the largest difference "
            f"{summary['step0_minus_pretrain_max_abs']:.1e} nats/byte). After "
            f"{data['setup']['continue']['steps']} steps, continued standard training is {-gain:.4f} below the "
            "pretrained model (which is far from converged: the continuation is more training on the same corpus, "
            "not a fine-tune on new data). The seed, which draws the batches, moves continued standard's loss by "
            f"{statistics.stdev(standard):.4f} (std), but paired on the same batches Block's and Full's gaps vary far "
            f"less (std {block['std']:.4f} and {full['std']:.4f}). The 95% interval of the gap to continued standard "
            f"lies below 0 for {'; '.join(below) or 'none'}; above 0 for {'; '.join(above) or 'none'}; it spans 0 "
            f"for {'; '.join(spans) or 'none'}. Block's mean gain ({block['mean']:+.4f}) is "
            f"{100 * block['mean'] / gain:.1f}% of what the continuation itself gains. "
            f"Compute-matched: Block's steps take {summary['step_time_ratio'][upcycle.BLOCK]:.2f}x standard's "
            f"(measured side by side, {data['setup']['threads']} thread), so in Block's training time standard "
            f"trains {matched['standard_steps']} steps; Block minus that run: {interval(matched['gap'])}, "
            f"{matched['verdict']}. Frozen base: the AttnRes parameters alone move the loss "
            f"{interval(arms['block-frozen']['minus_pretrained'])} from the pretrained model's, against {gain:+.4f} "
            "when every weight trains.")


def upcycle_depth_table(data: dict) -> list[str]:
    losses = data["summary"]["depth_val_loss"]
    lines = ["| layers | seeds | standard | Block | Block - standard [95%] | reading |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in data["summary"]["depth"]:
        standard, block = (list(losses.get(f"L{row['layers']}-{res}", {}).values())
                           for res in (upcycle.STANDARD, upcycle.BLOCK))
        lines.append(f"| {row['layers']} | {row['gap']['n']} | {spread(standard)} | {spread(block)} "
                     f"| {interval(row['gap'])} | {row['verdict']} |")
    return lines


def upcycle_depth_conclusion(data: dict) -> str:
    summary, setup = data["summary"], data["setup"]["depth"]
    rows = [r for r in summary["depth"] if r["gap"]["n"] > 1]
    if not rows:
        return "Too few seeds have finished for an interval."
    widening = summary["depth_widening"]
    standard = {r["layers"]: list(summary["depth_val_loss"][f"L{r['layers']}-{upcycle.STANDARD}"].values())
                for r in rows}
    losses = [statistics.stdev(v.values()) for v in summary["depth_val_loss"].values() if len(v) > 1]
    gap_stds = [r["gap"]["std"] for r in rows]
    first, last = rows[0]["layers"], rows[-1]["layers"]
    resolved = [r for r in rows if r["gap"]["ci95"][0] > 0 or r["gap"]["ci95"][1] < 0]
    deeper = statistics.mean(standard[last]) - statistics.mean(standard[first])
    ci = widening["gap"]["ci95"]
    trend = ("the gap widens with depth (AttnRes gains more), as the paper argues" if ci and ci[1] < 0
             else "the gap narrows with depth here" if ci and ci[0] > 0
             else "the gap does not measurably widen with depth here")
    largest = max(abs(r["gap"]["mean"]) for r in rows)
    return (f"The 95% interval spans 0 at {len(rows) - len(resolved)} of {len(rows)} depths. Gap at {last} layers "
            f"minus gap at {first}, paired by seed: {interval(widening['gap'])}: {trend}. "
            + ("These from-scratch runs are noisy: the" if max(gap_stds) >= largest else "The")
            + f" seed spread (std) of one depth's losses is {min(losses):.4f}-{max(losses):.4f} nats/byte and of "
              f"its paired gaps {min(gap_stds):.4f}-{max(gap_stds):.4f}, against mean gaps of at most {largest:.4f}. "
            + (f"At {setup['steps']} steps and d={setup['dim']} the deeper models have not caught up either "
               f"(standard at {last} layers {deeper:+.4f} against {first}), so this is not the regime where the "
               "paper's argument about depth applies." if deeper > 0 else ""))


def upcycle_reading(data: dict) -> str:
    """The continuation beside the public evidence, in words computed from the JSON."""
    summary = data["summary"]
    block = continue_rows(summary)[upcycle.BLOCK]["gap_to_standard"]
    matched = summary["compute_matched"]["gap"]
    if block["ci95"] is None or matched["ci95"] is None:
        return PUBLIC_UPCYCLE
    at_steps = ("gains a little" if block["ci95"][1] < 0 else "loses" if block["ci95"][0] > 0
                else "gains nothing measurable")
    at_time = ("gains" if matched["ci95"][1] < 0 else "loses" if matched["ci95"][0] > 0 else "gains nothing measurable")
    return (f"{PUBLIC_UPCYCLE} Here, converting the pretrained model and training on {at_steps} against continued "
            f"standard training at equal steps (Block {block['mean']:+.4f} nats/byte) and {at_time} at equal "
            f"training time (Block {matched['mean']:+.4f}). "
            + ("Unlike the public fine-tune, upcycling pays here even at equal compute. "
               if matched["ci95"][1] < 0 else "Neither shows upcycling paying for its cost. ")
            + "The two measure different things (a downstream average at 0.6B parameters against the validation "
              f"loss of a {data['runs']['pretrain']['num_params'] / 1e6:.2f}M-parameter byte-level model after "
              f"{data['setup']['continue']['steps']} steps), so neither predicts the other at scale; the paper "
              "trains AttnRes from scratch.")


def upcycle_cost(data: dict) -> str:
    timed = [r for r in data["runs"].values() if "train_s" in r]
    return (f"`{data['command']}` ({len(timed)} runs, {data['setup']['threads']} thread each: their training steps "
            f"took {sum(r['train_s'] for r in timed) / 3600:.1f} h, {sum(r['cpu_s'] for r in timed) / 3600:.1f} h of "
            "CPU time, the wall-clock time depending on what ran beside them; `--parts` and `--seeds` split it over "
            "processes that share the ledger)")


def upcycle_section(data: dict) -> list[str]:
    setup, pretrain = data["setup"], data["setup"]["pretrain"]
    cont, depth = setup["continue"], setup["depth"]
    return [
        f"{upcycle_cost(data)}. A standard model ({pretrain['layers']} layers, d={pretrain['dim']}, "
        f"{data['runs']['pretrain']['num_params']:,} parameters) pretrained for {pretrain['steps']} steps (validation "
        f"loss {data['summary']['pretrain_val_loss']:.4f}) continues from its `final/` (`attnres train --init-from`) "
        f"for {cont['steps']} steps (a fresh {cont['warmup']}-step warm-up, cosine, peak lr {cont['lr']:g}) as "
        f"standard, Block (block size {cont['block_size']}), Full, and Block with `--freeze-base` (the AttnRes "
        f"parameters alone, at {cont['arms']['block-frozen']['attn_res_lr_mult']:g}x; Block and Full train them at "
        f"{TrainConfig.attn_res_lr_mult:g}x). The continuation seed draws the batches; gaps in nats per byte, paired "
        "by seed, with a 95% t interval; step time relative to continued standard's, measured side by side.", "",
        *upcycle_continue_table(data), "", upcycle_continue_conclusion(data), "",
        f"Depth, from scratch: Block (block size {depth['block_size']}) against standard at "
        f"{', '.join(map(str, depth['layers']))} layers, d={depth['dim']}, the same tokens ({depth['steps']} "
        f"{depth['schedule']} steps, peak lr {depth['lr']:g}).", "",
        *upcycle_depth_table(data), "", upcycle_depth_conclusion(data), "",
        upcycle_reading(data), "", "![upcycle](figures/upcycle.png)"]


def upcycle_readme(data: dict) -> str:
    """The README's lines on upcycling (tests/analysis/test_results_page.py checks that the README quotes them)."""
    summary = data["summary"]
    gaps = {arm: row["gap_to_standard"] for arm, row in continue_rows(summary).items()}
    return (f"Continuing a pretrained standard model (L{data['setup']['pretrain']['layers']}-"
            f"d{data['setup']['pretrain']['dim']}, {data['setup']['continue']['steps']} steps, "
            f"{gaps[upcycle.BLOCK]['n']} seeds), Block ends {interval(gaps[upcycle.BLOCK])} nats/byte against "
            f"continued standard (95% interval), Full {interval(gaps[upcycle.FULL])} and `--freeze-base` "
            f"{interval(gaps['block-frozen'])}; at equal training time (Block's steps take "
            f"{summary['step_time_ratio'][upcycle.BLOCK]:.2f}x) Block minus standard is "
            f"{interval(summary['compute_matched']['gap'])}.")


def resolution(gap: dict | None, target: float = 0.01) -> str:
    """What the seeds of a paired gap can resolve, and how many a gap of `target` nats would take."""
    if not gap or gap["std"] is None:
        return ""
    half = (gap["ci95"][1] - gap["ci95"][0]) / 2
    if half <= target:
        return f"With {gap['n']} seeds the Block gap's interval is +-{half:.3f} wide: it resolves {target:g} nats. "
    need = seeds_to_resolve(gap["std"], target)
    return (f"With {gap['n']} seeds the Block gap's interval is +-{half:.3f} wide, so it cannot resolve a gap of "
            f"{target:g} nats: its per-seed gaps spread by {gap['std']:.4f}, and an interval of +-{target:g} takes "
            f"{need or 'more than 1000'} seeds (`--seeds` adds more to the ledger). ")


def real_upcycle_section(data: dict) -> list[str]:
    """SmolLM2-135M continued as standard, Block, Full and frozen-base Block: whatever seeds the ledger holds."""
    summary, setup = data["summary"], data["setup"]
    cont, losses = setup["continue"], summary["val_loss"]
    rows = ["| continued as | seeds | val loss (nats/token) | minus continued standard [95%] | reading |",
            "| --- | --- | --- | --- | --- |",
            f"| standard | {len(losses.get('standard', {}))} | {spread(list(losses.get('standard', {}).values()))} | | |"]
    for row in summary["continue"]:
        if row["arm"] == real_upcycle.MATCHED:
            continue
        rows.append(f"| {ARM_NAMES[row['arm']]} | {row['gap_to_standard']['n']} "
                    f"| {spread(list(losses.get(row['arm'], {}).values()))} | {interval(row['gap_to_standard'])} "
                    f"| {row['verdict']} |")
    matched = summary["compute_matched"]
    ratio = (summary["step_time_ratio"] or {}).get(real_upcycle.BLOCK)
    gaps = {r["arm"]: r["gap_to_standard"] for r in summary["continue"]}
    seeds = min((g["n"] for arm, g in gaps.items() if arm != real_upcycle.MATCHED), default=0)
    reading = (
        f"Every arm starts at the pretrained model's own loss ({', '.join(f'{v:.4f}' for v in summary['step0_val_loss'])}"
        " at step 0: the conversion is exact). "
        + (f"Compute-matched: Block's steps took {ratio:.2f}x standard's (measured side by side in the study's "
           f"process, 1 thread), so standard trains {matched['standard_steps']} steps in Block's time; Block "
           f"minus that run: {interval(matched['gap'])}, {matched['verdict']}. " if ratio else "")
        + (f"With {seeds} seed{'s' if seeds != 1 else ''} of every arm so far, this is no verdict yet: the study "
           "resumes from its ledger (`python -m experiments.real_upcycle`) until every arm has 3 seeds. "
           if seeds < 3 else "")
        + resolution(gaps.get(real_upcycle.BLOCK))
        + "The anchors: " + PUBLIC_UPCYCLE[0].lower() + PUBLIC_UPCYCLE[1:] + " The paper's from-scratch gains are "
        "about 0.02 nats at 194M-528M parameters.")
    return [
        f"`{data['command']}`: SmolLM2-135M-Instruct (`attnres fetch smollm2-135m`, dequantized from its 4-bit GGUF "
        f"file) continued for {cont['steps']} steps of {setup['data']['batch_size']} x {setup['data']['seq_len']} "
        f"tokens of the Python standard library's sources in its own tokenizer (the last 5% of the files held out), "
        f"a {cont['warmup']}-step warm-up and cosine from a peak lr of {cont['lr']:g}, each arm one `attnres train "
        f"--init-from` run per seed (the seed draws the batches): standard, Block (block size {cont['block_size']}) "
        f"and Full with the AttnRes parameters at {cont['attn_res_lr_mult']:g}x, and Block with `--freeze-base` "
        f"(the AttnRes parameters alone, at {cont['arms']['block-frozen']['attn_res_lr_mult']:g}x). Gaps paired by "
        "seed, with a 95% t interval.", "", *rows, "", reading, "",
        "![real upcycle](figures/real_upcycle.png)", "",
        "Which sources each point reads after continued training (seed 0; the paper's figure 8):", "",
        "![depth weights](figures/real_depth_weights.png)"]


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
    if data := load("upcycle"):
        out.append(("Upcycling: continuing a pretrained model as AttnRes", upcycle_section(data)))
    if data := load("real_upcycle"):
        out.append(("A real model: SmolLM2-135M continued as AttnRes", real_upcycle_section(data)))
    return out


def page() -> str:
    lines = ["# Results: AttnRes against PreNorm", "",
             "Generated by `python -m experiments.results` from the JSON beside this page. Byte-level language models "
             "on the Python standard library's sources (4 MiB, 5% held out), 16 x 128 bytes a step, one CPU thread a "
             "run, and a real pretrained model (SmolLM2-135M) continued on the same sources.", ""]
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
    for name, module in (("query_lr", query_lr), ("stability", stability), ("upcycle", upcycle),
                         ("real_upcycle", real_upcycle)):
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
