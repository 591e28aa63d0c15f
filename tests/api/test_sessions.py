"""Client sessions over HTTP: what a session records, heartbeats until it is finished, the list."""


def test_a_session_keeps_its_metadata_and_display_name(api):
    http = api.as_tenant(api.key("ada"))
    created = http.post("/create_session", json={"tags": ["x"], "user_metadata": {"step": "7"},
                                                 "display_name": "sweep 3", "sdk_version": "0.38.0"})
    assert created.status_code == 200 and created.json()["type"] == "create_session"
    session = http.get(f"/sessions/{created.json()['session_id']}").json()
    assert session == {"training_run_ids": [], "sampler_ids": [], "user_metadata": {"step": "7", "display_name": "sweep 3"},
                       "display_name": "sweep 3"}


def test_a_session_lists_its_training_runs(api):
    http = api.as_tenant(api.key("ada"))
    session_id = http.post("/create_session", json={}).json()["session_id"]
    model_id = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0, "base_model": "tiny",
                                                "lora_config": {"rank": 4}}).json()["model_id"]
    assert http.get(f"/sessions/{session_id}").json()["training_run_ids"] == [model_id]


def test_heartbeats_are_answered_until_the_session_is_finished(api):
    http = api.as_tenant(api.key("ada"))
    session_id = http.post("/create_session", json={}).json()["session_id"]
    assert http.post("/session_heartbeat", json={"session_id": session_id}).json() == {"type": "session_heartbeat"}
    assert http.post(f"/sessions/{session_id}/finish").status_code == 200
    assert http.post(f"/sessions/{session_id}/finish").status_code == 200  # finishing twice is no error
    late = http.post("/session_heartbeat", json={"session_id": session_id})
    assert late.status_code == 410 and "session finished" in late.text


def test_sessions_are_listed_newest_first_a_page_at_a_time(api):
    http = api.as_tenant(api.key("ada"))
    ids = [http.post("/create_session", json={}).json()["session_id"] for _ in range(5)]
    api.as_tenant(api.key("bob")).post("/create_session", json={})  # another tenant's: never listed
    assert http.get("/sessions").json()["sessions"] == ids[::-1]
    assert http.get("/sessions", params={"limit": 2, "offset": 1}).json()["sessions"] == ids[::-1][1:3]
    assert http.get("/sessions", params={"offset": 5}).json()["sessions"] == []
    for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1}):
        refused = http.get("/sessions", params=bad)
        assert refused.status_code == 422 and next(iter(bad)) in refused.text
