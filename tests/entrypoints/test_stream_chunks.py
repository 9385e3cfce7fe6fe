"""The stream chunks' wire format (``protocol``'s msgspec structs through
``streaming.sse``) byte for byte as the server wrote it before they were structs: which
fields are null and which absent, their order, escapes; the same structs inside whole
responses; and the streaming skeleton (``streaming.ChunkStream``): one write per batch of
outputs, usage, the error event, ``[DONE]``, the requests aborted."""

from __future__ import annotations

import asyncio
import json

import pytest

from tandem.engine.async_llm import EngineDeadError
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.streaming import ChunkStream, sse
from tandem.outputs import CompletionOutput, RequestOutput

CREATED = 1700000000
RID, MODEL = 'cmpl-"x"\\é', "m/ö\n"
HEAD = 'data: {"id":"cmpl-\\"x\\"\\\\é","object":"text_completion","created":1700000000,"model":"m/ö\\n","choices":'
OPEN = 'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":'
NO_END = '"finish_reason":null,"stop_reason":null,"matched_stop":null'


def _cmpl(choices, usage=None, rid=RID, model=MODEL) -> P.CompletionStreamResponse:
    return P.CompletionStreamResponse(id=rid, created=CREATED, model=model, choices=choices, usage=usage)


def _chat(choices, usage=None) -> P.ChatCompletionStreamResponse:
    return P.ChatCompletionStreamResponse(id="chatcmpl-1", created=CREATED, model="m", choices=choices, usage=usage)


USAGE = P.UsageInfo(prompt_tokens=7, completion_tokens=3, total_tokens=10)
USAGE_JSON = '{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,"prompt_tokens_details":null}'
LOGPROBS = P.CompletionLogProbs(text_offset=[0, 6], token_logprobs=[None, -9999.0], tokens=["a", " b"],
                                top_logprobs=[None, {" b": -9999.0, "c": -1e-05}])
CHAT_LOGPROBS = P.ChatCompletionLogProbs(content=[P.ChatCompletionLogProbsContent(
    token="<|im_end|>", logprob=-0.25, bytes=None,
    top_logprobs=[P.ChatCompletionLogProb("<|im_end|>", -0.25, [60, 124]),
                  P.ChatCompletionLogProb("é", -2.5, [195, 169])])])

# (chunk, its SSE event as the pydantic models and the hand-written frames wrote it)
CHUNKS = {
    "completion: logprobs, stop string, usage": (
        _cmpl([P.CompletionResponseStreamChoice(1, " b", LOGPROBS, "stop", 'a"b', 'a"b')], USAGE),
        HEAD + '[{"index":1,"text":" b","logprobs":{"text_offset":[0,6],"token_logprobs":[null,-9999.0],'
        '"tokens":["a"," b"],"top_logprobs":[null,{" b":-9999.0,"c":-0.00001}]},"finish_reason":"stop",'
        '"stop_reason":"a\\"b","matched_stop":"a\\"b"}],"usage":' + USAGE_JSON + '}\n\n'),
    "completion: the usage chunk": (
        _cmpl([], USAGE, "cmpl-1", "m"),
        'data: {"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[],"usage":'
        + USAGE_JSON + '}\n\n'),
    "chat: the role chunk, continuous usage": (
        _chat([P.ChatCompletionResponseStreamChoice(0, P.DeltaMessage(role="assistant", content=""))],
              P.UsageInfo(prompt_tokens=5, total_tokens=5)),
        OPEN + '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,' + NO_END + '}],"usage":'
        '{"prompt_tokens":5,"completion_tokens":0,"total_tokens":5,"prompt_tokens_details":null}}\n\n'),
    "chat: content, logprobs, EOS": (
        _chat([P.ChatCompletionResponseStreamChoice(1, P.DeltaMessage(content="é"), CHAT_LOGPROBS, "stop", None, 2)]),
        OPEN + '[{"index":1,"delta":{"content":"é"},"logprobs":{"content":[{"token":"<|im_end|>","logprob":-0.25,'
        '"bytes":null,"top_logprobs":[{"token":"<|im_end|>","logprob":-0.25,"bytes":[60,124]},{"token":"é",'
        '"logprob":-2.5,"bytes":[195,169]}]}]},"finish_reason":"stop","stop_reason":null,"matched_stop":2}],'
        '"usage":null}\n\n'),
    "chat: content and a whole tool call": (
        _chat([P.ChatCompletionResponseStreamChoice(0, P.DeltaMessage(content="Sure.", tool_calls=[
            P.DeltaToolCall(0, "chatcmpl-tool-1", "function", P.DeltaFunctionCall("f", '{"x": 1}'))]))]),
        OPEN + '[{"index":0,"delta":{"content":"Sure.","tool_calls":[{"index":0,"id":"chatcmpl-tool-1",'
        '"type":"function","function":{"name":"f","arguments":"{\\"x\\": 1}"}}]},"logprobs":null,' + NO_END
        + '}],"usage":null}\n\n'),
    "chat: a piece of a call's arguments": (
        _chat([P.ChatCompletionResponseStreamChoice(0, P.DeltaMessage(tool_calls=[
            P.DeltaToolCall(0, function=P.DeltaFunctionCall(arguments="2}"))]))]),
        OPEN + '[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"2}"}}]},"logprobs":null,'
        + NO_END + '}],"usage":null}\n\n'),
    "chat: the finish after calls, empty delta": (
        _chat([P.ChatCompletionResponseStreamChoice(0, P.DeltaMessage(), None, "tool_calls", None, 2)]),
        OPEN + '[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls","stop_reason":null,'
        '"matched_stop":2}],"usage":null}\n\n'),
}


