"""`loraplex-admin projects` and `loraplex-admin audit`: what an operator sees of projects and of who
did what."""

from __future__ import annotations

import json

from tests.admin.cli import admin_cli, printed_key


def test_projects_are_listed_per_tenant_and_operator_actions_are_audited(tmp_path):
    admin = admin_cli(tmp_path)
    admin("tenants", "create", "alice")
    key = printed_key(admin("keys", "issue", "alice"))
    admin("tenants", "create", "bob")
    assert "created" in admin("projects", "create", "alice", "archive")
    assert "exists already" in admin("projects", "create", "alice", "archive")
    admin("projects", "create", "bob", "archive")
    assert "a project name is" in admin("projects", "create", "alice", "no spaces", ok=False)
    admin("quotas", "set", "alice", "--max-live-models", "3")
    admin("keys", "revoke", key[:12])
    admin("tenants", "disable", "bob")

    listed = json.loads(admin("projects", "list", "--json"))
    assert [(p["tenant"], p["project"], p["sessions"], p["checkpoints"]) for p in listed] == \
        [("alice", "archive", 0, 0), ("bob", "archive", 0, 0)]
    assert [p["tenant"] for p in json.loads(admin("projects", "list", "alice", "--json"))] == ["alice"]

    events = json.loads(admin("audit", "--json"))
    assert [(e["tenant"], e["event"]) for e in events] == [
        ("alice", "tenant_create"), ("alice", "api_key_issue"), ("bob", "tenant_create"),
        ("alice", "project_create"), ("bob", "project_create"), ("alice", "quota_set"),
        ("alice", "api_key_revoke"), ("bob", "tenant_disable")]
    assert all(e["actor"] == "operator" for e in events)
    assert events[5]["details"] == {"max_live_models": 3}
    assert events[6]["details"] == {"api_key": key[:12] + "..."}  # never the key itself
    only = json.loads(admin("audit", "--tenant", "alice", "--category", "projects", "--json"))
    assert [e["event"] for e in only] == ["project_create"]
    assert [e["event"] for e in json.loads(admin("audit", "--limit", "1", "--json"))] == ["tenant_disable"]
    assert "one of checkpoints" in admin("audit", "--category", "billing", ok=False)
