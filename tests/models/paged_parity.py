"""Shared check: a Tandem model over the paged KV cache gives transformers' logits for a
ragged prefill, decode steps, and a chunked step on top of a cached prefix."""

from __future__ import annotations

import torch

from tandem.attention.metadata import AttentionMetadata


def random_hf_reference(cfg):
    """transformers' model of ``cfg`` in fp32, eager attention, every weight drawn from
    N(0, 0.1) after ``torch.manual_seed(0)``: the reference the parity tests load into Tandem."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg._attn_implementation = "eager"
    ref = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    return ref


def step_metadata(q_lens, computed, block_tables, block_size, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata of one step (decode requests first), as the model runner builds it."""
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    seq_lens = [c + q for c, q in zip(computed, q_lens)]
    slots = [bt[p // block_size] * block_size + p % block_size
             for q, c, bt in zip(q_lens, computed, block_tables) for p in range(c, c + q)]
    width = max(len(b) for b in block_tables)
    bt = [b + [0] * (width - len(b)) for b in block_tables]
    num_decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    t = lambda v, dt=torch.int32: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    return AttentionMetadata(t(qsl), t(seq_lens), t(computed), t(bt), t(slots, torch.long), max(q_lens),
                             max(seq_lens), qsl, seq_lens, num_decode)


def assert_paged_parity(model, ref, vocab_size: int, kv: list[torch.Tensor], block_size: int, decode_steps: int) -> None:
    """Three ragged prompts on shuffled physical blocks; logits within 1e-4 (fp32)."""
    nblocks = kv[0].shape[1]
    prompts = [torch.randint(0, vocab_size, (n,)).tolist() for n in (13, 8, 21)]
    perm = (torch.randperm(nblocks - 1) + 1).tolist()  # the paged layout must not matter
    tables = [perm[0:6], perm[6:12], perm[12:18]]
    seqs = [list(p) for p in prompts]
    close = lambda a, b: torch.testing.assert_close(a, b, atol=1e-4, rtol=0)  # noqa: E731
    with torch.no_grad():
        meta = step_metadata([len(p) for p in prompts], [0, 0, 0], tables, block_size)
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        logits = model.compute_logits(model(ids, pos, kv, meta))
        off = 0
        for p in prompts:
            close(logits[off : off + len(p)], ref(torch.tensor([p])).logits[0])
            off += len(p)
        # Decode steps: each sequence's greedy token appended, one token per sequence.
        last = [logits[sum(len(p) for p in prompts[: i + 1]) - 1].argmax().item() for i in range(3)]
        for _ in range(decode_steps):
            for s, t in zip(seqs, last):
                s.append(t)
            computed = [len(s) - 1 for s in seqs]
            meta = step_metadata([1, 1, 1], computed, tables, block_size)
            step_logits = model.compute_logits(model(torch.tensor(last), torch.tensor(computed), kv, meta))
            for i, s in enumerate(seqs):
                close(step_logits[i], ref(torch.tensor([s])).logits[0, -1])
            last = step_logits.argmax(-1).tolist()
        # A chunked step: two decodes + a 5-token chunk on top of a cached prefix.
        extra = torch.randint(0, vocab_size, (5,)).tolist()
        c0 = len(seqs[0])
        seqs[0] += extra
        for s, t in zip(seqs[1:], last[1:]):
            s.append(t)
        computed = [len(seqs[1]) - 1, len(seqs[2]) - 1, c0]
        meta = step_metadata([1, 1, 5], computed, [tables[1], tables[2], tables[0]], block_size)
        ids = torch.tensor([last[1], last[2]] + extra)
        pos = torch.tensor([computed[0], computed[1]] + list(range(c0, c0 + 5)))
        out = model.compute_logits(model(ids, pos, kv, meta))
        close(out[0], ref(torch.tensor([seqs[1]])).logits[0, -1])
        close(out[1], ref(torch.tensor([seqs[2]])).logits[0, -1])
        close(out[2:], ref(torch.tensor([seqs[0]])).logits[0, -5:])
