"""Tandem: an LLM inference and serving engine built around overlap."""

from tandem.entrypoints.llm import LLM
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams
from tandem.version import tandem_version

__version__ = tandem_version()

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
