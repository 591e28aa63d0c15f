"""A base model named by its hub id: found in the local Hugging Face cache, or a folder advertised
under the hub id given with it; an architecture the trainer is not proven on is refused at start.

The caches here are written in huggingface_hub's own layout (loraplex.hf_cache, the code behind
`loraplex tokenizer pull`), and huggingface_hub's snapshot_download reads them back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import constants
from loraplex.hf_cache import write_snapshot
from transformers import AutoTokenizer, GPT2Config, Qwen2MoeConfig

from models.registry import REGISTRY, SUPPORTED_ARCHITECTURES, ModelUnavailable, model_info, resolve_model
from models.tokenizer_files import tokenizer_manifest
from service.embedded import free_port
from tests.distributed.processes import ROOT, start_service, wait_healthy
from tests.reliability.processes import stop, tenant_key

HUB_ID = "acme/tiny-llama"
REVISION = "a" * 40


def cache_model(hub_cache: Path, folder: Path, hub_id: str = HUB_ID, only=None) -> Path:
    """`folder`'s files (or those named in `only`) as the refs/main snapshot of `hub_id` in `hub_cache`."""
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and (only is None or p.name in only)}
    return write_snapshot(hub_id, REVISION, files, hub_cache)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache of this test's own, where huggingface_hub (and publish_tokenizer) look."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_in_the_local_cache_is_served_by_that_id(hub_cache, tiny_model_path):
    snapshot = cache_model(hub_cache, tiny_model_path)
    info = model_info(HUB_ID)
    assert (info.name, info.path, info.arch) == (HUB_ID, snapshot, "llama")
    assert tokenizer_manifest(info.path).revision == tokenizer_manifest(tiny_model_path).revision


def test_a_tokenizer_alone_in_the_cache_is_not_a_model(hub_cache, tiny_model_path):
    cache_model(hub_cache, tiny_model_path, only={"tokenizer.json", "tokenizer_config.json", "config.json"})
    with pytest.raises(ModelUnavailable, match="has no config.json or no weights .*`hf download acme/tiny-llama`"):
        resolve_model(HUB_ID)


def test_a_hub_id_nowhere_is_refused_saying_where_it_looked_and_what_to_do(hub_cache):
    assert constants.HF_HUB_OFFLINE  # tests never reach a hub
    with pytest.raises(ModelUnavailable) as refused:
        model_info("acme/not-here")
    message = str(refused.value)
    assert "'acme/not-here' is not in the local Hugging Face cache" in message and str(hub_cache) in message
    assert "hf download acme/not-here" in message and "--model-name acme/not-here" in message
    assert all(repr(name) in message for name in REGISTRY)
    with pytest.raises(ModelUnavailable, match="neither a registered model .* nor a Hugging Face hub id"):
        model_info("not a hub id!")


def test_a_folder_is_advertised_under_the_hub_id_given_with_it(hub_cache, tiny_model_path):
    info = model_info(str(tiny_model_path), served_name="acme/q3")
    assert (info.name, info.path) == ("acme/q3", tiny_model_path)
    # a notebook on this machine loads its tokenizer by that id, offline
    loaded = AutoTokenizer.from_pretrained("acme/q3", cache_dir=hub_cache, local_files_only=True)
    assert loaded.encode("What is 4 + 5?") == AutoTokenizer.from_pretrained(tiny_model_path).encode("What is 4 + 5?")
    assert model_info(str(tiny_model_path)).name == str(tiny_model_path)  # unnamed: its path, as before
    with pytest.raises(ModelUnavailable, match="model_name: 'acme/q3' names a folder's model"):
        model_info("tiny", served_name="acme/q3")


def test_a_named_folder_never_overwrites_a_real_download_of_that_id(hub_cache, tiny_model_path, tmp_path):
    real = cache_model(hub_cache, tiny_model_path, hub_id="acme/real")
    refs = hub_cache / "models--acme--real" / "refs" / "main"
    model_info(str(tiny_model_path), served_name="acme/real")
    assert refs.read_text() == real.name  # still the real snapshot


