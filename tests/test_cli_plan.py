"""`hybrid-kv plan` and the command line as a user meets it: the table, JSON, plot, budgets
from a GPU size, and one-line errors (exit 2), Ctrl-C (130) and closed pipes (141) without a
traceback."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hybrid_kv import __version__
from hybrid_kv import cli as cli_module
from hybrid_kv.cli import main
from hybrid_kv.planner import KVCachePlan, PipelineStage


def test_plan_prints_our_plan_beside_vllms(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "gemma-3-27b", "--memory", "40GiB", "--max-model-len", "1024"])
    out = capsys.readouterr().out
    assert code == 0
    assert "min-waste (chosen)" in out and "vllm 0.33" in out
    lines = out.splitlines()
    waste_row = next(line for line in lines if line.startswith("expected waste"))
    assert "4.62%" in waste_row and "11.43%" in waste_row
    for label in (
        "groups",
        "attention block size",
        "page size",
        "num_blocks",
        "blocks per request",
        "max concurrency",
        "KV cache tokens",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert any(line.startswith("KV cache: ") and "max concurrency" in line for line in lines)


def test_plan_json_holds_both_plans_and_a_schema_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["plan", "bamba-9b", "--memory", "16GiB", "--max-model-len", "8192", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    assert document["schema_version"] == cli_module.JSON_SCHEMA_VERSION
    assert document["plan"]["schema_version"] >= 2
    assert document["plan"]["strategy"] == "min-waste"
    assert document["vllm"]["strategy"] == "vllm"
    assert {g["block_size"] for g in document["vllm"]["groups"]} == {528}
    assert document["plan"]["max_model_len"] == 8192
    # Full attention, plus 3 blocks per Mamba-2 group (2 + a prefill checkpoint block).
    assert document["vllm"]["blocks_per_request"] == 8192 // 528 + 1 + 3 * 10


def test_plan_with_vllm_strategy_prints_one_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt-oss-20b", "--memory", "8GiB", "--strategy", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "vllm (chosen)" in out and "vllm 0.33" not in out


def test_plan_options_reach_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "bamba-9b", "--memory", "16GiB", "--max-model-len", "8192", "--json"]
    argv += ["--kv-cache-layout", "blnhc", "--async-scheduling", "--prefix-match-unit", "16"]
    argv += ["--max-num-batched-tokens", "4096", "--no-prefix-caching"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["kv_cache_layout"] == "BLNHC"
    assert plan["max_in_flight_tokens"] == 8192
    assert plan["mamba_cache_mode"] == "none"


@pytest.mark.parametrize(
    ("options", "batches", "assumed"),
    [
        (
            [],
            2,
            "4,096 tokens in flight (2 batches of 2,048: async scheduling (vLLM's default), "
            "pipeline parallel size 1",
        ),
        (["--no-async-scheduling"], 1, "(1 batch of 2,048: sync scheduling (given), pipeline"),
        (["--async-scheduling"], 2, "(2 batches of 2,048: async scheduling (given), pipeline"),
        (["--pipeline-parallel-size", "3"], 4, "async scheduling (vLLM's default), pipeline"),
        (["-pp", "3", "--no-async-scheduling"], 3, "sync scheduling (given), pipeline parallel"),
        (["-pp", "3", "--async-scheduling"], 4, "pipeline parallel size 3, model runner v2)"),
        (["-pp", "4", "--model-runner", "v1"], 4, "sync scheduling (vLLM's default), pipeline"),
        (["-pp", "2", "--async-scheduling", "--model-runner", "V2"], 3, "6,144 tokens in fl"),
    ],
)
def test_pipeline_stages_and_the_model_runner_set_the_tokens_in_flight(
    options: list[str], batches: int, assumed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM 0.33's `max_concurrent_batches` x `max_num_batched_tokens`, and the report says so.
    argv = ["plan", "gemma-3-27b", "--memory", "40GiB", "--max-model-len", "32768", *options]
    assert main([*argv, "--max-num-batched-tokens", "2048", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    for plan in (document["plan"], document["vllm"]):
        assert plan["max_in_flight_tokens"] == batches * 2048
        assert plan["in_flight"]["max_concurrent_batches"] == batches
    # vLLM's grouping of Gemma 3: a full-attention group and six of 1024-token windows.
    window = -(-(1023 + batches * 2048) // 16) + 1
    assert document["vllm"]["blocks_per_request"] == 32768 // 16 + 6 * window
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert assumed in out.splitlines()[1]
    # Each stage's GPU, sized for its own layers as vLLM sizes it.
    staged = "-pp" in options or "--pipeline-parallel-size" in options
    assert ("pipeline stages" in out) == staged


@pytest.mark.parametrize(
    ("options", "num_blocks"),
    [([], 13_107), (["-pp", "2"], 26_214), (["-pp", "4"], 43_690), (["-pp", "3"], 32_768)],
)
def test_pipeline_stages_size_each_gpu_as_vllm_does(
    options: list[str], num_blocks: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM 0.33's num_blocks for Gemma 3 27B at 16 GiB per GPU (tests/test_planner_vllm.py
    # checks them against vLLM itself): each stage's GPU holds its own layers' pages.
    argv = ["plan", "gemma-3-27b", "--memory", "16GiB", "--max-model-len", "32768", *options]
    assert main([*argv, "--strategy", "vllm", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["num_blocks"] == num_blocks
    stages = plan["stages"]
    assert len(stages) == (int(options[1]) if options else 1)
    assert min(stage["budget_blocks"] for stage in stages) == num_blocks
    assert sum(stage["end_layer"] - stage["start_layer"] for stage in stages) == 62
    assert {p["stage"] for p in plan["placements"]} == set(range(len(stages)))
    assert plan["pool_bytes"] == sum(stage["pool_bytes"] for stage in stages)
    assert main([*argv, "--strategy", "vllm"]) == 0
    out = capsys.readouterr().out
    assert f"num_blocks              {num_blocks:,} (incl. null block)" in out
    assert ("pipeline stages (vllm; each GPU allocates" in out) == bool(options)
    assert "not modelled" not in out


def test_a_layer_partition_splits_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "gemma-3-27b", "--memory", "16GiB", "--max-model-len", "32768", "--json"]
    assert main([*argv, "-pp", "3", "--pp-layer-partition", " 10, 20,32"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert [(s["start_layer"], s["end_layer"]) for s in plan["stages"]] == [
        (0, 10),
        (10, 30),
        (30, 62),
    ]
    assert "[10, 20, 32] decoder layers (given)" in " ".join(plan["reasons"])
    # One stage holding every layer is a partition too.
    assert main([*argv, "--pp-layer-partition", "62"]) == 0
    assert len(json.loads(capsys.readouterr().out)["plan"]["stages"]) == 1


def test_stages_split_the_configs_layers_including_those_without_a_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nemotron-H "M-M*-M-": 7 decoder layers, the MLP-only ones ("-") without a cache. vLLM
    # splits all 7 (4 + 3), not the 6 the last cached layer's index would suggest.
    from test_catalogue import NEMOTRON_H

    for config, layers in ((NEMOTRON_H, 7), ({**NEMOTRON_H, "num_hidden_layers": 7}, 7)):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        assert main(["plan", str(path), "--memory", "4GiB", "-pp", "2", "--json"]) == 0
        stages = json.loads(capsys.readouterr().out)["plan"]["stages"]
        assert [(s["start_layer"], s["end_layer"]) for s in stages] == [(0, 4), (4, layers)]
        assert [s["layer_names"] for s in stages] == [
            ["model.layers.0", "model.layers.2", "model.layers.3"],
            ["model.layers.5"],
        ]


def _vllm_in_flight(asynchronous: bool | None, stages: int, runner: str) -> int | None:
    """The tokens in flight vLLM 0.33 counts for `--max-num-batched-tokens 2048` and these
    options (None where vLLM refuses them): from a `VllmConfig` vLLM builds where vLLM is
    installed, else vLLM's arithmetic (`VllmConfig.__post_init__`'s resolution of
    `async_scheduling=None`, then `max_concurrent_batches`) restated."""
    if importlib.util.find_spec("vllm") is not None:
        import vllm_reference as ref

        tokens = ref.vllm_in_flight(2048, asynchronous, stages, runner)
        return None if isinstance(tokens, str) else tokens
    incompatible = runner == "v1" and stages > 1
    if asynchronous and incompatible:
        return None
    on = not incompatible if asynchronous is None else asynchronous
    if on and runner == "v2":
        return (stages + 1) * 2048
    return (2 if on and stages == 1 else stages) * 2048


SCHEDULING_FLAGS = {None: [], False: ["--no-async-scheduling"], True: ["--async-scheduling"]}


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("asynchronous", [None, False, True], ids=["default", "no", "async"])
def test_async_scheduling_is_resolved_as_vllm_resolves_it(
    asynchronous: bool | None, stages: int, runner: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "gpt-oss-20b", "--memory", "16GiB", "--max-model-len", "8192"]
    argv += ["-pp", str(stages), "--model-runner", runner, *SCHEDULING_FLAGS[asynchronous]]
    expected = _vllm_in_flight(asynchronous, stages, runner)
    if expected is None:
        # vLLM refuses --async-scheduling with the V1 runner and pipeline stages; so do we.
        assert main(argv) == 2
        assert "not supported by vLLM's V1 model runner" in capsys.readouterr().err
        return
    assert main([*argv, "--max-num-batched-tokens", "2048", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    in_flight = document["plan"]["in_flight"]
    assert document["plan"]["max_in_flight_tokens"] == expected
    assert in_flight["max_in_flight_tokens"] == expected
    assert in_flight["async_scheduling_vllm_default"] is (asynchronous is None)
    # vLLM's default turns async scheduling off only for the V1 runner with stages, and warns.
    turned_off = asynchronous is None and runner == "v1" and stages > 1
    resolved = not turned_off if asynchronous is None else asynchronous
    assert in_flight["async_scheduling"] is resolved
    assert (in_flight["note"] is not None) == turned_off
    assert (in_flight["note"] in document["plan"]["warnings"]) == turned_off
    assert main(argv) == 0
    out = capsys.readouterr().out
    source = "vLLM's default" if asynchronous is None else "given"
    scheduling = "async" if resolved else "sync"
    assert f"{expected:,} tokens in flight" in out.splitlines()[1]
    assert f"{scheduling} scheduling ({source})" in out.splitlines()[1]
    assert ("V1 model runner does not support it with pipeline parallelism" in out) == turned_off


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("8192", 8192), ("8K", 8192), ("8k", 8000), ("2.5k", 2500), (" 4k", 4000)],
)
def test_token_counts_read_as_vllm_reads_them(
    text: str, tokens: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM's --max-model-len and --max-num-batched-tokens take 32k (32,000) and 32K (32,768).
    argv = ["plan", "llama-3.1-8b", "--memory", "16GiB", "--strategy", "vllm", "--json"]
    assert main([*argv, "--max-model-len", text, "--max-num-batched-tokens", text]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (plan["max_model_len"], plan["in_flight"]["max_num_batched_tokens"]) == (tokens, tokens)
    # Two batches of them in flight: vLLM's default async scheduling.
    assert plan["max_in_flight_tokens"] == 2 * tokens


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.5K", "'1.5K': no decimals with a binary suffix like K (did you mean 1.5k?)"),
        ("1e3", "not a token count: '1e3'"),
        ("16kb", "not a token count: '16kb'"),
    ],
)
def test_a_bad_token_count_is_named(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["plan", "llama-3.1-8b", "--memory", "16GiB", "--max-model-len", text])
    assert caught.value.code == 2
    assert f"argument --max-model-len: {message}" in capsys.readouterr().err


def test_an_unknown_model_runner_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["plan", "gemma-3-27b", "--memory", "40GiB", "--model-runner", "v3"])
    assert caught.value.code == 2
    assert "argument --model-runner: invalid choice: 'v3'" in capsys.readouterr().err


def test_dtype_auto_is_the_checkpoints_as_in_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "llama-3.1-8b", "--memory", "24GiB", "--strategy", "vllm", "--json"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)["plan"]
    assert main([*argv, "--dtype", "auto"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == default


def test_vllms_option_names_are_taken(capsys: pytest.CaptureFixture[str]) -> None:
    # As an operator copies them from a `vllm serve` command line.
    argv = ["plan", "gpt-oss-120b", "--gpu-memory", "80GiB", "--max-model-len", "8192", "--json"]
    ours = ["--tensor-parallel-size", "2", "--dtype", "fp8", "--no-prefix-caching"]
    ours += ["--pipeline-parallel-size", "2"]
    vllms = ["-tp", "2", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching", "-pp", "2"]
    assert main([*argv, *ours]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert expected["tensor_parallel_size"] == 2
    assert expected["plan"]["in_flight"]["pipeline_parallel_size"] == 2
    assert main([*argv, *vllms]) == 0
    assert json.loads(capsys.readouterr().out) == expected


def test_plan_sizes_the_budget_from_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama-3.1-8b", "--gpu-memory", "80GiB", "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "0.9 x 80.00 GiB - 14.96 GiB of weights per GPU (estimated from the config" in out
    argv = ["plan", "llama-3.1-8b", "--gpu-memory", "80GiB", "--weights-memory", "16GiB"]
    argv += ["--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2", "--json"]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["plan"]["memory_bytes"] == 24 * 2**30
    assert document["tensor_parallel_size"] == 2
    assert "(given;" in document["budget"]


def test_plan_lengths_from_a_histogram_and_a_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "gemma-3-27b", "--memory", "40GiB", "--max-model-len", "8192", "--json"]
    assert main([*argv, "--lengths", "1024:3,8192:1"]) == 0
    waste = json.loads(capsys.readouterr().out)["plan"]["waste"]
    assert [r["reference_len"] for r in waste["per_length"]] == [1024, 8192]
    workload = {"requests": [{"prompt": [1] * 100, "output": [2] * 28}] * 3}
    path = tmp_path / "workload.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(workload, f)
    assert main([*argv, "--lengths", str(path)]) == 0
    waste = json.loads(capsys.readouterr().out)["plan"]["waste"]
    assert [r["reference_len"] for r in waste["per_length"]] == [128]
    assert "3 requests" in waste["distribution"]


def test_plan_draws_the_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout.png"
    assert main(["plan", "jamba-mini-1.5", "--memory", "40GiB", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


@contextlib.contextmanager
def _figure(plan: Any, **kwargs: Any) -> Iterator[Any]:
    """`plan_figure(plan, **kwargs)`, closed after the block (skips without matplotlib)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from hybrid_kv.plot import plan_figure

    figure = plan_figure(plan, **kwargs)
    try:
        yield figure
    finally:
        plt.close(figure)


