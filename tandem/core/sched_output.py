"""What the scheduler hands the model runner for one step: plain data, no live objects.

After vLLM's ``v1/core/sched/output.py``: a sequence scheduled for the first time (or again
after a preemption) carries a :class:`NewRequestData` copy of what the runner needs to
build its persistent row; every scheduled sequence carries only its step's delta (tokens,
new KV blocks). Nothing here refers to the scheduler's mutable ``Request``, so an output
can be sent to other ranks (tensor parallelism) and later scheduler updates never reach a
step already handed over. They are msgspec structs, encoded as arrays: a TP driver sends
one per step (:class:`tandem.engine.rank_core.TPStepChannel`); a decode step of 1024
sequences is ~12 KB, where the pickled dataclasses were ~44 KB and several times slower to
encode and decode.
"""

from __future__ import annotations

import msgspec

from tandem.request import Request
from tandem.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A sequence the model runner has no row for yet.

    ``prompt_token_ids`` / ``output_token_ids``: copies of the sequence's tokens when
    scheduled (output tokens are those generated before a preemption, recomputed now; they
    seed its penalty counts); ``num_output_tokens`` counts them (the index of its next
    sampled token, for seeded sampling and ``min_tokens``); ``compute_prompt_logprobs``:
    this sequence computes its request's prompt logprobs (only the first of ``n`` does).
    ``sampling_params`` is the request's (never changed after it is added).
    """

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    compute_prompt_logprobs: bool

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @classmethod
    def from_request(cls, req: Request) -> NewRequestData:
        p = req.sampling_params
        return cls(req.seq_id, list(req.prompt_token_ids), list(req.output_token_ids), p,
                   p.prompt_logprobs is not None and req.index == 0)


class ScheduledSequence(msgspec.Struct, array_like=True, gc=False):
    """One sequence's share of a step (vLLM's cached-request data, per sequence).

    ``token_ids`` are the host-known input tokens; when ``uses_prev_sample`` the last
    input token is the sequence's sample from the previous step, still on the device.
    ``sample`` is True when the step's last token is the end of the known sequence, so a
    new token is sampled. ``new_block_ids`` are the KV blocks appended to the sequence's
    block table since it was last scheduled (its whole table when ``new_request`` is set).
    ``spec_token_ids``: draft tokens (speculative decoding) that follow ``token_ids`` in the
    step's input and are counted in ``num_new_tokens``; the model verifies them, and the
    sequence then emits its accepted drafts plus one token. ``num_device_drafts``: instead,
    that many of the drafts the model runner proposed after the previous step (which is
    still in flight: ``uses_prev_sample``) follow its sample, their ids never on the host;
    ``num_computed_tokens`` then assumes every draft of that step was accepted, and the
    runner takes back its rejected ones (asynchronous speculative decoding).
    """

    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: list[int]
    uses_prev_sample: bool
    sample: bool
    new_block_ids: list[int]
    # Set the first time the sequence is scheduled (or again after a preemption).
    new_request: NewRequestData | None = None
    spec_token_ids: list[int] = msgspec.field(default_factory=list)
    num_device_drafts: int = 0

    @property
    def num_drafts(self) -> int:
        """Draft tokens the step verifies for the sequence (host-known or on the device)."""
        return len(self.spec_token_ids) + self.num_device_drafts


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    """A scheduler decision: what the model runner executes in one step."""

    step_id: int
    scheduled: list[ScheduledSequence]
    num_scheduled_tokens: int
    preempted_seq_ids: list[int] = msgspec.field(default_factory=list)
    finished_seq_ids: list[int] = msgspec.field(default_factory=list)
    # Sampling sequences whose token must match a grammar: the runner samples them only
    # once given their bitmask (vLLM's structured_output_request_ids).
    structured_output_seq_ids: list[int] = msgspec.field(default_factory=list)
    # Speculative decoding: drafts are wanted after this step (the runner's draft model
    # proposes them); the scheduler's decision, by batch size.
    propose_drafts: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
