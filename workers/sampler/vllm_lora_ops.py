"""vLLM's CPU LoRA ops replaced by the trainer's segmented (SGMV) math.

vLLM calls a "punica wrapper" for every LoRA layer. The stock CPU one gathers a full
[out, rank] weight matrix per token (slow), and maps a token without adapter (slot -1) to the
last slot, so a base-model request batched with LoRA requests silently gets a tenant's adapter.
This wrapper groups the batch's rows by adapter slot once per step (`workers.sgmv.segment_ops`,
shared with the trainer) and computes every adapter's shrink in one batched matmul and every
expand in another, over a layer's merged slices at once (q/k/v, gate/up); rows without an adapter
get exactly the base model's output. On CPUs with AMX or AVX512-BF16, in bf16, decode steps (up to
`dense_lora.DENSE_MAX_ROWS` rows) take two prepacked dense GEMMs per layer instead
(`workers.sampler.dense_lora`).

Weight layouts (vLLM): lora_a_stacked[i] [max_loras, 1, rank, in], lora_b_stacked[i]
[max_loras, 1, out, rank], both zero-padded to max_lora_rank.

What this relies on in vLLM beyond the wrapper's interface (each guarded by a test in
tests/workers/sampler/test_sampler_vllm.py that names it when it breaks, and by `VERIFIED_WITH_VLLM`):
- a layer passes the same stacked weight tensors on every step, and a slot's weights change only
  when `lora_index_to_id` changes (the per-layer weight caches);
- sampling's logits input is a tensor of its own with one row per `sampler_indices` entry, while
  prompt logprobs pass a slice of the step's hidden states (`_logits_groups`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from workers.sampler import dense_lora
from workers.sgmv.segment_ops import (
    PaddedGroups, SlotRows, expand_, group_rows_by_slot, padded_groups, padded_lora_, shrink, take,
)


# The vLLM release the couplings above were checked against; tests fail on any other until rechecked.
VERIFIED_WITH_VLLM = "0.32.0"


class _PerLayer:
    """Values cached per LoRA layer, found by the layer's stacked weight tensor itself: a tensor
    freed and another allocated at its address (or a view of another layer) is never taken for it."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, layer: torch.Tensor) -> Any:
        entry = self._entries.get(id(layer))
        return entry[1] if entry is not None and entry[0]() is layer else None

    def put(self, layer: torch.Tensor, value: Any) -> Any:
        self._entries[id(layer)] = (weakref.ref(layer, lambda _, key=id(layer): self._entries.pop(key, None)), value)
        return value

    def values(self) -> list[Any]:
        return [value for _, value in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)


