"""The model path check: a missing path says so; a path of another kind says what is read."""

from __future__ import annotations

import pytest

from tandem.model_loader.model_path import check_model_path


def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist"):
        check_model_path(str(tmp_path / "nope.gguf"))


def test_other_kind(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is none of them"):
        check_model_path(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("name", ["m.gguf", "config.json", "folder"])
def test_readable_kinds(tmp_path, name):
    path = tmp_path / name
    path.mkdir() if name == "folder" else path.write_text("{}")
    check_model_path(str(path))
