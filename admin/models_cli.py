"""`loraplex-admin models state | rebuild | reset`: a model's stored training state (admin/model_state.py)."""

from __future__ import annotations

from datetime import timedelta

import typer
from sqlalchemy.orm import Session

from admin.common import console, fail, session, sessions, settings, state
from admin.output import show
from db.models import Checkpoint, TrainingModel, utcnow

models_app = typer.Typer(no_args_is_help=True, help="state, rebuild, reset: a model's stored training state")


def _live_model(s: Session, model_id: str) -> TrainingModel:
    model = s.get(TrainingModel, model_id)
    if model is None or model.deleted_at is not None:
        raise typer.BadParameter(f"no live model {model_id!r}", param_hint="MODEL_ID")
    return model


def _checkpoint(s: Session, tinker_path: str) -> Checkpoint:
    import sqlalchemy as sa

    row = s.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == tinker_path))
    if row is None:
        raise typer.BadParameter(f"no checkpoint {tinker_path!r}", param_hint="TINKER_PATH")
    return row


def _engine(model: TrainingModel):
    """A trainer engine on the model's base model, set up as the server's (this process replays on it)."""
    from models.registry import model_info
    from workers.trainer.engine import TrainerEngine

    current = settings()
    return TrainerEngine(model_info(current.model_source(model.base_model), current.model_cache).path,
                         max_rank=max(current.max_lora_rank, model.lora_config["rank"]),
                         min_shared_prefix=current.trainer_min_shared_prefix,
                         keep_glibc_malloc_defaults=current.keep_glibc_malloc_defaults)


def refuse_while_served(s: Session, model_id: str, what: str) -> None:
    """Fail while a scheduler beats on this database (scheduler/liveness.py): the engines it feeds hold
    the models' weights in memory and write them out after each step, over what this command wrote."""
    from db.scheduler_beats import live_schedulers

    running = live_schedulers(s)
    if running:
        ago = (utcnow() - running[0].beat_at) / timedelta(seconds=1)
        fail(f"{model_id}: not {what}: a Loraplex scheduler is running on this database (pid {running[0].pid} on "
             f"{running[0].host}, last beat {ago:.0f} s ago). The trainer it feeds holds the model's weights in memory "
             f"and its next step would write over the {what}, so it would be lost. Stop the server (distributed: the "
             f"scheduler and the trainer workers), run this again, then start it.")


@models_app.command("state")
def models_state(model_id: str) -> None:
    """The model's stored training states (verified, or what is wrong) and the bases a rebuild could use."""
    from admin.model_state import bases
    from storage.checkpoint_files import CheckpointError, verify_training_state
    from storage.live_slots import read_slots

    live_dir = settings().live_dir
    with session() as s:
        model = _live_model(s, model_id)
        rows = []
        for slot in read_slots(live_dir, model.id):
            try:
                verify_training_state(slot.path)
                check = "verified"
            except CheckpointError as e:
                check = str(e)
            m = slot.manifest or {}
            rows.append({"slot": slot.label, "location": slot.path, "after_seq_id": slot.seq if m else None,
                             "step": m.get("step"), "history_from_seq_id": slot.lineage, "check": check})
        show(f"stored training state of {model.id} (last applied seq_id {model.last_applied_seq_id})", rows,
             ["slot", "location", "after_seq_id", "step", "history_from_seq_id", "check"])
        show("bases a rebuild could start from (latest first)",
             [{"base": b.what, "replays_after_seq_id": b.seq, "usable": b.problem or "yes"}
              for b in bases(s, model, live_dir)], ["base", "replays_after_seq_id", "usable"])


@models_app.command("rebuild")
def models_rebuild(model_id: str) -> None:
    """Rebuild the model's stored state from its latest verified base (a stored state, one of its
    training-state checkpoints, or its create_model / load_weights) and the requests after it."""
    from admin.model_state import bases, rebuild, to_replay

    factory = sessions()
    with factory() as s:
        model = _live_model(s, model_id)
        found = bases(s, model, settings().live_dir)
        usable = [b for b in found if b.problem is None]
        if not usable:
            fail(f"{model_id}: nothing to rebuild from: " + ("; ".join(f"{b.what}: {b.problem}" for b in found)
                                                           or "no create_model or load_weights of it finished"))
        base, last = usable[0], model.last_applied_seq_id
        count = to_replay(s, model, base)
        if count:
            plan = (f"replaying its requests after seq_id {base.seq}: {count} forward_backward and optim_step "
                    f"request{'' if count == 1 else 's'} up to seq_id {last}")
        elif base.seq >= last:
            plan = f"nothing to replay: it reflects every request up to seq_id {last}"
        else:
            plan = f"nothing to replay: no request after seq_id {base.seq} up to {last} changes its state"
        console.print(f"{model_id}: rebuilding from {base.what}, {plan}", highlight=False)
        try:
            replayed = rebuild(s, factory, model, settings(), base, _engine(model))
        except RuntimeError as e:
            fail(f"{model_id}: {e}")
    console.print(f"{model_id}: rebuilt ({replayed} request{'' if replayed == 1 else 's'} replayed); its stored state "
                  f"after seq_id {model.last_applied_seq_id} is written and verified", highlight=False)


@models_app.command("reset")
def models_reset(model_id: str, tinker_path: str,
                 yes: bool = typer.Option(False, "--yes", help="do not ask for confirmation")) -> None:
    """Make a training-state checkpoint (TINKER_PATH, of the same tenant) the model's state from now on.
    The requests after that checkpoint stay answered, but their effect on the weights is dropped.
    Refused while a server runs on this database: stop it first."""
    from admin.model_state import reset

    with session() as s:
        model = _live_model(s, model_id)
        row = _checkpoint(s, tinker_path)
        if row.tenant_id != model.tenant_id or row.kind != "training_state":
            raise typer.BadParameter(f"{tinker_path!r} is not a training-state checkpoint of this model's tenant",
                                     param_hint="TINKER_PATH")
        refuse_while_served(s, model_id, "reset")
        if not yes:
            typer.confirm(f"{model_id} continues from {tinker_path}; the effect of its requests after that "
                          "checkpoint on the weights is dropped. Go on?", abort=True)
        try:
            reset(model, state["settings"], row, _engine(model))
        except RuntimeError as e:
            fail(f"{model_id}: {e}")
    console.print(f"{model_id}: its stored state is now {tinker_path} (after seq_id {model.last_applied_seq_id})",
                  highlight=False)
