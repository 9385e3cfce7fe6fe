"""Front-end output processing: core outputs (token ids) -> text and ``RequestOutput``s.

As vLLM V1's ``OutputProcessor``: for each sequence's new token ids it runs incremental
detokenization (:class:`IncrementalDetokenizer`), matches stop strings and stop regexes,
decodes logprob token strings and builds the request's ``RequestOutput`` (FINAL_ONLY,
CUMULATIVE or DELTA).
Token-id finishes (EOS, stop token ids, length) were decided by the core
(``Scheduler.update_from_output``); a stop string found here finishes the sequence and is
returned in ``reqs_to_abort`` for the caller to abort in its core. A token of a sequence
that finished before the core heard of it is dropped here, never emitted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.messages import EngineCoreOutput, EngineCoreRequest, PromptLogprobsData
from tandem.engine.token_bytes import TokenBytes
from tandem.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tandem.sampling_params import RequestOutputKind


@dataclass(eq=False)
class SeqOutputState:
    """One of a request's ``n`` sequences, as the front end sees it."""

    core_request_id: str
    index: int
    params: object  # SamplingParams
    detok: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    finish_sent: bool = False
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    num_cached_tokens: int = 0


@dataclass
class OutputProcessorOutput:
    """What one batch of core outputs produced.

    ``request_outputs``: one per request that changed; ``reqs_to_abort``: core request ids
    finished here by a stop string (abort them in their core); ``errors``: request id ->
    message, for requests their core dropped (a failed step, a grammar that did not
    compile); they are gone here too. ``failed_outputs``: the final output of each of
    those (what it had, unfinished completions as "abort", ``error`` set), for callers
    that answer with one (``LLMEngine``).
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    failed_outputs: list[RequestOutput] = field(default_factory=list)


class OutputProcessor:
    """Turns ``EngineCoreOutput``s into ``RequestOutput``s.

    Args:
        tokenizer: HF fast tokenizer (detokenization and logprob token strings).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.parents: dict[str, ParentState] = {}
        self.seqs: dict[str, tuple[ParentState, SeqOutputState]] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0}

    def add_request(self, request_id: str, prompt: str | None, core_reqs: list[EngineCoreRequest]) -> None:
        """Track a user request made of the sequences ``core_reqs`` (one per completion).

        Raises:
            ValueError: ``request_id`` is already live.
        """
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")
        first = core_reqs[0]
        p = first.sampling_params
        parent = ParentState(request_id, prompt, first.prompt_token_ids, p.output_kind, first.arrival_time)
        if p.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i, cr in enumerate(core_reqs):
            sp = cr.sampling_params
            detok = IncrementalDetokenizer(
                self.tokenizer, cr.prompt_token_ids, skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens, stop=sp.stop,
                include_stop_str_in_output=sp.include_stop_str_in_output, stop_regex=sp.stop_regex,
            )
            want_lp = sp.logprobs is not None
            s = SeqOutputState(cr.request_id, i, sp, detok, [] if want_lp else None, 0.0 if want_lp else None)
            parent.seqs.append(s)
            self.seqs[cr.request_id] = (parent, s)
        self.parents[request_id] = parent
        self.stats["prompt_tokens"] += len(parent.prompt_token_ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the core ids of its sequences still running there."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        live = []
        for s in parent.seqs:
            if self.seqs.pop(s.core_request_id, None) is not None:
                live.append(s.core_request_id)
        return live

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Process the core outputs of one step (see the module docstring), in one pass."""
        now = time.monotonic()
        res = OutputProcessorOutput()
        touched: dict[str, ParentState] = {}
        seqs = self.seqs
        num_generated = 0
        for o in outputs:
            entry = seqs.get(o.request_id)
            if entry is None:
                continue  # finished or aborted before this step was processed
            parent, s = entry
            if o.error is not None:
                res.errors[parent.request_id] = o.error
                res.reqs_to_abort += [c for c in self.abort(parent.request_id) if c != o.request_id]
                touched.pop(parent.request_id, None)
                res.failed_outputs.append(self._failed_output(parent, o.error, now))
                continue
            if o.new_prompt_logprobs is not None and parent.prompt_logprobs is not None and s is parent.seqs[0]:
                self._add_prompt_logprobs(parent, o.new_prompt_logprobs)
            if not o.new_token_ids:
                if o.finish_reason is None:
                    continue
                s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason  # finished without a token
                del seqs[o.request_id]
                touched[parent.request_id] = parent
                continue
            if s.index == 0:
                parent.num_cached_tokens = o.num_cached_tokens
            num_generated += self._take_tokens(s, o, now, res)
            if s.finish_reason is not None:
                del seqs[o.request_id]
            touched[parent.request_id] = parent
        self.stats["generation_tokens"] += num_generated
        make = self._make_output
        res.request_outputs = [r for p in touched.values() if (r := make(p, now)) is not None]
        return res

    def _take_tokens(self, s: SeqOutputState, o: EngineCoreOutput, now: float, res: OutputProcessorOutput) -> int:
        """Take a step's new tokens of one sequence; returns how many were taken (the
        tokens after a stop string that ends the sequence are dropped)."""
        sp = s.params
        new = o.new_token_ids
        last = len(new) - 1
        if s.first_token_time is None:
            s.first_token_time = now
        out_ids, detok = s.output_token_ids, s.detok
        for k, tok in enumerate(new):
            out_ids.append(tok)
            if s.logprobs is not None:
                ids, lps, rank = o.new_logprobs[k]
                s.logprobs.append(self._position_logprobs(ids, lps, rank, sp.logprobs))
                s.cumulative_logprob += lps[0]
            reason = o.finish_reason if k == last else None
            # As in vLLM, an EOS / stop token's own text is left out unless asked for.
            hide = reason == "stop" and not sp.include_stop_str_in_output
            stop_str = detok.update([] if hide else [tok], reason is not None,
                                    check_stop=len(out_ids) >= sp.min_tokens)
            if reason is not None:
                s.finish_reason, s.stop_reason = reason, o.stop_reason
            # A stop string completed by the last allowed token still ends it as "stop".
            if stop_str is not None and reason in (None, "length"):
                if reason is None:
                    res.reqs_to_abort.append(s.core_request_id)
                s.finish_reason, s.stop_reason = "stop", stop_str
            if s.finish_reason is not None:
                return k + 1
        return last + 1

    def _failed_output(self, parent: ParentState, error: str, now: float) -> RequestOutput:
        """The last output of a request its core dropped: its completions so far, the
        unfinished ones ending as "abort"."""
        for s in parent.seqs:
            if not s.finished:
                s.finish_reason = "abort"
        out = self._make_output(parent, now)
        out.error = error
        return out

    def _position_logprobs(self, ids: list[int], lps: list[float], rank: int, k: int) -> PositionLogprobs:
        token_string = self.token_bytes.token_string
        out = {ids[0]: Logprob(lps[0], rank, token_string(ids[0]))}
        for r, (t, lp) in enumerate(zip(ids[1 : 1 + k], lps[1 : 1 + k]), start=1):
            if t not in out:
                out[t] = Logprob(lp, r, token_string(t))
        return out

    def _add_prompt_logprobs(self, parent: ParentState, pl: PromptLogprobsData) -> None:
        k = parent.seqs[0].params.prompt_logprobs
        # After a preemption the prompt is recomputed: skip positions already delivered.
        skip = max(len(parent.prompt_logprobs) - pl.start, 0)
        for ids, lps, rank in list(zip(pl.token_ids, pl.logprobs, pl.ranks))[skip:]:
            parent.prompt_logprobs.append(self._position_logprobs(ids, lps, rank, k))

    def _make_output(self, parent: ParentState, now: float) -> RequestOutput | None:
        seqs = parent.seqs
        if len(seqs) == 1:
            finished = seqs[0].finish_reason is not None
        else:
            finished = all(s.finish_reason is not None for s in seqs)
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for s in seqs:
            s_finished = s.finish_reason is not None
            n = len(s.output_token_ids)
            if delta and n == s.sent_tokens and (s.finish_sent or not s_finished):
                continue  # nothing new for this sequence in a streamed output
            text = s.detok.get_next_output_text(s_finished, delta)
            start = s.sent_tokens if delta else 0
            completions.append(CompletionOutput(
                s.index, text, s.output_token_ids[start:], s.cumulative_logprob,
                s.logprobs[start:] if s.logprobs is not None else None, s.finish_reason, s.stop_reason,
            ))
            s.sent_tokens = n
            s.finish_sent = s_finished
        prompt_lp = parent.prompt_logprobs
        if delta and prompt_lp is not None:
            prompt_lp = None if parent.prompt_logprobs_sent else prompt_lp
            parent.prompt_logprobs_sent = True
        metrics = {}
        if finished:
            self.parents.pop(parent.request_id, None)
            first = min((s.first_token_time for s in parent.seqs if s.first_token_time), default=now)
            metrics = {"arrival_time": parent.arrival_time, "first_token_time": first, "finished_time": now,
                       "num_generation_tokens": sum(len(s.output_token_ids) for s in parent.seqs)}
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=metrics,
        )
