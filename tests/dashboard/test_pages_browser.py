"""The dashboard's pages in a real browser: Debian's headless Chromium driven by Playwright, against
an embedded server (tiny model, vLLM sampler) on which two tenants trained a few real steps through
the SDK, one of them a small RL loop through the inference API and the rollout store, and a third ran
tinker-cookbook's math_rl recipe unchanged through the official tinker SDK.

LORAPLEX_DASHBOARD_SCREENSHOTS=1 also writes the docs' screenshots (docs/dashboard/*.png) from
the pages these tests open; without it the tests write nothing. Every page a test opens must
finish without a script error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import loraplex
import numpy as np
import openai
import pytest
from loraplex import types
from PIL import Image
from playwright.sync_api import Page, expect, sync_playwright

from db.operator_keys import issue_operator_key
from tests.ecosystem.cookbook_runs import RENDERER, final_state, run_recipe
from tests.servers import running_server

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler (the RL run samples through it)

CHROMIUM = "/usr/bin/chromium"  # Debian's package (scripts/setup.sh); Playwright downloads no browser
SCREENSHOTS = Path(__file__).parents[2] / "docs" / "dashboard"
STEPS = 3
GROUPS, GROUP_SIZE, MAX_TOKENS = 2, 4, 8  # per RL step
# A loss name the server refuses, quoting it in its error: the page must show it as text, run nothing.
HOSTILE_LOSS = "<script>window.injected=1</script><img src=x onerror=window.injected=1>"
RL_NAME = "arithmetic RL"  # what alice called her RL run (its user_metadata)
COOKBOOK_STEPS, COOKBOOK_GROUPS, COOKBOOK_GROUP_SIZE = 3, 4, 4  # math_rl's max_steps, groups_per_batch, group_size


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


def train_step(training, step: int) -> None:
    """One real round: forward_backward, optim_step, and the client's own numbers for that step (one that
    spans decades, and one named as a service series is)."""
    training.forward_backward([datum(list(range(10 + step, 40)))], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    training.log_metrics({"reward/mean": 0.2 * step, "eval/accuracy": 0.5 + 0.1 * step,
                          "scale/ratio": 10.0 ** (-4 * step), "entropy": 2.0 - 0.1 * step}, step=step + 1)


def rl_step(training, rollouts, oai, step: int) -> None:
    """Sample groups from the newest snapshot through the inference API (recorded in the rollout
    store), reward each sample, train on the stored tokens with importance sampling."""
    training.save_weights_for_sampler(f"step-{step}").result()
    datums = []
    for group in range(GROUPS):
        session = f"step{step}-group{group}"
        oai.completions.create(model=f"tinker://{training.model_id}/sampler_weights/@latest",
                               prompt=[20 + group] + list(range(30, 40)), n=GROUP_SIZE, max_tokens=MAX_TOKENS,
                               temperature=1.0, seed=10 * step + group, extra_headers={"X-Loraplex-Session": session})
        for choice in range(GROUP_SIZE):
            rollouts.set_reward(session, float((choice + step + group) % 3 == 0), turn=0, choice=choice)
        datums += rollouts.datums(session).datums
    training.forward_backward(datums, "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    training.log_metrics({"reward/mean": 0.3 + 0.1 * step}, step=step + 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("dashboard")) as running:
        yield running


@pytest.fixture(scope="module")
def world(server):
    """alice: an SFT run of STEPS steps with client metrics and two refused requests, and an RL run of
    STEPS steps; bob: a run of one step; an operator key."""
    keys = SimpleNamespace(alice=server.new_tenant("alice <b>&amp;"), bob=server.new_tenant("bob"))
    with server.embedded.sessions() as s:
        keys.operator = issue_operator_key(s)
    alice = loraplex.ServiceClient(base_url=server.base_url, api_key=keys.alice)
    bob = loraplex.ServiceClient(base_url=server.base_url, api_key=keys.bob)
    alice_run = alice.create_lora_training_client("tiny", rank=8, seed=1)
    for step in range(STEPS):
        train_step(alice_run, step)
    for bad in ([datum([1, 2, 3, 10**6])], "cross_entropy"), ([datum([1, 2, 3, 4])], HOSTILE_LOSS):
        with pytest.raises(loraplex.LoraplexError):
            alice_run.forward_backward(*bad).result()
    rl_run = alice.create_lora_training_client("tiny", rank=8, seed=2, user_metadata={"name": RL_NAME})
    rollouts = loraplex.RolloutsClient(alice)
    oai = openai.OpenAI(base_url=f"{server.base_url}/oai/api/v1", api_key=keys.alice)
    for step in range(STEPS):
        rl_step(rl_run, rollouts, oai, step)
    bob_run = bob.create_lora_training_client("tiny", rank=4, seed=3)
    train_step(bob_run, 0)
    yield SimpleNamespace(keys=keys, alice_run=alice_run, rl_run=rl_run, rollouts=rollouts, bob_run=bob_run)
    alice.close()
    bob.close()


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install chromium` (scripts/setup.sh installs it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser, server):
    """open_page(key): a new browser session (its own cookies), logged in with `key` when one is given.
    The test fails if a script on any of its pages threw."""
    errors, contexts = [], []

    def open_page(key: str | None = None) -> Page:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(f"{page.url}: {error}"))
        page.goto(f"{server.base_url}/dashboard")
        if key is not None:
            page.fill("#api_key", key)
            page.click("#login-form button[type=submit]")
            expect(page.locator("#runs tbody tr").first).to_be_visible()
        return page

    yield open_page
    for context in contexts:
        context.close()
    assert errors == []


def listed_runs(page: Page) -> set[str]:
    return set(page.locator("#runs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.runId)"))


def screenshot(page: Page, name: str) -> None:
    """docs/dashboard/<name>.png, in 64 colours: a fifth of the bytes, and these pages are flat colours."""
    if os.environ.get("LORAPLEX_DASHBOARD_SCREENSHOTS"):
        SCREENSHOTS.mkdir(exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=path, full_page=True)
        Image.open(path).convert("RGB").quantize(colors=64).save(path, optimize=True)


def test_each_tenant_sees_only_their_runs(server, world, open_page):
    alice = open_page(world.keys.alice)
    expect(alice.locator("#viewer-name")).to_have_text("alice <b>&amp;")  # a tenant's name is text, not markup
    assert listed_runs(alice) == {world.alice_run.model_id, world.rl_run.model_id}
    row = alice.locator(f"#runs tbody tr[data-run-id='{world.alice_run.model_id}']")
    expect(row).to_contain_text("loraplex/tiny")
    expect(row).to_contain_text("2 failed")
    rl_row = alice.locator(f"#runs tbody tr[data-run-id='{world.rl_run.model_id}']")
    expect(rl_row.locator(".tag")).to_have_count(STEPS)  # its sampler checkpoints, with TTL and publish state
    expect(rl_row.locator(".tag").first).to_contain_text("private")
    screenshot(alice, "runs")

    bob = open_page(world.keys.bob)
    assert listed_runs(bob) == {world.bob_run.model_id}
    response = bob.goto(f"{server.base_url}/dashboard/runs/{world.alice_run.model_id}")  # alice's run, by its id
    assert response.status == 404
    expect(bob.locator("#run-error")).to_contain_text("run_id")
    expect(bob.locator("#chart-loss")).to_have_attribute("data-points", "0")


def test_charts_show_one_point_per_step(server, world, open_page):
    page = open_page(world.keys.alice)
    page.click(f"a:text-is('{world.alice_run.model_id}')")
    for chart in ("chart-loss", "chart-grad-norm", "chart-learning-rate", "chart-tokens", "chart-stall",
                  "chart-client-reward", "chart-client-eval"):
        expect(page.locator(f"#{chart}")).to_have_attribute("data-points", str(STEPS))
        expect(page.locator(f"#{chart} canvas")).to_have_count(1)
    expect(page.locator("#run-summary")).to_contain_text(f"{STEPS} steps")


def test_runs_side_by_side(server, world, open_page):
    page = open_page(world.keys.alice)
    expect(page.locator("#compare")).to_be_disabled()
    for run in (world.alice_run, world.rl_run):
        page.check(f"#runs input[value='{run.model_id}']")
    page.click("#compare")
    loss = page.locator("#chart-loss")
    expect(loss).to_have_attribute("data-points", str(STEPS))  # both runs' steps 1..STEPS on one axis
    for label in (world.alice_run.model_id, RL_NAME):  # a run by its name where it has one
        expect(loss.locator(".u-legend .u-label", has_text=label)).to_have_count(1)
    expect(page.locator("#chart-entropy")).to_have_count(1)  # a series only the RL run has
    screenshot(page, "compare")


def test_rl_run_shows_sampler_measures_and_groups(server, world, open_page):
    page = open_page(world.keys.alice)
    page.goto(f"{server.base_url}/dashboard/runs/{world.rl_run.model_id}")
    for chart in ("chart-loss", "chart-entropy", "chart-sampler-throughput", "chart-logprob-gap", "chart-staleness",
                  "chart-prefix-overlap", "chart-group-reward", "chart-group-outcomes", "chart-output-length"):
        expect(page.locator(f"#{chart}")).to_have_attribute("data-points", str(STEPS))
    expect(page.locator("#groups tbody tr")).to_have_count(STEPS * GROUPS)
    expect(page.locator("#groups tbody tr").first).to_contain_text("mixed")
    screenshot(page, "run")


def test_trajectory_viewer_shows_both_logprobs_per_token(server, world, open_page):
    session = f"step{STEPS - 1}-group0"
    stored = world.rollouts.get_trajectory(session).turns[0].samples
    page = open_page(world.keys.alice)
    page.goto(f"{server.base_url}/dashboard/runs/{world.rl_run.model_id}")
    group_row = page.locator("#groups tbody tr", has=page.locator(f"a[title='{session}']"))
    expect(group_row.locator("td.prompt-text")).not_to_be_empty()  # the group's prompt, as text
    group_row.locator(f"a[title='{session}']").click()
    expect(page.locator(".choice")).to_have_count(GROUP_SIZE)
    expect(page.locator(".prompt-block summary")).to_contain_text("Prompt as the sampler saw it (11 tokens)")
    first = stored[0]
    sampler_tokens = page.locator(".choice").first.locator(".tokens.sampler .tok")
    expect(sampler_tokens).to_have_count(len(first.tokens))
    expect(page.locator(".choice").first.locator(".tokens.trainer .tok")).to_have_count(len(first.tokens))
    shown = sampler_tokens.evaluate_all("spans => spans.map(s => [+s.dataset.token, +s.dataset.samplerLogprob, "
                                        "s.dataset.trainerLogprob === '' ? null : +s.dataset.trainerLogprob])")
    assert [token for token, _, _ in shown] == list(first.tokens)
    np.testing.assert_allclose([lp for _, lp, _ in shown], first.logprobs, rtol=1e-6)
    # trained on exactly these tokens, so the trainer's logprob of each is there, and near the sampler's
    np.testing.assert_allclose([lp for _, _, lp in shown], first.logprobs, atol=1e-3)
    screenshot(page, "trajectory")
    # a reward attached later shows without a reload (each choice's own reward still ranks it in its group)
    page.evaluate("window.sameDocument = true")
    world.rollouts.set_reward(session, 0.75)
    expect(page.locator("#trajectory-summary")).to_contain_text("trajectory reward 0.75", timeout=15_000)
    assert page.evaluate("window.sameDocument") is True


def test_charts_update_live_without_reload(server, world, open_page):
    page = open_page(world.keys.bob)
    page.goto(f"{server.base_url}/dashboard/runs/{world.bob_run.model_id}")
    loss = page.locator("#chart-loss")
    expect(loss).to_have_attribute("data-points", "1")
    page.evaluate("window.sameDocument = true")
    train_step(world.bob_run, 1)
    expect(loss).to_have_attribute("data-points", "2", timeout=15_000)
    expect(page.locator("#chart-client-reward")).to_have_attribute("data-points", "2")
    assert page.evaluate("window.sameDocument") is True  # polled, not reloaded


def test_failed_requests_show_their_error_as_text(server, world, open_page):
    page = open_page(world.keys.alice)
    page.goto(f"{server.base_url}/dashboard/runs/{world.alice_run.model_id}")
    errors = page.locator("#failed tbody td.error-text")
    expect(errors).to_have_count(2)
    expect(errors.filter(has_text="token id 1000000 is outside the vocabulary")).to_have_count(1)
    expect(errors.filter(has_text=HOSTILE_LOSS)).to_have_count(1)  # the markup, shown as its characters
    assert page.locator("#failed script, #failed img").count() == 0
    assert page.evaluate("window.injected") is None


def test_wrong_key_is_said_on_the_form(server, open_page):
    page = open_page()
    page.fill("#api_key", "tml-not-a-key")
    page.click("#login-form button[type=submit]")
    expect(page.locator("#login-error")).to_contain_text("api_key")
    assert "tml-not-a-key" not in page.url


def test_operator_view_for_the_operator_only(server, world, open_page):
    tenant = open_page(world.keys.alice)
    response = tenant.goto(f"{server.base_url}/dashboard/admin")
    assert response.status == 403
    expect(tenant.locator("#tenants")).to_have_count(0)

    operator = open_page(world.keys.operator)
    assert listed_runs(operator) >= {world.alice_run.model_id, world.rl_run.model_id, world.bob_run.model_id}
    operator.goto(f"{server.base_url}/dashboard/admin")
    for name in ("alice <b>&amp;", "bob"):
        expect(operator.locator("#tenants tbody td:first-child", has_text=re.compile(f"^{re.escape(name)}$"))) \
            .to_have_count(1)
    expect(operator.locator("#chart-cycle-requests")).not_to_have_attribute("data-points", "0")
    screenshot(operator, "admin")
    operator.goto(f"{server.base_url}/dashboard/usage")
    expect(operator.locator("#usage tbody tr").first).to_contain_text("loraplex/tiny")
    expect(operator.locator("#chart-tokens-trained")).not_to_have_attribute("data-points", "0")
    expect(operator.locator("#chart-tokens-sampled")).not_to_have_attribute("data-points", "0")
    screenshot(operator, "usage")


def test_logout_ends_the_session(server, world, open_page):
    page = open_page(world.keys.alice)
    page.click("#logout")
    expect(page.locator("#login-form")).to_be_visible()
    assert page.context.cookies() == []
    page.goto(f"{server.base_url}/dashboard/runs/{world.alice_run.model_id}")
    expect(page.locator("#login-form")).to_be_visible()  # the run's page asks to log in again
    assert page.request.get(f"{server.base_url}/dashboard/api/runs").status == 401


def test_runs_are_shown_by_name_with_their_hyperparameters_and_filtered_and_sorted(server, world, open_page):
    page = open_page(world.keys.alice)
    named = page.locator(f"#runs tbody tr[data-run-id='{world.rl_run.model_id}']")
    expect(named.locator("a.run-name")).to_have_text(RL_NAME)
    expect(named.locator("a.run-name")).to_have_attribute("title", world.rl_run.model_id)
    expect(named).to_contain_text("rank 8 · alpha 32 · attn+mlp+unembed · adamw · lr 0.01")
    page.fill("#filter", "arithmetic")
    assert listed_runs(page) == {world.rl_run.model_id}
    page.fill("#filter", "")
    page.click("button.sort[data-key='name']")  # by name, A to Z: the unnamed run's id sorts by its hex
    names = page.locator("#runs tbody a.run-name").all_inner_texts()
    assert names == sorted(names, key=str.lower)
    page.click(f"a:text-is('{RL_NAME}')")
    expect(page.locator("#run-title")).to_have_text(RL_NAME)
    expect(page.locator("#run-summary")).to_contain_text(f"{world.rl_run.model_id} · ")


def test_a_series_spanning_decades_is_drawn_on_a_log_axis_the_reader_can_switch(server, world, open_page):
    page = open_page(world.keys.alice)
    page.goto(f"{server.base_url}/dashboard/runs/{world.alice_run.model_id}")
    ratio = page.locator("#chart-client-scale")  # 1, 1e-4, 1e-8
    expect(ratio).to_have_attribute("data-scale", "log")
    ratio.locator("input.log-scale").uncheck()
    expect(ratio).to_have_attribute("data-scale", "linear")
    expect(page.locator("#chart-loss")).to_have_attribute("data-scale", "linear")  # within a decade
    page.locator("#smoothing").evaluate("(input) => { input.value = '0.9'; input.dispatchEvent(new Event('input')); }")
    expect(page.locator("#chart-loss")).to_have_attribute("data-smoothing", "0.9")


def test_a_chart_downloads_the_points_the_api_gave(server, world, open_page):
    page = open_page(world.keys.alice)
    page.goto(f"{server.base_url}/dashboard/runs/{world.alice_run.model_id}")
    stall = page.locator("#chart-stall")
    expect(stall).to_have_attribute("data-points", str(STEPS))
    with page.expect_download() as csv:
        stall.locator("button.chart-download", has_text="CSV").click()
    rows = Path(csv.value.path()).read_text().splitlines()
    assert rows[0] == '"step","trainer: waiting","trainer: computing","sampler: wait + compute (wall)"'
    series = page.evaluate(f"fetch('/dashboard/api/runs/{world.alice_run.model_id}/metrics').then(r => r.json())")
    waiting = dict(series["series"]["train/queue_seconds"]["points"])
    assert [float(row.split(",")[1]) for row in rows[1:]] == pytest.approx([waiting[s] for s in sorted(waiting)])
    with page.expect_download() as json_file:
        stall.locator("button.chart-download", has_text="JSON").click()
    assert '"x":"step"' in Path(json_file.value.path()).read_text()


def test_client_series_keep_to_charts_of_their_own_and_colours_keep_one_meaning(server, world, open_page):
    page = open_page(world.keys.alice)
    page.goto(f"{server.base_url}/dashboard/runs/{world.alice_run.model_id}")
    client = page.locator("#chart-client-entropy")  # the client logged "entropy": not merged with anything
    expect(client.locator("h3")).to_contain_text("entropy (client)")
    expect(client).to_have_attribute("data-points", str(STEPS))
    page.goto(f"{server.base_url}/dashboard/runs/{world.rl_run.model_id}")

    def colour(chart: str, label: str) -> str:
        marker = page.locator(f"#{chart} .u-legend tr", has_text=label).locator(".u-marker")
        return marker.evaluate("m => getComputedStyle(m).borderColor")

    expect(page.locator("#chart-group-reward")).to_have_attribute("data-points", str(STEPS))
    good, bad, mixed = "rgb(0, 158, 115)", "rgb(213, 94, 0)", "rgb(230, 159, 0)"
    assert colour("chart-group-reward", "best") == colour("chart-group-outcomes", "all good") == good
    assert colour("chart-group-reward", "worst") == colour("chart-group-outcomes", "all bad") == bad
    assert colour("chart-group-outcomes", "mixed") == mixed


@pytest.fixture(scope="module")
def cookbook_run(server, tmp_path_factory):
    """carol: tinker-cookbook's math_rl recipe (arithmetic env, its default loss) run unchanged against the
    server, then `loraplex metrics follow --once` sending the recipe's metrics.jsonl to its run."""
    key = server.new_tenant("carol")
    log_path = tmp_path_factory.mktemp("cookbook") / "math_rl"
    rows = run_recipe("math_rl", server.base_url, key, log_path, 600, model_name="loraplex/tiny",
                      renderer_name=RENDERER, env="arithmetic", groups_per_batch=COOKBOOK_GROUPS,
                      group_size=COOKBOOK_GROUP_SIZE, max_tokens=16, lora_rank=8, learning_rate=1e-2,
                      max_steps=COOKBOOK_STEPS)
    followed = subprocess.run([str(Path(sys.executable).parent / "loraplex"), "metrics", "follow", str(log_path),
                               "--once", "--base-url", server.base_url, "--api-key", key],
                              capture_output=True, text=True, timeout=120)
    assert followed.returncode == 0, followed.stderr
    run_id = final_state(log_path).removeprefix("tinker://").split("/", 1)[0]
    return SimpleNamespace(key=key, run_id=run_id, rows={row["step"]: row for row in rows})


