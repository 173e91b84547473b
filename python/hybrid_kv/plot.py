"""Draw a plan's memory layout: one row per group, one block wide, each layer's page coloured
by attention type and padding hatched; with pipeline stages, one block of each stage's GPU.
Imports matplotlib lazily."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

from hybrid_kv.planner import KVCachePlan, PipelineStage, PlanError, format_bytes
from hybrid_kv.planner.memory import format_count

__all__ = ["plan_figure", "plot_plan", "plot_target", "require_matplotlib", "save_figure"]

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
        raise PlanError(f"--plot {str(path)!r}: not a file name")
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
    """Write `plan_figure` to `path` (`save_figure`)."""
    save_figure(plan_figure(plan, baseline=baseline, title=title), path, dpi=120)


def save_figure(figure: Any, path: str | Path, *, dpi: int) -> None:
    """Write `figure` to `path` whole or not at all, in the format its extension names (PNG
    without one, written to `path.png` as matplotlib writes it), and close the figure.

    matplotlib writes the file as it draws, so the figure goes to `path.partial` beside it and
    is renamed over `path` once complete: Ctrl-C or a full disk in the middle leaves no cut
    image, and an earlier file of that name whole. A symlink's target is the file replaced; a
    `path` that exists and is not a regular file (/dev/null, a FIFO) is written directly.
    Raises `PlanError` when it cannot be written.
    """
    import matplotlib.pyplot as plt

    target = Path(path)
    if not target.suffix:
        target = target.with_name(target.name + ".png")
    direct = target.exists() and not target.is_file()
    # Through a symlink, the file it names is replaced (as matplotlib writes through it).
    final = Path(os.path.realpath(target)) if target.is_symlink() else target
    partial = target if direct else final.with_name(final.name + ".partial")
    try:
        figure.savefig(partial, dpi=dpi, format=target.suffix[1:].lower())
        if not direct:
            os.replace(partial, final)
    except OSError as error:
        raise PlanError(f"cannot write plot {target}: {error}") from None
    finally:
        plt.close(figure)
        if not direct:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)


def plan_figure(plan: KVCachePlan, *, baseline: KVCachePlan | None = None, title: str = "") -> Any:
    """A figure of the plan's blocks (and `baseline`'s, below): one row per group; along the
    row the pages of its layers, padding hatched grey. A plan with pipeline stages gets a
    panel per stage, one block of that stage's GPU: its layers' pages, the rest of its block
    hatched, its pool against its own budget in the panel's title. When every page has one
    size the axis counts pages (integer ticks), else bytes. The legend (below the panels)
    lists only the kinds present."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    plans = [plan] if baseline is None else [plan, baseline]
    panels = [(current, stage) for current in plans for stage in _panel_stages(current)]
    height = sum(max(current.num_groups, 1) for current, _ in panels)
    # A stage's panel has two or three title lines where a plan's one has one.
    titles = sum(_panel_title(current, stage).count("\n") for current, stage in panels)
    figure, axes = plt.subplots(
        len(panels),
        1,
        figsize=(10, 1.6 + 0.38 * height + 1.0 * len(panels) + 0.2 * titles),
        squeeze=False,
    )
    kinds: set[str] = set()
    padded = False
    for axis, (current, stage) in zip(axes[:, 0], panels, strict=True):
        used_kinds, has_padding = _draw(axis, current, Rectangle, stage)
        kinds |= used_kinds
        padded |= has_padding
    handles = [Patch(facecolor=_COLOURS[k], label=_LABELS[k]) for k in _COLOURS if k in kinds]
    if padded:
        handles.append(Patch(facecolor="#dddddd", hatch="///", label="padding"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    heading = f"{title}: " if title else ""
    figure.suptitle(
        f"{heading}{_budget_text(plan)}, max_model_len "
        f"{plan.max_model_len:,}, layout {plan.kv_cache_layout}",
        fontsize=10,
    )
    figure.tight_layout(rect=(0, 0.06, 1, 0.95))
    return figure


def _panel_stages(plan: KVCachePlan) -> tuple[PipelineStage | None, ...]:
    """The panels a plan gets: one per pipeline stage, or one (None) for the whole block."""
    return plan.stages if len(plan.stages) > 1 else (None,)


def _budget_text(plan: KVCachePlan) -> str:
    """The suptitle's budget: the plan's, or with stages each stage GPU's."""
    if len(plan.stages) <= 1:
        return f"{format_bytes(plan.memory_bytes)} budget"
    budgets = [format_bytes(stage.memory_bytes) for stage in plan.stages]
    each = budgets[0] if len(set(budgets)) == 1 else " / ".join(budgets)
    return f"{len(plan.stages)} pipeline stages, {each} budget per GPU"


def _summary(plan: KVCachePlan, block: str) -> str:
    return (
        f"{plan.strategy}: {format_count(plan.num_groups, 'group')}, {block}, "
        f"{plan.waste.waste_percent:.2f}% expected waste, "
        f"max concurrency {plan.max_concurrency or 0:.2f}x"
    )


def _panel_title(plan: KVCachePlan, stage: PipelineStage | None) -> str:
    """A panel's title: the plan's line for its whole block, or `_stage_title`."""
    if stage is None:
        return _summary(plan, f"{format_bytes(plan.block_bytes)} blocks")
    return _stage_title(plan, stage)


def _stage_title(plan: KVCachePlan, stage: PipelineStage) -> str:
    """A stage panel's title: the plan's line over its first stage, then the stage's layers and
    block, then its pool against its own budget."""
    lines = []
    if stage.index == 0:
        whole = f"{format_bytes(plan.block_bytes)} blocks over all stages"
        lines.append(_summary(plan, whole))
    sharing = plan.kv_sharing
    shared = sum(name in sharing for name in stage.layer_names)
    layers = f"{len(stage.layer_names) - shared} KV-cache layers"
    if shared:
        # They have no page: they read their targets', on the same stage.
        layers += f", {shared} sharing theirs"
    # Every stage holds a decoder layer (the planner refuses a split leaving one without).
    lines.append(
        f"{plan.strategy} stage {stage.index}'s GPU: decoder layers "
        f"{stage.start_layer}-{stage.end_layer - 1}, {layers}, "
        f"{format_bytes(stage.block_bytes)} blocks"
    )
    blocks = f"{plan.num_blocks:,} blocks incl. the null block"
    if stage.budget_blocks != plan.num_blocks:
        blocks += f" ({stage.budget_blocks:,} fit its budget)"
    unused = stage.memory_bytes - stage.pool_bytes
    lines.append(
        f"pool {format_bytes(stage.pool_bytes)} of its {format_bytes(stage.memory_bytes)} "
        f"budget, {format_bytes(unused)} unused: {blocks}"
    )
    return "\n".join(lines)


def _draw(
    axis: Any, plan: KVCachePlan, rectangle: Any, stage: PipelineStage | None = None
) -> tuple[set[str], bool]:
    """One block of the plan's pool (`stage`: of that stage's GPU, holding its layers only)."""
    pages = {p.page_bytes for p in plan.placements}
    unit = pages.pop() if len(pages) == 1 else 1
    block_bytes = plan.block_bytes if stage is None else stage.block_bytes
    width = block_bytes / unit
    held = None if stage is None else set(stage.layer_names)
    kinds: set[str] = set()
    padded = False
    by_name = {p.layer_name: p for p in plan.placements}
    for row, group in enumerate(plan.groups):
        names = [n for n in group.layer_names if held is None or n in held]
        x = 0.0
        for name in names:
            page = by_name[name].page_bytes / unit
            axis.add_patch(
                rectangle((x, row), page, 1, facecolor=_COLOURS[group.kind], edgecolor="white")
            )
            x += page
        if names:
            kinds.add(group.kind)
        # A stage's block holds the group's pages of its own layers; the rest is unused there.
        padding = (
            group.padding_bytes
            if stage is None
            else block_bytes - sum(by_name[n].page_bytes for n in names)
        )
        if padding:
            padded = True
            axis.add_patch(
                rectangle(
                    (x, row),
                    padding / unit,
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
    axis.set_title(_panel_title(plan, stage), fontsize=9)
    return kinds, padded
