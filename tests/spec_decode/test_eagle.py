"""EAGLE / EAGLE-3 speculative decoding (stage 4 of issue 46): heads in the public Hugging
Face layout (random weights: no public head can be downloaded here) load and draft what a
plain-torch reading of the EAGLE papers drafts over transformers' hidden states of the
same target, through chunked prefills and prefix-cache hits; greedy output equals no
speculation alone, in a batch and under preemption; a head that agrees with its target
gets its drafts accepted; heads that do not fit the target are refused with one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tandem.entrypoints.llm import LLM
from tandem.sampling_params import SamplingParams
from tests.conftest import assert_all_blocks_free

V, H, HEADS, KV, HD, INTER, DRAFT_V = 512, 64, 4, 2, 16, 128, 300
LAYERS = 8
AUX = (2, LAYERS // 2, LAYERS - 3)  # the default EAGLE-3 layers of an 8-layer target
K = 3
TARGET = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=H,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=INTER,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              initializer_range=0.2)
HEAD = {**TARGET, "num_hidden_layers": 1}
TOKEN_PROMPTS = [[5, 17, 99, 23, 41, 7, 7, 8, 250, 3, 11], list(range(1, 30)), [300, 301, 302] * 6,
                 [5, 17, 99, 23, 41, 7, 7, 8, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


# ----------------------------------------------------------------- checkpoints
def _save_folder(path, config: dict, weights: dict[str, torch.Tensor], bin_file: bool = False) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(weights, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return str(path)


def _head_weights(eagle3: bool, seed: int) -> dict[str, torch.Tensor]:
    """A head's tensors under the public checkpoints' names, random."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s  # noqa: E731
    norm = lambda: 1 + 0.1 * torch.randn(H, generator=gen)  # noqa: E731
    pre = "midlayer." if eagle3 else "layers.0."
    qkv_in = 2 * H if eagle3 else H
    w = {pre + "self_attn.q_proj.weight": rnd(HEADS * HD, qkv_in), pre + "self_attn.k_proj.weight": rnd(KV * HD, qkv_in),
         pre + "self_attn.v_proj.weight": rnd(KV * HD, qkv_in), pre + "self_attn.o_proj.weight": rnd(H, HEADS * HD),
         pre + "mlp.gate_proj.weight": rnd(INTER, H), pre + "mlp.up_proj.weight": rnd(INTER, H),
         pre + "mlp.down_proj.weight": rnd(H, INTER), pre + "post_attention_layernorm.weight": norm(),
         "embed_tokens.weight": rnd(V, H)}  # a copy of the target's in some heads: not loaded
    if eagle3:
        targets = torch.randperm(V, generator=gen)[:DRAFT_V].sort().values
        w |= {pre + "input_layernorm.weight": norm(), pre + "hidden_norm.weight": norm(), "norm.weight": norm(),
              "fc.weight": rnd(H, 3 * H, s=0.1), "lm_head.weight": rnd(DRAFT_V, H),
              "d2t": targets - torch.arange(DRAFT_V), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, targets, True)}
    else:
        w |= {"fc.weight": rnd(H, 2 * H, s=0.1), "fc.bias": rnd(H)}
    return w


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random Llama of 8 layers saved by transformers, and that transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TARGET.items() if k != "model_type"})).eval()
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder), model


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    eagle = _head_weights(False, seed=1)
    eagle3 = _head_weights(True, seed=2)
    return {"eagle": (_save_folder(root / "eagle", HEAD, eagle, bin_file=True), eagle),
            "eagle3": (_save_folder(root / "eagle3", {**HEAD, "architectures": ["LlamaForCausalLMEagle3"],
                                                      "draft_vocab_size": DRAFT_V}, eagle3), eagle3)}


