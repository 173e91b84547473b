"""vLLM's own `Scheduler` and `AsyncScheduler`, with hybrid-kv's KV cache manager.

The subclasses own nothing vLLM already does: vLLM's `Scheduler.__init__` builds its
`KVCacheManager` with keyword arguments; while it runs, the name it calls is bound to
`build_kv_cache_manager`, which receives exactly those arguments and returns hybrid-kv's manager,
or vLLM's own (with one log line naming the reason) for a configuration in
`hybrid_kv.vllm._support.FALLBACKS`.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.sched import scheduler as _vllm_scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

from hybrid_kv.vllm._manager import HybridKVCacheManager, Unsupported
from hybrid_kv.vllm._support import BuildContext, fallback_reason

logger = init_logger(__name__)

if _vllm_scheduler_module.KVCacheManager is not VllmKVCacheManager:
    raise ImportError(
        "vllm.v1.core.sched.scheduler no longer builds vllm.v1.core.kv_cache_manager."
        "KVCacheManager: this vLLM version is not supported by hybrid_kv.vllm"
    )

# Scheduler construction rebinds a module global of vLLM's scheduler module for its duration.
_BUILD_LOCK = threading.RLock()


def build_kv_cache_manager(
    vllm_config: VllmConfig, manager_kwargs: dict[str, Any]
) -> HybridKVCacheManager | VllmKVCacheManager:
    """hybrid-kv's manager for vLLM's arguments, or vLLM's own when hybrid-kv cannot serve them."""
    kv_cache_config: KVCacheConfig = manager_kwargs["kv_cache_config"]
    reason = fallback_reason(BuildContext(vllm_config, kv_cache_config, manager_kwargs))
    if reason is None:
        try:
            manager = HybridKVCacheManager(**manager_kwargs)
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
        def factory(**manager_kwargs: Any) -> HybridKVCacheManager | VllmKVCacheManager:
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
        if request.resumable and self.uses_hybrid_kv:
            raise ValueError(
                "hybrid_kv.vllm does not serve streaming-input (resumable) requests yet; "
                "run without --scheduler-cls hybrid_kv.vllm.Scheduler for them"
            )
        super().add_request(request)  # type: ignore[misc]


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