def test_plan_figure_labels_axes_and_lists_only_present_kinds() -> None:
    from hybrid_kv import load_model, plan_kv_cache

    layers = load_model("gemma-3-27b").layers
    plan = plan_kv_cache(layers, 40 * 2**30, 4096)
    vllm = plan_kv_cache(layers, 40 * 2**30, 4096, strategy="vllm")
    with _figure(plan, baseline=vllm, title="gemma-3-27b") as figure:
        (legend,) = figure.legends
        labels = [text.get_text() for text in legend.get_texts()]
        assert labels == ["full attention", "sliding window", "padding"]
        assert "40.00 GiB budget" in figure._suptitle.get_text()
        for axis in figure.axes:
            assert axis.get_ylabel() == "KV cache group"
            assert "page within a block" in axis.get_xlabel()
            assert all(float(t).is_integer() for t in axis.get_xticks())


def _drawn_rows(axis: Any) -> dict[int, list[tuple[str, float]]]:
    """A layout panel's rectangles by row (group): (colour, width) from left to right."""
    from matplotlib.colors import to_hex

    rows: dict[int, list[tuple[float, str, float]]] = {}
    for patch in axis.patches:
        row = rows.setdefault(round(patch.get_y()), [])
        row.append((patch.get_x(), to_hex(patch.get_facecolor()), patch.get_width()))
    return {r: [(colour, width) for _, colour, width in sorted(row)] for r, row in rows.items()}


