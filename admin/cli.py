"""`loraplex-admin`: tenants, API keys, quotas, checkpoints and usage, for operators.

It works on the database directly, so it serves the embedded deployment (SQLite under the data
dir) and the distributed one (LORAPLEX_DATABASE_URL=postgresql+psycopg://...) alike:

    loraplex-admin tenants create alice            # prints alice's first API key, once
    loraplex-admin keys revoke tml-AbCdEfGh        # by the prefix `keys list` shows
    loraplex-admin quotas set alice --max-live-models 4 --train-tokens-per-day 1000000
    loraplex-admin quotas set alice --rollout-ttl-seconds 604800 --max-rollout-bytes 1000000000
    loraplex-admin checkpoints prune-expired
    loraplex-admin usage --days 7
    loraplex-admin models state MODEL_ID           # its stored training state, verified, and what a rebuild uses
    loraplex-admin models rebuild MODEL_ID         # after "cannot be restored": last verified base + replay
    loraplex-admin checkpoints list --json         # every list command: --json for scripts
    loraplex-admin trainers                        # the running trainers' memory: resident, paged, page-ins
    loraplex-admin projects list alice             # alice's projects: sessions, runs, checkpoints in each
    loraplex-admin audit --tenant alice --category checkpoints   # who copied, deleted, published what
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import sqlalchemy as sa
import typer

from admin.audit_cli import audit_log
from admin.common import console, session, sessions, state, tenant_named
from admin.models_cli import _checkpoint, models_app
from admin.operator_keys_cli import operator_keys_app
from admin.projects_cli import projects_app
from admin.trainers_cli import trainers
from admin.output import JSON_OPTION, human_bytes, show
from db import audit
from db import usage as usage_queries
from db.models import QUOTA_FIELDS, ApiKey, Checkpoint, Quota, Tenant, TrainingModel, utcnow
from db.tenants import create_tenant, issue_key
from service.settings import Settings
from storage import store

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.split("\n\n")[0])
tenants_app = typer.Typer(no_args_is_help=True, help="create, list, disable, enable")
keys_app = typer.Typer(no_args_is_help=True, help="issue, list, revoke")
quotas_app = typer.Typer(no_args_is_help=True, help="set, show")
checkpoints_app = typer.Typer(no_args_is_help=True, help="list, export, delete, prune-expired")
for sub, name in ((tenants_app, "tenants"), (keys_app, "keys"), (quotas_app, "quotas"), (checkpoints_app, "checkpoints"),
                  (models_app, "models"), (operator_keys_app, "operator-keys"), (projects_app, "projects")):
    app.add_typer(sub, name=name)


@app.callback()
def main(
    database_url: str | None = typer.Option(None, envvar="LORAPLEX_DATABASE_URL", help="default: SQLite in the data dir"),
    data_dir: Path | None = typer.Option(None, envvar="LORAPLEX_DATA_DIR", help="the embedded server's data dir"),
) -> None:
    _quiet_progress_bars()
    overrides = {k: v for k, v in {"database_url": database_url, "data_dir": data_dir}.items() if v}
    state["settings"] = settings = Settings(**overrides)
    store.use_cache_dir(settings.store_cache)


def _quiet_progress_bars() -> None:
    """The base model's loading bars (transformers, huggingface_hub) are noise among the CLI's lines:
    off before either is imported (the variable), and in a process that imported them already."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


# --- tenants -------------------------------------------------------------------------------------


@tenants_app.command("create")
def tenants_create(name: str) -> None:
    """Create a tenant; its first API key is printed once (only a hash is stored)."""
    with session() as s:
        try:
            tenant, key = create_tenant(s, name)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="NAME") from None
        audit.record(s, tenant.id, "organizations", "tenant_create", audit.OPERATOR, tenant=name,
                     api_key=key[:12] + "...")
        s.commit()
    console.print(f"tenant {name!r} created; API key (shown once):")
    print(key)


@tenants_app.command("list")
def tenants_list(as_json: bool = JSON_OPTION) -> None:
    with session() as s:
        rows = [{"name": t.name, "id": t.id, "state": "disabled" if t.disabled else "active", "created": t.created_at}
                for t in s.scalars(sa.select(Tenant).order_by(Tenant.created_at))]
    show("tenants", rows, ["name", "id", "state", "created"], as_json)


def _set_disabled(name: str, disabled: bool) -> None:
    with session() as s:
        tenant = tenant_named(s, name)
        tenant.disabled = disabled
        audit.record(s, tenant.id, "organizations", "tenant_disable" if disabled else "tenant_enable", audit.OPERATOR,
                     tenant=name)
        s.commit()
    console.print(f"tenant {name!r} {'disabled: its keys stop working now' if disabled else 'enabled'}")


