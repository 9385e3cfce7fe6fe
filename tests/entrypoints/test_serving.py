"""A streamed chat choice's tool-call deltas (``serving_chat.ToolCallStream``) against
``ToolPlan.split`` of the whole text, for every tool_choice and any split into deltas;
SGLang's ``matched_stop``; the request's sampling fields in its SamplingParams. The chunks'
wire format: test_stream_chunks.py."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.serving_chat import ToolCallStream
from tandem.entrypoints.openai.serving_engine import REQUEST_SAMPLING_FIELDS, OpenAIServingBase, matched_stop
from tandem.sampling_params import RequestOutputKind
from tandem.entrypoints.openai.structured_outputs import tool_plan

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
HERMES = ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n\n'
          '<tool_call>{"name": "g", "arguments": {}}</tool_call>\n')
ARRAY = '[\n  {"name": "f", "parameters": {"x": 1}},\n  {"name": "g", "parameters": {}}\n]'
CASES = [
    ("auto", None, HERMES), ("auto", False, HERMES), ("auto", None, HERMES[:70]),
    ("required", None, ARRAY), ("required", False, ARRAY[:45]), ("required", None, ARRAY[:60]),
    ({"type": "function", "function": {"name": "g"}}, None, '{\n "y": 2}'),
]


def _streamed(plan, text: str, size: int):
    """(joined content or None, [(name, arguments)], the delta of each call's first
    piece) from feeding ``text`` in pieces of ``size`` characters."""
    ts = ToolCallStream(plan, "hermes")
    content, calls, first_at = None, {}, []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        delta, _ = ts.delta(piece, i == len(pieces) - 1)
        if delta.content is not None:
            # Beside tool calls, whitespace alone is no content (it goes with text that follows).
            assert delta.content.strip(), f"whitespace-only content {delta.content!r}"
            content = (content or "") + delta.content
        for t in delta.tool_calls or []:
            if t.index not in calls:
                first_at.append(i)
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments
    return content, [tuple(calls[k]) for k in sorted(calls)], first_at


@pytest.mark.parametrize("choice, parallel, text", CASES)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_tool_calls_equal_whole(choice, parallel, text, size):
    plan = tool_plan(P.ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                             tool_choice=choice, parallel_tool_calls=parallel))
    content, calls = plan.split(text, "hermes")
    s_content, s_calls, first_at = _streamed(plan, text, size)
    assert s_content == content
    assert s_calls == [(c.name, c.arguments) for c in calls]
    if parallel is False:
        assert len(calls) <= 1
    if plan.mode in ("auto", "required") and size == 1 and calls:
        assert first_at[0] < len(text) - 1  # the first call went out as soon as it was complete
    for name, args in s_calls:
        json.loads(args)


@pytest.mark.parametrize("finish, stop_reason, last, want", [
    ("stop", "\n", 5, "\n"), ("stop", r"and|or", 5, r"and|or"), ("stop", 7, 7, 7), ("stop", None, 2, 2),
    ("length", None, 5, None), ("abort", None, None, None), ("stop", None, None, None)])
def test_matched_stop_is_sglangs(finish, stop_reason, last, want):
    """The stop string, regex pattern or stop token id; the EOS (last) token; None unless "stop"."""
    assert matched_stop(finish, stop_reason, last) == want


# A value other than the default for each field a request and SamplingParams share.
_SET = {"allowed_token_ids": [3, 4], "bad_words": ["no"], "frequency_penalty": 0.5, "ignore_eos": True,
        "include_stop_str_in_output": True, "min_p": 0.1, "min_tokens": 2, "n": 2, "presence_penalty": -0.5,
        "repetition_penalty": 1.2, "seed": 7, "skip_special_tokens": False, "spaces_between_special_tokens": False,
        "stop": ["x"], "stop_regex": ["y+"], "stop_token_ids": [5], "temperature": 0.7, "top_k": 5, "top_p": 0.9}


def _params(**fields):
    serving = object.__new__(OpenAIServingBase)
    serving.llm = type("Engine", (), {"vocab_size": 100})()
    req = P.CompletionRequest(prompt="hi", **fields)
    return serving._sampling_params(req, 8, None, None, RequestOutputKind.FINAL_ONLY)


def test_every_shared_request_field_reaches_the_sampling_params():
    assert sorted(_SET) == list(REQUEST_SAMPLING_FIELDS)  # a new shared field gets a value here
    params = _params(**_SET)
    for name, value in _SET.items():
        assert getattr(params, name) == value, name
    # Left out (or null): SamplingParams' own default, or None for the model's generation config.
    unset = _params(n=None, presence_penalty=None, temperature=None)
    assert (unset.n, unset.presence_penalty, unset.temperature, unset.top_p) == (1, 0.0, None, None)


# The request path up to the engine, in process: a serving object over a stand-in engine
# whose add_request runs the real Processor (no model, no engine core).
_CONTEXT = 16


class _Accepted(Exception):
    """Raised by the stand-in engine for a request the Processor took."""


class _Engine:
    def __init__(self) -> None:
        from types import SimpleNamespace

        from tandem.config.resolved import ResolvedConfig
        from tandem.engine.processor import Processor
        from tandem.model_loader.generation_config import GenerationDefaults

        resolved = ResolvedConfig("float32", None, None, "cpu", _CONTEXT, 4, 64, 8, GenerationDefaults())
        self.tokenizer = SimpleNamespace(eos_token_id=None)
        self.vocab_size = 100
        self.processor = Processor(self.tokenizer, SimpleNamespace(resolved=resolved, vocab_size=100,
                                                                   eos_token_ids=[0]))

    async def add_request(self, request_id, prompt_token_ids, params, arrival_time=None):
        self.processor.process_inputs(request_id, list(prompt_token_ids), params, 0.0)
        raise _Accepted


def _serving(cls, prompt_len: int):
    from concurrent.futures import ThreadPoolExecutor

    serving = object.__new__(cls)
    serving.llm = _Engine()
    serving.tokenizer = serving.llm.tokenizer
    serving.served_model_names = ["m"]
    serving.model_name = "m"
    serving.return_tokens_as_token_ids = False
    serving.tool_call_parser = "hermes"
    serving._tok_pool = ThreadPoolExecutor(1)
    serving._chat_prompt = lambda req, conv: ("", [7] * prompt_len)  # no chat template needed
    return serving


def _error(endpoint: str, prompt_len: int, **fields):
    """The OpenAIError a request of ``prompt_len`` prompt tokens gets, or None if accepted."""
    import asyncio

    from tandem.entrypoints.openai.errors import OpenAIError
    from tandem.entrypoints.openai.serving_chat import OpenAIServingChat
    from tandem.entrypoints.openai.serving_completion import OpenAIServingCompletion

    if endpoint == "chat":
        serving = _serving(OpenAIServingChat, prompt_len)
        call = serving.create_chat_completion(P.ChatCompletionRequest(
            messages=[{"role": "user", "content": "Hi"}], **fields), "r")
    else:
        serving = _serving(OpenAIServingCompletion, prompt_len)
        call = serving.create_completion(P.CompletionRequest(prompt=[7] * prompt_len, **fields), "r")
    try:
        asyncio.run(call)
    except OpenAIError as e:
        return e
    except _Accepted:
        return None
    finally:
        serving.shutdown()
    raise AssertionError("neither accepted nor refused")


@pytest.mark.parametrize("beam", [False, True])
@pytest.mark.parametrize("endpoint, field, prompt_field", [
    ("completions", "max_tokens", "prompt"), ("chat", "max_tokens", "messages"),
    ("chat", "max_completion_tokens", "messages")])
def test_context_overflow_names_the_field_at_fault(endpoint, field, prompt_field, beam):
    """prompt + max_tokens over max_model_len: a prompt that fits alone leaves the fault to
    the budget field that was sent (``param`` it, the message giving the prompt's tokens, the
    budget and the context); a prompt that does not is the prompt's fault, whatever the budget."""
    extra = {"use_beam_search": True} if beam else {}
    err = _error(endpoint, 8, **{field: 10}, **extra)
    assert (err.status_code, err.param) == (400, field), err.message
    assert err.message.startswith(f"{field} is too large: "), err.message
    for part in (f"maximum context length is {_CONTEXT} tokens", f"8 tokens in the {prompt_field}", f"{field} 10",
                 "= 18 tokens", f"reduce {field} to at most 8,"):
        assert part in err.message, err.message
    if not beam:  # a beam search takes its rounds through the engine: the first is accepted
        assert _error(endpoint, 8, **{field: 8}, **extra) is None  # exactly the context
    for budget in ({field: 4}, {field: 10}, {}):
        err = _error(endpoint, _CONTEXT, **budget, **extra)
        assert (err.status_code, err.param) == (400, prompt_field), err.message
        assert f"your {prompt_field} resulted in {_CONTEXT} tokens" in err.message, err.message
