"""Grammar compilation and matching for constrained requests (xgrammar backend).

Why xgrammar (benchmarks/RESULTS.md, "Session 5 — structured outputs"): on SmolLM2's
tokenizer it fills a next-token mask in a few microseconds per token (it precomputes
context-independent token sets at compile time) against ~0.1 ms for llguidance; its
longer compile (tens of ms) happens once per schema, on a worker thread, and is cached.

Life of a constrained sequence:

All of it lives in the engine core (:class:`tandem.engine.core.EngineCore`), where the
bitmask is built; the front end only validates the constraint and sends its fields.

1. ``init_request`` (core thread, when the request is added) submits its grammar to
   one compile thread, or reuses the compile of an equal constraint (cache keyed by
   :meth:`StructuredOutputsParams.cache_key`). The scheduler leaves the request waiting
   until ``is_ready()`` (vLLM's ``WAITING_FOR_FSM``), so a new schema never stalls the
   requests already running.
2. ``accept_tokens`` (``Scheduler.advance_grammars``, core thread) advances the matchers
   of a step's constrained sequences by their sampled tokens, all in one xgrammar call.
3. ``grammar_bitmask`` (core thread) fills the bitmask rows of the next step's
   constrained sequences, all in one xgrammar call.

An error raised by one sequence's matcher (xgrammar at run time) ends that sequence alone:
the manager sets its ``structured_output.failure``, gives it an all-allowed row, and the
scheduler finishes it as "abort" with that error; a batched call that raises is redone
sequence by sequence to find whose it was.

Both calls run in C++ without the GIL; the fill spreads its rows over
``TANDEM_STRUCTURED_OUTPUT_THREADS`` threads (:mod:`tandem.envs`). With every sequence
constrained this is the host work that stands between a step's tokens reaching the host
and the next step's sampling (``EngineCore.step``): one Python call per sequence made it
exposed on a GPU (benchmarks/RESULTS.md, "Session 6 — structured outputs host cost").
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem import envs
from tandem.structured_output.bitmask import GrammarBitmask
from tandem.structured_output.params import ANY_OBJECT, StructuredOutputsParams, xgrammar_error

if TYPE_CHECKING:
    import xgrammar as xgr

    from tandem.request import Request

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (least recently used first out), at most this many and
# this many bytes of them (xgrammar's own count; a small JSON schema or a tool call on a
# 49K vocabulary takes ~0.2 MB: RESULTS, "engine core memory").
_CACHE_SIZE = 256
_CACHE_BYTES = 64 * 2**20
# Bitmask rows per fill thread. xgrammar starts its threads at every batched fill, which
# costs about what filling a few rows in typical states does: small batches fill on
# fewer threads (vLLM fills in parallel from 128 rows, 16 rows per task).
_ROWS_PER_THREAD = 16


class StructuredOutputRequest:
    """One sequence's grammar: a compile future, then a matcher of its own.

    Args:
        compiled: resolves to an ``xgrammar.CompiledGrammar``.
    """

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None
        # The grammar takes no more tokens: it accepted its stop token, or refused the
        # last sampled one (set by StructuredOutputManager.accept_tokens).
        self.finished = False
        # The last sampled token was refused: it is not part of the output.
        self.refused = False
        # The stop token that replaces the sample of a row whose grammar can only end
        # while min_tokens masks its stop tokens (set by grammar_bitmask).
        self.forced_stop: int | None = None
        # Why this sequence's matcher failed at run time: the scheduler ends it with this
        # error (set by StructuredOutputManager, with ``finished``).
        self.failure: str | None = None

    def is_ready(self) -> bool:
        """Compiled without error: the sequence may be scheduled."""
        return self._compiled.done() and self._compiled.exception() is None

    def error(self) -> str | None:
        """The compile error, once the compile failed."""
        if not self._compiled.done() or self._compiled.exception() is None:
            return None
        return xgrammar_error(self._compiled.exception())

    @property
    def matcher(self) -> "xgr.GrammarMatcher":
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher


class StructuredOutputManager:
    """Compiles constraints off the engine loop and builds each step's bitmask.

    Args:
        tokenizer: the model's HF tokenizer, or the path to load it from (on the compile
            thread, at the first constrained request: a core needs no tokenizer otherwise).
        vocab_size: logits width (may exceed the tokenizer's size: padded vocabularies).
        stop_token_ids: tokens that end a complete output (the model's EOS ids; the
            tokenizer's EOS is added).
        pin_memory: build the bitmasks in pinned memory (a CUDA device copies them
            without blocking).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], pin_memory: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.pin_memory = pin_memory
        # The bitmask rows of every step (grown as needed).
        self._bitmask: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        # The tokens that end a grammar (set with the compiler).
        self._grammar_stop_ids: frozenset[int] = frozenset()
        # Batched fillers by thread count.
        self._batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pending: list[Request] = []

    def init_request(self, req: "Request") -> None:
        """Give a constrained sequence its grammar (compiled in the background)."""
        params: StructuredOutputsParams = req.sampling_params.structured_outputs
        key = params.cache_key()
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
        self._cache.move_to_end(key)
        self._evict()
        req.structured_output = StructuredOutputRequest(fut)
        self._pending.append(req)

    def _evict(self) -> None:
        """Drop the least recently used compiles while over :data:`_CACHE_SIZE` entries or
        :data:`_CACHE_BYTES` (compiles still running count 0; the newest entry stays)."""
        sizes = [f.result().memory_size_bytes if f.done() and f.exception() is None else 0
                 for f in self._cache.values()]
        total = sum(sizes)
        for size in sizes[:-1]:
            if len(self._cache) <= _CACHE_SIZE and total <= _CACHE_BYTES:
                break
            self._cache.popitem(last=False)
            total -= size

    def take_failed(self) -> list["Request"]:
        """Sequences whose grammar failed to compile (each returned once)."""
        failed, pending = [], []
        for req in self._pending:
            so = req.structured_output
            if not so._compiled.done():
                pending.append(req)
            elif so.error() is not None:
                failed.append(req)
        self._pending = pending
        return failed

    def accept_tokens(self, reqs: list["Request"], token_ids: list[int]) -> None:
        """Advance each sequence's matcher by its sampled token (one xgrammar call).

        A sequence whose grammar accepted its stop token, or refused its token, gets
        ``structured_output.finished`` set (the scheduler then finishes it as "stop"); a
        refused token also sets ``structured_output.refused`` (the scheduler leaves it out
        of the output). A refusal only happens when other masks (``logit_bias``, bad
        words) leave the row no token its grammar allows: the runner samples within the
        bitmask, and a grammar that can only end gets its stop token whatever
        ``min_tokens`` says (:meth:`grammar_bitmask`).

        Args:
            reqs: live sequences with a compiled grammar, at most one entry each.
            token_ids: ``token_ids[i]`` was sampled for ``reqs[i]``.
        """
        import xgrammar as xgr

        matchers = [r.structured_output.matcher for r in reqs]
        try:
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, token_ids)
        except Exception:  # noqa: BLE001 - one sequence's matcher: redone one by one below
            accepted = [self._guarded(r, False, m.accept_token, t) for r, m, t in zip(reqs, matchers, token_ids)]
        for req, matcher, tok, ok in zip(reqs, matchers, token_ids, accepted):
            if req.structured_output.failure is not None:
                continue
            if not ok:
                logger.warning("request %s: token %d does not match its grammar; finishing it", req.request_id, tok)
                req.structured_output.finished = req.structured_output.refused = True
            elif tok in self._grammar_stop_ids and matcher.is_terminated():  # only a stop token ends a grammar
                req.structured_output.finished = True

    def valid_draft_prefix(self, req: "Request", drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` that ``req``'s grammar accepts after its tokens
        so far, without a token that ends the grammar (speculative decoding: a verified
        position after an ended grammar has no mask; the stop token comes as the step's own
        token). The grammar's state is left as it was."""
        return self._guarded(req, [], self._valid_draft_prefix, req, drafts)

    def _valid_draft_prefix(self, req: "Request", drafts: list[int]) -> list[int]:
        matcher = req.structured_output.matcher
        n, ended = 0, False
        for tok in drafts:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            n += 1
            if matcher.is_terminated():
                ended = True
                break
        if n:
            matcher.rollback(n)
        return drafts[:n - 1] if ended else drafts[:n]

    def accept_run(self, req: "Request", token_ids: list[int]) -> int:
        """Advance ``req``'s matcher by the tokens a verification emitted, in order; returns
        how many it accepted. A refused token ends the run: the sequence is finished
        there (``refused`` too when it was the first); so is one whose grammar accepted
        its stop token."""
        return self._guarded(req, 0, self._accept_run, req, token_ids)

    def _accept_run(self, req: "Request", token_ids: list[int]) -> int:
        so = req.structured_output
        matcher = so.matcher
        for n, tok in enumerate(token_ids):
            if not matcher.accept_token(tok):
                logger.warning("request %s: token %d does not match its grammar; finishing it", req.request_id, tok)
                so.finished, so.refused = True, n == 0
                return n
        if token_ids[-1] in self._grammar_stop_ids and matcher.is_terminated():
            so.finished = True
        return len(token_ids)

    def grammar_bitmask(self, seq_ids: list[int], requests: dict[int, "Request"]) -> GrammarBitmask:
        """The bitmask rows of ``seq_ids`` (``int32 [len(seq_ids), ceil(V / 32)]``, host),
        filled in one xgrammar call over up to ``TANDEM_STRUCTURED_OUTPUT_THREADS`` threads
        (one per 16 rows).

        A sequence no longer in ``requests`` (finished by the step processed meanwhile),
        or whose grammar is finished, gets an all-allowed row: its sampled token is
        discarded. A sequence below ``min_tokens`` whose grammar can only end (the sampler
        would mask every token its row allows) gets ``structured_output.forced_stop``:
        the grammar's end wins, and that stop token replaces its sample.

        A sequence that verifies draft tokens (``req.spec_token_ids``) gets a row per
        verified position, consecutive (its id repeated in the result's ``seq_ids``): the
        grammar's mask after each prefix of its drafts (which its grammar accepts,
        :meth:`valid_draft_prefix`).

        The rows live in one buffer that the next call overwrites: a step's bitmask is
        read by that step's sampling, and the next step's fill waits for that step's
        tokens (``EngineCore.step``), so no copy and no fresh 4 MB per step (256 rows of
        a 128K vocabulary).
        """
        import xgrammar as xgr

        spec = [sid for sid in seq_ids if sid in requests and requests[sid].spec_token_ids]
        if spec:
            return self._bitmask_with_drafts(seq_ids, requests, set(spec))
        bitmask = self._rows(len(seq_ids))
        matchers, rows, allow_all, below_min = [], [], [], []
        live = []
        for row, sid in enumerate(seq_ids):
            req = requests.get(sid)
            matcher = None
            if req is not None and not req.structured_output.finished:
                so = req.structured_output
                # Only its first use creates a matcher (and may fail): no guard per step after.
                matcher = so._matcher if so._matcher is not None else self._guarded(req, None, lambda: so.matcher)
            if matcher is not None:
                matchers.append(matcher)
                rows.append(row)
                live.append(req)
                # Tokens before this sample: the host's, plus the samples in flight but this one.
                if req.sampling_params.min_tokens > len(req.output_token_ids) + req.num_output_placeholders - 1:
                    below_min.append((row, req))
            else:
                allow_all.append(row)
        # xgrammar writes whole rows: only the others need resetting (no 4 MB memset per step).
        if allow_all:
            bitmask[allow_all] = -1
        if matchers:
            threads = max(1, min(envs.TANDEM_STRUCTURED_OUTPUT_THREADS, len(matchers) // _ROWS_PER_THREAD))
            filler = self._batch_matchers.get(threads)
            if filler is None:
                filler = self._batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
            try:
                filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)
            except Exception:  # noqa: BLE001 - one sequence's matcher: redone one by one
                for req, matcher, row in zip(live, matchers, rows):
                    self._guarded(req, None, matcher.fill_next_token_bitmask, bitmask, row)
                    if req.structured_output.failure is not None:
                        bitmask[row] = -1
        for row, req in below_min:
            so = req.structured_output
            if so.failure is None:
                so.forced_stop = self._guarded(req, None, self._only_stop, bitmask[row], so.matcher)
        return GrammarBitmask(seq_ids, bitmask)

    def _bitmask_with_drafts(self, seq_ids: list[int], requests: dict[int, "Request"],
                             spec: set[int]) -> GrammarBitmask:
        """:meth:`grammar_bitmask` of a step with verifying sequences ``spec``: theirs row by
        row (each draft accepted, then all rolled back), the others in one batched fill."""
        plain = [sid for sid in seq_ids if sid not in spec]
        base = self.grammar_bitmask(plain, requests).bitmask.clone() if plain else None
        rows_of = {sid: 1 + len(requests[sid].spec_token_ids) for sid in spec}
        out_ids = [sid for sid in seq_ids for _ in range(rows_of.get(sid, 1))]
        bitmask = self._rows(len(out_ids))
        row, plain_row = 0, 0
        for sid in seq_ids:
            if sid not in spec:
                bitmask[row] = base[plain_row]
                row, plain_row = row + 1, plain_row + 1
                continue
            req = requests[sid]
            n = rows_of[sid]
            if not req.structured_output.finished:
                self._guarded(req, None, self._fill_draft_rows, req, bitmask, row)
            if req.structured_output.finished:  # ended, or its matcher failed just now
                bitmask[row:row + n] = -1
            row += n
        return GrammarBitmask(out_ids, bitmask)

    @staticmethod
    def _fill_draft_rows(req: "Request", bitmask: torch.Tensor, row: int) -> None:
        """Fill ``req``'s rows from ``row`` on: its mask after each prefix of its drafts."""
        matcher, drafts = req.structured_output.matcher, req.spec_token_ids
        matcher.fill_next_token_bitmask(bitmask, row)
        for j, tok in enumerate(drafts):
            matcher.accept_token(tok)
            matcher.fill_next_token_bitmask(bitmask, row + 1 + j)
        matcher.rollback(len(drafts))

    def _guarded(self, req: "Request", default, fn, *args):
        """``fn(*args)``, or ``default`` once ``req``'s matcher raised: the sequence is then
        finished with the error (``structured_output.failure``; the scheduler ends it as
        "abort") and its grammar is not asked again."""
        so = req.structured_output
        if so.failure is not None:
            return default
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - this sequence's fault: it ends, the others go on
            so.failure, so.finished = f"grammar matcher failed: {xgrammar_error(e)}", True
            logger.error("request %s: %s; finishing it", req.request_id, so.failure)
            return default

    def _only_stop(self, row: torch.Tensor, matcher: "xgr.GrammarMatcher") -> int | None:
        """The first stop token ``row`` allows when it allows no other token, else None."""
        if not matcher.is_completed():
            return None
        words = row.numpy().view(np.uint32).copy()
        stops = [t for t in self._grammar_stop_ids if words[t >> 5] >> (t & 31) & 1]
        for t in stops:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return min(stops) if stops and not words.any() else None

    def _rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the reused bitmask buffer (contents undefined)."""
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = torch.empty(n, -(-self.vocab_size // 32), dtype=torch.int32, pin_memory=self.pin_memory)
        return self._bitmask[:n]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------------- compile thread
    def _compile(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar":
        compiler = self._get_compiler()
        kind = params.kind
        if kind == "json":
            return compiler.compile_json_schema(params.schema_text(), **params.json_options())
        if kind == "json_object":
            return compiler.compile_json_schema(ANY_OBJECT, strict_mode=False, **params.json_options())
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(params.choice_ebnf())
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_structural_tag(params.structural_tag)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            if isinstance(self.tokenizer, str):
                from tandem.model_loader.loader import load_tokenizer

                self.tokenizer = load_tokenizer(self.tokenizer)
            stop = set(self.stop_token_ids)
            if self.tokenizer.eos_token_id is not None:
                stop.add(self.tokenizer.eos_token_id)
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(stop) or None)
            self._grammar_stop_ids = frozenset(info.stop_token_ids)
            # No cache of xgrammar's own: it has no bound by default and would keep every
            # grammar the bounded cache of this manager has let go.
            self._compiler = xgr.GrammarCompiler(info, max_threads=envs.TANDEM_STRUCTURED_OUTPUT_THREADS,
                                                 cache_enabled=False)
        return self._compiler
