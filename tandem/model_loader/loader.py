"""Model loading: Hugging Face folder (safetensors), GGUF file, or dummy weights.

GGUF: config, tokenizer and chat template come from the file's metadata through
transformers' GGUF support, converted once into a cached folder
(:mod:`tandem.model_loader.gguf_cache`) that later loads read; weights are dequantized to
fp32 with the ``gguf`` library and renamed to HF names
(:mod:`tandem.model_loader.gguf_weights`). With ``quantization="gguf"`` (the CPU default)
the linear layers of the types the CPU runs quantized are rebuilt from the file's raw
blocks and run quantized (:mod:`tandem.layers.quantization.gguf`); those that become
blocks are never dequantized (their dense weights stay on the meta device). The first load of a
model in a dtype (and with or without int4 layers) caches what the model then holds in the
folder, and later loads map it instead of reading the GGUF file
(:mod:`tandem.model_loader.param_cache`).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tandem.attention.backend import AttentionBackend
from tandem.distributed import parallel_state as ps
from tandem.layers import batch_invariant, fused_ops
from tandem.layers.quantization.apply import (finish_fp8_model, load_kv_cache_scales, prepare_fp8_model,
                                              rename_checkpoint_scales)
from tandem.layers.quantization.config import Fp8Config, GGUFQuantConfig
from tandem.layers.quantization.gguf import defer_block_weights, quantize_gguf_linears
from tandem.models.cpu_decode import build_cpu_decode
from tandem.model_loader.gguf_cache import WEIGHTS_FILE, converted_folder
from tandem.model_loader.gguf_weights import gguf_weight_count, iterate_gguf_weights, open_gguf, raw_gguf_weights
from tandem.model_loader.model_path import check_model_path
from tandem.model_loader.param_cache import load_cached_parameters, model_spec, save_parameters
from tandem.models.registry import get_model_class
from tandem.progress import Progress

logger = logging.getLogger(__name__)


def _split_gguf_path(path: str) -> tuple[str, str]:
    return os.path.dirname(os.path.abspath(path)), os.path.basename(path)


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


@functools.lru_cache(maxsize=4)
def load_hf_config(model: str):
    """HF config of a folder, a config.json, or a GGUF file (cached per path: parsing a
    GGUF file's metadata takes seconds; callers treat the config as read-only).

    Raises:
        ValueError: the path is none of those.
    """
    from transformers import AutoConfig, PretrainedConfig

    check_model_path(model)
    if is_gguf(model):
        cached = converted_folder(model)
        if cached is not None:
            return converted_config(cached)
        folder, name = _split_gguf_path(model)
        return AutoConfig.from_pretrained(folder, gguf_file=name)
    if os.path.isfile(model):  # a config.json
        with open(model) as f:
            d = json.load(f)
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[d["model_type"]].from_dict(d) if "model_type" in d else PretrainedConfig.from_dict(d)
    return AutoConfig.from_pretrained(model)


def converted_config(folder: str):
    """The config of a converted GGUF folder as a generic ``PretrainedConfig``, without
    importing its model's config class.

    The folder's config.json was saved from the full class (:mod:`tandem.model_loader.gguf_cache`),
    and saving keeps every attribute that differs from the generic class's defaults, so the
    generic class reads back the same values. The specific classes' modules import
    transformers' model-loading stack (``torch.distributed.tensor`` among others): the
    largest import of a CLI start, for values this file already holds.
    """
    from transformers import PretrainedConfig

    with open(os.path.join(folder, "config.json")) as f:
        return PretrainedConfig.from_dict(json.load(f))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str):
    """HF tokenizer (with chat template) of a folder or a GGUF file (cached per path,
    read-only).

    A config file (``config.json`` for dummy weights) stands for its folder, as for the
    generation config.

    Raises:
        ValueError: ``path`` holds no tokenizer (a folder, or a config file's folder,
            without tokenizer files): the message says to pass ``--tokenizer``.
    """
    from transformers import AutoTokenizer

    if is_gguf(path):
        cached = converted_folder(path)
        if cached is not None:  # given the config, AutoTokenizer does not import its class
            return AutoTokenizer.from_pretrained(cached, config=converted_config(cached))
        folder, name = _split_gguf_path(path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    folder = (os.path.dirname(path) or ".") if os.path.isfile(path) else path
    if not any(os.path.exists(os.path.join(folder, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"{path!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)}): pass --tokenizer "
                         f"(LLM(tokenizer=...)) with a tokenizer folder or .gguf, e.g. the embedded model's: "
                         f"python -c 'from tandem.config import embedded_default_model as m; print(m())'")
    return AutoTokenizer.from_pretrained(folder)


def iterate_gguf_weights_cached(path: str, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF file's weights (HF names, fp32) from its cache entry when that holds them
    (:func:`~tandem.model_loader.gguf_cache.checkpoint_folder` wrote them), else dequantized
    from the file."""
    cached = _cached_weights_folder(path)
    if cached is not None:
        return iterate_safetensors_weights(cached)
    return iterate_gguf_weights(path, hf_config)


def _cached_weights_folder(path: str) -> str | None:
    cached = converted_folder(path)
    return cached if cached is not None and os.path.isfile(os.path.join(cached, WEIGHTS_FILE)) else None


def load_gguf_weights(model: nn.Module, path: str, hf_config, dtype: torch.dtype, cache_parameters: bool = True,
                      int4: bool = False, progress: Progress | None = None) -> None:
    """Load a GGUF file's weights into ``model`` (as built, in ``dtype``), with ``int4``
    rebuilding the linear layers of the types the int4 kernel takes
    (:func:`~tandem.layers.quantization.gguf.quantize_gguf_linears`): mapped from the
    parameter cache of its converted folder when that holds them, else loaded from the
    folder's fp32 checkpoint (where :func:`~tandem.model_loader.gguf_cache.checkpoint_folder`
    wrote one) or the file, and then cached (with ``cache_parameters``). Sharded (tensor-
    or expert-parallel) models and pipeline stages are never cached: their parameters
    depend on the layout; nor
    are FP8 ones (pass ``cache_parameters=False``): theirs are rewritten after loading.
    ``progress`` counts the tensors loaded."""
    folder = converted_folder(path)
    cacheable = (cache_parameters and folder is not None and ps.get_tp_size() == 1 and ps.get_ep_size() == 1
                 and ps.get_pp_size() == 1)
    built = model_spec(model)
    if cacheable:
        if progress is not None:
            progress.stage("mapping the cached parameters")
        if load_cached_parameters(model, folder, dtype, int4):
            return
    # One parse of the file's metadata (seconds: its tokenizer) for its tensors and raw blocks.
    cached = _cached_weights_folder(path)
    reader = open_gguf(path) if cached is None or int4 else None
    raw = raw_gguf_weights(reader, hf_config) if int4 else None
    # Layers that become the file's blocks are built from them alone: never dequantized.
    deferred = defer_block_weights(model, raw) if int4 else set()
    if cached is not None:
        weights = (w for w in iterate_safetensors_weights(cached) if w[0] not in deferred)
        total = count_safetensors_weights(cached) - len(deferred)
    else:
        weights, total = iterate_gguf_weights(reader, hf_config, deferred), gguf_weight_count(reader) - len(deferred)
    if progress is not None:
        progress.stage("reading the tensors")
        weights = progress.track(weights, total)
    model.load_weights(weights)
    if int4:
        if progress is not None:
            progress.stage("GGUF quantized layers")
        quantize_gguf_linears(model, raw)
    if cacheable:
        if progress is not None:
            progress.stage("caching the parameters")
        save_parameters(model, folder, dtype, built, int4)


def count_safetensors_weights(folder: str) -> int:
    """How many tensors :func:`iterate_safetensors_weights` yields (reads the files' headers
    only). Raises ValueError: a file that cannot be read, naming it."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        try:
            with safe_open(f, framework="pt") as sf:
                total += len(sf.keys())
        except SafetensorError as e:
            raise ValueError(f"cannot read {f}: {e}") from None
    return total


def iterate_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every ``*.safetensors`` file of a folder.

    Raises:
        FileNotFoundError: the folder has no safetensors files.
        ValueError: a file that cannot be read (truncated, corrupt), naming it.
    """
    from safetensors import SafetensorError, safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder!r} (use --load-format dummy for random weights)")
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        except SafetensorError as e:  # a truncated or corrupt file: one line, not a traceback
            raise ValueError(f"cannot read {f}: {e}") from None


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights generated on the model's device: N(0, 0.02) for matrices, 1 for norms.

    A parameter sharded over tensor- or expert-parallel ranks (attributes ``full_shape``
    and ``shard``, see :mod:`tandem.layers.linear`) is drawn at its full shape and sliced,
    and each parameter from a generator seeded by ``seed`` and its name, so that every rank
    of every parallel layout (a pipeline stage holds only some of the parameters) holds a
    part of the same model.
    """
    device = next(model.parameters()).device
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator(device=device).manual_seed(seed << 32 | zlib.crc32(name.encode()))
            full_shape = getattr(p, "full_shape", None)
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            elif full_shape is not None and tuple(full_shape) != tuple(p.shape):
                full = torch.empty(full_shape, dtype=p.dtype, device=p.device).normal_(0.0, 0.02, generator=gen)
                p.copy_(p.shard(full))
                del full
            else:
                p.normal_(0.0, 0.02, generator=gen)


def instantiate_model(make: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device,
                      quant_config: Fp8Config | None = None) -> nn.Module:
    """``make()``'s model with its parameters created in ``dtype`` on ``device`` (FP8 layers
    prepared with ``quant_config``) and its floating-point buffers (RoPE tables) in fp32;
    weights not loaded. Its layers take the deterministic mode of the caller's
    :func:`tandem.layers.batch_invariant.building` block (off outside one) and the fused-ops
    mode of its :func:`tandem.layers.fused_ops.building` block (``auto`` outside one)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = make()
            if quant_config is not None:
                prepare_fp8_model(model, quant_config)
    finally:
        torch.set_default_dtype(prev)
    for mod in model.modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(mod, bname, buf.float())
    return model