def _assert_stage_panel(axis: Any, plan: KVCachePlan, stage: PipelineStage) -> None:
    """The panel draws one block of `stage`'s GPU: each group's pages of the stage's own layers
    (one rectangle a layer), the rest of the stage's block hatched, and its pool against its
    own budget."""
    from hybrid_kv.planner import format_bytes

    pages = {p.page_bytes for p in plan.placements}
    (unit,) = pages
    held = set(stage.layer_names)
    rows = _drawn_rows(axis)
    for group in plan.groups:
        mine = [n for n in group.layer_names if n in held]
        drawn = rows.get(group.group_id, [])
        layers = [width for colour, width in drawn if colour != "#dddddd"]
        padding = [width for colour, width in drawn if colour == "#dddddd"]
        assert len(layers) == len(mine), (stage.index, group.group_id)
        assert sum(layers) * unit == sum(plan.placement(n).page_bytes for n in mine)
        assert (sum(layers) + sum(padding)) * unit == stage.block_bytes
    assert axis.get_xlim() == (0, stage.block_bytes / unit)
    title = axis.get_title()
    assert f"{plan.strategy} stage {stage.index}'s GPU" in title
    assert f"decoder layers {stage.start_layer}-{stage.end_layer - 1}" in title
    assert (
        f"pool {format_bytes(stage.pool_bytes)} of its {format_bytes(stage.memory_bytes)} budget"
        in title
    )
    assert f"{plan.num_blocks:,} blocks incl. the null block" in title


