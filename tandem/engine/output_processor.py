"""Processing a step's outputs: the CPU work that one-step-ahead scheduling overlaps.

For each sampled token: append it, check stop conditions (stop token ids, EOS, length,
stop strings after incremental detokenization), gather logprobs, free finished sequences'
KV blocks, and build ``RequestOutput``s. With ``async_output_proc`` this runs for step N
while the device executes step N+1; a token of a sequence that finished (or was aborted)
before its step was processed is dropped here, never emitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.core.scheduler import Scheduler
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.token_bytes import TokenBytes
from tandem.outputs import CompletionOutput, Logprob, ModelRunnerOutput, PositionLogprobs, PromptLogprobs, RequestOutput
from tandem.request import Request, RequestStatus
from tandem.sampling_params import RequestOutputKind


@dataclass(eq=False)
class SeqOutputState:
    req: Request
    detok: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    sent_tokens: int = 0  # for DELTA outputs
    finish_sent: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(eq=False)
class ParentState:
    """A user request: its ``n`` sequences and what has been delivered."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    arrival_time: float
    seqs: list[SeqOutputState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    finished: bool = False


class OutputProcessor:
    """Turns ``ModelRunnerOutput``s into ``RequestOutput``s and finishes sequences.

    Args:
        tokenizer: HF tokenizer (for detokenization and logprob token strings).
        scheduler: told about arrived tokens and finished sequences.
        max_model_len: context length (a "length" stop).
    """

    def __init__(self, tokenizer, scheduler: Scheduler, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.parents: dict[str, ParentState] = {}
        self.seqs: dict[int, tuple[ParentState, SeqOutputState]] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}

    def add_request(self, request_id: str, prompt: str | None, reqs: list[Request]) -> None:
        """Track a user request made of sequences ``reqs`` (one per completion).

        Raises:
            ValueError: ``request_id`` is already live.
        """
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")
        p = reqs[0].sampling_params
        parent = ParentState(request_id, prompt, reqs[0].prompt_token_ids, p.output_kind, reqs[0].arrival_time)
        if p.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for req in reqs:
            sp = req.sampling_params
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens, stop=sp.stop,
                include_stop_str_in_output=sp.include_stop_str_in_output,
            )
            s = SeqOutputState(req, detok, [] if sp.logprobs is not None else None, 0.0 if sp.logprobs is not None else None)
            parent.seqs.append(s)
            self.seqs[req.seq_id] = (parent, s)
        self.parents[request_id] = parent
        self.stats["prompt_tokens"] += len(parent.prompt_token_ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def abort(self, request_id: str) -> None:
        """Finish every sequence of a request as aborted; nothing more is emitted."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return
        for s in parent.seqs:
            self.seqs.pop(s.req.seq_id, None)
            self.scheduler.finish_request(s.req.seq_id, RequestStatus.FINISHED_ABORTED)

    def process(self, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Process one step's results; returns outputs of the requests that changed."""
        now = time.monotonic()
        touched: dict[str, ParentState] = {}
        for sid, pl in result.prompt_logprobs.items():
            entry = self.seqs.get(sid)
            if entry is not None and entry[0].prompt_logprobs is not None and entry[1] is entry[0].seqs[0]:
                self._add_prompt_logprobs(entry[0], pl)
        for row, (sid, tok) in enumerate(zip(result.seq_ids, result.sampled_token_ids)):
            entry = self.seqs.get(sid)
            if entry is None:
                continue  # finished or aborted before this step was processed
            parent, s = entry
            req = s.req
            self.scheduler.on_token(req)
            req.output_token_ids.append(tok)
            self.stats["generation_tokens"] += 1
            if s.first_token_time is None:
                s.first_token_time = now
            s.last_token_time = now
            if s.logprobs is not None:
                ids, lps, rank = result.logprobs[row]
                s.logprobs.append(self._position_logprobs(ids, lps, rank, req.sampling_params.logprobs))
                s.cumulative_logprob += lps[0]
            status = self._check_stop(req, tok)
            # As in vLLM, an EOS / stop token's own text is left out unless asked for.
            hide = status == RequestStatus.FINISHED_STOPPED and not req.sampling_params.include_stop_str_in_output
            stop_str = s.detok.update([] if hide else [tok], status is not None,
                                      check_stop=req.num_output_tokens >= req.sampling_params.min_tokens)
            # A stop string completed by the last allowed token still ends it as "stop".
            if stop_str is not None and status in (None, RequestStatus.FINISHED_LENGTH):
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if status is not None:
                self.scheduler.finish_request(sid, status)
                del self.seqs[sid]
            touched[parent.request_id] = parent
        return [o for p in touched.values() if (o := self._make_output(p, now)) is not None]

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
            if tok in p.all_stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _position_logprobs(self, ids: list[int], lps: list[float], rank: int, k: int) -> PositionLogprobs:
        token_string = self.token_bytes.token_string
        out = {ids[0]: Logprob(lps[0], rank, token_string(ids[0]))}
        for r, (t, lp) in enumerate(zip(ids[1 : 1 + k], lps[1 : 1 + k]), start=1):
            if t not in out:
                out[t] = Logprob(lp, r, token_string(t))
        return out

    def _add_prompt_logprobs(self, parent: ParentState, pl: PromptLogprobs) -> None:
        k = parent.seqs[0].req.sampling_params.prompt_logprobs
        # After a preemption the prompt is recomputed: skip positions already delivered.
        skip = max(len(parent.prompt_logprobs) - pl.start, 0)
        for ids, lps, rank in list(zip(pl.token_ids, pl.logprobs, pl.ranks))[skip:]:
            parent.prompt_logprobs.append(self._position_logprobs(ids, lps, rank, k))

    def _make_output(self, parent: ParentState, now: float) -> RequestOutput | None:
        finished = all(s.req.is_finished for s in parent.seqs)
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for s in parent.seqs:
            req = s.req
            if delta and len(req.output_token_ids) == s.sent_tokens and (s.finish_sent or not req.is_finished):
                continue  # nothing new for this sequence in a streamed output
            text = s.detok.get_next_output_text(req.is_finished, delta)
            start = s.sent_tokens if delta else 0
            completions.append(CompletionOutput(
                index=req.index,
                text=text,
                token_ids=req.output_token_ids[start:],
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs[start:] if s.logprobs is not None else None,
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
            ))
            s.sent_tokens = len(req.output_token_ids)
            s.finish_sent = req.is_finished
        prompt_lp = parent.prompt_logprobs
        if delta and prompt_lp is not None:
            prompt_lp = None if parent.prompt_logprobs_sent else prompt_lp
            parent.prompt_logprobs_sent = True
        metrics = {}
        if finished:
            self.parents.pop(parent.request_id, None)
            first = min((s.first_token_time for s in parent.seqs if s.first_token_time), default=now)
            metrics = {"arrival_time": parent.arrival_time, "first_token_time": first, "finished_time": now,
                       "num_generation_tokens": sum(s.req.num_output_tokens for s in parent.seqs)}
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=max(parent.seqs[0].req.num_cached_tokens, 0),
            metrics=metrics,
        )
