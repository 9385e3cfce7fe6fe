"""Structured outputs: constraints (JSON schema, regex, choice, grammar), their grammars
and the per-step token bitmask."""

from tandem.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
