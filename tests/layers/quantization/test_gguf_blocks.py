"""GGUF blocks run at the file's bits (tandem.layers.quantization.gguf_blocks and the C++
kernels torch.ops.tandem_cpu.gguf_repack and gguf_repacked_linear): every type against gguf's
own dequantization, the input's int8 rounding as the only error beyond fp32's, row invariance
at any row count, the tiles' size against the file's, fused parts of several types, every row
on the one kernel whatever its phase, the layer swap and its restore from a parameter cache's
tensors, and bad tables refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tandem.distributed.forward_context import ForwardContext, RowPhases, forward_context
from tandem.layers import cpu_ops
from tandem.layers.quantization import gguf_blocks
from tandem.layers.quantization.gguf import (MAX_INT4_ROWS, GGUFInt4Linear, defer_block_weights,
                                             gguf_quantized_layers, quantize_gguf_linears, restore_gguf_linears)
from tandem.layers.quantization.gguf_blocks import GGUFBlockLinear, GGUFEmbedding, pack_blocks
from tandem.model_loader.gguf_weights import RawWeight

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built")

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of each type's fp16 scales in a block (d; m or dmin).
_SCALES = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2),
           T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``[rows, bytes]`` blocks of ``qtype``: random bits, finite fp16 scales of ~0.01."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _SCALES[qtype]:
        d = rng.uniform(0.002, 0.02, (rows, cols // block)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _raw(qtype: T, rows: int, cols: int, seed: int = 0) -> RawWeight:
    return RawWeight(_random_blocks(qtype, rows, cols, seed), qtype.name, rows, cols, None)


def _dequantized(w: RawWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w.data, T[w.qtype]).reshape(w.rows, w.cols).astype(np.float64))


def _int8_rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernel quantizes it: int8 per ``group`` values, scale max|x| / 127, round to
    nearest even."""
    g = x.double().reshape(x.shape[0], -1, group)
    d = g.abs().amax(-1, keepdim=True) / 127
    return (torch.round(g / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(x.shape)


def _repacked(parts: list[RawWeight]) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, segments = pack_blocks(parts)
    return cpu_ops.gguf_repack(blocks, segments, parts[0].cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_every_type_is_gguf_dequantization_times_int8_rounded_input(qtype, rows):
    """For each type and row count: the output is gguf's dequantized weight times the input
    rounded as the kernel rounds it (int8 per 32 values) to fp32 rounding (1e-5 of the
    largest output), and within 2e-2 of it times the unrounded input (the stated tolerance;
    ~5e-3 typical)."""
    w = _raw(qtype, 40, 512, seed=qtype.value)
    layer = GGUFBlockLinear.from_parts([w])
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    y = layer(x).double()
    ref = _dequantized(w)
    exact = _int8_rounded(x, 32) @ ref.T
    assert ((y - exact).abs().max() / exact.abs().max()).item() < 1e-5
    plain = x.double() @ ref.T
    assert ((y - plain).abs().max() / plain.abs().max()).item() < 2e-2


def test_the_file_and_its_rows_real_values():
    """Quantized real values (gguf's own quantizer), bf16 input as the model gives it: the
    output's dtype follows the input's, within 2e-2 of the dequantized product."""
    w32 = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    for qtype in (T.Q5_0, T.Q8_0, T.Q4_1):
        w = RawWeight(gguf.quants.quantize(w32, qtype), qtype.name, 64, 256, None)
        x = torch.randn(3, 256).to(torch.bfloat16)
        y = GGUFBlockLinear.from_parts([w])(x)
        assert y.dtype == torch.bfloat16 and y.shape == (3, 64)
        ref = x.double() @ _dequantized(w).T
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_a_row_gets_the_same_bits_in_any_batch():
    """Row-invariant: a row alone and in a batch of 1 to 19 rows at any place (tails of the
    kernel's 8-row passes), one result; the layer the same for any leading shape."""
    repacked, segments = _repacked([_raw(T.Q6_K, 24, 512, 1), _raw(T.Q5_0, 8, 512, 2)])
    xs = torch.randn(19, 512)
    alone = [cpu_ops.gguf_repacked_linear(xs[i:i + 1], repacked, segments)[0] for i in range(xs.shape[0])]
    for n in range(2, xs.shape[0] + 1):
        batch = cpu_ops.gguf_repacked_linear(xs[:n], repacked, segments)
        assert all(torch.equal(batch[i], alone[i]) for i in range(n)), n
    layer = GGUFBlockLinear(repacked, segments)
    assert torch.equal(layer(xs.view(-1, 1, 512)).view(xs.shape[0], -1), layer(xs))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_tiles_every_row_count_and_the_files_bits(qtype):
    """Tiles of 16 weight rows with a partial last one (40 rows) and an input of 1, 8 and 13
    rows (one 8-row pass and its tail): gguf's dequantized weight times the input rounded per
    32, to fp32 rounding; the bias added to each row. The tiles of whole 16-row tiles hold
    the file's bytes (the 32-weight types) or 1/36 more (the K-quants' scales per row and
    group of 32 as bytes, where the file packs them in 6 bits): no dequantized copy."""
    w = _raw(qtype, 40, 512, seed=qtype.value + 1)
    repacked, segments = _repacked([w])
    assert cpu_ops.gguf_repacked_width(repacked, segments) == 512
    bias = torch.randn(40)
    ref = _dequantized(w)
    for rows in (1, 8, 13):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        y = cpu_ops.gguf_repacked_linear(x, repacked, segments, bias).double()
        exact = _int8_rounded(x, 32) @ ref.T + bias.double()
        assert ((y - exact).abs().max() / exact.abs().max()).item() < 1e-5, rows
    whole = _raw(qtype, 48, 512, seed=qtype.value + 1)
    file_bytes = whole.data.size
    ratio = _repacked([whole])[0].numel() / file_bytes
    expected = {T.Q4_K: 2368 / 2304, T.Q5_K: 2880 / 2816, T.Q6_K: 1.0}.get(qtype, 1.0)
    assert ratio == pytest.approx(expected), ratio


def test_fused_parts_of_several_types_and_the_bias():
    """q/k/v of three types (a K-quant among them) in one layer: each part's rows equal the
    part alone; the bias is added to each output row."""
    parts = [_raw(T.Q4_K, 32, 512, 3), _raw(T.Q8_0, 16, 512, 4), _raw(T.Q6_K, 16, 512, 5)]
    bias = torch.randn(64)
    fused = GGUFBlockLinear.from_parts(parts, bias=bias)
    assert (fused.in_features, fused.out_features) == (512, 64)
    # Bytes per 16-row tile at 512 columns: Q4_K 2 x (320 + 8 x 256), Q8_0 16 x (32 + 512).
    assert fused.segments.tolist() == [[T.Q4_K.value, 32, 0], [T.Q8_0.value, 16, 2 * 4736],
                                       [T.Q6_K.value, 16, 2 * 4736 + 8704]]
    x = torch.randn(2, 512)
    alone = torch.cat([GGUFBlockLinear.from_parts([p])(x) for p in parts], dim=1)
    torch.testing.assert_close(fused(x), alone + bias, rtol=0, atol=1e-6)


def test_llama_cpp_row_order_is_undone():
    """q/k rows interleaved by llama.cpp (permute_heads) come back in HF order, as the
    dequantized path loads them."""
    raw = _random_blocks(T.Q8_0, 16, 64, 6)
    w = RawWeight(raw, "Q8_0", 16, 64, permute_heads=2)
    hf_order = torch.from_numpy(w.unpermute(gguf.quants.dequantize(raw, T.Q8_0)).astype(np.float64))
    x = torch.randn(1, 64)
    ref = _int8_rounded(x, 32) @ hf_order.T
    torch.testing.assert_close(GGUFBlockLinear.from_parts([w])(x).double(), ref, rtol=0, atol=1e-5)


def test_every_row_runs_the_one_kernel_whatever_its_phase():
    """Prompt and generated rows, a few or many, through the same kernel (a prompt's bits do
    not depend on how it was chunked or cached, a verification's rows equal one-by-one
    decoding); no dense weight is kept."""
    layer = GGUFBlockLinear.from_parts([_raw(T.Q4_K, 32, 256, 7)])
    assert layer.dense is None and layer.max_quantized_rows is None
    x = torch.randn(6, 256)
    plain = layer(x)
    for mask in (np.array([True, False, True, False, False, True]), np.ones(6, dtype=bool), np.zeros(6, dtype=bool)):
        with forward_context(ForwardContext(6, row_phases=RowPhases.from_mask(mask, torch.device("cpu")))):
            assert torch.equal(layer(x), plain)
    assert torch.equal(layer(x[1:2]), plain[1:2])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_rows_are_ggufs_dequantization_exactly(qtype):
    """The block embedding's rows (any ids, repeated, any shape; a table of two parts, the
    first ending inside a tile) are gguf's dequantized values to the bit (fp32; the model
    dtype is their cast), so a model's embeddings do not change when its table stays blocks."""
    parts = [_raw(qtype, 40, 512, seed=qtype.value + 2), _raw(T.Q8_0, 8, 512, seed=qtype.value + 3)]
    repacked, segments = _repacked(parts)
    ref = torch.cat([_dequantized(w) for w in parts]).float()
    ids = torch.tensor([3, 0, 39, 3, 17, 40, 47], dtype=torch.int32)
    got = cpu_ops.gguf_repacked_get_rows(repacked, segments, ids, 512, torch.float32)
    assert torch.equal(got, ref[ids.long()])
    emb = GGUFEmbedding(repacked, segments, torch.bfloat16)
    assert (emb.num_embeddings, emb.embedding_dim) == (48, 512)
    assert torch.equal(emb(ids.long().view(1, 7)), ref[ids.long()].to(torch.bfloat16).view(1, 7, 512))
    with pytest.raises(RuntimeError, match="id 48 outside the 48 rows"):
        emb(torch.tensor([1, 48]))
    with pytest.raises(RuntimeError, match="integers"):
        cpu_ops.gguf_repacked_get_rows(repacked, segments, torch.zeros(2), 512, torch.float32)


def test_bad_tables_and_parts_are_refused():
    w = _raw(T.Q5_0, 16, 64)
    blocks, segments = pack_blocks([w])
    repacked, table = cpu_ops.gguf_repack(blocks, segments, 64)
    for bad, match in ((torch.tensor([[99, 16, 0]]), "not supported"), (torch.tensor([[6, 16, 4]]), "at byte 4"),
                       (torch.tensor([[6, 48, 0]]), "fit no width"), (table[:, :2], "int64"),
                       (torch.tensor([[6, 8, 0], [6, 8, 100]]), "at byte 100")):
        with pytest.raises(ValueError, match=match):
            GGUFBlockLinear(repacked, bad)
    with pytest.raises(ValueError, match="need one of"):
        pack_blocks([RawWeight(np.zeros((8, 210), np.uint8), "Q2_K", 8, 256, None)])
    with pytest.raises(ValueError, match="all 64 wide"):
        pack_blocks([w, _raw(T.Q5_0, 8, 128)])
    with pytest.raises(RuntimeError, match="in_features 48"):
        cpu_ops.gguf_repacked_linear(torch.zeros(1, 48), repacked, table)
    with pytest.raises(RuntimeError, match="need"):
        cpu_ops.gguf_repacked_linear(torch.zeros(1, 128), repacked, table)
    with pytest.raises(RuntimeError, match="bias of 3"):
        cpu_ops.gguf_repacked_linear(torch.zeros(6, 64), repacked, table, torch.zeros(3))
    with pytest.raises(RuntimeError, match="passes the end"):
        cpu_ops.gguf_repack(blocks, segments, 128)
    with pytest.raises(RuntimeError, match="not supported"):
        cpu_ops.gguf_repack(blocks, torch.tensor([[99, 16, 0]]), 64)


class _Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from tandem.layers.linear import QKVParallelLinear, RowParallelLinear

        self.qkv_proj = QKVParallelLinear(256, 32, 2, 1, bias=True)
        self.o_proj = RowParallelLinear(64, 256, bias=False)
        self.down_proj = RowParallelLinear(256, 256, bias=False)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layers()])
        self.embed_tokens = torch.nn.Embedding(64, 256)
        self.lm_head_quant = None
        for p in self.parameters():  # the linear layers' are left uninitialized (NaN != NaN)
            p.data.normal_()


def _parts() -> dict[str, RawWeight]:
    named = {"qkv_proj.q_proj": (T.Q4_K, 64, 256), "qkv_proj.k_proj": (T.Q4_K, 32, 256),
             "qkv_proj.v_proj": (T.Q6_K, 32, 256), "o_proj": (T.Q4_1, 256, 64), "down_proj": (T.Q5_0, 256, 256)}
    out = {}
    for i, (name, (qtype, rows, cols)) in enumerate(named.items()):
        key = name.split(".")[-1]
        out[f"model.layers.0.{key}.weight"] = _raw(qtype, rows, cols, 10 + i)
    out["model.embed_tokens.weight"] = _raw(T.Q8_0, 64, 256, 20)
    return out


def test_the_swap_takes_blocks_and_restores_them():
    """With the block kernel: every layer of block types takes them (a fused layer of Q4_K and
    Q6_K parts, a Q5_0 one, a Q4_1 one), the tied Q8_0 head too, and the embedding shares its
    tiles (its rows gguf's dequantized values); without it the Q6_K layer stays
    dense, the 4- and 5-bit ones int4, the embedding dense. A model as built gets the same
    layers back from the tensors."""
    model = _Model()
    dense_table = model.embed_tokens.weight.detach().clone()
    counts = quantize_gguf_linears(model, _parts(), block_kernel=True)
    assert counts == {"blocks": 3, "int4": 0, "dequantized": 0}
    layer = model.layers[0]
    assert all(isinstance(m, GGUFBlockLinear) for m in (layer.qkv_proj, layer.o_proj, layer.down_proj))
    assert isinstance(model.lm_head_quant, GGUFBlockLinear) and isinstance(model.embed_tokens, GGUFEmbedding)
    assert model.embed_tokens.repacked.data_ptr() == model.lm_head_quant.repacked.data_ptr()
    ref = torch.from_numpy(gguf.quants.dequantize(_parts()["model.embed_tokens.weight"].data, T.Q8_0).reshape(64, 256))
    assert torch.equal(model.embed_tokens(torch.tensor([5, 63])), ref[[5, 63]].float())
    assert not torch.equal(dense_table[[5, 63]], ref[[5, 63]].float())  # the test's table was random
    assert layer.qkv_proj.bias is not None and layer.qkv_proj.dense is None
    layers, tensors = gguf_quantized_layers(model), model.state_dict()
    assert set(layers) == {"layers.0.qkv_proj", "layers.0.o_proj", "layers.0.down_proj", "lm_head_quant", "embed_tokens"}
    fresh = _Model()
    restore_gguf_linears(fresh, layers, tensors)
    assert [(n, type(m)) for n, m in fresh.named_modules()] == [(n, type(m)) for n, m in model.named_modules()]
    got = fresh.state_dict()
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], v) for k, v in tensors.items() if not k.startswith("embed_tokens"))
    assert fresh.layers[0].qkv_proj.repacked.data_ptr() == tensors["layers.0.qkv_proj.repacked"].data_ptr()
    assert isinstance(fresh.embed_tokens, GGUFEmbedding) and fresh.embed_tokens.dtype == torch.float32

    without = _Model()
    assert quantize_gguf_linears(without, _parts(), block_kernel=False) == {"blocks": 0, "int4": 2, "dequantized": 1}
    assert not isinstance(without.layers[0].qkv_proj, GGUFBlockLinear | GGUFInt4Linear)
    assert without.layers[0].o_proj.max_quantized_rows == MAX_INT4_ROWS
    assert isinstance(without.embed_tokens, torch.nn.Embedding)  # the int4 head reads its table


