"""OpenAI serving logic: requests -> engine requests -> responses and SSE chunks.

Everything here runs on the server's event loop, except tokenization (prompts, chat
templates, token strings), which runs on one front-end worker thread with the front end's
own tokenizer copy, so that neither the event loop nor the engine thread waits for it.
Non-streaming requests ask the engine for one final output (``FINAL_ONLY``); streaming ones
for deltas (``DELTA``), each turned into one SSE chunk per choice.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from typing import Any

import msgspec

from tandem.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from tandem.engine.processor import PromptError
from tandem.engine.token_bytes import TokenBytes, token_id_string
from tandem.entrypoints.chat_utils import ChatMessageError, parse_chat_messages, render_chat
from tandem.beam_search import BeamSearch
from tandem.entrypoints.openai.beam_search import BeamSearchStream, beam_search_params, run_beam_search
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.structured_outputs import FieldError, ToolPlan, structured_outputs_of, tool_plan
from tandem.entrypoints.openai.tool_parsers import ToolCall, parser_for_chat_template
from tandem.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams
from tandem.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


class OpenAIError(Exception):
    """An error answered with an OpenAI-style body (``{"error": {...}}``)."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type
        self.param = param

    def body(self) -> dict:
        return error_body(self.message, self.status_code, self.err_type, self.param)


def error_body(message: str, code: int, err_type: str, param: str | None = None) -> dict:
    return P.ErrorResponse(error=P.ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, "BadRequestError", param)


def model_not_found(name: str) -> OpenAIError:
    """OpenAI's and vLLM's answer to a model id that is not served: 404, naming ``model``."""
    return OpenAIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")


def _param_of(message: str) -> str | None:
    """The field a ``SamplingParams`` / engine message names first, if any."""
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_FIELDS else None


def _clamp(lp: float) -> float:
    """JSON has no infinities: vLLM's convention maps -inf / nan to -9999.0."""
    return -9999.0 if math.isnan(lp) or math.isinf(lp) else max(lp, -9999.0)


