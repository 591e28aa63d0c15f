"""The vLLM sampler checks a snapshot before loading it: a finite change to lora_B bytes, which
without the check changes the greedy tokens silently, fails the sample naming the file; a NaN
snapshot's error says whether the training run diverged or the file is corrupt."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from loraplex.types import AdamParams
from safetensors.torch import load_file

from contract.configs import LoraConfig
from contract.errors import EngineError
from contract.inputs import EngineDatum, ForwardBackwardInput
from contract.sampling import SampleResult
from tests.workers.sampler.test_sampler_vllm import job, run, start_engine
from tests.workers.sampler.test_snapshot_integrity import WEIGHTS, rewrite_tensor
from workers.compute_thread import ComputeThread
from workers.trainer.engine import TrainerEngine

pytestmark = pytest.mark.vllm  # a vLLM sampler engine per module


@pytest.fixture(scope="module")
def trainer(tiny_model_path) -> TrainerEngine:
    trainer = TrainerEngine(tiny_model_path, max_rank=16)
    trainer.create_adapter("t", LoraConfig(rank=8, seed=1))
    tokens = list(range(10, 40))
    datum = EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(6):
        trainer.forward_backward([ForwardBackwardInput("t", [datum])])
        trainer.optim_step([("t", AdamParams(learning_rate=2e-2))])
    return trainer


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    compute = ComputeThread()
    engine = start_engine(tiny_model_path, compute)
    yield engine
    engine.close()
    compute.close()


def test_a_finite_corruption_of_lora_b_fails_the_sample_naming_the_file(engine, trainer, tmp_path):
    intact = Path(trainer.save_sampler_weights("t", tmp_path / "intact"))
    corrupted = tmp_path / "corrupted"
    shutil.copytree(intact, corrupted)
    lm_head_b = next(name for name in load_file(intact / WEIGHTS) if "lm_head.lora_B" in name)
    rewrite_tensor(corrupted / WEIGHTS, lm_head_b, lambda v: v * -4 + 0.5)  # finite: the NaN check passes it
    unchecked = tmp_path / "unchecked"  # the same bytes without a manifest, as saved before snapshots had one
    shutil.copytree(corrupted, unchecked)
    (unchecked / "manifest.json").unlink()

    results = run(engine, [job("intact", str(intact)), job("corrupted", str(corrupted)),
                           job("unchecked", str(unchecked))])
    assert isinstance(results["intact"], SampleResult) and isinstance(results["unchecked"], SampleResult)
    # what the check prevents: the corruption silently changes what is sampled
    assert results["unchecked"].sequences[0].tokens != results["intact"].sequences[0].tokens
    refused = results["corrupted"]
    assert isinstance(refused, EngineError) and refused.category == "server"
    assert f"the sampler snapshot's file {WEIGHTS} failed its SHA-256 check" in str(refused)
    assert str(tmp_path) not in str(refused)


def test_a_nan_snapshot_says_whether_training_diverged_or_the_file_is_corrupt(engine, trainer, tmp_path):
    adapter = trainer.adapter("t")
    kept = adapter.flat_weights.clone()
    try:
        adapter.flat_weights[0] = float("inf")  # diverged, and saved so: the manifest matches
        diverged = Path(trainer.save_sampler_weights("t", tmp_path / "diverged"))
    finally:
        adapter.flat_weights.copy_(kept)
    corrupt = Path(trainer.save_sampler_weights("t", tmp_path / "corrupt"))
    lora_b = next(name for name in load_file(corrupt / WEIGHTS) if "lora_B" in name)
    rewrite_tensor(corrupt / WEIGHTS, lora_b, lambda v: v.fill_(float("nan")))

    results = run(engine, [job("diverged", str(diverged)), job("corrupt", str(corrupt)), job("base", None)])
    assert isinstance(results["base"], SampleResult)
    assert results["diverged"].category == "user"
    assert f"of the snapshot's file {WEIGHTS} holds NaN or inf" in str(results["diverged"])
    assert "the training run diverged" in str(results["diverged"])
    assert results["corrupt"].category == "server"
    assert "the file is corrupt" in str(results["corrupt"])
    assert f"NaN or inf in tensor {lora_b}" in str(results["corrupt"])
