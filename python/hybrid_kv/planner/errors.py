"""Planner exceptions."""

from __future__ import annotations

__all__ = ["InsufficientMemoryError", "PlanError"]


class PlanError(ValueError):
    """Bad planner input (strategy, sizes, memory string, layout)."""


class InsufficientMemoryError(PlanError):
    """The memory budget cannot admit one request of `max_model_len` tokens.

    `reserved_bytes` is vLLM's reservation for one request (what its refusal calls "KV cache
    needed"), `needed_bytes` the budget that would admit it (the reservation plus the null
    block), `fitting_max_model_len` the longest `max_model_len` the given budget admits (0
    when not even one token fits), found as vLLM finds it.
    """

    def __init__(
        self,
        message: str,
        *,
        reserved_bytes: int = 0,
        needed_bytes: int = 0,
        fitting_max_model_len: int = 0,
    ) -> None:
        super().__init__(message)
        self.reserved_bytes = reserved_bytes
        self.needed_bytes = needed_bytes
        self.fitting_max_model_len = fitting_max_model_len
