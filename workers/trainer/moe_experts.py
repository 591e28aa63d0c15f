"""Mixture-of-experts layers with many adapters' LoRA on every expert, in one packed pass.

transformers keeps a sparse block's experts as fused 3-D parameters (Qwen3-MoE's, Mixtral's and
OLMoE's `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), which LoRA by module name
would skip; their routers differ (renormalised top-k weights or not) but hand the experts the same
top_k_index and top_k_weights, so one module serves them all. The engine swaps each such experts
module for a `MultiLoRAExperts`, which reads the same `RoutingPlan` as the Linear layers
(lora_layers.py). An adapter that trains the MLP holds, for each
of these parameters, one A and one B per expert: A [E, r, in], B [E, out, r] (a `LoraWeights` of
3-D matrices, so its flat tensor, checkpoints and paging carry them like any other). The router
(the block's `gate`) is the base model's, frozen, with no LoRA: it picks each token's experts and
their weights, and its gradient still flows back into the hidden states as in transformers.

Segment layout (one sparse block, T packed token rows, top-k experts per token):

    dispatched rows: every (token t, slot j) pair, T * k of them, sorted by expert, then by token
                     (a stable sort of t * k + j by top_k_index[t, j]);
    expert e's block: its rows, contiguous, tokens ascending;
    (adapter, expert) segment: the rows of expert e's block whose token lies in the adapter's span
                     [start, end) of the packed row. Spans are contiguous and tokens ascend in a
                     block, so a segment is contiguous too; a request's piece of a span (its
                     weight gradients' unit, grad_pieces.py) maps to a contiguous range the same way.

gate_up and down are each expert's base product on its block, then one `apply_segmented_lora`
over every (adapter, expert) segment of the dispatched rows, whose A and B are the adapter's [e]
slices and whose gradients go to the [e] slices of the adapter's .grad views (one call, not one
per expert: a segment is a few rows when many tenants share a pass, and a call per expert cost more
than its products). Each row's output is scaled by its routing weight and a token's k rows are added
in slot order.

Batch invariance (docs/decisions/0022): the number of rows an expert gets follows the whole
batch, so its base products go through row_gemm (a product of few rows is computed on zero-padded
rows, in the forward and the backward), the LoRA products through the segment code that already
holds every row to the bits of a lone request, and nothing sums over tokens but the weight
gradients' pieces. transformers' own loop adds with `index_add_` in expert order from zero: for
k = 2 the same two additions as the slot order here.

`reference_experts` is the plain torch statement of the same math, one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from contract.configs import EXPERT_PARAMETERS
from workers.sgmv import row_gemm
from workers.sgmv.segmented_lora import Segment, apply_segmented_lora
from workers.trainer.lora_layers import Router, RoutingPlan


@dataclass(frozen=True)
class ExpertProjection:
    """One fused [experts, out, in] parameter as a LoRA target (the engine's `base_layers` entry)."""

    weight: torch.Tensor  # the base model's parameter

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    @property
    def in_features(self) -> int:
        return self.weight.shape[2]

    def lora_shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.num_experts, rank, self.in_features), (self.num_experts, self.out_features, rank)


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' experts layout this module computes: concatenated [gate; up], [E, out, in], no bias."""
    gate_up = getattr(module, "gate_up_proj", None)
    return (isinstance(gate_up, nn.Parameter) and gate_up.dim() == 3 and hasattr(module, "num_experts")
            and getattr(module, "is_concatenated", True) and not getattr(module, "is_transposed", False)
            and not getattr(module, "has_bias", False) and getattr(module, "has_gate", True))


class MultiLoRAExperts(nn.Module):
    def __init__(self, base: nn.Module, module_path: str, router: Router) -> None:
        super().__init__()
        self.base = base
        self.module_path = module_path
        self.router = router
        self.paths = tuple(f"{module_path}.{name}" for name in EXPERT_PARAMETERS)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        plan = self.router.plan
        if plan is None:
            return self.base(hidden_states, top_k_index, top_k_weights)
        return routed_experts(hidden_states, top_k_index, top_k_weights, self.base, plan, self.paths,
                              self.router.sgmv_backend)


def wrap_moe_experts(model: nn.Module, router: Router) -> dict[str, ExpertProjection]:
    """Replace every fused experts module of `model` in place; return {parameter path: ExpertProjection}."""
    found: dict[str, ExpertProjection] = {}
    for path, module in list(model.named_modules()):
        if not hasattr(module, "gate_up_proj") or isinstance(module, nn.Linear) or not path.endswith("experts"):
            continue
        if not is_fused_experts(module):
            raise ValueError(f"{path}: an experts layout the trainer does not compute ({type(module).__name__})")
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path), attr, MultiLoRAExperts(module, path, router))
        for name in EXPERT_PARAMETERS:
            found[f"{path}.{name}"] = ExpertProjection(getattr(module, name))
    return found