class _UntiedModel(_Model):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(256, 64, bias=False)


def test_an_untied_model_keeps_neither_dense_table_nor_dense_head():
    """Untied (the Qwen GGUFs' separate ``output``): a Q6_K head as blocks drops the dense
    ``lm_head``, the Q5_0 embedding becomes blocks of its own; restored alike from the
    tensors, which hold neither dense weight."""
    parts = _parts() | {"model.embed_tokens.weight": _raw(T.Q5_0, 64, 256, 21), "lm_head.weight": _raw(T.Q6_K, 64, 256, 22)}
    model = _UntiedModel()
    quantize_gguf_linears(model, parts, block_kernel=True)
    assert not hasattr(model, "lm_head") and isinstance(model.lm_head_quant, GGUFBlockLinear)
    assert isinstance(model.embed_tokens, GGUFEmbedding)
    assert model.embed_tokens.segments[0, 0].item() == T.Q5_0.value
    assert model.lm_head_quant.segments[0, 0].item() == T.Q6_K.value
    layers, tensors = gguf_quantized_layers(model), model.state_dict()
    assert not any(k.startswith("lm_head.") or k == "embed_tokens.weight" for k in tensors)
    fresh = _UntiedModel()
    restore_gguf_linears(fresh, layers, tensors)
    assert not hasattr(fresh, "lm_head") and fresh.state_dict().keys() == tensors.keys()
    x = torch.randn(2, 256)
    assert torch.equal(fresh.lm_head_quant(x), model.lm_head_quant(x))

    int4_head = _UntiedModel()  # without the block kernel a Q4_0 head runs int4 and keeps the dense weight
    quantize_gguf_linears(int4_head, parts | {"lm_head.weight": _raw(T.Q4_0, 64, 256, 23)}, block_kernel=False)
    assert isinstance(int4_head.lm_head_quant, GGUFInt4Linear) and hasattr(int4_head, "lm_head")
    assert isinstance(int4_head.embed_tokens, torch.nn.Embedding)