def test_plan_figure_draws_each_pipeline_stages_gpu_for_both_plans() -> None:
    from hybrid_kv import load_model, plan_kv_cache

    model = load_model("gemma-3-27b")
    options = {"pipeline_parallel_size": 2, "num_hidden_layers": model.num_hidden_layers}
    plan = plan_kv_cache(model.layers, 16 * 2**30, 131072, **options)
    vllm = plan_kv_cache(model.layers, 16 * 2**30, 131072, strategy="vllm", **options)
    assert plan.stages[0].block_bytes < plan.block_bytes  # not the whole model's block
    with _figure(plan, baseline=vllm, title="gemma-3-27b") as figure:
        panels = [(plan, plan.stages[0]), (plan, plan.stages[1])]
        panels += [(vllm, vllm.stages[0]), (vllm, vllm.stages[1])]
        assert len(figure.axes) == len(panels)
        for axis, (current, stage) in zip(figure.axes, panels, strict=True):
            _assert_stage_panel(axis, current, stage)
        # 31 layers a stage, not 62: each GPU holds half the pages.
        assert sum(len(_drawn_rows(a)) for a in figure.axes) == 4 * plan.num_groups
        assert figure.axes[0].get_title().startswith("min-waste: 7 groups, 1.25 MiB blocks")
        assert figure.axes[2].get_title().startswith("vllm: 7 groups")
        assert "2 pipeline stages, 16.00 GiB budget per GPU" in figure._suptitle.get_text()


