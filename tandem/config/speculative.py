"""Speculative decoding (vLLM's ``SpeculativeConfig``), given as one JSON object:
``--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`` or
``LLM(speculative_config={...})``.

Methods: ``"ngram"`` (prompt lookup), ``"draft_model"`` (a smaller model of the same
vocabulary, ``"model": PATH``), ``"eagle"`` and ``"eagle3"`` (a head over the target's
hidden states trained for it, ``"model": FOLDER`` in the public Hugging Face layout). A step
with drafts is taken in before the next is scheduled (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Methods whose drafts come from a model run by the worker after each step.
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# vLLM's prompt-lookup n when neither bound is given.
_DEFAULT_PROMPT_LOOKUP = 5
# Batch size above which drafts cost more than they save: benchmarks/RESULTS.md, "Stop 45".
DEFAULT_DISABLE_BY_BATCH_SIZE = 1


@dataclass
class SpeculativeConfig:
    """Speculative decoding: draft tokens proposed each decode step and verified by the
    model in one forward (docs/architecture.md)."""

    method: str | None = None
    """How drafts are proposed: "ngram" (prompt lookup in the request's own tokens),
    "draft_model" (greedy tokens of the smaller model ``model``), "eagle" / "eagle3" (greedy
    tokens of the EAGLE / EAGLE-3 head ``model``). Unset, it follows from ``model`` as in
    vLLM ("ngram" for ``"model": "ngram"``, a folder name with "eagle3" / "eagle-" that
    method, else "draft_model")."""

    model: str | None = None
    """The draft model or head (required with every method but "ngram", refused with it): a
    draft model is a GGUF file or a Hugging Face folder of the target's tokenizer; an EAGLE
    head a Hugging Face folder (config.json and safetensors or pytorch_model.bin)."""

    num_speculative_tokens: int | None = None
    """Draft tokens proposed per request and step (K >= 1; required)."""

    prompt_lookup_min: int | None = None
    """Shortest n-gram looked up in the request's history (>= 1; default: prompt_lookup_max,
    or 5 when both are unset, as vLLM)."""

    prompt_lookup_max: int | None = None
    """Longest n-gram looked up (>= prompt_lookup_min; default: prompt_lookup_min, or 5)."""

    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    """Speculate only while at most this many requests are running (>= 1; None: always;
    default 1: above one, drafts cost more than they save on the machines measured). Above
    it, steps run without drafts. With ``async_output_proc`` every step runs one step ahead
    but those that need their drafts on the host (n-gram, or while a grammar runs)."""

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self._infer_method()
        if self.method not in METHODS:
            omitted = "; or leave it out and give speculative_config.model, which it is inferred from" \
                if self.method is None else ""
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}{omitted}.")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config.num_speculative_tokens is required: how many draft tokens to "
                             'propose per step, e.g. {"num_speculative_tokens": 4}.')
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}.")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1 or null, got {b!r}.")
        if self.uses_model:
            self._check_model()
        else:
            self._resolve_prompt_lookup()

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model the worker runs after each step (a draft model or an
        EAGLE head), with ``num_speculative_tokens`` lookahead KV slots per sequence."""
        return self.method in MODEL_METHODS

    def _infer_method(self) -> None:
        """vLLM's inference of ``method`` from ``model`` alone: "ngram" (or "[ngram]") is
        prompt lookup, a name with "eagle3" / "eagle-" in it that method, any other a draft
        model. Only the last path component counts (a folder named "eagle..." above a draft
        model does not make it a head)."""
        name = str(self.model)
        last = os.path.basename(os.path.normpath(name)).lower()
        if name in ("ngram", "[ngram]"):
            self.method, self.model = "ngram", None
        elif "eagle3" in last:
            self.method = "eagle3"
        elif "eagle-" in last:
            self.method = "eagle"
        else:
            self.method = "draft_model"

    def _check_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"speculative_config.model (the draft model's or head's path) is required with method "
                             f"{self.method!r}.")
        self.model = os.path.expanduser(self.model)
        if not os.path.exists(self.model):
            raise ValueError(f"speculative_config.model: no such file or folder: {self.model!r}.")
        if self.method != "draft_model" and not os.path.isdir(self.model):
            raise ValueError(f"speculative_config.model: an EAGLE head is a Hugging Face folder, got the file "
                             f"{self.model!r}.")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} is for method 'ngram', not {self.method!r}.")

    def _resolve_prompt_lookup(self) -> None:
        if self.model is not None:
            raise ValueError("speculative_config.model is not used by method 'ngram'.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = _DEFAULT_PROMPT_LOOKUP
        self.prompt_lookup_min = lo = hi if lo is None else lo
        self.prompt_lookup_max = hi = lo if hi is None else hi
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi}).")

    @classmethod
    def from_json(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config of a ``--speculative-config`` JSON string or an ``LLM(speculative_config=)``
        dict (None and ``{}``: speculation off).

        Raises:
            ValueError: invalid JSON, not an object, an unknown field, or a bad value
                (naming the field).
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        if not value:
            return None
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown} (supported: "
                             f"{[f.name for f in fields(cls)]}).")
        return cls(**value)