def _llm(target_path: str, tokenizer: str, method: str | None, head: str | None, **kw) -> LLM:
    spec = None if method is None else {"method": method, "model": head, "num_speculative_tokens": K,
                                        "disable_by_batch_size": None}
    args = dict(tokenizer=tokenizer, block_size=8, num_kv_blocks=64, max_model_len=128, dtype="float32",
                speculative_config=spec)
    return LLM(target_path, **{**args, **kw})


def _ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(target, embedded_model_path):
    llm = _llm(target[0], embedded_model_path, None, None)
    ids = _ids(llm, TOKEN_PROMPTS)
    llm.engine.shutdown()
    return ids


# ----------------------------------------------------------------- the papers, in plain torch
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of ``x [T, heads, HD]`` at positions 0..T-1."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    ang = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., :HD // 2], x[..., HD // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def _attention(x: torch.Tensor, w: dict, pre: str) -> torch.Tensor:
    t = x.shape[0]
    q = _rope((x @ w[pre + "self_attn.q_proj.weight"].T).view(t, HEADS, HD))
    k = _rope((x @ w[pre + "self_attn.k_proj.weight"].T).view(t, KV, HD)).repeat_interleave(HEADS // KV, 1)
    v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(t, KV, HD).repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(HD)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, HEADS * HD)
    return out @ w[pre + "self_attn.o_proj.weight"].T


def _mlp(x: torch.Tensor, w: dict, pre: str) -> torch.Tensor:
    gate, up = x @ w[pre + "mlp.gate_proj.weight"].T, x @ w[pre + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T


def _head(w: dict, eagle3: bool, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(states for logits, states for the next position) of a head over a whole sequence."""
    if eagle3:
        pre = "midlayer."
        x = torch.cat([_rms(emb, w[pre + "input_layernorm.weight"]), _rms(hidden, w[pre + "hidden_norm.weight"])], -1)
        r = _attention(x, w, pre) + hidden
        out = _mlp(_rms(r, w[pre + "post_attention_layernorm.weight"]), w, pre) + r
        return _rms(out, w["norm.weight"]), out
    pre = "layers.0."
    x = torch.cat([emb, hidden], -1) @ w["fc.weight"].T + w["fc.bias"]  # layer 0 has no input norm
    r = _attention(x, w, pre) + x
    out = _mlp(_rms(r, w[pre + "post_attention_layernorm.weight"]), w, pre) + r
    return out, out


def _reference_drafts(hf, w: dict, eagle3: bool, tokens: list[int]) -> list[int]:
    """The K greedy drafts after ``tokens`` (its last one just emitted): the head over the
    target's hidden states of every earlier position, each paired with the next token."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = torch.cat([hs[i][0] for i in AUX], -1) @ w["fc.weight"].T if eagle3 else hs[-1][0]
        emb_table, lm_head = hf.model.embed_tokens.weight, hf.lm_head.weight
        ids, drafts = list(tokens[1:]), []
        for _ in range(K):
            out, nxt = _head(w, eagle3, emb_table[ids], hidden)
            if eagle3:
                logits = torch.full((V,), float("-inf"))
                logits[torch.arange(DRAFT_V) + w["d2t"]] = out[-1] @ w["lm_head.weight"].T
            else:
                logits = out[-1] @ lm_head.T
            drafts.append(int(logits.argmax()))
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, nxt[-1:]])
    return drafts


def _record_drafts(llm: LLM) -> list[tuple[tuple[int, ...], int, list[int]]]:
    """Wrap the runner so that every proposal is recorded as (prompt, position of the
    emitted token it follows, drafts)."""
    runner = llm.engine.core.runner
    records, order = [], []
    inner_propose, outer = runner.drafter.propose, runner._propose_drafts

    def propose(d):
        drafts = inner_propose(d)
        if drafts is not None:
            for r, idx in enumerate(d.sampled.tolist()):
                pos = int(d.inputs.num_computed[idx] + d.keep[idx])
                records.append((order[r], pos, drafts[r].tolist()))
        return drafts

    def propose_drafts(draft, sampling, last, accepted):
        spec_ids = sampling.spec.seq_ids if sampling.spec is not None else []
        order[:] = [tuple(runner.input_batch.states[sid].prompt_token_ids) for sid in sampling.seq_ids + spec_ids]
        return outer(draft, sampling, last, accepted)

    runner.drafter.propose, runner._propose_drafts = propose, propose_drafts
    return records


