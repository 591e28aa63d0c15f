"""What the dashboard charts of a forward_backward or optim_step, taken from what the engine computed.

The executor attaches these numbers to the request's Outcome (`Outcome.metrics`), so they reach the
database with the outcome itself, through the same path in embedded and distributed mode; the
scheduler stores them (db/run_metrics.py). Sums, not means: the dashboard adds a step's requests
up and divides once. Every number is read off arrays the request already holds (no extra pass).
"""

from __future__ import annotations

import numpy as np
import torch

from contract.inputs import ForwardBackwardInput
from workers.trainer.batch import EngineOutput
from workers.trainer.shared_prefix import MIN_SHARED_TOKENS, share_plan


def _array(values) -> np.ndarray:
    return values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)


def _trained_mask(inputs: dict, length: int) -> np.ndarray | None:
    """The positions that carry loss: nonzero advantages (RL losses) or weights (cross_entropy); None: all."""
    for name in ("advantages", "weights"):
        values = inputs.get(name)
        if values is not None and len(values) == length:
            return _array(values) != 0
    return None


def forward_backward_metrics(request: ForwardBackwardInput, result: EngineOutput, step: int) -> dict[str, float]:
    """`step`: the adapter's optimizer steps before this request (its gradient feeds step + 1).

    tokens: loss-bearing target tokens; shared_tokens: input tokens that repeat their group's first
    datum (the trainer's shared-prefix plan, at its default threshold, whether or not sharing is on);
    advantage_datums: datums carrying `advantages`; gap_*: over trained tokens whose datum carried the
    sampler's `logprobs`, |trainer - sampler| and the k3 estimate r - 1 - log r of KL(sampler ||
    trainer), r = exp(trainer - sampler).
    The datums' arrays are joined once and reduced together: a few hundred microseconds for a group."""
    trainer, masks, gap_trainer, gap_sampler = [], [], [], []
    for datum, output in zip(request.data, result.loss_fn_outputs):
        logprobs = output.get("logprobs")
        if logprobs is None or logprobs.ndim != 1:
            continue
        trainer.append(logprobs)
        mask = _trained_mask(datum.loss_fn_inputs, logprobs.numel())
        masks.append(np.ones(logprobs.numel(), dtype=bool) if mask is None else mask)
        if "logprobs" in datum.loss_fn_inputs:
            gap_trainer.append(logprobs[torch.from_numpy(masks[-1])])
            gap_sampler.append(_array(datum.loss_fn_inputs["logprobs"])[masks[-1]])
    rows = [torch.as_tensor(_array(d.tokens)) for d in request.data]
    metrics = {"step": step + 1, "loss_sum": float(result.metrics.get("loss:sum", 0.0)),
               "tokens": int(np.concatenate(masks).sum()) if masks else 0,
               "input_tokens": sum(t.numel() for t in trainer),
               "shared_tokens": sum(share_plan(rows, MIN_SHARED_TOKENS)), "datums": len(request.data),
               # the dashboard reads the RL groups of only these requests' datums (db/inferred_groups.py)
               "advantage_datums": sum("advantages" in d.loss_fn_inputs for d in request.data)}
    if gap_trainer:
        diff = torch.cat(gap_trainer).double().numpy() - np.concatenate(gap_sampler).astype(np.float64)
        with np.errstate(over="ignore"):  # an overflowing ratio gives inf, which the scheduler leaves out
            metrics.update(gap_tokens=diff.size, gap_abs_sum=float(np.abs(diff).sum()),
                           gap_k3_sum=float((np.expm1(diff) - diff).sum()))
    return metrics


def optim_step_metrics(result: dict[str, float]) -> dict[str, float]:
    """The engine's optim_step result: the step it made, its gradient norm and learning rate."""
    return {"step": int(result["step"]), "grad_norm": result["grad_norm"], "learning_rate": result["learning_rate"]}
