"""`benches/vllm_scheduler.py`'s instrumented pass: its timers pass every manager call through
unchanged (the instrumented scheduler decides as the plain one does), count the calls the
scheduler makes, and are taken off again afterwards."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv.vllm as hkv  # noqa: E402
from bench_loader import load_bench  # noqa: E402
from hybrid_kv import _core  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402

bench = load_bench("vllm_scheduler.py")
SIZE = 4


def _options(layout: str) -> harness.Options:
    return harness.Options(
        layout=layout, num_blocks=4_000, max_num_seqs=SIZE, max_model_len=4096, log_stats=True
    )


def _workload() -> list[harness.RequestSpec]:
    return harness.chat_workload(
        14, seed=3, num_system_prompts=2, system_len=(40, 90), user_len=(5, 40), max_tokens=(8, 40)
    )


def _run(scheduler: Any, workload: list[harness.RequestSpec]) -> list[dict[str, Any]]:
    return [harness.summarize(out) for out, _ in harness.Driver(scheduler, workload).run()]


@pytest.mark.parametrize("layout", ["full", "gemma3"])
@pytest.mark.parametrize("cls", [None, hkv.Scheduler], ids=["vllm", "hybrid-kv"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_timed_scheduler_decides_as_the_plain_one(layout: str, cls: Any, native: bool) -> None:
    workload = _workload()
    plain = _run(harness.build_scheduler(_options(layout), cls), workload)
    scheduler = harness.build_scheduler(_options(layout), cls)
    manager = scheduler.kv_cache_manager
    result_class = type(manager.empty_kv_cache_blocks)
    originals = {
        c: c.__dict__["get_block_ids"]
        for c in result_class.__mro__
        if "get_block_ids" in c.__dict__
    }
    if native:
        timers, restore = bench.instrument_native(manager)
        read = timers.read
    else:
        totals, restore = bench.instrument(manager)

        def read() -> dict[str, int]:
            return dict(totals)

    try:
        timed = _run(scheduler, workload)
    finally:
        restore()
    assert timed == plain
    totals = read()
    steps = len(plain)
    running_steps = sum(len(s["new"]) + len(s["cached"]) for s in plain)
    # Every scheduled request, new or running, had its slots allocated once per step.
    assert totals["allocate_slots#calls"] >= running_steps
    assert totals["allocate_slots"] > 0
    for name in ("get_computed_blocks", "free", "new_step_starts", "make_prefix_cache_stats"):
        assert totals[f"{name}#calls"] > 0, name
        assert totals[name] > 0, name
    assert totals["new_step_starts#calls"] == steps
    assert totals[f"{bench.READ_IDS}#calls"] > 0
    if native:
        assert totals["calls"] == sum(v for k, v in totals.items() if k.endswith("#calls"))
        # hybrid-kv's running steps that took new blocks came back through a proxy.
        assert (totals["proxies"] > 0) == (cls is not None)
    assert totals["manager"] >= totals["allocate_slots"]
    for c, original in originals.items():
        assert c.__dict__["get_block_ids"] is original


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_manager_share_counts_the_running_steps(native: bool) -> None:
    options = bench.options_for("gemma3", SIZE)
    workload = bench.workload_for(SIZE, 40)
    shares = {}
    for name, cls in (("vllm", None), ("hybrid-kv", hkv.Scheduler)):
        share, per_call = bench.manager_share(options, workload, cls, 40, False, native)
        assert 0 < share < 1, (name, share)
        share_of_calls, ns, per_step = per_call["allocate_slots"]
        # Steps kept have SIZE requests running, each allocated once (admissions included).
        assert per_step >= SIZE, (name, per_step)
        assert ns > 0 and 0 < share_of_calls < share
        shares[name] = share
    # vLLM's manager takes a larger share of its step than hybrid-kv's of its own.
    assert shares["vllm"] > shares["hybrid-kv"]


def test_native_bias_is_measured() -> None:
    bias = bench.native_bias(samples=20_000)
    assert bias["counted"] == bias["allocate_counted"] == 0
    assert set(bias) == {
        "counted",
        "allocate_counted",
        "step",
        "allocate_step",
        "ids_step",
        "proxy",
    }
    assert bias["proxy"] > 0
    assert _core._CallTimer(len).function()([1, 2]) == 2
