"""The configs training requests carry, with the checks the API runs at the door and the engine
runs again (one definition of each check, and no torch, so an API replica needs no engine).

`LoraConfig` is an adapter's: stored with its model (db TrainingModel.lora_config), in create_model's
payload and in every training-state manifest. `AdamParams` is the SDK's type (loraplex.types): the
client sends it, the optimizer applies it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from contract.errors import InvalidInputError
from loraplex.types import DEFAULT_LORA_RANK, AdamParams

DEFAULT_LORA_ALPHA = 32.0

# Tinker's LoRA switches -> the module names they cover: Llama, Mistral, Qwen2/3 and Gemma 2 name them
# alike; Phi-3 fuses q/k/v into qkv_proj and gate/up into gate_up_proj. A model holds one set or the other.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
UNEMBED_MODULES = ("lm_head",)


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


def adam_params_from(raw: dict) -> AdamParams:
    """AdamParams from a request's hyperparameters; InvalidInputError naming the first that is unknown or
    not a number (before this, Python's own TypeError text reached the caller)."""
    known = [f.name for f in fields(AdamParams)]
    for name, value in raw.items():
        if name not in known:
            raise InvalidInputError(f"adam_params.{str(name)[:64]}",
                                    f"not a hyperparameter of AdamW; known: {', '.join(known)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = _JSON_KINDS.get(type(value), "a value")
            raise InvalidInputError(f"adam_params.{name}", f"must be a number, got {kind}")
    return AdamParams(**raw)


def check_adam_params(adam: AdamParams) -> None:
    """Every hyperparameter a finite number in its range; InvalidInputError naming the first that is not."""
    checks = {
        "learning_rate": adam.learning_rate >= 0,
        "beta1": 0 <= adam.beta1 < 1,
        "beta2": 0 <= adam.beta2 < 1,
        "eps": adam.eps > 0,
        "weight_decay": adam.weight_decay >= 0,
        "grad_clip_norm": adam.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(adam, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
            raise InvalidInputError(f"adam_params.{name}", f"invalid value {value!r}")
