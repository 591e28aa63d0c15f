"""Sampling sessions and `asample`: token-in/token-out through the multi-LoRA vLLM sampler.

A sampler is pinned to one immutable snapshot folder (or to the base model) when it is created;
`asample` validates the request, stores it, hands it to the sampling dispatcher and answers at
once with the request id and the ids of the sequences to come. Each sequence id ends with the
policy version that will produce it (`@v<optimizer steps>`, or `@base`), so async RL can measure
staleness without another call.
"""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, HTTPException, Request
from loraplex.types import SAMPLING_DEFAULTS, format_sequence_id
from loraplex.wire.codec import WireError, model_input_tokens, tensor_data_from_json
from pydantic import BaseModel, ConfigDict, Field

from api import quotas
from api.input_policy import INT32_MAX, INT64_MAX, Id, Label, Seed, SessionSeq, StopStrings, StopTokens
from api.deps import DB, CurrentTenant
from api.lookups import owned_sampler, owned_session, resolve_checkpoint
from api.paths import sampler_id
from api.served_models import ServedModel, served
from api.submit import submit
from contract.errors import SamplerBusy, SamplerUnavailable
from contract.kinds import RequestKind
from contract.sampling import SampleJob, SamplingOptions
from db.models import Checkpoint, Sampler, new_id
from models.architectures import sampling_refusal
from storage.checkpoint_files import snapshot_policy_version

router = APIRouter()
MAX_TOPK = 20  # vLLM's default max_logprobs
MAX_ALT_TOKENS_K = 256
# target_prompt_logprobs and prompt_alt_tokens_k read the whole vocabulary's logprobs at every prompt
# position (workers/sampler/prompt_rows.py): (len(prompt) - 1) x vocab values, held in Python lists by vLLM
# (about 100 bytes each) on the engine's thread, so a request may ask for at most this many (4.2M: 85
# positions of a 49k vocabulary, about 0.4 GB for a moment and 1.5 s of the engine on 2 CPU cores)
MAX_WHOLE_ROW_CELLS = 2**22


class CreateSamplingSession(BaseModel):
    session_id: Id
    sampling_session_seq_id: SessionSeq
    base_model: Label | None = None
    model_path: Id | None = None


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    session = owned_session(db, tenant.id, body.session_id)
    base = served(request).named(body.base_model) if body.base_model else served(request).default
    adapter_path = None
    if body.model_path:
        _, checkpoint = resolve_checkpoint(db, tenant.id, body.model_path, "model_path")
        if checkpoint.kind != "sampler":
            raise HTTPException(400, "model_path: sample from sampler weights (tinker://.../sampler_weights/...)")
        adapter_path = checkpoint.storage_path  # pinned: a later save under this name makes a new folder
        base = served(request).of_checkpoint(db, checkpoint, "model_path")  # the weights' own, whatever was named
    refusal = sampling_refusal(base.info.arch)
    if refusal:  # told at creation, not at the first sample
        raise HTTPException(400, refusal)
    sid = sampler_id(session.id, body.sampling_session_seq_id)
    if db.get(Sampler, sid) is None:  # stored by its hub id, whichever alias named it
        db.add(Sampler(id=sid, tenant_id=tenant.id, session_id=session.id, base_model=base.name,
                       model_path=body.model_path, adapter_path=adapter_path))
        db.commit()
    return {"type": "create_sampling_session", "sampling_session_id": sid}


def policy_version(adapter_path: str | None) -> int | None:
    """The policy version a sample of this snapshot folder will carry (None: the base model)."""
    if adapter_path is None:
        return None
    version = snapshot_policy_version(adapter_path)
    if version is None:
        raise HTTPException(404, "sampling_session_id: the sampler's weights are not saved (yet) or were deleted")
    return version


@router.get("/samplers/{sampling_session_id}")
def get_sampler(sampling_session_id: str, tenant: CurrentTenant, db: DB) -> dict:
    row = owned_sampler(db, tenant.id, sampling_session_id)
    version = snapshot_policy_version(row.adapter_path) if row.adapter_path else None
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path,
            "policy_version": version}


# --- asample -------------------------------------------------------------------------------------


class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)  # NaN is "not a finite number", not "below 0"

    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    seed: Seed | None = None
    stop: Label | StopStrings | StopTokens | None = None
    temperature: float = Field(default=SAMPLING_DEFAULTS.temperature, ge=0.0)
    top_k: int = Field(default=SAMPLING_DEFAULTS.top_k, ge=-1, le=INT32_MAX)
    top_p: float = Field(default=SAMPLING_DEFAULTS.top_p, gt=0.0, le=1.0)


