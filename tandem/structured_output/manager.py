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
2. ``grammar_bitmask`` (core thread) fills one bitmask row per constrained sequence
   of a step from its matcher's state, after the previous step's tokens were accepted.
3. ``StructuredOutputRequest.accept_token`` (``Scheduler.update_from_output``, the core's
   output update) advances the matcher by each sampled token.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from tandem.structured_output.bitmask import GrammarBitmask
from tandem.structured_output.params import StructuredOutputsParams, xgrammar_error

if TYPE_CHECKING:
    import xgrammar as xgr

    from tandem.request import Request

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (most recently used first out).
_CACHE_SIZE = 256


class StructuredOutputRequest:
    """One sequence's grammar: a compile future, then a matcher of its own.

    Args:
        compiled: resolves to an ``xgrammar.CompiledGrammar``.
    """

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None

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

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar accepted a complete output (and its stop token)."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    """Compiles constraints off the engine loop and builds each step's bitmask.

    Args:
        tokenizer: the model's HF tokenizer, or the path to load it from (on the compile
            thread, at the first constrained request: a core needs no tokenizer otherwise).
        vocab_size: logits width (may exceed the tokenizer's size: padded vocabularies).
        stop_token_ids: tokens that end a complete output (the model's EOS ids; the
            tokenizer's EOS is added).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
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
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        req.structured_output = StructuredOutputRequest(fut)
        self._pending.append(req)

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

    def grammar_bitmask(self, seq_ids: list[int], requests: dict[int, "Request"]) -> GrammarBitmask:
        """The bitmask rows of ``seq_ids`` (``int32 [len(seq_ids), ceil(V / 32)]``, host).

        A sequence no longer in ``requests`` (finished by the step processed meanwhile)
        gets an all-allowed row: its sampled token is discarded.
        """
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(seq_ids), self.vocab_size)
        for row, sid in enumerate(seq_ids):
            req = requests.get(sid)
            if req is not None:
                req.structured_output.fill_bitmask(bitmask, row)
        return GrammarBitmask(seq_ids, bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------------- compile thread
    def _compile(self, params: StructuredOutputsParams) -> "xgr.CompiledGrammar":
        compiler = self._get_compiler()
        kind = params.kind
        if kind == "json":
            return compiler.compile_json_schema(params.schema_text(), any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
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
            self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
        return self._compiler
