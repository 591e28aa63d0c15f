"""Base models are named by hub ids, their short names stay aliases, and a served model's tokenizer
files (only those) are listed with a revision that follows their content."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from huggingface_hub.utils import validate_repo_id
from transformers import AutoTokenizer

from models.registry import (
    ALIASES,
    REGISTRY,
    ModelUnavailable,
    hub_id,
    model_info,
    names_of,
    publish_tokenizer,
    resolve_model,
)
from models.tokenizer_files import tokenizer_manifest

NAMES = {
    "loraplex/tiny": ["tiny"],
    "loraplex/tiny-qwen2": ["tiny-qwen2"],
    "loraplex/tiny-qwen3": ["tiny-qwen3"],
    "loraplex/tiny-mistral": ["tiny-mistral"],
    "loraplex/tiny-phi3": ["tiny-phi3"],
    "loraplex/tiny-gemma2": ["tiny-gemma2"],
    "loraplex/tiny-qwen3-moe": ["tiny-qwen3-moe"],
    "loraplex/tiny-mixtral": ["tiny-mixtral"],
    "loraplex/tiny-olmoe": ["tiny-olmoe"],
    "HuggingFaceTB/SmolLM2-135M-Instruct": ["SmolLM2-135M-Instruct", "smollm2"],
}


def test_every_model_is_named_by_a_hub_id_that_tinker_loads_unchanged():
    assert {name: names_of(name)[1:] for name in REGISTRY} == NAMES
    for name in REGISTRY:
        validate_repo_id(name)  # huggingface_hub's own check (raises on anything else)
        # tinker's get_tokenizer rewrites meta-llama/Llama-3*, org/model/variant, TML/ and thinkingmachines/
        assert name.count("/") == 1 and not name.startswith(("meta-llama/Llama-3", "TML/", "thinkingmachines/"))


def test_hub_ids_and_aliases_name_the_same_model():
    for name, aliases in NAMES.items():
        for alias in [name, *aliases]:
            assert hub_id(alias) == name
            assert names_of(alias) == [name, *aliases]
    assert not set(ALIASES) & set(REGISTRY)  # an alias never shadows another model's hub id


def test_an_unknown_name_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ModelUnavailable, match="base_model: 'Qwen/Qwen3-8B' is not in the local Hugging Face cache "
                                               ".* registered models: 'loraplex/tiny', "):
        resolve_model("Qwen/Qwen3-8B")
    assert hub_id("/models/my-llama") == "/models/my-llama"  # a local folder keeps its path as its name
    assert names_of("/models/my-llama") == ["/models/my-llama"]


def test_the_cache_folder_is_the_short_name_so_earlier_caches_stay_valid(tiny_model_path):
    assert resolve_model("loraplex/tiny") == resolve_model("tiny") == tiny_model_path
    assert tiny_model_path.name == "tiny"


def test_model_info_names_the_served_model_by_its_hub_id(tiny_model_path):
    assert model_info("tiny").name == "loraplex/tiny"
    assert model_info(str(tiny_model_path)).name == str(tiny_model_path)  # served by path: named by path


def test_only_tokenizer_files_are_listed_with_their_sizes_and_hashes(tiny_model_path):
    manifest = tokenizer_manifest(tiny_model_path)
    assert [f.path for f in manifest.files] == ["config.json", "tokenizer.json", "tokenizer_config.json",
                                                "chat_template.jinja"]  # no weights, no generation_config.json
    for f in manifest.files:
        data = (tiny_model_path / f.path).read_bytes()
        assert (f.size, f.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert len(manifest.revision) == 40 and int(manifest.revision, 16) >= 0


def test_the_revision_follows_the_content(tiny_model_path, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_path, copy)
    assert tokenizer_manifest(copy).revision == tokenizer_manifest(tiny_model_path).revision
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text().replace("}", ' , "x": 1}'))
    assert tokenizer_manifest(copy).revision != tokenizer_manifest(tiny_model_path).revision
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        tokenizer_manifest(copy)


def test_the_server_publishes_its_tokenizer_to_its_own_hub_cache(tiny_model_path, tmp_path):
    snapshot = publish_tokenizer("loraplex/tiny", tiny_model_path, tmp_path)
    assert snapshot.name == tokenizer_manifest(tiny_model_path).revision
    blobs = {p: p.stat().st_mtime_ns for p in (tmp_path / "models--loraplex--tiny" / "blobs").iterdir()}
    assert publish_tokenizer("loraplex/tiny", tiny_model_path, tmp_path) == snapshot
    assert {p: p.stat().st_mtime_ns for p in blobs} == blobs  # the second time writes nothing
    loaded = AutoTokenizer.from_pretrained("loraplex/tiny", cache_dir=tmp_path, local_files_only=True)
    assert loaded.encode("What is 4 + 5?") == AutoTokenizer.from_pretrained(tiny_model_path).encode("What is 4 + 5?")