def test_plan_figure_draws_each_stage_against_its_own_budget() -> None:
    from hybrid_kv import load_model, plan_kv_cache

    model = load_model("gemma-3-27b")
    # Stage 0 holds layers 0-4: one sliding-window layer in each of five groups, none of the
    # sixth's nor of the full-attention group's, so its block is one page.
    plan = plan_kv_cache(
        model.layers,
        [16 * 2**30, 12 * 2**30],
        32768,
        pipeline_parallel_size=2,
        num_hidden_layers=model.num_hidden_layers,
        pp_layer_partition=[5, 57],
    )
    first, second = plan.stages
    assert first.budget_blocks > second.budget_blocks == plan.num_blocks
    with _figure(plan) as figure:
        top, bottom = figure.axes
        _assert_stage_panel(top, plan, first)
        _assert_stage_panel(bottom, plan, second)
        assert "pool 1.20 GiB of its 16.00 GiB budget, 14.80 GiB unused" in top.get_title()
        assert f"({first.budget_blocks:,} fit its budget)" in top.get_title()
        assert "pool 12.00 GiB of its 12.00 GiB budget" in bottom.get_title()
        assert "fit its budget" not in bottom.get_title()
        # The groups without a layer on stage 0 are a block of nothing but padding there.
        rows = _drawn_rows(top)
        assert rows[5] == rows[6] == [("#dddddd", 1.0)]
        assert "16.00 GiB / 12.00 GiB budget per GPU" in figure._suptitle.get_text()


def test_plan_figure_of_a_stage_draws_no_page_for_its_kv_sharing_layers() -> None:
    from hybrid_kv import load_model, plan_kv_cache

    model = load_model("gemma-3n-e4b")
    plan = plan_kv_cache(
        model.layers, 16 * 2**30, 32768, pipeline_parallel_size=2, num_hidden_layers=35
    )
    with _figure(plan) as figure:
        top, bottom = figure.axes
        _assert_stage_panel(top, plan, plan.stages[0])
        _assert_stage_panel(bottom, plan, plan.stages[1])
        # Stage 1 holds layers 18-34: two with a KV cache, fifteen reading theirs.
        assert "18 KV-cache layers, 128.00 KiB blocks" in top.get_title()
        assert "2 KV-cache layers, 15 sharing theirs, 32.00 KiB blocks" in bottom.get_title()
        assert len([p for p in bottom.patches if p.get_hatch() is None]) == 2


def test_plan_figure_of_one_stage_draws_the_whole_block() -> None:
    from hybrid_kv import load_model, plan_kv_cache
    from hybrid_kv.planner import format_bytes

    model = load_model("gemma-3-27b")
    plan = plan_kv_cache(model.layers, 16 * 2**30, 32768, pipeline_parallel_size=1)
    vllm = plan_kv_cache(model.layers, 16 * 2**30, 32768, strategy="vllm")
    assert len(plan.stages) == 1
    with _figure(plan, baseline=vllm, title="gemma-3-27b") as figure:
        assert len(figure.axes) == 2
        for axis, current in zip(figure.axes, (plan, vllm), strict=True):
            (unit,) = {p.page_bytes for p in current.placements}
            rows = _drawn_rows(axis)
            for group in current.groups:
                drawn = rows[group.group_id]
                assert len(drawn) == len(group.layer_names) + bool(group.padding_bytes)
                assert sum(width for _, width in drawn) * unit == current.block_bytes
            assert axis.get_title() == (
                f"{current.strategy}: {current.num_groups} groups, "
                f"{format_bytes(current.block_bytes)} blocks, "
                f"{current.waste.waste_percent:.2f}% expected waste, "
                f"max concurrency {current.max_concurrency:.2f}x"
            )
        assert figure._suptitle.get_text() == (
            "gemma-3-27b: 16.00 GiB budget, max_model_len 32,768, layout LBNHC"
        )


