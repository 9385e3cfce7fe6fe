"""The model path check every entry point runs first (no torch, no file read)."""

from __future__ import annotations

import os


def check_model_path(model: str) -> None:
    """Check that ``model`` is a path of a kind the loader reads (a folder, a config.json, a
    .gguf file), without reading it and without importing torch: every entry point runs it
    before loading anything, so that a wrong path is reported at once.

    Raises:
        ValueError: the path does not exist, or is none of those kinds.
    """
    if not os.path.exists(model):
        raise ValueError(f"model {model!r} does not exist.")
    if not (os.path.isdir(model) or (os.path.isfile(model) and model.endswith((".json", ".gguf")))):
        raise ValueError(f"model must be a Hugging Face folder, a config.json or a .gguf file; {model!r} is none "
                         f"of them.")
