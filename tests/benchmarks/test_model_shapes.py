"""``python benchmarks/model_shapes.py SHAPE DIR`` writes a folder that runs with
``--load-format dummy`` and no ``--tokenizer`` (the README's dummy-weights example); the
SmolLM2 shape is the embedded model's."""

from __future__ import annotations

import os

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def test_smollm2_shape_folder_runs_with_dummy_weights(tmp_path, monkeypatch, embedded_model_path):
    monkeypatch.syspath_prepend(BENCH)
    from model_shapes import SMOLLM2_135M, main

    from tandem.entrypoints.llm import LLM
    from tandem.model_loader.loader import load_hf_config
    from tandem.sampling_params import SamplingParams

    real = load_hf_config(embedded_model_path)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert SMOLLM2_135M[key] == getattr(real, key), key
    folder = str(tmp_path / "smol_shape")
    main(["smollm2-135m", folder])
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(folder))
    llm = LLM(folder, load_format="dummy", device="cpu", max_model_len=64, num_kv_blocks=8)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