def build_model(hf_config, model_path: str, load_format: str, backend: AttentionBackend, dtype: torch.dtype,
                device: torch.device, max_positions: int, seed: int = 0,
                quant_config: Fp8Config | GGUFQuantConfig | None = None, fused_ops_mode: str = "auto",
                **model_kwargs) -> nn.Module:
    """Instantiate the model class of the config and load its weights; ``model_kwargs``
    go to the model's constructor (e.g. ``all2all`` for MoE models). The model is built in
    the deterministic mode of ``backend`` (``backend.deterministic``) and in fused-ops mode
    ``fused_ops_mode`` (the worker's, :func:`tandem.layers.fused_ops.resolve_mode`; ``auto``
    decides per tensor), which each of its layers keeps
    (:func:`tandem.layers.batch_invariant.building`, :func:`tandem.layers.fused_ops.building`).
    With an FP8 ``quant_config`` the linear and expert layers get FP8 weights
    (:mod:`tandem.layers.quantization.apply`); with a GGUF one the linear layers of 4-bit
    GGUF weights run them quantized (:mod:`tandem.layers.quantization.gguf`).

    Raises:
        ValueError: unknown architecture, unknown load format, weights not matching, an
            FP8 checkpoint lacking scales, or an unknown ``fused_ops_mode``.
    """
    cls = get_model_class(hf_config)
    gguf_config = quant_config if isinstance(quant_config, GGUFQuantConfig) else None
    quant_config = None if gguf_config is not None else quant_config
    # One bar per deployment: the other ranks write the closing line only.
    with Progress("Loading model weights", logger, unit="tensors", show=ps.get_rank() == 0) as progress:
        progress.stage("building the model")
        with batch_invariant.building(backend.deterministic), fused_ops.building(fused_ops_mode):
            model = instantiate_model(lambda: cls(hf_config, backend, max_positions=max_positions, **model_kwargs),
                                      dtype, device, quant_config)
        if load_format == "dummy":
            progress.stage("random weights")
            init_dummy_weights(model, seed)
        elif is_gguf(model_path):
            load_gguf_weights(model, model_path, hf_config, dtype, cache_parameters=quant_config is None,
                              int4=gguf_config is not None, progress=progress)
        elif os.path.isdir(model_path):
            progress.stage("reading the tensors")
            weights = progress.track(iterate_safetensors_weights(model_path), count_safetensors_weights(model_path))
            weights = load_kv_cache_scales(model, weights)
            model.load_weights(rename_checkpoint_scales(weights, quant_config) if quant_config else weights)
        else:
            raise ValueError(f"cannot load weights from {model_path!r} with load_format={load_format!r}")
        if quant_config is not None:
            progress.stage("FP8 weights")
            finish_fp8_model(model, quant_config, dtype)
    if hasattr(model, "cpu_decode"):
        model.cpu_decode = build_cpu_decode(model)
    return model.eval()
