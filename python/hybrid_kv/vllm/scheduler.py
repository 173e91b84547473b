"""vLLM's own `Scheduler` and `AsyncScheduler`, with hybrid-kv's KV cache manager.

The subclasses own nothing vLLM already does: vLLM's `Scheduler.__init__` builds its
`KVCacheManager` with keyword arguments; while it runs, the name it calls is bound, for the thread
building it, to `build_kv_cache_manager`, which receives exactly those arguments and returns
hybrid-kv's manager, or vLLM's own (with one log line naming the reason) for a configuration in
`hybrid_kv.vllm._support.FALLBACKS`. Other threads building a stock scheduler meanwhile get
vLLM's own manager.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.outputs import RequestError
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched import scheduler as _vllm_scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from hybrid_kv.vllm._manager import HybridKVCacheManager, Unsupported
from hybrid_kv.vllm._support import BuildContext, fallback_reason

# Under vLLM's logger tree: its handler, level and `--log-config-file` apply to these lines.
logger = init_logger(f"vllm.{__name__}")

if _vllm_scheduler_module.KVCacheManager is not VllmKVCacheManager:
    raise ImportError(
        "vllm.v1.core.sched.scheduler no longer builds vllm.v1.core.kv_cache_manager."
        "KVCacheManager: this vLLM version is not supported by hybrid_kv.vllm"
    )

# Scheduler construction rebinds a module global of vLLM's scheduler module for its duration.
_BUILD_LOCK = threading.RLock()

STREAMING_INPUT_REFUSAL = (
    "this server's scheduler (hybrid_kv.vllm) does not serve streaming-input (resumable) "
    "requests yet"
)

REFUSAL = "this server's scheduler (hybrid_kv.vllm) does not serve a request whose {problem}"


def _text_problem(request: Request) -> str | None:
    """What of the request's text that keys hybrid-kv's tables (its id, cache salt, LoRA
    adapter, multimodal identifiers) the core's keys (UTF-8 strings) cannot hold: a value that
    is not a `str`, or a string holding a lone surrogate, which an in-process engine can be
    handed (vLLM's msgpack transport carries neither). None if it can hold all of it."""
    lora = request.lora_request
    fields = [
        ("request id", request.request_id),
        ("cache_salt", request.cache_salt),
        # The adapter's name and path, which key its blocks (whatever their types).
        ("LoRA adapter", None if lora is None else f"{lora.lora_name}{lora.lora_path}"),
    ]
    fields += [("multimodal identifier", f.identifier) for f in request.mm_features]
    for field, text in fields:
        if text is None:
            continue
        if not isinstance(text, str):
            return f"{field} is of type {type(text).__name__}, not str"
        if not text.isascii():
            try:
                text.encode()
            except UnicodeEncodeError:
                return f"{field} is not valid Unicode (it holds a lone surrogate)"
    return None


def build_kv_cache_manager(
    vllm_config: VllmConfig, manager_kwargs: dict[str, Any]
) -> HybridKVCacheManager | VllmKVCacheManager:
    """hybrid-kv's manager for vLLM's arguments, or vLLM's own when hybrid-kv cannot serve them."""
    kv_cache_config: KVCacheConfig = manager_kwargs["kv_cache_config"]
    reason = fallback_reason(BuildContext(vllm_config, kv_cache_config, manager_kwargs))
    if reason is None:
        try:
            manager = HybridKVCacheManager(
                **manager_kwargs,
                # Blocks are keyed with the hash vLLM's config names (SHA-256 by default).
                hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
            )
        except Unsupported as error:
            reason = str(error)
        else:
            logger.info(
                "hybrid-kv: KV cache manager for %d group(s), %d blocks",
                len(kv_cache_config.kv_cache_groups),
                kv_cache_config.num_blocks,
            )
            return manager
    logger.warning("hybrid-kv: using vLLM's own KV cache manager: %s", reason)
    return VllmKVCacheManager(**manager_kwargs)


class _HybridKvMixin:
    """Builds the scheduler with hybrid-kv's manager (see the module docstring)."""

    kv_cache_manager: HybridKVCacheManager | VllmKVCacheManager

    def __init__(self, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> None:
        # Requests refused since the last output (see `add_request`).
        self._refused: list[tuple[Request, str]] = []

        builder = threading.get_ident()

        def factory(**manager_kwargs: Any) -> HybridKVCacheManager | VllmKVCacheManager:
            if threading.get_ident() != builder:
                # A stock vLLM scheduler another thread builds meanwhile reads the rebound name
                # too: it gets vLLM's own manager, for its own arguments.
                return VllmKVCacheManager(**manager_kwargs)
            return build_kv_cache_manager(vllm_config, manager_kwargs)

        with _BUILD_LOCK:
            _vllm_scheduler_module.KVCacheManager = factory  # type: ignore[misc,assignment]
            try:
                super().__init__(vllm_config, *args, **kwargs)  # type: ignore[call-arg]
            finally:
                _vllm_scheduler_module.KVCacheManager = VllmKVCacheManager  # type: ignore[misc]

    @property
    def uses_hybrid_kv(self) -> bool:
        """Whether hybrid-kv's manager serves this scheduler (False after a fallback)."""
        return isinstance(self.kv_cache_manager, HybridKVCacheManager)

    def add_request(self, request: Request) -> None:
        """vLLM's `add_request`, except, when hybrid-kv's manager serves, for requests it
        cannot take: streaming-input (resumable) requests, requests whose keyed text is not a
        valid Unicode string, and requests whose prompt or multimodal placeholders the core
        cannot hold (`HybridKVCacheManager.refusal`, which makes the request's companion now).
        An exception here (or in the manager, later) would stop vLLM's engine loop for every
        client, so the request is not queued, and the next `update_from_output` finishes it
        with a validation error (the client's HTTP 400), as vLLM finishes a request that fails
        validation; the engine keeps serving the others."""
        if self.uses_hybrid_kv:
            reason = None
            if request.resumable:
                reason = STREAMING_INPUT_REFUSAL
            else:
                problem = _text_problem(request) or self.kv_cache_manager.refusal(request)  # type: ignore[union-attr]
                if problem is not None:
                    reason = REFUSAL.format(problem=problem)
            if reason is not None:
                logger.warning("hybrid-kv: refusing request %r: %s", request.request_id, reason)
                self._refused.append((request, reason))
                return
        super().add_request(request)  # type: ignore[misc]

    def has_requests(self) -> bool:
        # A refusal not yet reported keeps the engine stepping until it is.
        return bool(self._refused) or super().has_requests()  # type: ignore[misc]

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs: dict[int, EngineCoreOutputs] = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        if self._refused:
            refused, self._refused = self._refused, []
            for request, reason in refused:
                eco = outputs.get(request.client_index)
                if eco is None:
                    eco = outputs[request.client_index] = EngineCoreOutputs()
                eco.outputs.append(
                    EngineCoreOutput(
                        request.request_id,
                        [],
                        finish_reason=FinishReason.ERROR,
                        error=RequestError(code="validation_error", message=reason),
                    )
                )
                if self.finished_req_ids_dict is not None:  # type: ignore[attr-defined]
                    # Multi-engine clients track request lifetimes by these ids.
                    eco.finished_requests = (eco.finished_requests or set()) | {request.request_id}
        return outputs


class Scheduler(_HybridKvMixin, VllmScheduler):
    """vLLM's `Scheduler` with hybrid-kv's KV cache manager.

    `--scheduler-cls hybrid_kv.vllm.Scheduler` selects it; with async scheduling on, vLLM gets
    `hybrid_kv.vllm.AsyncScheduler` from the same name.
    """

    def __new__(cls, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> Scheduler:
        if cls is Scheduler and vllm_config.scheduler_config.async_scheduling:
            cls = AsyncScheduler
        return super().__new__(cls)


class AsyncScheduler(Scheduler, VllmAsyncScheduler):
    """vLLM's `AsyncScheduler` with hybrid-kv's KV cache manager."""
