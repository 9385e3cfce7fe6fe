"""On-disk cache of GGUF files converted to Hugging Face folders.

Reading a GGUF file's config and tokenizer (vocabulary and merges in its metadata) through
transformers, and dequantizing its tensors with ``gguf``, parses the file three times and
takes tens of seconds on a CPU. The first load of a GGUF file writes what those produce
into a folder that transformers and :mod:`tandem.model_loader.loader` read like any HF
checkpoint; every later load reads that folder:

* ``config.json``: the HF config (``AutoConfig.from_pretrained(..., gguf_file=...)``);
* the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat template);
* ``model.safetensors``: every tensor dequantized to fp32 under its HF name (llama.cpp's
  q/k row permutation undone), when that is at most :data:`MAX_CACHED_WEIGHT_BYTES`;
  larger files are dequantized from the GGUF file at every load instead;
* ``source.json``: what the entry was made from.

Location: ``$TANDEM_CACHE_ROOT/gguf/<key>`` (``~/.cache/tandem/gguf/<key>`` by default, see
:mod:`tandem.envs`). The entry also holds the model's parameters as loaded, per dtype
(:mod:`tandem.model_loader.param_cache`).
The key hashes the file's real path, size, modification time (ns) and content (all of it
up to :data:`FULL_HASH_MAX_BYTES`, else its first and last 64 MiB), the versions of
tandem, transformers and gguf, and :data:`CACHE_FORMAT`: a changed file, or a converter
that may convert differently, gets a new entry. An entry is built in a temporary folder
next to it and renamed into place (atomic on POSIX), so a reader never sees a partial
entry and concurrent first loads do not corrupt each other (one rename wins). Writing a
new entry removes older entries made from the same path. When the cache cannot be written
(read-only home, full disk) loading works as without it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import metadata

from tandem import envs
from tandem.model_loader.gguf_weights import dequantized_bytes, iterate_gguf_weights, open_gguf

logger = logging.getLogger(__name__)

# Bump when the conversion's output changes (names, layout, dtype).
CACHE_FORMAT = 1
FULL_HASH_MAX_BYTES = 1 << 30
_SAMPLE_BYTES = 64 << 20
# fp32 bytes of the dequantized weights above which they are not cached (disk space).
MAX_CACHED_WEIGHT_BYTES = 4 << 30
WEIGHTS_FILE = "model.safetensors"
SOURCE_FILE = "source.json"


def cache_root() -> str:
    """The folder holding the converted GGUF files."""
    return os.path.join(envs.TANDEM_CACHE_ROOT, "gguf")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def _content_digest(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(size - _SAMPLE_BYTES)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def source_info(path: str) -> dict:
    """What identifies a GGUF file and its conversion (the cache key is its hash).

    Raises:
        FileNotFoundError: no such file.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    return {
        "format": CACHE_FORMAT,
        "path": real,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": _content_digest(real, st.st_size),
        "versions": {d: _version(d) for d in ("tandem", "transformers", "gguf")},
    }


def cache_key(info: dict) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:32]


def converted_folder(path: str) -> str | None:
    """The cached HF folder of a GGUF file, converting it on first use.

    Returns None when the cache cannot be written (the caller loads from the GGUF file).
    The answer is remembered per (path, size, mtime) within the process.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    return _converted_folder(real, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _converted_folder(real: str, size: int, mtime_ns: int) -> str | None:
    info = source_info(real)
    root = cache_root()
    dest = os.path.join(root, cache_key(info))
    if os.path.isfile(os.path.join(dest, SOURCE_FILE)):
        return dest
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", dir=root)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    except OSError as e:
        logger.warning("GGUF cache %s not writable (%s): converting %s at every load", root, e, real)
        return None
    try:
        logger.info("converting %s into the GGUF cache (first load only)", real)
        _convert(real, tmp)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump(info, f, indent=1)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, SOURCE_FILE)):
                raise
            # Another process renamed its conversion of the same file first.
    except OSError as e:
        logger.warning("could not write the GGUF cache entry %s (%s): converting at every load", dest, e)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale(root, info["path"], os.path.basename(dest))
    return dest


def _convert(path: str, out: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    reader = open_gguf(path)
    if dequantized_bytes(reader) <= MAX_CACHED_WEIGHT_BYTES:
        save_file(dict(iterate_gguf_weights(reader, config)), os.path.join(out, WEIGHTS_FILE), metadata={"format": "pt"})


def _remove_stale(root: str, real: str, keep: str) -> None:
    """Drop the entries of earlier versions of the same file (same path, other key)."""
    for entry in os.listdir(root):
        if entry == keep or entry.startswith("."):
            continue
        try:
            with open(os.path.join(root, entry, SOURCE_FILE)) as f:
                same = json.load(f).get("path") == real
        except (OSError, ValueError):
            continue
        if same:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
