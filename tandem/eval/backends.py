"""Where an evaluation runs: Tandem's offline ``LLM`` or an OpenAI-compatible server.

Both answer two questions, always greedily:

- ``generate(prompts, max_tokens, stop)``: the completion text of each prompt.
- ``choice_logprobs(contexts, continuations)``: for each context, the log-probability of
  each continuation (MMLU's ``" A"``..``" D"``). When every continuation is one token (the
  usual case), one request per context asks for the next token with the top ``top_n``
  logprobs (raw model logits, fp32). A continuation absent from the top ``top_n`` has a
  lower log-probability than all of them, so the argmax over continuations is exact as long
  as one of them is present; its value is reported as None. When none is present, or a
  continuation is not a single token, each continuation is scored exactly instead, as
  lm-eval's ``loglikelihood`` does: the prompt ``context + continuation`` with prompt
  logprobs (offline) or ``echo`` + ``logprobs`` (server), summing the continuation tokens.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from tandem.sampling_params import SamplingParams


@dataclass
class Generation:
    text: str
    token_ids: list[int] | None = None
    prompt_num_tokens: int | None = None
    finish_reason: str | None = None
    truncated_prompt_tokens: int = 0
    error: str | None = None


@dataclass
class ChoiceScores:
    """Log-probabilities of the continuations (None: below the returned top-N)."""

    logprobs: list[float | None]
    method: str  # "next-token-topN" or "loglikelihood"
    top_token: str | None = None  # the greedy next token's text (next-token method)
    prompt_num_tokens: int | None = None
    truncated_prompt_tokens: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def argmax(self) -> int | None:
        vals = [(-math.inf if v is None else v) for v in self.logprobs]
        if all(v == -math.inf for v in vals):
            return None
        return max(range(len(vals)), key=lambda i: (vals[i], -i))  # first of equal maxima, as np.argmax


class OfflineBackend:
    """Tandem's offline engine (``tandem.entrypoints.llm.LLM``).

    Prompts are tokenized here with the engine's tokenizer, as the engine would, and cut from
    the left when they do not fit in ``max_model_len`` with the completion (as lm-eval does).
    """

    kind = "offline"

    def __init__(self, llm, top_n: int = 20, use_tqdm: bool = False) -> None:
        self.llm = llm
        self.top_n = top_n
        self.use_tqdm = use_tqdm
        self.tokenizer = llm.get_tokenizer()

    @classmethod
    def from_engine_args(cls, top_n: int = 20, use_tqdm: bool = False, **engine_kwargs) -> "OfflineBackend":
        from tandem.entrypoints.llm import LLM

        return cls(LLM(**engine_kwargs), top_n=top_n, use_tqdm=use_tqdm)

    def describe(self) -> dict:
        from dataclasses import asdict

        import msgspec

        engine = self.llm.engine
        config = engine.config
        # The resolved path: the embedded default when no model was given; beside the
        # settings as given, what the engine resolved them to.
        return {"backend": self.kind, "model": config.model_config.model, "engine_config": asdict(config),
                "resolved": msgspec.to_builtins(msgspec.structs.asdict(engine.resolved))}

    def close(self) -> None:
        self.llm.engine.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.resolved.max_model_len

    def _fit(self, ids: list[int], room: int) -> tuple[list[int], int]:
        keep = self.max_model_len - room
        if len(ids) <= keep:
            return ids, 0
        return ids[len(ids) - keep:], len(ids) - keep

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # Same call as LLMEngine.add_request on a text prompt.
        return [self.tokenizer.encode(t) for t in texts]

    def generate(self, prompts: list[str], max_tokens: int, stop: list[str]) -> list[Generation]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(stop))
        fitted = [self._fit(ids, max_tokens) for ids in self._encode(prompts)]
        outs = self.llm.generate([ids for ids, _ in fitted], params, use_tqdm=self.use_tqdm)
        return [Generation(o.outputs[0].text, list(o.outputs[0].token_ids), len(o.prompt_token_ids),
                           o.outputs[0].finish_reason, cut) for o, (_, cut) in zip(outs, fitted)]

    def choice_logprobs(self, contexts: list[str], continuations: list[str]) -> list[ChoiceScores]:
        ctx_ids = self._encode(contexts)
        cont_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in continuations]
        single = all(len(c) == 1 for c in cont_ids)
        results: list[ChoiceScores | None] = [None] * len(contexts)
        todo_next: list[int] = []
        if single:
            # lm-eval tokenizes context + continuation whole and splits after the context.
            for i, text in enumerate(contexts):
                whole = self.tokenizer.encode(text + continuations[0])
                if whole[: len(ctx_ids[i])] == ctx_ids[i] and whole[len(ctx_ids[i]):] == cont_ids[0]:
                    todo_next.append(i)
        planned = set(todo_next)
        exact = [i for i in range(len(contexts)) if i not in planned]
        if todo_next:
            params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=self.top_n)
            fitted = [self._fit(ctx_ids[i], 1) for i in todo_next]
            outs = self.llm.generate([ids for ids, _ in fitted], params, use_tqdm=self.use_tqdm)
            for i, o, (_, cut) in zip(todo_next, outs, fitted):
                pos = o.outputs[0].logprobs[0]
                lps = [pos[c[0]].logprob if c[0] in pos else None for c in cont_ids]
                top = o.outputs[0].token_ids[0]
                sc = ChoiceScores(lps, f"next-token-top{self.top_n}", self.tokenizer.decode([top]),
                                  len(o.prompt_token_ids), cut)
                if all(v is None for v in lps):
                    exact.append(i)
                else:
                    results[i] = sc
        if exact:
            exact.sort()
            reqs, index = [], []
            for i in exact:
                for j, c in enumerate(cont_ids):
                    ids, cut = self._fit(ctx_ids[i] + c, 1)
                    reqs.append(ids)
                    index.append((i, j, len(c), cut))
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            outs = self.llm.generate(reqs, params, use_tqdm=self.use_tqdm)
            for i in exact:
                results[i] = ChoiceScores([0.0] * len(continuations), "loglikelihood")
            for (i, j, n, cut), o, ids in zip(index, outs, reqs):
                plp = o.prompt_logprobs
                total = sum(plp[p][ids[p]].logprob for p in range(len(ids) - n, len(ids)))
                results[i].logprobs[j] = total
                results[i].prompt_num_tokens = len(ids) - n
                results[i].truncated_prompt_tokens = cut
        return results  # type: ignore[return-value]


class ServerBackend:
    """An OpenAI-compatible server (``tandem serve``, vLLM, ...) through ``/v1/completions``.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name; None: the first of ``/v1/models``.
        concurrency: requests in flight at once.
        top_n: ``logprobs`` asked for the next-token method (servers cap it: vLLM and
            Tandem at 20, OpenAI at 5).
        use_tqdm: a progress bar over the requests of each call.

    Raises:
        ConnectionError: no server answers at ``base_url``.
    """

    kind = "server"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 concurrency: int = 8, top_n: int = 20, timeout: float = 600.0, use_tqdm: bool = False) -> None:
        import openai

        from tandem.entrypoints.openai.client import served_models

        models = served_models(base_url)  # one clear error when no server answers
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout, max_retries=2)
        self.base_url = base_url
        self.model = model or models[0]
        self.concurrency = max(1, concurrency)
        self.top_n = top_n
        self.use_tqdm = use_tqdm

    def describe(self) -> dict:
        return {"backend": self.kind, "base_url": self.base_url, "model": self.model}

    def close(self) -> None:
        self.client.close()

    def _map(self, fn, items):
        with ThreadPoolExecutor(self.concurrency) as ex:
            return list(tqdm(ex.map(fn, items), total=len(items), desc="Requests", disable=not self.use_tqdm,
                             dynamic_ncols=True))

    def generate(self, prompts: list[str], max_tokens: int, stop: list[str]) -> list[Generation]:
        def one(p: str) -> Generation:
            try:
                r = self.client.completions.create(model=self.model, prompt=p, max_tokens=max_tokens, temperature=0.0,
                                                   stop=list(stop) or None)
            except Exception as e:  # noqa: BLE001 - a failed item is recorded, not fatal
                return Generation("", error=f"{type(e).__name__}: {e}")
            c = r.choices[0]
            return Generation(c.text, None, getattr(r.usage, "prompt_tokens", None), c.finish_reason)

        return self._map(one, prompts)

    def _continuation_tokens(self, ctx: str, cont: str) -> tuple[float, int, bool]:
        """(log-probability of ``cont`` after ``ctx``, its token count, whether a token starts
        exactly at the context's end), from ``echo`` + ``logprobs``."""
        r = self.client.completions.create(model=self.model, prompt=ctx + cont, max_tokens=1, temperature=0.0,
                                           echo=True, logprobs=0)
        lp = r.choices[0].logprobs
        end = len(ctx) + len(cont)
        total, count = 0.0, 0
        for off, v in zip(lp.text_offset, lp.token_logprobs):
            if len(ctx) <= off < end:
                total += v
                count += 1
        return total, count, len(ctx) in lp.text_offset

    def choice_logprobs(self, contexts: list[str], continuations: list[str]) -> list[ChoiceScores]:
        if not contexts:
            return []
        # Without the server's tokenizer: the next-token method needs every continuation to be
        # one token right after the context; probe that on the first context's tail (the
        # tokens at its end do not depend on text far before them).
        probe = [self._continuation_tokens(contexts[0][-256:], c) for c in continuations]
        single = all(n == 1 and aligned for _, n, aligned in probe)

        def exact(ctx: str, top: str | None = None) -> ChoiceScores:
            return ChoiceScores([self._continuation_tokens(ctx, c)[0] for c in continuations], "loglikelihood", top)

        def one(ctx: str) -> ChoiceScores:
            try:
                if not single:
                    return exact(ctx)
                r = self.client.completions.create(model=self.model, prompt=ctx, max_tokens=1, temperature=0.0,
                                                   logprobs=self.top_n)
                c = r.choices[0]
                top = (c.logprobs.top_logprobs or [None])[0] or {}
                lps = [top.get(cont) for cont in continuations]
                if any(v is not None for v in lps):
                    return ChoiceScores(lps, f"next-token-top{self.top_n}", c.text,
                                        getattr(r.usage, "prompt_tokens", None))
                return exact(ctx, c.text)
            except Exception as e:  # noqa: BLE001 - a failed item is recorded, not fatal
                return ChoiceScores([None] * len(continuations), "error", error=f"{type(e).__name__}: {e}")

        return self._map(one, contexts)
