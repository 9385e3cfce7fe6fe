"""Flat engine arguments and their flags (vLLM's ``vllm/engine/arg_utils.py``).

:class:`EngineArgs` holds one field per field of the config groups (same name, same default):
it is what ``LLM(**kwargs)`` takes and what every ``tandem`` command's engine flags parse
into; :meth:`EngineArgs.create_engine_config` routes the fields into the nested
:class:`tandem.config.EngineConfig`. The flags are generated from the groups' fields: the
name (``--max-num-seqs``), type, choices (``Literal`` fields), default and help (the field's
doc) come from the dataclass, so a new config field is a new flag without editing this file.
A field whose metadata says ``flag: False`` is set by the entry point instead
(``usage_context``: an argument of :meth:`EngineArgs.create_engine_config`). An optional
group (``EngineConfig.json_groups``: ``speculative_config``) is one argument, a JSON object
or dict, and one flag (``--speculative-config '{...}'``), as in vLLM.
"""

from __future__ import annotations

import argparse
import re
import typing
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

from tandem.config import (CacheConfig, CacheDType, DBOConfig, DeviceConfig, EngineConfig, LoadConfig, LoadFormat,
                           ModelConfig, ModelDType, ParallelConfig, SchedulerConfig, SimulatedLinkConfig,
                           SpeculativeConfig, get_attr_docs)
from tandem.config.parallel import All2AllBackend
from tandem.config.scheduler import UsageContext
from tandem.config.utils import literal_choices, unwrap_optional
from tandem.layers.quantization.config import QuantizationMethods

# Short forms kept from vLLM's CLI.
_FLAG_ALIASES = {"quantization": ("-q",), "tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",)}


