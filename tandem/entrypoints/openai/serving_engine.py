"""What the OpenAI endpoints share: the front end's tokenizer thread, a request's sampling
parameters and engine requests, token strings and the choices' shared fields
(``matched_stop``, logprobs). Everything here runs on the server's event loop, except
tokenization (prompts, chat templates, token strings), which runs on one front-end
worker thread with the front end's own tokenizer copy, so that neither the event loop
nor the engine thread waits for it.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

from tandem.beam_search import BeamSearch
from tandem.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from tandem.engine.processor import PromptError
from tandem.engine.token_bytes import TokenBytes, token_id_string
from tandem.entrypoints.openai import protocol as P
from tandem.entrypoints.openai.beam_search import BeamSearchStream, beam_search_params, run_beam_search
from tandem.entrypoints.openai.errors import OpenAIError, bad_request, model_not_found
from tandem.entrypoints.openai.structured_outputs import FieldError, structured_outputs_of
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams
from tandem.structured_output import StructuredOutputsParams

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
# What the front end decides itself (their request fields differ from the engine's); every
# other field a request and SamplingParams share passes through by name (None: the default).
_SET_BY_SERVER = {"logit_bias", "max_tokens", "logprobs", "prompt_logprobs", "output_kind", "structured_outputs"}
REQUEST_SAMPLING_FIELDS = tuple(sorted(_SAMPLING_FIELDS & set(P._SamplingFields.model_fields) - _SET_BY_SERVER))


def _param_of(message: str) -> str | None:
    """The field a ``SamplingParams`` / engine message names first, if any."""
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_FIELDS else None


def prompt_error(e: PromptError, prompt_field: str, max_tokens_field: str = "max_tokens") -> OpenAIError:
    """The 400 of a prompt error, worded with the request's fields and naming the one at
    fault (``param``): the prompt's (``prompt_field``), or the budget's
    (``max_tokens_field``) when the prompt alone fits the context
    (:func:`tandem.engine.processor.check_context_length` decides)."""
    e = e.for_field(prompt_field, max_tokens_field)
    return bad_request(str(e), e.request_field)


def clamp_logprob(lp: float) -> float:
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


class OpenAIServingBase:
    """The state and steps both endpoints share, on top of an ``AsyncLLM``.

    Args:
        llm: the engine front end.
        served_model_names: names accepted in the ``model`` field (the first is reported).
        return_tokens_as_token_ids: logprob tokens spelled ``token_id:N`` unless a request's
            ``return_tokens_as_token_ids`` says otherwise (vLLM's server flag).
    """

    def __init__(self, llm: AsyncLLM, served_model_names: list[str], return_tokens_as_token_ids: bool = False) -> None:
        self.llm = llm
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.tokenizer = llm.tokenizer
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenizer")
        self.token_bytes = TokenBytes(self.tokenizer)

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
            shared = {name: value for name in REQUEST_SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
            params = SamplingParams(**shared, logit_bias=bias, max_tokens=max_tokens, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, output_kind=kind,
                                    structured_outputs=structured_outputs)
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

    def _gen_in_text(self, c: CompletionOutput, params: SamplingParams) -> list[bool]:
        """Which generated tokens of completion ``c`` are in its text."""
        shown = [self._in_output_text(t, params.skip_special_tokens) for t in c.token_ids]
        if shown and self._stop_token_hidden(c, params):
            shown[-1] = False
        return shown

    async def _add(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                   prompt_field: str, max_tokens_field: str = "max_tokens") -> list[RequestStream]:
        """Add one engine request per prompt, all at once; on any rejection abort the others.
        ``prompt_field`` / ``max_tokens_field``: the request fields the prompts and the
        output budget came from, named in prompt errors."""
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
                raise prompt_error(e, prompt_field, max_tokens_field)
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
                           prompt_field: str, max_tokens_field: str = "max_tokens") -> BeamSearchStream:
        """Start ``req``'s beam search over the prompt ``ids`` (:mod:`tandem.entrypoints.openai.beam_search`).

        Raises:
            OpenAIError: 400, a field beam search cannot serve or a bad value, the prompt
                and ``max_tokens`` over the context as a sampled request's (before it starts).
        """
        proc = self.llm.processor
        try:
            params = beam_search_params(req, max_tokens, len(ids), proc.max_model_len)
            search = BeamSearch(ids, params, proc.eos_token_ids, proc.max_model_len)
        except PromptError as e:
            raise prompt_error(e, prompt_field, max_tokens_field) from None
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), name if name in type(req).model_fields else None) from None

        async def generate_round(rid: str, prompts: list[list[int]], round_params: SamplingParams):
            return await self._collect(await self._add(rid, prompts, round_params, prompt_field, max_tokens_field))

        async def decode(token_ids: list[int]) -> str:
            return await self._in_tokenizer(self.llm.tokenizer.decode, token_ids, req.skip_special_tokens)

        return BeamSearchStream(run_beam_search(request_id, search, generate_round, decode))

    def _prompt_logprobs(self, out: RequestOutput, as_ids: bool) -> list[dict[str, P.PromptLogprob] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob, rank, text."""
        if out.prompt_logprobs is None:
            return None
        return [None if pos is None else
                {str(t): P.PromptLogprob(logprob=clamp_logprob(v.logprob), rank=v.rank,
                                         decoded_token=self._token_str(t, as_ids)) for t, v in pos.items()}
                for pos in out.prompt_logprobs]
