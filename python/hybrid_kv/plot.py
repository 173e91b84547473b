"""Draw a plan's memory layout: one row per group, one block wide, each layer's page coloured
by attention type and padding hatched. Imports matplotlib lazily."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from hybrid_kv.planner import KVCachePlan, PlanError, format_bytes

__all__ = ["plan_figure", "plot_plan", "plot_target", "require_matplotlib"]

_COLOURS = {
    "full": "#4c72b0",
    "sliding_window": "#55a868",
    "chunked_local": "#8172b2",
    "mamba": "#dd8452",
}
_LABELS = {
    "full": "full attention",
    "sliding_window": "sliding window",
    "chunked_local": "chunked local",
    "mamba": "Mamba state",
}


def require_matplotlib() -> None:
    """Raise `PlanError` naming the `plot` extra when matplotlib is missing (checked before
    any work, so a missing extra fails at once)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install 'hybrid-kv[plot]'") from None


def plot_target(path: str | Path) -> Path:
    """Where `--plot path` writes, checked before any work: `path` itself, or `path.png` when it
    has no extension (where matplotlib would write it). Raises `PlanError` for a file type
    matplotlib cannot write, a missing or unwritable directory, or a path that is a directory
    (before or after the `.png`)."""
    import matplotlib.figure

    target = Path(path)
    if not target.name or target.name in (".", ".."):
        raise PlanError(f"--plot {path}: not a file name")
    if target.is_dir():
        # Not `path.png` beside it: a directory given is a mistake, not a file name.
        raise PlanError(f"--plot {target} is a directory")
    if not target.suffix:
        target = target.with_name(target.name + ".png")
    formats = matplotlib.figure.Figure().canvas.get_supported_filetypes()
    if target.suffix[1:].lower() not in formats:
        raise PlanError(
            f"--plot {path}: matplotlib cannot write {target.suffix} files "
            f"(it writes {', '.join('.' + f for f in sorted(formats))})"
        )
    if target.is_dir():
        raise PlanError(f"--plot {target} is a directory")
    parent = target.parent
    if not parent.is_dir():
        raise PlanError(f"--plot {target}: no such directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PlanError(f"--plot {target}: cannot write in {parent}")
    return target


def plot_plan(
    plan: KVCachePlan,
    path: str | Path,
    *,
    baseline: KVCachePlan | None = None,
    title: str = "",
) -> None:
    """Write `plan_figure` as a PNG."""
    figure = plan_figure(plan, baseline=baseline, title=title)
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=120)
    except OSError as error:
        raise PlanError(f"cannot write plot {path}: {error}") from None
    finally:
        plt.close(figure)


def plan_figure(plan: KVCachePlan, *, baseline: KVCachePlan | None = None, title: str = "") -> Any:
    """A figure of the plan's blocks (and `baseline`'s, in a second panel): one row per
    group; along the row the pages of its layers, padding hatched grey. When every page has
    one size the axis counts pages (integer ticks), else bytes. The legend (below the panels)
    lists only the kinds present."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    plans = [plan] if baseline is None else [plan, baseline]
    height = sum(max(p.num_groups, 1) for p in plans)
    figure, axes = plt.subplots(
        len(plans),
        1,
        figsize=(10, 1.6 + 0.38 * height + 1.0 * len(plans)),
        squeeze=False,
    )
    kinds: set[str] = set()
    padded = False
    for axis, current in zip(axes[:, 0], plans, strict=True):
        used_kinds, has_padding = _draw(axis, current, Rectangle)
        kinds |= used_kinds
        padded |= has_padding
    handles = [Patch(facecolor=_COLOURS[k], label=_LABELS[k]) for k in _COLOURS if k in kinds]
    if padded:
        handles.append(Patch(facecolor="#dddddd", hatch="///", label="padding"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    heading = f"{title}: " if title else ""
    figure.suptitle(
        f"{heading}{format_bytes(plan.memory_bytes)} budget, max_model_len "
        f"{plan.max_model_len:,}, layout {plan.kv_cache_layout}",
        fontsize=10,
    )
    figure.tight_layout(rect=(0, 0.06, 1, 0.95))
    return figure


def _draw(axis: Any, plan: KVCachePlan, rectangle: Any) -> tuple[set[str], bool]:
    pages = {p.page_bytes for p in plan.placements}
    unit = pages.pop() if len(pages) == 1 else 1
    width = plan.block_bytes / unit
    kinds: set[str] = set()
    padded = False
    by_name = {p.layer_name: p for p in plan.placements}
    for row, group in enumerate(plan.groups):
        x = 0.0
        for name in group.layer_names:
            page = by_name[name].page_bytes / unit
            axis.add_patch(
                rectangle((x, row), page, 1, facecolor=_COLOURS[group.kind], edgecolor="white")
            )
            x += page
        kinds.add(group.kind)
        if group.padding_bytes:
            padded = True
            axis.add_patch(
                rectangle(
                    (x, row),
                    group.padding_bytes / unit,
                    1,
                    facecolor="#dddddd",
                    hatch="///",
                    edgecolor="white",
                )
            )
    axis.set_xlim(0, max(width, 1))
    axis.set_ylim(max(plan.num_groups, 1), 0)
    if unit > 1:
        axis.set_xlabel(f"page within a block ({format_bytes(unit)} each)")
        step = max(1, math.ceil(width / 20))
        axis.set_xticks(range(0, int(width) + 1, step))
    else:
        axis.set_xlabel("bytes within a block")
    axis.set_ylabel("KV cache group")
    axis.set_yticks([g.group_id + 0.5 for g in plan.groups])
    axis.set_yticklabels([f"{g.group_id}: {g.kind} bs={g.block_size}" for g in plan.groups])
    axis.set_title(
        f"{plan.strategy}: {plan.num_groups} groups, {format_bytes(plan.block_bytes)} blocks, "
        f"{plan.waste.waste_percent:.2f}% expected waste, "
        f"max concurrency {plan.max_concurrency or 0:.2f}x",
        fontsize=9,
    )
    return kinds, padded
