"""tinker-cookbook 0.6.1's own recipes, run unchanged against an embedded Loraplex server, offline.

Each recipe runs through its own entry point (`python -m tinker_cookbook.recipes.<recipe>.train
key=value ...`) in a subprocess, as a user runs it: the server is named by the recipe's `base_url`
field, the key by TINKER_API_KEY; HF_HUB_OFFLINE=1 (tests/conftest.py), so the recipe's tokenizer
comes from the Hugging Face cache the server filled with its own at start. Only command-line
values differ from a user's run: the model, a renderer for its chat template (the cookbook knows
no renderer for models outside its own list), small batches and few steps. What the recipes log
(metrics.jsonl, checkpoints.jsonl in log_path) is checked, and so is what the server recorded.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from db.models import RecordedSequence, Request, RequestState
from loraplex.wire.codec import decode_forward_backward_request
from tests.ecosystem.cookbook_runs import RENDERER, check_chat_sl, final_state, run_recipe, steps, tenant
from tests.servers import running_server

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex")) as running:
        yield running


def test_chat_sl_trains_loraplex_tiny_on_the_cookbook_conversations(server, tmp_path):
    # 15-25 s with the server's start: 10 steps of 8 chats (~500 tokens a batch). Measured: train_mean_nll
    # 6.305 at step 0 and 4.98-5.12 at step 9 (6 runs); the first batch 6.305 -> 4.86-4.92 (5 runs)
    nll, base, trained = check_chat_sl(server, "loraplex/tiny", tmp_path, max_steps=10, learning_rate=5e-3,
                                       timeout=300)
    assert nll[-1] < nll[0] - 0.5
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 0.5
    assert trained < base - 0.5


@pytest.mark.slow  # 40-85 s on 2 cores: 8 steps of 16 groups x 8 samples, sampled by vLLM
def test_math_rl_arithmetic_with_its_default_loss(server, tmp_path):
    """math_rl's arithmetic env with the recipe's default loss, stable_reinforce. loraplex/tiny is a
    random model: it never answers a sum right, but it can learn the format reward (end the answer
    with <|im_end|> within max_tokens), which it first hits ~3% of the time. When it takes off varies
    (the recipe does not seed its samples): of nine 6-step runs, seven had format 0.742-1.0 at step 5,
    and two started late, 0.602 and 0.227 (still at 0.055 at step 4). Eight steps leave room for a
    late start. The reward is 0.1 * (format - 1) while no sum is right."""
    api_key, tenant_id = tenant(server)
    log_path = tmp_path / "math_rl"
    max_steps, groups, group_size = 8, 16, 8
    rows = run_recipe("math_rl", server.base_url, api_key, log_path, 600, model_name="loraplex/tiny",
                      renderer_name=RENDERER, env="arithmetic", groups_per_batch=groups, group_size=group_size,
                      max_tokens=16, lora_rank=8, learning_rate=1e-2, max_steps=max_steps)
    config = json.loads((log_path / "config.json").read_text())
    assert config["loss_fn"] == "stable_reinforce"  # the recipe's default: nothing on the command line names it

    fmt, reward = steps(rows, "env/all/format"), steps(rows, "env/all/reward/total")
    print(f"format by step {[round(x, 3) for x in fmt]}; reward {[round(x, 3) for x in reward]}")
    assert len(fmt) == max_steps
    assert steps(rows, "env/all/total_episodes") == [groups * group_size] * max_steps
    for key in ("grad_norm:mean", "optim/entropy", "optim/kl_sample_train_v1", "optim/kl_sample_train_v2"):
        assert all(math.isfinite(x) for x in steps(rows, key)), key
    # the trainer's logprobs of the sampled tokens agree with the sampler's (vLLM) at every step
    assert all(abs(x) < 1e-3 for x in steps(rows, "optim/kl_sample_train_v1"))  # measured: at most 5e-8
    assert fmt[0] < 0.15 and fmt[-1] > 0.4 and fmt[-1] > fmt[0] + 0.3
    assert reward[-1] > reward[0] + 0.03
    assert steps(rows, "optim/entropy")[-1] < steps(rows, "optim/entropy")[0]
    final_state(log_path)

    # The server's side: every training step was one stable_reinforce forward_backward that succeeded,
    # over sequences its sampler recorded (the loss's provenance was resolved against them).
    with server.embedded.sessions() as s:
        requests = s.scalars(sa.select(Request).where(Request.tenant_id == tenant_id,
                                                      Request.kind == "forward_backward")).all()
        recorded = s.scalar(sa.select(sa.func.count()).select_from(RecordedSequence)
                            .where(RecordedSequence.tenant_id == tenant_id))
    assert len(requests) == max_steps
    assert {r.state for r in requests} == {RequestState.DONE}
    losses = [decode_forward_backward_request(r.payload, None).loss_fn for r in requests]
    assert losses == ["stable_reinforce"] * max_steps
    assert recorded == max_steps * groups * group_size

    # `loraplex metrics follow` puts the recipe's own metrics on its run's dashboard, each iteration at the
    # optimizer step it fed (iteration i: step i + 1), no change to the recipe
    run_id = final_state(log_path).removeprefix("tinker://").split("/", 1)[0]
    followed = subprocess.run([str(Path(sys.executable).parent / "loraplex"), "metrics", "follow", str(log_path),
                               "--once", "--base-url", server.base_url, "--api-key", api_key],
                              capture_output=True, text=True, timeout=120)
    assert followed.returncode == 0, followed.stderr
    assert f"sent to run {run_id}" in followed.stdout
    series = httpx.get(f"{server.base_url}/dashboard/api/runs/{run_id}/metrics", headers={"X-API-Key": api_key}).json()
    charted = dict(series["series"]["env/all/format"]["points"])
    assert charted == {step + 1: pytest.approx(value) for step, value in enumerate(fmt)}
    assert series["series"]["env/all/format"]["source"] == "client"
