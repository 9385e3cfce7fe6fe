"""Dual-batch overlap of MoE models (vLLM keeps these fields in ``ParallelConfig``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DBOConfig:
    """When a step is split into two ubatches whose all-to-all and compute overlap
    (the decision: tandem/worker/step_plan.py, docs/architecture.md)."""

    enable_dbo: bool = False
    """Dual-batch overlap for MoE models: split large steps into two ubatches and overlap one's
    all-to-all with the other's compute."""

    dbo_decode_token_threshold: int = 32
    """Smallest decode-only step (in tokens) that is split."""

    dbo_prefill_token_threshold: int = 512
    """Smallest step with prefill tokens that is split."""

    dbo_measure_split: bool = True
    """On CUDA, split only where a split step was measured faster than a plain one at startup:
    with CUDA graphs each decode size from the threshold up is captured both ways and their
    replays timed; steps with prefill tokens split only if an eager step of
    min(max_num_batched_tokens, max_model_len) tokens did; eager decode-only steps follow the
    thresholds alone. Off: split every step from the thresholds up."""

    def __post_init__(self) -> None:
        if self.dbo_decode_token_threshold < 2 or self.dbo_prefill_token_threshold < 2:
            raise ValueError("dbo_decode_token_threshold and dbo_prefill_token_threshold must be >= 2 "
                             "(each ubatch needs a token).")
