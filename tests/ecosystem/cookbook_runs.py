"""Running tinker-cookbook's recipes as a user does, and reading what they logged: the helpers of
tests/ecosystem/test_cookbook*.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
import tinker
import tinker_cookbook

from db.models import Tenant

COOKBOOK = Path(tinker_cookbook.__file__).parent
CONVERSATIONS = COOKBOOK / "example_data" / "conversations.jsonl"  # 128 chats the cookbook ships
# ChatML without a thinking block: the chat template of loraplex/tiny and of SmolLM2-Instruct.
RENDERER = "qwen3_instruct"


def tenant(server) -> tuple[str, str]:
    """A new tenant's (API key, id)."""
    name = f"cookbook-{os.urandom(4).hex()}"
    key = server.new_tenant(name)
    with server.embedded.sessions() as s:
        return key, s.scalar(sa.select(Tenant.id).where(Tenant.name == name))


def run_recipe(recipe: str, base_url: str, api_key: str, log_path: Path, timeout: float, **args) -> list[dict]:
    """Run `python -m tinker_cookbook.recipes.<recipe>.train` with these key=value arguments; its metrics.jsonl rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")} | {"TINKER_API_KEY": api_key,
                                                                                 "HF_HUB_OFFLINE": "1"}
    argv = [f"{k}={v}" for k, v in ({"base_url": base_url, "log_path": log_path,
                                     "behavior_if_log_dir_exists": "raise"} | args).items()]
    done = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{recipe}.train", *argv], env=env,
                          cwd=log_path.parent, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert "Training completed successfully" in done.stdout + done.stderr
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def steps(rows: list[dict], key: str) -> list[float]:
    """The metric `key` of each training step, in step order (the last row of a run holds only totals)."""
    logged = [(row["step"], row[key]) for row in rows if key in row]
    assert [step for step, _ in logged] == list(range(len(logged)))
    return [value for _, value in logged]


def final_state(log_path: Path) -> str:
    (final,) = [c for c in map(json.loads, (log_path / "checkpoints.jsonl").read_text().splitlines())
                if c["name"] == "final"]
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].startswith("tinker://")
    return final["state_path"]


def first_batch_nll(base_url: str, api_key: str, model: str, state_path: str | None, batch_size: int) -> float:
    """The mean NLL (the recipe's own `train_mean_nll`) of the recipe's first batch under the base model
    (state_path None: a fresh adapter, whose B is zero) or under a saved training state. The batch is
    built by the recipe's own dataset code, as the run built it (epoch 0's shuffle, batch 0)."""
    from tinker_cookbook.recipes.chat_sl.train import get_dataset_builder
    from tinker_cookbook.supervised.common import compute_mean_nll

    train_set, _ = get_dataset_builder(str(CONVERSATIONS), model, RENDERER, 16384, batch_size)()
    train_set.set_epoch(seed=0)
    batch = train_set.get_batch(0)
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    training = (service.create_lora_training_client(base_model=model, rank=8) if state_path is None
                else service.create_training_client_from_state(state_path)).result()
    out = training.forward(batch, "cross_entropy").result()
    return compute_mean_nll([o["logprobs"] for o in out.loss_fn_outputs],
                            [d.loss_fn_inputs["weights"] for d in batch])


def check_chat_sl(server, model: str, tmp_path: Path, max_steps: int, learning_rate: float,
                  timeout: float) -> tuple[list[float], float, float]:
    api_key, _ = tenant(server)
    log_path = tmp_path / "chat_sl"
    rows = run_recipe("chat_sl", server.base_url, api_key, log_path, timeout, model_name=model,
                      renderer_name=RENDERER, dataset=CONVERSATIONS, batch_size=8, lora_rank=8,
                      learning_rate=learning_rate, max_steps=max_steps)
    nll = steps(rows, "train_mean_nll")
    assert len(nll) == max_steps and all(math.isfinite(x) and x > 0 for x in nll)
    assert all(math.isfinite(g) for g in steps(rows, "grad_norm:mean"))
    # The same batch before and after training, by the recipe's own batching: the step-0 figure is
    # reproduced on the base model (so it is that batch), and the trained weights do better on it.
    base = first_batch_nll(server.base_url, api_key, model, None, 8)
    assert base == pytest.approx(nll[0], rel=1e-3)
    trained = first_batch_nll(server.base_url, api_key, model, final_state(log_path), 8)
    print(f"{model}: train_mean_nll by step {[round(x, 3) for x in nll]}; first batch {base:.3f} -> {trained:.3f}")
    return nll, base, trained