def test_a_cookbook_math_rl_run_shows_its_groups_and_rewards(server, world, cookbook_run, open_page):
    """No rollout store, no log_metrics: the groups are inferred from the datums' advantages (the recipe
    samples each member alone), the rewards are the recipe's own metrics.jsonl."""
    page = open_page(cookbook_run.key)
    page.goto(f"{server.base_url}/dashboard/runs/{cookbook_run.run_id}")
    for chart in ("chart-client-env", "chart-group-outcomes", "chart-output-length"):
        expect(page.locator(f"#{chart}")).to_have_attribute("data-points", str(COOKBOOK_STEPS))
    reward = page.locator("#chart-client-env .u-legend .u-label", has_text=re.compile("^env/all/reward/total$"))
    expect(reward).to_have_count(1)
    rows = page.locator("#groups tbody tr")
    expect(rows).to_have_count(COOKBOOK_STEPS * COOKBOOK_GROUPS)
    cells = rows.evaluate_all("rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    assert {row[0] for row in cells} == {str(s) for s in range(1, COOKBOOK_STEPS + 1)}  # optimizer steps
    # the prompt as text, shown by its end: the recipe's question after its fixed example (What is 4 + 5?)
    questions = [re.findall(r"What is \d+ \+ \d+\?", row[1]) for row in cells]
    assert all(found and found[-1] != "What is 4 + 5?" for found in questions), questions
    for step in range(1, COOKBOOK_STEPS + 1):  # a step's groups: each a question of its own
        asked = [found[-1] for found, row in zip(questions, cells) if row[0] == str(step)]
        assert len(set(asked)) == COOKBOOK_GROUPS
    assert {row[2] for row in cells} <= {"uniform", "mixed"} and {row[3] for row in cells} == {str(COOKBOOK_GROUP_SIZE)}
    assert {row[4] for row in cells} == {"–"}  # the SDK sends no rewards: none is made up
    # the outcomes agree with the recipe's own count of its groups (its iteration i fed step i + 1)
    answer = page.evaluate(f"fetch('/dashboard/api/runs/{cookbook_run.run_id}/rl_groups').then(r => r.json())")
    for step in answer["steps"]:
        logged = cookbook_run.rows[step["step"] - 1]
        assert step["fractions"]["mixed"] == pytest.approx(logged["env/all/by_group/frac_mixed"])
        assert step["fractions"]["uniform"] == pytest.approx(logged["env/all/by_group/frac_all_good"]
                                                             + logged["env/all/by_group/frac_all_bad"])
    screenshot(page, "cookbook_run")
    # another tenant sees neither the run nor its groups
    bob = open_page(world.keys.bob)
    assert bob.request.get(f"{server.base_url}/dashboard/api/runs/{cookbook_run.run_id}/rl_groups").status == 404
