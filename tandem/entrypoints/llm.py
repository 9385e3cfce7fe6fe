"""Offline inference API in the vLLM style: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any

import msgspec
from tqdm import tqdm

from tandem.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tandem.engine.arg_utils import EngineArgs
from tandem.engine.processor import MAX_LOGPROBS, parse_prompt
from tandem.engine.stat_logger import SpecDecodingStats
from tandem.entrypoints.chat_utils import parse_chat_messages, render_chat
from tandem.model_loader.model_path import check_model_path
from tandem.outputs import RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]
Prompt = str | list[int] | Mapping


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list of single prompts (each then checked by the engine).

    Raises:
        ValueError: ``prompts`` is none of the accepted forms.
    """
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a string, a list of token ids, a {{'prompt': ...}} / "
                         f"{{'prompt_token_ids': [...]}} dict, or a list of those; got {type(prompts).__name__}.")
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _params_list(sampling_params, n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt.

    Raises:
        ValueError: not a SamplingParams, None or a list of them, one per prompt.
    """
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    if isinstance(sampling_params, (str, bytes, Mapping)) or not isinstance(sampling_params, Sequence):
        raise ValueError(f"sampling_params must be a SamplingParams, a list of them or None; "
                         f"got {type(sampling_params).__name__}.")
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts.")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}.")
    return params


def _conversations(messages: Any) -> list[tuple[str, list[dict[str, Any]]]]:
    """``chat``'s messages (one conversation or a list of them) as ``(field, conversation)``
    pairs, each conversation checked and made template-ready by :func:`parse_chat_messages`.

    Raises:
        ValueError: naming the field (``messages[0].content``, ``messages[1][0].role`` in a
            list of conversations): see :func:`parse_chat_messages`.
    """
    def is_list(x: Any) -> bool:
        return isinstance(x, Sequence) and not isinstance(x, (str, bytes))

    # Only a list of lists is several conversations: anything else is checked as one, so that
    # a malformed message is named as a message.
    if is_list(messages) and messages and is_list(messages[0]):
        return [(f"messages[{i}]", parse_chat_messages(c, f"messages[{i}]")) for i, c in enumerate(messages)]
    return [("messages", parse_chat_messages(messages))]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: HF folder, GGUF file, or config (with ``load_format="dummy"``); None for
            the embedded default (SmolLM2-135M-Instruct).
        **kwargs: any :class:`tandem.engine.arg_utils.EngineArgs` field (block_size, max_num_seqs,
            enable_prefix_caching, async_output_proc, ...). With ``data_parallel_size *
            tensor_parallel_size > 1`` the ranks are launched as engine-core processes
            (``tandem.engine.core_client``; under torchrun this process is one of them,
            ``tandem.engine.external_launcher``); ``engine`` is their front end.

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: a bad value, naming the field, or a model path that does not exist (before
            torch is imported or anything loads).
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a path (str), got {type(model).__name__}.")
        config = EngineArgs(model=None if model is None else os.fspath(model), **kwargs).create_engine_config()
        check_model_path(config.model_config.model)
        # Imported here, not at module level: the checks above answer before torch loads.
        from tandem.distributed.parallel_state import env_rendezvous
        from tandem.engine.launch import check_tensor_parallel_size

        check_tensor_parallel_size(config)  # before any rank starts and loads

        if config.parallel_config.world_size > 1 and env_rendezvous():  # torchrun & co.: this process is a rank
            from tandem.engine.external_launcher import make_external_launcher_engine

            self.engine = make_external_launcher_engine(config)
        else:  # one rank in this process, or several spawned as core processes (core_client)
            from tandem.engine.llm_engine import LLMEngine

            self.engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The values of the sampling fields a request leaves unset: the model's
        generation_config.json (``generation_config="auto"``), else vLLM's defaults."""
        return self.engine.get_default_sampling_params()

    def generate(self, prompts: str | Mapping | Sequence[str | list[int] | Mapping],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for prompts, in input order: strings, token-id lists, or
        vLLM's ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` dicts (one or a list).

        ``sampling_params`` is one for all prompts or one per prompt.

        Raises:
            ValueError: invalid prompt or parameters, naming the field (nothing is left queued).
        """
        prompts = _prompt_list(prompts)
        ids = self._add(prompts, _params_list(sampling_params, len(prompts)), RequestOutputKind.FINAL_ONLY)
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: str | Mapping | Sequence[str | list[int] | Mapping], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for each prompt (any form ``generate`` takes), all prompts' beams
        batched in each round (:mod:`tandem.beam_search`); results in input order.

        Raises:
            ValueError: ``params`` is not a BeamSearchParams or its beam width is too wide
                for the logprobs a request may ask, a prompt is invalid or leaves no room
                for a token within the context.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        params.check_width(MAX_LOGPROBS)
        proc = self.engine.processor
        searches = []
        for prompt in _prompt_list(prompts):
            text, ids = parse_prompt(prompt)
            searches.append(BeamSearch(proc.tokenizer.encode(text) if ids is None else list(ids), params,
                                       proc.eos_token_ids, proc.max_model_len))
        round_params = params.round_params()
        bar = tqdm(total=params.max_tokens, desc="Beam search rounds", disable=not use_tqdm, dynamic_ncols=True)
        while True:
            pending = [s.pending() for s in searches]
            flat = [{"prompt_token_ids": t} for p in pending for t in p]
            if not flat:
                break
            outs = iter(self.generate(flat, round_params, use_tqdm=False))
            for search, beams in zip(searches, pending):
                if beams:
                    search.advance([next(outs).outputs[0].logprobs[0] for _ in beams])
            bar.update(1)
        bar.close()
        results = [s.result() for s in searches]
        for search, result in zip(searches, results):
            for seq in result.sequences:
                seq.text = self.engine.tokenizer.decode(search.text_token_ids(seq), skip_special_tokens=True)
        return results

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt (any single form ``generate`` takes), yielding its output as it
        grows: each ``RequestOutput`` holds the text and token ids so far; the last one is
        finished. Leaving the loop early aborts the request.

        Raises:
            ValueError: invalid prompt or parameters, naming the field.
        """
        (rid,) = self._add([prompt], _params_list(sampling_params, 1), RequestOutputKind.CUMULATIVE)
        return self._follow(rid)

    def _follow(self, rid: str) -> Iterator[RequestOutput]:
        finished = False
        try:
            while not finished and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request([rid])

    def chat(self, messages: ChatMessages | Sequence[ChatMessages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        Messages are checked as OpenAI's chat API checks them (:mod:`tandem.entrypoints.chat_utils`).

        Raises:
            ValueError: ``messages`` is not a conversation or a list of them, a message is
                malformed (the message names the field, e.g. ``messages[0].content``) or the chat
                template refuses it, or invalid parameters.
        """
        prompts, token_ids = self._chat_prompts(messages, add_generation_prompt)
        outs = self.generate(token_ids, sampling_params, use_tqdm)
        for o, p in zip(outs, prompts):
            o.prompt = p
        return outs

    def stream_chat(self, messages: ChatMessages, sampling_params: SamplingParams | None = None,
                    add_generation_prompt: bool = True) -> Iterator[RequestOutput]:
        """:meth:`stream` for one conversation, through the model's chat template.

        Raises:
            ValueError: ``messages`` is not one conversation, a message is malformed or refused by
                the chat template (naming the field, as :meth:`chat`), or invalid parameters.
        """
        prompts, token_ids = self._chat_prompts(messages, add_generation_prompt)
        if len(token_ids) != 1:
            raise ValueError("messages must be one conversation; chat() takes several.")
        return self._with_prompt(self.stream(token_ids[0], sampling_params), prompts[0])

    @staticmethod
    def _with_prompt(outs: Iterator[RequestOutput], prompt: str) -> Iterator[RequestOutput]:
        for out in outs:
            out.prompt = prompt
            yield out

    def _chat_prompts(self, messages: Any, add_generation_prompt: bool) -> tuple[list[str], list[list[int]]]:
        """The rendered prompts of ``messages`` and their token ids.

        Raises:
            ValueError: a malformed message or one the chat template refuses, naming the field.
        """
        tok = self.engine.tokenizer
        prompts = [render_chat(tok, conv, add_generation_prompt, field=field)
                   for field, conv in _conversations(messages)]
        # The template already holds the BOS token where the model wants it.
        return prompts, [tok.encode(p, add_special_tokens=False) for p in prompts]

    def _add(self, prompts: list, params: list[SamplingParams], kind: RequestOutputKind) -> list[str]:
        """Queue the requests; on a bad one, none stays queued."""
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._counter))
                self.engine.add_request(rid, prompt, p.clone(output_kind=kind))
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2, dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[i] for i in ids]


class DPLLM(LLM):
    """Offline data-parallel inference: ``LLM`` with ``data_parallel_size`` replicas (2 by
    default) launched on this machine (or joined under torchrun). ``LLM`` itself does the
    same whenever ``data_parallel_size * tensor_parallel_size > 1``; this class only names
    it and is a context manager that shuts the ranks down.

    Example: ``with DPLLM(model, data_parallel_size=2, enable_expert_parallel=True) as llm:
    llm.generate(prompts, params)``.
    """

    def __init__(self, model: str | None = None, *, data_parallel_size: int = 2, **kwargs) -> None:
        super().__init__(model, data_parallel_size=data_parallel_size, **kwargs)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "DPLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def spec_decode_counts(llm) -> SpecDecodingStats | None:
    """Speculative-decoding counters so far of an in-process engine core; None for the
    DP/TP front-ends, which do not speculate."""
    core = getattr(llm.engine.client, "core", None)
    if core is None:
        return None
    return SpecDecodingStats.from_stats(msgspec.structs.asdict(core.scheduler_stats()))
