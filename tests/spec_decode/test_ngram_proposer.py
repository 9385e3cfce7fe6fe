"""N-gram proposer: vLLM's match rule (longest n in [min, max], earliest occurrence),
truncation, bounds, and agreement with a brute-force reference on random histories."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.spec_decode.ngram_proposer import NgramProposer


def propose(history: list[int], k: int, lo: int, hi: int, **kwargs) -> list[int]:
    return NgramProposer(k, lo, hi, **kwargs).propose(np.array(history, dtype=np.int64)).tolist()


def reference(history: list[int], k: int, lo: int, hi: int) -> list[int]:
    """n from hi down to lo; the first (earliest) start whose n tokens equal the last n,
    the suffix's own position excluded; the up to k tokens after it."""
    total = len(history)
    for n in range(hi, lo - 1, -1):
        for start in range(total - n):
            if history[start:start + n] == history[total - n:]:
                return history[start + n:start + n + k]
    return []


def test_vllm_docstring_example():
    # [4, 2, 3] never occurred before; [2, 3] did, followed by [4, 2, 3] (three tokens < K).
    assert propose([1, 2, 3, 4, 2, 3], k=4, lo=2, hi=3) == [4, 2, 3]


def test_longest_n_wins_over_an_earlier_shorter_match():
    # Suffix [7, 8, 9]: the 3-gram occurs at 4 (followed by 1), the 2-gram [8, 9] already
    # at 0 (followed by 2).
    history = [8, 9, 2, 0, 7, 8, 9, 1, 5, 7, 8, 9]
    assert propose(history, k=1, lo=1, hi=3) == [1]
    assert propose(history, k=1, lo=1, hi=2) == [2]


def test_earliest_occurrence_of_the_longest_match():
    history = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert propose(history, k=1, lo=2, hi=2) == [10]
    assert propose(history, k=2, lo=1, hi=4) == [10, 1]


def test_k_truncation_at_history_end():
    history = [1, 2, 3, 1, 2]
    assert propose(history, k=5, lo=2, hi=2) == [3, 1, 2]
    assert propose(history, k=2, lo=2, hi=2) == [3, 1]
    # The occurrence may overlap the suffix: [1, 1, 1] at 0 is followed by one token.
    assert propose([1, 1, 1, 1], k=4, lo=3, hi=3) == [1]


def test_no_match():
    assert propose([1, 2, 3, 4, 5], k=3, lo=1, hi=3) == []
    assert propose([1, 2, 3, 9, 2, 4], k=3, lo=1, hi=3) == []  # the last token is new
    assert propose([1, 2, 3, 9, 2, 3], k=3, lo=3, hi=4) == []  # [2, 3] repeats, shorter than min
    assert propose([], k=3, lo=1, hi=3) == []
    assert propose([5], k=3, lo=1, hi=3) == []


def test_min_max_bounds():
    # Suffix [3, 4]: the 1-gram [4] first occurs at 0 (followed by 7), the 2-gram at 2
    # (followed by 9), the 3-gram [9, 3, 4] nowhere earlier.
    history = [4, 7, 3, 4, 9, 3, 4]
    assert propose(history, k=1, lo=1, hi=1) == [7]
    assert propose(history, k=1, lo=1, hi=5) == [9]
    assert propose(history, k=1, lo=2, hi=2) == [9]
    assert propose(history, k=1, lo=3, hi=5) == []


def test_repeated_pattern():
    history = [5, 6, 7] * 4
    # Every n up to 9 repeats; the 9-gram first occurs at 0, followed by the last period.
    assert propose(history, k=3, lo=1, hi=9) == [5, 6, 7]
    assert propose(history, k=4, lo=2, hi=2) == [5, 6, 7, 5]
    assert propose([0] * 10, k=4, lo=1, hi=5) == [0, 0, 0, 0]


def test_max_model_len_caps_the_proposal():
    history = [1, 2, 3, 1, 2]
    assert propose(history, k=3, lo=2, hi=2, max_model_len=7) == [3, 1]
    assert propose(history, k=3, lo=2, hi=2, max_model_len=5) == []


def test_result_is_a_copy_of_the_input_dtype():
    history = np.array([1, 2, 3, 1, 2], dtype=np.int32)
    out = NgramProposer(2, 1, 2).propose(history)
    assert out.dtype == np.int32
    out[:] = -1
    assert history.tolist() == [1, 2, 3, 1, 2]
    assert NgramProposer(2, 1, 2).propose(np.array([1, 2], dtype=np.int32)).dtype == np.int32


def test_matches_brute_force_reference():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        history = rng.integers(0, rng.integers(1, 5), rng.integers(0, 50)).tolist()
        lo = int(rng.integers(1, 5))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert propose(history, k, lo, hi) == reference(history, k, lo, hi), (history, k, lo, hi)


def test_propose_batch():
    p = NgramProposer(2, 1, 3)
    histories = [np.array(h) for h in ([1, 2, 3, 1, 2], [4, 5], [], [7, 7, 7])]
    assert [x.tolist() for x in p.propose_batch(histories)] == [[3, 1], [], [], [7]]


@pytest.mark.parametrize("args, field", [
    ((0, 1, 2), "num_speculative_tokens"),
    ((3, 0, 2), "prompt_lookup_min"),
    ((3, 3, 2), "prompt_lookup_max"),
])
def test_bad_params_raise(args, field):
    with pytest.raises(ValueError, match=field):
        NgramProposer(*args)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="max_model_len"):
        NgramProposer(3, 1, 2, max_model_len=0)
    with pytest.raises(ValueError, match="1-D"):
        NgramProposer(3, 1, 2).propose(np.zeros((2, 3), dtype=np.int64))