class _RowLinear(torch.autograd.Function):
    """x @ w^T for a frozen w, each row with the bits of a large product in both directions (row_gemm.py)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        out = row_gemm.mm(x, w.t())
        # few rows come back as a view of a padded product; the LoRA adds into this output in place
        return out.clone() if out._base is not None else out

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return (row_gemm.mm(grad.contiguous(), w) if ctx.needs_input_grad[0] else None), None


@dataclass(frozen=True)
class Dispatch:
    """Where each (token, slot) pair went: rows sorted by expert, then token (the module docstring)."""

    order: torch.Tensor  # [T * k]: dispatched row -> t * k + j
    counts: list[int]  # rows of each expert
    offsets: list[int]  # first row of each expert
    _positions: dict[tuple[int, int], int]  # (expert, packed row b) -> first row of the expert's block at token >= b

    @classmethod
    def of(cls, top_k_index: torch.Tensor, boundaries: list[int], num_experts: int) -> "Dispatch":
        T, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=num_experts).tolist()
        keys = experts[order] * T + order // k  # ascending: expert-major, then token
        queries = torch.tensor([[e * T + b for b in boundaries] for e in range(num_experts)], dtype=keys.dtype)
        found = torch.searchsorted(keys, queries.flatten()).tolist() if boundaries else []
        offsets = [0]
        for n in counts[:-1]:
            offsets.append(offsets[-1] + n)
        positions = {(e, b): found[e * len(boundaries) + i] - offsets[e]
                     for e in range(num_experts) for i, b in enumerate(boundaries)}
        return cls(order, counts, offsets, positions)

    def local(self, expert: int, row: int) -> int:
        """The row of expert `expert`'s block where packed row `row`'s tokens begin."""
        return self._positions[(expert, row)]


def expert_segments(plan: RoutingPlan, dispatch: Dispatch, path: str) -> list[Segment]:
    """The (adapter, expert) segments of one fused parameter, in dispatched rows: expert after expert,
    each expert's adapters in packed order."""
    segments = []
    for expert, offset in enumerate(dispatch.offsets):
        for i, (adapter, start, end) in enumerate(plan.spans):
            weights = adapter.weights.get(path)
            if weights is None:
                continue
            lo, hi = dispatch.local(expert, start), dispatch.local(expert, end)
            if hi <= lo:
                continue
            pieces = tuple((offset + dispatch.local(expert, a), offset + dispatch.local(expert, b))
                           for a, b in plan.pieces[i]) if plan.pieces is not None else ()
            segments.append(Segment(offset + lo, offset + hi, weights.lora_a[expert], weights.lora_b[expert],
                                    adapter.scale, weights.lora_a.grad[expert], weights.lora_b.grad[expert], pieces))
    return segments


def span_boundaries(plan: RoutingPlan) -> list[int]:
    """Every packed row where a span or one of its pieces begins or ends."""
    rows = set()
    for i, (_, start, end) in enumerate(plan.spans):
        rows.update((start, end))
        for piece in plan.pieces[i] if plan.pieces is not None else ():
            rows.update(piece)
    return sorted(rows)


def per_expert(rows: torch.Tensor, weight: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
    """Each expert's block of dispatched rows times its own [out, in] matrix of the fused `weight`."""
    return torch.cat([_RowLinear.apply(rows[first: first + n], weight[e])
                      for e, (first, n) in enumerate(zip(dispatch.offsets, dispatch.counts)) if n])


def routed_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: nn.Module,
                   plan: RoutingPlan, paths: tuple[str, str], backend: str = "auto") -> torch.Tensor:
    """The experts' output [T, H] for packed rows x [T, H] with each adapter's LoRA on its own rows."""
    T, k = top_k_index.shape
    with torch.no_grad():
        dispatch = Dispatch.of(top_k_index, span_boundaries(plan), experts.num_experts)
    # each token once per slot, then sorted: index_select by a permutation, whose backward adds no two rows
    rows = x[:, None, :].expand(T, k, x.shape[-1]).reshape(T * k, x.shape[-1]).index_select(0, dispatch.order)
    # base products expert by expert; each parameter's LoRA over every (adapter, expert) segment in one call
    h = apply_segmented_lora(rows, per_expert(rows, experts.gate_up_proj, dispatch),
                             expert_segments(plan, dispatch, paths[0]), backend)
    gate, up = h.chunk(2, dim=-1)
    u = experts.act_fn(gate) * up
    down = apply_segmented_lora(u, per_expert(u, experts.down_proj, dispatch),
                                expert_segments(plan, dispatch, paths[1]), backend)
    weighted = down * top_k_weights.reshape(-1).index_select(0, dispatch.order)[:, None].to(x.dtype)
    per_slot = weighted.index_select(0, torch.argsort(dispatch.order)).view(T, k, -1)
    out = per_slot[:, 0]
    for j in range(1, k):  # slot order: a token's sum never depends on other tokens
        out = out + per_slot[:, j]
    return out


def reference_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: nn.Module,
                      loras: list[tuple[int, int, dict[str, tuple[torch.Tensor, torch.Tensor]], float]],
                      paths: tuple[str, str]) -> torch.Tensor:
    """The same math, token by token: `loras` holds (start, end, {path: (A [E, r, in], B [E, out, r])},
    scale) per adapter span. For tests; as slow as it is plain."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        lora = next(((w, s) for start, end, w, s in loras if start <= t < end), (None, 0.0))
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])

            def project(v: torch.Tensor, path: str, base: torch.Tensor) -> torch.Tensor:
                y = base[e] @ v
                if lora[0] is not None and path in lora[0]:
                    a, b = lora[0][path]
                    y = y + lora[1] * (b[e] @ (a[e] @ v))
                return y

            gate, up = project(x[t], paths[0], experts.gate_up_proj).chunk(2)
            out[t] = out[t] + top_k_weights[t, j] * project(experts.act_fn(gate) * up, paths[1], experts.down_proj)
    return out
