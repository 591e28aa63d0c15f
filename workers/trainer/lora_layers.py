"""Base-model Linear layers that add many adapters' LoRA deltas to packed tokens.

The engine swaps each targeted `nn.Linear` of the frozen base model for a `MultiLoRALinear`.
Before a pass it publishes a `RoutingPlan` (which token rows belong to which adapter) on the
shared `Router`; every wrapped layer reads it and applies its segments. With no plan the layer
is exactly the base layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.sgmv.segmented_lora import Segment, apply_segmented_lora

if TYPE_CHECKING:
    from workers.trainer.adapters import Adapter

# Tinker's LoRA switches -> the module names they cover (same names in Llama, Qwen2 and Qwen3).
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


@dataclass
class RoutingPlan:
    """Token rows [start, end) of the packed batch that go through each adapter."""

    spans: list[tuple["Adapter", int, int]]
    _by_module: dict[str, list[Segment]] = field(default_factory=dict)

    def segments_for(self, module_path: str) -> list[Segment]:
        segments = self._by_module.get(module_path)
        if segments is None:
            segments = []
            for adapter, start, end in self.spans:
                weights = adapter.weights.get(module_path)
                if weights is not None and end > start:
                    segments.append(Segment(start, end, weights.lora_a, weights.lora_b, adapter.scale))
            self._by_module[module_path] = segments
        return segments


class Router:
    """Holds the plan of the pass in flight; one per engine (the engine runs one pass at a time)."""

    def __init__(self, sgmv_backend: str = "auto") -> None:
        self.plan: RoutingPlan | None = None
        self.sgmv_backend = sgmv_backend


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, module_path: str, router: Router) -> None:
        super().__init__()
        self.base = base
        self.module_path = module_path
        self.router = router

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # tied embeddings and HF utilities look for `.weight`
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        plan = self.router.plan
        if plan is None:
            return out
        return apply_segmented_lora(x, out, plan.segments_for(self.module_path), self.router.sgmv_backend)


def target_module_names(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    return (ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ()) + (
        UNEMBED_MODULES if train_unembed else ()
    )


def wrap_linear_layers(model: nn.Module, router: Router) -> dict[str, nn.Linear]:
    """Replace every LoRA-targetable Linear of `model` in place; return {module path: base Linear}."""
    all_targets = set(target_module_names(True, True, True))
    wrapped: dict[str, nn.Linear] = {}
    for path, module in list(model.named_modules()):
        if path.rsplit(".", 1)[-1] in all_targets and isinstance(module, nn.Linear):
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, attr, MultiLoRALinear(module, path, router))
            wrapped[path] = module
    return wrapped