@pytest.mark.parametrize("name", list(CHUNKS))
def test_chunk_is_written_as_before(name):
    chunk, want = CHUNKS[name]
    assert sse(chunk) == want


# text -> its JSON as written before: only what JSON requires escaped, the rest as itself in UTF-8
TEXTS = {"": '""', " hello": '" hello"', 'q"uo\\te/': '"q\\"uo\\\\te/"',
         "\n\t\r\b\f\x00\x1f\x7f": '"\\n\\t\\r\\b\\f\\u0000\\u001f\x7f"',
         "é中🙂\u2028\u2029\ufffd": '"é中🙂\u2028\u2029\ufffd"', "</script>": '"</script>"'}


@pytest.mark.parametrize("text", list(TEXTS))
def test_text_is_escaped_as_before(text):
    got = sse(_cmpl([P.CompletionResponseStreamChoice(3, text)]))
    assert got == HEAD + '[{"index":3,"text":' + TEXTS[text] + ',"logprobs":null,' + NO_END + '}],"usage":null}\n\n'
    assert json.loads(got[len("data: "):])["choices"][0]["text"] == text


def test_whole_response_holds_the_same_structs():
    """Logprobs and usage in a whole response dump as the chunk writes them (the HTTP
    layer sends ``model_dump()``), and are checked to be those structs."""
    resp = P.CompletionResponse(id="cmpl-1", model="m", usage=USAGE, choices=[
        P.CompletionResponseChoice(index=0, text=" b", logprobs=LOGPROBS, finish_reason="length")])
    body = resp.model_dump()
    assert body["usage"] == json.loads(USAGE_JSON)
    assert body["choices"][0]["logprobs"] == json.loads(sse(LOGPROBS)[len("data: "):])
    assert json.loads(resp.model_dump_json()) == json.loads(json.dumps(body))
    with pytest.raises(ValueError):
        P.CompletionResponse(id="cmpl-1", model="m", usage=json.loads(USAGE_JSON), choices=[])


# ----------------------------------------------------------------- the skeleton
class _Stream:
    """A request stream whose batches of outputs are given up front; an exception in
    place of a batch is raised there."""

    def __init__(self, batches: list) -> None:
        self.batches = list(batches)
        self.aborted = False

    async def next_outputs(self) -> list[RequestOutput]:
        await asyncio.sleep(0)
        if not self.batches:
            raise StopAsyncIteration
        batch = self.batches.pop(0)
        if isinstance(batch, BaseException):
            raise batch
        return batch

    def abort(self) -> None:
        self.aborted = True


