"""Answer extraction equals lm-eval's gsm8k filters and metric."""

from __future__ import annotations

import pytest

from tandem.eval.extraction import (INVALID, canonical_number, flexible_extract, letter_flexible, letter_strict,
                                    normalize_answer, numbers_match, strict_match)

CASES = [
    # text, strict-match, flexible-extract
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
    ("#### -12", "-12", "-12"),
    ("The total is $1,234.50.\n#### 1,234.50", "1,234.50", "1,234.50"),
    ("#### 5\nQuestion: then #### 6", "5", "6"),
    ("The answer is 42.", INVALID, "42."),
    ("It costs $18 in total", INVALID, "$18"),
    ("x = 3 and y = 4", INVALID, "4"),
    ("no numbers here", INVALID, INVALID),
    ("", INVALID, INVALID),
    ("####7", INVALID, "7"),  # strict needs "#### " with the blank
    ("#### 3.5 dollars", "3.5", "3.5"),
    ("1, 2, 3", INVALID, "3"),
    ("-5 degrees then 10.", INVALID, "10."),
]


@pytest.mark.parametrize("text,strict,flexible", CASES)
def test_filters(text, strict, flexible):
    assert strict_match(text) == strict
    assert flexible_extract(text) == flexible


@pytest.mark.parametrize("text", [c[0] for c in CASES] + ["a 1.2.3 b", "$$ 9", "...", "7 8 9 #### 10 11"])
def test_filters_equal_lm_eval(text):
    extraction = pytest.importorskip("lm_eval.filters.extraction")
    strict = extraction.RegexFilter(regex_pattern=r"#### (\-?[0-9\.\,]+)")
    flexible = extraction.RegexFilter(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
    assert strict_match(text) == list(strict.apply([[text]], [{}]))[0][0]
    assert flexible_extract(text) == list(flexible.apply([[text]], [{}]))[0][0]


@pytest.mark.parametrize("pred,ref,ok", [
    ("7", "7", True), ("1,234", "1234", True), ("$18", "18", True), ("42.", "42", True),
    ("65", "65.0", True), ("0.50", "0.5", True), ("7", "8", False), (INVALID, "7", False),
    ("-3", "3", False), ("1.2.3", "1.2.3", True), ("abc", "7", False),
])
def test_numbers_match(pred, ref, ok):
    assert numbers_match(pred, ref) is ok


def test_exact_match_normalisation_is_lm_eval_s():
    metrics = pytest.importorskip("lm_eval.api.metrics")
    regexes = [",", "\\$", "(?s).*#### ", "\\.$"]
    for pred, ref in [("$1,000.", "1000"), ("#### 5", "5"), ("A", "a"), ("12", "12.0"), ("x #### 3.", "3")]:
        want = metrics.exact_match_hf_evaluate([pred], [ref], regexes_to_ignore=regexes, ignore_case=True)["exact_match"]
        assert (normalize_answer(pred) == normalize_answer(ref)) == bool(want), (pred, ref)


def test_canonical_number():
    assert canonical_number("65.0") == "65"
    assert canonical_number("1,000") == "1000"
    assert canonical_number("1.50") == "1.5"
    assert canonical_number("-0.25") == "-0.25"
    assert canonical_number("$3") == "3"
    with pytest.raises(ValueError):
        canonical_number("nine")


@pytest.mark.parametrize("text,strict,flexible", [
    (" B", "B", "B"), (" (C) because", "C", "C"), ("D.", "D", "D"), (" The answer is A", INVALID, "A"),
    (" Banana", INVALID, INVALID), ("", INVALID, INVALID), (" A and B", "A", "A"), ("ABBA", INVALID, INVALID),
])
def test_letters(text, strict, flexible):
    assert letter_strict(text) == strict
    assert letter_flexible(text) == flexible
