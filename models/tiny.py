"""Tiny, deterministic base models for tests and the embedded default.

A byte-level BPE tokenizer is trained on a small built-in corpus and a randomly initialised
causal LM is built from a config with a fixed seed: the same bytes every time, no downloads.
head_dim is 32 because vLLM's CPU attention supports no smaller head size.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512
# ChatML, the format SmolLM2-Instruct uses too, so examples render the same way on both.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Hermes-style, as Qwen's own: tools listed in a system turn, calls as <tool_call>{json}</tool_call>, which
# vLLM's Hermes parser reads (api/inference/rendering.py). The Qwen-family tiny model carries it, so tools
# work through the inference proxy on a built-in model; the others keep CHAT_TEMPLATE.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}{{ '\\n<tool_call>\\n' }}{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS_ARCHITECTURES = ("qwen3",)

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water "
    "than call first who may down side been now find any new work part take get place made live where "
    "after back little only round man year came show every good me give our under name very through "
    "just form sentence great think say help low line differ turn cause much mean before move right boy "
    "old too same tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father"
).split()


def tiny_corpus() -> list[str]:
    """A few thousand deterministic lines: prose-like word runs, arithmetic and chat turns."""
    lines = []
    for i, (a, b) in enumerate(itertools.product(range(0, 60, 3), range(0, 50, 7))):
        words = " ".join(_WORDS[(i * 7 + k * 13) % len(_WORDS)] for k in range(12))
        lines.append(f"{words}.")
        lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}")
        lines.append(f"<|im_start|>user\nWhat is {a} - {b}?<|im_end|>\n<|im_start|>assistant\n{a - b}<|im_end|>")
    return lines


def build_tokenizer(chat_template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


# Experts per layer of the tiny MoE: few, so that short datums still leave some experts without a row.
MOE_EXPERTS = 4

# A window shorter than the datums of the tests, so that packed attention's window is exercised.
SLIDING_WINDOW = 16


def tiny_config(arch: str, vocab_size: int):
    """A 2-layer config of `arch` (a Hugging Face model_type) with what sets the family apart kept:
    Mistral's sliding window, Phi-3's fused qkv and gate_up projections, Gemma 2's soft-capping, tied
    embeddings, (1 + w) norms and alternating sliding and global layers, Qwen3-MoE's experts (4 per layer, each
    token routed to 2, their weights renormalised as Qwen3-MoE's released configs do, every layer sparse), Mixtral's
    (the same experts behind a router that always renormalises, Mistral's sliding window) and OLMoE's (the same
    experts, weights not renormalised, q/k norms over the whole projection)."""
    from transformers import (Gemma2Config, LlamaConfig, MistralConfig, MixtralConfig, OlmoeConfig, Phi3Config,
                              Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # exercise grouped-query attention
        max_position_embeddings=2048,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=32, **common)
    if arch == "mistral":
        return MistralConfig(head_dim=32, sliding_window=SLIDING_WINDOW, **common)
    if arch == "phi3":
        return Phi3Config(**common)
    if arch == "gemma2":  # soft-capping (50 on attention scores, 30 on logits) and query_pre_attn_scalar stay
        return Gemma2Config(head_dim=32, sliding_window=SLIDING_WINDOW, **(common | {"tie_word_embeddings": True}))
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=32, num_experts=MOE_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    if arch == "mixtral":  # Mistral's attention (its sliding window kept, as on the tiny Mistral) and experts
        return MixtralConfig(num_local_experts=MOE_EXPERTS, num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
                             **(common | {"intermediate_size": 32}))
    if arch == "olmoe":  # top-k weights not renormalised and no q/k/v clipping, as OLMoE's released configs
        return OlmoeConfig(num_experts=MOE_EXPERTS, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
                           **(common | {"intermediate_size": 32}))
    raise ValueError(f"unknown tiny architecture {arch!r}")


def build_tiny_model(dest: Path, arch: str = "llama", seed: int = 0) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(TOOLS_CHAT_TEMPLATE if arch in TOOLS_ARCHITECTURES else CHAT_TEMPLATE)
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2], "special ids are baked into the config"
    config = tiny_config(arch, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
