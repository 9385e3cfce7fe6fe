"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute.

Follows vLLM V1's unified scheduler (no separate prefill/decode phases): each step gives
every running sequence the tokens it still needs (1 for a decode), then admits waiting
sequences FCFS while the token budget, ``max_num_seqs`` and free KV blocks allow. When a
running sequence cannot get a block, the most recently admitted running sequence is
preempted: its blocks are freed and it rejoins the front of the waiting queue to be
recomputed (prompt + generated tokens) later.

One-step-ahead scheduling (docs/architecture.md): ``num_computed_tokens`` advances when a step is
scheduled, and a step that samples adds a *placeholder* for the token that is not on the
host yet, so step N+1 can be scheduled before step N's outputs are processed.

Speculative decoding: a running sequence in decode gets draft tokens and is scheduled for
``1 + len(drafts)`` tokens, KV slots included; until its step's output arrives it counts
``1 + len(drafts)`` placeholders and as many computed tokens, as if every draft were
accepted (vLLM's async scheduler). When the output arrives, ``num_computed_tokens`` is taken
back to the accepted drafts: the K/V of rejected drafts stays in slots past it, which later
steps overwrite. The blocks allocated for drafts stay with the sequence until it is freed.
Only host-known (confirmed) tokens are ever hashed into the prefix cache
(``KVCacheManager._cache_full_blocks``), and drafts are never host-known, so no cached
block is registered under tokens it lacks.

Where drafts come from:

* the n-gram ``proposer`` on the host, from the sequence's tokens: its step in flight must
  have been taken in first (:meth:`Scheduler.needs_outputs_to_draft`);
* with a draft model or an EAGLE head, the model runner: every step that samples a
  sequence proposes its next ``num_lookahead_tokens`` drafts (after allocating as many
  lookahead slots for the draft K/V, vLLM's lookahead slots, unless that would need a block
  nobody has free). While that step is in flight the next one is scheduled with them as
  ``ScheduledSequence.num_device_drafts``: their ids stay on the device, and the runner
  corrects the step's positions by the drafts the previous step rejected (asynchronous
  speculative decoding, issue 46 stage 2). A sequence with no step in flight takes the
  drafts its last output carried (``ModelRunnerOutput.draft_token_ids``). A constrained
  sequence's drafts must be checked against its grammar on the host: while one runs,
  every step is taken in before the next is scheduled.

