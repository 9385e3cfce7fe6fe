"""Offline inference API in the vLLM style: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import fields

from tqdm import tqdm

from tandem.engine.arg_utils import EngineArgs
from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, str]]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: HF folder, GGUF file, or config (with ``load_format="dummy"``); None for
            the embedded default (SmolLM2-135M-Instruct).
        **kwargs: any :class:`tandem.engine.arg_utils.EngineArgs` field (block_size, max_num_seqs,
            enable_prefix_caching, async_output_proc, ...). With ``data_parallel_size *
            tensor_parallel_size > 1`` the ranks are launched as engine-core processes
            (``tandem.engine.core_client``; under torchrun this process is one of them,
            ``tandem.engine.dp_engine``); ``engine`` is their front end.

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: a bad value, naming the field (before anything loads).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        if config.parallel_config.world_size > 1:  # data / tensor parallel: launch (or join) the ranks
            from tandem.engine.dp_engine import make_parallel_engine

            self.engine = make_parallel_engine(config)
        else:
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
            ValueError: invalid prompt or parameters (nothing is left queued).
        """
        if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts.")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._counter))
                self.engine.add_request(rid, prompt, p.clone(output_kind=RequestOutputKind.FINAL_ONLY))
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt) for c in convs]
        # The template already holds the BOS token where the model wants it.
        token_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        outs = self.generate(token_ids, sampling_params, use_tqdm)
        for o, p in zip(outs, prompts):
            o.prompt = p
        return outs

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
