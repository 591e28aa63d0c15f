"""The dashboard's JSON API (docs/dashboard.md) on a real embedded server (tiny model, no sampler):
login and its cookie, who sees what, a short training run's series with one point per optim_step,
client metrics through the loraplex SDK, failed requests with their error, usage, the operator view."""

from __future__ import annotations

import math

import httpx
import loraplex
import numpy as np
import pytest
from loraplex import types

from db.operator_keys import issue_operator_key, revoke_operator_key
from tests.servers import running_server

pytestmark = pytest.mark.slow  # one server for the module, a few seconds of training

STEPS = 3
TOKENS = list(range(10, 30))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("dashboard"), sampler_enabled=False) as running:
        yield running


@pytest.fixture(scope="module")
def operator_key(server) -> str:
    with server.embedded.sessions() as s:
        return issue_operator_key(s)


def datum(tokens=TOKENS):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


def rl_datum(group_prompt, tail, sampler_logprob=-3.0):
    """An importance_sampling datum: the sampler's logprobs and advantages on the tail's positions."""
    tokens = group_prompt + tail
    n = len(tokens) - 1
    prompt = len(group_prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "logprobs": np.array([0.0] * prompt + [sampler_logprob] * (n - prompt), dtype=np.float32),
        "advantages": np.array([0.0] * prompt + [1.0] * (n - prompt), dtype=np.float32)})


@pytest.fixture(scope="module")
def trained(server):
    """Tenant A: a run of STEPS rounds (an SFT forward_backward and an RL one sharing a 12-token prompt, then
    an optim_step), client metrics at each step, one refused request; tenant B: a run of its own."""
    key_a, key_b = server.new_tenant("dash-a"), server.new_tenant("dash-b")
    with loraplex.ServiceClient(base_url=server.base_url, api_key=key_a) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=3)
        prompt = list(range(40, 52))
        fb_tokens = 0
        for step in range(1, STEPS + 1):
            sft = training.forward_backward([datum()]).result()
            rl = training.forward_backward([rl_datum(prompt, [60 + i, 61, 62, 63]) for i in range(4)],
                                           "importance_sampling").result()
            fb_tokens += len(TOKENS) - 1
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            answer = training.log_metrics({"reward/mean": 0.1 * step, "eval/accuracy": 0.5}, step=step)
            assert answer == {"run_id": training.model_id, "step": step, "stored": 2}
        with pytest.raises(Exception):  # a token id past the vocabulary: refused at the door, recorded
            training.forward_backward([datum([10, 20, 10**6])]).result()
        # finite inputs whose ratio overflows: the engine refuses the step (grad_norm inf), a user error
        training.forward_backward([rl_datum(prompt, [70, 71], sampler_logprob=-1e30)], "importance_sampling").result()
        with pytest.raises(Exception, match="grad_norm"):
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses = (sft.metrics["loss:sum"], rl.metrics["loss:sum"])
    with loraplex.ServiceClient(base_url=server.base_url, api_key=key_b) as service:
        other = service.create_lora_training_client("tiny", rank=2, seed=1).model_id
    return {"key_a": key_a, "key_b": key_b, "run": training.model_id, "other": other, "last_losses": losses}


