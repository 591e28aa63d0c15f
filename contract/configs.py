"""The configs training requests carry, with the checks the API runs at the door and the engine
runs again (one definition of each check, and no torch, so an API replica needs no engine).

`LoraConfig` is an adapter's: stored with its model (db TrainingModel.lora_config), in create_model's
payload and in every training-state manifest. `AdamParams` and `DimuonParams` are the SDK's types
(loraplex.types): the client sends them, the optimizer applies them (docs/optimizers.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from contract.errors import InvalidInputError
from loraplex.types import DEFAULT_LORA_RANK, OPTIMIZERS, AdamParams, DimuonParams

DEFAULT_LORA_ALPHA = 32.0

# Tinker's LoRA switches -> the module names they cover: Llama, Mistral, Qwen2/3 and Gemma 2 name them
# alike; Phi-3 fuses q/k/v into qkv_proj and gate/up into gate_up_proj. A model holds one set or the other.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
UNEMBED_MODULES = ("lm_head",)
# A mixture-of-experts block's fused expert parameters ([experts, out, in], e.g. Qwen3-MoE's
# mlp.experts.gate_up_proj), in the order transformers defines them: train_mlp covers them too,
# one A and B per expert (workers/trainer/moe_experts.py)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def target_module_names(train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    return (ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ()) + (
        UNEMBED_MODULES if train_unembed else ()
    )


@dataclass(frozen=True)
class LoraConfig:
    rank: int = DEFAULT_LORA_RANK
    alpha: float = DEFAULT_LORA_ALPHA
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def validate(self, max_rank: int) -> None:
        if not isinstance(self.rank, int) or not 1 <= self.rank <= max_rank:
            raise InvalidInputError("lora_config.rank", f"must be an integer in [1, {max_rank}], got {self.rank!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise InvalidInputError("lora_config.alpha", f"must be a positive finite number, got {self.alpha!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise InvalidInputError("lora_config", "at least one of train_attn, train_mlp, train_unembed must be true")

    def target_modules(self) -> tuple[str, ...]:
        return target_module_names(self.train_attn, self.train_mlp, self.train_unembed)

    def to_dict(self) -> dict:
        return asdict(self)


_JSON_KINDS = {str: "text", bool: "true or false", list: "a list", dict: "an object", type(None): "null"}

OptimParams = AdamParams | DimuonParams
# optim_step's "type" -> the family of its hyperparameters ("adam" is the loraplex SDK's older spelling)
PARAMS_OF = {"adam": AdamParams, "adamw": AdamParams, "dimuon": DimuonParams}
OPTIMIZER_OF = {AdamParams: "adamw", DimuonParams: "dimuon"}


def optimizer_of(params: OptimParams) -> str:
    """The optimizer (an optimizer_config type) that `params` are the hyperparameters of."""
    return OPTIMIZER_OF[type(params)]


def optim_params_from(raw: dict, field: str = "adam_params") -> OptimParams:
    """An optim_step's hyperparameters, of the family its "type" names (AdamW when none); InvalidInputError
    naming the first field (under `field`, the key the client sent them in) that is unknown, missing or
    not a number. Fields left out take their defaults, on every step (never an earlier step's values)."""
    kind = raw.get("type", "adamw")
    family = PARAMS_OF.get(kind) if isinstance(kind, str) else None
    if family is None:
        raise InvalidInputError(f"{field}.type", f"unknown optimizer {str(kind)[:64]!r}; known: {', '.join(OPTIMIZERS)}")
    known = [f.name for f in fields(family)]
    values = {name: value for name, value in raw.items() if name != "type"}
    for name, value in values.items():
        if name not in known:
            raise InvalidInputError(f"{field}.{str(name)[:64]}",
                                    f"not a hyperparameter of {OPTIMIZER_OF[family]}; known: {', '.join(known)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind_name = _JSON_KINDS.get(type(value), "a value")
            raise InvalidInputError(f"{field}.{name}", f"must be a number, got {kind_name}")
    if family is DimuonParams and "learning_rate" not in values:
        raise InvalidInputError(f"{field}.learning_rate", "is required for Dimuon (it has no default)")
    params = family(**values)
    check_optim_params(params, field)
    return params


def check_optim_params(params: OptimParams, field: str = "adam_params") -> None:
    """Every hyperparameter a finite number in its range; InvalidInputError naming the first that is not."""
    if isinstance(params, DimuonParams):
        checks = {
            "learning_rate": params.learning_rate >= 0,
            "grad_clip_norm": True,  # any value: <= 0 disables clipping (Tinker's contract)
            "beta1": 0 <= params.beta1 < 1,
            "damping": params.damping > 0,
            "rank_lr_correction_exponent": True,
        }
    else:
        checks = {
            "learning_rate": params.learning_rate >= 0,
            "beta1": 0 <= params.beta1 < 1,
            "beta2": 0 <= params.beta2 < 1,
            "eps": params.eps > 0,
            "weight_decay": params.weight_decay >= 0,
            "grad_clip_norm": params.grad_clip_norm >= 0,
        }
    for name, ok in checks.items():
        value = getattr(params, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
            raise InvalidInputError(f"{field}.{name}", f"invalid value {value!r}")
