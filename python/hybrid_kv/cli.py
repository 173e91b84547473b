"""`hybrid-kv` command line. One `_add_<name>_parser` + `_cmd_<name>` pair per subcommand."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from hybrid_kv.catalogue import ModelSpec, list_presets, load_model
from hybrid_kv.planner import (
    STRATEGIES,
    InsufficientMemoryError,
    KVCachePlan,
    format_bytes,
    parse_memory,
    plan_kv_cache,
)

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hybrid-kv` and `python -m hybrid_kv`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="hybrid-kv", description="KV-cache manager for hybrid LLMs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in _SUBCOMMANDS:
        add_parser(subparsers)
    args = parser.parse_args(argv)
    command: Command = args.handler
    try:
        return command(args)
    except (CommandError, ValueError) as error:
        print(f"hybrid-kv {args.command}: error: {error}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- plan


def _add_plan_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan the KV cache of a model and compare with vLLM's plan",
        description=(
            "Plan layer groups, page size and pool size for a model; print it beside vLLM "
            f"0.33's plan. Presets: {', '.join(list_presets())}."
        ),
    )
    parser.add_argument("model", metavar="MODEL_OR_CONFIG", help="preset name or config.json path")
    parser.add_argument(
        "--memory", required=True, help="KV-cache memory budget, e.g. 40GiB, 512MiB, 80GB"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="longest request (default: the config's)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="base block size (tokens)")
    parser.add_argument("--alignment", type=int, default=16, help="kernel block-size alignment")
    parser.add_argument("--strategy", choices=STRATEGIES, default="min-waste")
    parser.add_argument(
        "--dtype", default=None, help="attention KV dtype: fp32, bf16, fp16, fp8_e4m3, fp8_e5m2"
    )
    parser.add_argument(
        "--reference-len",
        type=int,
        default=None,
        help="request length the waste is measured at (default: max model len)",
    )
    parser.add_argument("--max-groups", type=int, default=None, help="cap on the group count")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="draw the memory layout")
    parser.set_defaults(handler=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    model = load_model(args.model, dtype=args.dtype)
    memory = parse_memory(args.memory)
    max_model_len = model.max_model_len if args.max_model_len is None else args.max_model_len
    options: dict[str, Any] = {
        "block_size": args.block_size,
        "alignment": args.alignment,
        "reference_len": args.reference_len,
        "max_groups": args.max_groups,
    }
    plan = plan_kv_cache(model.layers, memory, max_model_len, strategy=args.strategy, **options)
    baseline: KVCachePlan | None = None
    baseline_error: str | None = None
    if args.strategy != "vllm":
        try:
            options["max_groups"] = None
            baseline = plan_kv_cache(
                model.layers, memory, max_model_len, strategy="vllm", **options
            )
        except InsufficientMemoryError as error:
            baseline_error = str(error)
    if args.json:
        document = {
            "model": model.name,
            "model_type": model.model_type,
            "plan": plan.to_dict(),
            "vllm": baseline.to_dict() if baseline else None,
        }
        if baseline_error:
            document["vllm_error"] = baseline_error
        print(json.dumps(document, indent=2))
    else:
        print(format_plan_report(model, plan, baseline, baseline_error))
    if args.plot:
        from hybrid_kv.plot import plot_plan

        plot_plan(plan, args.plot, baseline=baseline, title=model.name)
        if not args.json:
            print(f"\nmemory layout written to {args.plot}")
    return 0


def format_plan_report(
    model: ModelSpec,
    plan: KVCachePlan,
    baseline: KVCachePlan | None = None,
    baseline_error: str | None = None,
) -> str:
    """The readable `hybrid-kv plan` report: a side-by-side table, the groups, the reasons."""
    kinds = Counter(spec.kind for spec in model.layers.values())
    layer_summary = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    lines = [
        f"model: {model.name} ({model.model_type}; {len(model.layers)} layers: {layer_summary})",
        f"memory: {format_bytes(plan.memory_bytes)}   max_model_len: {plan.max_model_len}   "
        f"waste measured at {plan.waste.reference_len} tokens",
        "",
    ]
    columns = [(f"{plan.strategy} (chosen)", plan)]
    if baseline is not None:
        columns.append(("vllm 0.33", baseline))
    rows: list[tuple[str, Callable[[KVCachePlan], str]]] = [
        ("groups", lambda p: _group_summary(p)),
        ("buffers (slots/group)", lambda p: str(p.num_buffers)),
        ("padding slots", lambda p: str(p.num_padding_slots)),
        (
            "block sizes",
            lambda p: ", ".join(str(s) for s in sorted({g.block_size for g in p.groups})),
        ),
        ("page size", lambda p: format_bytes(p.block_bytes)),
        ("num_blocks", lambda p: f"{p.num_blocks} (incl. null block)"),
        ("waste", lambda p: f"{p.waste.waste_percent:.2f}% ({format_bytes(p.waste.waste_bytes)})"),
        ("max concurrency", lambda p: f"{p.max_concurrency:.2f}x at {p.max_model_len} tokens"),
    ]
    header = ["", *(name for name, _ in columns)]
    if baseline_error:
        header.append("vllm 0.33")
    table = [header]
    for label, cell in rows:
        row = [label, *(cell(p) for _, p in columns)]
        if baseline_error:
            row.append("does not fit" if label == "groups" else "")
        table.append(row)
    lines.extend(_format_table(table))
    if baseline_error:
        lines.append(f"vllm 0.33: {baseline_error}")
    lines.append("")
    lines.append(f"groups ({plan.strategy}):")
    group_table = [["id", "kind", "block", "layers", "padding", "shared", "layer names"]]
    for group in plan.groups:
        group_table.append(
            [
                str(group.group_id),
                _kind_label(group.kind, group.sliding_window, group.attention_chunk_size),
                str(group.block_size),
                str(len(group.layer_names)),
                str(group.num_padding_slots),
                str(len(group.shared_layer_names)),
                _abbreviate(group.layer_names),
            ]
        )
    lines.extend("  " + line for line in _format_table(group_table))
    lines.append("")
    lines.append("reasons:")
    lines.extend(f"  - {reason}" for reason in plan.reasons)
    return "\n".join(lines)


def _group_summary(plan: KVCachePlan) -> str:
    counts = Counter(group.kind for group in plan.groups)
    return f"{plan.num_groups} (" + ", ".join(f"{n} {k}" for k, n in counts.items()) + ")"


def _kind_label(kind: str, window: int | None, chunk: int | None) -> str:
    if window is not None:
        return f"{kind}({window})"
    if chunk is not None:
        return f"{kind}({chunk})"
    return kind


def _abbreviate(names: Sequence[str], limit: int = 4) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[: limit - 1]) + f", ... {names[-1]}"


def _format_table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


# --------------------------------------------------------------------------- demo


def _add_demo_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="walk through allocating, caching, hitting and evicting blocks"
    )
    parser.add_argument("--num-blocks", type=int, default=11, help="pool size (default 11)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from hybrid_kv.demo import run_demo

    if args.num_blocks < 10:
        raise CommandError("--num-blocks must be at least 10 for the demo")
    run_demo(args.num_blocks, args.block_size)
    return 0


# --------------------------------------------------------------------------- simulate


def _add_simulate_parser(subparsers: Any) -> None:
    from hybrid_kv.simulate import WORKLOADS

    parser = subparsers.add_parser(
        "simulate",
        help="run a built-in serving simulation and report cache behaviour",
        description=(
            "Drive a synthetic workload through the KV cache manager planned for a model "
            f"and memory budget. Presets: {', '.join(list_presets())}."
        ),
    )
    parser.add_argument("model", nargs="?", default="gemma-3-27b", metavar="MODEL_OR_CONFIG")
    parser.add_argument("--workload", choices=WORKLOADS, default="chat")
    parser.add_argument("--memory", default="24GiB", help="KV cache budget (default 24GiB)")
    parser.add_argument("--requests", type=int, default=200, help="number of requests")
    parser.add_argument("--max-model-len", type=int, default=None, help="default min(model, 32768)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE.png", help="plot usage and hit rate over time")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from hybrid_kv.simulate import plot_report, progress_bar, simulate

    if args.requests <= 0:
        raise CommandError("--requests must be positive")
    try:
        model = load_model(args.model)
    except (OSError, KeyError) as error:
        raise CommandError(str(error)) from error
    report = simulate(
        args.model,
        args.workload,
        parse_memory(args.memory),
        args.requests,
        args.max_model_len,
        args.seed,
        progress=None if args.no_progress else progress_bar,
    )
    del model
    for line in report.lines():
        print(line)
    if args.plot:
        plot_report(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0


_SUBCOMMANDS: list[Callable[[Any], None]] = [
    _add_simulate_parser,
    _add_plan_parser,
    _add_demo_parser,
]
