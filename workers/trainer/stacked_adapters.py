"""A pass's adapters side by side: their flat weights stacked once, their gradients in one buffer.

On CPU, a pass of several adapters runs each LoRA layer as batched matmuls over the adapters
(workers/sgmv/padded_segments.py). Stacking each layer's A's and B's on every call and handing
each adapter's dA and dB back one by one cost more than the matmuls when segments are small
(8 `tiny` adapters x 32 tokens: 48 weight gradients per q/k/v group to slice and add). Instead the
adapters' flat weights (adapters.py) are stacked once per pass, [adapters, P], so that every
layer's stacked A and B are views; the backward writes every layer's stacked dA and dB into
views of one buffer of that shape, and after the backward one call adds each adapter's row into
its own flat gradient.

Used for a CPU pass of two or more adapters of one layout (same rank and targets, so the same
flat layout) whose segments lay out on a bmm grid. Only layers up to the first one wider than
the bmm path takes (an unembedding, which comes last) are stacked: those keep the segment loop,
which adds into the adapters' gradients itself.
"""

from __future__ import annotations

import torch

from workers.sgmv.padded_segments import SegmentGrid, paying_grid
from workers.sgmv.segmented_lora import BMM_MAX_OUT_FEATURES
from workers.sgmv.stacked_lora import StackedLayer
from workers.trainer.adapters import Adapter


class StackedAdapters:
    def __init__(self, adapters: list[Adapter], grid: SegmentGrid, with_gradients: bool) -> None:
        """`grid`: the adapters' row segments, in order (adapter i owns segment i)."""
        first = adapters[0]
        self.adapters = adapters
        self.grid = grid
        self.scale = torch.tensor([a.scale for a in adapters], dtype=first.flat_weights.dtype).view(-1, 1, 1)
        # the stacked modules: those before the first vocabulary-wide one, in layout order
        self.paths: list[str] = []
        for path, weights in first.weights.items():
            if weights.lora_b.shape[0] > BMM_MAX_OUT_FEATURES:
                break
            self.paths.append(path)
        end = self._region(self.paths[-1])[1] if self.paths else 0
        self.weights = torch.stack([a.flat_weights[:end] for a in adapters]).requires_grad_(with_gradients)
        self.grads = torch.empty_like(self.weights, requires_grad=False) if with_gradients else None
        self._layers = {path: self._layer(path) for path in self.paths}
        self._written: set[str] = set()

    @classmethod
    def for_pass(cls, spans: list[tuple[Adapter, int, int]], n_rows: int, with_gradients: bool,
                 device: torch.device) -> StackedAdapters | None:
        """The stacked adapters of a pass, or None where the pass does not take this path."""
        adapters = [adapter for adapter, _, _ in spans]
        if device.type != "cpu" or len(spans) < 2 or len({id(a) for a in adapters}) < len(adapters):
            return None
        if any(end <= start for _, start, end in spans) or len({a.layout() for a in adapters}) > 1:
            return None
        grid = paying_grid(tuple((start, end) for _, start, end in spans), n_rows)
        return None if grid is None else cls(adapters, grid, with_gradients)

    def layers(self, paths: list[str]) -> list[StackedLayer] | None:
        """The stacked matrices of these modules, or None unless every one of them is stacked."""
        layers = [self._layers.get(path) for path in paths]
        return None if any(layer is None for layer in layers) else layers

    def backward_done(self, paths: list[str]) -> None:
        """The backward of these modules wrote their gradients (it writes, not adds: once per pass)."""
        if self._written.intersection(paths):
            raise RuntimeError(f"modules {sorted(self._written.intersection(paths))} ran twice in one stacked "
                               "pass; their first gradients were overwritten")
        self._written.update(paths)

    def add_gradients(self) -> None:
        """After the backward: add each adapter's stacked gradients into its flat gradient."""
        if self.grads is None or not self._written:
            return
        if len(self._written) == len(self.paths):  # every stacked module was written: one call
            end = self.grads.shape[1]
            torch._foreach_add_([a.flat_grads[:end] for a in self.adapters], list(self.grads.unbind()))
        else:  # a module without a backward left its region unwritten: add the others one by one
            for path in self._written:
                start, end = self._region(path)
                torch._foreach_add_([a.flat_grads[start:end] for a in self.adapters],
                                    list(self.grads[:, start:end].unbind()))
        self._written.clear()

    def _region(self, path: str) -> tuple[int, int]:
        """[start, end) of the module's A and B (adjacent) in the flat layout."""
        a_start, b_start = self.adapters[0].offsets[path]
        return a_start, b_start + self.adapters[0].weights[path].lora_b.numel()

    def _layer(self, path: str) -> StackedLayer:
        weights = self.adapters[0].weights[path]
        a_start, b_start = self.adapters[0].offsets[path]

        def view(flat: torch.Tensor | None, start: int, shape: torch.Size) -> torch.Tensor | None:
            return None if flat is None else flat[:, start: start + shape.numel()].view(-1, *shape)

        a_shape, b_shape = weights.lora_a.shape, weights.lora_b.shape
        return StackedLayer(view(self.weights, a_start, a_shape), view(self.weights, b_start, b_shape),
                            view(self.grads, a_start, a_shape), view(self.grads, b_start, b_shape))
