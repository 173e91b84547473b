"""The replay loop's input: a workload vLLM would refuse is a `ValueError` naming the request,
and a loop that can make no more progress raises instead of spinning."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import subprocess
import sys
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
    ("not an object", [1, 2], "a list, not an object"),
    ("sched not an object", {"sched": [1], "requests": []}, "'sched' is a list"),
    ("requests not a list", {**workload(), "requests": {"a": 1}}, "'requests' is a dict"),
    ("request not an object", workload(request("a", 10), 5), "request 1: missing"),
    ("id a list", workload({**request("a", 10), "rid": [1]}), "id \\[1\\] is not a string"),
    ("id a bool", workload({**request("a", 10), "rid": True}), "id True is not a string"),
    ("prompt a string", workload({**request("a", 10), "prompt": "hello"}), "got str"),
    ("prompt token str", workload({**request("a", 10), "prompt": [1, "2"]}), "token 1 is '2'"),
    ("prompt token float", workload({**request("a", 10), "prompt": [1.0]}), "token 0 is 1.0"),
    ("prompt token bool", workload({**request("a", 10), "prompt": [3, True]}), "token 1 is True"),
    ("prompt token < 0", workload({**request("a", 10), "prompt": [5, -1]}), "token 1 is -1"),
    ("prompt token 2^32", workload({**request("a", 10), "prompt": [2**32]}), "\\[0, 2\\^32\\)"),
    ("output an int", workload({**request("a", 10), "output": 3}), "output must be a list"),
    ("output token < 0", workload({**request("a", 10), "output": [-7]}), "output token 0"),
]


def _sched(**fields: Any) -> dict[str, Any]:
    wl = workload(request("a", 10))
    wl["sched"].update(fields)
    return wl


def _without(key: str) -> dict[str, Any]:
    wl = workload(request("a", 10))
    del wl["sched"][key]
    return wl


BAD += [
    ("no max_num_seqs", _without("max_num_seqs"), "missing sched 'max_num_seqs'"),
    ("no max_model_len", _without("max_model_len"), "missing sched 'max_model_len'"),
    ("max_num_seqs 0", _sched(max_num_seqs=0), "max_num_seqs must be an integer of at least 1"),
    ("max_num_seqs str", _sched(max_num_seqs="4"), "max_num_seqs must be an integer"),
    ("batched 0", _sched(max_num_batched_tokens=0), "max_num_batched_tokens must be"),
    ("batched float", _sched(max_num_batched_tokens=8.0), "max_num_batched_tokens must be"),
    ("threshold < 0", _sched(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    ("max_model_len 2^63", _sched(max_model_len=2**63), "max_model_len must be below 2\\^63"),
]


@pytest.mark.parametrize(("name", "wl", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_workload_vllm_would_refuse_is_a_value_error_before_any_step(
    name: str, wl: dict[str, Any], message: str
) -> None:
    pattern = message if "\\" in message else message.replace("(", r"\(")
    with pytest.raises(ValueError, match=pattern):
        check_workload(wl)
    m = manager()
    with pytest.raises(ValueError, match=pattern):
        replay(wl, m)
    # Nothing ran: no request reached the manager.
    assert m.num_free_blocks == 199


def test_a_long_prefill_threshold_of_none_or_zero_is_accepted() -> None:
    for threshold in (None, 0):
        check_workload(_sched(long_prefill_token_threshold=threshold))


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


def _run(tmp_path: Path, workload_path: Path, trace: Path, *extra: str) -> int:
    out = tmp_path / "o.jsonl"
    return replay_module.main(
        [str(workload_path), "--groups-from", str(trace), "--out", str(out), *extra]
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_python_dash_m_replay_whose_summary_cannot_be_written_exits_1_in_one_line(
    conformance_dir: Path, tmp_path: Path
) -> None:
    workload_path = conformance_dir / "full-attn.eviction.workload.json.gz"
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    argv = [str(workload_path), "--groups-from", str(trace), "--out", str(tmp_path / "o.jsonl")]
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "hybrid_kv.replay", *argv, "--max-steps", "1"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
    assert result.returncode == 1
    assert result.stderr == "hybrid-kv: error: [Errno 28] No space left on device\n"


def test_the_replay_command_names_a_file_it_cannot_read(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    not_json = tmp_path / "notes.json"
    not_json.write_text("hello")
    not_gzip = tmp_path / "w.json.gz"
    not_gzip.write_bytes(b"\x1f\x8b not really")
    truncated = tmp_path / "cut.json.gz"
    truncated.write_bytes(real.read_bytes()[:300])
    no_header = tmp_path / "t.jsonl"
    no_header.write_text("5\n")
    for workload_path, trace_path, expected in (
        (not_json, trace, f"workload {not_json}: Expecting value"),
        (not_gzip, trace, f"workload {not_gzip}:"),
        (truncated, trace, f"workload {truncated}: Compressed file ended"),
        (tmp_path, trace, "Is a directory"),
        (real, not_json, f"trace {not_json}: Expecting value"),
        (real, no_header, f"{no_header}: no header line"),
    ):
        assert _run(tmp_path, workload_path, trace_path) == 2
        err = capsys.readouterr().err
        assert err.startswith("replay: error: ") and expected in err, err
        assert "Traceback" not in err


def test_the_replay_command_refuses_an_input_that_is_not_a_regular_file(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    # A device or a pipe is read to its end before parsing: /dev/zero or /dev/urandom would
    # fill memory, a FIFO nobody writes blocks forever. Named as `--lengths` names them.
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    for workload_path, trace_path, expected in (
        (Path(os.devnull), trace, f"workload {os.devnull} is not a regular file"),
        (real, Path(os.devnull), f"trace {os.devnull} is not a regular file"),
    ):
        assert _run(tmp_path, workload_path, trace_path) == 2
        err = capsys.readouterr().err
        assert err == f"replay: error: {expected}\n", err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda h: h.pop("kv_cache"), "no 'kv_cache' object"),
        (lambda h: h["kv_cache"].update(groups=None), "'groups' must be a list of objects"),
        (lambda h: h["kv_cache"].update(groups=[5]), "'groups' must be a list of objects"),
        (lambda h: h["kv_cache"].pop("num_blocks"), "missing 'num_blocks'"),
        (lambda h: h["kv_cache"]["groups"][0].pop("block_size"), "group 0: missing 'block_size'"),
        (lambda h: h["kv_cache"]["groups"][0].update(spec=["x"]), "vLLM spec \\['x'\\]"),
        (lambda h: h["kv_cache"].update(num_blocks="many"), "the header of"),
    ],
)
def test_the_replay_command_reports_a_bad_header(
    conformance_dir: Path, tmp_path: Path, capsys, mutate: Any, message: str
) -> None:
    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    head = replay_module.read_header(conformance_dir / "full-attn.eviction.vllm.jsonl.gz")
    mutate(head)
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(head) + "\n")
    assert _run(tmp_path, real, trace) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"replay: error: cannot build a manager from the header of {trace}")
    assert re.search(message, err), err


def test_the_replay_command_reports_an_output_it_cannot_write_and_a_bad_step_limit(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    for out in (tmp_path / "no" / "such" / "dir.jsonl", tmp_path):
        rc = replay_module.main([str(real), "--groups-from", str(trace), "--out", str(out)])
        assert rc == 2
        err = capsys.readouterr().err
        assert err.startswith(f"replay: error: cannot write {out}:"), err
    for steps in ("0", "-3", "two"):
        with pytest.raises(SystemExit) as exit_:
            _run(tmp_path, real, trace, "--max-steps", steps)
        assert exit_.value.code == 2
        assert "argument --max-steps" in capsys.readouterr().err
    assert _run(tmp_path, real, trace, "--max-steps", "2") == 0
    steps = [json.loads(line) for line in (tmp_path / "o.jsonl").open()]
    assert sum(1 for r in steps if r["kind"] == "step") == 2


def test_integer_request_ids_replay_as_their_decimal_strings(
    conformance_dir: Path, tmp_path: Path
) -> None:
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    with gzip.open(conformance_dir / "full-attn.eviction.workload.json.gz", "rt") as f:
        real = json.load(f)
    real["requests"] = real["requests"][:40]
    numbered = copy.deepcopy(real)
    for index, r in enumerate(numbered["requests"]):
        r["rid"] = index * 7 + (2**70 if index % 2 else 0)
        real["requests"][index]["rid"] = str(r["rid"])
    calls = {}
    for name, document in (("str", real), ("int", numbered)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        out = tmp_path / f"{name}.jsonl"
        argv = [str(path), "--groups-from", str(trace), "--out", str(out)]
        assert replay_module.main(argv) == 0
        calls[name] = [
            {**r, "rid": str(r["rid"]), "ns": 0}
            for r in map(json.loads, out.open())
            if r["kind"] == "call"
        ]
    assert calls["int"] == calls["str"] and calls["int"]


@pytest.mark.parametrize(("first", "second"), [(1, "1"), ("12", 12), (2**70, str(2**70))])
def test_an_integer_id_and_its_string_are_one_id(first: Any, second: Any) -> None:
    bad = workload({**request("a", 10), "rid": first}, {**request("b", 10), "rid": second})
    with pytest.raises(ValueError, match="is used twice"):
        check_workload(bad)


def test_deeply_nested_json_is_not_valid_json(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    for opening, closing in (("[", "]"), ('{"a":', "}")):
        deep = tmp_path / "deep.json"
        deep.write_text(opening * 100_000 + "1" + closing * 100_000)
        for workload_path, trace_path, what in ((deep, trace, "workload"), (real, deep, "trace")):
            assert _run(tmp_path, workload_path, trace_path) == 2
            err = capsys.readouterr().err
            assert err == f"replay: error: {what} {deep}: not valid JSON (nested too deeply)\n"


def _stalling_inputs(conformance_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A workload whose second request can never be admitted to the trace header's pool."""
    head = replay_module.read_header(conformance_dir / "full-attn.eviction.vllm.jsonl.gz")
    head["kv_cache"]["num_blocks"] = 12
    trace = tmp_path / "small.jsonl"
    trace.write_text(json.dumps(head) + "\n")
    path = tmp_path / "stall.json"
    path.write_text(json.dumps(workload(request("a", 20), request("b", 250), max_model_len=300)))
    return path, trace


