"""What an engine core decided for every setting left to it (vLLM resolves its config once,
where it is built; here the device and the loaded model decide, so the core does).

:class:`ResolvedConfig` is computed once by :class:`tandem.engine.core.EngineCore` after its
worker loaded the model and sized the KV cache, and sent in the core's ready message
(:class:`tandem.engine.messages.EngineCoreReady`). The scheduler, the front ends, the
``tandem generate`` speed line and the check of a multi-host deployment's replicas read it:
none of them resolves ``"auto"`` or an unset limit again.
"""

from __future__ import annotations

import msgspec

from tandem.model_loader.generation_config import GenerationDefaults


class ResolvedConfig(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The values one data-parallel replica runs with (its driver rank's; every rank of a
    replica shares them).

    Attributes:
        dtype: torch dtype name of the weights and activations (``"bfloat16"``,
            ``"float16"``, ``"float32"``): ``--dtype``, ``auto`` resolved for the device and
            the checkpoint (:func:`tandem.platform.auto_dtype`).
        quantization: how the linear weights run: ``"fp8"`` or ``"compressed-tensors"``
            (FP8 W8A8), ``"gguf"`` (a GGUF file's 4-bit blocks); None: in ``dtype``.
            ``--quantization`` unset resolved from the checkpoint and the device.
        all2all_backend: dispatch/combine backend of the MoE layers (``"local"``,
            ``"allgather_reducescatter"``, ``"all_to_all"``, ``"simulated"``), ``auto``
            resolved by the expert-parallel size; None for a dense model (no MoE layer).
        device: torch device of the driver rank (``"cpu"``, ``"cuda:0"``).
        max_model_len: context length in tokens, prompt and output together: the model's
            when unset, lowered to what the KV cache holds.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step.
        num_kv_blocks: KV cache size in blocks of ``block_size`` tokens, the null block 0
            included (the smallest over the replica's ranks).
        generation_defaults: the model's generation_config.json as ``--generation-config``
            selects it (EOS ids, defaults of the sampling fields a request leaves unset).
    """

    dtype: str
    quantization: str | None
    all2all_backend: str | None
    device: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    generation_defaults: GenerationDefaults

    @property
    def weights_mode(self) -> str:
        """How the linear weights run, for the speed line of ``tandem generate``:
        ``"gguf quantized + bfloat16"`` (GGUF blocks run quantized, activations in ``dtype``),
        ``"fp8"`` / ``"compressed-tensors"`` (FP8), or ``dtype`` (``"float32"``...)."""
        if self.quantization == "gguf":
            return f"gguf quantized + {self.dtype}"
        return self.quantization or self.dtype


__all__ = ["ResolvedConfig"]