def test_plan_figure_title_counts_one_group_in_the_singular() -> None:
    from hybrid_kv import load_model, plan_kv_cache

    plan = plan_kv_cache(load_model("llama-3.1-8b").layers, 16 * 2**30, 32768)
    assert plan.num_groups == 1
    with _figure(plan, title="llama-3.1-8b") as figure:
        assert figure.axes[0].get_title().startswith("min-waste: 1 group, ")


def test_plan_plot_with_pipeline_stages_draws_each_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from hybrid_kv import plot

    figures: list[Any] = []
    original = plot.plan_figure

    def recorded(*args: Any, **kwargs: Any) -> Any:
        figures.append(original(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(plot, "plan_figure", recorded)
    path = tmp_path / "x.png"
    argv = ["plan", "gemma-3-27b", "--memory", "16GiB", "-pp", "2", "--plot", str(path)]
    assert main(argv) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out
    (figure,) = figures
    titles = [axis.get_title() for axis in figure.axes]
    assert len(titles) == 4
    for title, strategy, stage in zip(
        titles, ["min-waste", "min-waste", "vllm", "vllm"], [0, 1, 0, 1], strict=True
    ):
        assert f"{strategy} stage {stage}'s GPU: decoder layers" in title
        assert "pool 16.00 GiB of its 16.00 GiB budget" in title


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "nope-7b", "--memory", "40GiB"], "unknown model 'nope-7b'"),
        (["plan", "gema-3-27b", "--memory", "40GiB"], "did you mean gemma-3-27b"),
        (["plan", "./nope/config.json", "--memory", "40GiB"], "no such file or directory"),
        (["plan", "gemma-3-27b", "--memory", "forty"], "bad memory size 'forty'"),
        (["plan", "gemma-3-27b", "--memory", "40"], "has no unit: write 40GiB"),
        (["plan", "gemma-3-27b", "--memory", "-1GiB"], "memory size must be positive"),
        (
            ["plan", "gemma-3-27b", "--memory", "24GiB", "--strategy", "vllm", "--max-groups", "2"],
            "--max-groups caps min-waste's grouping; --strategy vllm groups as vLLM 0.33 does",
        ),
        (["plan", "gemma-3-27b", "--memory", "0"], "memory size must be positive, got '0'"),
        (["plan", "gemma-3-27b", "--memory", "0.0"], "memory size must be positive, got '0.0'"),
        (["plan", "gemma-3-27b"], "give --memory"),
        (["plan", "gemma-3-27b", "--memory", "4GiB", "--gpu-memory", "8GiB"], "not both"),
        (["plan", "gemma-3n-e4b", "--gpu-memory", "24GiB"], "pass --weights-memory"),
        (["plan", "llama-3.1-8b", "--gpu-memory", "16GiB"], "do not fit"),
        (["plan", "llama-3.1-8b", "--memory", "1GiB"], "a max_model_len of"),
        (["plan", "llama-3.1-8b", "--memory", "1GiB", "--block-size", "24"], "multiple"),
        (["plan", "llama-3.1-8b", "--memory", "1GiB", "--dtype", "int2"], "unknown dtype"),
        (["plan", "llama-3.1-8b", "--memory", "1GiB", "--lengths", "1kb:2"], "bad --lengths"),
        *(
            (
                ["plan", "gemma-3-27b", "--memory", "40GiB", "--pipeline-parallel-size", text],
                f"--pipeline-parallel-size must be an integer >= 1, got '{text}'",
            )
            for text in ("0", "-1", "two", "1.5", "", "2e0")
        ),
        (
            ["plan", "gemma-3-27b", "--memory", "40GiB", "-pp", "2", "--async-scheduling"]
            + ["--model-runner", "v1"],
            "async scheduling is not supported by vLLM's V1 model runner with pipeline",
        ),
        *(
            (
                ["plan", "gemma-3-27b", "--memory", "40GiB", "-pp", "2"]
                + ["--pp-layer-partition", text],
                message,
            )
            for text, message in (
                ("a,b", "--pp-layer-partition must be comma-separated layer counts"),
                ("", "--pp-layer-partition must be comma-separated layer counts"),
                ("30,,32", "--pp-layer-partition must be comma-separated layer counts"),
                ("31.0,31", "--pp-layer-partition must be comma-separated layer counts"),
                ("62", "gives 1 layer count, one per stage, but the pipeline parallel size is 2"),
                ("30,31", "sums to 61 layers, but the model has 62"),
                ("-1,63", "counts must be ints >= 0, got -1"),
                ("62,0", "pipeline stage 1 (no decoder layer; split [62, 0]) holds no layer"),
            )
        ),
        *(
            (
                ["plan", "gemma-3-27b", "--memory", "40GiB", "-pp", text],
                f"pipeline parallel size {text} is more stages than the model's 62 decoder layers",
            )
            for text in ("63", "100000", "99999999999999999999")
        ),
        (
            ["plan", "gemma-3n-e4b", "--memory", "40GiB", "-pp", "3"],
            "pipeline stage 2 (decoder layers 24-34; split [12, 12, 11]) holds no layer with a "
            "KV cache of its own",
        ),
    ],
)
def test_errors_are_one_line_with_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("hybrid-kv plan: error:")


