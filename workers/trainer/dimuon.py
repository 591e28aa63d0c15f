"""Dimuon: a Muon-family optimizer for LoRA factors, Loraplex's reading of Tinker's published contract.

Tinker publishes Dimuon's parameters and a few properties, not its formula; the math here is ours
and docs/optimizers.md writes it out. Per adapter, per step:

    g  = clip(gradient, grad_clip_norm)               (the adapter's global norm, as AdamW's)
    M  = beta1 * M + (1 - beta1) * g                  (momentum, one flat tensor like the weights)
    per LoRA matrix X of M, oriented [rank, d] (A as is, B transposed):
      X' = X / rms(X)                                 (the damping below is then scale-free)
      P  = X' / ((row_ms + damping)^1/4 (col_ms + damping)^1/4)   (damped row and column preconditioner)
      O  = msign(P)                                   (Newton-Schulz, NS_STEPS iterations)
      U  = O * sqrt(rank) / ||O||_F                   (a direction of Frobenius norm sqrt(rank))
      W -= learning_rate * (32 / rank)^rank_lr_correction_exponent * U

Each adapter is computed on its own (matrices of one adapter grouped by shape into one batched
product, the grouping fixed by the adapter alone), so a step co-batched with other tenants gives the
same bits as the step alone.
"""

from __future__ import annotations

import math

import torch
from loraplex.types import DimuonParams
from torch import Tensor

from contract.errors import InvalidInputError
from workers.trainer.adapters import Adapter
from workers.trainer.optimizer import clip_

REFERENCE_RANK = 32  # Tinker: the learning-rate correction is relative to rank 32
NS_STEPS = 5  # Newton-Schulz iterations of the matrix sign (an internal constant, as Tinker's)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic: singular values to ~[0.7, 1.2] in 5 steps
EPS = 1e-12  # normalization epsilon (internal): keeps an all-zero momentum a zero update


def rank_lr(params: DimuonParams, rank: int) -> float:
    """The learning rate applied at this rank: 1x at rank 32, exponent 0 disables the correction."""
    return params.learning_rate * (REFERENCE_RANK / rank) ** params.rank_lr_correction_exponent


def matrix_sign(x: Tensor) -> Tensor:
    """msign of each [r, d] matrix of `x` ([k, r, d], r <= d): U V^T of its SVD, by Newton-Schulz."""
    a, b, c = NS_COEFFICIENTS
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + EPS)  # singular values into [0, 1]
    for _ in range(NS_STEPS):
        gram = x @ x.mT  # [k, r, r]: cheap, r is the LoRA rank
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def directions(momenta: Tensor, rank: int, damping: float) -> Tensor:
    """The update direction of each [rank, d] matrix of `momenta` ([k, rank, d]): Frobenius norm sqrt(rank)
    (zero where the momentum is zero)."""
    x = momenta.float()
    x = x / (x.square().mean(dim=(-2, -1), keepdim=True).sqrt() + EPS)
    rows = (x.square().mean(dim=-1, keepdim=True) + damping) ** 0.25
    cols = (x.square().mean(dim=-2, keepdim=True) + damping) ** 0.25
    sign = matrix_sign(x / rows / cols)
    return sign * (math.sqrt(rank) / (torch.linalg.matrix_norm(sign, keepdim=True) + EPS))


def _oriented(adapter: Adapter, flat: Tensor) -> list[Tensor]:
    """Each matrix of `flat` as [rank, d]: A ([rank, in]) as is, B ([out, rank]) transposed (views)."""
    return [view if name.endswith("lora_A") else view.mT for name, view in adapter.named_views(flat)]


def _step_one(adapter: Adapter, params: DimuonParams) -> None:
    state = adapter.optimizer_state
    if not state:
        state["momentum"] = torch.zeros_like(adapter.flat_weights)
    momentum = state["momentum"]
    momentum.lerp_(adapter.flat_grads, 1 - params.beta1)  # M = beta1 M + (1 - beta1) g
    rank, lr = adapter.config.rank, rank_lr(params, adapter.config.rank)
    groups: dict[tuple[int, ...], list[tuple[Tensor, Tensor]]] = {}  # shape -> (momentum, weight) pairs
    for m, w in zip(_oriented(adapter, momentum), _oriented(adapter, adapter.flat_weights)):
        groups.setdefault(tuple(m.shape), []).append((m, w))
    for pairs in groups.values():
        update = directions(torch.stack([m for m, _ in pairs]), rank, params.damping)
        for (_, w), u in zip(pairs, update):
            w.sub_((lr * u).to(w.dtype))


def dimuon_step(batch: list[tuple[Adapter, DimuonParams]]) -> list[dict[str, float] | InvalidInputError]:
    """One Dimuon step on each adapter of `batch` (each at most once), then clear its gradients. Metrics in
    batch order. An adapter whose gradients hold NaN or inf is not stepped (as in adamw_step)."""
    assert len({id(a) for a, _ in batch}) == len(batch), "an adapter appears twice in one step"
    results: list[dict[str, float] | InvalidInputError] = []
    with torch.no_grad():
        for adapter, params in batch:
            norm = torch.linalg.vector_norm(adapter.flat_grads)
            grad_norm = float(norm)
            if not math.isfinite(grad_norm):
                results.append(InvalidInputError(
                    "gradients", f"grad_norm is {grad_norm}: the accumulated gradients hold NaN or inf, so the step "
                    "was not applied and they were cleared (weights, momentum and step count unchanged)"))
                continue
            if params.grad_clip_norm > 0:
                clip_(adapter.flat_grads, params.grad_clip_norm, norm)
            _step_one(adapter, params)
            adapter.step += 1
            results.append({"grad_norm": grad_norm, "learning_rate": params.learning_rate, "step": float(adapter.step)})
    Adapter.zero_grads([adapter for adapter, _ in batch])
    return results
