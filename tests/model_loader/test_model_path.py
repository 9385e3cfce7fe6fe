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
    if name == "folder":
        path.mkdir()
        (path / "config.json").write_text("{}")
    else:
        path.write_text("{}")
    check_model_path(str(path))


def test_folder_without_config_says_what_it_must_hold(tmp_path):
    """An empty folder (or one of other files) is named, with what a model folder holds, not
    transformers' message about a config.json that does not exist."""
    with pytest.raises(ValueError) as e:
        check_model_path(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and repr(str(tmp_path)) in msg
    assert "has no config.json" in msg and "*.safetensors weights" in msg and "tokenizer files" in msg


def test_folder_of_gguf_files_points_to_the_file(tmp_path):
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"pass the GGUF file itself, e\.g\. '.*model\.Q4_0\.gguf'"):
        check_model_path(str(tmp_path))
