"""Single-adapter references for the engine's tests: peft models and the loss math from the protocol.

The losses here are written out from the Tinker protocol text (section 8), per datum, on
purpose independently of workers/trainer/losses.py, so a mistake in one shows up as a mismatch.
"""

from __future__ import annotations

import math

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from storage.peft_export import expert_target_parameters, peft_target_modules, peft_weights
from workers.trainer.adapters import Adapter


def peft_model_like(adapter: Adapter, model_path, dtype=torch.float32):
    """A fresh base model with one peft LoRA adapter holding a copy of `adapter`'s weights. transformers'
    eager attention: its reference math, the one that applies every family's extras (Gemma 2's
    soft-capping; SDPA drops it)."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="eager")
    cfg = adapter.config
    # a mixture of experts' fused expert parameters: peft's LoRA on nn.Parameters (its ParamWrapper)
    experts = expert_target_parameters(path for path, w in adapter.weights.items() if w.lora_a.dim() == 3)
    model = get_peft_model(
        base,
        PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,
                       target_modules=peft_target_modules(cfg, bool(experts)),
                       **({"target_parameters": experts} if experts else {})),
    )
    model.eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in peft_named(adapter, lambda p: p).items():
            params[name].copy_(tensor)
    return model


def peft_named(adapter: Adapter, of) -> dict[str, torch.Tensor]:
    """`of(parameter)` for each A and B of `adapter`, under its peft model's parameter names and in peft's
    layout (an expert parameter's A's and B's side by side: storage/peft_export.peft_weights)."""
    pairs = {path: (of(w.lora_a), of(w.lora_b)) for path, w in adapter.weights.items()}
    return {key.removesuffix(".weight") + ".default.weight": tensor for key, tensor in peft_weights(pairs).items()}


def target_logprobs(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[None]).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    if targets.dim() == 1:
        return logp.gather(1, targets[:, None])[:, 0]
    return logp.gather(1, targets)


def reference_loss(loss_fn: str, tlp, inputs: dict, config: dict) -> torch.Tensor:
    """Loss of ONE datum, exactly as the protocol's table writes it."""
    if loss_fn == "cross_entropy":
        return (-tlp * inputs.get("weights", torch.ones_like(tlp))).sum()
    if loss_fn == "stable_reinforce":
        return stable_reinforce_reference(tlp, inputs, config)
    slp, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(torch.exp(tlp - slp) * adv).sum()
    if loss_fn == "ppo":
        ratio = torch.exp(tlp - slp)
        clipped = torch.clamp(ratio, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
        return -torch.min(ratio * adv, clipped * adv).sum()
    if loss_fn == "cispo":
        ratio = torch.exp(tlp - slp)
        clipped = torch.clamp(ratio, config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0))
        return -(clipped.detach() * tlp * adv).sum()
    if loss_fn == "dro":
        quad = (tlp - slp) ** 2
        return -(tlp * adv - 0.5 * config.get("beta", 0.05) * quad).sum()
    if loss_fn == "gspo":
        m = inputs["sequence_ratio_mask"] != 0
        log_ratio = (tlp.detach() - slp)[m].mean() if m.any() else torch.zeros(())
        ratio = torch.exp(log_ratio + tlp - tlp.detach())
        clipped = torch.clamp(ratio, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
        return -torch.min(ratio * adv, clipped * adv).sum()
    raise ValueError(loss_fn)


def stable_reinforce_reference(tlp, inputs: dict, config: dict) -> torch.Tensor:
    """stable_reinforce of ONE datum as docs/losses.md writes it, one token at a time, in Python floats
    wherever no gradient is needed (the importance weight, the sequence's drift)."""
    cap = config.get("clip_high_threshold", 2.0)
    bound = config.get("sequence_ratio_threshold", 2.0)
    kl_coeff = config.get("kl_coeff", 0.0)
    sequence = [int(v) for v in inputs["recorded_sequence"]]
    q = [float(v) for v in inputs["recorded_logprobs"]]
    adv = [float(v) for v in inputs["advantages"]]
    total = torch.zeros(())
    for t, k in enumerate(sequence):
        if k == 0:  # not a sampled token: no loss
            continue
        same = [u for u, other in enumerate(sequence) if other == k]
        drift = sum(float(tlp[u].detach()) - q[u] for u in same) / len(same)
        if abs(drift) > math.log(bound):  # the sequence drifted too far from its sampler: dropped
            continue
        weight = min(math.exp(float(tlp[t].detach()) - q[t]), cap)
        total = total - weight * adv[t] * tlp[t] + 0.5 * kl_coeff * (tlp[t] - q[t]) ** 2
    return total


def random_datum(loss_fn: str, n: int, gen: torch.Generator, vocab: int, k: int | None = None):
    """A datum of n positions with plausible inputs for `loss_fn` (sampler logprobs near the tiny model's)."""
    from contract.inputs import EngineDatum

    seq = torch.randint(0, vocab, (n + 1,), generator=gen)
    inputs: dict[str, torch.Tensor] = {}
    if k is None:
        inputs["target_tokens"] = seq[1:]
    else:
        inputs["target_tokens"] = torch.randint(0, vocab, (n, k), generator=gen)
    shape = inputs["target_tokens"].shape
    if loss_fn == "cross_entropy":
        inputs["weights"] = torch.rand(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.2)
    elif loss_fn == "stable_reinforce":
        # rows [0, p) prompt, then two sampled sequences; the second's sampler logprobs are far above the
        # model's, so it is dropped. The client's `logprobs` differ from the record: the loss must ignore them.
        p, cut = n // 3, n // 3 + (n - n // 3) // 2
        sequence = torch.zeros(n)
        sequence[p:cut], sequence[cut:] = 1, 2
        recorded = -torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(n, generator=gen)
        recorded[cut:] += 3.0
        inputs["recorded_logprobs"] = torch.where(sequence > 0, recorded, torch.zeros(n))
        inputs["recorded_sequence"] = sequence
        inputs["advantages"] = torch.randn(n, generator=gen) * (sequence > 0)
        inputs["logprobs"] = torch.randn(n, generator=gen)
    else:
        # near log(1/vocab) so ratios straddle the clip bounds
        inputs["logprobs"] = -torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(n, generator=gen)
        inputs["advantages"] = torch.randn(n, generator=gen)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (torch.rand(n, generator=gen) > 0.3).float()
    return EngineDatum(seq[:-1], inputs)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))
