"""Incremental detokenization and stop-string matching, one instance per sequence.

The output processor feeds each sequence's newly sampled token ids into its
:class:`IncrementalDetokenizer`, which turns them into text and watches that text for the
request's stop strings. The design follows vLLM's v1 ``FastIncrementalDetokenizer`` /
``StopChecker``: decoding is delegated to the ``tokenizers`` library's
:class:`tokenizers.decoders.DecodeStream` (which buffers tokens until they form complete
UTF-8 characters and keeps just enough preceding ids as context, so each step costs
O(chunk) rather than O(sequence)), and stop strings are searched on the accumulated text,
across token boundaries.

Guarantees (checked by ``tests/engine/test_detokenizer.py``):

* The concatenation of all released text equals the text that the output ids add to the
  decoded prompt context, i.e. ``decode(ctx + out)[len(decode(ctx)):]`` where ``ctx`` is a
  short tail of the prompt. For byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) and
  for an empty prompt that is exactly ``tokenizer.decode(out, skip_special_tokens=...,
  clean_up_tokenization_spaces=False)``; for SentencePiece-style (Metaspace) tokenizers it
  keeps the leading space of the first generated word that a standalone decode would drop
  (``" Paris"`` after ``"The capital of France is"``), as in vLLM.
  The only known exception is adversarial ids for byte-fallback tokenizers: a run of
  ``<0x..>`` tokens that is invalid UTF-8 *as a whole* after a valid prefix of it was already
  released (the ``ByteFallback`` decoder then turns *every* byte of the run into U+FFFD);
  the already released prefix is kept and decoding resumes after it.
* Released text never contains any part of a stop string (unless
  ``include_stop_str_in_output``): text that could still be the beginning of a stop string
  is held back (at most ``len(longest stop) - 1`` characters) until it can no longer match or
  the sequence finishes. On a match the text is cut right before the stop string (right after
  it with ``include_stop_str_in_output``) and nothing after it is ever released.
* Stop regexes (SGLang's ``stop_regex``) likewise: text from the first place where a match
  could still begin (a partial match that reaches the end of the text, the ``regex``
  module's ``partial=True``) is held back; the leftmost match of a pattern ends the
  sequence, the text cut as at a stop string. A pattern like ``<.*>`` holds back
  everything from its first ``<`` until it matches or the sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import regex
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT_CHAR = "\ufffd"
# The prompt tail used as decoding context is at most this many tokens long.
_MAX_PROMPT_CONTEXT_TOKENS = 16


def _backend_tokenizer(tokenizer) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            "IncrementalDetokenizer needs a Hugging Face fast tokenizer (backed by the "
            f"`tokenizers` library) or a `tokenizers.Tokenizer`; got {type(tokenizer).__name__}"
        )
    return backend


def _select_prompt_context(backend: Tokenizer, prompt_token_ids: Sequence[int],
                           skip_special_tokens: bool) -> list[int]:
    """Shortest prompt tail that decodes to non-empty text free of U+FFFD, else ``[]``.

    The context gives the first generated token what precedes it: SentencePiece decoders strip
    the leading space of the first token of a decode, which is wrong for the first generated
    word after a prompt. A tail with U+FFFD (a character cut at the tail's start or end) is not
    used, so prompt bytes never leak into the output.
    """
    n_max = min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT_TOKENS)
    for n in range(1, n_max + 1):
        tail = [int(t) for t in prompt_token_ids[-n:]]
        text = backend.decode(tail, skip_special_tokens=skip_special_tokens)
        if text and _REPLACEMENT_CHAR not in text:
            return tail
    return []


def _is_invalid_prefix_error(exc: Exception) -> bool:
    return str(exc).startswith("Invalid prefix")


class _Stream:
    """``DecodeStream`` plus a mirror of its window, for flushing and error recovery.

    ``DecodeStream`` releases a chunk only when the decoded window does not end with U+FFFD; the
    ids of a trailing incomplete character (or of a genuine trailing U+FFFD) stay pending inside
    it. :meth:`flush` decodes them with the same context the stream would use.
    """

    def __init__(self, backend: Tokenizer, context_ids: list[int], skip_special_tokens: bool):
        self._backend = backend
        self._skip = skip_special_tokens
        self._stream, self._step_takes_lists = self._new_stream(context_ids)
        # Ids whose decode is the stream's current "prefix" (the last released chunk) and ids
        # stepped since that chunk without releasing text.
        self._chunk_ids: list[int] = list(context_ids)
        self._pending_ids: list[int] = []

    def _new_stream(self, context_ids: list[int]) -> tuple[DecodeStream, bool]:
        try:  # tokenizers >= 0.22: prefill ids, step() accepts a list
            return DecodeStream(ids=list(context_ids), skip_special_tokens=self._skip), True
        except TypeError:  # older tokenizers: prime by stepping and discarding the text
            stream = DecodeStream(skip_special_tokens=self._skip)
            for tid in context_ids:
                stream.step(self._backend, tid)
            return stream, False

    def _raw_step(self, stream: DecodeStream, ids: list[int], takes_lists: bool) -> str | None:
        if takes_lists:
            return stream.step(self._backend, ids)
        out = [stream.step(self._backend, tid) for tid in ids]
        parts = [p for p in out if p is not None]
        return "".join(parts) if parts else None

    def step(self, ids: list[int]) -> str:
        """Text released by the stream for ``ids`` ("" while a character is incomplete)."""
        try:
            if self._step_takes_lists:  # the common case, one call less per token
                text = self._stream.step(self._backend, ids)
            else:
                text = self._raw_step(self._stream, ids, False)
        except Exception as exc:  # noqa: BLE001 - narrowed right below
            if not _is_invalid_prefix_error(exc):
                raise
            # The decoder is not prefix-stable here (byte-fallback run that turned invalid,
            # vLLM issue #17448): restart without context from the not yet released ids.
            ids = self._pending_ids + ids
            self._pending_ids = []
            self._chunk_ids = []
            self._stream, self._step_takes_lists = self._new_stream([])
            text = self._raw_step(self._stream, ids, self._step_takes_lists)
        if text is None:
            self._pending_ids.extend(ids)
            return ""
        if self._pending_ids:
            self._chunk_ids = self._pending_ids + ids
            self._pending_ids = []
        else:  # the common case: no list built per token
            self._chunk_ids = ids
        return text

    def flush(self) -> str:
        """Text of the pending ids, incomplete characters decoded as U+FFFD; then no pending."""
        if not self._pending_ids:
            return ""
        dec = self._backend.decode
        prefix = dec(self._chunk_ids, skip_special_tokens=self._skip)
        full = dec(self._chunk_ids + self._pending_ids, skip_special_tokens=self._skip)
        if full.startswith(prefix):
            text = full[len(prefix):]
        else:  # not prefix-stable (see step()): decode the pending ids on their own
            text = dec(self._pending_ids, skip_special_tokens=self._skip)
        self._chunk_ids = self._chunk_ids + self._pending_ids
        self._pending_ids = []
        return text


class IncrementalDetokenizer:
    """Per-sequence incremental detokenizer + stop-string matcher.

    Args:
        tokenizer: a Hugging Face fast tokenizer (``PreTrainedTokenizerFast`` /
            ``TokenizersBackend``) or a ``tokenizers.Tokenizer``. Slow (pure Python)
            tokenizers raise ``TypeError``.
        prompt_token_ids: the request's prompt ids; only a short tail is used, as decoding
            context for the first generated tokens.
        skip_special_tokens: drop special tokens (e.g. ``<|im_end|>``) from the text.
        spaces_between_special_tokens: accepted for API compatibility. Like Hugging Face fast
            tokenizers, the backend's decoder alone decides the spacing (byte-level BPE and
            SentencePiece decoders insert no spaces between special tokens).
        stop: stop strings; empty strings are ignored.
        include_stop_str_in_output: keep the matched stop string (or regex match) at the
            end of the text.
        stop_regex: regular expressions (Python's dialect) that stop the sequence as stop
            strings do; :meth:`update` returns the pattern that matched.

    Typical use by the output processor, once per step and sequence::

        stop_str = detok.update(new_ids, stop_terminated=finishing_for_other_reason)
        finished = finishing_for_other_reason or stop_str is not None
        text = detok.get_next_output_text(finished, delta=stream_deltas)

    Note that the text of every id passed to :meth:`update` is decoded: a caller that wants an
    EOS/stop token's text out of the output (with ``skip_special_tokens=False``) does not pass
    that id.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, stop_regex: Sequence[str] | None = None) -> None:
        backend = _backend_tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        if isinstance(stop, str):
            stop = [stop]
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.stop_regex: list[regex.Pattern] = [regex.compile(p) for p in (stop_regex or [])]
        # A regex match counts only if it ends at or after this: text fed with
        # check_stop=False (before min_tokens) must not end one, as it ends no stop string.
        self._regex_min_end = 0

        context = _select_prompt_context(backend, prompt_token_ids, skip_special_tokens)
        self._stream = _Stream(backend, context, skip_special_tokens)
        self._text = ""          # decoded text so far (cut at a matched stop string)
        self._released = 0       # self._text[:self._released] is released
        self._delta_offset = 0   # end of the text returned by the last delta call
        self._finished = False
        #: The stop string (or stop regex pattern) that ended the sequence, if any.
        self.matched_stop_str: str | None = None

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """Text released so far (never any part of a stop string, unless included)."""
        return self._text[:self._released]

    @property
    def finished(self) -> bool:
        """True once a stop string matched or the sequence was terminated/finished."""
        return self._finished

    def update(self, new_token_ids: list[int], stop_terminated: bool, *,
               check_stop: bool = True) -> str | None:
        """Feed newly generated token ids.

        Returns the matched stop string, or the pattern of the matched stop regex, if one
        was found (the request must then finish with finish_reason "stop", stop_reason =
        that string), else None.
        ``stop_terminated`` is True when the engine is finishing the sequence for another reason
        (EOS, stop token, length) with these tokens: then no text is held back any more
        (incomplete characters are decoded as U+FFFD). ``check_stop=False`` (e.g. before
        ``min_tokens`` are generated) skips stop-string matching for this update's text; text is
        still held back, and a stop string that starts in it but ends in a later update's text
        still matches. Once finished, further calls are ignored and return None.
        """
        if self._finished:
            return None
        old_len = len(self._text)
        if new_token_ids:
            self._text += self._stream.step([int(t) for t in new_token_ids])
        if stop_terminated:
            self._text += self._stream.flush()
        if not self.stop and not self.stop_regex:  # nothing to match or hold back
            self._released = len(self._text)
            self._finished = stop_terminated
            return None

        matched = self._match_stop(old_len) if check_stop else None
        regex_matched, regex_hold = self._scan_regexes(check_stop)
        if regex_matched is not None and (matched is None or regex_matched[:2] < matched[:2]):
            matched = regex_matched
        if matched is not None:
            end, start, stop_str = matched
            self._text = self._text[:end if self.include_stop_str_in_output else start]
            self._released = len(self._text)
            self._finished = True
            self.matched_stop_str = stop_str
            return stop_str
        if not check_stop:
            self._regex_min_end = len(self._text) + 1

        if stop_terminated:
            self._released = len(self._text)
            self._finished = True
        else:
            held_from = min(len(self._text) - self._num_chars_held(), regex_hold)
            self._released = max(self._released, held_from)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to put into the next RequestOutput.

        ``delta=False``: the whole released text; ``delta=True``: only the text released since
        the last call with ``delta=True``. ``finished=True`` first releases everything still
        held back (as ``update([], stop_terminated=True)`` would).
        """
        if finished and not self._finished:
            self.update([], stop_terminated=True)
        end = self._released
        if not delta:
            return self._text[:end]
        start = self._delta_offset
        if start >= end:
            return ""
        self._delta_offset = end
        return self._text[start:end]

    # ------------------------------------------------------------------ internals

    def _match_stop(self, old_len: int) -> tuple[int, int, str] | None:
        """First stop string completed in the text added after ``old_len`` chars, as
        ``(end, start, stop string)``.

        Only matches ending after ``old_len`` are new, so each stop string is searched from
        ``old_len - len(stop) + 1``. Among several, the one that ends first wins (the one a
        character-by-character stream would have completed first); on a tie, the one that
        starts first.
        """
        if not self.stop or len(self._text) == old_len:
            return None
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = self._text.find(s, max(0, old_len - len(s) + 1))
            if start != -1:
                cand = (start + len(s), start, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        return best

    def _scan_regexes(self, check: bool) -> tuple[tuple[int, int, str] | None, int]:
        """``(match, hold)`` of the stop regexes on the text not yet released.

        ``match``: ``(end, start, pattern)``: of each pattern's leftmost match that counts
        (``check``, and ending at or after ``_regex_min_end``), the one that ends first (then
        starts first), else None. ``hold``: where the first partial match begins (text from
        there may still become a match), else the text's length.
        """
        text, hold, best = self._text, len(self._text), None
        for pattern in self.stop_regex:
            # One match per start position (overlapped): a partial one at i does not hide a
            # complete one at i + 1.
            for m in pattern.finditer(text, self._released, overlapped=True, partial=True):
                if m.partial:
                    hold = min(hold, m.start())
                elif check and m.end() >= self._regex_min_end:
                    cand = (m.end(), m.start(), pattern.pattern)
                    if best is None or cand[:2] < best[:2]:
                        best = cand
                    break
        return best, hold

    def _num_chars_held(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            for s in self.stop:
                if len(s) > k and s.startswith(tail):
                    return k
        return 0
