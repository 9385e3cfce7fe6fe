"""On-disk cache of GGUF files converted to Hugging Face folders.

Reading a GGUF file's config and tokenizer (vocabulary and merges in its metadata) through
transformers parses the file twice and takes seconds on a CPU. The first load of a GGUF
file writes what those produce into a folder that transformers and
:mod:`tandem.model_loader.loader` read like an HF model folder; every later load reads that
folder:

* ``config.json``: the HF config (``AutoConfig.from_pretrained(..., gguf_file=...)``);
* the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, chat template);
* ``source.json``: what the entry was made from.

The weights are not converted here: a load dequantizes the file's tensors (or repacks them
for the int4 layers) and caches what the model then holds in the entry, per dtype, mapped by
later loads (:mod:`tandem.model_loader.param_cache`). Only where a reader of a whole HF
checkpoint asks for one (transformers' ``from_pretrained`` in tests and benchmarks:
:func:`checkpoint_folder`) does the entry get ``model.safetensors``, every tensor
dequantized to fp32 under its HF name (llama.cpp's q/k row permutation undone), which the
loader then reads instead of dequantizing.

Location: ``$TANDEM_CACHE_ROOT/gguf/<key>`` (``~/.cache/tandem/gguf/<key>`` by default, see
:mod:`tandem.envs`).
The key hashes the file's content (its size and SHA-256), the versions of tandem,
transformers and gguf, and :data:`CACHE_FORMAT`, not its path: copies of one file in
several installations (virtual environments, checkouts) share one entry, while a changed
file, or a converter that may convert differently, gets a new one. The SHA-256 of the whole
file is computed once per (path, size, modification and change times, inode) and kept in
``<root>/hashes/`` (:func:`content_digest`), so later loads only stat the file.

An entry is built in a temporary folder next to it and renamed into place (atomic on
POSIX), so a reader never sees a partial entry; concurrent first loads take turns on a lock
file beside it (``.<key>.lock``, removed after the conversion): the later ones wait for the
first conversion and read it (where the file system has no locks, they convert too and one
rename wins). Files added to an entry later (parameters, the fp32 checkpoint) are written
to a temporary file in it and renamed into place. ``source.json`` lists the paths loaded
from the entry; when one of them changes, its new entry drops it from the old one, and
removes the old one once none of its paths still holds that content. When the cache cannot
be written (read-only home, full disk) loading works as without it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import metadata

from tandem import envs
from tandem.distributed import parallel_state as ps
from tandem.model_loader.gguf_weights import gguf_weight_count, iterate_gguf_weights, open_gguf
from tandem.progress import Progress

logger = logging.getLogger(__name__)

# Bump when the conversion's output changes (names, layout, dtype, which files).
CACHE_FORMAT = 2
_HASH_CHUNK_BYTES = 1 << 20
WEIGHTS_FILE = "model.safetensors"
SOURCE_FILE = "source.json"
HASHES_DIR = "hashes"


def cache_root() -> str:
    """The folder holding the converted GGUF files."""
    return os.path.join(envs.TANDEM_CACHE_ROOT, "gguf")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK_BYTES), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(real: str, st: os.stat_result) -> dict:
    """What says a file is unchanged since its hash was taken (the inode change time moves
    on every write, and on a modification time set back by hand)."""
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino}


def _hash_record(real: str) -> str:
    return os.path.join(cache_root(), HASHES_DIR, hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")


def _recorded_digest(real: str, st: os.stat_result) -> str | None:
    """The SHA-256 remembered for this path, if the file is unchanged since."""
    try:
        with open(_hash_record(real)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    stamp = _stamp(real, st)
    return rec.get("sha256") if {k: rec.get(k) for k in stamp} == stamp else None


def _write_json(path: str, data: dict) -> None:
    """Write ``data`` atomically (a temporary file renamed over ``path``).

    Raises:
        OSError: the folder is not writable.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def content_digest(path: str) -> str:
    """SHA-256 of the file's bytes, read in full only when the file is new or changed (its
    path, size, modification or change time or inode differ from when it was last hashed).

    Raises:
        FileNotFoundError: no such file.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    digest = _recorded_digest(real, st)
    if digest is None:
        digest = _file_sha256(real)
        try:
            _write_json(_hash_record(real), {**_stamp(real, st), "sha256": digest})
        except OSError:
            pass  # an unwritable cache: hashed again next time
    return digest


def source_info(path: str) -> dict:
    """What identifies a GGUF file's content and its conversion (the cache key is its hash);
    the same for every copy of the file.

    Raises:
        FileNotFoundError: no such file.
    """
    return {
        "format": CACHE_FORMAT,
        "size": os.path.getsize(path),
        "sha256": content_digest(path),
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
    if not os.path.isfile(os.path.join(dest, SOURCE_FILE)):
        try:
            os.makedirs(root, exist_ok=True)
            lock = open(os.path.join(root, f".{os.path.basename(dest)}.lock"), "a")
        except OSError as e:
            logger.warning("GGUF cache %s not writable (%s): converting %s at every load", root, e, real)
            return None
        with lock:
            # One conversion at a time per entry: `tandem serve` reads the tokenizer in its
            # front end while its engine core reads the config, and both would otherwise
            # convert the file, on the same CPUs.
            if not _try_lock(lock):
                logger.info("waiting for another process converting %s into the GGUF cache", real)
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.isfile(os.path.join(dest, SOURCE_FILE)):
                try:
                    built = _build_entry(real, info, root, dest)
                finally:
                    # Removed while held: a process waiting on it finds the entry (or, after a
                    # failure, converts itself), a later one takes a new lock file.
                    with contextlib.suppress(OSError):
                        os.unlink(lock.name)
                if not built:
                    return None
    _add_path(dest, real)
    _remove_stale(root, real, os.path.basename(dest))
    return dest


def _try_lock(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _build_entry(real: str, info: dict, root: str, dest: str) -> bool:
    """Convert ``real`` into the entry ``dest`` (built in a temporary folder, then renamed);
    False, with a warning, when the cache cannot be written."""
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", dir=root)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    except OSError as e:
        logger.warning("GGUF cache %s not writable (%s): converting %s at every load", root, e, real)
        return False
    try:
        logger.info("converting %s into the GGUF cache (first load only)", real)
        _convert(real, tmp)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump({**info, "paths": [real]}, f, indent=1)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isfile(os.path.join(dest, SOURCE_FILE)):
                raise
            # Another process (on a file system without locks) renamed its conversion first.
    except OSError as e:
        logger.warning("could not write the GGUF cache entry %s (%s): converting at every load", dest, e)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def _convert(path: str, out: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(path)
    # Each stage takes seconds on a small CPU; the first load would otherwise sit silent.
    with Progress(f"Converting {name}", logger, show=ps.get_rank() == 0) as progress:
        progress.stage("checking the file")
        open_gguf(path)  # a damaged file named in one line, not in a traceback of the converters
        progress.stage("reading the config")
        AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(out)
        progress.stage("reading the tokenizer")
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)


def checkpoint_folder(path: str) -> str | None:
    """The converted folder of a GGUF file as a whole HF checkpoint: with ``model.safetensors``
    (every tensor dequantized to fp32), written on the first request, for readers of such a
    folder (``AutoModelForCausalLM.from_pretrained``); a load does not need it.

    Returns None when the cache cannot be written.

    Raises:
        ValueError: a tensor name has no HF equivalent.
    """
    folder = converted_folder(path)
    if folder is None or os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
        return folder
    try:
        _write_checkpoint(os.path.realpath(path), folder)
    except OSError as e:
        logger.warning("could not write %s into the GGUF cache entry %s (%s)", WEIGHTS_FILE, folder, e)
        return None
    return folder


def _write_checkpoint(path: str, folder: str) -> None:
    """Dequantize the file's tensors into ``folder``'s ``model.safetensors`` (a temporary
    file renamed into place: concurrent writers write the same bytes, one rename wins).

    Raises:
        OSError: the folder is not writable.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.", dir=folder)
    os.close(fd)
    try:
        with Progress(f"Dequantizing {os.path.basename(path)}", logger, unit="tensors",
                      show=ps.get_rank() == 0) as progress:
            reader = open_gguf(path)
            tensors = dict(progress.track(iterate_gguf_weights(reader, config), gguf_weight_count(reader)))
            progress.stage(f"writing {WEIGHTS_FILE}")
            save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, os.path.join(folder, WEIGHTS_FILE))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_source(entry: str) -> dict | None:
    try:
        with open(os.path.join(entry, SOURCE_FILE)) as f:
            src = json.load(f)
    except (OSError, ValueError):
        return None
    if "paths" not in src:  # an entry keyed by its path (before content keys)
        src["paths"] = [src["path"]] if "path" in src else []
    return src


