"""Request-length distributions: the default, histograms, workloads and traces, clipping and
binning."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hybrid_kv.planner import LengthDistribution, PlanError
from hybrid_kv.planner.lengths import MAX_POINTS


def test_default_is_log_uniform_from_128_to_max_model_len() -> None:
    dist = LengthDistribution.default(4096)
    assert dist.lengths == (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert set(dist.weights) == {1}
    assert LengthDistribution.default(100).lengths == (100,)


def test_histograms_parse_lengths_and_counts() -> None:
    dist = LengthDistribution.parse("8192:2, 1024:5,1024,300")
    assert (dist.lengths, dist.weights) == ((300, 1024, 8192), (1, 6, 2))
    for bad in ("", "1.5K:2", "1e3:2", "1k:2k", "100:-1", "0:3", "a,b"):
        with pytest.raises(PlanError):
            LengthDistribution.parse(bad)


def test_histogram_lengths_read_as_vllm_reads_token_counts() -> None:
    # As --max-model-len: 8K is 8,192 tokens, 8k is 8,000, 2.5k is 2,500.
    dist = LengthDistribution.parse("8K:2,8k,2.5k:3, 300")
    assert (dist.lengths, dist.weights) == ((300, 2500, 8000, 8192), (1, 3, 1, 2))


def test_workloads_count_prompt_plus_output(tmp_path: Path) -> None:
    workload = {
        "requests": [
            {"prompt": [1] * 10, "output": [2] * 5},
            {"prompt": [1] * 10, "output": [2] * 5},
            {"prompt": [1] * 90, "output": [2] * 10},
        ]
    }
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workload))
    dist = LengthDistribution.load(path)
    assert (dist.lengths, dist.weights) == ((15, 100), (2, 1))
    assert "3 requests" in dist.source
    assert LengthDistribution.parse(str(path)) == dist


def test_kvtrace_req_records_count_prompt_plus_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t.vllm.jsonl.gz"
    records = [
        {"kind": "header", "format": "kvtrace/1"},
        {"kind": "req", "rid": "a", "num_prompt_tokens": 100, "max_tokens": 20},
        {"kind": "req", "rid": "b", "num_prompt_tokens": 500, "max_tokens": 12},
        {"kind": "call", "op": "free"},
    ]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    assert LengthDistribution.load(path).lengths == (120, 512)


def test_unreadable_sources_are_clear(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no such file"):
        LengthDistribution.load(tmp_path / "missing.json")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"requests": []}))
    with pytest.raises(PlanError, match="no requests found"):
        LengthDistribution.load(empty)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(PlanError, match="neither JSON nor JSON lines"):
        LengthDistribution.load(broken)


def test_lengths_beyond_max_model_len_count_at_max_model_len() -> None:
    dist = LengthDistribution.parse("100:1,5000:2,9000:3").clipped(4096)
    assert (dist.lengths, dist.weights) == ((100, 4096), (1, 5))


def test_large_samples_are_binned_keeping_their_weight() -> None:
    dist = LengthDistribution.from_lengths(range(1, 5001), "sample")
    assert len(dist.lengths) <= MAX_POINTS
    assert dist.total_weight == 5000
    assert dist.lengths[0] >= 1 and dist.lengths[-1] <= 5000
    assert list(dist.lengths) == sorted(set(dist.lengths))
