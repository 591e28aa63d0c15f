"""One valid request per route of the app, keyed by (method, path) exactly as the app's route table
spells them, and who may call it. The authorization matrix runs every route the app has: a route
missing here fails it, so whoever adds a route also says how to call it and who may."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from api.app import create_app
from api.served_models import ServedModel, ServedModels
from service.settings import Settings
from tests.reliability.checks import SHORT
from tests.reliability.client import PROTOBUF, forward_backward_body
from tests.reliability.world import World

PUBLIC, TENANT, OWNED = "public", "tenant", "owned"
V1 = "/api/v1"
CHECKPOINT = f"{V1}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}"
TRAJECTORY = f"{V1}/rollouts/trajectories/{{session_id}}"
OAI = "/oai/api/v1"
ANY_METHOD = ("GET", "POST", "PUT", "PATCH", "DELETE")
DASH = "/dashboard"
DASH_API = f"{DASH}/api"
MOUNTS = {("Mount", f"{DASH}/static")}
PAGE = 4096  # the dashboard's login form (~1.2 KB) or a page's shell (~2.6 KB): a template, with no data
OAI_SAMPLE = {"max_tokens": 2, "temperature": 0.0}


@dataclass(frozen=True)
class Example:
    """`access`: PUBLIC (anyone, no key), TENANT (the caller's own data; names no resource) or OWNED
    (names the owner's resources). `params(world)`: the path parameters; `body(world, seq_id)`: a
    JSON body, or bytes (a protobuf); `seq_id` is the owner model's seq id reserved for the route.
    `owner_status`: what the owner (on PUBLIC and TENANT routes: anyone served) gets;
    `other_status`: what another tenant gets on an OWNED route, worded as for an id of nobody."""

    access: str
    params: Callable[[World], dict[str, str]] = lambda w: {}
    body: Callable[[World, int], Any] | None = None
    owner_status: frozenset[int] = frozenset({200})
    other_status: frozenset[int] = frozenset({404})
    needs_sampler: bool = False  # served only where vLLM runs
    # the most bytes a refusal (401, and another tenant's 404) may have: an API's is a sentence; an
    # HTML page's is the login form or the page's empty shell (PAGE), never data
    refusal_bytes: int = SHORT


def call_of(route: tuple[str, str], example: Example, world: World, seq_id: int) -> dict[str, Any]:
    """httpx.request's arguments for `example` of `route`: the path template filled in, the body."""
    method, path = route
    params = example.params(world)
    call: dict[str, Any] = {"method": method, "url": re.sub(r"{(\w+)(:\w+)?}", lambda m: params[m[1]], path)}
    body = example.body(world, seq_id) if example.body else None
    if route in MOUNTS:  # a mount has no methods of its own: a GET of one of its files
        call |= {"method": "GET", "url": f"{call['url']}/{params['file']}"}
    if isinstance(body, bytes):
        call |= {"content": body, "headers": PROTOBUF}
    elif isinstance(body, Form):
        call["data"] = dict(body)
    elif body is not None:
        call["json"] = body
    return call


class Form(dict):
    """A body sent as an HTML form (application/x-www-form-urlencoded), as a browser's login is."""


def checkpoint(tinker_path: str) -> dict[str, str]:
    run_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return {"run_id": run_id, "checkpoint_id": f"{kind}/{name}"}


def fixed(body: dict[str, Any]) -> Callable[[World, int], Any]:
    return lambda w, seq: body


SDK = {"sdk_version": "0.38.0"}
SAMPLE = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
          "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
# Tinker routes the server answers with 400 "not supported" (api/routes/unsupported.py): still
# after authentication, and the same answer for another tenant's ids as for ids of nobody.
NOT_SUPPORTED = {"owner_status": frozenset({400}), "other_status": frozenset({400})}

EXAMPLES: dict[tuple[str, str], Example] = {
    # FastAPI's documentation, metrics, and the calls the SDK makes before it has a session
    ("GET", "/openapi.json"): Example(PUBLIC),
    ("GET", "/docs"): Example(PUBLIC),
    ("GET", "/docs/oauth2-redirect"): Example(PUBLIC),
    ("GET", "/redoc"): Example(PUBLIC),
    ("GET", "/metrics"): Example(PUBLIC),
    ("POST", f"{V1}/client/config"): Example(PUBLIC, body=fixed(SDK)),
    ("POST", f"{V1}/client/dynamic_config"): Example(PUBLIC, body=fixed(SDK)),
    ("GET", f"{V1}/healthz"): Example(PUBLIC),
    ("GET", f"{V1}/get_server_capabilities"): Example(PUBLIC),

    ("POST", f"{V1}/telemetry"): Example(TENANT, body=fixed({"events": [], **SDK})),
    ("POST", f"{V1}/create_session"): Example(TENANT, body=fixed({"tags": [], "user_metadata": {}, **SDK})),
    ("GET", f"{V1}/sessions"): Example(TENANT),
    ("GET", f"{V1}/training_runs"): Example(TENANT),
    ("GET", f"{V1}/checkpoints"): Example(TENANT),
    # the SDK's token exchange, and the reports of its AdminClient: the caller's own tenant's
    ("POST", f"{V1}/auth/token"): Example(TENANT, body=fixed({})),
    ("GET", f"{V1}/audit"): Example(TENANT),
    ("GET", f"{V1}/billing/usage/checkpoints/current"): Example(TENANT),
    # its window (starting_on, ending_before) is required: the call without one is refused, naming them
    ("GET", f"{V1}/billing/usage/events"): Example(TENANT, owner_status=frozenset({422})),
    # the served base model's tokenizer files: any tenant's, none of them tenant data
    ("GET", f"{V1}/tokenizers/{{model:path}}/files"): Example(TENANT, lambda w: {"model": "tiny"}),
    ("GET", f"{V1}/tokenizers/{{model:path}}/files/{{filename}}"): Example(
        TENANT, lambda w: {"model": "tiny", "filename": "tokenizer_config.json"}),

    ("POST", f"{V1}/session_heartbeat"): Example(OWNED, body=lambda w, seq: {"session_id": w.ids.session}),
    ("POST", f"{V1}/sessions/{{session_id}}/finish"): Example(
        OWNED, lambda w: {"session_id": w.ids.spare_session}, fixed({"reason": {"type": "success"}, "detail": None})),
    ("GET", f"{V1}/sessions/{{session_id}}"): Example(OWNED, lambda w: {"session_id": w.ids.session}),
    ("POST", f"{V1}/create_model"): Example(OWNED, body=lambda w, seq: {
        "session_id": w.ids.session, "model_seq_id": 1, "base_model": "tiny", "lora_config": {"rank": 4, "seed": 3}}),
    ("POST", f"{V1}/get_info"): Example(OWNED, body=lambda w, seq: {"model_id": w.ids.model}),
    ("POST", f"{V1}/forward_backward"): Example(OWNED, body=lambda w, seq: forward_backward_body(w.ids.model, seq)),
    ("POST", f"{V1}/optim_step"): Example(OWNED, body=lambda w, seq: {
        "model_id": w.ids.model, "seq_id": seq, "adam_params": {"learning_rate": 1e-3}}),
    ("POST", f"{V1}/save_weights"): Example(OWNED, body=lambda w, seq: {
        "model_id": w.ids.model, "seq_id": seq, "path": "matrix"}),
    ("POST", f"{V1}/save_weights_for_sampler"): Example(OWNED, body=lambda w, seq: {
        "model_id": w.ids.model, "seq_id": seq, "path": "matrix"}),
    ("POST", f"{V1}/load_weights"): Example(OWNED, body=lambda w, seq: {
        "path": w.ids.checkpoint, "session_id": w.ids.session, "model_seq_id": 2}),
    ("POST", f"{V1}/weights_info"): Example(OWNED, body=lambda w, seq: {"tinker_path": w.ids.checkpoint}),
    ("POST", f"{V1}/retrieve_future"): Example(OWNED, body=lambda w, seq: {"request_id": w.ids.request}),
    ("POST", f"{V1}/create_sampling_session"): Example(OWNED, body=lambda w, seq: {
        "session_id": w.ids.session, "sampling_session_seq_id": 1, "model_path": w.ids.sampler_weights}),
    ("POST", f"{V1}/copy_weights"): Example(OWNED, body=lambda w, seq: {
        "source_path": w.ids.checkpoint, "destination_project_id": "matrix"}),
    ("PUT", f"{V1}/sessions/{{session_id}}/project"): Example(
        OWNED, lambda w: {"session_id": w.ids.session}, fixed({"project_id": "matrix"})),
    ("GET", f"{V1}/samplers/{{sampling_session_id}}"): Example(OWNED, lambda w: {"sampling_session_id": w.ids.sampler}),
    ("POST", f"{V1}/asample"): Example(OWNED, body=lambda w, seq: {"sampling_session_id": w.ids.sampler, "seq_id": seq,
                                                                  **SAMPLE}, needs_sampler=True),
    ("GET", f"{V1}/training_runs/{{run_id}}"): Example(OWNED, lambda w: {"run_id": w.ids.model}),
    ("GET", f"{V1}/training_runs/{{run_id}}/checkpoints"): Example(OWNED, lambda w: {"run_id": w.ids.model}),
    # publish and unpublish toggle one checkpoint: the owner's second call of either may find it done (409)
    ("POST", f"{CHECKPOINT}/publish"): Example(OWNED, lambda w: checkpoint(w.ids.publish_checkpoint),
                                               owner_status=frozenset({200, 409})),
    ("DELETE", f"{CHECKPOINT}/publish"): Example(OWNED, lambda w: checkpoint(w.ids.publish_checkpoint),
                                                 owner_status=frozenset({200, 409})),
    ("PUT", f"{CHECKPOINT}/ttl"): Example(OWNED, lambda w: checkpoint(w.ids.checkpoint), fixed({"ttl_seconds": 7200})),
    ("GET", f"{CHECKPOINT}/archive"): Example(OWNED, lambda w: checkpoint(w.ids.checkpoint)),
    ("DELETE", CHECKPOINT): Example(OWNED, lambda w: checkpoint(w.ids.delete_checkpoint)),
    # external weights (api/routes/external_weights.py): an export of the owner's model; the URLs of a
    # checkpoint that is no export are refused (400). A file's URL needs no key: its signature is the
    # credential, and one that does not verify is a 403 for anyone, whether or not the export exists.
    ("POST", f"{V1}/save_weights_external"): Example(OWNED, body=lambda w, seq: {
        "model_id": w.ids.model, "seq_id": seq, "path": "external"}),
    ("GET", f"{CHECKPOINT}/external_weights_urls"): Example(OWNED, lambda w: checkpoint(w.ids.checkpoint),
                                                            owner_status=frozenset({400})),
    ("GET", f"{V1}/external_weights/{{run_id}}/{{name}}/{{file:path}}"): Example(
        PUBLIC, lambda w: {"run_id": w.ids.model, "name": "external", "file": "config.json?expires=1&signature=0"},
        owner_status=frozenset({403})),

    ("POST", f"{V1}/create_custom_loss"): Example(OWNED, body=lambda w, seq: {"model_id": w.ids.model}, **NOT_SUPPORTED),
    ("GET", f"{V1}/sessions/{{session_id}}/trace_export"): Example(OWNED, lambda w: {"session_id": w.ids.session}),
    # the trace itself: its signed URL is the credential (a key alone gets nothing)
    ("GET", f"{V1}/sessions/{{session_id}}/session.pftrace"): Example(
        PUBLIC, lambda w: {"session_id": w.ids.session}, owner_status=frozenset({403})),
    ("POST", f"{V1}/sessions/search"): Example(TENANT, body=fixed({"user_metadata": {}, "limit": 50})),

    # the rollout store (api/routes/rollouts.py) and the OpenAI-compatible inference API (api/inference/)
    ("GET", f"{V1}/rollouts/trajectories"): Example(TENANT),
    ("GET", TRAJECTORY): Example(OWNED, lambda w: {"session_id": w.ids.trajectory}),
    ("PUT", f"{TRAJECTORY}/reward"): Example(OWNED, lambda w: {"session_id": w.ids.trajectory}, fixed({"reward": 0.5})),
    ("GET", f"{TRAJECTORY}/datums"): Example(OWNED, lambda w: {"session_id": w.ids.trajectory}),
    ("DELETE", TRAJECTORY): Example(OWNED, lambda w: {"session_id": w.ids.delete_trajectory}),
    ("POST", f"{OAI}/chat/completions"): Example(OWNED, body=lambda w, seq: {
        "model": w.ids.sampler_weights, "messages": [{"role": "user", "content": "hi"}], **OAI_SAMPLE},
        needs_sampler=True),
    ("POST", f"{OAI}/completions"): Example(OWNED, body=lambda w, seq: {
        "model": w.ids.sampler_weights, "prompt": [5, 6, 7], **OAI_SAMPLE}, needs_sampler=True),
    ("GET", f"{OAI}/models"): Example(TENANT),
    ("POST", f"{OAI}/responses"): Example(OWNED, body=lambda w, seq: {
        "model": w.ids.sampler_weights, "input": "hi", "max_output_tokens": 2, "temperature": 0.0},
        needs_sampler=True),
    # a stored response of the owner's is not in the world: another tenant's is checked in tests/inference
    ("GET", f"{OAI}/responses/{{response_id}}"): Example(TENANT, lambda w: {"response_id": "resp_none"},
                                                         owner_status=frozenset({404})),
    ("POST", "/anthropic/v1/messages"): Example(OWNED, body=lambda w, seq: {
        "model": w.ids.sampler_weights, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0.0}, needs_sampler=True),
    ("POST", "/anthropic/v1/messages/count_tokens"): Example(OWNED, body=lambda w, seq: {
        "model": w.ids.sampler_weights, "messages": [{"role": "user", "content": "hi"}]}),

    # client metrics of a run (api/routes/run_metrics.py), logged by the SDK's log_metrics
    ("POST", f"{V1}/training_runs/{{run_id}}/metrics"): Example(OWNED, lambda w: {"run_id": w.ids.model}, fixed({
        "metrics": {"reward/mean": 0.25}, "step": 1})),

    # the dashboard (api/dashboard/, docs/dashboard.md). Its JSON API takes the key as X-API-Key (as the
    # matrix sends it) as well as the login cookie; a revoked key or a disabled tenant's is refused either way.
    ("GET", f"{DASH_API}/me"): Example(TENANT),
    ("GET", f"{DASH_API}/runs"): Example(TENANT),
    ("GET", f"{DASH_API}/usage"): Example(TENANT),
    ("GET", f"{DASH_API}/admin/overview"): Example(TENANT, owner_status=frozenset({403})),  # operator keys only
    ("GET", f"{DASH_API}/runs/{{run_id}}"): Example(OWNED, lambda w: {"run_id": w.ids.model}),
    # the owner's run has service points (its forward_backward and optim_step) and a client metric (world.py)
    ("GET", f"{DASH_API}/runs/{{run_id}}/metrics"): Example(OWNED, lambda w: {"run_id": w.ids.model}),
    ("GET", f"{DASH_API}/runs/{{run_id}}/requests"): Example(OWNED, lambda w: {"run_id": w.ids.model}),
    ("GET", f"{DASH_API}/runs/{{run_id}}/rl_groups"): Example(OWNED, lambda w: {"run_id": w.ids.model}),
    ("GET", f"{DASH_API}/runs/{{run_id}}/trajectories/{{session_id}}"): Example(
        OWNED, lambda w: {"run_id": w.ids.model, "session_id": w.ids.run_trajectory}),
    # login takes the key from its form, not a header: open to anyone, and the owner's key in the form
    # logs anyone in (303 to the dashboard); a wrong key there is tests/dashboard's. Logout needs no session.
    ("POST", f"{DASH}/login"): Example(PUBLIC, body=lambda w, seq: Form(api_key=w.keys["owner"]),
                                       owner_status=frozenset({303})),
    ("POST", f"{DASH}/logout"): Example(PUBLIC, owner_status=frozenset({303})),
    ("GET", f"{DASH}/login"): Example(PUBLIC, owner_status=frozenset({200, 303})),  # 303: logged in already
    ("Mount", f"{DASH}/static"): Example(PUBLIC, lambda w: {"file": "dashboard.css"}),
    # the pages: shells whose scripts read the JSON API above (no data in the HTML). Without a live key or
    # session a page answers 401 with the login form, a browser's way back in; another tenant's run page
    # is the shell with 404, as for a run of nobody's. The landing page is the login form itself then (200):
    # anyone gets a 200 page there, and what it lists comes from /dashboard/api/runs, checked above.
    ("GET", DASH): Example(PUBLIC),
    ("GET", f"{DASH}/"): Example(PUBLIC),
    ("GET", f"{DASH}/compare"): Example(TENANT, refusal_bytes=PAGE),
    ("GET", f"{DASH}/usage"): Example(TENANT, refusal_bytes=PAGE),
    ("GET", f"{DASH}/admin"): Example(TENANT, owner_status=frozenset({403}), refusal_bytes=PAGE),
    ("GET", f"{DASH}/runs/{{run_id}}"): Example(OWNED, lambda w: {"run_id": w.ids.model}, refusal_bytes=PAGE),
    ("GET", f"{DASH}/runs/{{run_id}}/trajectories/{{session_id}}"): Example(
        OWNED, lambda w: {"run_id": w.ids.model, "session_id": w.ids.run_trajectory}, refusal_bytes=PAGE),

    **{(method, f"{OAI}/{{route:path}}"): Example(TENANT, lambda w: {"route": "embeddings"},
                                                  owner_status=frozenset({404})) for method in ANY_METHOD},
    ("GET", "/anthropic/v1/models"): Example(TENANT),
    **{(method, "/anthropic/{route:path}"): Example(TENANT, lambda w: {"route": "v1/files"},
                                                    owner_status=frozenset({404})) for method in ANY_METHOD},
}


def bare_app():
    """The app as create_app builds it, without a server behind it (its route table is all the
    matrix needs at collection time; the matrix checks the running server's table is the same)."""
    return create_app(settings=Settings(), sessions_factory=None, notifier=None,
                      models=ServedModels([ServedModel(SimpleNamespace(name="tiny"), None)]))


def route_table(app) -> list[tuple[str, str]]:
    """(method, path) of every route of `app`. Starlette adds HEAD to each GET route: it is left out."""
    table = []
    for route in app.routes:
        methods = set(getattr(route, "methods", None) or {type(route).__name__})  # a mount or websocket: no methods
        if "GET" in methods:
            methods.discard("HEAD")
        table += [(method, route.path) for method in sorted(methods)]
    return table
