"""The official SDK's search_sessions against a real embedded server: filters, pages and projects, within
the caller's tenant only."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.slow  # two servers (SQLite; Postgres with the engine in a child process)


def search(rest: tinker.RestClient, **filters) -> types.SessionSearchResponse:
    return rest.search_sessions(types.SessionSearchRequest(**filters)).result()


@pytest.mark.filterwarnings("ignore::tinker.ExperimentalWarning")
def test_search_sessions_filters_pages_and_stays_in_the_tenant(server):
    key, other_key = server.new_tenant(), server.new_tenant()
    made = {}
    for name, recipe in (("nightly sft", "sft"), ("Nightly RL", "rl"), ("weekly eval", "eval")):
        client = tinker.ServiceClient({"recipe": recipe}, display_name=name, base_url=server.base_url, api_key=key)
        made[name] = client
    theirs = tinker.ServiceClient({"recipe": "sft"}, display_name="nightly sft", base_url=server.base_url,
                                  api_key=other_key)
    ids = {name: c.holder.get_session_id() for name, c in made.items()}  # created in this order
    theirs_id = theirs.holder.get_session_id()
    tc = made["weekly eval"].create_lora_training_client(base_model="tiny", rank=4).result()
    tc.save_state("kept").result()
    made["Nightly RL"].close("success").result()
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)

    newest_first = [ids["weekly eval"], ids["Nightly RL"], ids["nightly sft"]]
    assert [s.session_id for s in search(rest).sessions] == newest_first
    assert [s.session_id for s in search(rest, display_name="NIGHTLY").sessions] == newest_first[1:]
    assert [s.session_id for s in search(rest, display_name="sft nightly").sessions] == [ids["nightly sft"]]
    assert [s.session_id for s in search(rest, user_metadata={"recipe": "rl"}).sessions] == [ids["Nightly RL"]]
    either = search(rest, session_id=ids["weekly eval"], display_name="sft").sessions
    assert [s.session_id for s in either] == [ids["weekly eval"], ids["nightly sft"]]
    assert search(rest, session_id=theirs_id).sessions == []  # another tenant's session: not found, not named

    finished = search(rest, statuses=[types.ClientFinishedSessionStatusQuery()]).sessions
    assert [s.session_id for s in finished] == [ids["Nightly RL"]] and finished[0].status is None
    active = search(rest, statuses=[types.ActiveSessionStatusQuery()]).sessions
    assert [s.session_id for s in active] == [ids["weekly eval"], ids["nightly sft"]]
    assert all(s.status.type == "active" for s in active)
    assert search(rest, statuses=[types.FailedSessionStatusQuery(), types.CancelledSessionStatusQuery()]).sessions == []
    with pytest.raises(tinker.BadRequestError, match=r"statuses\[0\]\.reasons"):
        search(rest, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["success"])])
    with pytest.raises(tinker.BadRequestError, match="user_metadata: a key with"):
        search(rest, user_metadata={'say "hi"': "x"})

    (summary,) = search(rest, session_id=ids["weekly eval"]).sessions
    assert summary.display_name == "weekly eval" and summary.user_metadata["recipe"] == "eval"
    assert summary.checkpoints_count == 1 and summary.checkpoint_storage_bytes > 0
    assert summary.owner == rest.get_training_run(tc.model_id).result().model_owner

    # a page at a time: every session once, newest first, then no cursor
    pages, request = [], types.SessionSearchRequest(limit=1)
    while True:
        page = rest.search_sessions(request).result()
        pages.append([s.session_id for s in page.sessions])
        if page.next_cursor is None:
            break
        request = request.model_copy(update={"cursor": page.next_cursor})
    assert pages == [[i] for i in newest_first]

    assert search(rest, owner=types.AccessibleSearchOwner()).sessions == search(rest).sessions
    assert search(rest, owner=types.UserSearchOwner(owner_urns=["someone-else"])).sessions == []
    other = tinker.RestClient(base_url=server.base_url, api_key=other_key)
    assert [s.session_id for s in search(other, display_name="nightly").sessions] == [theirs_id]


@pytest.mark.filterwarnings("ignore::tinker.ExperimentalWarning")
def test_search_sessions_by_project(server):
    key = server.new_tenant()
    filed = tinker.ServiceClient(project_id="team-a", base_url=server.base_url, api_key=key).holder.get_session_id()
    loose = tinker.ServiceClient(base_url=server.base_url, api_key=key).holder.get_session_id()
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    (found,) = search(rest, project_ids=["team-a"]).sessions
    assert found.session_id == filed and found.project_id == "team-a"
    assert [s.project_id for s in search(rest, session_id=loose).sessions] == [""]  # in no project
    with pytest.raises(tinker.NotFoundError, match="project_ids: no project 'team-b'"):
        search(rest, project_ids=["team-a", "team-b"])
    other = tinker.RestClient(base_url=server.base_url, api_key=server.new_tenant())
    with pytest.raises(tinker.NotFoundError, match="project_ids: no project 'team-a'"):  # names are per tenant
        search(other, project_ids=["team-a"])