@tenants_app.command("disable")
def tenants_disable(name: str) -> None:
    """Every key of the tenant stops working at once; nothing is deleted."""
    _set_disabled(name, True)


@tenants_app.command("enable")
def tenants_enable(name: str) -> None:
    _set_disabled(name, False)


# --- keys ----------------------------------------------------------------------------------------


@keys_app.command("issue")
def keys_issue(tenant: str) -> None:
    """Issue another API key for TENANT, printed once."""
    with session() as s:
        owner = tenant_named(s, tenant)
        key = issue_key(s, owner)
        audit.record(s, owner.id, "organizations", "api_key_issue", audit.OPERATOR, api_key=key[:12] + "...")
        s.commit()
    console.print(f"new API key of tenant {tenant!r} (shown once, only its hash is stored):", highlight=False)
    print(key)


@keys_app.command("list")
def keys_list(tenant: str | None = typer.Argument(None), as_json: bool = JSON_OPTION) -> None:
    with session() as s:
        query = sa.select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.created_at)
        if tenant:
            query = query.where(ApiKey.tenant_id == tenant_named(s, tenant).id)
        rows = [{"tenant": name, "key": k.key_prefix + "...", "created": k.created_at,
                     "state": "revoked" if k.revoked_at else "active", "revoked": k.revoked_at}
                for k, name in s.execute(query)]
    show("API keys", rows, ["tenant", "key", "created", "state", "revoked"], as_json)


@keys_app.command("revoke")
def keys_revoke(key_prefix: str = typer.Argument(..., help="the key's first characters, as `keys list` shows")) -> None:
    """Revoke a key: requests with it fail from now on."""
    with session() as s:
        prefix = key_prefix.removesuffix("...")
        matches = s.scalars(sa.select(ApiKey).where(ApiKey.key_prefix.startswith(prefix[:12]))).all()
        matches = [k for k in matches if prefix.startswith(k.key_prefix) or k.key_prefix.startswith(prefix)]
        if len(matches) != 1:
            raise typer.BadParameter(f"{len(matches)} keys match {key_prefix!r}; give more characters", param_hint="KEY_PREFIX")
        matches[0].revoked_at = utcnow()
        audit.record(s, matches[0].tenant_id, "organizations", "api_key_revoke", audit.OPERATOR,
                     api_key=matches[0].key_prefix + "...")
        s.commit()
    console.print(f"key {matches[0].key_prefix}... revoked")


# --- quotas --------------------------------------------------------------------------------------


def _limit(value: str | None, field: str) -> int | None | str:
    """'none' clears a limit; an integer sets it; no option leaves it as it is."""
    if value is None:
        return "keep"
    if value.lower() == "none":
        return None
    if not value.isdigit():
        raise typer.BadParameter(f"a whole number or 'none', got {value!r}", param_hint=f"--{field.replace('_', '-')}")
    return int(value)


@quotas_app.command("set")
def quotas_set(
    tenant: str,
    max_live_models: str | None = typer.Option(None, help="models not deleted"),
    max_lora_rank: str | None = typer.Option(None),
    train_tokens_per_day: str | None = typer.Option(None, help="forward/forward_backward input tokens, from 00:00 UTC"),
    sample_tokens_per_day: str | None = typer.Option(None, help="prompt + generated tokens, from 00:00 UTC"),
    max_concurrent_requests: str | None = typer.Option(None, help="accepted and not finished"),
    max_checkpoint_bytes: str | None = typer.Option(None, help="bytes of stored checkpoints"),
    rollout_ttl_seconds: str | None = typer.Option(
        None, help="rollout-store trajectories untouched this long are deleted by the janitor"),
    max_rollout_bytes: str | None = typer.Option(None, help="bytes of stored rollouts; past it recordings are refused"),
) -> None:
    """Set limits (a number, or 'none' for no limit); options not given keep their value."""
    given = {"max_live_models": max_live_models, "max_lora_rank": max_lora_rank, "train_tokens_per_day": train_tokens_per_day,
                 "sample_tokens_per_day": sample_tokens_per_day, "max_concurrent_requests": max_concurrent_requests,
                 "max_checkpoint_bytes": max_checkpoint_bytes, "rollout_ttl_seconds": rollout_ttl_seconds,
                 "max_rollout_bytes": max_rollout_bytes}
    with session() as s:
        owner = tenant_named(s, tenant)
        quota = s.get(Quota, owner.id) or Quota(tenant_id=owner.id)
        for field, raw in given.items():
            value = _limit(raw, field)
            if value != "keep":
                setattr(quota, field, value)
        s.add(quota)
        audit.record(s, owner.id, "organizations", "quota_set", audit.OPERATOR,
                     **{field: getattr(quota, field) for field in QUOTA_FIELDS})
        s.commit()
    quotas_show(tenant)


