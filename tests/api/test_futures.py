"""retrieve_future over HTTP: a request's stored outcome as the scheduler left it, try_again while it
runs, and a waiting long-poll answered as soon as the scheduler says the request finished."""

import threading
import time

import pytest

from api.routes.futures import RECHECK_SECONDS
from db.models import Request, RequestState
from messaging.notify import Answer
from tests.waiting import wait_until


def accepted_request(api, key: str) -> str:
    """The id of a request the API accepted (a create_model) and the scheduler has not run."""
    http = api.as_tenant(key)
    session_id = http.post("/create_session", json={}).json()["session_id"]
    return http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny",
                                            "lora_config": {"rank": 4}}).json()["request_id"]


def finish(api, request_id: str, **columns) -> None:
    with api.sessions() as s:
        row = s.get(Request, request_id)
        for name, value in columns.items():
            setattr(row, name, value)
        s.commit()


def test_an_unknown_request_is_a_404_naming_it(api):
    answer = api.as_tenant(api.key("ada")).post("/retrieve_future", json={"request_id": "nope"})
    assert answer.status_code == 404 and "request_id" in answer.text and "nope" in answer.text


def test_a_request_not_run_yet_says_try_again_after_the_long_poll(api):
    key = api.key("ada")
    request_id = accepted_request(api, key)
    start = time.monotonic()
    answer = api.as_tenant(key).post("/retrieve_future", json={"request_id": request_id})
    assert answer.json() == {"type": "try_again", "request_id": request_id, "queue_state": "active",
                             "queue_position": 0, "queue_state_reason": "0 requests accepted before it are unfinished"}
    assert time.monotonic() - start >= api.app.state.settings.long_poll_seconds


def test_a_finished_request_answers_its_stored_bytes_as_stored(api):
    key = api.key("ada")
    request_id = accepted_request(api, key)
    finish(api, request_id, state=RequestState.DONE, result=b"\x0a\x03abc", result_content_type="application/x-protobuf")
    answer = api.as_tenant(key).post("/retrieve_future", json={"request_id": request_id})
    assert answer.status_code == 200 and answer.content == b"\x0a\x03abc"
    assert answer.headers["content-type"] == "application/x-protobuf"


def test_a_failed_requests_error_names_no_server_path(api):
    key = api.key("ada")
    request_id = accepted_request(api, key)
    store = api.app.state.settings.store_root
    finish(api, request_id, state=RequestState.FAILED,
           error={"error": f"state at {store}/live/m/state is unreadable", "category": "server"})
    answer = api.as_tenant(key).post("/retrieve_future", json={"request_id": request_id}).json()
    assert answer == {"error": "state at <store>/live/m/state is unreadable", "category": "server"}


@pytest.mark.parametrize("handed_over", [True, False], ids=["answer-handed-over", "read-back"])
def test_a_waiting_long_poll_answers_when_the_scheduler_says_the_request_finished(api, handed_over):
    """In one process the scheduler hands the committed answer over (the row is left pending here, so
    only the hand-over can answer); a bare wake-up (another process's scheduler) makes the long-poll
    read the answer back from the database, sooner than its periodic re-read."""
    api.app.state.settings = api.app.state.settings.model_copy(update={"long_poll_seconds": 30})
    key = api.key("ada")
    request_id = accepted_request(api, key)
    answers = []
    poll = threading.Thread(target=lambda: answers.append(
        api.as_tenant(key).post("/retrieve_future", json={"request_id": request_id})))
    poll.start()
    waiters = api.app.state.notifier._waiters  # a long-poll registers there before it reads the row
    wait_until(lambda: request_id in waiters, "the long-poll to wait", timeout=30)
    notified = time.monotonic()
    if handed_over:
        api.app.state.notifier.notify(request_id, Answer(b'{"done": 1}', "application/json", None))
    else:
        finish(api, request_id, state=RequestState.DONE, result=b"{}", result_content_type="application/json")
        api.app.state.notifier.notify(request_id)
    poll.join(30)
    assert time.monotonic() - notified < RECHECK_SECONDS, "the long-poll was not woken"
    assert answers[0].json() == ({"done": 1} if handed_over else {})
