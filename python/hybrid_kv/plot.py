"""Draw a plan's memory layout (buffers x groups, padding shaded). Imports matplotlib lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybrid_kv.planner import KVCachePlan, PlanError

__all__ = ["plot_plan"]

_COLOURS = {
    "full": "#4c72b0",
    "sliding_window": "#55a868",
    "chunked_local": "#8172b2",
    "mamba": "#dd8452",
}


def plot_plan(
    plan: KVCachePlan,
    path: str | Path,
    *,
    baseline: KVCachePlan | None = None,
    title: str = "",
) -> None:
    """Write a PNG: one row per group, one column per buffer; each layer's cell is coloured
    by attention type, padding slots are hatched grey. With `baseline`, two panels."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise PlanError("--plot needs matplotlib (pip install 'hybrid-kv[plot]')") from error

    plans = [plan] if baseline is None else [plan, baseline]
    width = max(p.num_buffers for p in plans)
    height = sum(p.num_groups for p in plans)
    figure, axes = plt.subplots(
        len(plans),
        1,
        figsize=(min(max(7.0, 2 + 0.35 * width), 24), 1.8 + 0.35 * height + 0.8 * len(plans)),
        squeeze=False,
    )
    for axis, current in zip(axes[:, 0], plans, strict=True):
        _draw(axis, current, Rectangle)
    handles = [Patch(facecolor=c, label=k) for k, c in _COLOURS.items()]
    handles.append(Patch(facecolor="#dddddd", hatch="///", label="padding"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.05, 1, 0.95))
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise PlanError(f"cannot write plot {path}: {error}") from None
    finally:
        plt.close(figure)


def _draw(axis: Any, plan: KVCachePlan, rectangle: Any) -> None:
    slots: dict[int, dict[int, str]] = {g.group_id: {} for g in plan.groups}
    for placement in plan.placements:
        if placement.shared_from is None:
            for buffer in placement.buffers:
                slots[placement.group_id][buffer] = placement.layer_name
    for row, group in enumerate(plan.groups):
        for buffer in range(plan.num_buffers):
            name = slots[group.group_id].get(buffer)
            if name is None:
                patch = rectangle(
                    (buffer, row), 1, 1, facecolor="#dddddd", hatch="///", edgecolor="white"
                )
            else:
                patch = rectangle(
                    (buffer, row), 1, 1, facecolor=_COLOURS[group.kind], edgecolor="white"
                )
            axis.add_patch(patch)
    axis.set_xlim(0, plan.num_buffers)
    axis.set_ylim(plan.num_groups, 0)
    axis.set_xlabel("buffer (one slice per block)")
    axis.set_ylabel("group")
    axis.set_yticks([g.group_id + 0.5 for g in plan.groups])
    axis.set_yticklabels([f"{g.group_id}: {g.kind} bs={g.block_size}" for g in plan.groups])
    axis.set_title(
        f"{plan.strategy}: {plan.num_groups} groups x {plan.num_buffers} buffers, "
        f"waste {plan.waste.waste_percent:.2f}% at {plan.waste.reference_len} tokens",
        fontsize=9,
    )