@dataclass
class EngineArgs:
    """Every engine argument, flat (``LLM(model=..., max_num_seqs=..., dtype=...)``); each
    field's doc is that of the config field it fills (:mod:`tandem.config`)."""

    # ModelConfig
    model: str | None = ModelConfig.model
    tokenizer: str | None = ModelConfig.tokenizer
    generation_config: str = ModelConfig.generation_config
    dtype: ModelDType = ModelConfig.dtype
    max_model_len: int | None = ModelConfig.max_model_len
    quantization: QuantizationMethods | None = ModelConfig.quantization
    seed: int = ModelConfig.seed
    enforce_eager: bool = ModelConfig.enforce_eager
    deterministic: bool = ModelConfig.deterministic
    # LoadConfig
    load_format: LoadFormat = LoadConfig.load_format
    # DeviceConfig
    device: str = DeviceConfig.device
    # CacheConfig
    block_size: int = CacheConfig.block_size
    num_kv_blocks: int | None = CacheConfig.num_kv_blocks
    kv_cache_memory_gib: float = CacheConfig.kv_cache_memory_gib
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    kv_cache_dtype: CacheDType = CacheConfig.kv_cache_dtype
    # SchedulerConfig
    max_num_seqs: int | None = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    async_output_proc: bool = SchedulerConfig.async_output_proc
    # ParallelConfig
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    data_parallel_size: int = ParallelConfig.data_parallel_size
    enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel
    all2all_backend: All2AllBackend = ParallelConfig.all2all_backend
    master_addr: str | None = ParallelConfig.master_addr
    master_port: int | None = ParallelConfig.master_port
    data_parallel_size_local: int | None = ParallelConfig.data_parallel_size_local
    data_parallel_start_rank: int = ParallelConfig.data_parallel_start_rank
    pipeline_parallel_size_local: int | None = ParallelConfig.pipeline_parallel_size_local
    pipeline_parallel_start_rank: int = ParallelConfig.pipeline_parallel_start_rank
    data_parallel_address: str | None = ParallelConfig.data_parallel_address
    data_parallel_rpc_port: int | None = ParallelConfig.data_parallel_rpc_port
    # DBOConfig
    enable_dbo: bool = DBOConfig.enable_dbo
    dbo_decode_token_threshold: int = DBOConfig.dbo_decode_token_threshold
    dbo_prefill_token_threshold: int = DBOConfig.dbo_prefill_token_threshold
    dbo_measure_split: bool = DBOConfig.dbo_measure_split
    # SimulatedLinkConfig
    simulated_link_gbps: float = SimulatedLinkConfig.simulated_link_gbps
    simulated_link_latency_us: float = SimulatedLinkConfig.simulated_link_latency_us
    simulated_ep_size: int = SimulatedLinkConfig.simulated_ep_size
    simulated_ep_rank_experts: bool = SimulatedLinkConfig.simulated_ep_rank_experts
    # Optional groups, given whole as JSON (EngineConfig.json_groups)
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    def create_engine_config(self, usage_context: UsageContext = "llm_class") -> EngineConfig:
        """The nested config of these arguments, every group validated; ``usage_context``:
        ``"openai_api_server"`` from ``tandem serve`` (it picks default batch limits).

        Raises:
            ValueError: a bad value, naming the field.
        """
        values = {**{f.name: getattr(self, f.name) for f in fields(self)}, "usage_context": usage_context}
        flat = {name: group(**{f.name: values[f.name] for f in fields(group)})
                for name, group in EngineConfig.group_types().items()}
        optional = {name: group.from_json(values[name]) for name, group in EngineConfig.json_groups().items()}
        return EngineConfig(**flat, **optional)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
        """Add one flag per field, in one argument group per config group (``--help``
        lists them under ``ModelConfig``, ``CacheConfig``, ...). ``model_positional``: also
        take the model as an optional positional argument (``tandem serve MODEL``)."""
        if model_positional:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL",
                                help="the model, as --model (default: the embedded SmolLM2-135M-Instruct)")
        for group in EngineConfig.group_types().values():
            arg_group = parser.add_argument_group(group.__name__, (group.__doc__ or "").strip())
            hints = typing.get_type_hints(group)
            docs = get_attr_docs(group)
            for f in flag_fields(group):
                flags = ("--" + f.name.replace("_", "-"), *_FLAG_ALIASES.get(f.name, ()))
                arg_group.add_argument(*flags, dest=f.name, **_flag_kwargs(f, hints[f.name], docs[f.name]))
        for name, group in EngineConfig.json_groups().items():
            parser.add_argument_group(group.__name__, (group.__doc__ or "").strip()).add_argument(
                "--" + name.replace("_", "-"), dest=name, default=None, metavar="JSON", help=_json_flag_help(group))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments parsed by a parser that :meth:`add_cli_args` filled (not yet validated)."""
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls)}
        if getattr(args, "model_pos", None):
            kwargs["model"] = args.model_pos
        return cls(**kwargs)


def with_flag_names(message: str, parser: argparse.ArgumentParser | None = None) -> str:
    """``message`` (a config or sampling error, which names fields as ``LLM(...)`` and
    ``SamplingParams`` take them) with each name of several words (``data_parallel_rpc_port``,
    ``min_tokens``) written as its flag (``--data-parallel-rpc-port``), for a command-line user:
    the engine fields, and with ``parser`` every long option of it and its subcommands (the
    sampling flags of ``tandem generate``). One-word names (``model``, ``temperature``) are
    left as they are: they are also plain words."""
    flags = {f.name: "--" + f.name.replace("_", "-") for group in EngineConfig.group_types().values()
             for f in flag_fields(group)}
    if parser is not None:
        flags.update(_long_options(parser))
    names = sorted((name for name in flags if "_" in name), key=len, reverse=True)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")\b")
    return pattern.sub(lambda m: flags[m.group(1)], message)


def _long_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``dest -> --long-option`` of ``parser``'s options and its subcommands'."""
    found: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.update(_long_options(sub))
        else:
            long = [o for o in action.option_strings if o.startswith("--")]
            if long:
                found.setdefault(action.dest, long[0])
    return found


def flag_fields(group: type) -> list[Field]:
    """The fields of a config group that are engine arguments (all but ``flag: False`` ones)."""
    return [f for f in fields(group) if f.metadata.get("flag", True)]


def _json_flag_help(group: type) -> str:
    """Help of a JSON group's flag: its fields and their docs."""
    docs = get_attr_docs(group)
    keys = "; ".join(f"{f.name}: {docs[f.name].rstrip('.')}" for f in fields(group))
    return f"a JSON object (default: off) with the keys {keys}.".replace("%", "%%")


def _flag_kwargs(f: Field, tp: Any, doc: str) -> dict[str, Any]:
    """``add_argument`` keywords of a config field: BooleanOptionalAction for a bool
    (``--x`` / ``--no-x``), ``choices`` for a ``Literal``, else the field's scalar type."""
    default = f.default
    assert default is not MISSING, f"config field {f.name} needs a default (a flag may be left out)"
    help_text = doc.replace("%", "%%") + ("" if default is None else f" (default: {default})")
    kwargs: dict[str, Any] = {"default": default, "help": help_text}
    base, _ = unwrap_optional(tp)
    choices = literal_choices(tp)
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif choices is not None:
        kwargs["choices"] = choices
    else:
        kwargs["type"] = base
    return kwargs
