"""``--speculative-config`` / ``LLM(speculative_config=...)``: JSON parsing, validation
naming the field, vLLM's prompt-lookup defaults, and what the resolved engine config does
with it (asynchronous output processing off; parallelism and DBO refused)."""

from __future__ import annotations

import argparse

import pytest

from tandem.config import SpeculativeConfig
from tandem.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE
from tandem.engine.arg_utils import EngineArgs


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}', r"unknown fields \['draft'\]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model is not used by method 'ngram'"),
    ({"num_speculative_tokens": 2},
     r"method must be one of \['ngram', 'draft_model', 'eagle', 'eagle3'\], got None; or leave it out and give "
     r"speculative_config.model"),
    ({"method": "medusa", "num_speculative_tokens": 2}, r"method must be one of .*, got 'medusa'\.$"),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     r"model \(the draft model's or head's path\) is required with method 'draft_model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/model"},
     "model: no such file or folder: '/no/such/model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/", "prompt_lookup_max": 3},
     "prompt_lookup_max is for method 'ngram'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "path\\) is required with method 'eagle'"),
    ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 2},
     "model: no such file or folder: 'yuhuili/EAGLE3-LLaMA3.1-Instruct-8B'"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": __file__}, "an EAGLE head is a Hugging Face folder"),
    ({"model": "/no/such/draft", "num_speculative_tokens": 2}, "model: no such file or folder"),
    ({"method": "ngram"}, "num_speculative_tokens is required: how many draft tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1.5}, "disable_by_batch_size must be"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
])
def test_bad_values_are_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value).create_engine_config()


@pytest.mark.parametrize("given, expected", [
    ({}, (5, 5)),  # vLLM's defaults
    ({"prompt_lookup_max": 3}, (3, 3)),
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
])
def test_prompt_lookup_defaults_follow_vllm(given, expected):
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, **given)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expected


@pytest.mark.parametrize("model, method, kept", [("ngram", "ngram", None), ("[ngram]", "ngram", None),
                                                 ("/", "draft_model", "/")])
def test_method_follows_from_model_as_in_vllm(model, method, kept):
    cfg = SpeculativeConfig(model=model, num_speculative_tokens=2)
    assert (cfg.method, cfg.model) == (method, kept)


@pytest.mark.parametrize("folder, method", [("EAGLE3-LLaMA3.1-head", "eagle3"), ("EAGLE-LLaMA3-head", "eagle"),
                                            ("eagle_trial/draft", "draft_model"), ("eagle/draft", "draft_model")])
def test_the_method_follows_from_the_last_folder_name_as_in_vllm(tmp_path, folder, method):
    (tmp_path / folder).mkdir(parents=True)
    cfg = SpeculativeConfig(model=str(tmp_path / folder), num_speculative_tokens=2)
    assert (cfg.method, cfg.uses_model) == (method, True)


def test_flag_and_dict_give_the_same_config():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    from_flag = EngineArgs.from_cli_args(ns).create_engine_config()
    from_dict = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).create_engine_config()
    assert from_flag == from_dict
    assert EngineArgs().create_engine_config().speculative_config is None
    assert EngineArgs(speculative_config="{}").create_engine_config().speculative_config is None


def test_speculation_keeps_async_output_processing_and_a_batch_size_limit():
    cfg = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
    assert cfg.scheduler_config.async_output_proc
    assert cfg.speculative_config.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    off = SpeculativeConfig(method="ngram", num_speculative_tokens=2, disable_by_batch_size=None)
    assert off.disable_by_batch_size is None


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2}, "tensor, pipeline, data or expert parallelism"),
    ({"data_parallel_size": 2}, "tensor, pipeline, data or expert parallelism"),
    ({"enable_expert_parallel": True}, "tensor, pipeline, data or expert parallelism"),
    ({"pipeline_parallel_size": 2}, "tensor, pipeline, data or expert parallelism"),
    ({"enable_dbo": True}, "enable_dbo"),
])
def test_what_stage_one_does_not_cover_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kwargs).create_engine_config()