def test_config_missing_fields_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    assert main(["plan", str(path), "--memory", "1GiB"]) == 2
    assert "missing 'num_hidden_layers'" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_planning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(cli_module, "plan_kv_cache", lambda *a, **k: pytest.fail("planned"))
    assert main(["plan", "gemma-3-27b", "--memory", "40GiB", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pip install 'hybrid-kv[plot]'" in err


def test_ctrl_c_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_cmd_plan", interrupted)
    assert main(["plan", "gemma-3-27b", "--memory", "40GiB"]) == 130
    assert capsys.readouterr().err == "hybrid-kv: interrupted\n"


def test_a_closed_pipe_ends_quietly() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "hybrid_kv", "plan", "gemma-3-27b", "--memory", "40GiB", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=os.environ.copy(),
    )
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline() == b"{\n"
    process.stdout.close()  # as `| head -1` does
    stderr = process.stderr.read().decode()
    assert process.wait() == 141
    assert stderr == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "gemma-3-27b", "--memory", "40GiB", "--json"],  # fails while printing
        ["demo"],  # fits in the buffer: fails at the final flush
        # argparse prints these and exits; it drops a failed write of its own.
        ["--version"],
        ["plan", "--help"],
    ],
)
def test_output_that_cannot_be_written_is_one_line_and_exit_1(
    argv: list[str], unbuffered: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "hybrid_kv", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    assert result.returncode == 1
    assert result.stderr == "hybrid-kv: error: [Errno 28] No space left on device\n"


def test_version_names_the_vllm_semantics(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"hybrid-kv {__version__} (vLLM 0.33 KV-cache semantics)"
    )


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybrid_kv", "plan", "gemma-2-9b", "--memory", "20GiB", "--json"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plan"]["groups"][0]["kind"] == "sliding_window"


