"""benchmarks/moe_layer.py on the CPU: both variants of the DeepSeek-V2 MoE layer half run
(the fused one's routing kernel in the Triton interpreter) and give the same output; the
parts table times the routing and the alignment alone."""

from __future__ import annotations

import os
import re

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


@pytest.fixture
def moe_layer(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("TANDEM_MOE_ROUTER", raising=False)
    import moe_layer

    return moe_layer


def test_variants_agree_and_table(moe_layer, capsys):
    import tandem.layers.fused_moe_triton as fmt

    before = fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS, fmt.FUSE_SILU_MUL
    moe_layer.main(["--device", "cpu", "--preset", "small", "--tokens", "0", "7", "--iters", "1", "--parts"])
    assert (fmt.ALIGN_ONE_PROGRAM_MAX_PAIRS, fmt.FUSE_SILU_MUL) == before and "TANDEM_MOE_ROUTER" not in os.environ
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "7", "0", "7"]  # the layer, then --parts
    assert float(rows[1].split("|")[-2]) < 1e-5  # fp32: routing and sums agree
    assert all(float(v) > 0 for v in rows[3].split("|")[2:-1])
