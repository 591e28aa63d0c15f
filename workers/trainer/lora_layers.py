"""Base-model Linear layers that add many adapters' LoRA deltas to packed tokens.

The engine swaps each targeted `nn.Linear` of the frozen base model for a `MultiLoRALinear`.
Before a pass it publishes a `RoutingPlan` (which token rows belong to which adapter) on the
shared `Router`; every wrapped layer reads it and applies its segments. With no plan the layer
is exactly the base layer.

Layers that read the same input (q/k/v of an attention block, gate/up of an MLP) form a
`LayerGroup`: on CPU the first of them to be called computes all of their outputs in one
autograd node (`apply_lora_group`) and the others pick theirs up, if they are called with that
same input tensor; otherwise each layer computes its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from contract.configs import target_module_names
from workers.sgmv.grad_pieces import Pieces
from workers.sgmv.segmented_lora import Segment, apply_lora_group, apply_segmented_lora
from workers.sgmv.stacked_lora import apply_stacked_lora_group

if TYPE_CHECKING:
    from workers.trainer.adapters import Adapter
    from workers.trainer.stacked_adapters import StackedAdapters

# (Which modules LoRA targets: contract/configs.py, beside the LoraConfig switches that pick them.)
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class RoutingPlan:
    """Token rows [start, end) of the packed batch that go through each adapter."""

    spans: list[tuple["Adapter", int, int]]
    # the spans' adapters stacked for the bmm path (stacked_adapters.py), where the pass takes it
    stacked: "StackedAdapters | None" = None
    # each span's pieces: the rows of each of its requests, in order; its weight gradients add them
    # one by one (workers/sgmv/grad_pieces.py). None: each span is one piece
    pieces: "list[Pieces] | None" = None
    _by_module: dict[str, list[Segment]] = field(default_factory=dict)

    def segments_for(self, module_path: str) -> list[Segment]:
        segments = self._by_module.get(module_path)
        if segments is None:
            segments = []
            for i, (adapter, start, end) in enumerate(self.spans):
                weights = adapter.weights.get(module_path)
                if weights is not None and end > start:
                    # the weight gradients go straight into the adapter's .grad (views of its flat tensor)
                    segments.append(Segment(start, end, weights.lora_a, weights.lora_b, adapter.scale,
                                            weights.lora_a.grad, weights.lora_b.grad,
                                            self.pieces[i] if self.pieces is not None else ()))
            self._by_module[module_path] = segments
        return segments


class Router:
    """Holds the plan of the pass in flight; one per engine (the engine runs one pass at a time)."""

    def __init__(self, sgmv_backend: str = "auto") -> None:
        self._plan: RoutingPlan | None = None
        self.sgmv_backend = sgmv_backend
        # outputs a group computed for members not called yet: group -> (input, its version, {member: output})
        self._pending: dict[LayerGroup, tuple[torch.Tensor, int, dict[int, torch.Tensor]]] = {}

    @property
    def plan(self) -> RoutingPlan | None:
        return self._plan

    @plan.setter
    def plan(self, plan: RoutingPlan | None) -> None:
        self._plan = plan
        self._pending.clear()

    def group_output(self, group: "LayerGroup", member: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `member` of `group` applied to x: computed with the whole group, unless the group
        already did so for this very input (same tensor, unchanged since)."""
        pending = self._pending.get(group)
        if pending is not None and pending[0] is x and pending[1] == x._version and member in pending[2]:
            out = pending[2].pop(member)
            if not pending[2]:
                del self._pending[group]
            return out
        outs = group.outputs(self._plan, x, self.sgmv_backend)
        rest = {i: out for i, out in enumerate(outs) if i != member}
        if rest:
            self._pending[group] = (x, x._version, rest)
        return outs[member]


class LayerGroup:
    """Base Linear layers that read one input, with their module paths (a single layer is a group
    of one)."""

    def __init__(self, paths: list[str], layers: list[nn.Linear]) -> None:
        self.paths, self.layers = paths, layers

    def outputs(self, plan: RoutingPlan, x: torch.Tensor, backend: str) -> list[torch.Tensor]:
        stacked = plan.stacked.layers(self.paths) if plan.stacked is not None and backend in ("auto", "bmm") else None
        if stacked is not None:
            bank = plan.stacked
            return apply_stacked_lora_group(x, self.layers, stacked, bank.grid, bank.scale, bank.weights, bank.pieces)
        segments = [plan.segments_for(path) for path in self.paths]
        rows = [[(s.start, s.end) for s in segs] for segs in segments]
        if x.is_cuda or backend == "triton" or any(r != rows[0] for r in rows):
            # on the token rows as a 2-D matrix: nn.Linear with a bias (Qwen2's q/k/v) answers a 3-D input
            # with a view of its product, and the LoRA adds into its base output in place, which a view
            # of a product does not allow (its backward failed on the shapes)
            x2 = x.reshape(-1, x.shape[-1])
            return [apply_segmented_lora(x2, F.linear(x2, layer.weight, layer.bias), segs, backend)
                    .view(*x.shape[:-1], layer.out_features) for layer, segs in zip(self.layers, segments)]
        # also without segments: the base layers then sum their input gradient as they do beside
        # LoRA (in place), so a row's bits do not depend on whether another adapter trains the group
        return apply_lora_group(x, self.layers, segments if any(segments) else [], backend)


class MultiLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, module_path: str, router: Router) -> None:
        super().__init__()
        self.base = base
        self.module_path = module_path
        self.router = router
        self.group, self.member = LayerGroup([module_path], [base]), 0

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
        if self.router.plan is None:
            return self.base(x)
        return self.router.group_output(self.group, self.member, x)


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
    _group_shared_inputs(model)
    return wrapped


def _group_shared_inputs(model: nn.Module) -> None:
    for parent in model.modules():
        for names in SHARED_INPUT_GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if all(isinstance(m, MultiLoRALinear) for m in members) and len({m.in_features for m in members}) == 1:
                group = LayerGroup([m.module_path for m in members], [m.base for m in members])
                for i, m in enumerate(members):
                    m.group, m.member = group, i