# ----------------------------------------------------------------- tests
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_are_the_papers_over_transformers_hidden_states(method, target, heads, embedded_model_path, reference):
    # Chunks of 8 tokens: prompts span several steps, whose last rows take the prompt's next token.
    llm = _llm(target[0], embedded_model_path, method, heads[method][0], max_num_batched_tokens=8,
               enable_chunked_prefill=True, enable_prefix_caching=False)
    records = _record_drafts(llm)
    outputs = [_ids(llm, [p])[0] for p in TOKEN_PROMPTS]
    assert outputs == reference
    full = {tuple(p): p + o for p, o in zip(TOKEN_PROMPTS, outputs)}
    checked = mismatched = 0
    for prompt, pos, drafts in records:
        tokens = full[prompt]
        if pos >= len(tokens):
            continue  # past max_tokens: the request ended there
        checked += 1
        mismatched += drafts != _reference_drafts(target[1], heads[method][1], method == "eagle3", tokens[:pos + 1])
    assert checked >= 4 * (GREEDY.max_tokens // (K + 1)) and mismatched == 0, (checked, mismatched)
    llm.engine.shutdown()


def test_greedy_output_unchanged_in_a_batch_under_preemption(target, heads, embedded_model_path, reference):
    llm = _llm(target[0], embedded_model_path, "eagle3", heads["eagle3"][0], num_kv_blocks=9, max_num_seqs=4)
    assert _ids(llm, TOKEN_PROMPTS) == reference
    stats = llm.engine.core.debug_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    assert_all_blocks_free(llm.engine)
    llm.engine.shutdown()


def test_prefix_cache_hits_keep_greedy_output(target, heads, embedded_model_path, reference):
    llm = _llm(target[0], embedded_model_path, "eagle", heads["eagle"][0])
    assert _ids(llm, TOKEN_PROMPTS) == reference
    assert _ids(llm, TOKEN_PROMPTS) == reference  # every full prompt block now a hit
    assert llm.engine.core.debug_stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(llm.engine)
    llm.engine.shutdown()


def test_a_head_that_agrees_with_its_target_gets_its_drafts_accepted(tmp_path, embedded_model_path):
    # A target whose attention adds nothing (o_proj zero) predicts from the last token
    # alone: emb -> layer -> norm -> lm_head. An EAGLE-1 head whose fc passes the embedding
    # of the next token through, with the target layer's MLP and no attention either,
    # computes the same state up to the final norm's positive scale (norm weight ones), so
    # its argmax is the target's next token whenever the head pairs each position with the
    # right next token.
    torch.manual_seed(3)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**{**{k: v for k, v in HEAD.items() if k != "model_type"}})).eval()
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
    hf.save_pretrained(tmp_path / "target", safe_serialization=True)
    sd = hf.state_dict()
    layer = {k.removeprefix("model."): v for k, v in sd.items() if k.startswith("model.layers.0.")}
    head = {k: v for k, v in layer.items() if "input_layernorm" not in k}
    head["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    folder = _save_folder(tmp_path / "head", HEAD, head)
    llm = _llm(str(tmp_path / "target"), embedded_model_path, None, None)
    ref = _ids(llm, TOKEN_PROMPTS)
    llm.engine.shutdown()
    llm = _llm(str(tmp_path / "target"), embedded_model_path, "eagle", folder)
    assert _ids(llm, TOKEN_PROMPTS) == ref
    stats = llm.engine.core.debug_stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.95 * drafted, (accepted, drafted)
    llm.engine.shutdown()


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 500}, "a head over 500 tokens for a target of 512"),
    ({"hidden_size": 32, "head_dim": 16}, "the head's hidden size is 32 and it takes target states of 32, the target's "
                                           "are 64"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, r"three target layers in 1\.\.7, got \[2, 4, 8\]"),
    ({"num_hidden_layers": 2}, "one decoder layer"),
])
def test_a_head_that_does_not_fit_is_refused_with_one_line(change, message, tmp_path, target, heads,
                                                          embedded_model_path):
    cfg = {**HEAD, "draft_vocab_size": DRAFT_V, **change}
    folder = _save_folder(tmp_path / "head", cfg, heads["eagle3"][1])
    with pytest.raises(ValueError, match=message):
        _llm(target[0], embedded_model_path, "eagle3", folder)


