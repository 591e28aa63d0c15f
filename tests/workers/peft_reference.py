"""Single-adapter references for the engine's tests: peft models and the loss math from the protocol.

The losses here are written out from the Tinker protocol text (section 8), per datum, on
purpose independently of workers/trainer/losses.py, so a mistake in one shows up as a mismatch.
"""

from __future__ import annotations

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from workers.trainer.adapters import Adapter


def peft_model_like(adapter: Adapter, model_path, dtype=torch.float32):
    """A fresh base model with one peft LoRA adapter holding a copy of `adapter`'s weights."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    cfg = adapter.config
    model = get_peft_model(
        base,
        PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, target_modules=list(cfg.target_modules())),
    )
    model.eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for path, w in adapter.weights.items():
            params[peft_param_name(path, "A")].copy_(w.lora_a)
            params[peft_param_name(path, "B")].copy_(w.lora_b)
    return model


def peft_param_name(module_path: str, which: str) -> str:
    return f"base_model.model.{module_path}.lora_{which}.default.weight"


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


def random_datum(loss_fn: str, n: int, gen: torch.Generator, vocab: int, k: int | None = None):
    """A datum of n positions with plausible inputs for `loss_fn` (sampler logprobs near the tiny model's)."""
    from workers.trainer.batch import Datum

    seq = torch.randint(0, vocab, (n + 1,), generator=gen)
    inputs: dict[str, torch.Tensor] = {}
    if k is None:
        inputs["target_tokens"] = seq[1:]
    else:
        inputs["target_tokens"] = torch.randint(0, vocab, (n, k), generator=gen)
    shape = inputs["target_tokens"].shape
    if loss_fn == "cross_entropy":
        inputs["weights"] = torch.rand(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.2)
    else:
        # near log(1/vocab) so ratios straddle the clip bounds
        inputs["logprobs"] = -torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(n, generator=gen)
        inputs["advantages"] = torch.randn(n, generator=gen)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (torch.rand(n, generator=gen) > 0.3).float()
    return Datum(seq[:-1], inputs)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))
