"""Tokens in flight: the tokens scheduled but not yet processed, which vLLM 0.33 reserves
sliding-window and chunked-local blocks for.

vLLM keeps `VllmConfig.max_concurrent_batches` batches in flight and counts
`max_in_flight_tokens = max_concurrent_batches * max_num_batched_tokens`. The batches are the
pipeline's stages (`--pipeline-parallel-size`); async scheduling overlaps one more with Model
Runner V2 (`VLLM_USE_V2_MODEL_RUNNER`, vLLM 0.33's default where Triton runs), and makes 2 of
1 stage with either runner.

Async scheduling is on unless turned off (`SchedulerConfig.async_scheduling=None`, resolved by
`VllmConfig.__post_init__`): vLLM turns it on by default unless something it knows is
incompatible, of which the V1 model runner with pipeline parallelism is the one the planner
sees ("Async scheduling is disabled because the V1 model runner does not support it with
pipeline parallelism"). Asked for explicitly there, vLLM refuses ("Async scheduling is not
supported by the V1 model runner with pipeline parallelism"), and so does `InFlight`. The
other cases vLLM turns it off for (pooling models, an executor without support, ROCm DeepEP
high-throughput DBO, some speculative methods on the V1 runner) are not planner options:
give `async_scheduling=False` for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_kv.planner.errors import PlanError

__all__ = ["DEFAULT_MODEL_RUNNER", "MODEL_RUNNERS", "V1_PP_ASYNC_NOTE", "InFlight"]

MODEL_RUNNERS = ("v1", "v2")
"""vLLM 0.33's model runners: `VLLM_USE_V2_MODEL_RUNNER=0` and `=1`."""

DEFAULT_MODEL_RUNNER = "v2"
"""vLLM 0.33's default where Triton runs (any CUDA GPU)."""

V1_PP_ASYNC_NOTE = (
    "async scheduling is off: vLLM turns it off by default because the V1 model runner does "
    "not support it with pipeline parallelism"
)
"""vLLM's warning when its default resolution turns async scheduling off for the V1 runner."""


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise PlanError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class InFlight:
    """The scheduler options that set the tokens in flight, and the count vLLM 0.33 makes of
    them (`max_concurrent_batches`, `tokens`).

    `async_scheduling` is vLLM's option as given: None (the default) is vLLM's own resolution
    (on, but off for the V1 model runner with pipeline parallelism), True and False are
    `--async-scheduling` and `--no-async-scheduling`. `resolved_async_scheduling` says which
    it is."""

    max_num_batched_tokens: int
    async_scheduling: bool | None = None
    pipeline_parallel_size: int = 1
    model_runner: str = DEFAULT_MODEL_RUNNER

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise PlanError(
                f"async_scheduling must be a bool or None, got {self.async_scheduling!r}"
            )
        if self.model_runner not in MODEL_RUNNERS:
            raise PlanError(
                f"model_runner must be one of {', '.join(MODEL_RUNNERS)}, got {self.model_runner!r}"
            )
        if self.async_scheduling and self._v1_with_pipeline_parallelism:
            raise PlanError(
                "async scheduling is not supported by vLLM's V1 model runner with pipeline "
                "parallelism (use model runner v2, or no async scheduling)"
            )

    @property
    def _v1_with_pipeline_parallelism(self) -> bool:
        return self.model_runner == "v1" and self.pipeline_parallel_size > 1

    @property
    def vllm_default(self) -> bool:
        """Whether async scheduling is vLLM's default resolution (`async_scheduling=None`)."""
        return self.async_scheduling is None

    @property
    def resolved_async_scheduling(self) -> bool:
        """Async scheduling as vLLM resolves it: as given, or on by default unless the V1
        model runner runs pipeline parallelism."""
        if self.async_scheduling is None:
            return not self._v1_with_pipeline_parallelism
        return self.async_scheduling

    @property
    def note(self) -> str | None:
        """vLLM's warning when its default resolution turned async scheduling off, or None."""
        if self.async_scheduling is None and self._v1_with_pipeline_parallelism:
            return V1_PP_ASYNC_NOTE
        return None

    @property
    def max_concurrent_batches(self) -> int:
        """vLLM's `VllmConfig.max_concurrent_batches`: one batch per pipeline stage, one more
        with async scheduling on Model Runner V2, 2 with async scheduling and one stage."""
        if self.resolved_async_scheduling:
            if self.model_runner == "v2":
                return self.pipeline_parallel_size + 1
            if self.pipeline_parallel_size == 1:
                return 2
        return self.pipeline_parallel_size

    @property
    def tokens(self) -> int:
        """vLLM's `VllmConfig.max_in_flight_tokens`."""
        return self.max_concurrent_batches * self.max_num_batched_tokens

    def describe(self) -> str:
        """`4,096 tokens in flight (2 batches of 2,048: async scheduling (vLLM's default),
        pipeline parallel size 1, model runner v2)`."""
        batches = self.max_concurrent_batches
        noun = "batch" if batches == 1 else "batches"
        scheduling = "async" if self.resolved_async_scheduling else "sync"
        source = "vLLM's default" if self.vllm_default else "given"
        return (
            f"{self.tokens:,} tokens in flight ({batches} {noun} of "
            f"{self.max_num_batched_tokens:,}: {scheduling} scheduling ({source}), pipeline "
            f"parallel size {self.pipeline_parallel_size}, model runner {self.model_runner})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "async_scheduling": self.resolved_async_scheduling,
            "async_scheduling_vllm_default": self.vllm_default,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "model_runner": self.model_runner,
            "max_concurrent_batches": self.max_concurrent_batches,
            "max_in_flight_tokens": self.tokens,
            "note": self.note,
        }
