"""Prompt forms the front end takes (vLLM's LLM.generate forms) and the errors for others."""

from __future__ import annotations

import pytest

from tandem.engine.processor import Processor, PromptError, parse_prompt


@pytest.mark.parametrize("prompt,want", [
    ("Hi there", ("Hi there", None)),
    ({"prompt": "Hi there"}, ("Hi there", None)),
    ([5, 6, 7], (None, [5, 6, 7])),
    ((5, 6, 7), (None, [5, 6, 7])),
    ({"prompt_token_ids": [5, 6, 7]}, (None, [5, 6, 7])),
    ({"prompt_token_ids": (5,)}, (None, [5])),
])
def test_accepted_forms(prompt, want):
    assert parse_prompt(prompt) == want


@pytest.mark.parametrize("prompt,match", [
    ({}, "exactly one of"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
    ({"prompt_token_ids": [1], "multi_modal_data": {}}, r"unsupported keys \['multi_modal_data'\]"),
    ({"prompt": [1, 2]}, "'prompt' must be a string"),
    ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list"),
    ({"prompt_token_ids": 3}, "'prompt_token_ids' must be a list"),
    (None, "prompt must be a string"),
    (7, "prompt must be a string"),
    (b"bytes", "prompt must be a string"),
])
def test_other_forms_name_the_field(prompt, match):
    with pytest.raises(ValueError, match=match):
        parse_prompt(prompt)


def _processor(max_model_len: int = 16, vocab_size: int = 100) -> Processor:
    from types import SimpleNamespace

    from tandem.config.resolved import ResolvedConfig
    from tandem.model_loader.generation_config import GenerationDefaults

    resolved = ResolvedConfig("float32", None, None, "cpu", max_model_len, 4, 64, 8, GenerationDefaults())
    ready = SimpleNamespace(resolved=resolved, vocab_size=vocab_size, eos_token_ids=[0])
    return Processor(SimpleNamespace(eos_token_id=None), ready)


@pytest.mark.parametrize("prompt,max_tokens,message", [
    ([], None, "{} must contain at least one token."),
    ([1] * 16, None, "However, your {} resulted in 16 tokens"),
    ([1] * 8, 10, "8 tokens in the {} + max_tokens 10 = 18 tokens. This model's maximum context length is 16 "
                  "tokens: reduce max_tokens to at most 8, or the length of the {}."),
    ([1, 100, {"x": 1}], None, "{} token ids outside the vocabulary [0, 100): [100, {{'x': 1}}]"),
])
def test_prompt_errors_name_the_prompt_as_the_caller_calls_it(prompt, max_tokens, message):
    """A server words them with its own field (chat: ``messages``)."""
    from tandem.sampling_params import SamplingParams

    with pytest.raises(PromptError) as e:
        _processor().process_inputs("r", prompt, SamplingParams(max_tokens=max_tokens), 0.0)
    assert message.format("prompt", "prompt") in str(e.value)
    assert message.format("messages", "messages") in str(e.value.for_field("messages"))


@pytest.mark.parametrize("prompt_len,max_tokens,param", [
    (8, 9, "max_tokens"), (15, 2, "max_tokens"), (16, None, "prompt"), (16, 1, "prompt"), (20, 4, "prompt")])
def test_context_overflow_is_the_prompts_fault_only_when_it_does_not_fit_alone(prompt_len, max_tokens, param):
    """``param``: the field a server names; the budget's field as the server calls it."""
    from tandem.sampling_params import SamplingParams

    with pytest.raises(PromptError) as e:
        _processor().process_inputs("r", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0.0)
    assert (e.value.param, e.value.request_field) == (param, param)
    chat = e.value.for_field("messages", "max_completion_tokens")
    assert chat.request_field == {"prompt": "messages", "max_tokens": "max_completion_tokens"}[param]
    if param == "max_tokens":
        assert str(chat).startswith("max_completion_tokens is too large: ") and "max_tokens" not in str(chat)
        assert f"at most {16 - prompt_len}," in str(chat)
