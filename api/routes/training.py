"""Training models: create, get_info, forward_backward, optim_step, save and load weights.

Every heavy call is validated here (errors name the field, 4xx), stored with its payload
(contract/payloads.py), queued, and answered at once with a request id; the scheduler runs it in
the model's seq_id order. The checks are the engine's own, run without torch (contract/configs.py,
contract/inputs.py): a request the engine would refuse is refused here.
"""

from __future__ import annotations

import secrets
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Request
from loraplex.types import DEFAULT_LORA_RANK
from loraplex.wire.codec import PROTOBUF, WireError, decode_body, decode_forward_backward_request
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from api import quotas
from api.input_policy import Id, Label, Metadata, NonNegInt32, Seed, SeqId, SessionSeq, StrMetadata, check_wire_text
from api.deps import DB, ApiKeyHeader, CurrentTenant, TenantRef, in_tenant_session
from api.optimizers import OptimizerConfig, run_optimizer, wire_config
from api.lookups import check_owned_model, checkpoint_base_model, owned_model, owned_session, resolve_checkpoint
from api.paths import CHECKPOINT_KINDS, TinkerPath, checkpoint_name, sampler_id, snapshot_folder, storage_path
from api.paths import model_id as make_model_id
from api.served_models import served
from api.submit import submit
from contract.configs import DEFAULT_LORA_ALPHA, LoraConfig, optim_params_from, optimizer_of
from contract.errors import InvalidInputError
from contract.inputs import check_request, from_wire
from contract.kinds import RequestKind
from contract.payloads import CreateModelPayload, LoadWeightsPayload, OptimStepPayload, SaveWeightsPayload
from db import stability
from db.models import Checkpoint, CheckpointKind, Sampler, TrainingModel
from models.architectures import check_lora_config
from storage.checkpoint_files import read_manifest
from storage.external_weights import MAX_AGE_RECIPIENTS, age_recipient

router = APIRouter()


class LoraConfigIn(BaseModel):
    """The lora_config of a create_model request as the client sent it (`lora_config()` resolves it)."""

    rank: NonNegInt32 = DEFAULT_LORA_RANK  # at most the server's max_lora_rank: checked by LoraConfig.validate
    seed: Seed | None = None
    alpha: float | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(BaseModel):
    session_id: Id
    model_seq_id: SessionSeq
    base_model: Label
    lora_config: LoraConfigIn = Field(default_factory=LoraConfigIn)
    user_metadata: Metadata | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)  # fixed for the model's life


class ModelRef(BaseModel):
    model_id: Id


class OptimStep(BaseModel):
    model_id: Id
    seq_id: SeqId
    adam_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None
    optim_params: dict[str, Any] | None = None


class SaveWeights(BaseModel):
    model_id: Id
    seq_id: SeqId
    path: Id | None = None
    sampling_session_seq_id: SessionSeq | None = None
    ttl_seconds: int | None = Field(default=None, ge=1, le=10 * 365 * 86400)
    overwrite: bool = False
    user_metadata: StrMetadata | None = None  # kept on the checkpoint


class SaveWeightsExternal(BaseModel):
    model_id: Id
    seq_id: SeqId
    path: Id  # the export's name
    ttl_seconds: int | None = Field(default=None, ge=1, le=10 * 365 * 86400)
    age_encryption_recipients: list[Label] | None = None


class LoadWeights(BaseModel):
    path: Id
    optimizer: bool = False
    model_id: Id | None = None  # legacy: load into an existing model at seq_id
    seq_id: SeqId | None = None
    session_id: Id | None = None  # create-via-load: a new model "{session_id}:train:{model_seq_id}"
    model_seq_id: SessionSeq | None = None
    # a new weights-only model's optimizer (AdamW when none); it cannot override a restored optimizer
    # state (`optimizer`) nor change an existing model's
    optimizer_config: OptimizerConfig | None = None
    user_metadata: Metadata | None = None  # create-via-load: the new run's (TrainingRun.user_metadata)


def lora_config(body: LoraConfigIn, max_rank: int) -> LoraConfig:
    cfg = LoraConfig(
        rank=body.rank, alpha=body.alpha if body.alpha is not None else DEFAULT_LORA_ALPHA,
        seed=body.seed if body.seed is not None else secrets.randbits(31),  # Tinker: no seed = random
        train_attn=body.train_attn, train_mlp=body.train_mlp, train_unembed=body.train_unembed,
    )
    try:
        cfg.validate(max_rank)
    except InvalidInputError as e:
        raise HTTPException(400, str(e)) from None
    return cfg


