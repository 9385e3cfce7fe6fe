"""EAGLE / EAGLE-3 on a CUDA device (skipped without one): with CUDA graphs capturing the
target (an EAGLE-3 target's graph returns its layer inputs too) and the head's one-token
forwards (its states through a persistent buffer), fp32 drafts equal the
plain-torch reading of the papers, and greedy output equals no speculation in fp32 and
bf16, batched and alone."""

from __future__ import annotations

import pytest
import torch

from tandem.entrypoints.llm import LLM
# The fixtures too (heads, target): pytest finds them in this module's namespace.
from tests.spec_decode.test_async_spec_cuda import _count_replays
from tests.spec_decode.test_eagle import (K, TOKEN_PROMPTS, _ids, _record_drafts, _reference_drafts, heads,  # noqa: F401
                                          target)  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_under_cuda_graphs(method, dtype, target, heads, embedded_model_path):  # noqa: F811
    common = dict(tokenizer=embedded_model_path, block_size=16, max_model_len=128, dtype=dtype, enforce_eager=False,
                  num_kv_blocks=256)
    llm = LLM(target[0], **common)
    reference = _ids(llm, TOKEN_PROMPTS)
    llm.engine.shutdown()
    llm = LLM(target[0], speculative_config={"method": method, "model": heads[method][0], "num_speculative_tokens": K,
                                             "disable_by_batch_size": None}, **common)
    drafter = llm.engine.core.runner.drafter
    assert llm.engine.core.runner.cuda_graphs is not None and drafter.cuda_graphs is not None
    replays = _count_replays(drafter)
    records = _record_drafts(llm)
    assert _ids(llm, TOKEN_PROMPTS) == reference
    solo = [_ids(llm, [p])[0] for p in TOKEN_PROMPTS]
    assert solo == reference
    assert {1, 4} <= set(replays), replays  # alone and batched, through the graphs
    if dtype == "float32":  # bf16 drafts round otherwise than the fp32 reference
        full = {tuple(p): p + o for p, o in zip(TOKEN_PROMPTS, solo)}
        checked = [(full[p], pos, d) for p, pos, d in records if pos < len(full[p])]
        assert checked and all(d == _reference_drafts(target[1], heads[method][1], method == "eagle3", t[:pos + 1])
                               for t, pos, d in checked)
    llm.engine.shutdown()
