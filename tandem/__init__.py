"""Tandem: an LLM inference and serving engine built around overlap.

The public names are imported on first use, so that ``tandem --help`` and argument errors
answer before PyTorch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tandem import envs as _envs
from tandem.version import tandem_version

_envs.set_openmp_spin_count()

__version__ = tandem_version()

_EXPORTS = {"LLM": "tandem.entrypoints.llm", "SamplingParams": "tandem.sampling_params",
            "RequestOutputKind": "tandem.sampling_params", "RequestOutput": "tandem.outputs",
            "CompletionOutput": "tandem.outputs", "Logprob": "tandem.outputs",
            "BeamSearchParams": "tandem.beam_search"}

if TYPE_CHECKING:
    from tandem.beam_search import BeamSearchParams
    from tandem.entrypoints.llm import LLM
    from tandem.outputs import CompletionOutput, Logprob, RequestOutput
    from tandem.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")


__all__ = ["BeamSearchParams", "LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
