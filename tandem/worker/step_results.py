"""A step's results while they are still device tensors: what the model runner copies to
the host in one go (pinned buffers and one event on CUDA) and turns into a
:class:`~tandem.outputs.ModelRunnerOutput`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.outputs import ModelRunnerOutput, PromptLogprobs

# Per row of a step: ([1+K] token ids, [1+K] logprobs, rank of the first), on the host.
RowLogprobs = tuple[list[int], list[float], int]


@dataclass
class PromptLogprobTensors:
    """One sequence's prompt logprobs computed in a step.

    Attributes:
        start: index in the prompt of the first token they score (>= 1).
        token_ids: ``[n, 1 + K]`` int64: the actual next prompt token, then the top K.
        logprobs: ``[n, 1 + K]`` float32, natural log.
        ranks: ``[n]`` int64: rank of the actual token (1: the most likely).
    """

    start: int
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PromptLogprobTensors:
        return PromptLogprobTensors(self.start, fn(self.token_ids), fn(self.logprobs), fn(self.ranks))

    def to_host(self) -> PromptLogprobs:
        return PromptLogprobs(self.start, self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())


@dataclass
class SampledLogprobTensors:
    """Logprobs of a step's sampled tokens: ``token_ids`` / ``logprobs`` ``[rows, 1 + K]``
    (int64 / float32; the sampled token first, then the top K), ``ranks`` ``[rows]`` int64."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SampledLogprobTensors:
        return SampledLogprobTensors(fn(self.token_ids), fn(self.logprobs), fn(self.ranks))

    def to_host(self) -> list[RowLogprobs]:
        return list(zip(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()))


@dataclass
class StepResultTensors:
    """A step's device-side results.

    Attributes:
        sampled: ``[rows]`` int64, one sampled token per sampling row (rows that verified
            drafts last, their first emitted token); None until the step is sampled.
        logprobs: of the sampled tokens, when a row asked for them.
        draft_token_ids: ``[rows, K]`` int64 drafts for the next step (a draft model).
        prompt_logprobs: seq_id -> the prompt logprobs it computed in the step.
    """

    sampled: torch.Tensor | None = None
    logprobs: SampledLogprobTensors | None = None
    draft_token_ids: torch.Tensor | None = None
    prompt_logprobs: dict[int, PromptLogprobTensors] = field(default_factory=dict)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> StepResultTensors:
        """The same results with ``fn`` applied to every tensor (the host copy)."""
        return StepResultTensors(
            None if self.sampled is None else fn(self.sampled),
            None if self.logprobs is None else self.logprobs.map(fn),
            None if self.draft_token_ids is None else fn(self.draft_token_ids),
            {sid: p.map(fn) for sid, p in self.prompt_logprobs.items()})

    def to_output(self, seq_ids: list[int], accepted: dict[int, list[int]],
                  accepted_logprobs: dict[int, list[RowLogprobs]], num_drafts: dict[int, int]) -> ModelRunnerOutput:
        """The host-side output (these tensors on the host; ``accepted`` /
        ``accepted_logprobs`` / ``num_drafts`` already are: ``ModelRunnerOutput``'s
        ``accepted_token_ids`` / ``accepted_logprobs`` / ``num_draft_tokens``)."""
        out = ModelRunnerOutput(seq_ids, self.sampled.tolist(), accepted_token_ids=accepted,
                                accepted_logprobs=accepted_logprobs, num_draft_tokens=num_drafts)
        if self.draft_token_ids is not None:
            out.draft_token_ids = self.draft_token_ids.tolist()
        if self.logprobs is not None:
            out.logprobs = self.logprobs.to_host()
        out.prompt_logprobs = {sid: p.to_host() for sid, p in self.prompt_logprobs.items()}
        return out


__all__ = ["PromptLogprobTensors", "RowLogprobs", "SampledLogprobTensors", "StepResultTensors"]
