"""The replay loop's input: a workload vLLM would refuse is a `ValueError` naming the request,
and a loop that can make no more progress raises instead of spinning."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import hybrid_kv as hk
import pytest
from hybrid_kv import replay as replay_module
from hybrid_kv.replay import (
    HybridKvEngine,
    ReplayStalledError,
    ReplayStuckError,
    check_workload,
    replay,
)

FULL = [{"kind": "full", "block_size": 16}]


def workload(*requests: dict[str, Any], max_model_len: int = 256) -> dict[str, Any]:
    return {
        "sched": {
            "max_model_len": max_model_len,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 64,
        },
        "requests": list(requests),
    }


def request(rid: str, prompt_len: int, output_len: int = 3, arrival: Any = 0) -> dict[str, Any]:
    return {
        "rid": rid,
        "prompt": list(range(1, prompt_len + 1)),
        "output": [7] * output_len,
        "arrival_step": arrival,
    }


def manager(max_model_len: int = 256) -> hk.KVCacheManager:
    return hk.KVCacheManager(FULL, 200, max_model_len)


BAD = [
    ("empty prompt", workload(request("a", 0)), "a prompt of 0 tokens"),
    # A prompt of max_model_len tokens or more: vLLM leaves no room for its output token (the
    # loop once ran such a request forever, never scheduling it a token).
    ("prompt of max_model_len", workload(request("a", 256)), "1 to max_model_len - 1 = 255"),
    ("prompt past max_model_len", workload(request("a", 10), request("b", 9000)), "'b'"),
    ("no output", workload(request("a", 10, output_len=0)), "no output token"),
    ("id twice", workload(request("a", 10), request("a", 12)), "'a' is used twice"),
    ("negative arrival", workload(request("a", 10, arrival=-1)), "arrival_step"),
    ("float arrival", workload(request("a", 10, arrival=1.5)), "arrival_step"),
    ("missing output", workload({"rid": "a", "prompt": [1], "arrival_step": 0}), "'output'"),
    ("max_model_len 1", workload(request("a", 1), max_model_len=1), "at least 2"),
    ("no sched", {"requests": []}, "missing 'sched'"),
]


@pytest.mark.parametrize(("name", "wl", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_workload_vllm_would_refuse_is_a_value_error_before_any_step(
    name: str, wl: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_workload(wl)
    m = manager()
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        replay(wl, m)
    # Nothing ran: no request reached the manager.
    assert m.num_free_blocks == 199


def test_prompts_up_to_max_model_len_minus_one_run_to_max_model_len() -> None:
    # The longest prompt vLLM accepts; its output stops at max_model_len.
    wl = workload(request("a", 255, output_len=50), request("b", 1, output_len=2))
    check_workload(wl)
    result = replay(wl, manager())
    assert result.num_finished == 2


def test_the_replay_command_reports_a_bad_workload(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    with gzip.open(conformance_dir / "full-attn.eviction.workload.json.gz", "rt") as f:
        real = json.load(f)
    bad = copy.deepcopy(real)
    bad["requests"][3]["prompt"] = list(range(bad["sched"]["max_model_len"]))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    rid = bad["requests"][3]["rid"]
    rc = replay_module.main(
        [str(path), "--groups-from", str(trace), "--out", str(tmp_path / "out.jsonl")]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("replay: error:") and repr(rid) in err, err


def test_a_loop_that_schedules_nothing_with_requests_running_raises(monkeypatch) -> None:
    # An engine whose Mamba split leaves a running prefill no token (none does today; the loop
    # must not spin if one ever does).
    class Split(HybridKvEngine):
        def mamba_block_size(self) -> int:
            return 16

    def split(block_size, sched, req, start, n, junction, alignment=0) -> int:
        return n if start == 0 else 0

    monkeypatch.setattr(replay_module, "mamba_block_aligned_split", split)
    wl = workload(request("a", 200, output_len=2))
    with pytest.raises(ReplayStuckError, match="no progress at step 1: 1 requests running") as e:
        replay(wl, Split(manager()))
    assert isinstance(e.value, ReplayStalledError)
    assert e.value.request_id == "a"


def header(*groups: dict[str, Any]) -> dict[str, Any]:
    return {"kv_cache": {"num_blocks": 100, "groups": list(groups)}}


def test_a_header_group_is_built_from_its_vllm_spec_with_every_field_the_core_reads() -> None:
    # A header's short `kind` is as coarse as vLLM's spec kind (full attention for an RSWA
    # group): the spec decides, and its fields reach the core.
    manager = replay_module.manager_from_header(
        header(
            {"kind": "full", "spec": "RSWASpec", "block_size": 16, "rswa_window": 64},
            {
                "kind": "mamba",
                "spec": "MambaSpec",
                "block_size": 16,
                "mamba_cache_mode": "align",
                "num_speculative_blocks": 2,
            },
            {"kind": "full", "spec": "MLAAttentionSpec", "block_size": 16},
            {
                "kind": "sliding_window",
                "spec": "SlidingWindowMLASpec",
                "block_size": 16,
                "sliding_window": 32,
                "bounded_replay": True,
            },
            {"kind": "full", "spec": "UniformTypeKVCacheSpecs", "block_size": 16},
        ),
        512,
    )
    assert manager.groups == [
        {"kind": "rswa", "block_size": 16, "rswa_window": 64},
        {
            "kind": "mamba",
            "block_size": 16,
            "mamba_cache_mode": "align",
            "num_speculative_blocks": 2,
        },
        {"kind": "mla", "block_size": 16},
        {
            "kind": "sliding_window_mla",
            "block_size": 16,
            "sliding_window": 32,
            "bounded_replay": True,
        },
        {"kind": "full", "block_size": 16},
    ]


@pytest.mark.parametrize(
    "spec", ["SinkFullAttentionSpec", "CrossAttentionSpec", "HiSparseHotSpec", "Bogus"]
)
def test_a_header_group_whose_spec_has_no_group_kind_is_refused_by_name(spec: str) -> None:
    # Replaying such a group as the kind its header names would diverge without saying why.
    with pytest.raises(ValueError, match=f"header group 1: vLLM spec '{spec}'"):
        replay_module.manager_from_header(
            header(
                {"kind": "full", "spec": "FullAttentionSpec", "block_size": 16},
                {"kind": "full", "spec": spec, "block_size": 16},
            ),
            512,
        )
