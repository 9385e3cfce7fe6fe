"""Tandem: an LLM inference and serving engine built around overlap."""

from tandem.entrypoints.llm import LLM
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob"]
