"""`hybrid-kv simulate`: the built-in serving simulation (the README's first command)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from hybrid_kv import cli as cli_module
from hybrid_kv import load_model, manager_from_plan, plan_kv_cache
from hybrid_kv import simulate as simulate_module
from hybrid_kv.cli import main
from hybrid_kv.planner import InsufficientMemoryError
from hybrid_kv.replay import ReplayStalledError
from hybrid_kv.simulate import (
    MAX_REQUESTS,
    ProgressBar,
    SimulationError,
    make_workload,
    simulate,
)

GIB = 2**30


@pytest.mark.parametrize("workload", ["chat", "long-context", "eviction"])
def test_simulation_finishes_every_request(workload: str) -> None:
    report = simulate("gemma-3-27b", workload, 12 * GIB, num_requests=12, max_model_len=16384)
    assert report.result.num_finished == 12
    assert len(report.usage) == report.result.num_steps
    assert all(0.0 <= u <= 1.0 for u in report.usage)
    assert report.usage[-1] == 0.0, "every request freed at the end"


def test_chat_workload_hits_shared_prefixes_and_eviction_workload_evicts() -> None:
    chat = simulate("gpt-oss-20b", "chat", 2 * GIB, num_requests=40, max_model_len=8192)
    assert chat.result.prefix_cache["hit_rate"] > 0.3
    evict = simulate("llama-3.1-8b", "eviction", 2 * GIB, num_requests=40, max_model_len=8192)
    assert evict.evictions > 0
    assert evict.result.prefix_cache["hit_rate"] < 0.05


def test_mamba_hybrids_run() -> None:
    report = simulate("jamba-mini-1.5", "chat", 4 * GIB, num_requests=10, max_model_len=8192)
    assert report.result.num_finished == 10
    assert any(g.kind == "mamba" for g in report.plan.groups)


def test_workloads_are_deterministic_for_a_seed() -> None:
    assert make_workload("chat", 5, 4096, seed=3) == make_workload("chat", 5, 4096, seed=3)
    assert make_workload("chat", 5, 4096, seed=3) != make_workload("chat", 5, 4096, seed=4)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("batch", 5, 4096)
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        make_workload("chat", 5, 4096, max_num_seqs=0)


def test_scheduler_limits_are_options_and_change_the_run() -> None:
    sched = make_workload("chat", 5, 4096, max_num_seqs=4, max_num_batched_tokens=1024)["sched"]
    assert (sched["max_num_seqs"], sched["max_num_batched_tokens"]) == (4, 1024)
    wide = simulate("gpt-oss-20b", "chat", 8 * GIB, num_requests=30, max_model_len=8192)
    narrow = simulate(
        "gpt-oss-20b", "chat", 8 * GIB, num_requests=30, max_model_len=8192, max_num_seqs=2
    )
    assert narrow.sched["max_num_seqs"] == 2
    assert narrow.result.num_steps > wide.result.num_steps


def test_the_plan_reserves_for_the_tokens_the_scheduler_puts_in_flight() -> None:
    def run(**options: Any) -> Any:
        return simulate(
            "gemma-3-27b",
            "chat",
            8 * GIB,
            num_requests=2,
            max_model_len=8192,
            max_num_batched_tokens=4096,
            **options,
        )

    report = run()
    # The replay runs one batch at a time: sync scheduling, not vLLM's default async (two).
    assert report.plan.max_in_flight_tokens == 4096
    assert "4,096 tokens in flight (sync scheduling)" in report.lines()[2]
    assert report.to_dict()["in_flight"]["async_scheduling"] is False
    # Asked for, async scheduling reserves for two batches.
    asynchronous = run(async_scheduling=True)
    assert asynchronous.plan.max_in_flight_tokens == 8192


def test_a_budget_that_admits_no_request_is_refused_before_running() -> None:
    # Used to loop forever: 8 GiB cannot admit one 32k-token request of Gemma-3-27B with
    # 16k tokens in flight.
    with pytest.raises(InsufficientMemoryError, match="a max_model_len of"):
        simulate("gemma-3-27b", "long-context", 8 * GIB, num_requests=1)


def test_manager_from_plan_uses_the_plan_groups() -> None:
    plan = plan_kv_cache(load_model("gpt-oss-20b").layers, GIB, 4096)
    manager = manager_from_plan(plan)
    assert manager.num_groups == len(plan.groups)
    assert manager.num_blocks == plan.num_blocks


def test_simulate_command_prints_report_and_plots(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sim.png"
    argv = ["simulate", "gpt-oss-20b", "--requests", "10", "--memory", "2GiB", "--no-progress"]
    assert main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    for field in (
        "budget 2.00 GiB",
        "max_model_len 32,768",
        "KV cache",
        "max concurrency",
        "max_num_seqs 64, max_num_batched_tokens 8,192",
        "hit rate",
        "blocks in use",
        "evictions",
        "preemptions",
        "manager time",
    ):
        assert field in out, field
    assert plot.stat().st_size > 10_000


def test_simulate_json(capsys) -> None:
    argv = ["simulate", "gpt-oss-20b", "--requests", "6", "--memory", "2GiB", "--json"]
    assert main([*argv, "--no-progress", "--max-num-seqs", "3"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema_version"] == cli_module.JSON_SCHEMA_VERSION
    assert list(document)[0] == "schema_version"
    assert document["num_requests_finished"] == 6
    assert document["scheduler"] == {"max_num_seqs": 3, "max_num_batched_tokens": 8192}
    assert document["kv_cache_tokens"] > 0 and document["max_concurrency"] > 1


def test_report_figure_labels_axes_and_keeps_the_legend_off_the_data() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    report = simulate("gpt-oss-20b", "eviction", 2 * GIB, num_requests=6, max_model_len=8192)
    figure = simulate_module.report_figure(report)
    try:
        (axis,) = figure.axes
        assert axis.get_ylabel() == "percent" and axis.get_xlabel() == "scheduler step"
        assert "2.00 GiB budget" in axis.get_title()
        assert axis.get_ylim()[0] < 0, "a 0% hit-rate line stays visible above the axis"
        legend = axis.get_legend()
        assert legend.get_bbox_to_anchor().y0 < axis.get_window_extent().y0
    finally:
        plt.close(figure)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "no-such-model"], "unknown model"),
        (["simulate", "--memory", "lots"], "bad memory size"),
        (["simulate", "--memory", "40"], "has no unit"),
        (["simulate", "--requests", "0"], "--requests must be positive"),
        (["simulate", "--max-num-seqs", "-2"], "--max-num-seqs must be positive"),
        (
            ["simulate", "--memory", "8GiB", "--workload", "long-context", "--requests", "1"],
            "fits in this budget, or raise the memory to",
        ),
    ],
)
def test_simulate_command_errors_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys
) -> None:
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybrid-kv simulate: error:") and "\n" not in err
    assert message in err


def test_a_replay_that_stops_exits_1_with_one_line(monkeypatch, capsys) -> None:
    stalled = ReplayStalledError(7, "r3", 9000, 6500, 6553)

    def stuck(*args: object, **kwargs: object) -> None:
        raise stalled

    monkeypatch.setattr(simulate_module, "replay", stuck)
    with pytest.raises(SimulationError, match="'r3' needs 9000 free blocks"):
        simulate("gpt-oss-20b", "chat", 2 * GIB, num_requests=4, max_model_len=8192)
    assert main(["simulate", "gpt-oss-20b", "--memory", "2GiB", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err == f"hybrid-kv simulate: error: the replay stopped: {stalled}\n"
    assert "\n" not in str(stalled)


def test_help_describes_every_simulate_option(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert "number of requests to simulate" in out
    assert "random seed of the synthetic workload" in out
    assert "--max-num-seqs" in out and "--max-num-batched-tokens" in out
    assert "the config's, at most 32,768" in " ".join(out.split())


def test_the_default_max_model_len_is_the_configs_at_most_32768() -> None:
    spec = load_model("gpt-oss-20b")
    assert spec.max_model_len > 32768
    report = simulate(spec, "chat", 8 * GIB, num_requests=2)
    assert report.plan.max_model_len == 32768


# ----------------------------------------------------------------------------- progress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_pipe_prints_a_line_every_few_seconds_and_at_the_end() -> None:
    stream, clock = io.StringIO(), _Clock()
    bar = ProgressBar(200, stream, interval=5.0, clock=clock)
    for step in range(1, 101):
        clock.now = step * 0.1  # 10 s in all
        bar(step, step // 2, 200)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines == [
        "step 50: 25/200 requests finished",
        "step 100: 50/200 requests finished",
        "step 100: 50/200 requests finished",
    ]


def test_progress_on_a_terminal_redraws_one_line_with_steps_and_requests() -> None:
    stream, clock = _Tty(), _Clock()
    bar = ProgressBar(4, stream, clock=clock)
    for step in range(1, 9):
        bar(step, step // 2, 4)
    bar.close()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.count("\r") == 5  # drawn once, then when a request finishes, not every step
    assert "4/4 requests, step 8" in text


def test_progress_goes_quiet_when_nothing_ran() -> None:
    stream = io.StringIO()
    ProgressBar(3, stream).close()
    assert stream.getvalue() == ""


def test_a_budget_whose_blocks_do_not_fit_in_host_memory_is_an_error_not_a_crash(capsys) -> None:
    # 200 TB of KV cache for gpt-oss-20b: ~500 million blocks, whose bookkeeping (~140 bytes
    # a block, ~70 GB) is more host memory than the machine has.
    argv = ["simulate", "gpt-oss-20b", "--requests", "5", "--memory", "200TB", "--no-progress"]
    try:
        with open("/proc/meminfo") as f:
            meminfo = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        pytest.skip("needs Linux (/proc/meminfo)")
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    if available > 60 * GIB:
        pytest.skip("the pool might fit this machine")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("hybrid-kv simulate: error: out of memory: cannot allocate"), err
    assert "per-block arrays" in err and "smaller KV cache budget" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["chat", "long-context", "eviction"])
@pytest.mark.parametrize("max_model_len", [2, 3, 100, 2048])
def test_workloads_fit_max_model_len(kind: str, max_model_len: int) -> None:
    # Every prompt is one vLLM accepts (1 to max_model_len - 1 tokens): the eviction workload's
    # prompts of up to 6,000 tokens once made `--max-model-len 2048` run forever.
    wl = make_workload(kind, 12, max_model_len, seed=3)
    assert all(1 <= len(r["prompt"]) < max_model_len for r in wl["requests"])
    report = simulate("gpt-oss-20b", kind, 2 * GIB, 12, max_model_len, seed=3)
    assert report.result.num_finished == 12


def test_a_max_model_len_without_room_for_an_output_token_is_refused() -> None:
    with pytest.raises(ValueError, match="max_model_len must be at least 2"):
        make_workload("chat", 3, 1)
    assert main(["simulate", "--max-model-len", "1", "--requests", "3", "--no-progress"]) == 2


def test_the_report_dict_has_the_command_lines_schema_version() -> None:
    report = simulate("gpt-oss-20b", "chat", 2 * GIB, num_requests=3, max_model_len=4096)
    assert report.to_dict()["schema_version"] == cli_module.JSON_SCHEMA_VERSION


def test_a_max_model_len_above_the_models_is_used_as_given(capsys) -> None:
    # As `plan` takes it; the command line adds a note that vLLM refuses it.
    spec = load_model("gpt-oss-20b")
    longer = spec.max_model_len * 2
    report = simulate(spec, "chat", 40 * GIB, num_requests=2, max_model_len=longer)
    assert report.plan.max_model_len == longer
    argv = ["simulate", "gpt-oss-20b", "--memory", "40GiB", "--requests", "2", "--json"]
    assert main([*argv, "--max-model-len", str(longer), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["max_model_len"] == longer
    assert captured.err.startswith(f"hybrid-kv: note: --max-model-len {longer:,} is above")


@pytest.mark.parametrize("requests", [MAX_REQUESTS + 1, 10**20])
def test_more_requests_than_a_simulation_takes_are_refused_before_any_work(
    requests: int, monkeypatch, capsys
) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_REQUESTS:,}"):
        make_workload("chat", requests, 4096)
    monkeypatch.setattr(cli_module, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["simulate", "--requests", str(requests), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-kv simulate: error: --requests must be at most 100,000")


def test_an_empty_memory_error_still_says_out_of_memory(monkeypatch, capsys) -> None:
    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(simulate_module, "simulate", exhausted)
    assert main(["simulate", "gpt-oss-20b", "--memory", "2GiB", "--no-progress"]) == 1
    assert capsys.readouterr().err == (
        "hybrid-kv simulate: error: out of memory "
        "(fewer --requests or a smaller KV cache budget need less)\n"
    )


@pytest.mark.parametrize("seed", ["-1", "1.5", str(2**128)])
def test_a_bad_seed_is_named(seed: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--seed", seed, "--no-progress"])
    assert exit_.value.code == 2
    assert "argument --seed:" in capsys.readouterr().err


def test_the_report_counts_one_group_in_the_singular(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "llama-3.1-8b", "--memory", "24GiB", "--requests", "2", "--no-progress"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("model llama-3.1-8b: 1 group (1 full bs 16)\n")


def test_ctrl_c_on_a_terminal_ends_the_bar_before_saying_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The bar's line is ended first, so the message is a line of its own (it was written at
    # the end of the bar's line).
    stream = _Tty()
    monkeypatch.setattr("sys.stderr", stream)

    def interrupted(*args: Any, progress: Any, **kwargs: Any) -> None:
        progress(3, 1, 4)
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate_module, "simulate", interrupted)
    assert main(["simulate", "gpt-oss-20b", "--memory", "8GiB", "--requests", "4"]) == 130
    assert stream.getvalue().endswith("1/4 requests, step 3\nhybrid-kv: interrupted\n")
