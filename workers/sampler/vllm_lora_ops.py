"""vLLM's CPU LoRA ops replaced by the trainer's segmented (SGMV) math.

vLLM calls a "punica wrapper" for every LoRA layer. The stock CPU one gathers a full
[out, rank] weight matrix per token (slow), and maps a token without adapter (slot -1) to the
last slot, so a base-model request batched with LoRA requests silently gets a tenant's adapter.
This wrapper groups the batch's rows by adapter slot once per step and runs one shrink and one
expand matmul per adapter group (`workers.sgmv.segment_ops`, shared with the trainer); rows
without an adapter are in no group and get exactly the base model's output.

Weight layouts (vLLM): lora_a_stacked[i] [max_loras, 1, rank, in], lora_b_stacked[i]
[max_loras, 1, out, rank], both zero-padded to max_lora_rank.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from workers.sgmv.segment_ops import SlotRows, expand_, group_rows_by_slot, shrink, take


def _assign(out: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = value
    else:
        out.index_copy_(0, rows, value.to(out.dtype))


class SegmentedPunicaWrapper(PunicaWrapperCPU):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._token_groups: list[SlotRows] = []
        self._sampler_groups: list[SlotRows] = []

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs) -> None:
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        # once per step, reused by every layer
        self._token_groups = group_rows_by_slot(self.token_lora_indices)
        self._sampler_groups = group_rows_by_slot(self.sampler_indices)

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
        """Shrink and expand fused per adapter group: no [tokens, rank] buffer over the whole batch."""
        x2 = x.view(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        for g in self._token_groups:
            offset = 0
            for a_stacked, b_stacked, width in zip(lora_a_stacked, lora_b_stacked, output_slices):
                b = b_stacked[g.slot, 0]
                v = shrink(x2, a_stacked[g.slot, 0], g.rows).to(b.dtype)
                expand_(y2[:, offset: offset + width], v, b, g.rows, scale)
                offset += width

    # --- embeddings and logits ---------------------------------------------------------------

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs: bool = True, **kwargs: Any) -> None:
        y2 = y.view(-1, y.shape[-1])
        for g in self._token_groups:
            if not add_inputs:
                _assign(y2, g.rows, torch.zeros_like(take(y2, g.rows)))
            b = lora_b_stacked[g.slot, 0]
            expand_(y2, take(x, g.rows).to(b.dtype), b, g.rows)

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs: Any) -> None:
        y2 = y.view(-1, y.shape[-1])
        x2 = x.view(-1, x.shape[-1])
        for g in self._logits_groups(x2):
            b = lora_b_stacked[g.slot, 0]
            v = shrink(x2, lora_a_stacked[g.slot, 0], g.rows).to(b.dtype)
            expand_(y2, v, b, g.rows, scale)

    def _logits_groups(self, x: torch.Tensor) -> list[SlotRows]:
        """Which adapter each row of the logits input belongs to.

        Sampling passes the gathered hidden states of the sampled positions: a tensor of its own,
        one row per sequence (`sampler_indices`). Prompt logprobs pass one request's rows as a
        slice of the step's hidden states: its row offset in that storage maps it to
        `token_lora_indices`. (vLLM's stock op assumes the former for both and fails on prompt
        logprobs with an lm_head adapter. Views are not tracked under inference mode, hence the
        storage test.)
        """
        owns_storage = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
        if owns_storage and x.size(0) == self.sampler_indices.numel():
            return self._sampler_groups
        start = x.storage_offset() // x.stride(0)
        slots = self.token_lora_indices[start: start + x.size(0)]
        if slots.numel() != x.size(0):
            raise RuntimeError(f"LoRA logits: {x.size(0)} rows at row {start} lie outside the step's tokens")
        return group_rows_by_slot(slots)