def test_a_head_without_its_draft_vocabulary_map_is_refused(tmp_path, target, heads, embedded_model_path):
    weights = {k: v for k, v in heads["eagle3"][1].items() if k != "d2t"}
    folder = _save_folder(tmp_path / "head", {**HEAD, "draft_vocab_size": DRAFT_V}, weights)
    with pytest.raises(ValueError, match="needs its d2t mapping"):
        _llm(target[0], embedded_model_path, "eagle3", folder)


def _bad_head(tmp_path, heads, change: dict | None = None, drop: str | None = None, config: dict | None = None,
              bin_file: bool = False) -> str:
    weights = {k: v for k, v in heads["eagle3"][1].items() if k != drop} | (change or {})
    return _save_folder(tmp_path / "head", config or {**HEAD, "draft_vocab_size": DRAFT_V,
                                                      "architectures": ["LlamaForCausalLMEagle3"]}, weights, bin_file)


@pytest.mark.parametrize("case, message", [
    ("d2t past the vocabulary", r"d2t maps draft tokens to ids outside the target's vocabulary \[0, 512\)"),
    ("d2t below zero", "d2t maps draft tokens to ids outside"),
    ("a tensor missing", r"lacks weights for \['layers.0.mlp.up_proj.weight'\]"),
    ("a corrupt safetensors file", r"cannot read .*model.safetensors: Error while deserializing header"),
    ("config.json not JSON", "cannot read its config.json"),
    ("an EAGLE-3 head as method eagle", "an EAGLE-3 head .*: use method 'eagle3'"),
])
def test_a_broken_or_mismatched_head_is_one_line_naming_the_field(case, message, tmp_path, target, heads,
                                                                   embedded_model_path):
    method = "eagle3"
    if case.startswith("d2t"):
        d2t = heads["eagle3"][1]["d2t"].clone()
        d2t[-1] = 10_000 if "past" in case else -DRAFT_V
        folder = _bad_head(tmp_path, heads, {"d2t": d2t})
    elif case == "a tensor missing":
        folder = _bad_head(tmp_path, heads, drop="midlayer.mlp.up_proj.weight")
    elif case == "a corrupt safetensors file":
        folder = _bad_head(tmp_path, heads)
        path = tmp_path / "head" / "model.safetensors"
        path.write_bytes(path.read_bytes()[:200])
    elif case == "config.json not JSON":
        folder = _bad_head(tmp_path, heads)
        (tmp_path / "head" / "config.json").write_text("{not json")
    else:
        folder, method = _bad_head(tmp_path, heads), "eagle"
    with pytest.raises(ValueError, match=f"speculative_config.model '{folder}'.*{message}") as info:
        _llm(target[0], embedded_model_path, method, folder)
    assert "\n" not in str(info.value)


def test_a_head_saved_in_torch_legacy_format_loads(tmp_path, target, heads, embedded_model_path):
    folder = tmp_path / "legacy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HEAD))
    torch.save(heads["eagle"][1], folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    llm = _llm(target[0], embedded_model_path, "eagle", str(folder))
    assert len(_ids(llm, TOKEN_PROMPTS[:1])[0]) == GREEDY.max_tokens
    llm.engine.shutdown()