def _add_path(entry: str, real: str) -> None:
    """Record that ``real`` loads from ``entry`` (best effort: two processes adding paths at
    once may drop one, which only lets a later cleanup remove the entry early)."""
    src = _read_source(entry)
    if src is not None and real not in src["paths"]:
        with contextlib.suppress(OSError):
            _write_json(os.path.join(entry, SOURCE_FILE), {**src, "paths": [*src["paths"], real]})


def _still_holds(path: str, src: dict) -> bool:
    """Whether the file at ``path`` may still be the content ``src`` was made from (unsure
    counts as yes: an entry is removed only when no path can need it)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_size != src.get("size"):
        return False
    digest = _recorded_digest(path, st)
    return digest is None or digest == src.get("sha256")


def _remove_stale(root: str, real: str, keep: str) -> None:
    """``real`` now loads from ``keep``: drop it from the other entries, and remove those no
    other path still holds the content of (earlier versions of the file)."""
    for entry in os.listdir(root):
        if entry in (keep, HASHES_DIR) or entry.startswith("."):
            continue
        folder = os.path.join(root, entry)
        src = _read_source(folder)
        if src is None or real not in src["paths"]:
            continue
        others = [p for p in src["paths"] if p != real and _still_holds(p, src)]
        if others:
            with contextlib.suppress(OSError):
                _write_json(os.path.join(folder, SOURCE_FILE), {**src, "paths": others})
        else:
            shutil.rmtree(folder, ignore_errors=True)
