"""Field docs read from the source, and the check of ``Literal`` fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from tandem.config.utils import check_choices, get_attr_docs, literal_choices, unwrap_optional


@dataclass
class _Example:
    """An example group."""

    mode: Literal["a", "b"] = "a"
    """The mode:
    a or b."""

    maybe: Literal["x"] | None = None
    """Optional."""

    undocumented: int = 0
    count: int = 1
    """How many."""


def test_attr_docs_are_the_strings_below_the_fields():
    assert get_attr_docs(_Example) == {"mode": "The mode:\na or b.", "maybe": "Optional.", "count": "How many."}


def test_literal_and_optional_types():
    assert literal_choices(Literal["a", "b"]) == ("a", "b")
    assert literal_choices(Literal["x"] | None) == ("x",)
    assert literal_choices(int | None) is None
    assert unwrap_optional(int | None) == (int, True) and unwrap_optional(int) == (int, False)


def test_check_choices_names_the_field_and_allows_none_only_when_optional():
    check_choices(_Example(mode="b", maybe=None))
    check_choices(_Example(maybe="x"))
    with pytest.raises(ValueError, match=r"mode must be one of a, b, got 'c'"):
        check_choices(_Example(mode="c"))
    with pytest.raises(ValueError, match=r"maybe must be one of x or None, got 'y'"):
        check_choices(_Example(maybe="y"))
    with pytest.raises(ValueError, match="mode"):
        check_choices(_Example(mode=None))