def test_a_stalled_replay_leaves_its_trace_beside_the_output_not_in_it(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    stall, trace = _stalling_inputs(conformance_dir, tmp_path)
    out = tmp_path / "o.jsonl"
    out.write_text("an earlier trace\n")
    assert _run(tmp_path, stall, trace) == 1
    partial = tmp_path / "o.jsonl.partial"
    err = capsys.readouterr().err
    assert err.startswith("replay: error: ") and f"the trace so far is in {partial}" in err, err
    assert out.read_text() == "an earlier trace\n"
    records = [json.loads(line) for line in partial.open()]
    assert records[0]["kind"] == "header"
    assert any(r["kind"] == "call" and r["rid"] == "a" for r in records)
    # A replay that completes replaces the output and leaves no partial trace.
    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    full = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    assert _run(tmp_path, real, full, "--max-steps", "3") == 0
    assert not partial.exists()
    assert json.loads(out.open().readline())["kind"] == "header"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_write_error_during_the_replay_is_one_line(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    argv = [str(real), "--groups-from", str(trace), "--out", "/dev/full"]
    assert replay_module.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("replay: error: cannot write /dev/full: ") and err.count("\n") == 1


def test_hybrid_kv_replay_names_its_command_in_errors(
    conformance_dir: Path, tmp_path: Path, capsys
) -> None:
    from hybrid_kv.cli import main

    stall, trace = _stalling_inputs(conformance_dir, tmp_path)
    out = tmp_path / "o.jsonl"
    assert main(["replay", str(stall), "--groups-from", str(trace), "--out", str(out)]) == 1
    assert capsys.readouterr().err.startswith("hybrid-kv replay: error: ")
    assert main(["replay", str(tmp_path), "--groups-from", str(trace), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("hybrid-kv replay: error: ")


def _gzip_bomb(path: Path, document: str, padding: int) -> Path:
    """`document` followed by `padding` spaces, gzip-compressed: valid JSON a thousand times
    larger than its file."""
    with gzip.open(path, "wt", compresslevel=9) as f:
        f.write(document)
        for _ in range(padding >> 20):
            f.write(" " * (1 << 20))
    return path


def test_an_input_that_decompresses_past_the_limit_is_refused_before_it_is_read_whole(
    conformance_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # A few kilobytes of gzip that expand to gigabytes would be read into memory (and parsed)
    # before anything was checked; the limit, lowered here, refuses them as it reads.
    monkeypatch.setattr("hybrid_kv.inputs.MAX_INPUT_CHARS", 1 << 20)
    small = workload({"rid": "a", "prompt": [1, 2, 3], "output": [4], "arrival_step": 0})
    bomb = _gzip_bomb(tmp_path / "bomb.json.gz", json.dumps(small), 4 << 20)
    assert bomb.stat().st_size < 20_000
    trace = conformance_dir / "full-attn.eviction.vllm.jsonl.gz"
    header = replay_module.read_header(trace)
    trace_bomb = _gzip_bomb(tmp_path / "t.jsonl.gz", "", 4 << 20)
    with gzip.open(trace_bomb, "at") as f:
        f.write("\n" + json.dumps(header) + "\n")
    fits = tmp_path / "fits.json"
    fits.write_text(json.dumps(small).ljust(1 << 20))
    for workload_path, trace_path, expected in (
        (bomb, trace, f"workload {bomb}: more than 1,048,576 characters once decompressed"),
        (fits, trace_bomb, f"trace {trace_bomb}: more than 1,048,576 characters once"),
    ):
        assert _run(tmp_path, workload_path, trace_path) == 2
        err = capsys.readouterr().err
        assert err.startswith("replay: error: ") and expected in err and err.count("\n") == 1
        assert list(tmp_path.glob("o.jsonl*")) == []
    # A file of exactly the limit is read.
    assert _run(tmp_path, fits, trace) == 0


def test_a_header_whose_pool_does_not_fit_in_memory_is_one_line_and_exit_1(
    conformance_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # `python -m hybrid_kv.replay` printed the MemoryError's traceback; `hybrid-kv replay`
    # advised a smaller KV cache budget, which replay has no option for.
    from hybrid_kv.cli import main as cli_main

    real = conformance_dir / "full-attn.eviction.workload.json.gz"
    head = replay_module.read_header(conformance_dir / "full-attn.eviction.vllm.jsonl.gz")
    head["kv_cache"]["num_blocks"] = 2**31 - 1
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(head) + "\n")

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("out of memory: cannot allocate 313538904096 bytes for the pool")

    monkeypatch.setattr(replay_module, "manager_from_header", out_of_memory)
    for prog, run in (
        ("replay", lambda argv: replay_module.main(argv)),
        ("hybrid-kv replay", lambda argv: cli_main(["replay", *argv])),
    ):
        argv = [str(real), "--groups-from", str(trace), "--out", str(tmp_path / "o.jsonl")]
        assert run(argv) == 1
        assert capsys.readouterr().err == (
            f"{prog}: error: cannot build a manager from the header of {trace}: out of memory: "
            "cannot allocate 313538904096 bytes for the pool (the header's pool has "
            "2,147,483,647 blocks)\n"
        )
        assert list(tmp_path.glob("o.jsonl*")) == []