def client(server, key=None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


def test_series_have_one_point_per_step(server, trained):
    with client(server, trained["key_a"]) as http:
        body = http.get(f"/dashboard/api/runs/{trained['run']}/metrics").json()
    series = body["series"]
    assert body["last_step"] == STEPS
    for name in ("loss", "tokens", "grad_norm", "learning_rate", "train/queue_seconds", "train/compute_seconds",
                 "logprob_gap/mean_abs", "logprob_gap/kl", "prefix_overlap", "reward/mean", "eval/accuracy"):
        assert [p[0] for p in series[name]["points"]] == list(range(1, STEPS + 1)), name
    assert series["loss"]["unit"] == "nats/token" and series["reward/mean"]["source"] == "client"
    assert [p[1] for p in series["learning_rate"]["points"]] == [1e-3] * STEPS
    assert series["reward/mean"]["points"][-1] == [STEPS, pytest.approx(0.1 * STEPS)]
    # per step: 19 weighted SFT tokens + 4 RL datums x 4 tokens with advantages
    assert [p[1] for p in series["tokens"]["points"]] == [19 + 16] * STEPS
    sft_loss, rl_loss = trained["last_losses"]
    assert series["loss"]["points"][-1][1] == pytest.approx((sft_loss + rl_loss) / 35, rel=1e-5)
    # 3 of the 4 RL datums repeat the 12-token prompt: 3 * 12 shared of 19 + 4 * 15 input tokens
    assert series["prefix_overlap"]["points"][0][1] == pytest.approx(36 / 79)
    gap, kl = series["logprob_gap/mean_abs"]["points"][0][1], series["logprob_gap/kl"]["points"][0][1]
    assert gap > 0 and kl > 0 and all(math.isfinite(v) for v in (gap, kl))
    assert all(p[1] > 0 for p in series["grad_norm"]["points"])
    # live polling: only the points after `since`
    with client(server, trained["key_a"]) as http:
        newer = http.get(f"/dashboard/api/runs/{trained['run']}/metrics", params={"since": STEPS - 1}).json()
    assert [p[0] for p in newer["series"]["loss"]["points"]] == [STEPS]


def test_run_list_and_requests(server, trained):
    with client(server, trained["key_a"]) as http:
        runs = http.get("/dashboard/api/runs").json()["runs"]
        assert [r["run_id"] for r in runs] == [trained["run"]]  # not tenant B's
        run = runs[0]
        assert (run["steps"], run["lora_rank"], run["status"], run["tenant_name"]) == (STEPS, 4, "idle", "dash-a")
        assert run["requests"]["failed"] == 2 and run["base_model"] == "loraplex/tiny"
        failed = http.get(f"/dashboard/api/runs/{trained['run']}/requests", params={"state": "failed"}).json()
        step_failure, refused = failed["requests"]  # newest first
        assert step_failure["kind"] == "optim_step" and "grad_norm" in step_failure["error"]
        assert step_failure["error_category"] == "user" and step_failure["compute_seconds"] >= 0
        assert refused["kind"] == "rejected" and "target_tokens" in refused["error"]
        every = http.get(f"/dashboard/api/runs/{trained['run']}/requests", params={"limit": 500}).json()["requests"]
        kinds = [r["kind"] for r in every]
        assert kinds.count("optim_step") == STEPS + 1 and kinds.count("forward_backward") == 2 * STEPS + 1
        done = [r for r in every if r["state"] == "done" and r["kind"] == "optim_step"]
        assert all(r["queue_seconds"] >= 0 and r["compute_seconds"] >= 0 for r in done)
        days = http.get("/dashboard/api/usage", params={"days": 2}).json()["days"]
        assert len(days) == 1 and days[0]["base_model"] == "loraplex/tiny" and days[0]["tokens_trained"] > 0


def test_another_tenants_run_is_not_found(server, trained):
    with client(server, trained["key_b"]) as http:
        for path in ("", "/metrics", "/requests", "/rl_groups", "/trajectories/x"):
            answer = http.get(f"/dashboard/api/runs/{trained['run']}{path}")
            assert answer.status_code == 404 and "run_id" in answer.json()["detail"], path
        assert http.get("/dashboard/api/admin/overview").status_code == 403
        assert [r["run_id"] for r in http.get("/dashboard/api/runs").json()["runs"]] == [trained["other"]]
    with client(server) as anonymous:
        assert anonymous.get("/dashboard/api/runs").status_code == 401
    with client(server, "tml-not-a-key") as wrong:
        assert wrong.get("/dashboard/api/me").status_code == 401


def test_cookie_login_and_logout(server, trained):
    with client(server) as http:
        bad = http.post("/dashboard/login", data={"api_key": "tml-wrong"})
        assert bad.status_code == 401 and bad.json()["detail"].startswith("api_key")
        assert http.post("/dashboard/login", data={}).status_code == 422
        login = http.post("/dashboard/login", data={"api_key": trained["key_a"], "next": "https://evil.example/"})
        assert login.status_code == 303 and login.headers["location"] == "/dashboard"
        cookie = login.headers["set-cookie"]
        assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and "Path=/dashboard" in cookie
        assert trained["key_a"] not in cookie
        me = http.get("/dashboard/api/me").json()["viewer"]
        assert me == {"kind": "tenant", "tenant_id": me["tenant_id"], "tenant_name": "dash-a"}
        assert http.get(f"/dashboard/api/runs/{trained['run']}").status_code == 200
        out = http.post("/dashboard/logout", headers={"Accept": "application/json"})
        assert out.json() == {"logged_out": True}
        http.cookies.clear()
        http.cookies.set("loraplex_dashboard", cookie.split(";")[0].split("=", 1)[1], path="/dashboard")
        assert http.get("/dashboard/api/me").status_code == 401  # the session is gone, not just the cookie


def test_operator_sees_every_tenant(server, trained, operator_key):
    with client(server) as http:
        login = http.post("/dashboard/login", data={"api_key": operator_key}, headers={"Accept": "application/json"})
        assert login.json()["viewer"]["kind"] == "admin"
        runs = {r["run_id"] for r in http.get("/dashboard/api/runs").json()["runs"]}
        assert {trained["run"], trained["other"]} <= runs
        assert http.get(f"/dashboard/api/runs/{trained['run']}/metrics").json()["last_step"] == STEPS
        overview = http.get("/dashboard/api/admin/overview").json()
        with server.embedded.sessions() as s:  # revoking the key ends its sessions at once
            assert revoke_operator_key(s, operator_key[:12]) == 1
        assert http.get("/dashboard/api/me").status_code == 401
    names = {t["name"]: t for t in overview["tenants"]}
    assert names["dash-a"]["live_models"] == 1 and names["dash-a"]["tokens_trained_today"] > 0
    assert overview["cycles"] and all(c["requests"] >= 1 and c["tenants"] >= 1 for c in overview["cycles"])
    assert overview["sampler"]["pending"] == 0


def test_bad_input_names_the_field(server, trained):
    run = trained["run"]
    with client(server, trained["key_a"]) as http:
        assert "since" in http.get(f"/dashboard/api/runs/{run}/metrics", params={"since": "x"}).json()["detail"]
        assert "limit" in http.get(f"/dashboard/api/runs/{run}/requests", params={"limit": 0}).json()["detail"]
        assert "state" in http.get(f"/dashboard/api/runs/{run}/requests", params={"state": "odd"}).json()["detail"]
        assert "days" in http.get("/dashboard/api/usage", params={"days": 999}).json()["detail"]
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": trained["key_a"]}) as http:
        def log(body):
            return http.post(f"/training_runs/{run}/metrics", json=body)
        assert "metrics.x" in log({"metrics": {"x": "NaN"}}).json()["detail"]
        assert "metrics." in log({"metrics": {"a" * 129: 1.0}}).json()["detail"]
        assert "metrics." in log({"metrics": {"bad name": 1.0}}).json()["detail"]
        assert "metrics" in log({"metrics": {f"m{i}": 1.0 for i in range(65)}}).json()["detail"]
        assert "step" in log({"metrics": {"x": 1.0}, "step": -1}).json()["detail"]
        assert log({"metrics": {"x": 1.0}}).json()["step"] == STEPS  # no step: the run's step now
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": trained["key_b"]}) as http:
        assert http.post(f"/training_runs/{run}/metrics", json={"metrics": {"x": 1.0}}).status_code == 404
    with loraplex.ServiceClient(base_url=server.base_url, api_key=trained["key_a"]) as service:
        with pytest.raises(ValueError, match="reward"):
            service.create_lora_training_client("tiny", rank=2).log_metrics({"reward": float("inf")})