class SampleRequestIn(BaseModel):
    prompt: dict[str, Any]
    num_samples: int = Field(default=1, ge=1, le=INT32_MAX)
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    sampling_session_id: Id | None = None
    base_model: Label | None = None  # legacy addressing, without a sampling session
    model_path: Id | None = None
    seq_id: int | None = Field(default=None, ge=0, le=INT64_MAX)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK)
    target_prompt_logprobs: Any = None  # TensorData (JSON): int64 ids [len(prompt) - 1, K], dense or CSR
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=MAX_ALT_TOKENS_K)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=0, le=INT32_MAX)
    record_stability_info: bool = False


def _options(p: SamplingParamsIn, prompt_len: int, max_context: int, vocab: int) -> SamplingOptions:
    room = max_context - prompt_len
    max_tokens = p.max_tokens if p.max_tokens is not None else room
    if max_tokens > room or room < 1:
        raise HTTPException(400, f"sampling_params.max_tokens: prompt ({prompt_len}) + max_tokens ({max_tokens}) "
                                 f"exceed the model's context of {max_context} tokens")
    if not math.isfinite(p.temperature) or not math.isfinite(p.top_p):
        raise HTTPException(400, "sampling_params: temperature and top_p must be finite")
    if p.top_k != -1 and p.top_k < 1:
        raise HTTPException(400, f"sampling_params.top_k: -1 (no limit) or >= 1, got {p.top_k}")
    stop = [p.stop] if isinstance(p.stop, str) else p.stop
    ids = tuple(s for s in stop or () if isinstance(s, int))
    if any(not 0 <= t < vocab for t in ids):
        raise HTTPException(400, f"sampling_params.stop: token ids must be in [0, {vocab})")
    return SamplingOptions(
        max_tokens=max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
        stop_strings=tuple(s for s in stop or () if isinstance(s, str)), stop_token_ids=ids,
        ignore_eos=stop == [],  # Tinker: [] disables every stop, EOS included
    )


def _target(body: SampleRequestIn, request: Request, tenant_id: str,
            db: DB) -> tuple[str | None, str | None, ServedModel]:
    """(sampler id or None, snapshot folder or None, the base model sampled) of the request."""
    if body.sampling_session_id is not None:
        sampler = owned_sampler(db, tenant_id, body.sampling_session_id)
        # Access is checked on every request: a deleted checkpoint stops serving (though the engine
        # may still hold it loaded), and so does another tenant's checkpoint once it is unpublished.
        if sampler.model_path is not None:
            checkpoint = db.execute(sa.select(Checkpoint.tenant_id, Checkpoint.public)
                                    .where(Checkpoint.tinker_path == sampler.model_path)).first()
            if checkpoint is None or (checkpoint.tenant_id != tenant_id and not checkpoint.public):
                raise HTTPException(404, f"sampling_session_id: the sampler's weights {sampler.model_path} "
                                         "are not saved (yet), were deleted (an unnamed snapshot is, once a newer "
                                         "one exists and it went unused), or are no longer published")
        return sampler.id, sampler.adapter_path, served(request).stored(sampler.base_model, "sampling_session_id")
    if body.model_path is not None:
        _, checkpoint = resolve_checkpoint(db, tenant_id, body.model_path, "model_path")
        if checkpoint.kind != "sampler":
            raise HTTPException(400, "model_path: sample from sampler weights (tinker://.../sampler_weights/...)")
        return None, checkpoint.storage_path, served(request).of_checkpoint(db, checkpoint, "model_path")
    if body.base_model is not None:
        return None, None, served(request).named(body.base_model)
    raise HTTPException(400, "sampling_session_id: required (or the legacy base_model / model_path)")


