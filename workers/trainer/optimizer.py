"""AdamW over many adapters at once: one fused kernel call per distinct set of hyperparameters.

Each adapter keeps its own moments and step count; torch's fused AdamW reads a step tensor per
tensor it updates, so adapters at different steps share a call. Every adapter's weights,
gradients and moments are one flat tensor each (adapters.py), so a call over 8 SmolLM2 adapters
updates 8 tensors instead of ~3400, and the gradient norm is one reduction per adapter.
Clipping and the reported grad_norm stay per adapter.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from contract.errors import InvalidInputError
from loraplex.types import AdamParams
from workers.trainer.adapters import Adapter


class _FusedCall:
    """The flat tensors of the adapters that share one set of hyperparameters."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.exp_avgs: list[Tensor] = []
        self.exp_avg_sqs: list[Tensor] = []
        self.steps: list[Tensor] = []

    def add(self, adapter: Adapter) -> None:
        state = adapter.optimizer_state
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=adapter.flat_weights.device)
            state["exp_avg"] = torch.zeros_like(adapter.flat_weights)
            state["exp_avg_sq"] = torch.zeros_like(adapter.flat_weights)
        self.params.append(adapter.flat_weights)
        self.grads.append(adapter.flat_grads)
        self.exp_avgs.append(state["exp_avg"])
        self.exp_avg_sqs.append(state["exp_avg_sq"])
        self.steps.append(state["step"])


def clip_(flat_grads: Tensor, max_norm: float, norm: Tensor) -> None:
    """Scale a gradient of norm `norm` down to `max_norm` if above it (torch's clip_grad_norm_ rule). Not
    clip_grads_with_norm_: that scales the `.grad` of the tensors it is given, and a flat gradient has none."""
    flat_grads.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def adamw_step(batch: list[tuple[Adapter, AdamParams]]) -> list[dict[str, float] | InvalidInputError]:
    """One AdamW step (decoupled weight decay, optional global-norm clipping) on each adapter of
    `batch` (each at most once), then clear its gradients. Metrics in batch order.

    An adapter whose gradients hold NaN or inf (a diverging run) is not stepped: one such step
    would make its weights and moments NaN for good. Its gradients are cleared and its result is
    an error; the other adapters step as usual."""
    assert len({id(a) for a, _ in batch}) == len(batch), "an adapter appears twice in one step"
    calls: dict[tuple[float, ...], _FusedCall] = {}
    # every adapter's gradient norm in one call (no forward_backward since the last step: its
    # gradient is zero, as if it had one)
    norms = torch._foreach_norm([adapter.flat_grads for adapter, _ in batch])
    grad_norms = torch.stack(norms).tolist()
    for (adapter, adam), grad_norm, norm in zip(batch, grad_norms, norms):
        if not math.isfinite(grad_norm):
            continue
        if adam.grad_clip_norm > 0:
            clip_(adapter.flat_grads, adam.grad_clip_norm, norm)
        key = (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay)
        calls.setdefault(key, _FusedCall()).add(adapter)
    with torch.no_grad():
        for (lr, beta1, beta2, eps, weight_decay), call in calls.items():
            adamw(call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, [], call.steps, fused=True,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                  maximize=False)
    Adapter.zero_grads([adapter for adapter, _ in batch])
    results: list[dict[str, float] | InvalidInputError] = []
    for (adapter, adam), grad_norm in zip(batch, grad_norms):
        if not math.isfinite(grad_norm):
            results.append(InvalidInputError(
                "gradients", f"grad_norm is {grad_norm}: the accumulated gradients hold NaN or inf, so "
                "the step was not applied and they were cleared (weights, moments and step count unchanged)"))
            continue
        adapter.step += 1
        results.append({"grad_norm": grad_norm, "learning_rate": adam.learning_rate, "step": float(adapter.step)})
    return results
