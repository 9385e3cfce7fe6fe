"""A GGUF model's parameters as loaded, cached per dtype and memory-mapped on later loads.

The converted folder of a GGUF file (:mod:`tandem.model_loader.gguf_cache`) holds its
tensors in fp32 under HF names. Loading those means reading all of them, converting them to
the model dtype and copying them into fresh (fused q/k/v, gate/up) parameters: a second of
a CLI start on a small CPU, most of it page faults of the new memory. This cache keeps the
parameters exactly as :meth:`load_weights` left them, in the model dtype, in
``<entry>/params-<dtype>.pt`` (``torch.save``'s zip format: every tensor 64-byte aligned
for the GEMM kernels, which safetensors does not guarantee). A later load maps that file
(``torch.load(mmap=True)``, copy-on-write: writes stay private to the process) and makes
the mapped tensors the parameters' storage on the CPU (no copy: pages are read from the page
cache at first use) or copies them to another device.

The entry's key already covers the GGUF file and the converter versions; the file also
records :data:`PARAMS_FORMAT`, the model class, the dtype and every parameter's name, shape
and dtype, and is used only when all of them equal the model being loaded. A file that cannot be
read (truncated, not a torch zip) or that does not match is rewritten from the converted
folder, with a warning. Written to a temporary file in the same folder and renamed into
place (atomic on POSIX): a reader never maps a partial file. Only unsharded, unquantized
models use it (a tensor-parallel rank's parameters are a slice that depends on the layout).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Bump when a model's parameter layout changes without changing names or shapes.
PARAMS_FORMAT = 1


def params_file(folder: str, dtype: torch.dtype) -> str:
    """Where the parameters of the converted GGUF ``folder`` in ``dtype`` are cached."""
    return os.path.join(folder, f"params-{str(dtype).removeprefix('torch.')}.pt")


def _header(model: nn.Module, dtype: torch.dtype) -> dict:
    return {
        "format": PARAMS_FORMAT,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtype": str(dtype),
        "params": {name: [list(p.shape), str(p.dtype)] for name, p in model.named_parameters()},
    }


def _matches(tensors: dict[str, torch.Tensor], header: dict) -> bool:
    return tensors.keys() == header["params"].keys() and all(
        [list(t.shape), str(t.dtype)] == header["params"][name] for name, t in tensors.items())


def load_cached_parameters(model: nn.Module, folder: str, dtype: torch.dtype) -> bool:
    """Point ``model``'s parameters at the cached tensors of ``folder`` in ``dtype``.

    Returns False, leaving the model untouched, when there is no such file, it cannot be
    read, or it was written for another layout (format, class, dtype, names or shapes).
    """
    path = params_file(folder, dtype)
    if not os.path.isfile(path):
        return False
    try:
        saved = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        header, tensors = saved["header"], saved["params"]
    except Exception as e:  # noqa: BLE001 - any unreadable file is rebuilt, whatever the reader raised
        logger.warning("cached parameters %s unreadable (%s: %s): rebuilding them", path, type(e).__name__, e)
        return False
    expected = _header(model, dtype)
    if header != expected or not _matches(tensors, expected):
        logger.warning("cached parameters %s were written for another model layout: rebuilding them", path)
        return False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device.type == "cpu":
                p.data = tensors[name]
            else:
                p.copy_(tensors[name])
    return True


def save_parameters(model: nn.Module, folder: str, dtype: torch.dtype) -> None:
    """Write ``model``'s parameters as the cached ones of ``folder`` for a model in ``dtype``.

    A folder that cannot be written (read-only, full disk) is logged and skipped.
    """
    path = params_file(folder, dtype)
    payload = {"header": _header(model, dtype),
               "params": {name: p.detach().cpu() for name, p in model.named_parameters()}}
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)
    except OSError as e:
        logger.warning("cannot cache the parameters in %s (%s)", folder, e)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        logger.warning("cannot cache the parameters in %s (%s)", folder, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
