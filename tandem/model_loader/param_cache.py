"""A GGUF model's tensors as loaded, cached per dtype and memory-mapped on later loads.

Loading a GGUF file's weights means parsing its metadata (2 s for a 135M model, 7 s for a
0.5B one on a small CPU: the tokenizer's arrays), dequantizing every tensor (``gguf``'s
numpy code: 1.5 s and 10 s), converting them to the model dtype and copying them into fresh
(fused q/k/v, gate/up) parameters; its quantized layers (:mod:`tandem.layers.quantization.gguf`)
then repack the file's raw blocks (0.5 s and 9 s). This cache keeps what the model holds
afterwards, exactly as it holds it, in ``<entry>/params-<dtype>[-gguf-quantized-<cpu
capability>[-vnni]].pt`` (``torch.save``'s zip format: every tensor 64-byte aligned for the GEMM
kernels, which safetensors does not guarantee): the parameters in the model dtype (a tied
LM head's dense weight is the embedding's storage, saved once), and the packed planes,
scales and zeros of the int4 layers and the repacked tiles and segment tables of the block
layers and embedding, with the list of those layers. A later load maps that
file (``torch.load(mmap=True)``, copy-on-write: writes stay private to the process), puts
the listed layers back around their mapped buffers
(:func:`~tandem.layers.quantization.gguf.restore_gguf_linears`) and makes the mapped tensors
the parameters' storage on the CPU (no copy: pages are read from the page cache at first
use) or copies them to another device. The quantized file's name carries the CPU capability
ATen dispatches to, whose packing it holds, and whether the block kernel has VNNI, which
decides the layers' forms (a cache shared by machines of two capabilities keeps one file per
capability).

The entry's key already covers the GGUF file and the converter versions; the file also
records :data:`PARAMS_FORMAT`, the model class, the dtype, the torch version (the packing's
owner) and the name, shape and dtype of every parameter of the model as built (before
loading), and is used only when all of them equal the model being loaded. A file that
cannot be read (truncated, not a torch zip, tensors other than it lists) or that does not
match is rewritten from the GGUF file, with a warning. Written to a temporary file in the
same folder and renamed into place (atomic on POSIX): a reader never maps a partial file.
Only unsharded models without FP8 layers use it (a tensor-parallel rank's parameters are a
slice that depends on the layout).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import torch
from torch import nn

from tandem.layers.quantization import gguf_blocks
from tandem.layers.quantization.gguf import gguf_quantized_layers, restore_gguf_linears

logger = logging.getLogger(__name__)

# Bump when what a load leaves in a model changes without changing the built model's names
# or shapes: a parameter's layout, which GGUF layers run int4 or blocks, how their blocks map
# to planes, whether they keep a dense weight, whether the embedding is blocks and the
# dense LM head kept (tandem.layers.quantization.gguf).
PARAMS_FORMAT = 9


def params_file(folder: str, dtype: torch.dtype, int4: bool = False) -> str:
    """Where the tensors of the converted GGUF ``folder``'s model in ``dtype`` are cached;
    ``int4``: the model with GGUF int4 layers (its packing is the current CPU capability's)."""
    name = str(dtype).removeprefix("torch.")
    if int4:  # which layers take the block kernel depends on VNNI
        name += f"-gguf-quantized-{torch.backends.cpu.get_cpu_capability().lower()}"
        name += "-vnni" if gguf_blocks.available() else ""
    return os.path.join(folder, f"params-{name}.pt")


def model_spec(model: nn.Module) -> dict[str, list]:
    """Name -> ``[shape, dtype]`` of every parameter: what tells two models built alike."""
    return {name: [list(p.shape), str(p.dtype)] for name, p in model.named_parameters()}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The loaded model's parameters and its GGUF quantized layers' buffers, by name, on the CPU."""
    out = {name: p.detach().cpu() for name, p in model.named_parameters()}
    for name in gguf_quantized_layers(model):
        for buffer, t in model.get_submodule(name).named_buffers():
            out[f"{name}.{buffer}"] = t
    return out


def _header(built: dict[str, list], model: nn.Module, dtype: torch.dtype) -> dict:
    """What must equal between the model that wrote the file and the one loading it."""
    return {
        "format": PARAMS_FORMAT,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "dtype": str(dtype),
        "torch": str(torch.__version__),
        "built": built,
    }


def _spec(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: [list(t.shape), str(t.dtype)] for name, t in tensors.items()}


def load_cached_parameters(model: nn.Module, folder: str, dtype: torch.dtype, int4: bool = False) -> bool:
    """Give ``model`` (as built, not loaded) the cached tensors of ``folder`` in ``dtype``:
    its int4 layers put back (with ``int4``) and every parameter pointing at its mapped
    tensor.

    Returns False, leaving the model untouched, when there is no such file, it cannot be
    read, or it was written for another model (format, class, dtype, torch version, or
    names and shapes of the built model's parameters).
    """
    path = params_file(folder, dtype, int4)
    if not os.path.isfile(path):
        return False
    try:
        saved = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        header, layers, tensors = saved["header"], saved["quantized_layers"], saved["tensors"]
        consistent = _spec(tensors) == saved["spec"]
    except Exception as e:  # noqa: BLE001 - any unreadable file is rebuilt, whatever the reader raised
        logger.warning("cached parameters %s unreadable (%s: %s): rebuilding them", path, type(e).__name__, e)
        return False
    if header != _header(model_spec(model), model, dtype) or not consistent:
        logger.warning("cached parameters %s were written for another model layout or by another version's "
                       "cache format: rebuilding them (once)", path)
        return False
    try:
        restore_gguf_linears(model, layers, tensors)
    except (AttributeError, KeyError, ValueError) as e:  # checked for every layer before any is replaced
        logger.warning("cached parameters %s hold inconsistent int4 layers (%s): rebuilding them", path, e)
        return False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.device.type == "cpu":
                p.data = tensors[name]
            else:
                p.copy_(tensors[name])
    return True


def save_parameters(model: nn.Module, folder: str, dtype: torch.dtype, built: dict[str, list] | None = None,
                    int4: bool = False) -> None:
    """Write the loaded ``model``'s tensors as the cached ones of ``folder`` for a model in
    ``dtype``.

    Args:
        built: :func:`model_spec` of the model before loading (None: the model's own, for a
            model whose loading changed no parameter's name, shape or dtype, i.e. without
            int4 layers).
        int4: the model went through the GGUF int4 rebuild (the file :func:`params_file`
            names for it; its int4 layers are saved with it).

    A folder that cannot be written (read-only, full disk) is logged and skipped.
    """
    path = params_file(folder, dtype, int4)
    tensors = _tensors(model)
    payload = {"header": _header(model_spec(model) if built is None else built, model, dtype),
               "quantized_layers": gguf_quantized_layers(model), "spec": _spec(tensors), "tensors": tensors}
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
