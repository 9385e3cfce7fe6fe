"""Batching limits and the engine loop's overlap (vLLM's ``SchedulerConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tandem.config.utils import check_choices

UsageContext = Literal["llm_class", "openai_api_server"]


@dataclass
class SchedulerConfig:
    """How many sequences and tokens a step takes, and how steps overlap."""

    max_num_seqs: int | None = None
    """Most sequences in one step. None: sized for the device (1024 on GPUs of >= 70 GiB
    such as the H100/H200, 256 on smaller GPUs and the CPU; tandem.platform)."""

    max_num_batched_tokens: int | None = None
    """Token budget of one step. None: sized for the device and use (GPUs of >= 70 GiB: 16384;
    smaller GPUs: 8192 offline, 2048 served; CPU: 2048; tandem.platform); without chunked
    prefill at least max_model_len."""

    enable_chunked_prefill: bool = True
    """Split long prompts over several steps (within the token budget)."""

    usage_context: UsageContext = field(default="llm_class", metadata={"flag": False})
    """Who drives the engine: the offline ``LLM`` class or ``tandem serve`` (set by the
    entry point, not a flag; picks the default token budget, as vLLM's usage context does)."""

    async_output_proc: bool = True
    """Process step N's outputs while step N+1 runs: N+1 is scheduled and launched before
    N's sampled ids are taken in (docs/architecture.md)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1 (or unset), got {self.max_num_batched_tokens}.")

    def resolve_limits(self, max_model_len: int, default_seqs: int, default_tokens: int) -> None:
        """Fill unset limits: ``max_num_seqs`` with ``default_seqs``, ``max_num_batched_tokens``
        with ``default_tokens`` (with chunked prefill off, at least ``max_model_len``).

        Raises:
            ValueError: without chunked prefill the budget is below ``max_model_len`` (a
                long prompt could never be scheduled).
        """
        if self.max_num_seqs is None:
            self.max_num_seqs = default_seqs
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_tokens if self.enable_chunked_prefill else max(max_model_len,
                                                                                                   default_tokens)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill off: long prompts could never run."
            )
