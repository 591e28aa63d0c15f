"""RL groups of a run driven by the official `tinker` SDK, which knows nothing of the rollout store, on a
real embedded server with its vLLM sampler: the server infers them from the run's sample requests
(num_samples > 1) and the advantages of the datums it trained on (db/inferred_groups.py)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
import tinker
from tinker import types

from db.inferred_groups import ADVANTAGE_DATUMS, SAMPLES
from db.models import ServiceMetric
from tests.servers import running_server

pytestmark = pytest.mark.vllm

MIXED_PROMPT = [5, 17, 300, 42, 8, 9, 10, 11]  # 4 samples, rewards 1, 0, 1, 0: advantages +-0.5
UNIFORM_PROMPT = [6, 18, 301, 43, 8, 9]  # 3 samples, one reward for all: advantages 0
SINGLE_PROMPT = [7, 19, 302, 44]  # one sample, not trained on: no group
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)


def datum(prompt: list[int], sequence, advantage: float) -> types.Datum:
    """An importance_sampling datum as tinker-cookbook builds one from a sampled sequence."""
    tokens = prompt + list(sequence.tokens)
    before = len(prompt) - 1  # targets that are prompt tokens
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "logprobs": np.array([0.0] * before + list(sequence.logprobs), dtype=np.float32),
        "advantages": np.array([0.0] * before + [advantage] * len(sequence.tokens), dtype=np.float32)})


@pytest.fixture(scope="module")
def sdk_run(tmp_path_factory):
    """One RL step through the tinker SDK: a snapshot (policy version 0), three sample requests, rewards
    scored client-side and never sent, one importance_sampling forward_backward, an optim_step (step 1)."""
    with running_server(tmp_path_factory.mktemp("dashboard-sdk")) as server:
        key, other_key = server.new_tenant("sdk-rl"), server.new_tenant("sdk-other")
        service = tinker.ServiceClient(base_url=server.base_url, api_key=key)
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        mixed = sampler.sample(types.ModelInput.from_ints(MIXED_PROMPT), 4, PARAMS).result().sequences
        uniform = sampler.sample(types.ModelInput.from_ints(UNIFORM_PROMPT), 3, PARAMS).result().sequences
        sampler.sample(types.ModelInput.from_ints(SINGLE_PROMPT), 1, PARAMS).result()
        advantages = [0.5, -0.5, 0.5, -0.5]
        data = [datum(MIXED_PROMPT, seq, a) for seq, a in zip(mixed, advantages)]
        data += [datum(UNIFORM_PROMPT, seq, 0.0) for seq in uniform]
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        with httpx.Client(base_url=f"{server.base_url}/dashboard/api", timeout=60) as http:
            yield http, training.model_id, key, other_key, [len(s.tokens) for s in mixed], advantages, server


def test_groups_of_an_sdk_run_come_from_its_samples_and_the_advantages_it_trained_on(sdk_run, tiny_model_path):
    from transformers import AutoTokenizer

    http, run, key, _, mixed_lengths, advantages, _ = sdk_run
    answer = http.get(f"/runs/{run}/rl_groups", headers={"X-API-Key": key})
    assert answer.status_code == 200, answer.text
    [step] = answer.json()["steps"]
    assert step["step"] == 1  # sampled by policy version 0, trained by the first optim_step
    assert step["reward"] is None  # the SDK sends no rewards, and none are made up
    assert step["fractions"] == {"all_good": 0.0, "all_bad": 0.0, "mixed": 0.5, "uniform": 0.5}
    groups = {g["prompt_tokens"]: g for g in step["groups"]}
    assert set(groups) == {len(MIXED_PROMPT), len(UNIFORM_PROMPT)}  # the one-sample request is no group
    mixed, uniform = groups[len(MIXED_PROMPT)], groups[len(UNIFORM_PROMPT)]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert mixed["prompt_text"] == tokenizer.decode(MIXED_PROMPT)
    # each datum's advantage on the sample it was built from: 4 members, not 4 samples and 4 datums
    assert (mixed["size"], mixed["outcome"], mixed["reward"]) == (4, "mixed", None)
    assert [(m["source"], m["choice"], m["advantage"], m["output_tokens"]) for m in mixed["members"]] == [
        ("sample", i, a, n) for i, (a, n) in enumerate(zip(advantages, mixed_lengths))]
    assert mixed["advantage"] == {"best": 0.5, "mean": 0.0, "worst": -0.5}
    assert (uniform["size"], uniform["outcome"]) == (3, "uniform")
    assert [m["advantage"] for m in uniform["members"]] == [0.0, 0.0, 0.0]


def test_sdk_groups_follow_since_and_stay_the_tenants_own(sdk_run):
    http, run, key, other_key, _, _, _ = sdk_run
    assert http.get(f"/runs/{run}/rl_groups", params={"since": 0}, headers={"X-API-Key": key}).json()["steps"]
    assert http.get(f"/runs/{run}/rl_groups", params={"since": 1}, headers={"X-API-Key": key}).json()["steps"] == []
    refused = http.get(f"/runs/{run}/rl_groups", headers={"X-API-Key": other_key})
    assert refused.status_code == 404 and "run_id" in refused.json()["detail"]


def test_rows_stored_before_the_counts_existed_give_the_same_groups(sdk_run):
    """Rows without the sample count or the trainer's count of datums with advantages (stored by an older
    version) are read by their bodies."""
    http, run, key, _, _, _, server = sdk_run
    before = http.get(f"/runs/{run}/rl_groups", headers={"X-API-Key": key}).json()
    with server.embedded.sessions() as s:
        rows = s.scalars(sa.select(ServiceMetric).where(ServiceMetric.run_id == run)).all()
        counted = {source: sorted(row.numbers[key] for row in rows if row.source == source)
                   for source, key in (("sample", SAMPLES), ("forward_backward", ADVANTAGE_DATUMS))}
        for row in rows:
            row.numbers = {k: v for k, v in row.numbers.items() if k not in (SAMPLES, ADVANTAGE_DATUMS)}
        s.commit()
    assert counted == {"sample": [1, 3, 4], "forward_backward": [7]}
    assert http.get(f"/runs/{run}/rl_groups", headers={"X-API-Key": key}).json() == before
