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
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import sqlalchemy as sa
import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy.orm import Session

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
models_app = typer.Typer(no_args_is_help=True, help="state, rebuild, reset: a model's stored training state")
for sub, name in ((tenants_app, "tenants"), (keys_app, "keys"), (quotas_app, "quotas"), (checkpoints_app, "checkpoints"),
                  (models_app, "models")):
    app.add_typer(sub, name=name)
console = Console(emoji=False)  # else ":train:" in model ids prints as an emoji
_state: dict = {}


@app.callback()
def main(
    database_url: Optional[str] = typer.Option(None, envvar="LORAPLEX_DATABASE_URL", help="default: SQLite in the data dir"),
    data_dir: Optional[Path] = typer.Option(None, envvar="LORAPLEX_DATA_DIR", help="the embedded server's data dir"),
) -> None:
    overrides = {k: v for k, v in dict(database_url=database_url, data_dir=data_dir).items() if v}
    _state["settings"] = settings = Settings(**overrides)
    store.use_cache_dir(settings.store_cache)


def sessions():
    from db.session import make_engine, make_session_factory, upgrade_to_head

    settings: Settings = _state["settings"]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.resolved_database_url
    upgrade_to_head(url)
    return make_session_factory(make_engine(url))


def session() -> Session:
    return sessions()()


def tenant_named(s: Session, name: str) -> Tenant:
    tenant = s.scalar(sa.select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise typer.BadParameter(f"no tenant {name!r}", param_hint="TENANT")
    return tenant


def show(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*["" if v is None else str(v) for v in row])
    console.print(table)


# --- tenants -------------------------------------------------------------------------------------


@tenants_app.command("create")
def tenants_create(name: str) -> None:
    """Create a tenant; its first API key is printed once (only a hash is stored)."""
    with session() as s:
        try:
            _, key = create_tenant(s, name)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="NAME") from None
    console.print(f"tenant {name!r} created; API key (shown once):")
    print(key)


@tenants_app.command("list")
def tenants_list() -> None:
    with session() as s:
        rows = [[t.name, t.id, "disabled" if t.disabled else "active", t.created_at.isoformat(timespec="seconds")]
                for t in s.scalars(sa.select(Tenant).order_by(Tenant.created_at))]
    show("tenants", ["name", "id", "state", "created"], rows)


def _set_disabled(name: str, disabled: bool) -> None:
    with session() as s:
        tenant_named(s, name).disabled = disabled
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
        key = issue_key(s, tenant_named(s, tenant))
    print(key)


@keys_app.command("list")
def keys_list(tenant: Optional[str] = typer.Argument(None)) -> None:
    with session() as s:
        query = sa.select(ApiKey, Tenant.name).join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(ApiKey.created_at)
        if tenant:
            query = query.where(ApiKey.tenant_id == tenant_named(s, tenant).id)
        rows = [[name, k.key_prefix + "...", k.created_at.isoformat(timespec="seconds"),
                 k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else "active"] for k, name in s.execute(query)]
    show("API keys", ["tenant", "key", "created", "revoked"], rows)


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
        s.commit()
    console.print(f"key {matches[0].key_prefix}... revoked")


# --- quotas --------------------------------------------------------------------------------------


def _limit(value: Optional[str], field: str) -> int | None | str:
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
    max_live_models: Optional[str] = typer.Option(None, help="models not deleted"),
    max_lora_rank: Optional[str] = typer.Option(None),
    train_tokens_per_day: Optional[str] = typer.Option(None, help="forward/forward_backward input tokens, from 00:00 UTC"),
    sample_tokens_per_day: Optional[str] = typer.Option(None, help="prompt + generated tokens, from 00:00 UTC"),
    max_concurrent_requests: Optional[str] = typer.Option(None, help="accepted and not finished"),
    max_checkpoint_bytes: Optional[str] = typer.Option(None, help="bytes of stored checkpoints"),
    rollout_ttl_seconds: Optional[str] = typer.Option(
        None, help="rollout-store trajectories untouched this long are deleted by the janitor"),
    max_rollout_bytes: Optional[str] = typer.Option(None, help="bytes of stored rollouts; past it recordings are refused"),
) -> None:
    """Set limits (a number, or 'none' for no limit); options not given keep their value."""
    given = dict(max_live_models=max_live_models, max_lora_rank=max_lora_rank, train_tokens_per_day=train_tokens_per_day,
                 sample_tokens_per_day=sample_tokens_per_day, max_concurrent_requests=max_concurrent_requests,
                 max_checkpoint_bytes=max_checkpoint_bytes, rollout_ttl_seconds=rollout_ttl_seconds,
                 max_rollout_bytes=max_rollout_bytes)
    with session() as s:
        owner = tenant_named(s, tenant)
        quota = s.get(Quota, owner.id) or Quota(tenant_id=owner.id)
        for field, raw in given.items():
            value = _limit(raw, field)
            if value != "keep":
                setattr(quota, field, value)
        s.add(quota)
        s.commit()
    quotas_show(tenant)


