"""The model path check every entry point runs first (no torch, no file read)."""

from __future__ import annotations

import os


def check_model_path(model: str) -> None:
    """Check that ``model`` is a path of a kind the loader reads (a folder, a config.json, a
    .gguf file), without reading it and without importing torch: every entry point runs it
    before loading anything, so that a wrong path is reported at once.

    Raises:
        ValueError: the path does not exist, is none of those kinds, or is a folder without
            a config.json (the message says what such a folder holds).
    """
    if not os.path.exists(model):
        raise ValueError(f"model {model!r} does not exist.")
    if not (os.path.isdir(model) or (os.path.isfile(model) and model.endswith((".json", ".gguf")))):
        raise ValueError(f"model must be a Hugging Face folder, a config.json or a .gguf file; {model!r} is none "
                         f"of them.")
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        hint = (f"; pass the GGUF file itself, e.g. {os.path.join(model, ggufs[0])!r}" if ggufs else
                " (or pass a .gguf file)")
        raise ValueError(f"model folder {model!r} has no config.json: a Hugging Face model folder holds config.json, "
                         f"the *.safetensors weights and the tokenizer files{hint}.")
