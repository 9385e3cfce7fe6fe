"""``/v1/completions``: prompts (text, token ids, several), ``echo``, completions
``logprobs`` with their ``text_offset``; a whole response, or its stream
(:class:`CompletionChunkStream`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tandem.engine.async_llm import RequestStream
from tandem.engine.token_bytes import TokenBytes
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.errors import OpenAIError, bad_request
from tandem.entrypoints.openai.serving_engine import OpenAIServingBase, clamp_logprob, matched_stop
from tandem.entrypoints.openai.streaming import ChunkStream
from tandem.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams


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


class OpenAIServingCompletion(OpenAIServingBase):
    """``/v1/completions`` (:meth:`create_completion`)."""

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
                res.token_logprobs.append(clamp_logprob(pos[tok].logprob))
                res.top_logprobs.append({self._token_str(t, as_ids): clamp_logprob(v.logprob) for t, v in pos.items()})
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

    async def create_completion(self, req: P.CompletionRequest, request_id: str):
        """Returns a ``CompletionResponse`` or, when streaming, its :class:`CompletionChunkStream`.

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
            return CompletionChunkStream(self, streams, prompts, echo_texts, echo_only, params, rid, include_usage,
                                         continuous_usage, self._as_ids(req))
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


class CompletionChunkStream(ChunkStream):
    """The stream of a completion: each choice's text and logprobs as they come; the first
    chunk of a choice starts with its prompt under ``echo`` (and its logprobs with the
    prompt's); ``echo`` with ``max_tokens`` 0 sends the prompt alone, finished by
    "length".

    ``prompts``, ``echo_texts``, ``echo_only``: as :meth:`OpenAIServingCompletion.create_completion`
    has them.
    """

    chunk_type = P.CompletionStreamResponse
    what = "completion"

    def __init__(self, serving: OpenAIServingCompletion, streams: Sequence[RequestStream],
                 prompts: list[tuple[str | None, list[int]]], echo_texts: list[str] | None, echo_only: bool,
                 params: SamplingParams, rid: str, include_usage: bool, continuous_usage: bool, as_ids: bool) -> None:
        super().__init__(streams, rid, serving.model_name, [len(ids) for _, ids in prompts], params.n, include_usage,
                         continuous_usage)
        self.serving = serving
        self.prompts = prompts
        self.echo_texts = echo_texts
        self.echo_only = echo_only
        self.counts_tokens = not echo_only
        self.params = params
        self.as_ids = as_ids
        self.offsets: dict[int, TextOffsets] = {}  # per choice: characters sent so far

    def choice(self, i: int, index: int, out: RequestOutput,
               c: CompletionOutput) -> P.CompletionResponseStreamChoice | None:
        offsets = self.offsets.get(index)
        first = offsets is None
        if first:
            offsets = self.offsets[index] = TextOffsets(self.serving.token_bytes)
        echo_only = self.echo_only
        text = "" if echo_only else c.text
        with_prompt = first and self.echo_texts is not None
        if with_prompt:
            text = self.echo_texts[i] + text
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = self.serving._completion_choice_logprobs(i, out, c, self.prompts, self.echo_texts, echo_only,
                                                                self.params, offsets, with_prompt, self.as_ids)
        if c.finish_reason is None:
            if not text and (echo_only or not c.token_ids):
                return None
            return P.CompletionResponseStreamChoice(index, text, logprobs)
        finish = "length" if echo_only else c.finish_reason
        return P.CompletionResponseStreamChoice(index, text, logprobs, finish, c.stop_reason,
                                                matched_stop(finish, c.stop_reason, self.last_token[index]))
