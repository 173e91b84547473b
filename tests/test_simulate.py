"""`hybrid-kv simulate`: the built-in serving simulation (the README's first command)."""

from pathlib import Path

import pytest
from hybrid_kv import manager_from_plan
from hybrid_kv.cli import main
from hybrid_kv.simulate import make_workload, simulate


@pytest.mark.parametrize("workload", ["chat", "long-context", "eviction"])
def test_simulation_finishes_every_request(workload: str) -> None:
    report = simulate("gemma-3-27b", workload, 8 * 2**30, num_requests=12, max_model_len=16384)
    assert report.result.num_finished == 12
    assert len(report.usage) == report.result.num_steps
    assert all(0.0 <= u <= 1.0 for u in report.usage)
    assert report.usage[-1] == 0.0, "every request freed at the end"


def test_chat_workload_hits_shared_prefixes_and_eviction_workload_evicts() -> None:
    chat = simulate("gpt-oss-20b", "chat", 2 * 2**30, num_requests=40, max_model_len=8192)
    assert chat.result.prefix_cache["hit_rate"] > 0.3
    evict = simulate("llama-3.1-8b", "eviction", 2 * 2**30, num_requests=40, max_model_len=8192)
    assert evict.evictions > 0
    assert evict.result.prefix_cache["hit_rate"] < 0.05


def test_workloads_are_deterministic_for_a_seed() -> None:
    assert make_workload("chat", 5, 4096, seed=3) == make_workload("chat", 5, 4096, seed=3)
    assert make_workload("chat", 5, 4096, seed=3) != make_workload("chat", 5, 4096, seed=4)
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("batch", 5, 4096)


def test_manager_from_plan_uses_the_plan_groups() -> None:
    from hybrid_kv import load_model, plan_kv_cache

    plan = plan_kv_cache(load_model("gpt-oss-20b").layers, 2**30, 4096)
    manager = manager_from_plan(plan)
    assert manager.num_groups == len(plan.groups)
    assert manager.num_blocks == plan.num_blocks


def test_simulate_command_prints_report_and_plots(tmp_path: Path, capsys) -> None:
    plot = tmp_path / "sim.png"
    code = main(
        [
            "simulate",
            "gpt-oss-20b",
            "--requests",
            "10",
            "--memory",
            "2GiB",
            "--no-progress",
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    for field in ("hit rate", "blocks in use", "evictions", "preemptions", "manager time"):
        assert field in out
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "no-such-model"],
        ["simulate", "--memory", "lots"],
        ["simulate", "--requests", "0"],
    ],
)
def test_simulate_command_errors_are_one_line_and_exit_2(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybrid-kv simulate: error:") and "\n" not in err
