"""Every example runs for a couple of steps on `tiny` against a real embedded server (with its
vLLM sampler), so they never rot."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

import loraplex
from examples import agent_rl, driver, rl_arithmetic, sft
from tests.servers import running_server

pytestmark = pytest.mark.vllm  # the examples sample through the server's vLLM sampler


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("examples")) as server:
        yield server, loraplex.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())


def test_sft_runs_logs_and_plots(service, tmp_path):
    summary = sft.run(service[1], "tiny", steps=2, batch_size=4, eval_every=1, results=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("held_out_loss" in r for r in rows)
    assert summary["held_out_loss_end"] == rows[-1]["held_out_loss"]
    assert (tmp_path / "sft.png").stat().st_size > 0
    # the same numbers reach the service's dashboard (log_metrics), on the run's step axis
    charted = httpx.get(f"{service[0].base_url}/dashboard/api/runs/{summary['run_id']}/metrics",
                        headers={"X-API-Key": service[1].config.api_key}).json()["series"]
    assert [step for step, _ in charted["held_out_loss"]["points"]] == [0, 1, 2]
    assert charted["held_out_loss"]["source"] == "client" and len(charted["train_loss"]["points"]) == 2


def test_the_verifier_reads_the_last_number():
    class Words:  # a tokenizer whose token ids are the characters
        def decode(self, tokens, skip_special_tokens=True):
            return "".join(map(chr, tokens))

    problem = rl_arithmetic.Problem(3, 4)
    assert rl_arithmetic.reward(Words(), list(map(ord, "3 + 4 = 7")), problem) == 1.0
    assert rl_arithmetic.reward(Words(), list(map(ord, "The answer is 12.")), problem) == 0.0
    assert rl_arithmetic.reward(Words(), list(map(ord, "seven")), problem) == 0.0


@pytest.mark.parametrize("async_mode", [False, True])
def test_rl_runs_with_bounded_staleness(service, tmp_path, async_mode, monkeypatch):
    # `tiny` never adds correctly: score by the first sampled token's parity instead, so that
    # groups disagree and every part of the step (datums, loss, update, new snapshot) runs
    monkeypatch.setattr(rl_arithmetic, "reward", lambda tokenizer, tokens, problem: float(tokens[0] % 2))
    summary = rl_arithmetic.run(service[1], "tiny", steps=3, prompts_per_step=2, group_size=4, max_tokens=4,
                                held_out=4, eval_every=3, async_mode=async_mode, results=tmp_path, temperature=1.5)
    rows = [json.loads(line) for line in (tmp_path / "rl.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["datums"] > 0 and r["logprob_gap"] is not None for r in rows[1:])
    assert max(r["staleness"] for r in rows[1:]) == (1 if async_mode else 0)
    if not async_mode:  # trained on the snapshot's own samples: sampler and trainer agree closely
        assert max(r["logprob_gap"] for r in rows[1:]) < 1e-3
    assert 0 <= summary["held_out_accuracy_end"] <= 1 and (tmp_path / "rl.png").stat().st_size > 0
    if not async_mode:  # every sample request is seeded from the run's seed: a second run repeats it
        rl_arithmetic.run(service[1], "tiny", steps=3, prompts_per_step=2, group_size=4, max_tokens=4, held_out=4,
                          eval_every=3, results=tmp_path, temperature=1.5, name="again")
        again = [json.loads(line) for line in (tmp_path / "again.jsonl").read_text().splitlines()]
        same = ("reward", "datums", "held_out_accuracy")
        assert [{k: r.get(k) for k in same} for r in again] == [{k: r.get(k) for k in same} for r in rows]
        # the entropy comes from the sampler's logprobs, which vLLM computes in batches of whichever requests
        # arrive together: equal to float32 rounding, not to the bit (a CI run's differed by 2e-9 relative)
        assert [r["entropy"] for r in again[1:]] == pytest.approx([r["entropy"] for r in rows[1:]], rel=1e-6)


def test_the_driver_runs_tenants_at_once_then_one_by_one(service, tmp_path):
    server = service[0]
    settings = {"sft": {"steps": 1, "batch_size": 2, "eval_every": 1},
                "rl": {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_tokens": 3, "held_out": 2}}
    report = driver.compare(server.base_url, lambda name: server.new_tenant(name), "tiny", ["sft", "rl"], settings,
                            results=tmp_path)
    for mode in ("concurrent", "serial"):
        assert [run["name"] for run in report[mode]["runs"]] == [f"sft-0-{mode}", f"rl-1-{mode}"]
        assert all((tmp_path / f"{run['name']}.png").is_file() for run in report[mode]["runs"])
        assert report[mode]["trainer_busy_seconds"] > 0 and report[mode]["sampler_generated_tokens"] > 0
    assert report["serial_over_concurrent"] > 0
    assert "serial / concurrent" in driver.markdown(report, "command")


def test_the_agents_calculator_is_arithmetic_only():
    assert agent_rl.calculate("3 * (4 + 2) - 1") == 17 and agent_rl.calculate("7 / 2") == 3.5
    for bad in ("__import__('os')", "2 ** 99", "1 / 0", "3 +"):
        with pytest.raises(ValueError):
            agent_rl.calculate(bad)
    assert agent_rl.CALL.search("sure. CALC: 12 * 3\n")[1].strip() == "12 * 3"
    problem = agent_rl.Problem("?", 36)
    assert agent_rl.score(problem, agent_rl.Episode("ANSWER: 36", 36.0, (36.0,), 2), 0.5) == 1.5
    assert agent_rl.score(problem, agent_rl.Episode("ANSWER: 36", 36.0, (), 1), 0.5) == 1.0
    assert agent_rl.score(problem, agent_rl.Episode("ANSWER: 7", 7.0, (7.0,), 2), 0.5) == 0.0  # a call alone: nothing
    assert agent_rl.score(problem, agent_rl.Episode("no idea", None, (), 1), 0.5) == 0.0


def test_agent_rl_trains_from_the_rollout_store_through_the_policy_alias(service, tmp_path, monkeypatch):
    # `tiny` never solves a word problem nor calls the calculator: alternate the rewards instead, so that every
    # group of three disagrees and every part of the step runs
    rewards = itertools.cycle((0.0, 1.0))
    monkeypatch.setattr(agent_rl, "score", lambda problem, episode, bonus: next(rewards))
    summary = agent_rl.run(service[1], "tiny", steps=2, prompts_per_step=2, group_size=3, max_turns=2, max_tokens=6,
                           held_out=3, eval_every=2, results=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "agent_rl.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "held_out_success" in rows[0] and "held_out_success" in rows[2]
    assert sum(r["datums"] for r in rows[1:]) > 0 and rows[-1]["policy_version"] >= 1
    assert all(r["stale_turns"] == 0 for r in rows[1:])  # every call answered by the alias's newest weights
    assert summary["policy_alias"].endswith("/sampler_weights/@latest") and (tmp_path / "agent_rl.png").is_file()
    assert summary["protocol"] == "text"  # `tiny`'s chat template renders no tools: the server said so with a 400
    store = loraplex.RolloutsClient(service[1])
    recorded = [t for t in store.list_trajectories(limit=100) if t.session_id.endswith("-s2-0")]
    assert len(recorded) == 1 and recorded[0].reward is not None  # rewarded in the store; eval episodes deleted