Several batches in flight (pipeline parallelism: one per stage, vLLM V1's
``max_concurrent_batches``): each sequence is admitted into one of
``max_concurrent_batches`` *virtual engines* (vLLM V0's name), the one being scheduled, while
it holds fewer than its even share of the sequences; :meth:`Scheduler.schedule` of a virtual
engine batches only its sequences. The engine core schedules a virtual engine only once its
previous batch has been taken in, so a sequence is never in two batches in flight and its
input tokens are on the host when it is scheduled.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from tandem.core.block_manager import KVCacheManager
from tandem.core.sched_output import NewRequestData, ScheduledSequence, SchedulerOutput
from tandem.engine.messages import EngineCoreOutput, PromptLogprobsData
from tandem.outputs import ModelRunnerOutput
from tandem.request import Request, RequestStatus

if TYPE_CHECKING:
    from tandem.spec_decode.ngram_proposer import NgramProposer
    from tandem.structured_output.manager import StructuredOutputManager


class Scheduler:
    """FCFS continuous batching over a ``KVCacheManager``.

    Args:
        kv_manager: block allocator.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step.
        max_model_len: context length; no sequence grows past it.
        enable_chunked_prefill: split prompts longer than the remaining budget.
        structured_output_manager: advances the grammars of constrained sequences (needed
            once one is added).
        proposer: proposes draft tokens for decoding sequences on the host (n-gram
            speculative decoding); None: none.
        num_lookahead_tokens: with a draft model or an EAGLE head (whose drafts the model
            runner proposes), its number of drafts per step ``K``; 0: none.
        disable_by_batch_size: speculate only while at most this many sequences run (None:
            always).
        max_concurrent_batches: virtual engines, each with its own batches (module
            docstring); 1: every sequence in every step.
    """

    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 structured_output_manager: "StructuredOutputManager | None" = None,
                 proposer: "NgramProposer | None" = None, num_lookahead_tokens: int = 0,
                 disable_by_batch_size: int | None = None, max_concurrent_batches: int = 1) -> None:
        self.kv = kv_manager
        self.max_concurrent_batches = max_concurrent_batches
        self.structured_output_manager = structured_output_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._finished_since_last_step: list[int] = []
        # Block ids of each running sequence already sent to the model runner.
        self._num_sent_blocks: dict[int, int] = {}
        self._step_id = 0
        self.num_preemptions = 0
        self.proposer = proposer
        self.num_lookahead_tokens = num_lookahead_tokens
        self.speculates = proposer is not None or num_lookahead_tokens > 0
        self.disable_by_batch_size = disable_by_batch_size
        # Speculative decoding (vLLM's SpecDecodingStats): sequence-steps that verified
        # drafts, draft and accepted tokens, and accepted tokens by draft position, sized to
        # K so that every position is reported from the start.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * (proposer.num_speculative_tokens if proposer is not None
                                                  else num_lookahead_tokens)

    def add_request(self, req: Request) -> None:
        self.requests[req.seq_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _schedule_seq(self, req: Request, num_new: int, num_tokens: int, so_seq_ids: list[int],
                      drafts: list[int] | None = None, num_device_drafts: int = 0,
                      propose_drafts: bool = False) -> ScheduledSequence:
        """``req``'s share of the step (``num_tokens``: its host-known tokens; ``drafts`` or
        ``num_device_drafts``: draft tokens after them, KV slots already allocated;
        ``propose_drafts``: the runner proposes drafts after the step); a sampling
        constrained sequence's id is appended to ``so_seq_ids``."""
        c = req.num_computed_tokens
        end = c + num_new
        known_end = end if end < num_tokens else num_tokens
        assert end - max(c, known_end) <= 1, "at most one not-yet-known input token (the previous step's sample)"
        sample = end == num_tokens + req.num_output_placeholders
        num_drafts = (len(drafts) if drafts else 0) + num_device_drafts
        req.num_computed_tokens = end + num_drafts
        if sample:
            req.num_output_placeholders += 1 + num_drafts
            req.num_device_drafts = self.num_lookahead_tokens if propose_drafts else 0
            if req.structured_output is not None:
                so_seq_ids.append(req.seq_id)
        seq_id = req.seq_id
        blocks = self.kv.req_blocks.get(seq_id, ())
        sent = self._num_sent_blocks.get(seq_id, 0)
        if len(blocks) != sent:
            self._num_sent_blocks[seq_id] = len(blocks)
            new_blocks = [b.block_id for b in blocks[sent:]]
        else:
            new_blocks = []  # most decode steps: the last block has room
        # A decode step whose input is the previous step's sample has no host-known token.
        tokens = req.token_slice(c, known_end) if c < known_end else []
        if not num_drafts:
            return ScheduledSequence(seq_id, c, num_new, tokens, end > num_tokens, sample, new_blocks)
        if drafts:
            req.spec_token_ids = drafts
            return ScheduledSequence(seq_id, c, num_new + num_drafts, tokens, False, sample, new_blocks,
                                     spec_token_ids=drafts)
        return ScheduledSequence(seq_id, c, num_new + num_drafts, tokens, True, sample, new_blocks,
                                 num_device_drafts=num_device_drafts)

    def _propose(self, req: Request, num_tokens: int, budget: int) -> list[int] | int:
        """Draft tokens for a decoding ``req`` with ``num_tokens`` known tokens: at most
        what its ``max_tokens``, the context and the step's ``budget`` leave room for
        besides the token the step samples anyway, counting its tokens in flight as the
        most they can be; of a constrained sequence, the prefix its grammar accepts. With
        a step in flight, the number of the runner's drafts to verify (their ids are on
        the device). None for a sequence below ``min_tokens`` (its stop tokens are masked
        per sampled token), counting a step in flight as one token."""
        in_flight = req.num_output_placeholders
        num_output = num_tokens - req.num_prompt_tokens
        if num_output + min(in_flight, 1) < req.sampling_params.min_tokens:
            return []
        room = min(req.max_tokens - num_output - in_flight, self.max_model_len - num_tokens - in_flight, budget) - 1
        if room <= 0:
            return []
        if in_flight:
            return min(req.num_device_drafts, room)
        if self.proposer is None:
            drafts = req.draft_token_ids[:room]
        else:
            drafts = self.proposer.propose(np.asarray(req.all_token_ids, dtype=np.int64))[:room].tolist()
        if drafts and req.structured_output is not None:
            return self.structured_output_manager.valid_draft_prefix(req, drafts)
        return drafts

    def _lookahead(self, req: Request, num_new: int) -> int:
        """Lookahead slots for ``req``'s step of ``num_new`` tokens: never past the context."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - req.num_computed_tokens - num_new))

    def _admit_slots(self, req: Request, num_new: int, blocks: list, speculate: bool) -> bool:
        """Allocate a waiting ``req``'s first ``num_new`` slots (after its prefix-cache hit
        ``blocks``), plus the draft model's lookahead where the step speculates, they end
        its prompt and a block is free for it."""
        ends_prompt = req.num_computed_tokens + num_new == req.num_tokens
        lookahead = self._lookahead(req, num_new) if speculate and ends_prompt else 0
        if lookahead and self.kv.allocate_slots(req, num_new, blocks, num_lookahead_tokens=lookahead):
            return True
        return self.kv.allocate_slots(req, num_new, blocks)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.draft_token_ids = []
        req.num_device_drafts = 0
        self._num_sent_blocks.pop(req.seq_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def wants_drafts(self) -> bool:
        """Whether the next step speculates. Decided once per step, by the number of
        running sequences (``disable_by_batch_size``)."""
        limit = self.disable_by_batch_size
        return self.speculates and (limit is None or len(self.running) <= limit)

    def needs_outputs_to_draft(self) -> bool:
        """Whether the next step's drafts need the step in flight taken in first: they
        come from the n-gram proposer (the sequences' tokens), or a constrained sequence
        runs (drafts are checked against its grammar on the host). Otherwise they stay
        on the device and the loop runs one step ahead."""
        if not self.wants_drafts():
            return False
        return self.proposer is not None or any(r.structured_output is not None for r in self.running)

    def schedule(self, virtual_engine: int = 0) -> SchedulerOutput:
        """Decide the next step: of ``virtual_engine``'s sequences, and the waiting ones it
        admits (module docstring). Never blocks; may return an empty step."""
        speculate = self.wants_drafts()
        propose = speculate and self.num_lookahead_tokens > 0
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Request] = []

        so_seq_ids: list[int] = []  # sampling constrained sequences, in step order
        running, kv, max_model_len = self.running, self.kv, self.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.virtual_engine != virtual_engine:
                i += 1
                continue
            num_output = len(req.output_token_ids)
            num_tokens = len(req.prompt_token_ids) + num_output
            placeholders = req.num_output_placeholders
            if num_output + placeholders >= req.max_tokens or num_tokens + placeholders >= max_model_len:
                # At its length limit: all it may produce is sampled (maybe not yet on the host).
                i += 1
                continue
            num_new = num_tokens + placeholders - req.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                i += 1
                continue
            proposal = self._propose(req, num_tokens, budget) if speculate and num_new == 1 else []
            drafts, device = ([], proposal) if isinstance(proposal, int) else (proposal, 0)
            num_drafts = len(drafts) + device
            lookahead = self._lookahead(req, num_new + num_drafts) if speculate else 0
            while not kv.allocate_slots(req, num_new + num_drafts, num_lookahead_tokens=lookahead):
                if num_drafts or lookahead:
                    drafts, device, num_drafts, lookahead = [], 0, 0, 0  # drafts never cost another sequence its blocks
                    continue
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(self._schedule_seq(req, num_new, num_tokens, so_seq_ids, drafts, device, propose))
                budget -= num_new + num_drafts
                i += 1
                continue
            break  # the sequence preempted itself: nothing else can fit

        if not preempted:
            # Requests whose grammar is still compiling wait without holding up the others.
            compiling: list[Request] = []
            room = self._admission_room(virtual_engine)
            while self.waiting and budget > 0 and room > 0:
                req = self.waiting[0]
                if req.num_output_placeholders:
                    break  # a preempted sequence whose last sample is still in flight
                if req.structured_output is not None and not req.structured_output.is_ready():
                    compiling.append(self.waiting.popleft())
                    continue
                blocks, num_hit = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_hit
                if num_new > budget:
                    if not self.enable_chunked_prefill:
                        break
                    num_new = budget
                req.num_computed_tokens = num_hit
                if not self._admit_slots(req, num_new, blocks, speculate):
                    req.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                    self.kv.record_prefix_lookup(req.num_tokens, num_hit)
                req.status = RequestStatus.RUNNING
                req.virtual_engine = virtual_engine
                room -= 1
                self.running.append(req)
                seq = self._schedule_seq(req, num_new, req.num_tokens, so_seq_ids, propose_drafts=propose)
                seq.new_request = NewRequestData.from_request(req)
                scheduled.append(seq)
                budget -= num_new
            self.waiting.extendleft(reversed(compiling))

        self._step_id += 1
        out = SchedulerOutput(
            step_id=self._step_id,
            scheduled=scheduled,
            num_scheduled_tokens=self.max_num_batched_tokens - budget,
            preempted_seq_ids=[r.seq_id for r in preempted],
            finished_seq_ids=self._finished_since_last_step,
            structured_output_seq_ids=so_seq_ids,
            propose_drafts=propose,
        )
        self._finished_since_last_step = []
        return out

    def _admission_room(self, virtual_engine: int) -> int:
        """How many waiting sequences ``virtual_engine`` may admit now: within
        ``max_num_seqs`` and, with several virtual engines, up to its even share of the
        sequences there are (running and waiting, at most ``max_num_seqs``), so that a
        few requests spread over the engines too."""
        room = self.max_num_seqs - len(self.running)
        n = self.max_concurrent_batches
        if n > 1:
            share = -(-min(self.max_num_seqs, len(self.running) + len(self.waiting)) // n)
            room = min(room, share - sum(1 for r in self.running if r.virtual_engine == virtual_engine))
        return room

    def advance_grammars(self, result: ModelRunnerOutput) -> None:
        """Advance the grammars of ``result``'s live constrained sequences by their sampled
        tokens, in one batched call (the first part of taking in a step's outputs: the
        engine core runs it alone before filling the next step's bitmask, then
        ``update_from_output(result, grammars_advanced=True)``).

        A sequence whose grammar could only end while ``min_tokens`` masked its stop
        tokens (``structured_output.forced_stop``) gets that stop token in place of its
        sample, in ``result`` too: the grammar's end wins over ``min_tokens``. A sequence
        that verified drafts advances by every token it emitted; a token its grammar
        refuses cuts its run there, in ``result`` too."""
        reqs, toks = [], []
        sampled, runs = result.sampled_token_ids, result.accepted_token_ids
        manager = self.structured_output_manager
        for i, sid in enumerate(result.seq_ids):
            req = self.requests.get(sid)
            if req is not None and req.structured_output is not None and req.structured_output.failure is None:
                so = req.structured_output
                if i in runs and req.spec_token_ids:
                    runs[i] = runs[i][:max(1, manager.accept_run(req, runs[i]))]
                    continue
                if so.forced_stop is not None:
                    sampled[i], so.forced_stop = so.forced_stop, None
                reqs.append(req)
                toks.append(sampled[i])
        if reqs:
            manager.accept_tokens(reqs, toks)

    def update_from_output(self, result: ModelRunnerOutput, grammars_advanced: bool = False) -> list[EngineCoreOutput]:
        """Take in one step's sampled tokens: placeholder accounting, token-id stop checks
        (EOS, ``stop_token_ids``, ``max_tokens``, ``min_tokens``, the context length), the
        advance of constrained sequences' grammars by their token (unless
        ``grammars_advanced``: :meth:`advance_grammars` already ran on ``result``; a
        completed grammar finishes the sequence as "stop", and so does one that refused
        its token, which is left out of the output; one whose matcher failed ends as "abort"
        with ``structured_output.failure`` as its error) and freeing of finished sequences.

        A sequence that verified drafts takes its ``result.accepted_token_ids`` one by one,
        each stop-checked, the rest dropped once one finishes it; its rejected drafts'
        computed tokens are taken back first.

        Returns one output per live sequence that got a token (a token of a sequence that
        finished or was aborted before its step was processed is dropped), plus prompt
        logprobs of sequences that computed some without sampling.
        """
        if not grammars_advanced:
            self.advance_grammars(result)
        outputs: dict[int, EngineCoreOutput] = {}
        for sid, pl in result.prompt_logprobs.items():
            req = self.requests.get(sid)
            if req is not None:
                outputs[sid] = EngineCoreOutput(req.request_id, [], new_prompt_logprobs=PromptLogprobsData(
                    pl.start, pl.token_ids, pl.logprobs, pl.ranks))
        requests, logprobs, accepted = self.requests, result.logprobs, result.accepted_token_ids
        drafts, num_verified = result.draft_token_ids, result.num_draft_tokens
        for row, (sid, tok) in enumerate(zip(result.seq_ids, result.sampled_token_ids)):
            req = requests.get(sid)
            if req is None:
                continue
            num_drafts = num_verified.get(row, 0)
            req.num_output_placeholders -= 1 + num_drafts  # the step's tokens reached the host
            out = outputs.get(sid)
            if out is None:
                out = outputs[sid] = EngineCoreOutput(req.request_id, [])
            so = req.structured_output
            if so is not None and so.failure is not None:
                # Its matcher failed: it ends with that error, its token dropped.
                self.finish_request(sid, RequestStatus.FINISHED_ABORTED)
                out.finish_reason, out.error = RequestStatus.FINISHED_ABORTED.finish_reason, so.failure
                continue
            if so is not None and so.refused:
                # Its grammar refused the token: not part of the output; the grammar ends it.
                self.finish_request(sid, RequestStatus.FINISHED_STOPPED)
                out.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
                continue
            if req.num_cached_tokens > 0:
                out.num_cached_tokens = req.num_cached_tokens
            wants_logprobs = req.sampling_params.logprobs is not None
            if num_drafts:
                tokens = accepted[row]
                self._take_back_rejected(req, num_drafts, len(tokens) - 1)
                token_logprobs = result.accepted_logprobs.get(row) if wants_logprobs else None
            else:
                tokens = (tok,)
                token_logprobs = [logprobs[row]] if wants_logprobs else None
            if token_logprobs is not None:  # one per token kept below
                out.new_logprobs = token_logprobs
            req.draft_token_ids = drafts[row] if drafts is not None else []
            last = len(tokens) - 1
            for k, tok in enumerate(tokens):
                req.output_token_ids.append(tok)
                out.new_token_ids.append(tok)
                status = self._check_stop(req, tok, k == last)
                if status is not None:  # the tokens after it are dropped
                    if out.new_logprobs is not None:
                        del out.new_logprobs[len(out.new_token_ids):]
                    self.finish_request(sid, status)
                    out.finish_reason, out.stop_reason = status.finish_reason, req.stop_reason
                    break
        return list(outputs.values())

    def _take_back_rejected(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Un-count the computed tokens of ``req``'s rejected drafts (their K/V slots are
        written again by later steps; a preempted sequence has none counted) and count the
        verification: position ``i`` is accepted when the first ``i + 1`` drafts are."""
        if req.status is RequestStatus.RUNNING:
            req.num_computed_tokens -= num_drafts - num_accepted
        req.spec_token_ids = []
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if num_drafts > len(per_pos):  # more drafts than the K it was sized to
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def _check_stop(self, req: Request, tok: int, last_of_step: bool = True) -> RequestStatus | None:
        """How ``req`` ends after its new token ``tok``, or None. A finished grammar ends it
        only at the step's last token (the grammar has taken in all of the step's tokens)."""
        p = req.sampling_params
        num_output = len(req.output_token_ids)
        if num_output >= p.min_tokens:
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
            if tok in p.all_stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if last_of_step and req.structured_output is not None and req.structured_output.finished:
            return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.prompt_token_ids) + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, seq_id: int, status: RequestStatus) -> Request | None:
        """Finish a sequence and free its blocks. Idempotent (returns None the 2nd time)."""
        req = self.requests.pop(seq_id, None)
        if req is None:
            return None
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        self._num_sent_blocks.pop(seq_id, None)
        self._finished_since_last_step.append(seq_id)
        return req

    def stats(self) -> dict[str, float | list[int]]:
        """Gauges and counters (tokens; ``spec_decode_num_accepted_tokens_per_pos``: one count
        per draft position)."""
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.kv.usage,
            "num_preemptions": self.num_preemptions,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