@quotas_app.command("show")
def quotas_show(tenant: str) -> None:
    with session() as s:
        quota = s.get(Quota, tenant_named(s, tenant).id)
        rows = [[f, getattr(quota, f) if quota and getattr(quota, f) is not None else "no limit"] for f in QUOTA_FIELDS]
    show(f"quotas of {tenant}", ["limit", "value"], rows)


# --- checkpoints ---------------------------------------------------------------------------------


def _checkpoint(s: Session, tinker_path: str) -> Checkpoint:
    row = s.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == tinker_path))
    if row is None:
        raise typer.BadParameter(f"no checkpoint {tinker_path!r}", param_hint="TINKER_PATH")
    return row


@checkpoints_app.command("list")
def checkpoints_list(tenant: Optional[str] = typer.Option(None), run: Optional[str] = typer.Option(None)) -> None:
    with session() as s:
        query = sa.select(Checkpoint, Tenant.name).join(Tenant, Tenant.id == Checkpoint.tenant_id).order_by(Checkpoint.created_at)
        if tenant:
            query = query.where(Checkpoint.tenant_id == tenant_named(s, tenant).id)
        if run:
            query = query.where(Checkpoint.model_id == run)
        rows = [[name, c.tinker_path, c.kind, c.size_bytes, c.created_at.isoformat(timespec="seconds"),
                 c.expires_at.isoformat(timespec="seconds") if c.expires_at else "never"] for c, name in s.execute(query)]
    show("checkpoints", ["tenant", "path", "kind", "bytes", "created", "expires"], rows)


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
    settings = _state["settings"]
    export_peft(row.storage_path, dest, model_info(settings.model_source(model.base_model), settings.model_cache).path)
    console.print(f"{tinker_path} -> {dest}")


@checkpoints_app.command("delete")
def checkpoints_delete(tinker_path: str) -> None:
    from db.checkpoints import delete_checkpoint

    with session() as s:
        delete_checkpoint(s, _checkpoint(s, tinker_path))
        s.commit()
    console.print(f"{tinker_path} deleted")


@checkpoints_app.command("prune-expired")
def checkpoints_prune_expired() -> None:
    """Delete every checkpoint whose TTL has passed, ephemeral sampler snapshots that are superseded and
    unused, and rollout trajectories past their tenant's rollout TTL (what the server's janitor does
    every minute: scheduler/janitor.py)."""
    from scheduler.janitor import sweep

    expired, ephemeral, trajectories = sweep(sessions(), _state["settings"].ephemeral_snapshot_grace_seconds)
    console.print(f"{expired} expired checkpoints and {ephemeral} ephemeral snapshots deleted; "
                  f"{trajectories} expired rollout trajectories deleted")


# --- models: their stored training state ---------------------------------------------------------


def _live_model(s: Session, model_id: str) -> TrainingModel:
    model = s.get(TrainingModel, model_id)
    if model is None or model.deleted_at is not None:
        raise typer.BadParameter(f"no live model {model_id!r}", param_hint="MODEL_ID")
    return model


def _engine(model: TrainingModel):
    """A trainer engine on the model's base model, set up as the server's (this process replays on it)."""
    from models.registry import model_info
    from workers.trainer.engine import TrainerEngine

    settings: Settings = _state["settings"]
    return TrainerEngine(model_info(settings.model_source(model.base_model), settings.model_cache).path,
                         max_rank=max(settings.max_lora_rank, model.lora_config["rank"]),
                         min_shared_prefix=settings.trainer_min_shared_prefix,
                         keep_glibc_malloc_defaults=settings.keep_glibc_malloc_defaults)


def _fail(message: str) -> None:
    console.print(f"[red]{message}[/red]", highlight=False)
    raise typer.Exit(1)


@models_app.command("state")
def models_state(model_id: str) -> None:
    """The model's stored training states (verified, or what is wrong) and the bases a rebuild could use."""
    from admin.model_state import bases
    from storage.checkpoint_files import CheckpointError, verify_training_state
    from storage.live_slots import read_slots

    settings: Settings = _state["settings"]
    with session() as s:
        model = _live_model(s, model_id)
        rows = []
        for slot in read_slots(settings.live_dir, model.id):
            try:
                verify_training_state(slot.path)
                check = "verified"
            except CheckpointError as e:
                check = str(e)
            m = slot.manifest or {}
            rows.append([slot.label, slot.path, slot.seq if m else None, m.get("step"), slot.lineage, check])
        show(f"stored training state of {model.id} (last applied seq_id {model.last_applied_seq_id})",
             ["slot", "location", "after seq_id", "step", "history from seq_id", "check"], rows)
        show("bases a rebuild could start from (latest first)", ["base", "replays after seq_id", "usable"],
             [[b.what, b.seq, b.problem or "yes"] for b in bases(s, model, settings.live_dir)])


