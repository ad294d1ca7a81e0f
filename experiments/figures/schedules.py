"""The merge schedules of a run folder (``OUT/<folder>/schedules.png``): per merged run, the fraction of tokens
removed per denoising step (from its block-call records, ``maps/<run>.json``), the requested ratio dashed, the
phases of its schedule shaded."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .canvas import new_figure, save_figure
from .run_data import RunData

__all__ = ["PHASE_COLOURS", "step_profile", "schedule_figure"]

PHASE_COLOURS = {"structure": "tab:blue", "detail": "tab:orange", "protected": "tab:gray", "merge": "tab:green",
                 "skip_step": "tab:gray", "skip_block": "tab:brown", "skip": "tab:gray"}


def step_profile(records: Sequence[dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[str]]:
    """Per step (over all trajectories and layers): fraction of tokens removed (unmerged calls count 0),
    mean requested ratio, and the most common decision label.

    Example:
        >>> rec = [dict(step=0, ratio=0.5, num_tokens=4, num_removed=2, label="a"),
        ...        dict(step=0, ratio=0.0, num_tokens=0, num_removed=0, label="skip"),
        ...        dict(step=1, ratio=0.5, num_tokens=4, num_removed=1, label="a")]
        >>> step_profile(rec)
        ([0, 1], [0.25, 0.25], [0.25, 0.5], ['a', 'a'])
    """
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[int(r["step"])].append(r)
    steps = sorted(by_step)
    removed = [sum(r["num_removed"] / r["num_tokens"] if r["num_tokens"] else 0.0 for r in by_step[s])
               / len(by_step[s]) for s in steps]
    ratios = [sum(float(r["ratio"]) for r in by_step[s]) / len(by_step[s]) for s in steps]
    labels = [Counter(r["label"] for r in by_step[s]).most_common(1)[0][0] for s in steps]
    return steps, removed, ratios, labels


def schedule_figure(data: RunData, stem: Path, formats: Sequence[str] = ("png",)) -> list[Path]:
    """One panel per merged run: removed fraction and requested ratio over steps, phases shaded."""
    from matplotlib.patches import Patch

    runs = [(r["run"], step_profile(data.records(r["run"]))) for r in data.merged]
    runs = [(name, prof) for name, prof in runs if prof[0]]
    if not runs:
        return []
    fig = new_figure(7.5, 0.9 + 1.3 * len(runs))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0]
    phases: dict[str, str] = {}
    for ax, (name, (steps, removed, ratios, labels)) in zip(axes, runs):
        if len(set(labels)) > 1:
            start = 0
            for i in range(1, len(steps) + 1):
                if i == len(steps) or labels[i] != labels[start]:
                    colour = phases.setdefault(labels[start], PHASE_COLOURS.get(labels[start], f"C{len(phases) + 3}"))
                    ax.axvspan(steps[start] - 0.5, steps[i - 1] + 0.5, color=colour, alpha=0.15, linewidth=0)
                    start = i
        ax.plot(steps, removed, marker=".", color="black", linewidth=1.2, label="tokens removed (measured)")
        ax.plot(steps, ratios, "--", color="tab:red", linewidth=1, label="requested ratio (mean over layers)")
        ax.set_ylim(-0.02, max(1.0, max(ratios) * 1.05))
        ax.set_ylabel("fraction", fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("denoising step")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    handles, names = axes[0].get_legend_handles_labels()
    handles += [Patch(color=c, alpha=0.3) for c in phases.values()]
    names += [f"phase: {p}" for p in phases]
    fig.legend(handles, names, loc="outside lower center", ncols=min(4, len(names)), fontsize=8, frameon=False)
    fig.suptitle(f"Merge schedules: {data.name}", fontsize=10)
    return save_figure(fig, stem, formats)
