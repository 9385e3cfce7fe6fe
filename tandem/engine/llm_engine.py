"""The synchronous engine front end: validate and tokenize, hand sequences to an engine core,
turn the core's token ids into ``RequestOutput``s.

``step()`` asks the core client for one step's outputs (with the in-process core: runs the
core's one-step-ahead iteration, see :mod:`tandem.engine.core`), detokenizes them and applies
stop strings (:mod:`tandem.engine.output_processor`); sequences finished by a stop string are
aborted in their core before the next step. With the in-process core, the front end's
processing of step N overlaps the model's execution of step N+1 (docs/architecture.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from tandem.config import EngineConfig
from tandem.config.resolved import ResolvedConfig
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.processor import MAX_LOGPROBS, Processor
from tandem.model_loader.loader import load_tokenizer
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.step_timing import StepHostTimes

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "MAX_LOGPROBS"]


class LLMEngine:
    """Front end over one engine-core client (:mod:`tandem.engine.core_client`).

    Args:
        config: engine configuration (``self.config``, as given); what the core resolved
            from it (dtype, limits, KV cache size, generation defaults) is ``self.resolved``.
        client: a core client; None: the core in this process for one rank, spawned rank
            processes for ``tensor_parallel_size * data_parallel_size > 1``.

    Raises:
        ValueError: the model cannot be loaded or the limits are inconsistent.
    """

    def __init__(self, config: EngineConfig, client=None) -> None:
        if client is None:
            from tandem.engine.core_client import make_client

            client = make_client(config)
        self.client = client
        ready = client.ready
        self.config = config
        self.resolved: ResolvedConfig = ready.resolved
        self.tokenizer = load_tokenizer(config.model_config.tokenizer or config.model_config.model)
        self.processor = Processor(self.tokenizer, ready)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = ready.vocab_size
        self.num_kv_blocks = self.resolved.num_kv_blocks
        self.eos_token_ids = self.processor.eos_token_ids
        # Rank 0's handshake, for tests and logs (``parallel``: its ParallelInfo fields).
        self.rank0_info = {"parallel": _Info(ready.parallel), "kv_cache_shape_per_block": ready.kv_cache_shape_per_block,
                           "max_model_len": self.resolved.max_model_len, "num_kv_blocks": self.resolved.num_kv_blocks}

    @property
    def generation_defaults(self):
        """The model's generation_config.json (``GenerationDefaults``)."""
        return self.processor.generation_defaults

    # The core's parts, when it runs in this process (tests, tools).
    @property
    def core(self):
        return self.client.core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_manager(self):
        return self.core.kv_manager

    @property
    def runner(self):
        return self.core.runner

    @property
    def model(self):
        return self.core.model

    def start_host_timing(self) -> StepHostTimes | None:
        """Record the core's host time per step from now on (:mod:`tandem.step_timing`);
        None (nothing recorded) when the core runs in another process."""
        core = getattr(self.client, "core", None)
        return None if core is None else core.start_host_timing()

    def stop_host_timing(self) -> StepHostTimes | None:
        """The times recorded since ``start_host_timing`` (None without an in-process core)."""
        core = getattr(self.client, "core", None)
        return None if core is None else core.stop_host_timing()

    @property
    def final_stats(self) -> dict | None:
        """Replica 0's step counts after ``shutdown()`` (spawned cores)."""
        return getattr(self.client, "final_stats", None)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling values a request gets for the fields it leaves unset: the model's
        generation_config.json, else vLLM's defaults."""
        return self.processor.default_sampling_params()

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request (text prompt or token ids).

        Raises:
            ValueError: empty prompt, prompt + max_tokens over the context, token ids
                outside the vocabulary, request_id already live, bad sampling values.
        """
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use by a running request.")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        text, reqs = self.processor.process_inputs(request_id, prompt, params, arrival)
        self.output_processor.add_request(request_id, text, reqs)
        self.client.add_requests(reqs)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests: their blocks are freed, nothing more is emitted for them."""
        core_ids = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            core_ids += self.output_processor.abort(rid)
        self.client.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns the outputs produced by it. A request its
        core dropped (its grammar did not compile, its model step failed) gets a final
        output with ``error`` set and its unfinished completions as "abort".

        Raises:
            Exception: a model step failed (in-process core): the requests of the failed
                step and of the step in flight are dropped (their blocks freed); the engine
                stays usable for the others and for new ones.
            EngineDeadError: a spawned core died.
        """
        outs = self.client.get_output()
        res = self.output_processor.process_outputs(outs.outputs)
        for rid, err in res.errors.items():
            logger.error("request %s dropped by its engine core: %s", rid, err)
        self.client.abort_requests(res.reqs_to_abort)
        return res.request_outputs + res.failed_outputs

    def shutdown(self) -> None:
        self.client.shutdown()

    def stats(self) -> dict[str, float]:
        return dict(self.output_processor.stats)


class _Info:
    """Attribute access to a core's ``ParallelInfo`` fields."""

    def __init__(self, fields: dict[str, int]) -> None:
        self.__dict__.update(fields)
