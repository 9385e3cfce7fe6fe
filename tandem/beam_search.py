"""Beam search over the engine (vLLM's ``beam_search``: ``LLM.beam_search`` and the
server's ``use_beam_search``).

Each round expands every live beam by one token: the beam's tokens go to the engine as
one request of ``max_tokens=1`` that asks for ``2 * beam_width`` logprobs, so beams run
inside the ordinary one-step-ahead loop, batched with every other request, and share
their prompt's and their common prefix's KV blocks through the prefix cache (no copies:
only the part of a beam past its last full block is computed again). Each candidate
(a beam plus one of its returned tokens) scores ``cum_logprob / len(tokens) **
length_penalty`` (:func:`beam_search_score`; prompt tokens counted, an EOS token not, as
vLLM); a candidate ending in EOS is a finished hypothesis, the best ``beam_width`` of the
others are the next beams. The search ends after ``max_tokens`` rounds, when no beam is
left, or, with ``early_stopping``, once ``beam_width`` hypotheses have finished (Hugging
Face's ``early_stopping=True``); the best ``beam_width`` of the finished hypotheses and
the last beams (the finished ones alone after an early stop) are the result.

The driver (:meth:`BeamSearch.pending` / :meth:`BeamSearch.advance`) is shared by the
offline :meth:`tandem.entrypoints.llm.LLM.beam_search` and the server, which differ
only in how a round's requests reach the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.engine.processor import check_context_length
from tandem.outputs import PositionLogprobs
from tandem.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's ``BeamSearchParams``).

    Attributes:
        beam_width: beams kept per prompt, and sequences returned (>= 1; at most
            ``max_logprobs // 2``: each round asks for ``2 * beam_width`` logprobs).
        max_tokens: most generated tokens per beam (>= 1).
        ignore_eos: EOS ends no hypothesis (beams run to ``max_tokens``).
        temperature: the temperature of each round's own sample, which joins the
            candidates beside the top ``2 * beam_width`` (0: greedy, no extra candidate;
            a sample is most often among the top ones already), as vLLM.
        length_penalty: exponent of the length in the score (1.0: mean logprob per
            token; 0: the sum; > 1 favours longer sequences).
        early_stopping: end once ``beam_width`` hypotheses have finished, and return only
            finished ones then (transformers' ``early_stopping=True``).
        include_stop_str_in_output: decode the EOS token with the rest (its text shows
            where the decode keeps special tokens: the server's ``skip_special_tokens``
            false).

    Raises:
        ValueError: a value out of range, naming the field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}.")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}.")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}.")

    def check_width(self, max_logprobs: int) -> None:
        """Raises ValueError when ``2 * beam_width`` logprobs exceed ``max_logprobs``."""
        if 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width must be at most {max_logprobs // 2} (each round asks for 2 x beam_width "
                             f"logprobs, at most {max_logprobs}), got {self.beam_width}.")

    def round_params(self) -> SamplingParams:
        """The sampling parameters of one round's request per beam."""
        return SamplingParams(n=1, max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One beam or finished hypothesis.

    Attributes:
        tokens: the prompt's token ids, then the generated ones.
        logprobs: per generated token, the logprobs its round returned (the chosen token
            among them).
        cum_logprob: sum of the generated tokens' logprobs (natural log).
        text: the generated text (set on the result).
        finish_reason: "stop" (EOS) or "length" (set on the result).
    """

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's result: its best ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: set[int], length_penalty: float) -> float:
    """``cum_logprob / L ** length_penalty`` with ``L`` the length of ``tokens`` (prompt
    included), less one when the last token is EOS (vLLM's ``get_beam_search_score``)."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The beam search of one prompt (module docstring).

    Args:
        prompt_token_ids: the prompt.
        params: the search settings.
        eos_token_ids: the tokens that end a hypothesis (unless ``ignore_eos``).
        max_model_len: the context length.

    Raises:
        PromptError: the prompt and ``max_tokens`` do not fit in ``max_model_len``
            (:func:`tandem.engine.processor.check_context_length`).
    """

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.prompt_len = len(prompt_token_ids)
        self.params, self.eos = params, set(eos_token_ids)
        check_context_length(self.prompt_len, params.max_tokens, max_model_len)  # a sampled request's check
        self.rounds_left = params.max_tokens
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []

    def _score(self, s: BeamSearchSequence) -> float:
        return beam_search_score(s.tokens, s.cum_logprob, self.eos, self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        """The token ids of each beam to expand this round ([] once the search is over)."""
        done = self.rounds_left <= 0 or (self.params.early_stopping and len(self.finished) >= self.params.beam_width)
        return [] if done else [b.tokens for b in self.beams]

    def advance(self, round_logprobs: list[PositionLogprobs]) -> None:
        """Take in the round's logprobs, one position per beam of :meth:`pending` (in its
        order): every returned token extends its beam into a candidate."""
        candidates = []
        for beam, lps in zip(self.beams, round_logprobs, strict=True):
            for tok, lp in lps.items():
                cand = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lps], beam.cum_logprob + lp.logprob)
                if tok in self.eos and not self.params.ignore_eos:
                    self.finished.append(cand)
                else:
                    candidates.append(cand)
        candidates.sort(key=self._score, reverse=True)
        self.beams = candidates[:self.params.beam_width]
        self.rounds_left = 0 if not self.beams else self.rounds_left - 1

    def result(self) -> BeamSearchOutput:
        """The best ``beam_width`` of the finished hypotheses and the last beams (of the
        finished ones alone when ``early_stopping`` ended the search, as transformers),
        best first, with their ``finish_reason`` (their ``text`` is the caller's to set:
        :meth:`text_token_ids`)."""
        width = self.params.beam_width
        stopped_early = self.params.early_stopping and len(self.finished) >= width
        pool = self.finished if stopped_early else self.finished + self.beams
        best = sorted(pool, key=self._score, reverse=True)[:width]
        for s in best:
            s.finish_reason = "stop" if self._ended(s) else "length"
        return BeamSearchOutput(best)

    def _ended(self, s: BeamSearchSequence) -> bool:
        return len(s.tokens) > self.prompt_len and s.tokens[-1] in self.eos and not self.params.ignore_eos

    def text_token_ids(self, s: BeamSearchSequence) -> list[int]:
        """The generated token ids whose text is ``s``'s text: its EOS left out unless
        ``include_stop_str_in_output``."""
        gen = s.tokens[self.prompt_len:]
        return gen[:-1] if self._ended(s) and not self.params.include_stop_str_in_output else gen


__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_search_score"]
