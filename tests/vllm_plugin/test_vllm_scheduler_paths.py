"""Scheduler paths the other differential tests do not take, against stock vLLM step for step
(scheduler outputs, engine-core outputs, KV events): requests that stop on a stop token inside a
block (with draft tokens after it), requests aborted between `schedule()` and
`update_from_output()` of the step that scheduled them, structured-output requests waiting for
their grammar (one that compiles late, one that fails, one that rejects half of every draft), and
structured-output requests whose grammar rejects a sampled token."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see .ci/run)")

import hybrid_kv.vllm as hkv  # noqa: E402
from hybrid_kv.vllm import testing as harness  # noqa: E402
from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

WORKLOAD = harness.chat_workload(24, seed=13, salts=(None, "tenant-a"))
STOP_TOKEN = 7


class HalfDraftGrammar:
    """A compiled grammar that accepts every sampled token and the first half of every draft."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) // 2]

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


@dataclasses.dataclass
class PathsDriver(harness.Driver):
    """The harness's engine loop, plus: requests in `stop_at` sample the stop token at that
    output index; requests in `grammar_at` ask for structured output, their grammar compiling
    at that step (failing if the step is negative); every `abort_every`th step aborts the first
    request it scheduled before the model's output comes back."""

    stop_at: dict[str, int] = dataclasses.field(default_factory=dict)
    grammar_at: dict[str, int] = dataclasses.field(default_factory=dict)
    abort_every: int = 0
    log: list[Any] = dataclasses.field(default_factory=list)
    _grammars_at: dict[str, tuple[int, Future]] = dataclasses.field(default_factory=dict)

    def make_request(self, spec: harness.RequestSpec) -> Request:
        rid = spec.request_id
        if rid not in self.stop_at and rid not in self.grammar_at:
            return super().make_request(spec)
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            stop_token_ids=[STOP_TOKEN] if rid in self.stop_at else None,
            structured_outputs=StructuredOutputsParams(json={"type": "object"})
            if rid in self.grammar_at
            else None,
        )
        request = Request(
            request_id=rid,
            prompt_token_ids=list(spec.prompt),
            sampling_params=params,
            pooling_params=None,
            cache_salt=spec.cache_salt,
            # Hashed as vLLM's engine core hashes requests for this configuration.
            block_hasher=harness._block_hasher(
                self.scheduler.hash_block_size,
                self.scheduler.vllm_config.num_hash_lookahead_tokens,
            ),
            arrival_time=0.0,
        )
        if rid in self.grammar_at:
            future: Future = Future()
            request.structured_output_request.grammar = future
            self._grammars_at[rid] = (self.grammar_at[rid], future)
        return request

    def schedule(self) -> Any:
        for at, future in self._grammars_at.values():
            if not future.done() and self.step >= abs(at):
                if at < 0:
                    future.set_exception(ValueError("the grammar does not compile"))
                else:
                    future.set_result(HalfDraftGrammar())
        output = super().schedule()
        if self.abort_every and self.step % self.abort_every == 0:
            victims = sorted(output.num_scheduled_tokens)[:1]
            if victims:
                self.scheduler.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
                self.log.append((self.step, victims))
        return output

    def fake_model_output(self, output: Any, chunks: set[str]) -> Any:
        runner = super().fake_model_output(output, chunks)
        for rid, sampled in zip(runner.req_ids, runner.sampled_token_ids, strict=True):
            request = self.scheduler.requests.get(rid)
            if rid in self.stop_at and request is not None:
                for k in range(len(sampled)):
                    if request.num_output_tokens + k == self.stop_at[rid]:
                        sampled[k] = STOP_TOKEN
        return runner


def run_both(
    options: harness.Options, workload: list[harness.RequestSpec] = WORKLOAD, **paths: Any
) -> tuple[list[Any], list[Any], int]:
    """Drives stock vLLM and hybrid-kv through `workload` with the same `PathsDriver` settings;
    asserts every step equal. Returns the finish reasons of the outputs, the aborts made and the
    steps whose drafts a grammar rejected some of."""
    schedulers = [harness.build_scheduler(options), harness.build_scheduler(options, hkv.Scheduler)]
    assert schedulers[1].uses_hybrid_kv
    recorders = [harness.EventRecorder(), harness.EventRecorder()]
    for scheduler, recorder in zip(schedulers, recorders, strict=True):
        scheduler.kv_event_publisher = recorder
    drivers = [PathsDriver(s, workload, **paths) for s in schedulers]
    steps, reasons, invalid = 0, [], 0
    for (stock_out, stock_results), (our_out, our_results) in zip(
        drivers[0].run(), drivers[1].run(), strict=True
    ):
        assert harness.summarize(our_out) == harness.summarize(stock_out), f"step {steps}"
        assert harness.summarize_results(our_results) == harness.summarize_results(stock_results), (
            f"step {steps}"
        )
        assert recorders[1].events == recorders[0].events, f"step {steps}"
        assert drivers[1].log == drivers[0].log
        reasons += [o.finish_reason for r in stock_results for e in r.values() for o in e.outputs]
        invalid += bool(stock_out.num_invalid_spec_tokens)
        steps += 1
    assert steps > 0
    return reasons, drivers[0].log, invalid


