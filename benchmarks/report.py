"""The benchmark's record as markdown tables, and the targets it is read against."""

from __future__ import annotations


def markdown(results: dict[int, dict], overhead: dict, layouts: dict) -> str:
    lines = []
    for world_size, variants in results.items():
        lines += [
            f"**{world_size} rank{'s' if world_size > 1 else ''}**",
            "",
            "| variant | median step (ms) | p25-p75 (ms) | ratio to baseline (p25-p75) "
            "| collectives / step beyond DDP's | bytes / step beyond DDP's | host syncs / step |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in variants.items():
            collectives = _collectives(r)
            syncs = f"{r['host_reads_per_step']:g}"
            if r["device_syncs_per_step"] is not None:
                syncs += f" ({r['device_syncs_per_step']:g} by CUDA)"
            lines.append(
                f"| {name} | {r['median_ms']:.1f} | {r['p25_ms']:.1f}-{r['p75_ms']:.1f} "
                f"| {r['ratio_to_baseline']:.3f} ({r['ratio_p25']:.3f}-{r['ratio_p75']:.3f}) "
                f"| {collectives} | {r['bytes_per_step']:g} | {syncs} |"
            )
        ddp = next(iter(variants.values()))  # the baseline: DDP's reduction alone
        lines += [
            "",
            f"DDP's own gradient reduction, in every variant: {_collectives(ddp, 'all_')} "
            f"({ddp['all_bytes_per_step']:g} bytes) per step.",
            "",
        ]
    lines += ["| per-microbatch call | µs per call |", "|---|---|"]
    lines += [f"| `{name}` | {us:.1f} |" for name, us in overhead["per_call_us"].items()]
    lines += ["", "| lossweight's own work per step (1 process) | µs per step |", "|---|---|"]
    lines += [f"| {mode} | {us:.0f} |" for mode, us in overhead["per_step_us"].items()]
    lines += [
        "",
        "| lossweight's own work per step, with its reductions (gloo processes) | µs per step |",
        "|---|---|",
    ]
    lines += [f"| {mode} | {us:.0f} |" for mode, us in overhead["group_per_step_us"].items()]
    lines += [
        "",
        "| scale after, 1 process | graph walk per microbatch, ms | backward counters per "
        "step, ms | forward and backward, ms | walk / forward and backward |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| GPT, {depth} | {t['walk_ms']:.2f} | {t['counters_ms']:.2f} "
        f"| {t['forward_backward_ms']:.1f} | {t['walk_ms'] / t['forward_backward_ms']:.3f} |"
        for depth, t in overhead["walk"].items()
    ]
    lines.append("")
    if layouts:
        lines += ["lossweight's collectives per step, by parallel layout:", ""]
        lines.append(layouts_markdown(layouts))
    return "\n".join(lines)


def targets(results: dict[int, dict], overhead: dict) -> list[str]:
    """The targets the numbers are read against (reported, not asserted).

    The step-time ratio of a variant is only as precise as the A/A control's spread; the
    library's own time per step, over the baseline's median step, is the precise figure.
    """
    report = []
    # Each variant's own-work figure, and the collectives per step its design calls for.
    modes = {
        "lossweight count-first": ("count first, loss_logging='next_step'", 1),
        "lossweight count-first, loss in end()": ("count first, loss_logging='end'", 2),
        "lossweight scale-after": ("scale after", 1),
    }
    for world_size, variants in results.items():
        baseline_us = 1e3 * variants["baseline: loss / k"]["median_ms"]
        control = variants["baseline again (A/A control)"]
        noise = max(1 - control["ratio_p25"], control["ratio_p75"] - 1)
        for name, (mode, target) in modes.items():
            r = variants[name]
            collectives = sum(r["collectives_per_step"].values())
            own = overhead["per_step_us"][mode] / baseline_us
            report.append(
                f"{world_size} rank(s), {name}: own work {100 * own:.2f}% of the baseline step "
                f"(target <= 1%: {'met' if own <= 0.01 else 'not met'}); measured ratio "
                f"{r['ratio_to_baseline']:.3f}, A/A control {control['ratio_to_baseline']:.3f} "
                f"+- {noise:.3f}; {collectives:g} collective(s)/step (target {target}: "
                f"{'met' if collectives == target else 'not met'}); "
                f"{r['host_reads_per_step']:g} host syncs/step (target 0: "
                f"{'met' if r['host_reads_per_step'] == 0 else 'not met'})"
            )
        one = variants["lossweight count-first"]
        for name in ("lossweight count-first, 2 terms", "lossweight count-first, 4 terms"):
            r = variants[name]
            collectives = sum(r["collectives_per_step"].values())
            report.append(
                f"{world_size} rank(s), {name}: {collectives:g} collective(s)/step (target 1: "
                f"{'met' if collectives == 1 else 'not met'}) of {r['bytes_per_step']:g} bytes; "
                f"median step {r['median_ms'] / one['median_ms']:.3f} of the one-term step's"
            )
    return report


def _collectives(figures: dict, prefix: str = "") -> str:
    per_step = figures[f"{prefix}collectives_per_step"]
    return ", ".join(f"{n:g} {name}" for name, n in sorted(per_step.items())) or "0"


def layouts_markdown(layouts: dict[str, dict[str, dict]]) -> str:
    """The collectives, bytes and host syncs per step of each layout (a row) in each mode (a
    column)."""
    modes = list(next(iter(layouts.values())))
    lines = [
        "| layout (4 ranks) | "
        + " | ".join(f"{m}: collectives; bytes; host syncs" for m in modes)
        + " |",
        "|---|" + "---|" * len(modes),
    ]
    for layout, figures in layouts.items():
        cells = [
            f"{_collectives({'collectives_per_step': f['calls']})}; {f['bytes']:g}; "
            f"{f['host_syncs']:g}"
            if "calls" in f
            else "differs by rank"
            for f in (figures[m] for m in modes)
        ]
        lines.append(f"| {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
