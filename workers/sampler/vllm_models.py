"""A vLLM general plugin: vLLM's model classes as Loraplex samples them.

Registered under the `vllm.general_plugins` entry point (pyproject.toml), so vLLM runs `register` in
every process it starts, on every platform. vLLM's Mistral and Qwen2 classes leave lm_head out of
the modules a LoRA may hold (Mistral's `embedding_modules = {}`, Qwen2's none), though both have the
`lm_head` of Llama and Qwen3, whose LoRA vLLM applies: an adapter that trains the unembedding
(Tinker's default) was refused there ("expected target modules in {...} but received ['lm_head']").
tests/workers/sampler/test_architectures.py holds their sampled logprobs to the trainer's, lm_head
LoRA included.
"""

from __future__ import annotations


def register() -> None:
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.mistral import MistralForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    for model in (MistralForCausalLM, Qwen2ForCausalLM):
        model.embedding_modules = dict(LlamaForCausalLM.embedding_modules)
