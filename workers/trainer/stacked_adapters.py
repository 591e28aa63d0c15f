"""A pass's adapters side by side: their flat weights stacked once, for every layer's bmm.

On CPU, a pass of several adapters runs each LoRA layer as batched matmuls over the adapters
(workers/sgmv/padded_segments.py). Stacking each layer's A's and B's on every call cost more than
the matmuls when segments are small (8 `tiny` adapters x 32 tokens). Instead the adapters' flat
weights (adapters.py) are stacked once per pass, [adapters, P], so that every layer's stacked A
and B are views. The backward adds each layer's dA and dB into each adapter's own gradient (its
`.grad` views), piece by piece (workers/sgmv/grad_pieces.py): the additions the segment loop
makes, in the same order.

Used for a CPU pass of two or more adapters of one layout (same rank, at least 2, and targets,
so the same flat layout) whose segments lay out on a bmm grid. Only layers up to the first one
wider than the bmm path takes (an unembedding, which comes last) are stacked: those keep the
segment loop. A mixture of experts' expert weights (after every Linear's) are not stacked either.
"""

from __future__ import annotations

import torch

from workers.sgmv.grad_pieces import GradPieces, Pieces, grad_pieces
from workers.sgmv.padded_segments import SegmentGrid, paying_grid
from workers.sgmv.segmented_lora import BMM_MAX_OUT_FEATURES
from workers.sgmv.stacked_lora import StackedLayer
from workers.trainer.adapters import Adapter


class StackedAdapters:
    def __init__(self, adapters: list[Adapter], grid: SegmentGrid, with_gradients: bool, pieces: GradPieces) -> None:
        """`grid`: the adapters' row segments, in order (adapter i owns segment i); `pieces`: the
        pieces of their weight gradients, segment i's those of adapter i."""
        first = adapters[0]
        self.adapters = adapters
        self.grid = grid
        self.pieces = pieces
        self.with_gradients = with_gradients
        self.scale = torch.tensor([a.scale for a in adapters], dtype=first.flat_weights.dtype).view(-1, 1, 1)
        # the stacked modules: those before the first vocabulary-wide one, in layout order
        self.paths: list[str] = []
        for path, weights in first.weights.items():
            # (a mixture of experts' per-expert weights come last and are read by moe_experts.py, never stacked)
            if weights.lora_b.shape[0] > BMM_MAX_OUT_FEATURES or weights.lora_a.dim() != 2:
                break
            self.paths.append(path)
        end = self._region(self.paths[-1])[1] if self.paths else 0
        self.weights = torch.stack([a.flat_weights[:end] for a in adapters]).requires_grad_(with_gradients)
        self._layers = {path: self._layer(path) for path in self.paths}

    @classmethod
    def for_pass(cls, spans: list[tuple[Adapter, int, int]], n_rows: int, with_gradients: bool,
                 device: torch.device, pieces: tuple[Pieces, ...] | None = None,
                 min_width: int = 1) -> StackedAdapters | None:
        """The stacked adapters of a pass, or None where the pass does not take this path.
        `pieces`: each span's requests' rows, the pieces of its weight gradients (default: one each);
        `min_width`: the grid's least width (row_gemm.min_rows())."""
        adapters = [adapter for adapter, _, _ in spans]
        if device.type != "cpu" or len(spans) < 2 or len({id(a) for a in adapters}) < len(adapters):
            return None
        if any(end <= start for _, start, end in spans) or len({a.layout() for a in adapters}) > 1:
            return None
        if adapters[0].config.rank < 2:  # a rank-1 product is computed 2 wide (row_gemm.py): not views
            return None
        bounds = tuple((start, end) for _, start, end in spans)
        grid = paying_grid(bounds, n_rows, min_width)
        if grid is None:
            return None
        pieces = tuple(pieces) if pieces is not None else tuple(((start, end),) for start, end in bounds)
        return cls(adapters, grid, with_gradients, grad_pieces(pieces))

    def layers(self, paths: list[str]) -> list[StackedLayer] | None:
        """The stacked matrices of these modules, or None unless every one of them is stacked."""
        layers = [self._layers.get(path) for path in paths]
        return None if any(layer is None for layer in layers) else layers

    def _region(self, path: str) -> tuple[int, int]:
        """[start, end) of the module's A and B (adjacent) in the flat layout."""
        a_start, b_start = self.adapters[0].offsets[path]
        return a_start, b_start + self.adapters[0].weights[path].lora_b.numel()

    def _layer(self, path: str) -> StackedLayer:
        weights = self.adapters[0].weights[path]
        a_start, b_start = self.adapters[0].offsets[path]

        def view(start: int, shape: torch.Size) -> torch.Tensor:
            return self.weights[:, start: start + shape.numel()].view(-1, *shape)

        grads_a = tuple(a.weights[path].lora_a.grad for a in self.adapters) if self.with_gradients else None
        grads_b = tuple(a.weights[path].lora_b.grad for a in self.adapters) if self.with_gradients else None
        return StackedLayer(view(a_start, weights.lora_a.shape), view(b_start, weights.lora_b.shape), grads_a, grads_b)
