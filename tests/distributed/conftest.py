"""Helpers of the multi-process engine tests: tiny random-weight models (config.json +
``load_format="dummy"``: the dummy weights are drawn at full shape from one seed and sliced,
so every rank of every layout holds the same model) and a watchdog around generate."""

from __future__ import annotations

import json
import threading

import pytest

from tandem.sampling_params import SamplingParams

COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6)
CONFIGS = {
    "llama": dict(model_type="llama", **COMMON, num_key_value_heads=2, intermediate_size=128),
    "qwen3_moe": dict(model_type="qwen3_moe", **COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "deepseek_v2": dict(model_type="deepseek_v2", **COMMON, num_key_value_heads=4, intermediate_size=96,
                        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=16, v_head_dim=16, topk_method="greedy", norm_topk_prob=False,
                        routed_scaling_factor=1.0),
}
# Mixed lengths (prefill chunks of different sizes, then decodes of different ages).
PROMPTS = [list(range(7 + i, 7 + i + n)) for i, n in enumerate([5, 23, 11, 2, 37, 8])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = dict(load_format="dummy", block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def _startup_watchdog(monkeypatch):
    """Spawned ranks that do not come up within 3 minutes fail the test (and are killed)."""
    monkeypatch.setenv("TANDEM_STARTUP_TIMEOUT_S", "180")


@pytest.fixture
def model_dir(tmp_path_factory):
    def make(family: str) -> str:
        d = tmp_path_factory.mktemp(family)
        (d / "config.json").write_text(json.dumps(CONFIGS[family]))
        return str(d)

    return make


def make_llm(model: str, llm_class=None, **kwargs):
    """``llm_class`` (default ``LLM``) on the test engine settings; the tokenizer is the
    embedded model's unless ``tokenizer`` is given."""
    from tandem.config import embedded_default_model
    from tandem.entrypoints.llm import LLM

    kwargs.setdefault("tokenizer", embedded_default_model())
    return (llm_class or LLM)(model=model, **{**ENGINE, **kwargs})


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory) -> str:
    """A word-level tokenizer of the test models' 512 ids (``t0`` .. ``t511``, eos ``t1``)
    for token-id prompts: it loads in milliseconds, where the embedded GGUF's takes seconds
    of CPU in every spawned rank."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(COMMON["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    d = tmp_path_factory.mktemp("word_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", unk_token="t0").save_pretrained(d)
    return str(d)


def generate_ids(llm, prompts, params=GREEDY, timeout: float = 180.0) -> list[list[int]]:
    """Greedy token ids of each prompt; kills the deployment and fails on a hang."""
    return [o.outputs[0].token_ids for o in generate_outputs(llm, prompts, params, timeout)]


def generate_outputs(llm, prompts, params=GREEDY, timeout: float = 180.0) -> list:
    """``llm.generate``'s outputs; kills the deployment and fails on a hang."""
    box: dict = {}

    def run():
        try:
            box["out"] = llm.generate(prompts, params, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        kill = getattr(llm.engine, "_kill", None)
        if kill is not None:
            kill()
        pytest.fail(f"generate did not finish within {timeout}s (hang)")
    if "err" in box:
        raise box["err"]
    return box["out"]


def constrained_mix() -> list[SamplingParams]:
    """Greedy, 10 tokens, for each of ``PROMPTS``: every other one constrained to the regex
    ``(t3|t4|t5)+t9`` (the word tokenizer's ids), the rest free."""
    from tandem.structured_output import StructuredOutputsParams

    free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(regex="(t3|t4|t5)+t9"))
    return [constrained if i % 2 else free for i in range(len(PROMPTS))]


def single_process_ids(model: str, prompts=PROMPTS, params=GREEDY, **kwargs) -> list[list[int]]:
    llm = make_llm(model, **kwargs)
    try:
        return generate_ids(llm, prompts, params)
    finally:
        llm.engine.shutdown()
