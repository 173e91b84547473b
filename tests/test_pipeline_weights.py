"""Weights per pipeline stage, as vLLM 0.33 places them, and the KV cache budget of each
stage's GPU that `plan --gpu-memory` makes from them."""

from __future__ import annotations

import json
import math

import pytest
from hybrid_kv.catalogue import (
    CatalogueError,
    estimate_stage_weight_bytes,
    estimate_weight_bytes,
    load_config,
    load_model,
)
from hybrid_kv.cli import main
from hybrid_kv.planner.stages import pp_partition

GIB = 2**30

# Countable presets, by where vLLM 0.33's model builds the embeddings and the LM head:
# (name, on every stage, tied).
PRESETS = [
    ("llama-3.1-8b", False, False),
    ("mistral-7b-v0.1", False, False),
    ("deepseek-v3", False, False),
    ("llama-4-scout", False, False),
    ("gemma-3-27b", True, True),
    ("gemma-2-9b", True, True),
    ("command-r7b", True, True),
    ("gpt-oss-20b", True, False),
    ("jamba-mini-1.5", True, False),
    ("qwen3-next-80b-a3b", True, False),
    ("bamba-9b", True, False),
]


def _embedding_bytes(name: str, tensor_parallel_size: int = 1) -> int:
    config = load_config(name)
    text = config.get("text_config", config)
    return -(-text["vocab_size"] * text["hidden_size"] * 2 // tensor_parallel_size)


@pytest.mark.parametrize(("name", "every_stage", "tied"), PRESETS)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("tp", [1, 2])
def test_stage_weights_add_up_to_the_whole_estimate_and_what_vllm_builds_again(
    name: str, every_stage: bool, tied: bool, stages: int, tp: int
) -> None:
    model = load_model(name)
    counts = pp_partition(model.num_hidden_layers, stages)  # type: ignore[arg-type]
    weights = estimate_stage_weight_bytes(model.config, counts, tp)
    assert len(weights) == stages
    whole = estimate_weight_bytes(model.config, tp)
    embedding = _embedding_bytes(name, tp)
    if every_stage:
        # The embeddings on every stage but the first, the LM head (unless tied) on every
        # stage but the last.
        again = (stages - 1) * embedding * (1 if tied else 2)
    else:
        # Tied embeddings are built again on the last stage for its LM head.
        again = embedding if tied and stages > 1 else 0
    assert sum(weights) == whole + again
    if stages == 1:
        assert weights == (whole,)


def test_a_first_and_last_stage_model_holds_the_embeddings_first_and_the_head_last() -> None:
    # Llama 3.1 8B (untied): 32 equal layers; over 2 stages each holds 16 layers, the first
    # the embeddings, the last the head, of the same size.
    config = load_config("llama-3.1-8b")
    embedding = _embedding_bytes("llama-3.1-8b")
    first, last = estimate_stage_weight_bytes(config, (16, 16))
    assert first == last
    one_layer, rest = estimate_stage_weight_bytes(config, (1, 31))
    assert (one_layer - embedding) * 31 == rest - embedding
    # Tied, the last stage builds the embeddings again (its LM head shares them).
    tied = {**config, "tie_word_embeddings": True}
    assert estimate_stage_weight_bytes(tied, (16, 16)) == (first, last)
    assert sum(estimate_stage_weight_bytes(tied, (16, 16))) == (
        estimate_weight_bytes(tied) + embedding
    )


def test_an_every_stage_model_holds_the_embeddings_on_each_stage() -> None:
    # gpt-oss-20b: 24 equal layers, untied: each of 4 stages holds 6 layers, the embeddings
    # and the LM head (vLLM builds both on every stage).
    config = load_config("gpt-oss-20b")
    weights = estimate_stage_weight_bytes(config, (6, 6, 6, 6))
    assert max(weights) - min(weights) <= 1
    whole = estimate_weight_bytes(config)
    embedding = _embedding_bytes("gpt-oss-20b")
    assert math.isclose(weights[0], (whole - 2 * embedding) / 4 + 2 * embedding, abs_tol=4)


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ((16, 15), "sum to the model's 32 decoder layers"),
        ((), "sum to the model's 32"),
        ((16, -1, 17), "ints >= 0"),
        ((16.0, 16), "ints >= 0"),
        ("16,16", "a sequence of ints"),
    ],
)
def test_stage_weights_refuse_counts_that_are_not_the_models_layers(
    counts: object, message: str
) -> None:
    with pytest.raises(CatalogueError, match=message):
        estimate_stage_weight_bytes(load_config("llama-3.1-8b"), counts)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- command line


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_deepseek_v3_over_16_gpus_plans_with_each_stages_weights(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 8 tensor ranks x 2 stages of 80 GiB: the whole model's weights per rank (78 GiB) do not
    # fit in 72 GiB, but each stage's GPU holds about half of them.
    argv = ["deepseek-v3", "--gpu-memory", "80GiB", "-tp", "8", "-pp", "2"]
    document = _plan(capsys, *argv)
    config = load_config("deepseek-v3")
    weights = estimate_stage_weight_bytes(config, (31, 30), 8)
    usable = math.ceil(80 * GIB * 9 / 10)
    stages = document["plan"]["stages"]
    assert [s["weights_bytes"] for s in stages] == list(weights)
    assert [s["memory_bytes"] for s in stages] == [usable - w for w in weights]
    assert [s["budget_blocks"] for s in stages] == [
        (usable - w) // s["block_bytes"] for w, s in zip(weights, stages, strict=True)
    ]
    assert document["plan"]["num_blocks"] == min(s["budget_blocks"] for s in stages)
    assert "each stage's weights" in document["budget"]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "stages holds a part" not in out
    row = out.split("pipeline stages (min-waste;")[1].splitlines()[3]
    assert row.split()[:2] == ["1", "31-60"]
    assert "40.40 GiB" in row  # stage 1's weights
    assert f"{(usable - weights[1]) / GIB:.2f} GiB" in row  # and its budget


def test_a_stage_whose_weights_do_not_fit_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 stages of 80 GiB: each holds a quarter of DeepSeek-V3's 627 GiB, still more than
    # 72 GiB; the refusal names the first stage and its own weights.
    assert main(["plan", "deepseek-v3", "--gpu-memory", "80GiB", "-pp", "4"]) == 2
    err = capsys.readouterr().err
    first = estimate_stage_weight_bytes(load_config("deepseek-v3"), (15, 15, 16, 15))[0]
    assert "pipeline stage 0's GPU: the weights" in err
    assert f"({first / GIB:.2f} GiB per GPU)" in err


def test_each_stage_budget_drives_its_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    # Gemma 3 27B (tied, on every stage) over 2 stages of 48 GiB: each GPU's budget is 0.9 x
    # 48 GiB less its own weights, half the layers plus the embeddings.
    document = _plan(capsys, "gemma-3-27b", "--gpu-memory", "48GiB", "-pp", "2")
    weights = estimate_stage_weight_bytes(load_config("gemma-3-27b"), (31, 31))
    usable = math.ceil(48 * GIB * 9 / 10)
    stages = document["plan"]["stages"]
    assert [s["memory_bytes"] for s in stages] == [usable - w for w in weights]
    assert document["plan"]["num_blocks"] == min(
        (usable - w) // s["block_bytes"] for w, s in zip(weights, stages, strict=True)
    )
    assert document["vllm"]["stages"][0]["weights_bytes"] == weights[0]


def test_given_weights_are_per_gpu_on_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["llama-3.1-8b", "--gpu-memory", "24GiB", "--weights-memory", "5GiB", "-pp", "2"]
    document = _plan(capsys, *argv)
    usable = math.ceil(24 * GIB * 9 / 10)
    stages = document["plan"]["stages"]
    assert [s["weights_bytes"] for s in stages] == [5 * GIB, 5 * GIB]
    assert [s["memory_bytes"] for s in stages] == [usable - 5 * GIB] * 2
    assert "of weights per GPU (given;" in document["budget"]
