"""Accepting training requests over HTTP, before anything runs: what create_model records, what goes
to the scheduler, retries, and the window of seq_ids a model accepts."""

from api.submit import MAX_SEQ_AHEAD
from db.models import TrainingModel


def new_model(http, seq: int = 0, rank: int = 4) -> dict:
    session_id = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": "tiny", "lora_config": {"rank": rank}}
    answer = http.post("/create_model", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json() | {"body": body}


def test_create_model_records_the_run_and_queues_one_request(api, tiny_info):
    http = api.as_tenant(api.key("ada"))
    created = new_model(http, rank=8)
    (queued,) = api.scheduler.submitted
    assert (queued.id, queued.model_id, queued.seq_id, queued.kind) == (created["request_id"], created["model_id"], 0,
                                                                        "create_model")
    run = http.get(f"/training_runs/{created['model_id']}").json()
    assert run["lora_rank"] == 8 and run["base_model"] == tiny_info.name
    assert run["last_checkpoint"] is None and run["last_sampler_checkpoint"] is None
    info = http.post("/get_info", json={"model_id": created["model_id"]}).json()
    assert info["lora_rank"] == 8 and info["model_name"] == tiny_info.name


def test_a_retried_request_gets_the_original_and_is_queued_once(api):
    http = api.as_tenant(api.key("ada"))
    created = new_model(http)
    again = http.post("/create_model", json=created["body"]).json()
    assert again["request_id"] == created["request_id"] and again["model_id"] == created["model_id"]
    step = {"model_id": created["model_id"], "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first, retry = (http.post("/optim_step", json=step).json() for _ in range(2))
    assert retry["request_id"] == first["request_id"]
    assert [q.kind for q in api.scheduler.submitted] == ["create_model", "optim_step"]


def test_a_seq_id_too_far_ahead_is_refused_naming_it(api):
    """Accepted up to MAX_SEQ_AHEAD past the model's last applied seq_id (-1 before create_model ran)."""
    http = api.as_tenant(api.key("ada"))
    model_id = new_model(http)["model_id"]
    step = lambda seq: http.post("/optim_step", json={"model_id": model_id, "seq_id": seq, "adam_params": {}})
    refused = step(MAX_SEQ_AHEAD)
    assert refused.status_code == 400
    assert refused.json()["detail"] == (f"seq_id: {MAX_SEQ_AHEAD} is more than {MAX_SEQ_AHEAD} beyond the model's "
                                        "next expected seq_id 0")
    assert step(MAX_SEQ_AHEAD - 1).status_code == 200


def test_training_runs_are_listed_newest_first_with_a_cursor(api):
    http = api.as_tenant(api.key("ada"))
    ids = [new_model(http)["model_id"] for _ in range(3)]
    new_model(api.as_tenant(api.key("bob")))  # another tenant's run: never listed, never counted
    page = http.get("/training_runs", params={"limit": 2, "offset": 1}).json()
    assert [r["training_run_id"] for r in page["training_runs"]] == ids[::-1][1:]
    assert page["cursor"] == {"offset": 1, "limit": 2, "total_count": 3}


def test_runs_and_checkpoints_answer_exactly_the_sdks_types(api):
    """One schema: every field the server sends is a field of the SDK's TrainingRun / Checkpoint, so
    reading an answer and writing it back changes nothing (user_metadata included)."""
    from db.models import Checkpoint as CheckpointRow
    from loraplex.types import Checkpoint, TrainingRun

    key = api.key("ada")
    http = api.as_tenant(key)
    model_id = new_model(http)["model_id"]
    with api.sessions() as s:
        run = s.get(TrainingModel, model_id)
        run.user_metadata = {"team": "rl"}
        s.add(CheckpointRow(tenant_id=run.tenant_id, model_id=model_id, kind="sampler", name="v1",
                            tinker_path=f"tinker://{model_id}/sampler_weights/v1", storage_path="/ckpt/v1",
                            size_bytes=123, user_metadata={"step": "1"}))
        s.commit()
    answer = http.get(f"/training_runs/{model_id}").json()
    assert TrainingRun.from_json(answer).to_json() == answer
    assert TrainingRun.from_json(answer).last_sampler_checkpoint.user_metadata == {"step": "1"}
    (checkpoint,) = http.get(f"/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert Checkpoint.from_json(checkpoint).to_json() == checkpoint
    assert TrainingRun.from_json(answer).user_metadata == {"team": "rl"}
