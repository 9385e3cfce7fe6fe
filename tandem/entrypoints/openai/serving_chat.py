"""``/v1/chat/completions``: the conversation through the chat template, ``echo``, chat
``logprobs``, tool calls (:class:`ToolCallStream` when streamed); a whole response, or
its stream (:class:`ChatChunkStream`).
"""

from __future__ import annotations

from typing import Any

from tandem.engine.async_llm import AsyncLLM, RequestStream
from tandem.entrypoints.chat_utils import ChatMessageError, parse_chat_messages, render_chat
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.errors import bad_request
from tandem.entrypoints.openai.serving_engine import OpenAIServingBase, clamp_logprob, matched_stop
from tandem.entrypoints.openai.streaming import ChunkStream
from tandem.entrypoints.openai.structured_outputs import FieldError, ToolPlan, tool_plan
from tandem.entrypoints.openai.tool_parsers import ToolCall, parser_for_chat_template
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams


class OpenAIServingChat(OpenAIServingBase):
    """``/v1/chat/completions`` (:meth:`create_chat_completion`).

    Args:
        tool_call_parser: how chat outputs are parsed for tool calls (``hermes``,
            ``llama3_json``); None: from the chat template.
        Others: :class:`OpenAIServingBase`'s.
    """

    def __init__(self, llm: AsyncLLM, served_model_names: list[str], tool_call_parser: str | None = None,
                 return_tokens_as_token_ids: bool = False) -> None:
        super().__init__(llm, served_model_names, return_tokens_as_token_ids)
        template = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else None
        self.tool_call_parser = tool_call_parser or parser_for_chat_template(template)

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
                token=self._token_str(tok, as_ids), logprob=clamp_logprob(pos[tok].logprob),
                bytes=list(tb.token_bytes(tok)) if shown else None,
                top_logprobs=[P.ChatCompletionLogProb(token=self._token_str(t, as_ids),
                                                      logprob=clamp_logprob(v.logprob), bytes=list(tb.token_bytes(t)))
                              for t, v in tops]))
        return P.ChatCompletionLogProbs(content=content)

    async def create_chat_completion(self, req: P.ChatCompletionRequest, request_id: str):
        """Returns a ``ChatCompletionResponse`` or, when streaming, its :class:`ChatChunkStream`.

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
            streams = [self._start_beam_search(req, request_id, ids, max_tokens, "messages", max_tokens_field)]
        else:
            streams = await self._add(request_id, [ids], params, "messages", max_tokens_field)
        if req.stream:
            return ChatChunkStream(self, streams[0], len(ids), params, rid, include_usage, continuous_usage, as_ids,
                                   plan, echo)
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
                logprobs=logprobs, finish_reason=finish_reason(plan, bool(calls), c.finish_reason),
                stop_reason=c.stop_reason,
                matched_stop=matched_stop(c.finish_reason, c.stop_reason, c.token_ids[-1] if c.token_ids else None)))
        usage = P.UsageInfo(prompt_tokens=len(ids), completion_tokens=num_gen, total_tokens=len(ids) + num_gen)
        return P.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage,
                                        prompt_logprobs=self._prompt_logprobs(out, as_ids))


def finish_reason(plan: ToolPlan, any_calls: bool, finish: str | None) -> str | None:
    """A chat choice's ``finish_reason`` for the engine's ``finish``, when it made
    ``any_calls``: OpenAI answers a forced (named) function with "stop", chosen calls with
    "tool_calls"."""
    return "tool_calls" if any_calls and finish == "stop" and plan.mode != "named" else finish


class ToolCallStream:
    """One streamed chat choice's tool calls (a plan whose mode is not ``none``): turns
    text deltas into ``DeltaMessage``s whose joined content and calls equal
    :meth:`ToolPlan.split` of the whole text.

    ``named``: the first delta opens the call (id, name), the text deltas are its
    arguments. ``required`` / ``auto``: each call whole once the plan's parser completes
    it, at most ``plan.max_calls``; ``auto`` also the parser's content.
    """

    def __init__(self, plan: ToolPlan, parser: str) -> None:
        self.plan = plan
        self.parser = plan.parser(parser)
        self.num_calls = 0
        self.call_id = ToolCall("", "").id

    def delta(self, text: str, final: bool) -> tuple[P.DeltaMessage, bool]:
        """(the delta to send, whether this choice made any call so far)."""
        if self.plan.mode == "named":
            if self.num_calls == 0:
                self.num_calls = 1
                call = P.DeltaToolCall(0, self.call_id, "function", P.DeltaFunctionCall(self.plan.name, text))
            else:
                call = P.DeltaToolCall(0, function=P.DeltaFunctionCall(arguments=text))
            return P.DeltaMessage(tool_calls=[call]), True
        content, calls = self.parser.feed(text)
        if final:
            tail, more = self.parser.finish()
            content, calls = content + tail, calls + more
        limit = self.plan.max_calls
        deltas = []
        for call in calls:
            if limit is None or self.num_calls < limit:
                deltas.append(P.DeltaToolCall(self.num_calls, call.id, "function",
                                              P.DeltaFunctionCall(call.name, call.arguments)))
                self.num_calls += 1
        return P.DeltaMessage(content=content or None, tool_calls=deltas or None), self.num_calls > 0


class ChatChunkStream(ChunkStream):
    """The stream of a chat completion: the role chunk of each choice, then its ``echo``
    chunk if ``echo`` is not empty (after every role chunk, as vLLM sends them), then
    each choice's content or tool calls (:class:`ToolCallStream`) and logprobs as they
    come."""

    chunk_type = P.ChatCompletionStreamResponse
    what = "chat completion"

    def __init__(self, serving: OpenAIServingChat, stream: RequestStream, num_prompt: int, params: SamplingParams,
                 rid: str, include_usage: bool, continuous_usage: bool, as_ids: bool, plan: ToolPlan,
                 echo: str) -> None:
        super().__init__([stream], rid, serving.model_name, [num_prompt], params.n, include_usage, continuous_usage)
        self.serving = serving
        self.params = params
        self.as_ids = as_ids
        self.plan = plan
        self.echo = echo
        # Per choice; None without tools (the common case): the text is the content as it
        # comes, with nothing to parse per token.
        self.tools = None if plan.mode == "none" else [ToolCallStream(plan, serving.tool_call_parser)
                                                       for _ in range(params.n)]

    def head(self) -> list[P.ChatCompletionResponseStreamChoice]:
        n = self.params.n
        choices = [P.ChatCompletionResponseStreamChoice(i, P.DeltaMessage(role="assistant", content=""))
                   for i in range(n)]
        if self.echo:
            choices += [P.ChatCompletionResponseStreamChoice(i, P.DeltaMessage(content=self.echo)) for i in range(n)]
        return choices

    def choice(self, i: int, index: int, out: RequestOutput,
               c: CompletionOutput) -> P.ChatCompletionResponseStreamChoice | None:
        finish = c.finish_reason
        if not c.text and not c.token_ids and finish is None:
            return None
        params = self.params
        logprobs = None
        if params.logprobs is not None:
            logprobs = self.serving._chat_logprobs(c, params, params.logprobs, self.as_ids)
        if self.tools is None:
            delta, any_calls = P.DeltaMessage(content=c.text), False
        else:
            delta, any_calls = self.tools[index].delta(c.text, finish is not None)
        if finish is None:
            if delta.content is None and delta.tool_calls is None and logprobs is None:
                return None  # text held back by the tool parser
            return P.ChatCompletionResponseStreamChoice(index, delta, logprobs)
        return P.ChatCompletionResponseStreamChoice(
            index, delta, logprobs, finish_reason(self.plan, any_calls, finish), c.stop_reason,
            matched_stop(finish, c.stop_reason, self.last_token[index]))
