"""`hybrid-kv` command line. One `_add_<name>_parser` + `_cmd_<name>` pair per subcommand.

Errors a user can fix (bad sizes, unknown models, budgets that cannot admit one request) print
one line on stderr and exit with status 2; a simulation that stops without finishing exits
with 1, as does output that cannot be written (`> /dev/full`: one line naming the system's
error); Ctrl-C exits with 130 and a closed output pipe (`... --json | head`) with 141, both
without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from hybrid_kv import __version__
from hybrid_kv.catalogue import (
    CatalogueError,
    ModelSpec,
    estimate_stage_weight_bytes,
    estimate_weight_bytes,
    list_presets,
    load_model,
    weight_estimate_note,
)
from hybrid_kv.planner import (
    DEFAULT_LAYOUT,
    DEFAULT_MAX_IN_FLIGHT_TOKENS,
    DEFAULT_MODEL_RUNNER,
    KV_CACHE_LAYOUTS,
    MODEL_RUNNERS,
    STRATEGIES,
    KVCachePlan,
    LengthDistribution,
    PlanError,
    format_bytes,
    kv_cache_budget,
    parse_memory,
    parse_partition,
    plan_kv_cache,
    pp_partition,
)
from hybrid_kv.planner.lengths import parse_token_count
from hybrid_kv.planner.search import MAX_BLOCK_SIZE, MAX_BLOCKS

__all__ = ["VLLM_SEMANTICS_VERSION", "CommandParser", "format_plan_report", "main", "run_command"]

VLLM_SEMANTICS_VERSION = "0.33"
"""The vLLM release whose KV-cache manager semantics hybrid-kv follows."""

JSON_SCHEMA_VERSION = 2
"""Version of the documents `plan --json` and `simulate --json` print."""

Command = Callable[[argparse.Namespace], int]
_VALUE_OPTIONS = {"--memory", "--gpu-memory", "--weights-memory", "--pp-layer-partition"}


class CommandError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, except that what it cannot write (`--help > /dev/full` with
    unbuffered output, as `PYTHONUNBUFFERED=1` gives) raises instead of being dropped, so that
    `run_command` says so and exits 1. Subcommands' parsers are of the same class."""

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if message:
            # argparse drops an OSError here; no stream at all (pythonw) is still nothing.
            stream = file or sys.stderr
            if stream is not None:
                stream.write(message)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hybrid-kv` and `python -m hybrid_kv`; returns the exit code."""
    return run_command(lambda: _run(sys.argv[1:] if argv is None else argv))


def run_command(command: Callable[[], int]) -> int:
    """`command()`'s exit code, or the one a command line gives when it is interrupted or its
    output cannot be written (also `python -m hybrid_kv.replay`'s entry)."""
    try:
        code = command()
        # Output still buffered (a short report to a file) fails here rather than in the
        # interpreter's final flush, where the exit code would not say so.
        sys.stdout.flush()
        return code
    except SystemExit:
        # argparse's `--help` and `--version` (and its errors) exit from inside `command`: what
        # they printed must reach its file too, or the exit says so.
        try:
            sys.stdout.flush()
        except OSError as error:
            return _unwritable(error)
        raise
    except KeyboardInterrupt:
        print("hybrid-kv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): say nothing more, and keep the interpreter's final
        # flush of stdout from failing again.
        _discard_stdout()
        return 141
    except OSError as error:
        return _unwritable(error)


def _unwritable(error: OSError) -> int:
    """Output that cannot be written (`> /dev/full`, a full disk, a terminal gone), or a file
    the system refuses: one line, not a traceback, and exit status 1. What a failed write left
    in stdout's buffer is dropped rather than failing again at the interpreter's final flush."""
    print(f"hybrid-kv: error: {error}", file=sys.stderr)
    try:
        sys.stdout.flush()
    except OSError:
        _discard_stdout()
    return 1


def _discard_stdout() -> None:
    """Point stdout at the null device, so what a failed write left in its buffer does not fail
    again at the interpreter's final flush."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run(argv: list[str]) -> int:
    parser = CommandParser(prog="hybrid-kv", description="KV-cache manager for hybrid LLMs.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"hybrid-kv {__version__} (vLLM {VLLM_SEMANTICS_VERSION} KV-cache semantics)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in _SUBCOMMANDS:
        add_parser(subparsers)
    args = parser.parse_args(_join_negative_values(argv))
    command: Command = args.handler
    try:
        return command(args)
    except (CommandError, ValueError) as error:
        print(f"hybrid-kv {args.command}: error: {error}", file=sys.stderr)
        return 2
    except MemoryError as error:
        # A pool whose bookkeeping does not fit this machine's memory (the core refuses it
        # before taking any), or a simulation's requests.
        advice = _MEMORY_ADVICE.get(args.command, "a smaller KV cache budget makes fewer blocks")
        print(
            f"hybrid-kv {args.command}: error: {str(error) or 'out of memory'} ({advice})",
            file=sys.stderr,
        )
        return 1


_MEMORY_ADVICE = {
    "demo": "fewer --num-blocks need less",
    "simulate": "fewer --requests or a smaller KV cache budget need less",
}


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """`--memory -1GiB` -> `--memory=-1GiB`, so a negative size reaches the size parser (and
    its clear message) instead of argparse taking it for an option."""
    result: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        following = argv[index + 1] if index + 1 < len(argv) else None
        if (
            token in _VALUE_OPTIONS
            and following is not None
            and following.startswith("-")
            and following[1:2].replace(".", "0").isdigit()
        ):
            result.append(f"{token}={following}")
            index += 2
            continue
        result.append(token)
        index += 1
    return result


# --------------------------------------------------------------------------- shared options


def _add_model_options(parser: argparse.ArgumentParser, *, default: str | None = None) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL_OR_CONFIG",
        nargs="?" if default else None,
        default=default,
        help="preset name (case-insensitive), config.json path or directory, or a Hugging Face "
        "id in the local cache" + (f" (default {default})" if default else ""),
    )
    parser.add_argument(
        "--dtype",
        "--kv-cache-dtype",
        dest="dtype",
        default=None,
        help="attention KV dtype: auto (the checkpoint's, as vLLM's default), fp32, bf16, fp16, "
        "fp8_e4m3, fp8_e5m2",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        metavar="N",
        help="plan one of N tensor-parallel GPUs (KV heads and Mamba states split as vLLM does)",
    )


def _add_budget_options(parser: argparse.ArgumentParser, *, default_memory: str | None) -> None:
    parser.add_argument(
        "--memory",
        default=None,
        help="KV cache budget, e.g. 40GiB, 512MiB, 80GB"
        + (f" (default {default_memory})" if default_memory else ""),
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="size the budget as vLLM does from one GPU of SIZE: SIZE x utilization minus the "
        "weights (instead of --memory)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="share of --gpu-memory vLLM may use (default 0.9)",
    )
    parser.add_argument(
        "--weights-memory",
        default=None,
        metavar="SIZE",
        help="weights per GPU (default: estimated from the config)",
    )
    parser.set_defaults(default_memory=default_memory)


def _add_plan_options(
    parser: argparse.ArgumentParser,
    *,
    batched_default: int | None,
    max_model_len_cap: int | None = None,
) -> None:
    default = "the config's" + (f", at most {max_model_len_cap:,}" if max_model_len_cap else "")
    parser.add_argument(
        "--max-model-len",
        type=_token_count,
        default=None,
        help=f"longest request, e.g. 32768, 32K or 32k as vLLM reads them (default: {default})",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="min-waste",
        help="min-waste (default) or vllm (vLLM 0.33's grouping)",
    )
    parser.add_argument(
        "--kv-cache-layout",
        type=str.upper,
        choices=KV_CACHE_LAYOUTS,
        default=DEFAULT_LAYOUT,
        metavar="LAYOUT",
        help=f"physical layout, one of {', '.join(KV_CACHE_LAYOUTS)} (default {DEFAULT_LAYOUT})",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_token_count,
        default=batched_default,
        metavar="N",
        help="tokens per scheduler step; sliding-window groups reserve blocks for them"
        + (f" (default {batched_default})" if batched_default else ""),
    )


def _token_count(text: str) -> int:
    """`--max-model-len` and `--max-num-batched-tokens`: a token count as vLLM reads it
    (`parse_token_count`). Range checks are the planner's."""
    try:
        return parse_token_count(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _model(args: argparse.Namespace) -> ModelSpec:
    # vLLM's `--dtype auto` and `--kv-cache-dtype auto` (its default) mean the checkpoint's.
    dtype = None if args.dtype is not None and args.dtype.strip().lower() == "auto" else args.dtype
    return load_model(args.model, dtype=dtype, tensor_parallel_size=args.tensor_parallel_size)


def _budget(
    args: argparse.Namespace, model: ModelSpec
) -> tuple[int | tuple[int, ...], str, tuple[int, ...] | None]:
    """The KV cache budget in bytes (with pipeline stages and estimated weights, one per stage
    GPU), a line saying where it came from, and each stage GPU's weights (None without
    --gpu-memory)."""
    if args.memory is not None and args.gpu_memory is not None:
        raise CommandError("give --memory (the KV cache budget) or --gpu-memory, not both")
    if args.gpu_memory is None:
        if args.weights_memory is not None:
            raise CommandError("--weights-memory goes with --gpu-memory")
        text = args.memory if args.memory is not None else args.default_memory
        if text is None:
            raise CommandError("give --memory (the KV cache budget) or --gpu-memory")
        memory = parse_memory(text)
        return memory, f"KV cache budget {format_bytes(memory)}", None
    gpu = parse_memory(args.gpu_memory)
    utilization = args.gpu_memory_utilization
    stages = _pipeline_parallel_size(getattr(args, "pipeline_parallel_size", "1"))
    if args.weights_memory is not None:
        # Given per GPU, as vLLM reports the weights each worker loaded: the same on every
        # stage's GPU.
        weights, source = (parse_memory(args.weights_memory),) * stages, "given"
    else:
        counts: tuple[int, ...] | None = None
        if stages > 1:
            if model.num_hidden_layers is None:
                raise CommandError(
                    "cannot split the weights over the pipeline stages (the config gives no "
                    "num_hidden_layers); pass --weights-memory"
                )
            # The stages vLLM (and the planner) split the decoder layers into.
            partition = _pp_layer_partition(getattr(args, "pp_layer_partition", None))
            counts = pp_partition(model.num_hidden_layers, stages, partition)
        try:
            if counts is None:
                weights = (estimate_weight_bytes(model.config, model.tensor_parallel_size),)
            else:
                weights = estimate_stage_weight_bytes(
                    model.config, counts, model.tensor_parallel_size
                )
            note = weight_estimate_note(model.config)
        except CatalogueError as error:
            raise CommandError(
                f"cannot estimate the weights ({error}); pass --weights-memory"
            ) from None
        source = "estimated from the config"
        if note is not None:
            source += f" at 16 bits: {note}, pass --weights-memory for its size"
    if stages == 1 or args.weights_memory is not None:
        memory = kv_cache_budget(gpu, utilization, weights[0])
        return (
            memory,
            f"KV cache budget {format_bytes(memory)} = {utilization:g} x "
            f"{format_bytes(gpu)} - {format_bytes(weights[0])} of weights per GPU ({source}; "
            "activations and CUDA graphs not counted)",
            weights,
        )
    budgets = []
    for stage, stage_weights in enumerate(weights):
        try:
            budgets.append(kv_cache_budget(gpu, utilization, stage_weights))
        except PlanError as error:
            raise PlanError(f"pipeline stage {stage}'s GPU: {error}") from None
    return (
        tuple(budgets),
        f"KV cache budget per stage GPU {', '.join(format_bytes(m) for m in budgets)} = "
        f"{utilization:g} x {format_bytes(gpu)} - each stage's weights "
        f"{', '.join(format_bytes(w) for w in weights)} ({source}; activations and CUDA "
        "graphs not counted)",
        weights,
    )


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
    _add_model_options(parser)
    _add_budget_options(parser, default_memory=None)
    _add_plan_options(parser, batched_default=DEFAULT_MAX_IN_FLIGHT_TOKENS)
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's async scheduling: one more batch in flight (2 batches without pipeline "
        "parallelism), whose tokens sliding-window groups reserve blocks for. Default: as "
        "vLLM 0.33 resolves it, on unless model runner v1 runs pipeline parallelism; "
        "--no-async-scheduling turns it off",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        dest="pipeline_parallel_size",
        default="1",
        metavar="N",
        help="vLLM's pipeline stages: N batches in flight (N + 1 with async scheduling on "
        "model runner v2), the layers split over N GPUs as vLLM splits them, each GPU's pool "
        "sized for its own layers within the budget (per GPU); num_blocks is the smallest "
        "stage's (default 1)",
    )
    parser.add_argument(
        "--pp-layer-partition",
        default=None,
        metavar="COUNTS",
        help="decoder layers per pipeline stage, as vLLM's VLLM_PP_LAYER_PARTITION gives them "
        "(e.g. 20,21,21: one count per stage, summing to the model's layers; default: "
        "vLLM's split)",
    )
    parser.add_argument(
        "--model-runner",
        type=str.lower,
        choices=MODEL_RUNNERS,
        default=DEFAULT_MODEL_RUNNER,
        help="vLLM's model runner, as VLLM_USE_V2_MODEL_RUNNER=1 (v2) or =0 (v1) selects it; "
        "counts only with --pipeline-parallel-size > 1, where v1 turns async scheduling off "
        f"by default and refuses --async-scheduling (default {DEFAULT_MODEL_RUNNER}, vLLM "
        "0.33's where Triton runs)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        dest="no_prefix_caching",
        action="store_true",
        help="Mamba layers in vLLM's 'none' mode (one state block per request)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="base block size (tokens)")
    parser.add_argument("--alignment", type=int, default=16, help="kernel block-size alignment")
    parser.add_argument(
        "--prefix-match-unit",
        type=int,
        default=None,
        metavar="N",
        help="hash prompts every N tokens (finer prefix hits than the block size)",
    )
    lengths = parser.add_mutually_exclusive_group()
    lengths.add_argument(
        "--lengths",
        default=None,
        metavar="SPEC",
        help="request lengths to minimise waste over: LENGTH:COUNT,... or a workload / kvtrace "
        "file (default: log-uniform up to max_model_len)",
    )
    lengths.add_argument(
        "--reference-len",
        type=int,
        default=None,
        help="measure waste with every request this long",
    )
    parser.add_argument("--max-groups", type=int, default=None, help="cap on the group count")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw the memory layout: a block of the pool, one row per group (with "
        "--pipeline-parallel-size N, a block of each stage's GPU, its pool against its budget), "
        "vLLM's plan below ours",
    )
    parser.set_defaults(handler=_cmd_plan)


def _plot_target(args: argparse.Namespace) -> Path | None:
    """Where `--plot` writes (checked before any work), or None without `--plot` (an empty
    name, as `--plot "$UNSET"` gives, is refused rather than taken for no plot)."""
    if args.plot is None:
        return None
    from hybrid_kv.plot import plot_target, require_matplotlib

    require_matplotlib()
    return plot_target(args.plot)


def _note_long_max_model_len(model: ModelSpec, max_model_len: int | None) -> None:
    """A line on stderr when `--max-model-len` exceeds the model's context length: it is used
    as given, but vLLM refuses it unless told to allow it."""
    if max_model_len is not None and max_model_len > model.max_model_len:
        print(
            f"hybrid-kv: note: --max-model-len {max_model_len:,} is above {model.name}'s "
            f"{model.max_model_len:,} (max_position_embeddings); vLLM refuses that unless "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
            file=sys.stderr,
        )


def _pipeline_parallel_size(text: str) -> int:
    """`--pipeline-parallel-size`: an integer >= 1 (checked here, so that a bad value is one
    line on stderr as the planner's errors are)."""
    try:
        size = int(text.strip(), 10)
    except ValueError:
        size = 0
    if size < 1:
        raise CommandError(f"--pipeline-parallel-size must be an integer >= 1, got {text!r}")
    return size


def _pp_layer_partition(text: str | None) -> tuple[int, ...] | None:
    """`--pp-layer-partition`: comma-separated counts, read as vLLM reads
    `VLLM_PP_LAYER_PARTITION` (the planner checks them against the stages and layers)."""
    if text is None:
        return None
    try:
        return parse_partition(text)
    except PlanError:
        raise CommandError(
            f"--pp-layer-partition must be comma-separated layer counts, one per stage "
            f"(e.g. 20,21,21), got {text!r}"
        ) from None


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.strategy == "vllm" and args.max_groups is not None:
        raise CommandError(
            "--max-groups caps min-waste's grouping; --strategy vllm groups as vLLM 0.33 does"
        )
    plot = _plot_target(args)
    model = _model(args)
    memory, budget_line, weights = _budget(args, model)
    _note_long_max_model_len(model, args.max_model_len)
    max_model_len = model.max_model_len if args.max_model_len is None else args.max_model_len
    lengths = LengthDistribution.parse(args.lengths) if args.lengths is not None else None
    options: dict[str, Any] = {
        "block_size": args.block_size,
        "alignment": args.alignment,
        "reference_len": args.reference_len,
        "lengths": lengths,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "async_scheduling": args.async_scheduling,
        "pipeline_parallel_size": _pipeline_parallel_size(args.pipeline_parallel_size),
        "pp_layer_partition": _pp_layer_partition(args.pp_layer_partition),
        "num_hidden_layers": model.num_hidden_layers,
        "model_runner": args.model_runner,
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_cache_layout": args.kv_cache_layout,
        "prefix_match_unit": args.prefix_match_unit,
    }
    plan = plan_kv_cache(
        model.layers,
        memory,
        max_model_len,
        strategy=args.strategy,
        max_groups=args.max_groups,
        **options,
    )
    baseline: KVCachePlan | None = None
    baseline_error: str | None = None
    if args.strategy != "vllm":
        try:
            baseline = plan_kv_cache(
                model.layers, memory, max_model_len, strategy="vllm", **options
            )
        except PlanError as error:
            baseline_error = str(error)
    if args.json:
        document: dict[str, Any] = {
            "schema_version": JSON_SCHEMA_VERSION,
            "model": model.name,
            "model_type": model.model_type,
            "tensor_parallel_size": model.tensor_parallel_size,
            "budget": budget_line,
            "plan": _plan_document(plan, weights),
            "vllm": _plan_document(baseline, weights) if baseline else None,
        }
        if baseline_error:
            document["vllm_error"] = baseline_error
        print(json.dumps(document, indent=2))
    else:
        print(format_plan_report(model, plan, baseline, baseline_error, budget_line, weights))
    if plot is not None:
        from hybrid_kv.plot import plot_plan

        plot_plan(plan, plot, baseline=baseline, title=model.name)
        if not args.json:
            print(f"\nmemory layout written to {plot}")
    return 0


def _plan_document(plan: KVCachePlan, weights: Sequence[int] | None) -> dict[str, Any]:
    """The plan's JSON, each pipeline stage with its GPU's weights (`weights_bytes`, null
    without --gpu-memory) beside its budget."""
    document = plan.to_dict()
    for stage in document["stages"]:
        stage["weights_bytes"] = None if weights is None else weights[stage["index"]]
    return document


def _in_flight_line(plan: KVCachePlan) -> str:
    """The tokens in flight the plan reserves for, and the options they were counted from."""
    if plan.in_flight is None:
        return f"{plan.max_in_flight_tokens:,} tokens in flight"
    return plan.in_flight.describe()


def format_plan_report(
    model: ModelSpec,
    plan: KVCachePlan,
    baseline: KVCachePlan | None = None,
    baseline_error: str | None = None,
    budget_line: str | None = None,
    stage_weights: Sequence[int] | None = None,
) -> str:
    """The readable `hybrid-kv plan` report: a side-by-side table, the groups, the reasons."""
    kinds = Counter(spec.kind for spec in model.layers.values())
    layer_summary = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    tp = f", 1 of {model.tensor_parallel_size} TP ranks" if model.tensor_parallel_size > 1 else ""
    lines = [
        f"model: {model.name} ({model.model_type}; {len(model.layers)} layers: "
        f"{layer_summary}{tp})",
        (budget_line or f"KV cache budget {format_bytes(plan.memory_bytes)}")
        + f"; max_model_len {plan.max_model_len:,}; {_in_flight_line(plan)}; layout "
        f"{plan.kv_cache_layout}",
        f"waste: expected over {plan.waste.distribution.source}",
        "",
    ]
    columns = [(f"{plan.strategy} (chosen)", plan)]
    if baseline is not None:
        columns.append(("vllm 0.33", baseline))
    rows: list[tuple[str, Callable[[KVCachePlan], str]]] = [
        ("groups", _group_summary),
        ("attention block size", lambda p: str(p.attention_block_size or "-")),
        (
            "block sizes",
            lambda p: ", ".join(str(s) for s in sorted({g.block_size for g in p.groups})) or "-",
        ),
        ("hash block size", lambda p: str(p.hash_block_size)),
        ("page size (block)", _block_bytes),
        ("padding", _padding),
        ("num_blocks", lambda p: f"{p.num_blocks:,} (incl. null block)"),
        ("blocks per request", lambda p: f"{p.blocks_per_request:,} (vLLM's reservation)"),
        ("max concurrency", lambda p: f"{p.max_concurrency or 0:.2f}x at {p.max_model_len:,}"),
        ("KV cache tokens", lambda p: f"{p.kv_cache_tokens:,}"),
        ("expected waste", lambda p: f"{p.waste.waste_percent:.2f}%"),
        ("waste at max_model_len", lambda p: f"{p.waste_at(p.max_model_len).waste_percent:.2f}%"),
    ]
    header = ["", *(name for name, _ in columns)]
    if baseline_error:
        header.append("vllm 0.33")
    table = [header]
    for label, cell in rows:
        row = [label, *(cell(p) for _, p in columns)]
        if baseline_error:
            row.append("refused" if label == "groups" else "")
        table.append(row)
    lines.extend(_format_table(table))
    if baseline_error:
        lines.append(f"vllm 0.33: {baseline_error}")
    lines.append("")
    lines.append(plan.summary_line())
    if len(plan.stages) > 1:
        lines.append("")
        lines.extend(_stage_lines(plan, stage_weights))
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
                format_bytes(group.padding_bytes) if group.padding_bytes else "-",
                str(len(group.shared_layer_names)),
                _abbreviate(group.layer_names),
            ]
        )
    lines.extend("  " + line for line in _format_table(group_table))
    lines.append("")
    lines.append("reasons:")
    lines.extend(f"  - {reason}" for reason in plan.reasons)
    if plan.warnings:
        lines.append("warnings:")
        lines.extend(f"  - {warning}" for warning in plan.warnings)
    return "\n".join(lines)


def _block_bytes(plan: KVCachePlan) -> str:
    if len(plan.stages) <= 1:
        return format_bytes(plan.block_bytes)
    widest = max(stage.block_bytes for stage in plan.stages)
    return f"{format_bytes(plan.block_bytes)} (all stages; per GPU up to {format_bytes(widest)})"


def _stage_lines(plan: KVCachePlan, weights: Sequence[int] | None = None) -> list[str]:
    """Each pipeline stage's GPU: its layers, weights, KV cache budget, block, the blocks its
    budget makes, its pool."""
    table = [
        [
            "stage",
            "decoder layers",
            "KV layers",
            "weights",
            "budget",
            "page size (block)",
            "budget blocks",
            "pool",
        ]
    ]
    for stage in plan.stages:
        table.append(
            [
                str(stage.index),
                f"{stage.start_layer}-{stage.end_layer - 1}",
                str(len(stage.layer_names)),
                "-" if weights is None else format_bytes(weights[stage.index]),
                format_bytes(stage.memory_bytes),
                format_bytes(stage.block_bytes),
                f"{stage.budget_blocks:,}",
                format_bytes(stage.pool_bytes),
            ]
        )
    return [
        f"pipeline stages ({plan.strategy}; each GPU allocates num_blocks = {plan.num_blocks:,}, "
        "the smallest stage's):",
        *("  " + line for line in _format_table(table)),
    ]


def _padding(plan: KVCachePlan) -> str:
    slots = plan.num_padding_slots
    if slots:
        return f"{slots} slot{'s' if slots != 1 else ''}"
    return (
        format_bytes(sum(g.padding_bytes for g in plan.groups))
        if plan.groups and any(g.padding_bytes for g in plan.groups)
        else "none"
    )


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

    if not 10 <= args.num_blocks <= MAX_BLOCKS:
        raise CommandError(
            f"--num-blocks must be in 10..{MAX_BLOCKS} for the demo, got {args.num_blocks}"
        )
    if not 1 <= args.block_size <= MAX_BLOCK_SIZE:
        raise CommandError(f"--block-size must be in 1..{MAX_BLOCK_SIZE}, got {args.block_size}")
    run_demo(args.num_blocks, args.block_size)
    return 0


# --------------------------------------------------------------------------- simulate


def _add_simulate_parser(subparsers: Any) -> None:
    from hybrid_kv.simulate import DEFAULT_MAX_MODEL_LEN, SCHEDULER_DEFAULTS, WORKLOADS

    defaults = "; ".join(
        f"{name}: {limits['max_num_seqs']} seqs, {limits['max_num_batched_tokens']} tokens"
        for name, limits in SCHEDULER_DEFAULTS.items()
    )
    parser = subparsers.add_parser(
        "simulate",
        help="run a built-in serving simulation and report cache behaviour",
        description=(
            "Drive a synthetic workload through the KV cache manager planned for a model "
            f"and memory budget. Presets: {', '.join(list_presets())}. Scheduler limits per "
            f"workload unless given: {defaults}."
        ),
    )
    _add_model_options(parser, default="gemma-3-27b")
    parser.add_argument(
        "--workload", choices=WORKLOADS, default="chat", help="synthetic workload (default chat)"
    )
    _add_budget_options(parser, default_memory="24GiB")
    _add_plan_options(parser, batched_default=None, max_model_len_cap=DEFAULT_MAX_MODEL_LEN)
    parser.set_defaults(max_model_len_default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="requests the scheduler runs at once (default: the workload's)",
    )
    parser.add_argument(
        "--requests", type=int, default=200, help="number of requests to simulate (default 200)"
    )
    parser.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="random seed of the synthetic workload (default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="plot usage and hit rate over time")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    parser.set_defaults(handler=_cmd_simulate)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < 2**128:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**128), got {value}")
    return value


def _cmd_simulate(args: argparse.Namespace) -> int:
    from hybrid_kv.simulate import (
        MAX_REQUESTS,
        ProgressBar,
        SimulationError,
        plot_report,
        simulate,
    )

    plot = _plot_target(args)
    for name in ("requests", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise CommandError(f"--{name.replace('_', '-')} must be positive")
    if args.requests > MAX_REQUESTS:
        raise CommandError(
            f"--requests must be at most {MAX_REQUESTS:,} (every request's tokens are made "
            f"before the replay starts), got {args.requests:,}"
        )
    model = _model(args)
    memory, _, _ = _budget(args, model)
    assert isinstance(memory, int)  # simulate has no pipeline stages
    _note_long_max_model_len(model, args.max_model_len)
    progress = None if args.no_progress else ProgressBar(args.requests)
    try:
        try:
            report = simulate(
                model,
                args.workload,
                memory,
                args.requests,
                args.max_model_len,
                args.seed,
                progress=progress,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                strategy=args.strategy,
                kv_cache_layout=args.kv_cache_layout,
            )
        finally:
            # Before any message (an error, Ctrl-C's): it goes on a line of its own.
            if progress is not None:
                progress.close()
    except SimulationError as error:
        print(f"hybrid-kv simulate: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        document = report.to_dict()
        print(json.dumps({**document, "schema_version": JSON_SCHEMA_VERSION}, indent=2))
    else:
        for line in report.lines():
            print(line)
    if plot is not None:
        plot_report(report, str(plot))
        if not args.json:
            print(f"plot written to {plot}")
    return 0


# --------------------------------------------------------------------------- replay


def _add_replay_parser(subparsers: Any) -> None:
    from hybrid_kv import replay

    parser = subparsers.add_parser(
        "replay",
        help="replay a conformance workload against a vLLM trace's KV cache layout",
        description=(replay.__doc__ or "").strip().splitlines()[0],
    )
    replay.add_arguments(parser)
    parser.set_defaults(handler=_cmd_replay)


def _cmd_replay(args: argparse.Namespace) -> int:
    from hybrid_kv import replay

    return replay.run(args, prog=f"hybrid-kv {args.command}")


_SUBCOMMANDS: list[Callable[[Any], None]] = [
    _add_simulate_parser,
    _add_plan_parser,
    _add_demo_parser,
    _add_replay_parser,
]
