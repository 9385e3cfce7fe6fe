"""``use_beam_search`` in completions and chat completions (vLLM's extension): ``n`` is the
beam width, ``length_penalty`` and ``early_stopping`` as :class:`tandem.beam_search.BeamSearchParams`.

The search runs in the API server (:class:`tandem.beam_search.BeamSearch`): each round's
beams are engine requests of one token, so a beam search shares the engine's steps with
every other request. Its answer is the usual response, one choice per returned sequence,
best first; streamed (as vLLM streams it), the whole result comes as one chunk per choice
once the search ends. Fields whose effect on a beam search is undefined are refused (400)
rather than ignored: logprobs, stop conditions, output constraints and the sampling fields
that reshape the distribution.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tandem.beam_search import BeamSearch, BeamSearchParams
from tandem.engine.processor import MAX_LOGPROBS
from tandem.entrypoints.openai import protocol as P
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

# Request fields that must be unset (or a no-op value) with use_beam_search.
_UNSUPPORTED = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "stop", "stop_token_ids",
                "stop_regex", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "top_p", "top_k", "min_p", "seed", "response_format",
                "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "regex",
                "ebnf", "tools")
# Values that leave a field without effect (0.0 and False compare equal to 0).
_NO_OP = (None, 0, "", [], {})
_NO_OP_ALSO = {"top_p": (1,), "top_k": (-1,), "repetition_penalty": (1,)}


def beam_search_params(req: P._SamplingFields, max_tokens: int | None, prompt_len: int,
                       max_model_len: int) -> BeamSearchParams:
    """The beam search a ``use_beam_search`` request asks for (``max_tokens`` None: up to
    the context).

    Raises:
        ValueError: a field beam search cannot serve, or a bad value (the message names
            the field).
    """
    for name in _UNSUPPORTED:
        value = getattr(req, name, None)
        if value not in _NO_OP and value not in _NO_OP_ALSO.get(name, ()):
            raise ValueError(f"{name} is not supported with use_beam_search.")
    width, most = req.n or 1, MAX_LOGPROBS // 2
    if width > most:
        raise ValueError(f"n must be at most {most} with use_beam_search (each round asks for 2 x n logprobs, at "
                         f"most {MAX_LOGPROBS}), got {width}.")
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens if max_tokens is not None else max(1, max_model_len - prompt_len),
        ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
        early_stopping=req.early_stopping, include_stop_str_in_output=req.include_stop_str_in_output)
    return params


async def run_beam_search(request_id: str, search: BeamSearch,
                          generate_round: Callable[[str, list[list[int]], SamplingParams], Awaitable[list[RequestOutput]]],
                          decode: Callable[[list[int]], Awaitable[str]]) -> RequestOutput:
    """Run one prompt's beam search; its result as a finished ``RequestOutput`` (one
    completion per returned sequence, best first, ``cumulative_logprob`` its sum).

    Args:
        generate_round: ``(round id, prompts, params) -> their final outputs`` (in order).
        decode: generated token ids -> text.
    """
    round_params = search.params.round_params()
    prompt_token_ids = search.beams[0].tokens
    rnd = 0
    while beams := search.pending():
        outs = await generate_round(f"{request_id}-beam{rnd}", beams, round_params)
        search.advance([o.outputs[0].logprobs[0] for o in outs])
        rnd += 1
    outputs = []
    for i, s in enumerate(search.result().sequences):
        outputs.append(CompletionOutput(index=i, text=await decode(search.text_token_ids(s)),
                                        token_ids=s.tokens[len(prompt_token_ids):], cumulative_logprob=s.cum_logprob,
                                        finish_reason=s.finish_reason))
    return RequestOutput(request_id, None, list(prompt_token_ids), outputs, finished=True)


class BeamSearchStream:
    """A running beam search as the request stream the response paths read
    (``next_outputs``, ``abort``): one output, its finished result. ``abort()`` cancels the
    search, and with it the engine requests of its round."""

    def __init__(self, search: Awaitable[RequestOutput]) -> None:
        self._task = asyncio.ensure_future(search)
        self._done = False

    async def next_outputs(self) -> list[RequestOutput]:
        if self._done:
            raise StopAsyncIteration
        out = await self._task
        self._done = True
        return [out]

    def __aiter__(self) -> "BeamSearchStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return (await self.next_outputs())[0]

    def abort(self) -> None:
        self._task.cancel()