def matched_stop(finish_reason: str | None, stop_reason: int | str | None, last_token: int | None) -> int | str | None:
    """SGLang's ``matched_stop`` of a choice whose engine finish is ``finish_reason``: for
    "stop", the stop string, stop regex (its pattern) or ``stop_token_ids`` entry that ended
    it (``stop_reason``), else its last token (the EOS token, or the token that completed
    its structured output: SGLang reports both); None for "length" and "abort"."""
    if finish_reason != "stop":
        return None
    return last_token if stop_reason is None else stop_reason


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[list[tuple[int, list[RequestOutput]]]]:
    """Interleave several request streams as ``(stream index, its outputs)``, in arrival
    order, in batches: each batch holds every output that arrived since the last one (at
    least one)."""
    if len(streams) == 1:
        s = streams[0]
        while True:
            try:
                outs = await s.next_outputs()
            except StopAsyncIteration:
                return
            yield [(0, outs)]
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            while True:
                try:
                    outs = await s.next_outputs()
                except StopAsyncIteration:
                    break
                q.put_nowait((i, outs))
        except BaseException as e:  # noqa: BLE001 - forwarded to the reader
            q.put_nowait((i, e))
            return
        q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            batch: list[tuple[int, list[RequestOutput]]] = []
            item = await q.get()
            while True:
                i, x = item
                if x is done:
                    remaining -= 1
                elif isinstance(x, BaseException):
                    if batch:
                        yield batch
                    raise x
                else:
                    batch.append((i, x))
                if q.empty():
                    break
                item = q.get_nowait()
            if batch:
                yield batch
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class SSEStream:
    """A streaming response body (SSE lines) and the engine requests behind it.

    ``abort()`` stops the requests even if the body was never iterated (a client gone
    before the first chunk); the HTTP layer calls it when the response ends, however.
    """

    def __init__(self, body: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        self.body = body
        self.streams = list(streams)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.body.__aiter__()

    def abort(self) -> None:
        for s in self.streams:
            s.abort()


def sse(data: Any) -> str:
    if isinstance(data, P.OpenAIBaseModel):
        return f"data: {data.model_dump_json()}\n\n"
    return f"data: {json.dumps(data)}\n\n"


_json_encoder = msgspec.json.Encoder()


def _js(value: str | int | None) -> str:
    """JSON of a string, an int or None, as pydantic writes it (both escape only what JSON
    requires and write every other character as itself, in UTF-8)."""
    return _json_encoder.encode(value).decode()


class ChunkFrames:
    """SSE frames of one streamed response's chunks (``CompletionStreamResponse``, ``object``
    "text_completion", or ``ChatCompletionStreamResponse``, "chat.completion.chunk") with
    one choice each, byte for byte their ``model_dump_json``, without building pydantic
    models per token: the fields every chunk shares are serialized once.
    """

    def __init__(self, obj: str, rid: str, created: int, model: str) -> None:
        self._head = (f'data: {{"id":{_js(rid)},"object":{_js(obj)},"created":{created},"model":{_js(model)},'
                      f'"choices":[{{"index":')
        self._field = ',"text":' if obj == "text_completion" else ',"delta":'

    def frame(self, index: int, value_json: str, logprobs_json: str, finish_reason: str | None,
              stop_reason: int | str | None, matched: int | str | None, usage_json: str) -> str:
        """One chunk: ``value_json`` is the choice's ``text`` (completions) or ``delta``
        (chat) already as JSON; ``logprobs_json`` / ``usage_json``: JSON or ``null``;
        ``matched``: its ``matched_stop``."""
        return (f'{self._head}{index}{self._field}{value_json},"logprobs":{logprobs_json},"finish_reason":'
                f'{_js(finish_reason)},"stop_reason":{_js(stop_reason)},"matched_stop":{_js(matched)}}}],'
                f'"usage":{usage_json}}}\n\n')

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> str:
        """``UsageInfo`` as JSON (no prompt token details)."""
        return (f'{{"prompt_tokens":{prompt_tokens},"completion_tokens":{completion_tokens},'
                f'"total_tokens":{prompt_tokens + completion_tokens},"prompt_tokens_details":null}}')


class TextOffsets:
    """``text_offset`` of successive tokens: the number of characters of the text before
    each token's own characters (a character split over tokens counts at the token that
    completes it). Tokens whose text is not in the response text add nothing: special
    tokens left out by ``skip_special_tokens``, an automatically added BOS in an echoed
    prompt, the stop token that ended a sequence.

    One instance per choice lives as long as its stream, so that offsets in a chunk go on
    from the characters already sent.
    """

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._tb = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pos = 0

    def next(self, token_id: int, in_text: bool = True) -> int:
        """Offset of ``token_id``; then advance past its characters if ``in_text``."""
        offset = self.pos
        if in_text:
            self.pos += len(self._decoder.decode(self._tb.token_bytes(token_id)))
        return offset


class OpenAIServing:
    """Completions, chat completions, tokenize/detokenize on top of an ``AsyncLLM``.

    Args:
        llm: the engine front end.
        served_model_names: names accepted in the ``model`` field (the first is reported).
        tool_call_parser: how chat outputs are parsed for tool calls (``hermes``,
            ``llama3_json``); None: from the chat template.
        return_tokens_as_token_ids: logprob tokens spelled ``token_id:N`` unless a request's
            ``return_tokens_as_token_ids`` says otherwise (vLLM's server flag).
    """

    def __init__(self, llm: AsyncLLM, served_model_names: list[str], tool_call_parser: str | None = None,
                 return_tokens_as_token_ids: bool = False) -> None:
        self.llm = llm
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.tokenizer = llm.tokenizer
        self.served_model_names = served_model_names
        template = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else None
        self.tool_call_parser = tool_call_parser or parser_for_chat_template(template)
        self.model_name = served_model_names[0]
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer")
        self.token_bytes = TokenBytes(self.tokenizer)

    # ----------------------------------------------------------------- helpers
    def shutdown(self) -> None:
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    async def _in_tokenizer(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, fn, *args)

    def check_model(self, name: str | None) -> None:
        """Reject a ``model`` field that names no served model. None or ``""`` (how the
        OpenAI SDK, whose ``model`` is required, defers to the server) is unset: the
        first served model, as in vLLM.

        Raises:
            OpenAIError: 404 NotFoundError naming ``model``.
        """
        if name and name not in self.served_model_names:
            raise model_not_found(name)

    def _check_token_ids(self, ids: list[int], what: str) -> None:
        v = self.llm.vocab_size
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise bad_request(f"{what} contains token ids outside the vocabulary [0, {v}): {bad[:8]}.", what)

    def _sampling_params(self, req: P._SamplingFields, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, kind: RequestOutputKind,
                         structured_outputs: StructuredOutputsParams | None = None,
                         max_tokens_field: str = "max_tokens") -> SamplingParams:
        """``max_tokens_field``: the request field ``max_tokens`` came from (chat's
        ``max_completion_tokens``), named in its error."""
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise bad_request(f"best_of must equal n (best_of > n is not supported; beam search: use_beam_search), got "
                              f"best_of={req.best_of}, n={req.n}.", "best_of")
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{max_tokens_field} must be at least 1, got {max_tokens}.", max_tokens_field)
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids (integers), got {list(req.logit_bias)[:8]}.",
                                  "logit_bias") from None
        try:
            params = SamplingParams(
                n=req.n or 1,
                # Left unset (None): the engine applies the model's generation_config.json.
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=req.repetition_penalty,
                logit_bias=bias,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                stop_regex=req.stop_regex,
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                output_kind=kind,
                structured_outputs=structured_outputs,
            )
            params.verify_vocab(self.llm.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), _param_of(str(e))) from None
        return params

    async def _structured_outputs(self, req: P._SamplingFields) -> StructuredOutputsParams | None:
        """The request's output constraint, parsed on the tokenizer thread.

        Raises:
            OpenAIError: 400 naming the invalid field.
        """
        try:
            return await self._in_tokenizer(structured_outputs_of, req)
        except FieldError as e:
            raise bad_request(str(e), e.param) from None

    @staticmethod
    def _stream_options(req: P._SamplingFields) -> tuple[bool, bool]:
        """(final usage chunk, usage in every content chunk) of a streamed request; as in
        vLLM, ``continuous_usage_stats`` only counts together with ``include_usage``.

        Raises:
            OpenAIError: ``stream_options`` without ``stream``; ``prompt_logprobs`` with it.
        """
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
        if req.stream and req.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not available when stream is true.", "prompt_logprobs")
        opts = req.stream_options
        include = bool(opts and opts.include_usage)
        return include, include and bool(opts.continuous_usage_stats)

    def _as_ids(self, req: P._SamplingFields) -> bool:
        """Whether ``req``'s logprob tokens are spelled ``token_id:N``: its own field, else
        the server's default."""
        if req.return_tokens_as_token_ids is None:
            return self.return_tokens_as_token_ids
        return req.return_tokens_as_token_ids

    def _token_str(self, token_id: int, as_ids: bool) -> str:
        return token_id_string(token_id) if as_ids else self.token_bytes.token_string(token_id)

    def _in_output_text(self, token_id: int, skip_special: bool) -> bool:
        return not (skip_special and self.token_bytes.is_special(token_id))

    @staticmethod
    def _stop_token_hidden(c: CompletionOutput, params: SamplingParams) -> bool:
        """The last token of ``c`` is a stop token whose text the output leaves out."""
        return (c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
                and not params.include_stop_str_in_output)

    async def _add(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                   prompt_field: str) -> list[RequestStream]:
        """Add one engine request per prompt, all at once; on any rejection abort the others.
        ``prompt_field``: the request field the prompts came from, named in prompt errors."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        res = await asyncio.gather(*(self.llm.add_request(rid, p, params) for rid, p in zip(ids, prompts)),
                                   return_exceptions=True)
        errors = [r for r in res if isinstance(r, BaseException)]
        if errors:
            for r in res:
                if isinstance(r, RequestStream):
                    r.abort()
            e = errors[0]
            if isinstance(e, PromptError):
                raise bad_request(str(e.for_field(prompt_field)), prompt_field)
            if isinstance(e, ValueError):
                raise bad_request(str(e), _param_of(str(e)))
            raise e
        return res

    @staticmethod
    async def _final(stream: RequestStream) -> RequestOutput:
        last = None
        async for out in stream:
            last = out
        if last is None or not last.finished:  # pragma: no cover - engine contract
            raise EngineDeadError("request ended without a final output")
        return last

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        try:
            return list(await asyncio.gather(*(self._final(s) for s in streams)))
        finally:
            for s in streams:
                s.abort()

    def _start_beam_search(self, req: P._SamplingFields, request_id: str, ids: list[int], max_tokens: int | None,
                           prompt_field: str) -> BeamSearchStream:
        """Start ``req``'s beam search over the prompt ``ids`` (:mod:`tandem.entrypoints.openai.beam_search`).

        Raises:
            OpenAIError: 400, a field beam search cannot serve or a bad value (before it starts).
        """
        proc = self.llm.processor
        try:
            params = beam_search_params(req, max_tokens, len(ids), proc.max_model_len)
            search = BeamSearch(ids, params, proc.eos_token_ids, proc.max_model_len)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), name if name in type(req).model_fields else None) from None

        async def generate_round(rid: str, prompts: list[list[int]], round_params: SamplingParams):
            return await self._collect(await self._add(rid, prompts, round_params, prompt_field))

        async def decode(token_ids: list[int]) -> str:
            return await self._in_tokenizer(self.llm.tokenizer.decode, token_ids, req.skip_special_tokens)

        return BeamSearchStream(run_beam_search(request_id, search, generate_round, decode))

    # ------------------------------------------------------------ completions
    def _tokenize_completion_prompts(self, req: P.CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise bad_request("prompt must not be empty.", "prompt")
        elif all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        out = []
        for x in items:
            if isinstance(x, str):
                out.append((x, self.tokenizer.encode(x, add_special_tokens=req.add_special_tokens)))
            else:
                if not x:
                    raise bad_request("prompt must not be empty.", "prompt")
                self._check_token_ids(x, "prompt")
                out.append((None, list(x)))
        return out

    def _prompt_texts(self, prompts: list[tuple[str | None, list[int]]]) -> list[str]:
        """Prompt texts, for echo (decoded when given as ids)."""
        return [self.tokenizer.decode(ids) if text is None else text for text, ids in prompts]

    def _completion_logprobs(self, token_ids: list[int], lps: list[PositionLogprobs | None], offsets: TextOffsets,
                             in_text: list[bool], as_ids: bool) -> P.CompletionLogProbs:
        """Completions ``logprobs`` of ``token_ids``; ``in_text[i]``: token i's text is in
        the response text (see :class:`TextOffsets`)."""
        res = P.CompletionLogProbs()
        for tok, pos, shown in zip(token_ids, lps, in_text):
            res.tokens.append(self._token_str(tok, as_ids))
            res.text_offset.append(offsets.next(tok, shown))
            if pos is None:  # the first prompt token has no logprob
                res.token_logprobs.append(None)
                res.top_logprobs.append(None)
            else:
                res.token_logprobs.append(_clamp(pos[tok].logprob))
                res.top_logprobs.append({self._token_str(t, as_ids): _clamp(v.logprob) for t, v in pos.items()})
        return res

    def _echo_in_text(self, text: str, ids: list[int]) -> list[bool]:
        """Which echoed prompt tokens are in the prompt text: all but special tokens that
        the text does not spell (a BOS the tokenizer added)."""
        tb, offsets, res = self.token_bytes, TextOffsets(self.token_bytes), []
        for t in ids:
            shown = not tb.is_special(t) or text.startswith(tb.token_string(t), offsets.pos)
            offsets.next(t, shown)
            res.append(shown)
        return res

    def _gen_in_text(self, c: CompletionOutput, params: SamplingParams) -> list[bool]:
        """Which generated tokens of completion ``c`` are in its text."""
        shown = [self._in_output_text(t, params.skip_special_tokens) for t in c.token_ids]
        if shown and self._stop_token_hidden(c, params):
            shown[-1] = False
        return shown

    def _prompt_logprobs(self, out: RequestOutput, as_ids: bool) -> list[dict[str, P.PromptLogprob] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob, rank, text."""
        if out.prompt_logprobs is None:
            return None
        return [None if pos is None else
                {str(t): P.PromptLogprob(logprob=_clamp(v.logprob), rank=v.rank, decoded_token=self._token_str(t, as_ids))
                 for t, v in pos.items()} for pos in out.prompt_logprobs]

    async def create_completion(self, req: P.CompletionRequest, request_id: str):
        """Returns a ``CompletionResponse`` or, when streaming, an async iterator of SSE lines.

        Raises:
            OpenAIError: invalid request (400), a model that is not served (404).
        """
        self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        include_usage, continuous_usage = self._stream_options(req)
        echo = bool(req.echo)
        max_tokens = req.max_tokens
        echo_only = echo and max_tokens == 0  # score the prompt only (OpenAI's echo + max_tokens 0)
        if echo_only:
            max_tokens = 1
        try:
            prompts = await self._in_tokenizer(self._tokenize_completion_prompts, req)
        except OpenAIError:
            raise
        except (ValueError, TypeError) as e:
            raise bad_request(f"could not tokenize the prompt: {e}", "prompt") from None
        lp = req.logprobs
        prompt_lp = lp if echo and lp is not None else req.prompt_logprobs
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        structured = await self._structured_outputs(req)
        params = self._sampling_params(req, max_tokens, lp, prompt_lp, kind, structured)
        echo_texts = await self._in_tokenizer(self._prompt_texts, prompts) if echo else None
        rid = f"cmpl-{request_id}"
        if req.use_beam_search:
            streams = []
            try:
                for i, (_, ids) in enumerate(prompts):
                    streams.append(self._start_beam_search(req, f"{request_id}-{i}", ids, max_tokens, "prompt"))
            except OpenAIError:
                for st in streams:
                    st.abort()
                raise
        else:
            streams = await self._add(request_id, [ids for _, ids in prompts], params, "prompt")
        if req.stream:
            return SSEStream(self._completion_stream(streams, prompts, echo_texts, echo_only, params, rid,
                                                     include_usage, continuous_usage, self._as_ids(req)), streams)
        outs = await self._collect(streams)
        return self._completion_response(req, outs, prompts, echo_texts, echo_only, params, rid)

    def _completion_choice_logprobs(self, i: int, out: RequestOutput, c: CompletionOutput, prompts, echo_texts,
                                    echo_only: bool, params: SamplingParams, offsets: TextOffsets,
                                    with_prompt: bool, as_ids: bool) -> P.CompletionLogProbs:
        """Logprobs of one choice's new tokens (and of the echoed prompt when ``with_prompt``)."""
        toks = [] if echo_only else c.token_ids
        lps = [] if echo_only else (c.logprobs or [])
        shown = [] if echo_only else self._gen_in_text(c, params)
        if with_prompt:
            ids = prompts[i][1]
            toks, shown = ids + toks, self._echo_in_text(echo_texts[i], ids) + shown
            lps = (out.prompt_logprobs or [None] * len(ids)) + lps
        return self._completion_logprobs(toks, lps, offsets, shown, as_ids)

    def _completion_response(self, req: P.CompletionRequest, outs: list[RequestOutput], prompts, echo_texts,
                             echo_only: bool, params: SamplingParams, rid: str) -> P.CompletionResponse:
        choices = []
        num_prompt = num_gen = 0
        as_ids = self._as_ids(req)
        for i, out in enumerate(outs):
            num_prompt += len(prompts[i][1])
            for c in sorted(out.outputs, key=lambda c: c.index):
                num_gen += 0 if echo_only else len(c.token_ids)
                text = ("" if echo_only else c.text)
                if echo_texts is not None:
                    text = echo_texts[i] + text
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self._completion_choice_logprobs(i, out, c, prompts, echo_texts, echo_only, params,
                                                                TextOffsets(self.token_bytes), echo_texts is not None,
                                                                as_ids)
                finish = "length" if echo_only else c.finish_reason
                choices.append(P.CompletionResponseChoice(
                    index=i * params.n + c.index, text=text, logprobs=logprobs, finish_reason=finish,
                    stop_reason=c.stop_reason,
                    matched_stop=matched_stop(finish, c.stop_reason, c.token_ids[-1] if c.token_ids else None),
                    prompt_logprobs=self._prompt_logprobs(out, as_ids) if req.prompt_logprobs is not None else None))
        usage = P.UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen, total_tokens=num_prompt + num_gen)
        return P.CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)

    async def _completion_stream(self, streams, prompts, echo_texts, echo_only: bool, params: SamplingParams,
                                 rid: str, include_usage: bool, continuous_usage: bool,
                                 as_ids: bool) -> AsyncIterator[str]:
        """One SSE event per choice and output; the events of the outputs that arrived
        together go out as one write."""
        created = int(time.time())
        chunks = ChunkFrames("text_completion", rid, created, self.model_name)
        n = params.n
        offsets: dict[int, TextOffsets] = {}  # per choice: characters sent so far
        num_gen: dict[int, int] = {}  # per choice: tokens sent so far
        last_token: dict[int, int] = {}  # per choice: the last token sent
        frames: list[str] = []

        def frame(i: int, out: RequestOutput, c: CompletionOutput) -> str | None:
            idx = i * n + c.index
            first = idx not in offsets
            if first:
                offsets[idx] = TextOffsets(self.token_bytes)
            toks = [] if echo_only else c.token_ids
            text = "" if echo_only else c.text
            num_gen[idx] = num_gen.get(idx, 0) + len(toks)
            if toks:
                last_token[idx] = toks[-1]
            with_prompt = echo_texts is not None and first
            if with_prompt:
                text = echo_texts[i] + text
            logprobs = "null"
            if params.logprobs is not None:
                logprobs = self._completion_choice_logprobs(i, out, c, prompts, echo_texts, echo_only, params,
                                                            offsets[idx], with_prompt, as_ids).model_dump_json()
            finish = ("length" if echo_only else c.finish_reason) if c.finish_reason else None
            if not text and not toks and finish is None:
                return None
            usage = chunks.usage(len(prompts[i][1]), num_gen[idx]) if continuous_usage else "null"
            stop_reason = c.stop_reason if finish else None
            return chunks.frame(idx, _js(text), logprobs, finish, stop_reason,
                                matched_stop(finish, stop_reason, last_token.get(idx)), usage)

        try:
            async for batch in merge_streams(streams):
                for i, outs in batch:
                    for out in outs:
                        for c in out.outputs:
                            if (f := frame(i, out, c)) is not None:
                                frames.append(f)
                if frames:
                    yield "".join(frames)
                    frames.clear()
            if include_usage:
                num_prompt = sum(len(ids) for _, ids in prompts)
                total_gen = sum(num_gen.values())
                usage = P.UsageInfo(prompt_tokens=num_prompt, completion_tokens=total_gen,
                                    total_tokens=num_prompt + total_gen)
                yield sse(P.CompletionStreamResponse(id=rid, created=created, model=self.model_name, choices=[],
                                                     usage=usage))
        except EngineDeadError as e:
            yield "".join(frames) + sse(error_body(str(e), 500, "InternalServerError"))
        except Exception as e:  # noqa: BLE001 - report, then close the stream
            logger.exception("streaming completion failed")
            yield "".join(frames) + sse(error_body(f"internal error: {e!r}", 500, "InternalServerError"))
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------- chat
    @staticmethod
    def _conversation(messages: list[Any]) -> list[dict[str, Any]]:
        """``messages`` checked and made template-ready (:func:`parse_chat_messages`).

        Raises:
            OpenAIError: 400 naming the malformed field (``messages[0].content``).
        """
        try:
            return parse_chat_messages(messages)
        except ChatMessageError as e:
            raise bad_request(str(e), e.param) from None

    def _apply_chat_template(self, conv: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                             kwargs: dict | None) -> str:
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true.",
                              "continue_final_message")
        try:
            return render_chat(self.tokenizer, conv, add_generation_prompt, continue_final_message, **(kwargs or {}))
        except ChatMessageError as e:
            raise bad_request(str(e), e.param) from None

    def _chat_prompt(self, req: P.ChatCompletionRequest, conv: list[dict[str, Any]]) -> tuple[str, list[int]]:
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        text = self._apply_chat_template(conv, req.add_generation_prompt, req.continue_final_message, kwargs)
        # The template already holds the BOS token where the model wants it.
        return text, self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    @staticmethod
    def _echo_text(req: P.ChatCompletionRequest, conv: list[dict[str, Any]]) -> str:
        """What vLLM's chat ``echo`` puts before each choice's content: the last message's
        content when that message is the response's role's (the assistant's, as when it is
        continued), else nothing."""
        last = conv[-1]
        return last["content"] if req.echo and last["role"] == "assistant" else ""

    def _chat_logprobs(self, c: CompletionOutput, params: SamplingParams, top: int,
                       as_ids: bool) -> P.ChatCompletionLogProbs:
        """Chat ``logprobs`` of completion ``c``'s new tokens. ``bytes`` are each token's
        exact bytes, null for a token whose text the content leaves out (a skipped special
        token, the stop token), so the non-null ``bytes`` join to the content."""
        tb = self.token_bytes
        content = []
        for tok, pos, shown in zip(c.token_ids, c.logprobs or [], self._gen_in_text(c, params)):
            tops = sorted(pos.items(), key=lambda kv: kv[1].rank)[:top] if top else []
            content.append(P.ChatCompletionLogProbsContent(
                token=self._token_str(tok, as_ids), logprob=_clamp(pos[tok].logprob),
                bytes=list(tb.token_bytes(tok)) if shown else None,
                top_logprobs=[P.ChatCompletionLogProb(token=self._token_str(t, as_ids), logprob=_clamp(v.logprob),
                                                      bytes=list(tb.token_bytes(t))) for t, v in tops]))
        return P.ChatCompletionLogProbs(content=content)

    async def create_chat_completion(self, req: P.ChatCompletionRequest, request_id: str):
        """Returns a ``ChatCompletionResponse`` or, when streaming, an async iterator of SSE lines.

        Raises:
            OpenAIError: invalid request (400), a model that is not served (404).
        """
        self.check_model(req.model)
        conv = self._conversation(req.messages)
        structured = await self._structured_outputs(req)
        try:
            plan = await self._in_tokenizer(tool_plan, req)
        except FieldError as e:
            raise bad_request(str(e), e.param) from None
        if plan.constraint is not None:
            if structured is not None:
                raise bad_request(f"tool_choice {req.tool_choice!r} cannot be combined with another output "
                                  f"constraint (response_format, structured_outputs, guided_*, regex, ebnf).",
                                  "tool_choice")
            structured = plan.constraint
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        include_usage, continuous_usage = self._stream_options(req)
        max_tokens_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, max_tokens_field)
        _, ids = await self._in_tokenizer(self._chat_prompt, req, conv)
        top = req.top_logprobs or 0
        lp = top if req.logprobs else None
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        params = self._sampling_params(req, max_tokens, lp, req.prompt_logprobs, kind, structured, max_tokens_field)
        rid = f"chatcmpl-{request_id}"
        as_ids = self._as_ids(req)
        echo = self._echo_text(req, conv)
        if req.use_beam_search:
            streams = [self._start_beam_search(req, request_id, ids, max_tokens, "messages")]
        else:
            streams = await self._add(request_id, [ids], params, "messages")
        if req.stream:
            return SSEStream(self._chat_stream(streams[0], len(ids), params, rid, include_usage, continuous_usage,
                                               as_ids, plan, echo), streams)
        (out,) = await self._collect(streams)
        choices = []
        num_gen = 0
        for c in sorted(out.outputs, key=lambda c: c.index):
            num_gen += len(c.token_ids)
            logprobs = self._chat_logprobs(c, params, top, as_ids) if lp is not None else None
            content, calls = plan.split(c.text, self.tool_call_parser)
            if echo:
                content = echo + (content or "")
            choices.append(P.ChatCompletionResponseChoice(
                index=c.index, message=P.ChatResponseMessage(role="assistant", content=content,
                                                             tool_calls=[t.to_dict() for t in calls]),
                logprobs=logprobs, finish_reason=self._finish_reason(plan, calls, c.finish_reason),
                stop_reason=c.stop_reason,
                matched_stop=matched_stop(c.finish_reason, c.stop_reason, c.token_ids[-1] if c.token_ids else None)))
        usage = P.UsageInfo(prompt_tokens=len(ids), completion_tokens=num_gen, total_tokens=len(ids) + num_gen)
        return P.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage,
                                        prompt_logprobs=self._prompt_logprobs(out, as_ids))

    @staticmethod
    def _finish_reason(plan: ToolPlan, calls: list[ToolCall], finish: str | None) -> str | None:
        # OpenAI answers a forced (named) function with "stop", chosen calls with "tool_calls".
        return "tool_calls" if calls and finish == "stop" and plan.mode != "named" else finish

    async def _chat_stream(self, stream: RequestStream, num_prompt: int, params: SamplingParams, rid: str,
                           include_usage: bool, continuous_usage: bool, as_ids: bool,
                           plan: ToolPlan, echo: str) -> AsyncIterator[str]:
        """The role chunk of each choice, then its ``echo`` chunk if ``echo`` is not empty,
        then one SSE event per choice and output; the events of the outputs that arrived
        together go out as one write."""
        created = int(time.time())
        chunks = ChunkFrames("chat.completion.chunk", rid, created, self.model_name)
        num_gen = [0] * params.n  # per choice: tokens sent so far
        last_token: list[int | None] = [None] * params.n  # per choice: the last token sent
        tools = [_ToolStream(plan, self.tool_call_parser) for _ in range(params.n)]
        frames: list[str] = []

        def frame(c: CompletionOutput) -> str | None:
            num_gen[c.index] += len(c.token_ids)
            if c.token_ids:
                last_token[c.index] = c.token_ids[-1]
            if not c.text and not c.token_ids and c.finish_reason is None:
                return None
            logprobs = (self._chat_logprobs(c, params, params.logprobs, as_ids).model_dump_json()
                        if params.logprobs is not None else "null")
            delta, any_calls = tools[c.index].delta_json(c.text, c.finish_reason is not None)
            finish = self._finish_reason(plan, [None] if any_calls else [], c.finish_reason)
            if delta == "{}" and logprobs == "null" and finish is None:
                return None  # text held back by the tool parser
            usage = chunks.usage(num_prompt, num_gen[c.index]) if continuous_usage else "null"
            stop_reason = c.stop_reason if c.finish_reason else None
            return chunks.frame(c.index, delta, logprobs, finish, stop_reason,
                                matched_stop(c.finish_reason, stop_reason, last_token[c.index]), usage)

        def head(index: int, delta: P.DeltaMessage) -> str:
            """A chunk before the generated ones (the role, the echo)."""
            usage = P.UsageInfo(prompt_tokens=num_prompt, total_tokens=num_prompt) if continuous_usage else None
            return sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=self.model_name, usage=usage,
                                                      choices=[P.ChatCompletionResponseStreamChoice(index=index,
                                                                                                    delta=delta)]))

        try:
            for i in range(params.n):
                yield head(i, P.DeltaMessage(role="assistant", content=""))
            if echo:  # after every role chunk, as vLLM sends it
                for i in range(params.n):
                    yield head(i, P.DeltaMessage(content=echo))
            while True:
                try:
                    outs = await stream.next_outputs()
                except StopAsyncIteration:
                    break
                for out in outs:
                    for c in out.outputs:
                        if (f := frame(c)) is not None:
                            frames.append(f)
                if frames:
                    yield "".join(frames)
                    frames.clear()
            if include_usage:
                total = sum(num_gen)
                usage = P.UsageInfo(prompt_tokens=num_prompt, completion_tokens=total, total_tokens=num_prompt + total)
                yield sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=self.model_name, choices=[],
                                                         usage=usage))
        except EngineDeadError as e:
            yield "".join(frames) + sse(error_body(str(e), 500, "InternalServerError"))
        except Exception as e:  # noqa: BLE001
            logger.exception("streaming chat completion failed")
            yield "".join(frames) + sse(error_body(f"internal error: {e!r}", 500, "InternalServerError"))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    # -------------------------------------------------------------- tokenizer
    def _tokenize(self, req: P.TokenizeRequest) -> P.TokenizeResponse:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages.", "prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            conv = self._conversation(req.messages)
            text = self._apply_chat_template(conv, req.add_generation_prompt, req.continue_final_message, None)
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return P.TokenizeResponse(count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs)

    async def tokenize(self, req: P.TokenizeRequest) -> P.TokenizeResponse:
        self.check_model(req.model)
        return await self._in_tokenizer(self._tokenize, req)

    async def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        self.check_model(req.model)
        self._check_token_ids(req.tokens, "tokens")
        return P.DetokenizeResponse(prompt=await self._in_tokenizer(self.tokenizer.decode, req.tokens))

    def tokenizer_info(self) -> dict:
        tok = self.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template if isinstance(tok.chat_template, str) else None,
            "model_max_length": self.llm.max_model_len,
            "vocab_size": self.llm.vocab_size,
        }


