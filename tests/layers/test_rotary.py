"""RoPE's CPU paths (tandem.layers.rotary): the full-width tables gathered once per forward
(fused-ops mode ``torch``) and the C++ kernel (mode ``cpu``) give the same bits as the
reference rotation (tandem.layers.fused_ops.apply_rotary_ref)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tandem.layers import fused_ops
from tandem.layers.rotary import RotaryEmbedding


MODES = ["torch", "cpu"]


def _rotary(head_dim: int = 64, max_pos: int = 512, mode: str = "torch") -> RotaryEmbedding:
    """A RoPE layer built in fused-ops ``mode`` (a CPU path under test)."""
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_pos,
                      rope_theta=100000.0)
    with fused_ops.building(mode):
        return RotaryEmbedding(cfg, head_dim, max_pos)


def _qk(t: int, dtype: torch.dtype, hq: int = 9, hk: int = 3, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)  # strided views, as the model's
    return qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 300])
@pytest.mark.parametrize("begin_step", [True, False], ids=["tables-of-the-step", "tables-per-call"])
@pytest.mark.parametrize("mode", MODES)
def test_cpu_rotation_equals_the_reference_bit_for_bit(t, dtype, begin_step, mode):
    rot = _rotary(mode=mode)
    q, k = _qk(t, dtype)
    pos = torch.randint(0, 512, (t,), generator=torch.Generator().manual_seed(t))
    if begin_step:
        rot.begin_step(pos)
    got_q, got_k = rot(pos, q, k)
    want_q, want_k = fused_ops.apply_rotary_ref(q, k, rot.cos, rot.sin, pos)
    assert got_q.dtype == dtype and torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 5, 300])
@pytest.mark.parametrize("mode", MODES)
def test_q_and_k_rotated_as_one_tensor_equal_the_reference_bit_for_bit(t, dtype, mode):
    rot = _rotary(mode=mode)
    hq, hk, d = 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(1)).to(dtype)
    qk = qkv[:, : (hq + hk) * d].view(t, hq + hk, d)  # a strided view, as the model's
    pos = torch.randint(0, 512, (t,), generator=torch.Generator().manual_seed(t))
    rot.begin_step(pos)
    got_q, got_k = rot.forward_qk(pos, qk, hq)
    want_q, want_k = fused_ops.apply_rotary_ref(qk[:, :hq], qk[:, hq:], rot.cos, rot.sin, pos)
    assert got_q.shape == (t, hq, d) and got_k.shape == (t, hk, d)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("mode", MODES)
def test_tables_of_a_step_serve_only_its_positions(mode):
    """Another positions tensor (even one of the same shape) is rotated at its own positions."""
    rot = _rotary(mode=mode)
    q, k = _qk(4, torch.float32)
    rot.begin_step(torch.tensor([0, 1, 2, 3]))
    other = torch.tensor([7, 100, 3, 511])
    got_q, got_k = rot(other, q, k)
    want_q, want_k = fused_ops.apply_rotary_ref(q, k, rot.cos, rot.sin, other)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_a_module_cast_off_fp32_tables_keeps_the_torch_ops():
    """The kernel reads fp32 tables; a layer whose tables were cast rotates with them as the
    torch code does, not with the kernel (which would refuse them)."""
    rot = _rotary(mode="cpu").to(torch.bfloat16)
    q, k = _qk(3, torch.bfloat16)
    pos = torch.tensor([1, 2, 3])
    got_q, _ = rot(pos, q, k)
    want_q, _ = _rotary(mode="torch").to(torch.bfloat16)(pos, q, k)
    assert torch.equal(got_q, want_q)
