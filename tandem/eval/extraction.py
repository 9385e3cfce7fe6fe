"""Answer extraction and matching, as lm-evaluation-harness does for gsm8k and MMLU.

The gsm8k filters (lm-eval ``tasks/gsm8k/gsm8k.yaml``, harness 0.4.x):

- ``strict-match``: regex ``#### (\\-?[0-9\\.\\,]+)``, first match, else ``[invalid]``.
- ``flexible-extract``: regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, last match (the first
  non-empty group of that match), else ``[invalid]``.

and the metric ``exact_match`` with ``ignore_case`` and ``regexes_to_ignore``
``[",", "\\$", "(?s).*#### ", "\\.$"]`` applied to both prediction and reference. Tandem
also counts two numbers as equal when they are numerically equal (``65`` and ``65.0``):
ASDiv's answers carry decimals that the harness would otherwise miss.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

INVALID = "[invalid]"

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = [re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$")]

# Multiple-choice letters in a generated answer (MMLU generative).
CHOICE_LETTERS = ("A", "B", "C", "D")
_LETTER_STRICT_RE = re.compile(r"^\s*\(?([ABCD])(?![A-Za-z0-9])")
_LETTER_FLEX_RE = re.compile(r"(?<![A-Za-z0-9])([ABCD])(?![A-Za-z0-9])")


def regex_filter(text: str, regex: re.Pattern, group_select: int = 0, fallback: str = INVALID) -> str:
    """lm-eval's ``RegexFilter`` on one response: ``findall``, pick ``group_select``; for
    a pattern with several groups the first non-empty one; stripped."""
    matches = regex.findall(text)
    if not matches:
        return fallback
    match = matches[group_select]
    if isinstance(match, tuple):
        nonempty = [m for m in match if m]
        if not nonempty:
            return fallback
        match = nonempty[0]
    return match.strip()


def strict_match(text: str) -> str:
    """The number after the first ``#### `` (gsm8k ``strict-match``), or ``[invalid]``."""
    return regex_filter(text, STRICT_RE, 0)


def flexible_extract(text: str) -> str:
    """The last number-like span of ``text`` (gsm8k ``flexible-extract``), or ``[invalid]``."""
    return regex_filter(text, FLEXIBLE_RE, -1)


NUMBER_FILTERS = {"strict-match": strict_match, "flexible-extract": flexible_extract}


def normalize_answer(s: str) -> str:
    """lm-eval ``exact_match`` normalisation for gsm8k: drop ``,`` and ``$``, anything up to
    ``#### ``, a trailing ``.``; lower-case; strip."""
    for rx in _IGNORE:
        s = rx.sub("", s)
    return s.lower().strip()


def _as_number(s: str) -> Decimal | None:
    try:
        d = Decimal(s)
    except (InvalidOperation, ValueError):
        return None
    return d if d.is_finite() else None


def numbers_match(prediction: str, reference: str) -> bool:
    """``exact_match`` after normalisation, or equal as decimal numbers.

    ``[invalid]`` never matches.
    """
    if prediction == INVALID:
        return False
    p, r = normalize_answer(prediction), normalize_answer(reference)
    if p == r:
        return True
    a, b = _as_number(p), _as_number(r)
    return a is not None and b is not None and a == b


def letter_strict(text: str) -> str:
    """The choice letter the output starts with (after blanks and ``(``), or ``[invalid]``."""
    m = _LETTER_STRICT_RE.match(text)
    return m.group(1) if m else INVALID


def letter_flexible(text: str) -> str:
    """The first stand-alone choice letter anywhere in the output, or ``[invalid]``."""
    m = _LETTER_FLEX_RE.search(text)
    return m.group(1) if m else INVALID


LETTER_FILTERS = {"strict-match": letter_strict, "flexible-extract": letter_flexible}


def canonical_number(s: str) -> str:
    """A gold number written plainly: ``1,000`` -> ``1000``, ``65.0`` -> ``65``, ``1.50`` -> ``1.5``.

    Raises:
        ValueError: ``s`` is not a number.
    """
    d = _as_number(s.replace(",", "").replace("$", "").strip())
    if d is None:
        raise ValueError(f"not a number: {s!r}")
    if d == d.to_integral_value():
        return str(d.quantize(Decimal(1)))
    return format(d.normalize(), "f")