class _ToolStream:
    """One streamed chat choice's tool calls: turns text deltas into ``DeltaMessage``s
    whose joined content and calls equal :meth:`ToolPlan.split` of the whole text.

    ``named``: the first delta opens the call (id, name), the text deltas are its
    arguments. ``required`` / ``auto``: each call whole once the plan's parser completes
    it, at most ``plan.max_calls``; ``auto`` also the parser's content. ``none``: plain
    content.
    """

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan = plan
        self.parser = plan.parser(parser)
        self.num_calls = 0
        self.call_id = ToolCall("", "").id

    def delta_json(self, text: str, final: bool) -> tuple[str, bool]:
        """:meth:`delta` as the JSON of the ``DeltaMessage`` (``{}`` when empty)."""
        if self.plan.mode == "none":  # the common case, without a pydantic model per token
            return f'{{"content":{_js(text)}}}', False
        delta, any_calls = self.delta(text, final)
        return delta.model_dump_json(), any_calls

    def delta(self, text: str, final: bool) -> tuple[P.DeltaMessage, bool]:
        """(the delta to send, whether this choice made any call so far)."""
        mode = self.plan.mode
        if mode == "none":
            return P.DeltaMessage(content=text), False
        if mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if self.num_calls == 0:
                call.update(id=self.call_id, type="function")
                call["function"]["name"] = self.plan.name
                self.num_calls = 1
            return P.DeltaMessage(tool_calls=[call]), True
        content, calls = self.parser.feed(text)
        if final:
            tail, more = self.parser.finish()
            content, calls = content + tail, calls + more
        limit = self.plan.max_calls
        dicts = []
        for call in calls:
            if limit is None or self.num_calls < limit:
                dicts.append({"index": self.num_calls, **call.to_dict()})
                self.num_calls += 1
        return P.DeltaMessage(content=content or None, tool_calls=dicts or None), self.num_calls > 0
