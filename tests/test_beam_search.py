"""The beam search driver on a made-up model (a table of next-token logprobs by the last
token): candidates, finished hypotheses at EOS, the length penalty, early stopping, the
context limit, and the checks of its parameters."""

from __future__ import annotations

import math

import pytest

from tandem.beam_search import BeamSearch, BeamSearchParams, beam_search_score
from tandem.engine.processor import PromptError
from tandem.outputs import Logprob

EOS = 0
# Next-token probabilities after each last token (7: the prompt's end).
TABLE = {
    7: {1: 0.5, 2: 0.3, 3: 0.2},
    1: {EOS: 0.6, 4: 0.4},
    2: {4: 0.9, 5: 0.1},
    3: {5: 1.0},
    4: {6: 0.7, EOS: 0.3},
    5: {6: 1.0},
    6: {6: 1.0},
    EOS: {EOS: 1.0},  # only reached with ignore_eos
}


def _round(beams: list[list[int]], top: int) -> list[dict[int, Logprob]]:
    out = []
    for tokens in beams:
        probs = sorted(TABLE[tokens[-1]].items(), key=lambda kv: -kv[1])[:top]
        out.append({t: Logprob(math.log(p), r + 1) for r, (t, p) in enumerate(probs)})
    return out


def _search(params: BeamSearchParams, prompt=(9, 7), max_model_len: int = 100) -> BeamSearch:
    bs = BeamSearch(list(prompt), params, {EOS}, max_model_len)
    while beams := bs.pending():
        bs.advance(_round(beams, 2 * params.beam_width))
    return bs


def test_two_beams_keep_the_best_and_finish_at_eos():
    """By hand: round 1 keeps 1 (.5) and 2 (.3); round 2 finishes 1-EOS (.3) and keeps 2-4
    (.27) and 1-4 (.2); round 3 ends with 2-4-6 (.189) and 1-4-6 (.14). 3-5-6 (.2) is better
    than 2-4-6 but fell out in round 1: beam search is not exhaustive."""
    bs = _search(BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
    out = bs.result()
    assert [s.tokens for s in out.sequences] == [[9, 7, 1, EOS], [9, 7, 2, 4, 6]]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([math.log(0.3), math.log(0.189)])
    assert [s.finish_reason for s in out.sequences] == ["stop", "length"]
    assert bs.text_token_ids(out.sequences[0]) == [1]
    assert bs.text_token_ids(out.sequences[1]) == [2, 4, 6]
    assert len(bs.finished) == 3  # 1-EOS, 2-4-EOS, 1-4-EOS


def test_ignore_eos_keeps_eos_as_an_ordinary_token():
    out = _search(BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True, length_penalty=0.0)).result()
    assert all(len(s.tokens) == 5 and s.finish_reason == "length" for s in out.sequences)
    assert out.sequences[0].tokens[:4] == [9, 7, 1, EOS]


def test_length_penalty_favours_longer_sequences():
    short = _search(BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.0)).result().sequences[0]
    long = _search(BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=30.0)).result().sequences[0]
    assert len(short.tokens) < len(long.tokens)


def test_score_counts_the_prompt_and_not_eos():
    assert beam_search_score([1, 2, 3, EOS], -3.0, {EOS}, 1.0) == pytest.approx(-1.0)
    assert beam_search_score([1, 2, 3, 4], -4.0, {EOS}, 2.0) == pytest.approx(-0.25)


def test_early_stopping_ends_once_the_width_has_finished():
    params = BeamSearchParams(beam_width=1, max_tokens=10, early_stopping=True)
    bs = BeamSearch([9, 7], params, {EOS}, 100)
    rounds = 0
    while beams := bs.pending():
        bs.advance(_round(beams, 2))
        rounds += 1
    assert rounds == 2 and len(bs.finished) >= 1
    # Only finished hypotheses are returned after an early stop.
    assert all(s.finish_reason == "stop" for s in bs.result().sequences)
    # Without it the search runs to max_tokens (the beams never end: 6 -> 6).
    assert len(_search(BeamSearchParams(beam_width=1, max_tokens=10)).beams[0].tokens) == 12


def test_prompt_and_max_tokens_must_fit_in_the_context():
    bs = _search(BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True), max_model_len=6)
    assert {len(s.tokens) for s in bs.result().sequences} == {6}
    with pytest.raises(PromptError, match=r"^max_tokens is too large: 2 tokens in the prompt \+ max_tokens 5 = 7 "
                                          r"tokens\. This model's maximum context length is 6 tokens") as e:
        BeamSearch([9, 7], BeamSearchParams(beam_width=2, max_tokens=5), {EOS}, 6)
    assert e.value.request_field == "max_tokens"
    with pytest.raises(PromptError, match="resulted in 2 tokens, which leaves no room") as e:
        BeamSearch([9, 7], BeamSearchParams(beam_width=2, max_tokens=4), {EOS}, 2)
    assert e.value.request_field == "prompt"


@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        BeamSearchParams(**kwargs)


def test_width_is_bounded_by_the_logprobs_a_request_may_ask():
    BeamSearchParams(beam_width=10, max_tokens=1).check_width(20)
    with pytest.raises(ValueError, match="^beam_width must be at most 10"):
        BeamSearchParams(beam_width=11, max_tokens=1).check_width(20)


def test_round_params_ask_for_twice_the_width():
    p = BeamSearchParams(beam_width=3, max_tokens=5, temperature=0.5).round_params()
    assert (p.max_tokens, p.logprobs, p.temperature, p.n) == (1, 6, 0.5, 1)