class _Texts(ChunkStream):
    """Each output's text as a completions choice; an empty one sends nothing."""

    chunk_type = P.CompletionStreamResponse
    what = "test"

    def choice(self, i, index, out, c):
        if not c.text and c.finish_reason is None:
            return None
        return P.CompletionResponseStreamChoice(index, c.text, None, c.finish_reason)


def _out(*completions: CompletionOutput) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], list(completions), False)


def _events(body: list[str]) -> list[list[dict | str]]:
    """Each write's events, ``[DONE]`` as the string."""
    return [[e if e == "[DONE]" else json.loads(e) for e in w.removeprefix("data: ").removesuffix("\n\n")
             .split("\n\ndata: ")] for w in body]


async def _body(stream: ChunkStream) -> list[str]:
    return [w async for w in stream]


def test_outputs_that_arrive_together_are_one_write_then_usage_and_done():
    first = [_out(CompletionOutput(0, "a", [5]), CompletionOutput(1, "", [6])), _out(CompletionOutput(0, "b", [7, 8]))]
    last = [_out(CompletionOutput(1, "c", [9], finish_reason="stop"),
                 CompletionOutput(0, "", [], finish_reason="length"))]
    streams = [_Stream([first, last]), _Stream([[_out(CompletionOutput(0, "z", [3], finish_reason="length"))]])]
    writes = _events(asyncio.run(_body(_Texts(streams, "cmpl-1", "m", [2, 4], 2, True, True))))
    texts = [[(c["choices"][0]["index"], c["choices"][0]["text"], c["usage"]["completion_tokens"]) for c in w]
             for w in writes[:-2]]
    # choice 1 of prompt 0 sent a token without text: counted, not sent
    assert sorted(sum(texts, [])) == [(0, "", 3), (0, "a", 1), (0, "b", 3), (1, "c", 2), (2, "z", 1)]
    assert any(w[:2] == [(0, "a", 1), (0, "b", 3)] for w in texts)  # one batch, one write, in order
    assert all(c["usage"]["prompt_tokens"] == (2 if c["choices"][0]["index"] < 2 else 4)
               for w in writes[:-2] for c in w)
    assert writes[-2] == [{"id": "cmpl-1", "object": "text_completion", "created": writes[0][0]["created"],
                           "model": "m", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 6,
                                                                  "total_tokens": 12, "prompt_tokens_details": None}}]
    assert writes[-1] == ["[DONE]"]
    assert all(s.aborted for s in streams)


@pytest.mark.parametrize("error, message", [(EngineDeadError("engine gone"), "engine gone"),
                                            (RuntimeError("bug"), "internal error: RuntimeError('bug')")])
def test_a_failure_ends_with_the_error_event_then_done(error, message):
    """The chunks of the batch being framed go out first; then the error, [DONE], and the
    requests aborted."""

    class Failing(_Texts):
        def choice(self, i, index, out, c):
            if c.text == "boom":
                raise error
            return super().choice(i, index, out, c)

    stream = _Stream([[_out(CompletionOutput(0, "a", [5]), CompletionOutput(0, "boom", [6]))]])
    writes = _events(asyncio.run(_body(Failing([stream], "cmpl-1", "m", [2], 1, True, False))))
    assert [c["choices"][0]["text"] for c in writes[0][:-1]] == ["a"]
    assert writes[0][0]["usage"] is None
    assert writes[0][-1] == {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
    assert writes[1:] == [["[DONE]"]]
    assert stream.aborted


def test_head_choices_go_first_as_one_write():
    class Headed(_Texts):
        def head(self):
            return [P.CompletionResponseStreamChoice(i, "") for i in range(self.n)]

    stream = _Stream([[_out(CompletionOutput(1, "x", [4], finish_reason="length"))]])
    writes = _events(asyncio.run(_body(Headed([stream], "cmpl-1", "m", [2], 2, False, True))))
    assert [(c["choices"][0]["index"], c["usage"]["total_tokens"]) for c in writes[0]] == [(0, 2), (1, 2)]
    assert [c["choices"][0]["text"] for c in writes[1]] == ["x"]
    assert writes[2:] == [["[DONE]"]]