def _target_prompt_ids(body: SampleRequestIn, prompt_len: int,
                       vocab: int) -> tuple[list[list[int]] | None, tuple[list[int], list[int]] | None]:
    """(the ids of target_prompt_logprobs, dense [len(prompt) - 1, K] with -1 where nothing is asked, and the
    request's CSR layout (crow, col) or None), checked; and the whole-row cost of both distillation fields."""
    wanted = [name for name, asked in (("target_prompt_logprobs", body.target_prompt_logprobs is not None),
                                       ("prompt_alt_tokens_k", body.prompt_alt_tokens_k > 0)) if asked]
    if not wanted:
        return None, None
    field = wanted[0]
    if prompt_len < 2:
        raise HTTPException(400, f"{field}: the prompt needs 2 or more tokens (position 0 has no context)")
    if (prompt_len - 1) * vocab > MAX_WHOLE_ROW_CELLS:
        raise HTTPException(400, f"{field}: reads the whole vocabulary ({vocab}) at each of the prompt's "
                                 f"{prompt_len - 1} scored positions, over this server's cap of "
                                 f"{MAX_WHOLE_ROW_CELLS} values; send at most "
                                 f"{MAX_WHOLE_ROW_CELLS // vocab + 1} prompt tokens")
    raw = body.target_prompt_logprobs
    if raw is None:
        return None, None
    if not isinstance(raw, dict) or raw.get("dtype") != "int64":
        raise HTTPException(400, "target_prompt_logprobs: an int64 TensorData of token ids")
    try:
        ids = tensor_data_from_json(raw, "target_prompt_logprobs", pad=-1, max_dense_elements=MAX_WHOLE_ROW_CELLS)
    except WireError as e:
        raise HTTPException(400, str(e)) from None
    if ids.ndim != 2 or ids.shape[0] != prompt_len - 1:
        raise HTTPException(400, f"target_prompt_logprobs: shape [len(prompt) - 1, K] = [{prompt_len - 1}, K], "
                                 f"got {list(ids.shape)}")
    if ids.size and (ids.min() < -1 or ids.max() >= vocab):
        raise HTTPException(400, f"target_prompt_logprobs: token ids in [0, {vocab}), or -1 to skip a cell")
    if not (ids >= 0).any():
        raise HTTPException(400, "target_prompt_logprobs: names no token id (every cell is -1)")
    csr = None
    if raw.get("sparse_crow_indices") is not None:
        csr = ([int(i) for i in raw["sparse_crow_indices"]], [int(i) for i in raw["sparse_col_indices"]])
    return ids.tolist(), csr


def admit_sample(db, dispatcher, tenant_id: str, tokens: int) -> None:
    """A sample of `tokens` tokens (prompt and samples) may go to the sampler: within the tenant's quota
    (403/429), and the sampler has room (429 with Retry-After) and is up (503). Every sampling route's door."""
    quotas.check_sampling_tokens(db, tenant_id, tokens)
    try:
        dispatcher.check_capacity()
    except SamplerBusy as e:
        raise HTTPException(429, str(e), headers={"Retry-After": "1"}) from None
    except SamplerUnavailable as e:
        raise HTTPException(503, str(e)) from None


@router.post("/asample")
def asample(body: SampleRequestIn, request: Request, tenant: CurrentTenant, db: DB) -> dict:
    sid, adapter_path, base = _target(body, request, tenant.id, db)
    dispatcher = base.require_sampling()
    settings, info = request.app.state.settings, base.info
    if body.num_samples > settings.sampler_max_samples:
        raise HTTPException(400, f"num_samples: at most {settings.sampler_max_samples}, got {body.num_samples}")
    try:
        prompt = [int(t) for t in model_input_tokens(body.prompt, "prompt")]
    except WireError as e:
        raise HTTPException(400, str(e)) from None
    if not prompt:
        raise HTTPException(400, "prompt: needs at least one token")
    if max(prompt) >= info.vocab_size:
        raise HTTPException(400, f"prompt: token id {max(prompt)} is not below the vocabulary size {info.vocab_size}")
    options = _options(body.sampling_params, len(prompt), info.max_context, info.vocab_size)
    target_ids, target_csr = _target_prompt_ids(body, len(prompt), info.vocab_size)
    version = policy_version(adapter_path)
    admit_sample(db, dispatcher, tenant.id, len(prompt) + options.max_tokens * body.num_samples)
    request_id = new_id()
    seq_id = body.seq_id if sid is not None else None  # (sampler, seq_id) dedupes the client's retries
    prefix = f"{sid or request_id}:{seq_id if seq_id is not None else 0}"
    sequence_ids = [format_sequence_id(prefix, i, version) for i in range(body.num_samples)]
    job = SampleJob(
        request_id=request_id, prompt=tuple(prompt), num_samples=body.num_samples, options=options,
        adapter_path=adapter_path, prompt_logprobs=body.prompt_logprobs,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n, topk_prompt_logprobs=body.topk_prompt_logprobs,
        topk_sample_logprobs=body.topk_sample_logprobs,
        target_prompt_ids=target_ids, target_prompt_csr=target_csr, prompt_alt_tokens_k=body.prompt_alt_tokens_k,
        # stable_reinforce: the samples are recorded under these ids when they finish (db/stability.py)
        recorded_sequence_ids=tuple(sequence_ids) if body.record_stability_info else (),
        policy_version=version, base_model=base.name,
    )
    accepted = submit(base.scheduler, db, tenant_id=tenant.id, model_id=sid, seq_id=seq_id,
                      kind=RequestKind.SAMPLE, payload=job.to_json(), num_tokens=len(prompt), request_id=job.request_id,
                      dispatch=lambda: dispatcher.submit(job))
    accepted["sample_sequence_ids"] = sequence_ids  # a retry's: the same (sampler, seq_id), the same ids
    return accepted
