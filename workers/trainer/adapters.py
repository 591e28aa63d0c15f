"""Tenant adapters: LoRA weights, their gradients and optimizer state, one object per adapter.

Memory grows with the adapters that exist (each holds only its own tensors), never with
tenants x slots. An adapter keeps its weights, their gradients and its optimizer's state (AdamW's
moments, Dimuon's momentum: docs/optimizers.md) in one flat
tensor each, and every A and B (and its `.grad`) is a view into them: the optimizer and the
gradient norm are then one call per adapter, not one per matrix (~420 of them on SmolLM2). The
LoRA backward adds each weight gradient straight into its `.grad` view (segmented_lora.Segment),
where gradients accumulate across forward_backward calls until an optimizer step (optimizer.py)
applies and clears them.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import torch
from torch import nn

from contract.configs import LoraConfig


class LoraWeights(nn.Module):
    """The A and B matrices of one adapter on one base Linear (or, one per expert, on a fused experts
    parameter: moe_experts.py)."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(lora_a)  # [rank, in_features]; experts: [experts, rank, in_features]
        self.lora_b = nn.Parameter(lora_b)  # [out_features, rank]; experts: [experts, out_features, rank]


def lora_shapes(layer, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of A and B on a base Linear, or on an expert parameter (moe_experts.ExpertProjection)."""
    if hasattr(layer, "lora_shapes"):
        return layer.lora_shapes(rank)
    return (rank, layer.in_features), (layer.out_features, rank)


# each optimizer's state tensors, every one shaped like flat_weights (AdamW's also has a "step" scalar)
OPTIMIZER_STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "dimuon": ("momentum",)}


class Adapter:
    def __init__(self, adapter_id: str, config: LoraConfig, weights: dict[str, LoraWeights],
                 optimizer: str = "adamw") -> None:
        """Takes `weights` over: their values move into the adapter's flat tensor. `optimizer`: the one
        it was created with (a key of OPTIMIZER_STATE), fixed for its life."""
        self.id = adapter_id
        self.config = config
        self.optimizer = optimizer
        self.weights = weights  # module path in the base model -> weights (fixed once created)
        matrices = [(w, attr) for w in weights.values() for attr in ("lora_a", "lora_b")]
        self._shapes = [getattr(w, attr).shape for w, attr in matrices]
        first = getattr(*matrices[0])
        self.flat_weights = torch.empty(sum(s.numel() for s in self._shapes), dtype=first.dtype, device=first.device)
        self.flat_grads = torch.zeros_like(self.flat_weights)
        # where each module's A and B begin in the flat tensors (stacked_adapters.py reads them)
        starts = [0, *itertools.accumulate(s.numel() for s in self._shapes)]
        self.offsets = {path: (starts[2 * i], starts[2 * i + 1]) for i, path in enumerate(weights)}
        for (w, attr), view, grad in zip(matrices, self.views(self.flat_weights), self.views(self.flat_grads)):
            view.copy_(getattr(w, attr).detach())
            setattr(w, attr, nn.Parameter(view))
            getattr(w, attr).grad = grad
        # every A and B, gathered once: the nn.Module attribute lookups of a generator cost ~0.3 ms
        # per step of 8 tiny adapters
        self._parameters = tuple(getattr(w, attr) for w, attr in matrices)
        self.scale = config.alpha / config.rank
        self.step = 0  # optimizer steps applied
        self.gradients_pending = False  # a backward ran since the last step (or zero_grad)
        # the optimizer's state, empty before the first step. AdamW's as torch's fused AdamW takes it:
        # "step" (a float32 scalar), "exp_avg" and "exp_avg_sq"; Dimuon's: "momentum"
        self.optimizer_state: dict[str, torch.Tensor] = {}

    def layout(self) -> tuple:
        """What two adapters' flat tensors must share to be stacked: matrix shapes, in order."""
        return (tuple(self.weights), tuple(self._shapes), self.flat_weights.dtype, self.flat_weights.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` (shaped like flat_weights) as one view per matrix, in `named_parameters` order."""
        return [chunk.view(shape) for chunk, shape in zip(flat.split([s.numel() for s in self._shapes]), self._shapes)]

    def named_views(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """`views(flat)` with the names of `named_parameters`."""
        return zip((name for name, _ in self.named_parameters()), self.views(flat))

    @classmethod
    def create(cls, adapter_id: str, config: LoraConfig, base_layers: dict[str, nn.Linear], dtype: torch.dtype,
               optimizer: str = "adamw"):
        """New adapter, initialised like peft: A ~ kaiming-uniform (seeded), B = 0, so it starts as a no-op."""
        gen = torch.Generator().manual_seed(config.seed)
        targets = set(config.target_modules())
        weights = {}
        for path, layer in base_layers.items():
            if path.rsplit(".", 1)[-1] not in targets:
                continue
            a_shape, b_shape = lora_shapes(layer, config.rank)
            # drawn as peft draws it: one [rows, in] matrix (an expert parameter's A's stacked, as peft's
            # ParamWrapper holds them), so kaiming's fan-in is `in` for every expert's A too
            lora_a = torch.empty(math.prod(a_shape[:-1]), a_shape[-1], dtype=dtype)
            nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5), generator=gen)
            lora_b = torch.zeros(b_shape, dtype=dtype)
            device = layer.weight.device
            weights[path] = LoraWeights(lora_a.view(a_shape).to(device), lora_b.to(device))
        return cls(adapter_id, config, weights, optimizer)

    def parameters(self) -> tuple[nn.Parameter, ...]:
        return self._parameters

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for path, w in self.weights.items():
            yield f"{path}.lora_A", w.lora_a
            yield f"{path}.lora_B", w.lora_b

    @property
    def resident_bytes(self) -> int:
        """The memory this adapter's state holds: weights, gradients and (once stepped) the optimizer's state."""
        tensors = [self.flat_weights, self.flat_grads, *self.optimizer_state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def stepped_bytes(self) -> int:
        """What `resident_bytes` becomes once it has stepped: weights, gradients and each weights-sized tensor
        of its optimizer's state (AdamW's scalar step counter aside)."""
        return (2 + len(OPTIMIZER_STATE[self.optimizer])) * self.flat_weights.numel() * self.flat_weights.element_size()

    def has_gradients(self) -> bool:
        return self.gradients_pending

    def zero_grad(self) -> None:
        Adapter.zero_grads([self])

    @staticmethod
    def zero_grads(adapters: list[Adapter]) -> None:
        """Clear these adapters' gradients (one call for all of them)."""
        torch._foreach_zero_([adapter.flat_grads for adapter in adapters])
        for adapter in adapters:
            adapter.gradients_pending = False
