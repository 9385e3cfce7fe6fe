"""Messages between the front end and the engine cores (msgspec structs, msgpack on zmq).

The names follow vLLM V1 (``vllm/v1/engine/__init__.py``). A front end sends
``(EngineCoreRequestType, payload)`` frames to a core; a core sends one
:class:`EngineCoreOutputs` per step (the new token ids of all its requests that got one),
plus the answers to utility calls and its startup handshake on the same socket.

Every struct is plain data (ints, floats, strings, lists; ``SamplingParams`` is a plain
dataclass that msgspec encodes field by field): nothing live is pickled.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tandem.config.resolved import ResolvedConfig
from tandem.structured_output.params import validated_elsewhere

from tandem.sampling_params import SamplingParams


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of a front end -> core message (one byte, as vLLM's)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"  # (client_index, call_id, name), answered by UtilityOutput: "debug_stats", "ping"
    WAKEUP = b"\x03"  # data-parallel lockstep: another replica got work
    SHUTDOWN = b"\x04"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence for a core to run (the front end fans a request with ``n > 1`` out
    into ``n`` of these, each with ``sampling_params.n == 1``).

    ``request_id``: unique among the core's live requests; ``prompt_token_ids``: validated
    against the vocabulary and the context by the front end; ``max_tokens``: resolved
    against the context length; ``arrival_time``: ``time.monotonic()`` of the front end;
    ``client_index``: the front end (API server) that sent it, which gets its outputs.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float
    client_index: int = 0


class PromptLogprobsData(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of prompt positions ``[start, start + len(ranks))`` computed by one step:
    per position ``token_ids`` / ``logprobs`` ``[1 + K]`` (the actual next prompt token
    first, then the top K) and the actual token's rank."""

    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one sequence.

    ``new_logprobs``: per new token ``(ids [1 + K], logprobs [1 + K], rank of the sampled
    token)``, the sampled token first (natural log, fp32). ``finish_reason``: set once, by
    the core's token-id checks: "stop" (EOS or a ``stop_token_ids`` entry; ``stop_reason``
    is that id for the latter), "length" (``max_tokens`` or the context), "abort" (the core
    dropped it; ``error`` says why).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    new_prompt_logprobs: PromptLogprobsData | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A core's state after a step (the server's gauges)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_free_blocks: int = 0
    num_usable_blocks: int = 0
    # Speculative decoding since the start (vLLM's names): draft and accepted tokens,
    # verifications (sequence-steps with drafts), accepted tokens by draft position (as
    # many positions as drafts per step; none without speculation).
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to a ``UTILITY`` call number ``call_id``: ``result`` or ``error``."""

    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One message of a core: a step's outputs, a utility answer, or a fatal error.

    ``engine_index``: the data-parallel replica that sent it. ``engine_dead``: the core
    failed (``error`` has its traceback) and exits; every request it held is lost.
    ``config_error``: a rank failed to start on bad input (a model path, a value the loader
    rejects: a ValueError or FileNotFoundError), and this is its message alone.
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    engine_dead: bool = False
    error: str | None = None
    config_error: str | None = None


class EngineCoreReady(msgspec.Struct, array_like=True, gc=False, tag=True):
    """A core's startup handshake: what it resolved, and the limits the front end validates
    requests against.

    ``resolved``: every setting the core decided (dtype, quantization, context length, batch
    limits, KV cache size, generation defaults: :class:`ResolvedConfig`); the front end reads
    these, never its own config's unresolved fields. ``eos_token_ids``: the EOS ids of the
    model's configs (the front end adds its tokenizer's and the generation defaults'; stop
    tokens unless ``ignore_eos``); ``kv_cache_shape_per_block``: ``(num_kv_heads, head_dim)``
    on this rank; ``parallel``: the rank's ``ParallelInfo`` fields; ``host``: the name of
    the host the replica runs on.
    """

    engine_index: int
    resolved: ResolvedConfig
    vocab_size: int
    eos_token_ids: list[int]
    kv_cache_shape_per_block: tuple[int, int]
    parallel: dict[str, int]
    host: str = ""


class MsgpackEncoder:
    """msgpack encoder of the structs above (one per socket user; not thread-safe)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, obj: Any) -> bytes:
        return self._enc.encode(obj)


class MsgpackDecoder:
    """msgpack decoder into ``type_`` (a struct, or a union of them). Constraints it
    decodes are not parsed again (their front end did; an engine core's loop must not)."""

    def __init__(self, type_: Any) -> None:
        self._dec = msgspec.msgpack.Decoder(type_)

    def decode(self, data: bytes | memoryview) -> Any:
        with validated_elsewhere():
            return self._dec.decode(data)


CoreMessage = EngineCoreOutputs | EngineCoreReady

__all__ = ["CoreMessage", "EngineCoreOutput", "EngineCoreOutputs", "EngineCoreReady", "EngineCoreRequest",
           "EngineCoreRequestType", "MsgpackDecoder", "MsgpackEncoder", "PromptLogprobsData", "SchedulerStats",
           "UtilityOutput"]