LAYOUTS = [("gpt-oss", 260), ("jamba", 300)]
DRAFTING = [
    {},
    {"ngram_tokens": 3},
    {"eagle_tokens": 3, "async_scheduling": True},
    # Two pipeline stages on Model Runner V2: three batches in flight.
    {
        "eagle_tokens": 3,
        "async_scheduling": True,
        "pipeline_parallel_size": 2,
        "v2_model_runner": True,
    },
]
IDS = ["plain", "ngram", "eagle-async", "eagle-async-pp2-v2"]


@pytest.mark.parametrize("drafting", DRAFTING, ids=IDS)
@pytest.mark.parametrize("layout,num_blocks", LAYOUTS)
def test_requests_stopping_inside_a_block_match_vllm(
    layout: str, num_blocks: int, drafting: dict[str, Any]
) -> None:
    # Stop tokens at output indices 0-39: inside blocks, and inside a step's accepted drafts.
    stop_at = {s.request_id: (i * 7) % 40 for i, s in enumerate(WORKLOAD) if i % 4}
    options = harness.Options(layout=layout, num_blocks=num_blocks, kv_events=True, **drafting)
    reasons, _, _ = run_both(options, stop_at=stop_at)
    assert reasons.count(FinishReason.STOP) >= len(stop_at) // 2


@pytest.mark.parametrize("drafting", DRAFTING, ids=IDS)
@pytest.mark.parametrize("layout,num_blocks", LAYOUTS)
def test_requests_aborted_in_the_step_that_scheduled_them_match_vllm(
    layout: str, num_blocks: int, drafting: dict[str, Any]
) -> None:
    options = harness.Options(layout=layout, num_blocks=num_blocks, kv_events=True, **drafting)
    _, aborts, _ = run_both(options, abort_every=3)
    assert len(aborts) >= 3


@pytest.mark.parametrize("drafting", DRAFTING, ids=IDS)
@pytest.mark.parametrize("layout,num_blocks", LAYOUTS)
def test_structured_output_requests_waiting_for_their_grammar_match_vllm(
    layout: str, num_blocks: int, drafting: dict[str, Any]
) -> None:
    # Every other request asks for structured output; its grammar compiles a few steps after it
    # arrives, or fails then (a validation error for that request alone).
    grammar_at = {
        s.request_id: (1 if i % 6 else -1) * (s.arrival_step + 1 + i % 4)
        for i, s in enumerate(WORKLOAD)
        if i % 2 == 0
    }
    options = harness.Options(layout=layout, num_blocks=num_blocks, kv_events=True, **drafting)
    reasons, _, _ = run_both(options, grammar_at=grammar_at)
    assert FinishReason.ERROR in reasons


@pytest.mark.parametrize("drafting", DRAFTING, ids=IDS)
@pytest.mark.parametrize("layout,num_blocks", LAYOUTS)
def test_structured_output_requests_whose_grammar_rejects_a_sampled_token_match_vllm(
    layout: str, num_blocks: int, drafting: dict[str, Any]
) -> None:
    # Every request asks for structured output. Every third one's grammar rejects the token
    # sampled at some output index (vLLM finishes the request with an error mid-decode); the
    # others' grammars keep a seeded prefix of every draft, which under async scheduling they
    # check once the step before is in (the engine core defers that step's sampling).
    rejecting = {s.request_id for i, s in enumerate(WORKLOAD) if i % 3 == 0}
    workload = [
        dataclasses.replace(
            spec,
            grammar=harness.GrammarSpec(
                ready_at=spec.arrival_step + i % 3,
                reject_at=(i * 5) % spec.max_tokens if spec.request_id in rejecting else None,
            ),
        )
        for i, spec in enumerate(WORKLOAD)
    ]
    options = harness.Options(layout=layout, num_blocks=num_blocks, kv_events=True, **drafting)
    reasons, _, invalid = run_both(options, workload)
    assert reasons.count(FinishReason.ERROR) >= len(rejecting) // 2
    assert (invalid > 0) == bool(drafting.get("async_scheduling"))


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_the_fake_model_accepts_no_draft_a_grammar_rejected(v2: bool) -> None:
    # Under async scheduling, every request's grammar keeps the first half of every draft. Once
    # the engine core checked a deferred step's drafts, the rejected ones are -1 and the model
    # accepts none of them (the grammar's bitmask rejects the first); Model Runner V2 accepts no
    # structured-output draft past the checked ones, so none of a step that sampled without
    # waiting (its drafts are -1 placeholders to the scheduler).
    options = harness.Options(
        layout="full", eagle_tokens=3, async_scheduling=True, v2_model_runner=v2
    )
    driver = PathsDriver(
        harness.build_scheduler(options),
        WORKLOAD,
        grammar_at={s.request_id: s.arrival_step for s in WORKLOAD},
    )
    model = driver.fake_model_output
    checked, accepted = 0, 0

    def fake_model_output(output: Any, chunks: set[str]) -> Any:
        nonlocal checked, accepted
        runner = model(output, chunks)
        for rid, sampled in zip(runner.req_ids, runner.sampled_token_ids, strict=True):
            drafts = output.scheduled_spec_decode_tokens.get(rid, [])
            if rid not in driver.scheduler.requests:
                continue  # finished meanwhile: vLLM reads none of its output
            if rid in (output.num_invalid_spec_tokens or {}) or (v2 and drafts):
                valid = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
                assert len(sampled) - 1 <= valid, (rid, drafts, sampled)
                checked += 1
            accepted += max(0, len(sampled) - 1)
        return runner

    driver.fake_model_output = fake_model_output  # type: ignore[method-assign]
    for _ in driver.run():
        pass
    assert checked > 0
    assert accepted > 0
