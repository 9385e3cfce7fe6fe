"""Prompt forms the front end takes (vLLM's LLM.generate forms) and the errors for others."""

from __future__ import annotations

import pytest

from tandem.engine.processor import parse_prompt


@pytest.mark.parametrize("prompt,want", [
    ("Hi there", ("Hi there", None)),
    ({"prompt": "Hi there"}, ("Hi there", None)),
    ([5, 6, 7], (None, [5, 6, 7])),
    ((5, 6, 7), (None, [5, 6, 7])),
    ({"prompt_token_ids": [5, 6, 7]}, (None, [5, 6, 7])),
    ({"prompt_token_ids": (5,)}, (None, [5])),
])
def test_accepted_forms(prompt, want):
    assert parse_prompt(prompt) == want


@pytest.mark.parametrize("prompt,match", [
    ({}, "exactly one of"),
    ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of"),
    ({"prompt_token_ids": [1], "multi_modal_data": {}}, r"unsupported keys \['multi_modal_data'\]"),
    ({"prompt": [1, 2]}, "'prompt' must be a string"),
    ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list"),
    ({"prompt_token_ids": 3}, "'prompt_token_ids' must be a list"),
    (None, "prompt must be a string"),
    (7, "prompt must be a string"),
    (b"bytes", "prompt must be a string"),
])
def test_other_forms_name_the_field(prompt, match):
    with pytest.raises(ValueError, match=match):
        parse_prompt(prompt)
