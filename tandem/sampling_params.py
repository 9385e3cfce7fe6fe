"""Sampling parameters with vLLM / OpenAI semantics."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import regex

from tandem.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def child_seed(seed: int, index: int) -> int:
    """Seed of completion ``index`` of a request seeded ``seed``: ``seed + index``, wrapped
    into the signed 64-bit range."""
    return (seed + index - _INT64_MIN) % 2**64 + _INT64_MIN


# vLLM's values of the fields a request may leave unset (None) when neither the request nor
# the model's generation_config.json gives one.
UNSET_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                  "repetition_penalty": 1.0}


def _check_stop_regex(pattern: Any) -> None:
    """Raise ValueError (naming ``stop_regex``) unless ``pattern`` compiles and cannot match
    the empty string: a pattern that can would end every sequence before its first
    character."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"stop_regex must contain non-empty strings, got {pattern!r}.")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}.") from None
    if compiled.fullmatch("") is not None:
        raise ValueError(f"stop_regex {pattern!r} matches the empty string, which would stop at once.")


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries."""

    CUMULATIVE = 0  # all text/tokens so far
    DELTA = 1  # only what is new since the previous output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Attributes follow vLLM's ``SamplingParams``: ``n`` completions; ``temperature`` 0 means
    greedy; ``top_k`` <= 0 or -1 disables; ``top_p`` in (0, 1]; ``min_p`` in [0, 1];
    ``seed`` makes the request's random stream independent of the batch;
    ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (OpenAI) act on generated
    tokens, ``repetition_penalty`` > 0 (CTRL, Keskar et al. 2019) on prompt and generated
    tokens; ``logit_bias`` maps token id -> bias added to the logit; ``max_tokens`` None
    means up to the context length; ``stop`` strings are matched on the detokenized text;
    ``stop_regex`` (SGLang's) are regular expressions (Python's dialect, the ``regex``
    module) matched on the detokenized text like ``stop`` strings: the first match ends the
    sequence, cut before the match (after it with ``include_stop_str_in_output``), its
    pattern the ``stop_reason``; ``logprobs`` = number of top logprobs per generated token (the sampled token is always
    included), ``prompt_logprobs`` likewise per prompt token; ``seed`` is a signed 64-bit
    integer. vLLM extensions: ``allowed_token_ids`` restricts sampling to those ids;
    ``bad_words`` are never generated (each word with and without a leading space: its
    last token is masked when the tokens before it were just generated).

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` default to
    None, "unset": the engine fills them from the model's ``generation_config.json``
    (``ModelConfig.generation_config``), else with vLLM's defaults (``UNSET_DEFAULTS``:
    1.0, 1.0, 0, 0.0, 1.0), as vLLM's OpenAI server does (:meth:`with_defaults`).

    ``structured_outputs`` constrains the output (JSON schema, regex, choice, grammar; a
    dict is taken as the keyword arguments of :class:`StructuredOutputsParams`).

    Raises:
        ValueError: on an invalid value; the message names the field.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: EOS ids of the model, unless ignore_eos.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine (update_from_tokenizer): token ids of each bad word variant.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_regex = [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map integer token ids to floats, got {self.logit_bias!r}") from e
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify()

    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is None and name in UNSET_DEFAULTS:
                continue
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), name,
                  "must be a finite number")
        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        v = self._value
        check(v("temperature") >= 0.0, "temperature", "must be non-negative")
        check(0.0 < v("top_p") <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(v("top_k"), int) and v("top_k") >= -1, "top_k", "must be -1 (disable), 0 (disable), or a positive integer")
        check(0.0 <= v("min_p") <= 1.0, "min_p", "must be in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(v("repetition_penalty") > 0.0, "repetition_penalty", "must be greater than zero")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens", "must be at least 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs", "must be a non-negative integer")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0), "prompt_logprobs", "must be a non-negative integer")
        check(self.seed is None or (isinstance(self.seed, int) and _INT64_MIN <= self.seed <= _INT64_MAX), "seed",
              "must be a signed 64-bit integer")
        check(self.allowed_token_ids is None or (bool(self.allowed_token_ids) and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
              "must be a non-empty list of non-negative integers")
        check(self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
              "must contain non-empty strings")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must contain non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must contain non-negative integers")
        for pattern in self.stop_regex:
            _check_stop_regex(pattern)
        if self.logit_bias:
            check(all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias", "values must be in [-100, 100]")

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary.

        Raises:
            ValueError: a logit_bias or stop_token_ids entry is outside ``[0, vocab_size)``.
        """
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias contains token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}.")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or [] if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}.")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize ``bad_words`` into ``bad_words_token_ids`` (vLLM's rule): each word
        alone and, when that tokenizes differently, after a space (a word inside a text),
        without special tokens."""
        self.bad_words_token_ids = []
        for word in self.bad_words or []:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            self.bad_words_token_ids.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                self.bad_words_token_ids.append(spaced)

    def _value(self, name: str) -> Any:
        value = getattr(self, name)
        return UNSET_DEFAULTS[name] if value is None else value

    def with_defaults(self, defaults: Mapping[str, Any] | None = None) -> "SamplingParams":
        """A copy whose unset fields (None) take ``defaults`` (the model's
        generation_config.json values, by SamplingParams field name), else vLLM's
        ``UNSET_DEFAULTS``; fields the request set are kept.

        Raises:
            ValueError: a default is out of its field's range (the message names the field).
        """
        defaults = defaults or {}
        changes = {name: defaults.get(name, fallback) for name, fallback in UNSET_DEFAULTS.items()
                   if getattr(self, name) is None}
        return self.clone(**changes) if changes else self.clone()

    @property
    def greedy(self) -> bool:
        return self._value("temperature") < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self._value("repetition_penalty") != 1.0

    def clone(self, **changes) -> "SamplingParams":
        return replace(self, **changes)
