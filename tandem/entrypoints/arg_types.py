"""argparse value types shared by the ``tandem`` subcommands: a bad value is rejected
while parsing, before anything loads.

Each raises ``argparse.ArgumentTypeError`` for every bad value, non-numbers included, so that
the message says what was expected (``--max-tokens: expected a positive integer, got '0'``)
rather than argparse's ``invalid positive_int value: '0'``.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable


def _number(text: str, kind: type, expected: str, ok: Callable[[int | float], bool]) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):  # a nan fails every comparison: refused too
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    return _number(text, int, "a TCP port in 0..65535", lambda v: 0 <= v <= 65535)


def unit_fraction(text: str) -> float:
    """A share in [0, 1]."""
    return _number(text, float, "a number in [0, 1]", lambda v: 0.0 <= v <= 1.0)


def api_key(text: str) -> str:
    """An API key, surrounding whitespace removed (an HTTP header value cannot carry it).
    Empty is refused: ``--api-key "$UNSET"`` must not start a server that anyone may use.
    The message never repeats the value."""
    key = text.strip()
    if not key:
        raise argparse.ArgumentTypeError("expected a non-empty key")
    return key


def chat_template(text: str) -> str:
    """A Jinja chat template, as vLLM's ``--chat-template`` takes it: the contents of the
    file that ``text`` names, else ``text`` itself with its backslash escapes decoded (a
    template written on one line: ``\\n`` is a newline). A value without ``{`` that names no
    readable file is a path that failed: an error, not a template that prints the path."""
    try:
        with open(text, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:  # ValueError: undecodable contents, a NUL in the name
        if "{" not in text:
            raise argparse.ArgumentTypeError(f"cannot read the template file {text!r}: "
                                             f"{getattr(e, 'strerror', None) or e}") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # an unknown escape such as \d stays as it is
            # Characters beyond latin-1 become \u escapes first, so that decoding keeps them.
            return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"the one-line template has a bad escape sequence: {e.reason}") from None