@models_app.command("rebuild")
def models_rebuild(model_id: str) -> None:
    """Rebuild the model's stored state from its latest verified base (a stored state, one of its
    training-state checkpoints, or its create_model / load_weights) and the requests after it."""
    from admin.model_state import bases, rebuild

    settings: Settings = _state["settings"]
    factory = sessions()
    with factory() as s:
        model = _live_model(s, model_id)
        found = bases(s, model, settings.live_dir)
        usable = [b for b in found if b.problem is None]
        if not usable:
            _fail(f"{model_id}: nothing to rebuild from: " + ("; ".join(f"{b.what}: {b.problem}" for b in found)
                                                            or "no create_model or load_weights of it finished"))
        base = usable[0]
        console.print(f"{model_id}: rebuilding from {base.what}, replaying its requests after seq_id {base.seq} "
                      f"up to {model.last_applied_seq_id}", highlight=False)
        try:
            replayed = rebuild(s, factory, model, settings, base, _engine(model))
        except RuntimeError as e:
            _fail(f"{model_id}: {e}")
    console.print(f"{model_id}: rebuilt ({replayed} request{'' if replayed == 1 else 's'} replayed); its stored state after seq_id "
                  f"{model.last_applied_seq_id} is written and verified", highlight=False)


@models_app.command("reset")
def models_reset(model_id: str, tinker_path: str,
                 yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
    """Make a training-state checkpoint (TINKER_PATH, of the same tenant) the model's state from now on.
    The requests after that checkpoint stay answered, but their effect on the weights is dropped."""
    from admin.model_state import reset

    with session() as s:
        model = _live_model(s, model_id)
        row = _checkpoint(s, tinker_path)
        if row.tenant_id != model.tenant_id or row.kind != "training_state":
            raise typer.BadParameter(f"{tinker_path!r} is not a training-state checkpoint of this model's tenant",
                                     param_hint="TINKER_PATH")
        if not yes:
            typer.confirm(f"{model_id} continues from {tinker_path}; the effect of its requests after that "
                          "checkpoint on the weights is dropped. Go on?", abort=True)
        try:
            reset(model, _state["settings"], row, _engine(model))
        except RuntimeError as e:
            _fail(f"{model_id}: {e}")
    console.print(f"{model_id}: its stored state is now {tinker_path} (after seq_id {model.last_applied_seq_id})",
                  highlight=False)


# --- usage ---------------------------------------------------------------------------------------


@app.command("usage")
def usage(tenant: Optional[str] = typer.Option(None), days: int = typer.Option(1, min=1, help="token window, from 00:00 UTC")) -> None:
    """Tokens trained and sampled, checkpoint storage and models, per tenant."""
    with session() as s:
        tenants = [tenant_named(s, tenant)] if tenant else s.scalars(sa.select(Tenant).order_by(Tenant.name)).all()
        rows = []
        for t in tenants:
            u = usage_queries.usage(s, t.id, days)
            rows.append([t.name, u.tokens_trained, u.tokens_sampled, u.storage_bytes, u.live_models, u.requests_in_flight])
    show(f"usage (tokens: last {days} day(s))", ["tenant", "tokens trained", "tokens sampled", "storage bytes",
                                                 "live models", "in flight"], rows)


# --- operator keys: the dashboard's admin view -------------------------------------------------------

operator_keys_app = typer.Typer(no_args_is_help=True, help="issue, revoke: keys for the dashboard's admin view")
app.add_typer(operator_keys_app, name="operator-keys")


@operator_keys_app.command("issue")
def operator_keys_issue() -> None:
    """Issue an operator key (tmo-...), printed once: it logs into /dashboard and sees every tenant."""
    from db.operator_keys import issue_operator_key

    with session() as s:
        print(issue_operator_key(s))


@operator_keys_app.command("revoke")
def operator_keys_revoke(key_prefix: str = typer.Argument(..., help="the key's first characters (tmo-...)")) -> None:
    """Revoke operator keys by prefix: their dashboard sessions end at once."""
    from db.operator_keys import revoke_operator_key

    with session() as s:
        count = revoke_operator_key(s, key_prefix.removesuffix("..."))
    console.print(f"{count} operator key(s) revoked")


if __name__ == "__main__":
    app()
