"""EAGLE / EAGLE-3 proposer: drafts from a head over the target's hidden states (vLLM's
``"method": "eagle" | "eagle3"``; the heads: :mod:`tandem.models.llama_eagle`).

The head keeps its own paged KV cache with as many blocks as the target's, addressed by the
same block ids, as a draft model's (:mod:`tandem.spec_decode.draft_model`). Its row at
position ``p`` takes the target's hidden state at ``p`` and the token at ``p + 1``; so per
step, once the target has sampled (:meth:`EagleProposer.propose`):

1. *catch-up*: one head forward over each sequence's confirmed step tokens, at their
   positions, each with the target's hidden state of its row and the token after it: the
   step's next input token, or for its last row the token the sequence emitted (a prompt
   chunk that does not end the prompt: the prompt's next token). The head's output at a
   sampling sequence's last row gives its first draft;
2. ``K - 1`` one-token forwards at the following positions, each with the previous draft as
   the token and the head's own previous output as the hidden state (on CUDA, CUDA graphs
   per batch size as a draft model's, the state passed through a persistent buffer:
   :class:`HeadGraphStep`).

Draft rows write the head's K/V at positions the next catch-up overwrites (the scheduler's
``K`` lookahead slots hold them). A prefix-cache hit reuses the head's K/V of the cached
blocks; the last row of such a block was computed with the token that followed it then,
which a new request may not share: that costs acceptance on one position, never correctness
(as in vLLM).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import numpy as np
import torch

from tandem.attention.backend import AttentionBackend
from tandem.distributed.forward_context import ForwardContext, forward_context
from tandem.layers import batch_invariant
from tandem.model_loader.loader import (init_dummy_weights, instantiate_model, iterate_safetensors_weights,
                                        load_hf_config)
from tandem.models.llama_eagle import HEADS, TargetParts, default_aux_hidden_state_layers
from tandem.spec_decode.draft_model import DraftModelProposer, DraftStep
from tandem.worker.ubatching import StepInputs


def load_eagle_head(method: str, path: str, target: torch.nn.Module, backend: AttentionBackend, dtype: torch.dtype,
                    device: torch.device, max_positions: int, load_format: str, seed: int = 0) -> torch.nn.Module:
    """The EAGLE (``method`` "eagle") or EAGLE-3 ("eagle3") head at ``path`` (a folder: config.json
    and ``*.safetensors`` or ``*.bin``), in ``dtype`` on ``device``, sharing ``target``'s
    embedding (and EAGLE-1 its LM head). For EAGLE-3 the target is set to return the inputs of
    the head's layers (``aux_hidden_state_layers``).

    Raises:
        ValueError: one line naming ``speculative_config.model``: files that cannot be read,
            a head that does not fit the target (:func:`check_eagle_head`), weights that do not
            fit the head, or a ``d2t`` mapping outside the target's vocabulary.
    """
    name = f"speculative_config.model {path!r}"
    try:
        hf = load_hf_config(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{name}: cannot read its config.json: {_one_line(e)}") from None
    layers = check_eagle_head(method, hf, target, path)
    parts = TargetParts(target.embed_tokens, target.compute_logits)
    try:
        with batch_invariant.building(backend.deterministic):  # the head runs in its backend's mode
            head = instantiate_model(lambda: HEADS[method](hf, backend, parts, max_positions), dtype, device)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if load_format == "dummy":
        init_dummy_weights(head, seed + 1)
    else:
        _load_head_weights(head, method, hf, path)
    if layers:
        target.aux_hidden_state_layers = layers
    return head.eval()


def _load_head_weights(head: torch.nn.Module, method: str, hf, path: str) -> None:
    """Load the head's checkpoint; every failure (unreadable, corrupt or mismatched files, a
    ``d2t`` outside the vocabulary) is one ValueError naming ``speculative_config.model``."""
    name = f"speculative_config.model {path!r}"
    try:
        head.load_weights(_checkpoint(path))
    except Exception as e:  # a user's files: any reader's error is this one line
        hint = ""
        if isinstance(e, ValueError) and method == "eagle3" and \
                not any("Eagle3" in a for a in getattr(hf, "architectures", None) or []):
            hint = " (its config does not name an EAGLE-3 architecture: an EAGLE-1 head? use method 'eagle')"
        raise ValueError(f"{name}: {_one_line(e)}{hint}") from None
    d2t = getattr(head, "d2t", None)
    if d2t is not None:
        targets = torch.arange(len(d2t), device=d2t.device) + d2t
        if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= head.spec.vocab_size):
            raise ValueError(f"{name}: its d2t maps draft tokens to ids outside the target's vocabulary "
                             f"[0, {head.spec.vocab_size}) ({int(targets.min())}..{int(targets.max())}).")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if not isinstance(e, ValueError) else text


def check_eagle_head(method: str, head_hf, target: torch.nn.Module, path: str) -> tuple[int, ...]:
    """Refuse a head its target cannot feed; returns the target layers whose inputs an
    EAGLE-3 head takes (empty for EAGLE-1).

    Raises:
        ValueError: naming ``speculative_config.model``: an EAGLE-3 head given as "eagle",
            another vocabulary or hidden size than the target's, or an EAGLE-3 head on a
            target that cannot return layer inputs (not a dense Llama / Qwen2 / Qwen3) or
            naming layers it lacks.
    """
    name = f"speculative_config.model {path!r}"
    archs = getattr(head_hf, "architectures", None) or []
    if method == "eagle" and any("Eagle3" in a for a in archs):
        raise ValueError(f"{name}: an EAGLE-3 head (architectures {archs}): use method 'eagle3'.")
    spec = getattr(target, "spec", None)
    if head_hf.vocab_size != target.embed_tokens.num_embeddings:
        raise ValueError(f"{name}: a head over {head_hf.vocab_size} tokens for a target of "
                         f"{target.embed_tokens.num_embeddings}: the head must be trained for this target.")
    hidden = target.embed_tokens.embedding_dim
    head_in = getattr(head_hf, "target_hidden_size", None) or head_hf.hidden_size
    if head_hf.hidden_size != hidden or head_in != hidden:
        raise ValueError(f"{name}: the head's hidden size is {head_hf.hidden_size} and it takes target states of "
                         f"{head_in}, the target's are {hidden}: the head must be trained for this target.")
    if method != "eagle3":
        return ()
    if spec is None or not hasattr(target, "aux_hidden_state_layers"):
        raise ValueError(f"{name}: method 'eagle3' needs a dense Llama / Qwen2 / Qwen3 target, "
                         f"not {type(target).__name__}.")
    layers = getattr(head_hf, "eagle_aux_hidden_state_layer_ids", None) or \
        default_aux_hidden_state_layers(spec.num_layers)
    if len(layers) != 3 or not all(0 < i < spec.num_layers for i in layers):
        raise ValueError(f"{name}: EAGLE-3 takes the inputs of three target layers in 1..{spec.num_layers - 1}, "
                         f"got {list(layers)} (a target of {spec.num_layers} layers).")
    return tuple(int(i) for i in layers)


def _checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A head's tensors: its ``*.safetensors`` files, else its ``*.bin`` files (the public
    EAGLE heads ship ``pytorch_model.bin``; loaded with ``weights_only``, any torch.save
    format)."""
    if glob.glob(os.path.join(path, "*.safetensors")):
        yield from iterate_safetensors_weights(path)
        return
    files = sorted(glob.glob(os.path.join(path, "*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin files in {path!r}")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


class HeadGraphStep(torch.nn.Module):
    """An EAGLE head as the decode CUDA graphs take a model
    (:class:`~tandem.worker.cuda_graph.DecodeCUDAGraphs`): ``forward(ids [n], positions [n],
    kv_caches, meta) -> [n, 2 H]``, the head's (states for logits, states for the next
    position) side by side, fed the states of ``hidden[:n]``, a persistent ``[max_rows, H]``
    buffer in the head's dtype that the caller fills before each replay."""

    def __init__(self, head: torch.nn.Module, max_rows: int) -> None:
        super().__init__()
        self.head = head
        weight = head.fc.weight
        self.hidden = torch.zeros(max_rows, head.spec.hidden_size, dtype=weight.dtype, device=weight.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta) -> torch.Tensor:
        out, nxt = self.head(input_ids, positions, self.hidden[: input_ids.shape[0]], kv_caches, meta)
        return torch.cat([out, nxt], dim=-1)


class EagleProposer(DraftModelProposer):
    """Greedy drafts of an EAGLE / EAGLE-3 head over its own paged KV cache (module
    docstring). Arguments as :class:`DraftModelProposer`'s, ``model`` being the head."""

    uses_target_hidden = True

    @torch.inference_mode()
    def propose(self, d: DraftStep) -> torch.Tensor | None:
        """Write the head's cache for a step's confirmed tokens and, when ``d.propose``,
        draft ``K`` tokens after each emitted one (``d.target_hidden`` and
        ``d.next_token_ids`` required).

        Returns:
            ``[R, K]`` int64 on the device; None without drafts.
        """
        step, keep = d.inputs, d.keep
        qsl = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(keep, out=qsl[1:])
        total = int(qsl[-1])
        offsets = np.arange(total) - np.repeat(qsl[:-1], keep)
        positions = np.repeat(step.num_computed, keep) + offsets
        src = np.repeat(step.query_start_loc[:-1], keep) + offsets  # the rows' step tokens
        last = qsl[1:] - 1
        inner = np.ones(total, dtype=bool)
        inner[last] = False
        ids = torch.empty(total, dtype=torch.long, device=self.device)
        ids[self._h2d(np.flatnonzero(inner))] = d.input_ids[self._h2d(src[inner] + 1)]
        prompt_seqs = np.flatnonzero(d.next_token_ids >= 0)
        ids[self._h2d(last[prompt_seqs])] = self._h2d(d.next_token_ids[prompt_seqs])
        ids[self._h2d(last[d.sampled])] = d.emitted
        hidden = self.model.combine_hidden_states(d.target_hidden[self._h2d(src)])
        row_of_token = np.repeat(np.arange(len(keep)), keep)
        catch_up = StepInputs(np.zeros(total, dtype=np.int64), positions,
                              self._slots(d.block_table_np[row_of_token], positions), qsl, step.num_computed,
                              step.num_computed + keep, d.block_table, [], [])
        out, nxt = self._run(catch_up, ids, hidden)
        if not d.propose or not len(d.sampled):
            return None
        rows = self._h2d(last[d.sampled])
        first = self.model.compute_logits(out[rows]).argmax(dim=-1)
        return self._decode(first, nxt[rows], positions[last[d.sampled]] + 1, d.block_table_np[d.sampled],
                            d.block_table[self._h2d(d.sampled)])

    def capture_cuda_graphs(self, max_num_seqs: int, max_blocks_per_seq: int,
                            catch_up_sizes: list[int] | None = None) -> None:
        """The one-token head graphs only: the head's catch-up (fed the target's states)
        runs eagerly."""
        self._graph_step = HeadGraphStep(self.model, max_num_seqs)
        super().capture_cuda_graphs(max_num_seqs, max_blocks_per_seq)

    def _graph_model(self) -> torch.nn.Module:
        return self._graph_step

    def _replay(self, step: StepInputs, ids: torch.Tensor, hidden: torch.Tensor, size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self._graph_step.hidden[: step.num_reqs].copy_(hidden)
        both = super()._replay(step, ids, None, size)[0]
        return both.chunk(2, dim=-1)

    def _run(self, inputs: StepInputs, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over ``inputs`` (eager, unpadded) fed ``hidden`` (``[num_tokens, H]``): (states
        for logits, states for the next position), each ``[num_tokens, H]``."""
        positions = self._h2d(np.minimum(inputs.positions, self.max_model_len - 1))
        with forward_context(ForwardContext(inputs.num_tokens)):
            return self.model(ids, positions, hidden, self.kv_caches, inputs.metadata(self.device))


__all__ = ["EagleProposer", "HeadGraphStep", "check_eagle_head", "load_eagle_head"]