def _assign(out: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = value
    else:
        out.index_copy_(0, rows, value.to(out.dtype))


# A q/k/v layer's three expands as one bmm over a block-diagonal B, up to this many rows (decode
# steps): 3x the expand's FLOPs, a third of its ops. SmolLM2, 8 adapters x 4 prompts, one engine
# alternating with and without: bf16 202 against 190 tok/s (median of 7 pairs, 5 faster), fp32
# 164 against 162 (no change). Beyond this many rows (prefill) the tripled FLOPs start to count.
BLOCK_DIAGONAL_MAX_ROWS = 256


def _block_diagonal(b_ts: list[torch.Tensor]) -> torch.Tensor:
    """[groups, rank_i, out_i] per slice -> [groups, sum(ranks), sum(outs)], zero off the blocks."""
    groups = b_ts[0].shape[0]
    block = b_ts[0].new_zeros(groups, sum(b.shape[1] for b in b_ts), sum(b.shape[2] for b in b_ts))
    r0 = o0 = 0
    for b in b_ts:
        block[:, r0: r0 + b.shape[1], o0: o0 + b.shape[2]] = b
        r0, o0 = r0 + b.shape[1], o0 + b.shape[2]
    return block


class SegmentedPunicaWrapper(PunicaWrapperCPU):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._token_groups: list[SlotRows] = []
        self._token_padded: PaddedGroups | None = None
        self._sampler_padded: PaddedGroups | None = None
        self._slot_ids: tuple = ()
        # per layer: the active adapters' weights transposed for bmm, rebuilt when slots change
        self._weights = _PerLayer()  # (key, a_t, b_ts, block) per layer
        # decode steps where dense_lora is available: per layer the adapters prepacked, and per
        # step the shrink columns each row must not see
        self._dense = _PerLayer()  # (slot ids, active slots, dense_lora.DenseLoRA | None) per layer
        self._keep_bits: dict[tuple, torch.Tensor] = {}
        self._embedding_cache: tuple[tuple | None, frozenset[int]] = (None, frozenset())

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs) -> None:
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        # once per step, reused by every layer
        self._token_groups = group_rows_by_slot(self.token_lora_indices)
        self._token_padded = padded_groups(self.token_lora_indices)
        self._sampler_padded = padded_groups(self.sampler_indices)
        self._slot_ids = tuple(lora_index_to_id)  # which adapter sits in each slot
        self._keep_bits = {}

    def _grouped_weights(self, lora_a_stacked, lora_b_stacked, slots: tuple[int, ...]):
        """The adapters in `slots`: every slice's A as one [groups, in, sum(ranks)] tensor, each
        slice's B as [groups, rank, out], transposed for bmm, and for layers of three or more
        slices (q/k/v) all B's as one block-diagonal [groups, sum(ranks), sum(outs)]. A slot's
        weights change only when another adapter is put there, so they are cached until the slot
        assignment changes."""
        key = (self._slot_ids, slots)
        cached = self._weights.get(lora_a_stacked[0])
        if cached is not None and cached[0] == key:
            return cached[1:]
        index = torch.tensor(slots, device=lora_a_stacked[0].device)
        a_t = torch.cat([a[index, 0] for a in lora_a_stacked], dim=1).transpose(1, 2).contiguous()
        b_ts = [b[index, 0].transpose(1, 2).contiguous() for b in lora_b_stacked]
        block = _block_diagonal(b_ts) if len(b_ts) >= 3 else None
        self._weights.put(lora_a_stacked[0], (key, a_t, b_ts, block))
        return a_t, b_ts, block

    # --- linear layers -----------------------------------------------------------------------

    def add_shrink(self, y, x, lora_a_stacked, scale: float, **kwargs: Any) -> None:
        x = x.view(-1, x.shape[-1])
        for out, stacked in zip(y, lora_a_stacked):
            out = out.view(-1, out.shape[-1])
            for g in self._token_groups:
                _assign(out, g.rows, shrink(x, stacked[g.slot, 0], g.rows).mul_(scale).to(out.dtype))

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start: int = 0, add_inputs=True,
                   **kwargs: Any) -> None:
        y2 = y.view(-1, y.shape[-1])
        offset = offset_start
        for v_all, stacked, width in zip(x, lora_b_stacked, output_slices):
            columns = y2[:, offset: offset + width]
            for g in self._token_groups:
                if not add_inputs:
                    _assign(columns, g.rows, torch.zeros_like(take(columns, g.rows)))
                b = stacked[g.slot, 0]
                expand_(columns, take(v_all, g.rows).to(b.dtype), b, g.rows)
            offset += width

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale: float, output_slices, *,
                        buffer=None, **kwargs: Any) -> None:
        if self._token_padded is None:
            return
        y2 = y.view(-1, y.shape[-1])
        if sum(output_slices) != y2.shape[1]:
            raise RuntimeError(f"LoRA slices {output_slices} do not cover the layer's {y2.shape[1]} outputs")
        x2 = x.view(-1, x.shape[-1])
        if y2.shape[0] <= dense_lora.DENSE_MAX_ROWS and self._dense_lora_(
                y2, x2, lora_a_stacked, lora_b_stacked, scale, self.token_lora_indices, self._token_padded.slots,
                self._keep_bits):
            return
        a_t, b_ts, block = self._grouped_weights(lora_a_stacked, lora_b_stacked, self._token_padded.slots)
        if block is not None and y2.shape[0] <= BLOCK_DIAGONAL_MAX_ROWS:
            b_ts = [block]  # one expand for all slices: fewer ops where per-op cost dominates
        padded_lora_(y2, x2, self._token_padded, a_t, b_ts, scale)

    def _dense_lora_(self, y2, x2, lora_a_stacked, lora_b_stacked, scale: float, row_slots: torch.Tensor,
                     active: tuple[int, ...], keep_bits_cache: dict | None) -> bool:
        """y2 += the rows' LoRA as two dense GEMMs (dense_lora); False where that path does not apply.
        row_slots: each row's adapter slot; active: the slots they use; keep_bits_cache: where this
        step keeps its masks (None: a one-off call)."""
        dtype = lora_a_stacked[0].dtype
        if not dense_lora.available(dtype) or not x2.dtype == y2.dtype == dtype or row_slots.numel() != y2.shape[0]:
            return False
        cached = self._dense.get(lora_a_stacked[0])
        if cached is None or cached[0] != self._slot_ids or not dense_lora.reusable(cached[1], active):
            built = dense_lora.DenseLoRA.build(lora_a_stacked, lora_b_stacked, active)
            cached = self._dense.put(lora_a_stacked[0], (self._slot_ids, active, built))
        _, slots, weights = cached
        if weights is None:
            return False
        mask_key = (slots, len(lora_b_stacked), weights.k)
        keep_bits = None if keep_bits_cache is None else keep_bits_cache.get(mask_key)
        if keep_bits is None:
            keep_bits = weights.keep_bits(dense_lora.row_groups(row_slots, slots))
            if keep_bits_cache is not None:
                keep_bits_cache[mask_key] = keep_bits
        weights.add_(y2, x2, keep_bits, scale)
        return True

    # --- embeddings and logits ---------------------------------------------------------------

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs: bool = True, **kwargs: Any) -> None:
        y2 = y.view(-1, y.shape[-1])
        with_embedding = self._embedding_slots(lora_b_stacked)
        for g in self._token_groups:
            if not add_inputs:
                _assign(y2, g.rows, torch.zeros_like(take(y2, g.rows)))
            if g.slot not in with_embedding:
                continue  # its B is zero: nothing to add
            b = lora_b_stacked[g.slot, 0]
            expand_(y2, take(x, g.rows).to(b.dtype), b, g.rows)

    def _embedding_slots(self, lora_b_stacked) -> frozenset[int]:
        """The slots whose adapter has an embedding LoRA (a nonzero B). vLLM runs the embedding's
        LoRA for every adapter with zeros where it has none, as Loraplex's never do: that was
        0.5 ms of a 58 ms mixed decode step (SmolLM2, 8 adapters), for nothing. Cached until the
        slot assignment changes, like the other layers' weights."""
        if self._embedding_cache[0] != self._slot_ids:
            nonzero = frozenset(s for s in range(lora_b_stacked.shape[0]) if bool(lora_b_stacked[s].any()))
            self._embedding_cache = (self._slot_ids, nonzero)
        return self._embedding_cache[1]

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs: Any) -> None:
        x2 = x.view(-1, x.shape[-1])
        groups, slots = self._logits_groups(x2)
        if groups is None:
            return
        y2 = y.view(-1, y.shape[-1])
        width = min(lora_b_stacked.shape[2], y2.shape[1])  # the adapter and the model may pad the vocabulary differently
        if x2.shape[0] <= dense_lora.DENSE_MAX_ROWS and self._dense_lora_(
                y2[:, :width], x2, (lora_a_stacked,), (lora_b_stacked,), scale, slots, groups.slots, None):
            return
        a_t, (b_t,), _ = self._grouped_weights((lora_a_stacked,), (lora_b_stacked,), groups.slots)
        padded_lora_(y2[:, :width], x2.to(a_t.dtype), groups, a_t, [b_t[:, :, :width]], scale)

    def _logits_groups(self, x: torch.Tensor) -> tuple[PaddedGroups | None, torch.Tensor]:
        """Which adapter each row of the logits input belongs to: its groups (None when no row has
        an adapter) and each row's slot.

        Sampling passes the gathered hidden states of the sampled positions: a tensor of its own,
        one row per sequence (`sampler_indices`). Prompt logprobs pass one request's rows as a
        slice of the step's hidden states: its row offset in that storage maps it to
        `token_lora_indices`. (vLLM's stock op assumes the former for both and fails on prompt
        logprobs with an lm_head adapter. Views are not tracked under inference mode, hence the
        storage test.)
        """
        if self._sampled_rows(x):
            return self._sampler_padded, self.sampler_indices
        start = x.storage_offset() // x.stride(0)
        slots = self.token_lora_indices[start: start + x.size(0)]
        if slots.numel() != x.size(0):
            raise RuntimeError(f"LoRA logits: {x.size(0)} rows at row {start} lie outside the step's tokens")
        return padded_groups(slots), slots

    def _sampled_rows(self, x: torch.Tensor) -> bool:
        """x is sampling's input (a tensor of its own, one row per sequence), not a slice of the step."""
        owns_storage = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
        return owns_storage and x.size(0) == self.sampler_indices.numel()