@pytest.mark.parametrize("untied", [False, True])
def test_deferred_weights_are_the_ones_blocks_replace(untied):
    """Before a load, exactly the weights that become blocks go to the meta device (every
    layer here, the head, the embedding; tied: the embedding as the head's source) and their
    names are returned for the load to skip; the model then quantized equals one quantized
    from loaded dense weights. A part of a type without blocks (F32) keeps its layer dense and
    loaded; without the block kernel nothing is deferred."""
    extra = {"model.embed_tokens.weight": _raw(T.Q5_0, 64, 256, 21), "lm_head.weight": _raw(T.Q6_K, 64, 256, 22)}
    parts = _parts() | (extra if untied else {})
    make = _UntiedModel if untied else _Model
    deferred_model, loaded_model = make(), make()
    names = defer_block_weights(deferred_model, parts, block_kernel=True)
    layer_parts = {n for n in parts if n.startswith("model.layers.")}
    assert names == layer_parts | {"model.embed_tokens.weight"} | ({"lm_head.weight"} if untied else set())
    meta = {n for n, p in deferred_model.named_parameters() if p.is_meta}
    assert meta == {"layers.0.qkv_proj.weight", "layers.0.o_proj.weight", "layers.0.down_proj.weight",
                    "embed_tokens.weight"} | ({"lm_head.weight"} if untied else set())
    loaded_model.load_state_dict({k: v for k, v in deferred_model.state_dict().items() if not v.is_meta}, strict=False)
    quantize_gguf_linears(deferred_model, parts, block_kernel=True)
    quantize_gguf_linears(loaded_model, parts, block_kernel=True)
    got, want = deferred_model.state_dict(), loaded_model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any(p.is_meta for p in deferred_model.parameters())

    f32 = _parts() | {"model.layers.0.down_proj.weight": RawWeight(np.zeros((256, 256), np.float32), "F32", 256, 256,
                                                                 None)}
    model = _Model()
    assert "model.layers.0.down_proj.weight" not in defer_block_weights(model, f32, block_kernel=True)
    assert not model.layers[0].down_proj.weight.is_meta
    model = _Model()
    assert defer_block_weights(model, _parts(), block_kernel=False) == set()
    assert not any(p.is_meta for p in model.parameters())


def test_available_says_whether_the_kernel_has_vnni():
    assert gguf_blocks.available() == bool(torch.ops.tandem_cpu.gguf_vnni())
