"""Front-end input processing: validate and tokenize once, then fan ``n`` out into core
requests (vLLM V1's ``Processor``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tandem.engine.messages import EngineCoreReady, EngineCoreRequest
from tandem.sampling_params import SamplingParams, child_seed

# Most top logprobs per position a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# The prompt forms vLLM's LLM.generate takes besides a string and a list of ids:
# TextPrompt {"prompt": str} and TokensPrompt {"prompt_token_ids": list[int]}.
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class PromptError(ValueError):
    """A prompt the engine cannot take: empty, over the context, with token ids outside the
    vocabulary, or one that fits alone but not with ``max_tokens``. The message calls the
    prompt ``field`` and the output budget ``max_tokens_field``; a server rewords it with :meth:`for_field` to name its own request
    fields (``messages`` for chat, as OpenAI's errors do; ``max_completion_tokens`` where a
    chat request sent that).

    Args:
        template: the message, with ``{field}`` / ``{max_tokens_field}`` (``str.format``)
            where the prompt / the budget is named.
        param: which input is at fault: ``"prompt"``, or ``"max_tokens"`` when the prompt
            alone fits the context (:func:`check_context_length` decides).

    Attributes:
        request_field: the field at fault as the message names it (``field`` or
            ``max_tokens_field``, by ``param``): a server's error ``param``.
    """

    def __init__(self, template: str, field: str = "prompt", param: str = "prompt",
                 max_tokens_field: str = "max_tokens") -> None:
        super().__init__(template.format(field=field, max_tokens_field=max_tokens_field))
        self.template = template
        self.param = param
        self.request_field = max_tokens_field if param == "max_tokens" else field

    def for_field(self, field: str, max_tokens_field: str = "max_tokens") -> PromptError:
        """The same error, the prompt called ``field`` and the budget ``max_tokens_field``."""
        return PromptError(self.template, field, self.param, max_tokens_field)


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Check that a prompt of ``num_prompt_tokens`` and ``max_tokens`` (None: whatever is
    left) fit in ``max_model_len``; the one place that decides which of the two is at fault.

    Raises:
        PromptError: ``param`` ``"prompt"`` when the prompt alone leaves no room for a
            completion token, else ``"max_tokens"`` when prompt + ``max_tokens`` exceed the
            context (the message gives the prompt's tokens, ``max_tokens``, the context and
            the most ``max_tokens`` that fits).
    """
    n = num_prompt_tokens
    if n >= max_model_len:
        raise PromptError(f"This model's maximum context length is {max_model_len} tokens. However, your {{field}} "
                          f"resulted in {n} tokens, which leaves no room for completion tokens.")
    if max_tokens is not None and n + max_tokens > max_model_len:
        # The field first, as every message that names one (the server's param rule).
        raise PromptError(f"{{max_tokens_field}} is too large: {n} tokens in the {{field}} + {{max_tokens_field}} "
                          f"{max_tokens} = {n + max_tokens} tokens. This model's maximum context length is "
                          f"{max_model_len} tokens: reduce {{max_tokens_field}} to at most {max_model_len - n}, "
                          f"or the length of the {{field}}.", param="max_tokens")


def parse_prompt(prompt: str | Sequence[int] | Mapping) -> tuple[str | None, list[int] | None]:
    """``(text, None)`` for a string or ``{"prompt": str}``, ``(None, ids)`` for a sequence
    of token ids or ``{"prompt_token_ids": [...]}`` (vLLM's TextPrompt / TokensPrompt).

    Raises:
        ValueError: any other type, a dict with unknown keys or not exactly one of the two,
            or a value of the wrong type (the message names the field).
    """
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
        given = [k for k in _PROMPT_KEYS if k in prompt]
        if unknown or len(given) != 1:
            raise ValueError(f"prompt: a dict needs exactly one of {list(_PROMPT_KEYS)}"
                             + (f"; unsupported keys {unknown}" if unknown else f", got {given}"))
        key = given[0]
        value = prompt[key]
        if key == "prompt" and not isinstance(value, str):
            raise ValueError(f"prompt: 'prompt' must be a string, got {type(value).__name__}")
        if key == "prompt_token_ids" and (isinstance(value, (str, bytes)) or not isinstance(value, Sequence)):
            raise ValueError(f"prompt: 'prompt_token_ids' must be a list of token ids, got {type(value).__name__}")
        prompt = value
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string, a list of token ids or a dict with one of {list(_PROMPT_KEYS)}, "
                     f"got {type(prompt).__name__}")


