"""The FP8 format of weights, activations and the KV cache: e4m3 (as vLLM's default), its
largest value and the smallest dynamic scale. Its own module so that the torch math
(:mod:`.fp8`) and the Triton kernels (:mod:`.fp8_triton`) share it without importing each
other."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Smallest dynamic scale (vLLM's MIN_SCALING_FACTOR): an all-zero row quantizes to zeros.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
