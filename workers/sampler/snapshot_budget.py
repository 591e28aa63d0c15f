"""How many adapter snapshots the sampler keeps loaded: as many as a byte budget holds.

vLLM keeps `max_cpu_loras` snapshots loaded in host memory (least recently used evicted, and loaded
again from their folder in the store when a request names them), `max_loras` of them in the batch's
slots. A count alone says nothing about memory: a rank-64 snapshot of a model weighs 8x a rank-8
one. So the count is derived from bytes: the budget (`sampler_memory_budget`, else
`sampler_memory_fraction` of the machine's RAM, reckoned as the trainer's: residency.memory_budget)
over the size of the largest snapshot the service accepts, one covering every linear layer (the
unembedding too) at `max_lora_rank`, in the sampler's dtype. Smaller snapshots leave room unused; none can pass the budget. docs/memory.md.
"""

from __future__ import annotations

from pathlib import Path

import torch


def largest_snapshot_bytes(model_path: Path, rank: int, dtype: str) -> int:
    """A LoRA of `rank` on every linear layer of the model: A (rank x in) and B (out x rank) per layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):  # shapes only: no weights read, no memory taken
        model = AutoModelForCausalLM.from_config(config)
    per_rank = sum(m.in_features + m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return per_rank * rank * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def snapshots_in_budget(budget_bytes: int, snapshot_bytes: int, max_loras: int) -> int:
    """vLLM's max_cpu_loras: what the budget holds, and never fewer than one batch's slots (vLLM's minimum)."""
    return max(max_loras, budget_bytes // snapshot_bytes)
