"""Batching limits and the engine loop's overlap (vLLM's ``SchedulerConfig``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """How many sequences and tokens a step takes, and how steps overlap."""

    max_num_seqs: int = 256
    """Most sequences in one step."""

    max_num_batched_tokens: int | None = None
    """Token budget of one step. None: 2048 with chunked prefill, else max(max_model_len, 2048)."""

    enable_chunked_prefill: bool = True
    """Split long prompts over several steps (within the token budget)."""

    async_output_proc: bool = True
    """Process step N's outputs while step N+1 runs: N+1 is scheduled and launched before
    N's sampled ids are taken in (docs/architecture.md)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1 (or unset), got {self.max_num_batched_tokens}.")

    def resolve_token_budget(self, max_model_len: int) -> None:
        """Fill ``max_num_batched_tokens`` for a context of ``max_model_len`` tokens.

        Raises:
            ValueError: without chunked prefill the budget is below ``max_model_len`` (a
                long prompt could never be scheduled).
        """
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill off: long prompts could never run."
            )
