"""The model architectures Loraplex trains and samples, and what each can and cannot do (docs/models.md).

One table, read by the registry (a base model of any other architecture is refused at start), by
create_model (a LoRA the sampler could not apply is refused at the door) and by the tests, which
prove every row on its tiny model (`loraplex/tiny-<arch>`, models/tiny.py): the trainer's logprobs
equal transformers' (eager attention, fp32), its LoRA gradients equal peft's, SFT lowers the loss, a
model's bits do not depend on who shares its batch, and vLLM samples its adapters with the trainer's
logprobs (tests/workers/trainer/test_architectures.py, tests/workers/sampler/test_architectures.py).
No torch here: the API checks requests with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.configs import LoraConfig
from contract.errors import InvalidInputError


@dataclass(frozen=True)
class Architecture:
    model_type: str  # Hugging Face's config.model_type
    family: str
    tiny: str  # the registered tiny model of this architecture
    what_differs: str  # what the trainer and sampler had to get right for it
    # whether the sampler (vLLM) applies a LoRA on the unembedding (lm_head): Gemma 2 ties it to the
    # embedding and vLLM gives it no LoRA slot, so train_unembed is refused there rather than dropped
    unembed_lora: bool = True
    # a mixture of experts (fused 3-D expert parameters, workers/trainer/moe_experts.py): its sampling is refused
    # for MOE_SAMPLING's reason, whatever the family (the tests check that every row whose model has experts says so)
    moe: bool = False

    @property
    def no_sampling(self) -> str:
        """Why the sampler cannot serve models of this architecture ("" where it can): sampling is then
        refused with this reason (a 400 at create_sampling_session and on every sample), never attempted."""
        return MOE_SAMPLING if self.moe else ""


# vLLM 0.32's CPU build runs a LoRA-enabled mixture-of-experts layer only through its Triton MoE kernels,
# which fail there ("module 'triton.language' has no attribute 'float32'"); without LoRA it has a CPU
# path, but Loraplex's sampler always runs with LoRA (the base model through an all-zero adapter)
MOE_SAMPLING = ("the sampler (vLLM's CPU build) has no LoRA for the expert layers of mixture-of-experts base "
                "models; train, save and export the adapter (PEFT, loadable in peft) instead (docs/models.md)")
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "Llama 2/3, SmolLM2", "loraplex/tiny", "the reference layout"),
    Architecture("qwen2", "Qwen2, Qwen2.5", "loraplex/tiny-qwen2", "q/k/v biases"),
    Architecture("qwen3", "Qwen3 (dense)", "loraplex/tiny-qwen3", "q/k norms"),
    Architecture("mistral", "Mistral", "loraplex/tiny-mistral", "sliding-window attention"),
    Architecture("phi3", "Phi-3", "loraplex/tiny-phi3", "fused qkv_proj and gate_up_proj: LoRA targets them whole"),
    Architecture("gemma2", "Gemma 2", "loraplex/tiny-gemma2",
                 "attention and logit soft-capping, (1 + w) norms, tied embeddings, sliding and global layers",
                 unembed_lora=False),
    Architecture("qwen3_moe", "Qwen3-MoE", "loraplex/tiny-qwen3-moe",
                 "mixture of experts: fused 3-D expert parameters (LoRA per adapter and expert), a frozen top-k router",
                 moe=True),
    Architecture("mixtral", "Mixtral", "loraplex/tiny-mixtral",
                 "mixture of experts as Qwen3-MoE's; its router always renormalises the top-k weights", moe=True),
    Architecture("olmoe", "OLMoE", "loraplex/tiny-olmoe",
                 "mixture of experts as Qwen3-MoE's, top-k weights not renormalised; q/k norms over the whole "
                 "projection", moe=True),
)}


# RoPE variants computed from each token's own position, as the packed passes give it (exact, tested
# against transformers). Others pick their frequencies by the longest sequence of the batch (Phi-3's
# `longrope` switches to its long factors past `original_max_position_embeddings`): a datum's
# numbers would follow who shares its pass. `dynamic` changes only past max_position_embeddings,
# which the trainer refuses anyway.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_types(config) -> set[str]:
    """The RoPE variants a transformers config names (one per layer type where it has several)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    found = [parameters] if "rope_type" in parameters or "type" in parameters else list(parameters.values())
    return {p.get("rope_type", p.get("type", "default")) for p in found if isinstance(p, dict)} or {"default"}


def sampling_refusal(model_type: str) -> str:
    """Why models of this architecture cannot be sampled ("" where they can)."""
    architecture = ARCHITECTURES.get(model_type)
    return architecture.no_sampling if architecture is not None else ""


def check_lora_config(model_type: str, config: LoraConfig) -> None:
    """InvalidInputError naming the field if a model of this architecture cannot train `config` as asked."""
    architecture = ARCHITECTURES.get(model_type)
    if architecture is not None and config.train_unembed and not architecture.unembed_lora:
        raise InvalidInputError(
            "lora_config.train_unembed",
            f"a LoRA on the unembedding is not supported on {architecture.family} base models: its embedding is "
            "tied to it and the sampler has no LoRA for it; create the model with train_unembed=False")
