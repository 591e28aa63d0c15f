"""Every architecture Loraplex serves (models/architectures.py), on its tiny model: the trainer's
logprobs, loss, LoRA gradients and AdamW step equal a single-adapter peft model's on transformers'
eager attention; a few SFT steps lower the loss; a model's bits do not depend on who shares its
batch. Datums run past the 16-token sliding window of Mistral and Gemma 2, and an RL group's shared
prompt too. (Sampling them with vLLM: tests/workers/sampler/test_architectures.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from contract.inputs import ForwardBackwardInput
from models.architectures import ARCHITECTURES, MOE_SAMPLING, sampling_refusal
from models.registry import resolve_model
from models.tiny import SLIDING_WINDOW
from tests.workers.trainer.test_batch_invariance import HEALTH, check_composition, compositions, datums
from tests.workers.trainer.test_engine_parity import check_against_peft, make_engine
from workers.trainer.engine import TrainerEngine
from workers.trainer.moe_experts import MultiLoRAExperts

LONG = 2 * SLIDING_WINDOW + 5  # past the window, twice


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request):
    return ARCHITECTURES[request.param]


@pytest.fixture(scope="module")
def model_path(arch):
    return resolve_model(arch.tiny)


def adapters(arch) -> dict[str, LoraConfig]:
    """Two ranks and target sets, the unembedding where the architecture samples a LoRA on it."""
    return {"attn": LoraConfig(rank=2, alpha=4, seed=1, train_mlp=False, train_unembed=False),
            "all": LoraConfig(rank=4, alpha=16, seed=2, train_unembed=arch.unembed_lora)}


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_logprobs_gradients_and_step_equal_peft_on_transformers(arch, model_path, loss_fn):
    engine = make_engine(model_path, adapters(arch))
    requests = [ForwardBackwardInput("attn", datums(loss_fn, [LONG, 7], 1, engine.vocab_size), loss_fn),
                # an RL group: three datums sharing a 20-token prompt, computed once (shared_prefix.py)
                ForwardBackwardInput("all", datums(loss_fn, [LONG, 30, 25], 2, engine.vocab_size, prompt=20), loss_fn)]
    check_against_peft(engine, requests, model_path)


def test_sft_steps_lower_the_loss(arch, model_path):
    engine = TrainerEngine(model_path)
    engine.create_adapter("m", adapters(arch)["all"])
    request = ForwardBackwardInput("m", datums("cross_entropy", [LONG, 12], 3, engine.vocab_size))
    losses = []
    for _ in range(4):
        losses.append(engine.forward_backward([request])[0].metrics["loss:sum"])
        engine.optim_step([("m", AdamParams(learning_rate=1e-2))])
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.slow  # ~0.5 s an architecture; test_batch_invariance.py's fast run covers the shared paths
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=HEALTH, database=None)
@given(data=st.data())
def test_a_models_bits_do_not_depend_on_the_batch(arch, model_path, data):
    engine = TrainerEngine(model_path)
    check_composition(engine, *data.draw(compositions(engine.vocab_size, arch.unembed_lora, longest=LONG)))


def test_a_lora_the_sampler_cannot_apply_is_refused_by_name(arch, model_path):
    engine = TrainerEngine(model_path)
    if arch.unembed_lora:
        engine.create_adapter("u", LoraConfig(rank=2))
        assert any(path.endswith("lm_head") for path in engine.adapter("u").weights)
        return
    with pytest.raises(InvalidInputError, match="lora_config.train_unembed: .*train_unembed=False"):
        engine.create_adapter("u", LoraConfig(rank=2))


def test_lora_covers_every_module_the_switches_name(arch, model_path):
    """Attention and MLP switches land on every projection of every layer, fused or not (Phi-3), and on
    every expert of a mixture of experts (its fused 3-D parameters, one A and B per expert), never on the
    router."""
    engine = TrainerEngine(model_path)
    adapter = engine.create_adapter("a", LoraConfig(rank=2, train_unembed=False))
    layers = engine.model.config.num_hidden_layers
    projections = {name.removesuffix(".base") for name, module in engine.model.named_modules()
                   if isinstance(module, torch.nn.Linear) and ".layers." in name}  # (wrapped: <path>.base)
    experts = {f"{name.removesuffix('.base')}.{p}": getattr(module, p) for name, module in engine.model.named_modules()
               if name.endswith("experts.base") for p in ("gate_up_proj", "down_proj")}
    assert set(adapter.weights) == projections | set(experts)
    per_layer = 6 if arch.moe else {"phi3": 4}.get(arch.model_type, 7)
    assert len(adapter.weights) == per_layer * layers
    assert not any(".gate." in path or path.endswith(".gate") for path in adapter.weights)  # the router: frozen
    for path, weight in experts.items():  # [experts, out, in] -> A [experts, r, in], B [experts, out, r]
        assert adapter.weights[path].lora_a.shape == (weight.shape[0], 2, weight.shape[2])
        assert adapter.weights[path].lora_b.shape == (weight.shape[0], weight.shape[1], 2)
    mlp_off = engine.create_adapter("b", LoraConfig(rank=2, train_mlp=False, train_unembed=False))
    assert not set(mlp_off.weights) & set(experts)


def test_a_model_with_experts_is_marked_moe_and_never_sampled(arch, model_path):
    """The sampler's refusal follows whether the model has fused experts, not which family it is: a new MoE
    row that forgot `moe=True` would reach vLLM's CPU MoE, which fails with an expert LoRA."""
    engine = TrainerEngine(model_path)
    has_experts = any(isinstance(m, MultiLoRAExperts) for m in engine.model.modules())
    assert has_experts == arch.moe
    assert sampling_refusal(arch.model_type) == (MOE_SAMPLING if has_experts else "")


ROPE = {  # rope_parameters of real configs (Llama 3.1's llama3, YaRN, linear, dynamic NTK), on tiny Llamas
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


@pytest.mark.slow  # a model built and compared with peft per variant: ~1 s each
@pytest.mark.parametrize("rope", sorted(ROPE))
def test_rope_scaling_is_exact_and_batch_invariant(rope, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from models.tiny import build_tokenizer

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_parameters=ROPE[rope])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    engine = make_engine(tmp_path, {"x": LoraConfig(rank=4, seed=3)})
    data = datums("cross_entropy", [300, 7, 25], 4, engine.vocab_size)  # 300: past llama3's 256 original positions
    alone = engine.forward([ForwardBackwardInput("x", data[1:2])])[0].loss_fn_outputs[0]["logprobs"]
    together = engine.forward([ForwardBackwardInput("x", data)])[0].loss_fn_outputs[1]["logprobs"]
    assert torch.equal(alone, together)  # the 7-token datum beside a 300-token one: the same bits
    check_against_peft(engine, [ForwardBackwardInput("x", data)], tmp_path)


def test_a_rope_that_follows_the_batch_is_refused_at_start(tmp_path):
    from transformers import Phi3Config

    from models.registry import ModelUnavailable, model_info

    Phi3Config(architectures=["Phi3ForCausalLM"], hidden_size=64, num_attention_heads=2,
               original_max_position_embeddings=4096, max_position_embeddings=131072,
               rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                                "rope_theta": 10000.0}).save_pretrained(tmp_path)
    with pytest.raises(ModelUnavailable, match="uses RoPE longrope, whose frequencies follow the longest sequence"):
        model_info(str(tmp_path))