@pytest.mark.parametrize("config, architecture", [
    (GPT2Config(architectures=["GPT2LMHeadModel"]), "'gpt2' model (GPT2LMHeadModel)"),
    # a mixture of experts with a shared expert beside the routed ones: not one of the MoE families served
    (Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], hidden_size=64, num_attention_heads=2),
     "'qwen2_moe' model (Qwen2MoeForCausalLM)"),
])
def test_an_architecture_not_proven_is_refused_naming_it_and_the_supported_ones(tmp_path, config, architecture):
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    with pytest.raises(ModelUnavailable) as refused:
        model_info(str(folder))
    assert f"is a {architecture}; Loraplex trains {', '.join(SUPPORTED_ARCHITECTURES)} models" in str(refused.value)


def test_a_model_that_clips_q_k_v_is_refused_by_name(tmp_path):
    """OLMoE's optional clip_qkv clamps the projections' outputs in place, which the trainer's grouped q/k/v
    LoRA cannot take (autograd refuses it mid-request); the tiny OLMoE, like the released ones, has none."""
    from transformers import OlmoeConfig

    assert model_info("loraplex/tiny-olmoe").arch == "olmoe"  # served
    OlmoeConfig(architectures=["OlmoeForCausalLM"], hidden_size=64, num_attention_heads=2,
                clip_qkv=8.0).save_pretrained(tmp_path)
    with pytest.raises(ModelUnavailable, match=r"clips its queries, keys and values \(clip_qkv=8.0\)"):
        model_info(str(tmp_path))


def test_a_moe_model_with_dense_mlp_layers_is_refused_by_name(tmp_path):
    """Its dense layers' gate_proj/up_proj beside fused experts would not load right from the PEFT export."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_attention_heads=2,
                   mlp_only_layers=[0]).save_pretrained(tmp_path)
    with pytest.raises(ModelUnavailable, match="mixes dense MLP layers .* with sparse ones"):
        model_info(str(tmp_path))


@pytest.mark.slow  # two server starts in processes of their own
def test_the_newcomer_command_serves_a_cached_hub_model_by_its_id(tmp_path, tiny_model_path):
    """`python -m service serve --base-model ORG/NAME` with the model in the Hugging Face cache: the
    official SDK sees it by that id (capabilities, get_info, its tokenizer) and trains it."""
    hub = tmp_path / "hub"
    cache_model(hub, tiny_model_path)
    # A user's shell: none of the suite's own HF_/LORAPLEX_/TINKER_ settings leak into either process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LORAPLEX_", "TINKER_", "TRANSFORMERS_"))}
    env |= {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "LORAPLEX_SAMPLER_ENABLED": "false"}
    port, data_dir = free_port(), tmp_path / "data"
    process = start_service("serve", env, "--base-model", HUB_ID, "--port", str(port), "--data-dir", str(data_dir))
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", seconds=300)
        notebook = textwrap.dedent(f"""
            import tinker
            service = tinker.ServiceClient(base_url="http://127.0.0.1:{port}", api_key={tenant_key(data_dir, 'ada')!r})
            names = [m.model_name for m in service.get_server_capabilities().supported_models]
            training = service.create_lora_training_client(base_model={HUB_ID!r}, rank=4)
            tokens = training.get_tokenizer().encode("What is 4 + 5?")
            datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                                 loss_fn_inputs={{"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}})
            loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
            print(names, training.get_info().model_data.model_name, loss > 0)
        """)
        done = subprocess.run([sys.executable, "-c", notebook], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split("\n")[-2] == f"['{HUB_ID}'] {HUB_ID} True"
    finally:
        stop(process)
    refused = subprocess.run([sys.executable, "-m", "service", "serve", "--base-model", "acme/not-here", "--port",
                              str(free_port()), "--data-dir", str(tmp_path / "other")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "error: base_model: 'acme/not-here' is not in the local Hugging Face cache" in refused.stderr