class Processor:
    """Checks requests against the limits a core announced (:class:`EngineCoreReady`).

    Args:
        tokenizer: the front end's tokenizer (text prompts).
        ready: the core's handshake (vocabulary, the model config's EOS ids, and in
            ``resolved`` the context length and the model's generation_config.json: EOS ids,
            and the values of sampling fields a request leaves unset).

    The EOS ids are the tokenizer's EOS token, the config's and generation_config.json's
    (transformers' ``generate`` stops on any of the generation config's).
    """

    def __init__(self, tokenizer, ready: EngineCoreReady) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = ready.resolved.max_model_len
        self.vocab_size = ready.vocab_size
        self.generation_defaults = ready.resolved.generation_defaults
        self.eos_token_ids = set(ready.eos_token_ids) | set(self.generation_defaults.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)

    def default_sampling_params(self) -> SamplingParams:
        """The sampling values a request gets for the fields it leaves unset (vLLM's
        ``LLM.get_default_sampling_params``): the model's generation_config.json, else
        vLLM's defaults."""
        return SamplingParams().with_defaults(self.generation_defaults.sampling)

    def process_inputs(self, request_id: str, prompt: str | Sequence[int] | Mapping, params: SamplingParams | None,
                       arrival_time: float) -> tuple[str | None, list[EngineCoreRequest]]:
        """The prompt text (None for token ids) and one core request per completion; the
        ``i``-th of ``n > 1`` is ``f"{i}_{request_id}"`` with seed ``child_seed(seed, i)``.

        Raises:
            PromptError: empty prompt, prompt + max_tokens over the context
                (:func:`check_context_length`), token ids outside the vocabulary.
            ValueError: bad sampling values (the message names the field).
        """
        defaults = self.generation_defaults.sampling
        params = (params or SamplingParams()).with_defaults(defaults)
        params.verify_vocab(self.vocab_size)
        params.update_from_tokenizer(self.tokenizer)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}.")
        text, ids = parse_prompt(prompt)
        if ids is None:
            ids = self.tokenizer.encode(text)
        # Text too: a tokenizer larger than the model's vocabulary (e.g. --tokenizer beside a
        # dummy config) must not crash the engine.
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            # Braces doubled: the ids are text of the template (a non-int id may print with braces).
            shown = str(bad[:8]).replace("{", "{{").replace("}", "}}")
            raise PromptError(f"{{field}} token ids outside the vocabulary [0, {self.vocab_size}): {shown}")
        if not ids:
            raise PromptError("{field} must contain at least one token.")
        max_len = self.max_model_len
        check_context_length(len(ids), params.max_tokens, max_len)
        if params.max_tokens is None:  # up to the context, or the model's max_new_tokens
            max_tokens = min(max_len - len(ids), defaults.get("max_tokens", max_len))
        else:
            max_tokens = params.max_tokens
        if not params.ignore_eos:
            params.all_stop_token_ids = set(self.eos_token_ids)
        if params.n == 1:
            return text, [EngineCoreRequest(request_id, ids, params, max_tokens, arrival_time)]
        reqs = []
        for i in range(params.n):
            child = params.clone(n=1, seed=None if params.seed is None else child_seed(params.seed, i))
            reqs.append(EngineCoreRequest(f"{i}_{request_id}", ids, child, max_tokens, arrival_time))
        return text, reqs


__all__ = ["MAX_LOGPROBS", "Processor", "PromptError", "check_context_length"]
