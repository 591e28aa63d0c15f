"""Decode-step LoRA on AMX or AVX512-BF16 CPUs: a layer's active adapters as two prepacked dense GEMMs.

At decode sizes (a few dozen rows) the segmented path's gathers, per-adapter bmm and scatter
cost far more in op overhead than in FLOPs. Here the active adapters of a layer are stacked into
one shrink, [in -> slices x adapters x rank], and one block-diagonal expand, both prepacked for
vLLM's packed GEMM kernel (`weight_packed_linear`, the one vLLM itself uses for small GEMMs on
AMX CPUs; it also runs on AVX512-BF16 without AMX: on a Zen 5 it computed M = 1-69, 128, 200 and
512 rows of eight LoRA shapes within 0.4% of fp32). Each
row's shrink output is zeroed outside its own adapter's columns before the expand, so a row gets
exactly its adapter's product and a row without an adapter gets exactly zero. Zeroed by a
bitwise AND of the 16-bit values with 0 or 0xFFFF, not multiplied by a 0/1 mask: a tenant's huge
but finite weights could make a base row's shrink inf, and inf * 0 is NaN. (The AND took 1.6 us at
[32, 384] where `masked_fill_` took 40 us.)

The FLOPs grow with the number of adapters in the step (every row meets every adapter's
columns), so the sampler uses this only for steps of up to DENSE_MAX_ROWS rows; prefill keeps
the segmented path. Weight layouts are vLLM's (see vllm_lora_ops).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# SmolLM2-135M shapes, bf16, 8 adapters, 30 layers of distinct weights after a base GEMM each
# (cold caches, as in the engine), us per LoRA layer call, dense / segmented bmm path, Xeon with
# AMX: 32 rows 149-177 / 227-287, 64 rows 230-254 / 267-337, 128 rows 336-362 / 361-433 (a tie).
# Zen 5 with AVX512-BF16 (no AMX), medians in us per layer of 4 calls beyond its base GEMMs:
# 32 rows 363 / 534, 48 rows 439 / 523, 64 rows 533 / 589, 128 rows 912 / 642.
DENSE_MAX_ROWS = 64
_K_ALIGN, _N_ALIGN = 32, 16  # what the kernel's VNNI packing needs of K and N


@functools.cache  # asked at every LoRA layer call of a decode step
def available(dtype: torch.dtype) -> bool:
    """Whether this CPU and vLLM build have the packed-weight kernel for `dtype`: AMX, or for bf16
    AVX512-BF16 (vLLM itself uses the kernel for base GEMMs on AMX CPUs only)."""
    if dtype == torch.bfloat16:
        ok = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    elif dtype == torch.float16:
        ok = torch.cpu._is_amx_fp16_supported()
    else:
        return False
    if not ok:
        return False
    try:
        from vllm import _custom_ops  # noqa: F401  (registers torch.ops._C)

        return hasattr(torch.ops._C, "weight_packed_linear") and hasattr(torch.ops._C, "convert_weight_packed")
    except ImportError:
        return False


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class DenseLoRA:
    """One layer's adapters (those of the slots it was built for), prepacked. The shrink's columns
    are slice-major: slice s, adapter group g, rank r -> column (s * groups + g) * rank + r; past
    those, zero padding up to a multiple of 32."""

    shrink: torch.Tensor  # packed [k, in]
    expand: torch.Tensor  # packed block-diagonal [out, k]
    k: int
    out: int
    column_group: torch.Tensor  # [k] the adapter group of each column; -2 for padding

    @classmethod
    def build(cls, lora_a_stacked, lora_b_stacked, slots: tuple[int, ...]) -> "DenseLoRA | None":
        """From vLLM's stacked weights (per slice: A [max_loras, 1, rank, in], B [max_loras, 1, out,
        rank]) for the adapters in `slots`; None where the shapes do not suit the kernel."""
        index = torch.tensor(slots, device=lora_a_stacked[0].device)
        rank, in_features = lora_a_stacked[0].shape[2:]
        outs = [b.shape[2] for b in lora_b_stacked]
        used = len(outs) * len(slots) * rank
        k, out = _round_up(used, _K_ALIGN), sum(outs)
        if in_features % _K_ALIGN or out % _N_ALIGN:
            return None
        a = lora_a_stacked[0].new_zeros(k, in_features)
        a[:used] = torch.cat([s[index, 0].reshape(-1, in_features) for s in lora_a_stacked])
        # slice s: [out_s, groups * rank], its outputs against its adapters' columns, on the diagonal
        blocks = [s[index, 0].permute(1, 0, 2).reshape(width, -1) for s, width in zip(lora_b_stacked, outs)]
        b = lora_b_stacked[0].new_zeros(out, k)
        b[:, :used] = torch.block_diag(*blocks)
        column_group = torch.full((k,), -2, dtype=torch.int64)
        column_group[:used] = (torch.arange(used) // rank) % len(slots)
        pack = torch.ops._C.convert_weight_packed
        return cls(pack(a), pack(b), k, out, column_group)

    def keep_bits(self, row_group: torch.Tensor) -> torch.Tensor:
        """[rows, k] int16: all ones where a row keeps its shrink output (its own adapter's columns),
        zero where it must not see it (other adapters' columns, padding). row_group: each row's
        adapter group, -1 for none."""
        keep = self.column_group[None, :] == row_group[:, None]
        return keep.to(torch.int16).neg_()  # True -> -1 (0xFFFF)

    def add_(self, y: torch.Tensor, x: torch.Tensor, keep_bits: torch.Tensor, scale: float = 1.0) -> None:
        """y [rows, <= out] += scale * (x A^T, own adapter's columns only) B^T, in place (the first
        y.shape[1] outputs: a model may pad its vocabulary less than the adapter does)."""
        v = torch.empty(x.shape[0], self.k, dtype=x.dtype, device=x.device)
        torch.ops._C.weight_packed_linear(v, x.contiguous(), self.shrink, None, True)
        v.view(torch.int16).bitwise_and_(keep_bits)  # bf16 and fp16 alike: 16 bits
        if scale != 1.0:
            v.mul_(scale)
        e = torch.empty(x.shape[0], self.out, dtype=x.dtype, device=x.device)
        torch.ops._C.weight_packed_linear(e, v, self.expand, None, True)
        y.add_(e[:, : y.shape[1]])


def reusable(built: tuple[int, ...], active: tuple[int, ...]) -> bool:
    """Whether weights built for the adapters in `built` serve a step whose rows use `active`.
    A superset does (the other adapters' columns are zeroed like any other), so the layers are not
    repacked each time a batch's last request of some adapter finishes. SmolLM2 bf16, 8 adapters x
    4 requests of 8-64 tokens, 4 batches: 242-363 packings taking 0.11-0.23 s per ~5.7 s batch,
    against 726-968 taking 0.41-0.63 s when every change of the active set repacked. Up to twice
    as many adapters as in use, so a lone tenant left does not keep reading eight."""
    return set(active) <= set(built) and len(built) <= 2 * len(active)


def row_groups(token_slots: torch.Tensor, slots: tuple[int, ...]) -> torch.Tensor:
    """Each row's index into `slots` (its adapter group), -1 for rows without an adapter."""
    token_slots = token_slots.to("cpu", torch.int64)
    lookup = torch.full((max(max(slots), int(token_slots.max())) + 2,), -1, dtype=torch.int64)
    lookup[list(slots)] = torch.arange(len(slots))
    return lookup[token_slots.clamp(min=-1)]  # slot -1 reads the lookup's last entry: -1
