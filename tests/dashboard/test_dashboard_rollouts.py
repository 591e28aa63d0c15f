"""The dashboard's RL views on a real embedded server with its vLLM sampler: sampler numbers (tokens,
throughput, entropy), RL groups from the rollout store, a trajectory's sampler and trainer logprobs
side by side, and policy staleness of trajectories turned into datums."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

import loraplex
from loraplex import types
from tests.servers import running_server

pytestmark = pytest.mark.vllm

PROMPT = [5, 17, 300, 42, 8, 9, 10, 11]
OTHER_PROMPT = [6, 18, 301, 43, 8, 9]
ENV = [12, 13, 14]  # what an environment answered between two turns
AGENT_PROMPT = [7, 19, 302, 44, 8, 9]  # a two-turn trajectory's first prompt (a group of its own, unrewarded)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """One RL round on `tiny`: a step of SFT, a snapshot (policy version 1), samples through the SDK and
    through the inference API (one call of n=3, and two one-choice trajectories of another prompt), rewards,
    datums of two trajectories trained with importance_sampling, an optim_step (step 2)."""
    with running_server(tmp_path_factory.mktemp("dashboard-rl")) as server:
        key = server.new_tenant("rl")
        with loraplex.ServiceClient(base_url=server.base_url, api_key=key) as service:
            training = service.create_lora_training_client("tiny", rank=4, seed=5)
            sft = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                              loss_fn_inputs={"target_tokens": np.array(PROMPT[1:], dtype=np.int64),
                                              "weights": np.ones(len(PROMPT) - 1, dtype=np.float32)})
            training.forward_backward([sft]).result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            path = training.save_weights_for_sampler("v1").result().path
            sampler = service.create_sampling_client(model_path=path)
            sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                           types.SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop=[])).result()
            oai = openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=key, max_retries=0)
            for session, prompt, n in (("group-a", PROMPT, 3), ("group-b1", OTHER_PROMPT, 1),
                                       ("group-b2", OTHER_PROMPT, 1)):
                oai.completions.create(model=path, prompt=prompt, n=n, max_tokens=6, temperature=1.0, seed=len(session),
                                       extra_headers={"X-Loraplex-Session": session})
            rollouts = loraplex.RolloutsClient(service)
            # a two-turn trajectory whose second prompt extends the first with the sampled tokens and an
            # environment's answer (ENV), as a token-in/token-out harness sends it
            oai.completions.create(model=path, prompt=AGENT_PROMPT, max_tokens=4, temperature=1.0, seed=3,
                                   extra_headers={"X-Loraplex-Session": "two-turns"})
            sampled = rollouts.get_trajectory("two-turns").turns[0].samples[0].tokens
            oai.completions.create(model=path, prompt=AGENT_PROMPT + sampled + ENV, max_tokens=4, temperature=1.0,
                                   seed=4, extra_headers={"X-Loraplex-Session": "two-turns"})
            for choice, reward in enumerate((1.0, 0.0, 1.0)):
                rollouts.set_reward("group-a", reward, turn=0, choice=choice)
            rollouts.set_reward("group-b1", 1.0)
            rollouts.set_reward("group-b2", 0.5)
            datums = [d for s in ("group-b1", "group-b2") for d in rollouts.datums(s, advantage=1.0).datums]
            # the two-turn trajectory's second turn trained alone, as a datum of its own prompt (as when a
            # harness renders the history anew): a later turn, a member of no group
            later = rollouts.get_trajectory("two-turns").turns[1]
            tokens = later.prompt_tokens + later.samples[0].tokens
            before = len(later.prompt_tokens) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": np.array(tokens[1:], dtype=np.int64),
                "logprobs": np.array([0.0] * before + later.samples[0].logprobs, dtype=np.float32),
                "advantages": np.array([0.0] * before + [0.5] * len(later.samples[0].tokens), dtype=np.float32)}))
            training.forward_backward(datums, "importance_sampling").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        with httpx.Client(base_url=f"{server.base_url}/dashboard/api", headers={"X-API-Key": key}, timeout=60) as http:
            yield http, training.model_id


def test_sampler_numbers_and_staleness(loop):
    http, run = loop
    series = http.get(f"/runs/{run}/metrics").json()["series"]
    tokens = dict(series["sample/tokens"]["points"])  # snapshot 1's samples feed step 2
    assert set(tokens) == {2} and tokens[2] >= 2 * 8 + 5  # the SDK's 2 x 8 tokens, and the API's (stop included)
    assert dict(series["sample/tokens_per_second"]["points"])[2] > 0
    assert dict(series["entropy"]["points"])[2] > 0  # -mean sampled logprob: positive unless every token is certain
    assert series["staleness"]["points"] == [[2, 0.0]]  # sampled by snapshot 1, trained by step 2: on-policy
    gap = dict(series["logprob_gap/mean_abs"]["points"])[2]
    assert gap < 0.05  # the same weights on both sides: vLLM's logprobs and the trainer's agree


def test_rl_groups(loop):
    http, run = loop
    [step] = http.get(f"/runs/{run}/rl_groups").json()["steps"]
    assert step["step"] == 2  # sampled from snapshot 1: the rollouts of step 2
    groups = sorted(step["groups"], key=lambda g: (g["size"], g["outcome"]))
    # PROMPT's group: the inference API's call of n=3 (rewarded) and the SDK's 2 samples of the same prompt
    # at the same step (unrewarded: they count in lengths, not in rewards)
    assert [(g["size"], g["outcome"]) for g in groups] == [(1, "unrewarded"), (2, "all_good"), (5, "mixed")]
    assert all(g["prompt_text"] for g in groups) and [g["prompt_tokens"] for g in groups] == [
        len(AGENT_PROMPT), len(OTHER_PROMPT), len(PROMPT)]
    assert [m["source"] for m in groups[2]["members"]] == ["rollouts"] * 3 + ["sample"] * 2
    assert groups[2]["reward"] == {"best": 1.0, "mean": 2 / 3, "worst": 0.0}
    groups = groups[1:]  # the rewarded ones
    assert groups[0]["reward"] == {"best": 1.0, "mean": 0.75, "worst": 0.5}
    # the trained trajectories' datums (advantage 1.0) land on the samples they were built from
    assert [m["advantage"] for m in groups[0]["members"]] == [1.0, 1.0]
    assert step["fractions"] == {"all_good": 0.5, "all_bad": 0.0, "mixed": 0.5, "uniform": 0.0}
    # max_tokens: 6 through the inference API, 8 through the SDK
    assert all(0 < m["output_tokens"] <= (8 if m["source"] == "sample" else 6) for g in groups for m in g["members"])
    assert http.get(f"/runs/{run}/rl_groups", params={"since": 2}).json()["steps"] == []
    assert "good_above" in http.get(f"/runs/{run}/rl_groups", params={"good_above": "inf"}).json()["detail"]


def test_trajectory_logprobs_side_by_side(loop):
    http, run = loop
    trained = http.get(f"/runs/{run}/trajectories/group-b1").json()
    [turn] = trained["turns"]
    [choice] = turn["choices"]
    assert turn["prompt_text"] and turn["new_input_text"] is None and turn["messages"] is None  # a completions call
    assert turn["policy_version"] == 1 and len(choice["token_texts"]) == len(choice["tokens"])
    np.testing.assert_allclose(choice["trainer_logprobs"], choice["sampler_logprobs"], atol=0.05)
    untrained = http.get(f"/runs/{run}/trajectories/group-a").json()["turns"][0]["choices"]
    assert len(untrained) == 3 and all(c["trainer_logprobs"] is None for c in untrained)
    assert http.get(f"/runs/{run}/trajectories/nobody").status_code == 404


def test_a_later_turn_shows_what_came_in_since_the_turn_before(loop, tiny_model_path):
    from transformers import AutoTokenizer

    http, run = loop
    first, second = http.get(f"/runs/{run}/trajectories/two-turns").json()["turns"]
    assert first["new_input_text"] is None
    assert second["new_input_text"] == AutoTokenizer.from_pretrained(tiny_model_path).decode(ENV)
    assert second["prompt_tokens"] == len(AGENT_PROMPT) + len(first["choices"][0]["tokens"]) + len(ENV)
