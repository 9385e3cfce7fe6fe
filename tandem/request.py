"""Engine-side state of one sequence (one of a request's ``n`` completions)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.structured_output.manager import StructuredOutputRequest

_seq_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)
class Request:
    """A sequence the scheduler batches.

    ``seq_id`` is a process-unique integer used below the engine (scheduler, KV cache,
    model runner), so that a user's request id can be reused while a step holding the
    old sequence is still in flight.

    Token accounting (one-step-ahead scheduling, see docs/architecture.md):
      * ``num_tokens`` = prompt + output tokens known on the host;
      * ``num_output_placeholders`` = tokens sampled by launched steps whose ids are not
        on the host yet (a step verifying ``k`` drafts counts ``1 + k``, as if it accepted
        every one: the most it can emit);
      * ``num_computed_tokens`` = tokens whose K/V are written by launched steps (advanced
        when a step is scheduled, drafts included; the rejected drafts are taken back when
        the step's output is processed);
      * ``spec_token_ids`` = the draft tokens of the step in flight (speculative decoding);
      * ``draft_token_ids`` = the draft model's proposals for its next step;
      * ``num_device_drafts`` = drafts the model runner proposes after the sequence's
        step in flight, kept on the device for its next step;
      * ``virtual_engine`` = which of the scheduler's concurrent batches the sequence runs
        in (pipeline parallelism, vLLM V0's virtual engines; set when it is admitted).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    index: int = 0  # which of the parent's n completions
    max_tokens: int = 16  # resolved against the context length
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 before
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    num_device_drafts: int = 0
    virtual_engine: int = 0
    # The grammar of a request with ``sampling_params.structured_outputs``.
    structured_output: "StructuredOutputRequest | None" = None

    def __getstate__(self) -> dict:
        # Sent to tensor-parallel followers inside SchedulerOutputs: the grammar (a compile
        # future and a matcher) stays with the driver, which builds the bitmasks.
        return {**self.__dict__, "structured_output": None}

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without concatenating the two."""
        p = len(self.prompt_token_ids)
        if start >= end:
            return []
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
