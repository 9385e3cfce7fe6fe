"""benchmarks/gguf_block_rows.py: a short real run prints one table row per (layer, type, row
count), the int4 kernel's column only for a one-plane type, and skips a type whose block does
not divide the layer's width."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.layers import cpu_ops

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                      "gguf_block_rows.py")


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built")
def test_short_run_prints_the_table():
    out = subprocess.run([sys.executable, SCRIPT, "--model", "smollm2", "--types", "Q5_0", "Q4_K", "Q4_1", "--rows", "2", "8",
                          "--iters", "1", "--threads", "1"], capture_output=True, text=True, timeout=300, check=True)
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and "[" in line]
    # SmolLM2's widths (576, 1536) are whole Q5_0 blocks, but 576 is not whole Q4_K super-blocks
    assert {r[1].strip() for r in rows} == {"Q5_0", "Q4_K", "Q4_1"}
    assert len([r for r in rows if r[1].strip() == "Q5_0"]) == 4 * 2
    assert all(r[0].strip().startswith("down_proj") for r in rows if r[1].strip() == "Q4_K")
    for r in rows:
        assert (r[5].strip() == "-") == (r[1].strip() != "Q4_1")
        assert float(r[3]) > 0 and float(r[4]) > 0