@quotas_app.command("show")
def quotas_show(tenant: str) -> None:
    with session() as s:
        quota = s.get(Quota, tenant_named(s, tenant).id)
        rows = [{"limit": f, "value": getattr(quota, f) if quota and getattr(quota, f) is not None else "no limit"}
                for f in QUOTA_FIELDS]
    show(f"quotas of {tenant}", rows, ["limit", "value"])


# --- checkpoints ---------------------------------------------------------------------------------


@checkpoints_app.command("list")
def checkpoints_list(tenant: str | None = typer.Option(None), run: str | None = typer.Option(None),
                     as_json: bool = JSON_OPTION) -> None:
    """Every checkpoint, its full tinker:// path (never cut: pipe it, or --json for scripts)."""
    with session() as s:
        query = sa.select(Checkpoint, Tenant.name).join(Tenant, Tenant.id == Checkpoint.tenant_id).order_by(Checkpoint.created_at)
        if tenant:
            query = query.where(Checkpoint.tenant_id == tenant_named(s, tenant).id)
        if run:
            query = query.where(Checkpoint.model_id == run)
        rows = [{"tenant": name, "path": c.tinker_path, "kind": c.kind, "size_bytes": c.size_bytes, "created": c.created_at,
                     "expires": c.expires_at} for c, name in s.execute(query)]
    show("checkpoints", rows, ["tenant", "path", "kind", "size_bytes", "created", "expires"], as_json,
         shown={"size_bytes": human_bytes, "expires": lambda at: at.isoformat(timespec="seconds") if at else "never"})


@checkpoints_app.command("export")
def checkpoints_export(tinker_path: str, dest: Path) -> None:
    """Write a checkpoint's adapter to DEST as a PEFT folder."""
    from models.registry import model_info
    from storage.peft_export import export_peft

    with session() as s:
        row = _checkpoint(s, tinker_path)
        model = s.get(TrainingModel, row.model_id)
    if dest.exists():
        raise typer.BadParameter(f"{dest} exists", param_hint="DEST")
    settings = state["settings"]
    export_peft(row.storage_path, dest, model_info(settings.model_source(model.base_model), settings.model_cache).path)
    console.print(f"{tinker_path} -> {dest}")


@checkpoints_app.command("delete")
def checkpoints_delete(tinker_path: str) -> None:
    from db.checkpoints import delete_checkpoint

    with session() as s:
        row = _checkpoint(s, tinker_path)
        delete_checkpoint(s, row)
        audit.record(s, row.tenant_id, "checkpoints", "checkpoint_delete", audit.OPERATOR, model_id=row.model_id,
                     tinker_path=row.tinker_path)
        s.commit()
    console.print(f"{tinker_path} deleted")


@checkpoints_app.command("prune-expired")
def checkpoints_prune_expired() -> None:
    """Delete every checkpoint whose TTL has passed, ephemeral sampler snapshots that are superseded and
    unused, and rollout trajectories past their tenant's rollout TTL (what the server's janitor does
    every minute: scheduler/janitor.py)."""
    from scheduler.janitor import sweep

    expired, ephemeral, trajectories = sweep(sessions(), state["settings"].ephemeral_snapshot_grace_seconds)
    console.print(f"{expired} expired checkpoints and {ephemeral} ephemeral snapshots deleted; "
                  f"{trajectories} expired rollout trajectories deleted")


# --- usage ---------------------------------------------------------------------------------------


@app.command("usage")
def usage(tenant: str | None = typer.Option(None), days: int = typer.Option(1, min=1, help="token window, from 00:00 UTC"),
          as_json: bool = JSON_OPTION) -> None:
    """Tokens trained and sampled, checkpoint storage and models, per tenant."""
    with session() as s:
        tenants = [tenant_named(s, tenant)] if tenant else s.scalars(sa.select(Tenant).order_by(Tenant.name)).all()
        rows = []
        for t in tenants:
            u = usage_queries.usage(s, t.id, days)
            rows.append({"tenant": t.name, "tokens_trained": u.tokens_trained, "tokens_sampled": u.tokens_sampled,
                             "storage_bytes": u.storage_bytes, "live_models": u.live_models, "in_flight": u.requests_in_flight})
    show(f"usage (tokens: last {days} day(s))", rows, ["tenant", "tokens_trained", "tokens_sampled", "storage_bytes",
                                                       "live_models", "in_flight"], as_json, shown={"storage_bytes": human_bytes})


app.command("trainers")(trainers)
app.command("audit")(audit_log)


if __name__ == "__main__":
    app()