def test_plot_without_an_extension_writes_and_names_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    assert main(["plan", "gpt-oss-20b", "--memory", "8GiB", "--plot", str(tmp_path / "l")]) == 0
    written = tmp_path / "l.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.endswith(f"memory layout written to {written}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["l.png"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("x.txt", "matplotlib cannot write .txt files"),
        ("missing/x.png", "no such directory"),
        (".", "not a file name"),
        ("dir.png", "is a directory"),
        ("plots", "--plot plots is a directory"),  # not written as plots.png
        ("", "not a file name"),  # `--plot "$UNSET"`: no plot, and no word of it
    ],
)
@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_plot_target_that_cannot_be_written_fails_before_any_work(
    command: str,
    target: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("matplotlib")
    from hybrid_kv import simulate as simulate_module

    (tmp_path / "dir.png").mkdir()
    (tmp_path / "plots").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_module, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(simulate_module, "simulate", lambda *a, **k: pytest.fail("simulated"))
    argv = [command, "gpt-oss-20b", "--memory", "8GiB", "--plot", target]
    assert main([*argv, "--no-progress"] if command == "simulate" else argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"hybrid-kv {command}: error: --plot ")
    assert message in captured.err


@pytest.mark.parametrize("memory", ["99999999999999999999PiB", "4096PiB"])
def test_a_budget_of_more_blocks_than_int32_ids_makes_a_pool_of_the_most_blocks(
    memory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "llama-3.1-8b", "--memory", memory, "--max-model-len", "4096", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["num_blocks"] == 2**31 - 1
    assert any(r.startswith("pool capped at 2,147,483,647 blocks") for r in plan["reasons"])


def test_a_pool_is_capped_at_the_most_blocks_int32_ids_number() -> None:
    from hybrid_kv import load_model, plan_kv_cache
    from hybrid_kv.buffers import allocate_kv_cache

    layers = load_model("llama-3.1-8b").layers
    block_bytes = plan_kv_cache(layers, 2**34, 4096, strategy="vllm").block_bytes
    for blocks, capped in ((2**31 - 1, False), (2**31, True), (2**70, True)):
        plan = plan_kv_cache(layers, blocks * block_bytes, 4096, strategy="vllm")
        assert plan.num_blocks == 2**31 - 1
        assert any("pool capped" in r for r in plan.reasons) == capped
    # The capped pool's buffers are within what torch can size.
    pytest.importorskip("torch")
    buffers = allocate_kv_cache(plan, "meta")
    assert buffers


def test_a_lengths_file_that_is_not_a_regular_file_or_is_broken_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(json.dumps({"requests": []}).encode() * 50)[:40])
    for lengths, message in (
        (os.devnull, f"--lengths {os.devnull} is not a regular file"),
        (str(tmp_path), f"--lengths {tmp_path} is a directory"),
        (str(deep), f"{deep}: not valid JSON (nested too deeply)"),
        (str(cut), f"cannot read {cut}"),
    ):
        argv = ["plan", "llama-3.1-8b", "--memory", "8GiB", "--lengths", lengths]
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert captured.err.startswith("hybrid-kv plan: error: ") and message in captured.err


def test_a_max_model_len_above_the_models_is_used_with_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "llama-3.1-8b", "--memory", "80GiB", "--max-model-len", "262144", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["plan"]["max_model_len"] == 262144
    assert captured.err == (
        "hybrid-kv: note: --max-model-len 262,144 is above llama-3.1-8b's 131,072 "
        "(max_position_embeddings); vLLM refuses that unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1\n"
    )
    assert main(["plan", "llama-3.1-8b", "--memory", "80GiB", "--max-model-len", "131072"]) == 0
    assert capsys.readouterr().err == ""


def test_a_lengths_file_that_decompresses_past_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A small gzip file that expands to gigabytes is not read into memory whole.
    monkeypatch.setattr("hybrid_kv.inputs.MAX_INPUT_CHARS", 1 << 20)
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wt", compresslevel=9) as f:
        f.write(json.dumps({"requests": [{"prompt": [1] * 100, "output": [2]}]}))
        for _ in range(4):
            f.write(" " * (1 << 20))
    assert bomb.stat().st_size < 20_000
    assert main(["plan", "llama-3.1-8b", "--memory", "8GiB", "--lengths", str(bomb)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"hybrid-kv plan: error: cannot read {bomb}: more than 1,048,576 characters once "
        "decompressed, more than hybrid-kv reads from one input file\n"
    )


@pytest.mark.parametrize("command", ["plan", "simulate"])
@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError(28, "No space left")])
def test_a_plot_cut_short_leaves_no_file_and_an_earlier_plot_whole(
    command: str,
    interruption: BaseException,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # matplotlib writes the file as it draws: Ctrl-C or a full disk in the middle left a
    # truncated image where the plot was asked for (over an earlier plot of that name).
    pytest.importorskip("matplotlib")
    from PIL import Image

    save = Image.Image.save

    def cut_short(self: Image.Image, fp: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(fp, (str, os.PathLike)):
            # matplotlib's dry run into memory, to lay the figure out.
            return save(self, fp, *args, **kwargs)
        with open(fp, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n cut")
        raise interruption

    monkeypatch.setattr(Image.Image, "save", cut_short)
    earlier = tmp_path / "earlier.png"
    earlier.write_bytes(b"an earlier plot")
    argv = [command, "gpt-oss-20b", "--memory", "8GiB"]
    if command == "simulate":
        argv += ["--requests", "2", "--no-progress"]
    for target in (tmp_path / "new.png", earlier):
        code = main([*argv, "--plot", str(target)])
        assert code == (130 if interruption is KeyboardInterrupt else 2)
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.png"]
    assert earlier.read_bytes() == b"an earlier plot"


def test_a_plot_through_a_symlink_is_written_to_its_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Written beside the file the link names and renamed over it, as matplotlib writes through
    # the link: the link stays a link.
    pytest.importorskip("matplotlib")
    (tmp_path / "plots").mkdir()
    real = tmp_path / "plots" / "run.png"
    real.write_bytes(b"an earlier plot")
    link = tmp_path / "latest.png"
    link.symlink_to(real)
    assert main(["plan", "gpt-oss-20b", "--memory", "8GiB", "--plot", str(link)]) == 0
    assert capsys.readouterr().out.endswith(f"memory layout written to {link}\n")
    assert link.is_symlink() and real.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["latest.png", "plots", "run.png"]
