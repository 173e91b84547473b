"""Replays vLLM 0.33's own traces through the Python API: every call must match, block ids too."""

import gzip
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hybrid_kv as hk
import numpy as np
import pytest
from conftest import FIXTURES
from hybrid_kv.replay import (
    HybridKvEngine,
    load_json,
    manager_from_header,
    read_header,
    replay,
)
from hybrid_kv.replay import main as replay_main


def trace_diff(conformance_dir: Path, ours: Path, name: str) -> str:
    vllm = conformance_dir / f"{name}.vllm.jsonl.gz"
    run = subprocess.run(
        [sys.executable, str(conformance_dir / "trace_diff.py"), str(ours), str(vllm), "--ids"],
        capture_output=True,
        text=True,
    )
    return run.stdout


@pytest.mark.parametrize("name", FIXTURES)
def test_replay_is_identical_to_vllm(conformance_dir: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / f"{name}.jsonl"
    code = replay_main(
        [
            str(conformance_dir / f"{name}.workload.json.gz"),
            "--groups-from",
            str(conformance_dir / f"{name}.vllm.jsonl.gz"),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = trace_diff(conformance_dir, out, name)
    assert "IDENTICAL" in report, report[:3000]
    # trace_diff does not compare request lines: they must match too (arrival, sizes, digest).
    ours = req_lines(out)
    assert len(ours) == len(load_json(conformance_dir / f"{name}.workload.json.gz")["requests"])
    assert ours == req_lines(conformance_dir / f"{name}.vllm.jsonl.gz")


def load_fixture(conformance_dir: Path, name: str) -> tuple[dict, dict, hk.KVCacheManager]:
    """A fixture's workload and recorded trace header, and a manager built from the header."""
    workload = load_json(conformance_dir / f"{name}.workload.json.gz")
    header = read_header(conformance_dir / f"{name}.vllm.jsonl.gz")
    return (
        workload,
        header,
        manager_from_header(
            header, workload["sched"]["max_model_len"], workload["sched"]["max_num_batched_tokens"]
        ),
    )


def req_lines(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.startswith('{"kind":"req"')]


@pytest.mark.parametrize("name", ["gpt-oss.shared-prefix", "gpt-oss.eviction.default"])
def test_replay_stays_identical_while_other_threads_probe(
    conformance_dir: Path, tmp_path: Path, name: str
) -> None:
    workload, header, manager = load_fixture(conformance_dir, name)
    prompts = [np.array(r["prompt"], dtype=np.int32) for r in workload["requests"][:60]]
    stop = threading.Event()
    problems: list[str] = []
    probes = [0]

    def probe(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            prompt = prompts[rng.integers(len(prompts))]
            prompt = prompt[: rng.integers(1, len(prompt) + 1)]
            try:
                hit = manager.probe(prompt)
            except Exception as e:  # noqa: BLE001 - any exception is a failure
                problems.append(repr(e))
                return
            if not 0 <= hit <= len(prompt) - 1:
                problems.append(f"probe reported {hit} tokens of a {len(prompt)}-token prompt")
            probes[0] += 1

    threads = [threading.Thread(target=probe, args=(s,)) for s in range(3)]
    # The GIL hands over every 5 ms by default: a replay of half a second then gives the probing
    # threads as few as a handful of turns. Finer turns interleave probes with the replay's calls.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    for t in threads:
        t.start()
    out = tmp_path / "ours.jsonl"
    try:
        with open(out, "w") as f:
            replay(
                workload,
                manager,
                f,
                {
                    "kind": "header",
                    **{k: header[k] for k in ("format", "layout", "workload", "kv_cache")},
                },
            )
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert problems == []
    assert probes[0] > 100
    assert "IDENTICAL" in trace_diff(conformance_dir, out, name)


def test_probe_matches_get_computed_blocks() -> None:
    manager = hk.KVCacheManager([{"kind": "full", "block_size": 16}], 64, 4096)
    prompt = list(range(100))
    first = hk.Request("a", prompt)
    new = manager.allocate_slots(first, 100)
    assert new is not None
    assert manager.probe(prompt) == 96
    second = hk.Request("b", prompt[:50] + [7] * 30)
    _, hit = manager.get_computed_blocks(second)
    assert manager.probe(np.array(prompt[:50] + [7] * 30)) == hit == 48
    assert manager.probe(prompt, cache_salt="other-tenant") == 0


@pytest.mark.parametrize("fresh", [True, False])
def test_replay_hands_requests_fresh_copies_of_the_prompts_or_the_loaded_lists(
    conformance_dir: Path, fresh: bool
) -> None:
    name = "full-attn.eviction"
    workload, _, manager = load_fixture(conformance_dir, name)
    loaded = {r["rid"]: r["prompt"] for r in workload["requests"]}
    given: dict[str, list[int]] = {}

    class Recording(HybridKvEngine):
        def request_maker(self, r: dict) -> Callable[[], Any]:
            given[r["rid"]] = r["prompt"]
            return super().request_maker(r)

    result = replay(workload, Recording(manager), max_steps=1, fresh_prompts=fresh)
    assert result.num_steps == 1
    assert given.keys() == loaded.keys()
    for rid, prompt in given.items():
        assert prompt == loaded[rid]
        assert (prompt is loaded[rid]) is not fresh
    # The workload itself is left as it was.
    assert all(r["prompt"] is loaded[r["rid"]] for r in workload["requests"])


def test_the_replay_subcommand_writes_an_identical_trace(
    conformance_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybrid_kv.cli import main

    name = "llama4.long-context.default"
    out = tmp_path / "ours.jsonl"
    rc = main(
        [
            "replay",
            str(conformance_dir / f"{name}.workload.json.gz"),
            "--groups-from",
            str(conformance_dir / f"{name}.vllm.jsonl.gz"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    assert "finished" in capsys.readouterr().out
    assert "IDENTICAL" in trace_diff(conformance_dir, out, name)


def test_a_header_gives_the_manager_vllms_resolved_block_sizes(conformance_dir: Path) -> None:
    # vLLM records the block sizes it resolved (`prefix_match_unit`, or the gcd and lcm of the
    # groups' block sizes); the replay's manager takes them rather than resolving its own.
    _, header, manager = load_fixture(conformance_dir, "gpt-oss.shared-prefix")
    kv = header["kv_cache"]
    assert (manager.scheduler_block_size, manager.hash_block_size) == (
        kv["scheduler_block_size"],
        kv["hash_block_size"],
    )
    finer = {**header, "kv_cache": {**kv, "hash_block_size": kv["hash_block_size"] // 2}}
    manager = manager_from_header(finer, 4096)
    assert manager.hash_block_size == kv["hash_block_size"] // 2
    coarser = {**header, "kv_cache": {**kv, "scheduler_block_size": 2 * kv["scheduler_block_size"]}}
    assert manager_from_header(coarser, 4096).scheduler_block_size == 2 * kv["scheduler_block_size"]
    # Older headers without them: the manager resolves them as vLLM does.
    bare = {
        **header,
        "kv_cache": {
            k: v for k, v in kv.items() if k not in ("scheduler_block_size", "hash_block_size")
        },
    }
    manager = manager_from_header(bare, 4096)
    assert (manager.scheduler_block_size, manager.hash_block_size) == (16, 16)
