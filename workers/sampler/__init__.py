"""The sampler worker: a multi-LoRA vLLM engine serving immutable adapter snapshots."""