@router.post("/create_model")
def create_model(body: CreateModel, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    owned_session(db, tenant.id, body.session_id)
    base = served(request).named(body.base_model)  # stored by its hub id, whichever alias named it
    optimizer = body.optimizer_config.resolve("optimizer_config")
    cfg = lora_config(body.lora_config, request.app.state.settings.max_lora_rank)
    try:
        check_lora_config(base.info.arch, cfg)
    except InvalidInputError as e:
        raise HTTPException(400, str(e)) from None
    mid = make_model_id(body.session_id, body.model_seq_id)
    if db.get(TrainingModel, mid) is None:
        quotas.check_new_model(db, tenant.id, cfg.rank)
        db.add(TrainingModel(
            id=mid, tenant_id=tenant.id, session_id=body.session_id, base_model=base.name,
            lora_config=cfg.to_dict(), user_metadata=body.user_metadata or {}, last_applied_seq_id=-1,
        ))
        db.flush()
    else:  # a retry, or a clash of ids: the run is what it was created as
        base = served(request).stored(db.get(TrainingModel, mid).base_model)
    return submit(base.scheduler, db, tenant_id=tenant.id, model_id=mid, seq_id=0,
                  kind=RequestKind.CREATE_MODEL,
                  payload=CreateModelPayload(lora_config=cfg, optimizer=optimizer).to_bytes())


@router.post("/get_info")
def get_info(body: ModelRef, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    from models.registry import hub_id

    row = owned_model(db, tenant.id, body.model_id)
    info = served(request).stored(row.base_model).info
    # The hub id, whichever alias created the model: the SDK makes model_name the base model of
    # its samplers, whose get_tokenizer() loads it by name, and loads tokenizer_id itself; both
    # from the client's Hugging Face cache (`loraplex tokenizer pull` fills it), never a server path.
    name = hub_id(row.base_model)
    return {
        "type": "get_info", "model_id": row.id, "is_lora": True, "lora_rank": row.lora_config["rank"],
        "model_name": name, "optimizer_config": wire_config(run_optimizer(db, row.id)),
        "model_data": {"arch": info.arch, "model_name": name, "tokenizer_id": name},
    }


@router.post("/forward_backward")
async def forward_backward(request: Request, x_api_key: ApiKeyHeader = None) -> dict:
    body = await request.body()
    return await in_tenant_session(request, x_api_key, lambda db, tenant: _accept_forward_backward(request, body, tenant.id, db))


def _accept_forward_backward(request: Request, body: bytes, tenant_id: str, db: Session) -> dict:
    settings = request.app.state.settings
    try:
        proto = decode_body(body, request.headers.get("content-encoding"), max_decompressed_bytes=settings.max_request_bytes)
        wire = decode_forward_backward_request(proto, None)
    except WireError as e:
        raise HTTPException(400, str(e)) from None
    texts = {f"loss_fn_config_v2[{key[:64]!r}]": value for key, value in wire.loss_fn_config.items()
             if isinstance(value, str)}
    problem = check_wire_text({"model_id": wire.model_id, "loss_fn": wire.loss_fn, **texts})
    if problem is not None:
        raise HTTPException(400, problem)
    base = served(request).stored(check_owned_model(db, tenant_id, wire.model_id))
    info = base.info
    if wire.seq_id < 1:
        raise HTTPException(400, f"seq_id: must be >= 1, got {wire.seq_id}")
    try:  # stable_reinforce: check the provenance, renew the sequences, add the record to the payload
        wire, proto = stability.attach_recorded_inputs(db, tenant_id, wire, proto)
    except InvalidInputError as e:
        raise HTTPException(400, str(e)) from None
    num_tokens = sum(len(d.tokens) for d in wire.data)
    try:
        check_request(from_wire(wire), info.vocab_size, info.max_context)
    except InvalidInputError as e:
        raise HTTPException(400, str(e)) from None
    quotas.check_training_tokens(db, tenant_id, num_tokens)
    return submit(
        base.scheduler, db, tenant_id=tenant_id, model_id=wire.model_id, seq_id=wire.seq_id,
        kind=RequestKind.FORWARD if wire.forward_only else RequestKind.FORWARD_BACKWARD, payload=proto,
        content_type=PROTOBUF, num_tokens=num_tokens,
    )


@router.post("/optim_step")
async def optim_step(body: OptimStep, request: Request, x_api_key: ApiKeyHeader = None) -> dict:
    return await in_tenant_session(request, x_api_key, lambda db, tenant: _accept_optim_step(request, body, tenant, db))


def _accept_optim_step(request: Request, body: OptimStep, tenant: TenantRef, db: Session) -> dict:
    base = served(request).stored(check_owned_model(db, tenant.id, body.model_id))
    # the SDK sends AdamParams as adam_params and other families as optimizer_params (optim_params: its alias)
    field, raw = next(((name, value) for name, value in (("adam_params", body.adam_params),
                                                          ("optimizer_params", body.optimizer_params),
                                                          ("optim_params", body.optim_params)) if value is not None),
                      ("adam_params", {}))
    try:
        params = optim_params_from(raw, field)
    except InvalidInputError as e:
        raise HTTPException(400, str(e)) from None
    optimizer = run_optimizer(db, body.model_id, body.seq_id)
    if optimizer_of(params) != optimizer:  # the optimizer is the model's for life (docs/optimizers.md)
        raise HTTPException(400, f"{field}.type: this model was created with {optimizer}, so its steps take "
                                 f"{optimizer}'s hyperparameters, not {optimizer_of(params)}'s; to switch, save_state "
                                 "and create a training client from that state with the other optimizer")
    return submit(base.scheduler, db, tenant_id=tenant.id, model_id=body.model_id, seq_id=body.seq_id,
                  kind=RequestKind.OPTIM_STEP, payload=OptimStepPayload(adam_params=params).to_bytes())


def _save(request: Request, db: DB, tenant_id: str, body: SaveWeights, kind: RequestKind, dir_kind: str,
          age_recipients: list[str] | None = None) -> dict:
    model = owned_model(db, tenant_id, body.model_id)
    base = served(request).stored(model.base_model)
    quotas.check_storage(db, tenant_id)
    snapshot: dict[str, Any] = {}  # an unnamed snapshot: the sampler it is for
    if body.path is None and dir_kind == "sampler_weights":
        if body.sampling_session_seq_id is None:
            raise HTTPException(400, "path or sampling_session_seq_id: one of them is required")
        sid = sampler_id(model.session_id, body.sampling_session_seq_id)
        name = f"snapshot-{body.seq_id}"
        snapshot = {"sampling_session_id": sid, "ephemeral": True}
    else:
        name = checkpoint_name(body.path or f"ckpt-{body.seq_id}", "path")
    path = TinkerPath(model.id, dir_kind, name)
    exists = db.scalar(sa.select(Checkpoint).where(Checkpoint.tinker_path == str(path)))
    if exists is not None and not body.overwrite and dir_kind == "weights":
        raise HTTPException(400, f"path: checkpoint {str(path)!r} exists; pass overwrite=true to replace it")
    folder = storage_path(request.app.state.settings.checkpoint_dir, tenant_id, path)
    if dir_kind == "sampler_weights":  # a new folder per save: samplers of an earlier save keep theirs
        folder = snapshot_folder(folder, body.seq_id)
    external = {"base_model": model.base_model, "age_recipients": age_recipients} \
        if dir_kind == "external_weights" else {}  # the base model as clients name it
    payload = SaveWeightsPayload(kind=CHECKPOINT_KINDS[dir_kind], ttl_seconds=body.ttl_seconds,
                                 user_metadata=body.user_metadata, **snapshot, **external,
                                 name=name, tinker_path=str(path), storage_path=folder)
    if payload.sampling_session_id and db.get(Sampler, payload.sampling_session_id) is None:
        db.add(Sampler(id=payload.sampling_session_id, tenant_id=tenant_id, session_id=model.session_id,
                       base_model=model.base_model, model_path=str(path), adapter_path=folder))
        db.flush()
    return submit(base.scheduler, db, tenant_id=tenant_id, model_id=model.id, seq_id=body.seq_id, kind=kind,
                  payload=payload.to_bytes())


@router.post("/save_weights")
def save_weights(body: SaveWeights, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    return _save(request, db, tenant.id, body, RequestKind.SAVE_WEIGHTS, "weights")


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeights, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    return _save(request, db, tenant.id, body, RequestKind.SAVE_WEIGHTS_FOR_SAMPLER, "sampler_weights")


@router.post("/save_weights_external")
def save_weights_external(body: SaveWeightsExternal, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    """The adapter merged into the base model, as a Hugging Face folder, beside the PEFT adapter
    (storage/external_weights.py); get_external_weights_urls then hands out its files."""
    recipients = body.age_encryption_recipients or None
    if recipients is not None:
        if len(recipients) > MAX_AGE_RECIPIENTS:
            raise HTTPException(400, f"age_encryption_recipients: at most {MAX_AGE_RECIPIENTS}, got {len(recipients)}")
        for i, recipient in enumerate(recipients):
            try:
                age_recipient(recipient)
            except ValueError as e:
                raise HTTPException(400, f"age_encryption_recipients[{i}]: {e}") from None
    save = SaveWeights(model_id=body.model_id, seq_id=body.seq_id, path=body.path, ttl_seconds=body.ttl_seconds)
    return _save(request, db, tenant.id, save, RequestKind.SAVE_WEIGHTS_EXTERNAL, "external_weights",
                 age_recipients=recipients)


@router.post("/load_weights")
def load_weights(body: LoadWeights, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    asked = body.optimizer_config.resolve("optimizer_config") if body.optimizer_config else None
    parsed, checkpoint = resolve_checkpoint(db, tenant.id, body.path)
    if parsed.kind != "weights":
        raise HTTPException(400, "path: only training-state checkpoints (tinker://.../weights/...) can be loaded")
    manifest = read_manifest(checkpoint.storage_path)
    if manifest is None:
        raise HTTPException(404, f"path: the files of {body.path!r} are missing")
    saved = manifest.get("optimizer", "adamw")  # states written before Dimuon were AdamW's
    # the base model the state was trained on (its run's; the default one's where the run is gone)
    source_base = checkpoint_base_model(db, checkpoint) or served(request).default.name
    if body.session_id is not None and body.model_seq_id is not None:  # create-via-load: seq 0 of a new model
        owned_session(db, tenant.id, body.session_id)
        base = served(request).stored(source_base, "path")
        mid, seq = make_model_id(body.session_id, body.model_seq_id), 0
        if db.get(TrainingModel, mid) is None:
            quotas.check_new_model(db, tenant.id, manifest["lora_config"]["rank"])
            db.add(TrainingModel(
                id=mid, tenant_id=tenant.id, session_id=body.session_id, base_model=base.name,
                lora_config=manifest["lora_config"], user_metadata=body.user_metadata or {}, last_applied_seq_id=-1,
            ))
            db.flush()
        if body.optimizer and asked not in (None, saved):
            raise HTTPException(400, f"optimizer_config: the optimizer state restored from {body.path!r} is {saved}'s; "
                                     "leave optimizer_config out, or load the weights only with a fresh optimizer")
        optimizer = saved if body.optimizer else asked or "adamw"
    elif body.model_id is not None and body.seq_id is not None:
        target = owned_model(db, tenant.id, body.model_id)
        if target.base_model != source_base:
            raise HTTPException(400, f"path: {body.path!r} was trained on {source_base}; run {target.id!r} trains "
                                     f"{target.base_model}")
        mid, seq, base = target.id, body.seq_id, served(request).stored(target.base_model)
        optimizer = run_optimizer(db, mid, seq)  # an existing model keeps its optimizer
        if asked not in (None, optimizer):
            raise HTTPException(400, f"optimizer_config: this model runs {optimizer}, fixed at its creation; "
                                     "create a training client from the state to use another optimizer")
        if body.optimizer and saved != optimizer:
            raise HTTPException(400, f"path: {body.path!r} holds {saved}'s optimizer state, but this model runs "
                                     f"{optimizer}; load its weights only, or create a training client from it")
    else:
        raise HTTPException(400, "session_id and model_seq_id (or model_id and seq_id) are required")
    payload = LoadWeightsPayload(storage_path=checkpoint.storage_path, optimizer=body.optimizer, tinker_path=body.path,
                                 optimizer_type=optimizer)
    return submit(base.scheduler, db, tenant_id=tenant.id, model_id=mid, seq_id=seq,
                  kind=RequestKind.LOAD_WEIGHTS, payload=payload.to_bytes())


class WeightsInfo(BaseModel):
    tinker_path: Id


@router.post("/weights_info")
def weights_info(body: WeightsInfo, tenant: CurrentTenant, db: DB) -> dict:
    _, checkpoint = resolve_checkpoint(db, tenant.id, body.tinker_path, "tinker_path")
    model = db.get(TrainingModel, checkpoint.model_id)
    if model is None:
        raise HTTPException(404, f"tinker_path: the run of {body.tinker_path!r} is gone")
    cfg = model.lora_config
    manifest = read_manifest(checkpoint.storage_path) if checkpoint.kind == CheckpointKind.TRAINING_STATE else None
    optimizer = (manifest or {}).get("optimizer") or run_optimizer(db, model.id)
    return {"base_model": model.base_model, "is_lora": True, "optimizer_config": wire_config(optimizer),
            "lora_rank": cfg["rank"], "train_unembed": cfg["train_unembed"], "train_mlp": cfg["train_mlp"],
            "train_attn": cfg["train_attn"]}
