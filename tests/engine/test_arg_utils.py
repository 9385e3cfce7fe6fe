"""``EngineArgs``: the flat arguments of ``LLM(...)`` and of every ``tandem`` command's engine
flags. The flags are generated from the config groups' fields: each has a flag with the
field's doc as help, the dataclass's default, type and choices; flags round-trip into the
nested config."""

from __future__ import annotations

import argparse
import subprocess
import sys
import typing
from dataclasses import MISSING, asdict, fields

import pytest

from tandem.config import EngineConfig, get_attr_docs
from tandem.engine.arg_utils import EngineArgs, flag_fields, with_flag_names


def _parser(model_positional: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, model_positional=model_positional)
    return p


def _group_fields():
    for group in EngineConfig.group_types().values():
        hints = typing.get_type_hints(group)
        for f in flag_fields(group):
            yield group, f, hints[f.name]


def test_engine_args_are_exactly_the_group_fields_with_their_types_and_defaults():
    args_hints = typing.get_type_hints(EngineArgs)
    args_fields = {f.name: f for f in fields(EngineArgs)}
    seen = []
    for group, f, tp in _group_fields():
        assert f.name in args_fields, f"{group.__name__}.{f.name} has no EngineArgs field"
        assert args_hints[f.name] == tp, f.name
        assert f.default is not MISSING and args_fields[f.name].default == f.default, f.name
        seen.append(f.name)
    assert len(seen) == len(set(seen)), "a field name is in two groups"
    assert sorted(seen + list(EngineConfig.json_groups())) == sorted(args_fields)


def test_every_field_has_a_flag_with_its_doc_and_default():
    actions = {a.dest: a for a in _parser()._actions}
    for group, f, _ in _group_fields():
        action = actions[f.name]
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        doc = get_attr_docs(group)[f.name]
        assert doc and action.help.startswith(doc.replace("%", "%%")), f.name
        assert action.default == f.default, f.name
    assert _parser().parse_args([]) == argparse.Namespace(**asdict(EngineArgs()))


def test_flag_types_choices_and_booleans_come_from_the_dataclass():
    actions = {a.dest: a for a in _parser()._actions}
    assert actions["max_num_seqs"].type is int and actions["max_model_len"].type is int
    assert actions["gpu_memory_utilization"].type is float and actions["tokenizer"].type is str
    assert tuple(actions["kv_cache_dtype"].choices) == ("auto", "fp8", "fp8_e4m3")
    assert tuple(actions["quantization"].choices) == ("fp8", "compressed-tensors", "gguf", "none")
    assert "-q" in actions["quantization"].option_strings
    assert isinstance(actions["enforce_eager"], argparse.BooleanOptionalAction)
    assert "--no-enable-prefix-caching" in actions["enable_prefix_caching"].option_strings
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-cache-dtype", "fp16"])


def test_flags_round_trip_into_the_nested_config():
    ns = _parser(model_positional=True).parse_args([
        "m", "--all2all-backend", "simulated", "--simulated-ep-rank-experts", "--no-dbo-measure-split",
        "-q", "fp8", "--kv-cache-dtype", "fp8", "--max-num-seqs", "7", "--block-size", "32", "--no-enable-prefix-caching",
        "--tensor-parallel-size", "1", "--simulated-link-gbps", "12.5", "--master-port", "29555", "--enforce-eager"])
    args = EngineArgs.from_cli_args(ns)
    assert args.model == "m"  # the positional model
    cfg = args.create_engine_config()
    assert cfg.simulated_link_config.simulated_ep_rank_experts and not cfg.dbo_config.dbo_measure_split
    assert cfg.model_config.quantization == "fp8" and cfg.cache_config.kv_cache_dtype == "fp8"
    assert cfg.scheduler_config.max_num_seqs == 7 and cfg.cache_config.block_size == 32
    assert not cfg.cache_config.enable_prefix_caching and cfg.model_config.enforce_eager
    assert cfg.simulated_link_config.simulated_link_gbps == 12.5 and cfg.parallel_config.master_port == 29555
    # Every field reaches its group unchanged; the usage context comes from the entry point.
    flat = {k: v for group in asdict(cfg).values() if group is not None for k, v in group.items()}
    assert flat.pop("usage_context") == "llm_class"
    assert flat == {k: v for k, v in asdict(args).items() if k not in EngineConfig.json_groups()}
    assert args.create_engine_config("openai_api_server").scheduler_config.usage_context == "openai_api_server"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (nested) subcommand parser by its prog, e.g. ``tandem bench throughput``."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found[sub.prog] = sub
                found.update(_subparsers(sub))
    return found


@pytest.mark.parametrize("prog", ["tandem generate", "tandem serve", "tandem bench throughput", "tandem eval",
                                  "tandem eval-parity"])
def test_every_engine_command_takes_every_engine_flag(prog):
    from tandem.entrypoints.cli import build_parser

    parser = _subparsers(build_parser())[prog]
    dests = {a.dest: a for a in parser._actions}
    for f in fields(EngineArgs):
        assert f.name in dests and dests[f.name].help, (prog, f.name)


def test_unknown_llm_keyword_is_a_type_error():
    from tandem.entrypoints.llm import LLM

    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs=0)


def test_a_config_error_names_the_flags_on_the_command_line():
    """Every multi-word flag field is renamed, only as a whole name; plain words stay."""
    for _, f, _ in _group_fields():
        if "_" in f.name:
            flag = "--" + f.name.replace("_", "-")
            assert with_flag_names(f"{f.name} must be set, got {f.name}=3.") == f"{flag} must be set, got {flag}=3."
    text = ("pipeline_parallel_size_local 2 > pipeline_parallel_size 1; model 'x' on device cpu; "
            "num_speculative_tokens and my_max_model_len and --max-num-seqs stay")
    assert with_flag_names(text) == ("--pipeline-parallel-size-local 2 > --pipeline-parallel-size 1; model 'x' on "
                                     "device cpu; num_speculative_tokens and my_max_model_len and --max-num-seqs stay")


def test_a_command_line_error_names_the_commands_own_flags_too():
    """With the parser, the sampling flags of tandem generate are named as typed (top_p is
    --top-p), besides the engine's; a JSON group's keys stay keys."""
    from tandem.entrypoints.cli import build_parser

    parser = build_parser()
    assert with_flag_names("min_tokens must be less than or equal to max_tokens=4, got 10.", parser) == \
        "--min-tokens must be less than or equal to --max-tokens=4, got 10."
    assert with_flag_names("top_p must be in (0, 1], got 2.0; tensor_parallel_size (2)", parser) == \
        "--top-p must be in (0, 1], got 2.0; --tensor-parallel-size (2)"
    assert with_flag_names("speculative_config: num_speculative_tokens must be >= 1", parser) == \
        "--speculative-config: num_speculative_tokens must be >= 1"


def test_building_the_cli_does_not_import_torch():
    code = ("import sys; from tandem.entrypoints.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
