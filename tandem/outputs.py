"""Outputs: the model runner's per-step result (``ModelRunnerOutput``, vLLM's
``v1/outputs.py``) and the request outputs returned to users (vLLM's ``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token: natural log, fp32 from the raw model logits.

    ``rank`` is 1 for the most likely token; ``decoded_token`` is its text, or
    ``bytes:\\xNN...`` (OpenAI's spelling) when the token is not valid UTF-8 on its own
    (part of a character).
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled / prompt token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is None while running, else "stop" (EOS, stop token or stop string)
    "length" (max_tokens or context length) or "abort". ``stop_reason`` is the stop string
    or stop token id that ended it (None for EOS and length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Output of one request: prompt, its completions, and whether it is finished.

    ``prompt_logprobs[0]`` is None (the first prompt token has no context).
    ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    ``error`` says why the engine dropped the request (its grammar did not compile, its
    model step failed); its unfinished completions then end as "abort".
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens computed in one step for one sequence.

    ``token_ids`` / ``logprobs``: ``[n, 1 + K]`` (the actual next prompt token first, then
    the top K); ``ranks``: ``[n]``; ``start``: index in the prompt of the first token they
    score (>= 1).
    """

    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """Host-side result of one model step: one sampled token per sampling sequence
    (``seq_ids[i]`` sampled ``sampled_token_ids[i]``), in the order the runner sampled them.

    ``accepted_token_ids``: row -> every token a row with draft tokens emitted (its
    accepted drafts, then the recovered or bonus token; ``sampled_token_ids[row]`` is the
    first of them); rows without drafts are not in it; ``accepted_logprobs`` has, for such
    rows that asked for logprobs, one ``logprobs`` entry per emitted token;
    ``num_draft_tokens`` has, for such rows, the number of drafts verified. ``draft_token_ids``: with a draft
    model, per row the drafts proposed for the sequence's next step (the K tokens after its
    last emitted one); None otherwise."""

    seq_ids: list[int]
    sampled_token_ids: list[int]
    # Per sampling row, when any row asked for logprobs: ([1+K] ids, [1+K] logprobs, rank).
    logprobs: list[tuple[list[int], list[float], int]] | None = None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    accepted_token_ids: dict[int, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[int, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    num_draft_tokens: dict[int, int] = field(default_factory=dict)
    draft_token_ids: list[list[int]] | None = None
    # Pipeline parallelism: each stage's host seconds busy with the step (PipelineStage).
    stage_busy_s: list[float] | None = None
