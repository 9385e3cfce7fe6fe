"""A model without tokenizer files fails at once, saying to pass --tokenizer."""

from __future__ import annotations

import json

import pytest

from tandem.model_loader.loader import load_tokenizer


@pytest.mark.parametrize("as_file", [False, True])
def test_missing_tokenizer_names_the_flag(tmp_path, as_file):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    path = tmp_path / "config.json" if as_file else tmp_path
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(str(path))
