"""Recorded sequences for stable_reinforce: what a sampler with record_stability_info sampled, and
how a training request's provenance finds it.

The contract, as Tinker documents it (losses/stable-reinforce, datum#provenance):
- every sample from a sampling client created with `record_stability_info=True` is recorded, and
  each returned sequence's `sequence_id` names it in training requests;
- a datum's provenance names, for every input position and every loss row, where it came from:
  `PromptProvenanceSpan(sequence_id, offset, length)` for positions [offset, offset + length) of
  that sequence's request prompt, `SampledProvenanceSpan(...)` for positions of its sampled
  tokens; the runs tile the field they annotate;
- a recorded sequence can be trained on for one day after sampling, and each training request
  that uses it restarts that day.
Recorded here, per tenant: the prompt, the sampled tokens, the sampler's logprob of each, the
policy version. Another tenant's sequence_id gets the answer an id that never existed gets.

When a stable_reinforce request is accepted (`attach_recorded_inputs`, from the forward_backward
route), the spans' claims are checked against the record and the record's logprobs go into the
request's payload as two loss inputs (RECORDED_LOGPROBS, RECORDED_SEQUENCE in
contract/loss_specs.py). The stored payload then holds all its replays and trainer workers
need: they never look anything up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Sequence

import numpy as np
import sqlalchemy as sa
from loraplex.wire import tinker_public_pb2 as pb
from loraplex.wire.codec import DatumWire, ForwardBackwardWire, ProvenanceSpanWire, SampledSequenceWire
from sqlalchemy.orm import Session

from contract.errors import InvalidInputError
from contract.loss_specs import LOSS_SPECS, RECORDED_LOGPROBS, RECORDED_SEQUENCE
from contract.sampling import SampleJob
from db.models import RecordedSequence, utcnow

RETENTION = timedelta(days=1)
PRUNE_INTERVAL_SECONDS = 600.0  # expired rows are invisible at once; deleting them can wait
_LOOKUP_CHUNK = 500  # ids per IN (...): well under SQLite's limit on bound parameters
_last_prune = float("-inf")


@dataclass(frozen=True)
class Recorded:
    prompt: np.ndarray  # int64
    tokens: np.ndarray  # int64, the sampled tokens
    logprobs: np.ndarray  # float32, the sampler's logprob of each sampled token
    policy_version: int | None  # None: the base model


def record(s: Session, tenant_id: str, sampler_id: str | None, job: SampleJob,
           sequences: Sequence[SampledSequenceWire], now: datetime) -> None:
    """Record a finished job's sequences under the ids asample answered with (job.recorded_sequence_ids)."""
    prompt = np.asarray(job.prompt, dtype="<i4").tobytes()
    for sequence_id, seq in zip(job.recorded_sequence_ids, sequences, strict=True):
        # merge: a job run again (resent after a worker was lost) records its last outcome, as the result row does
        s.merge(RecordedSequence(
            id=sequence_id, tenant_id=tenant_id, sampler_id=sampler_id, policy_version=job.policy_version,
            prompt_tokens=prompt, tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(), created_at=now, expires_at=now + RETENTION,
        ))


def lookup(s: Session, tenant_id: str, ids: Sequence[str], now: datetime) -> dict[str, Recorded]:
    """The tenant's live recorded sequences among `ids` (expired or foreign ones are left out)."""
    found: dict[str, Recorded] = {}
    unique = sorted(set(ids))
    for start in range(0, len(unique), _LOOKUP_CHUNK):
        rows = s.scalars(sa.select(RecordedSequence).where(
            RecordedSequence.id.in_(unique[start:start + _LOOKUP_CHUNK]), RecordedSequence.tenant_id == tenant_id,
            RecordedSequence.expires_at > now))
        for row in rows:
            found[row.id] = Recorded(
                prompt=np.frombuffer(row.prompt_tokens, dtype="<i4").astype(np.int64),
                tokens=np.frombuffer(row.tokens, dtype="<i4").astype(np.int64),
                logprobs=np.frombuffer(row.logprobs, dtype="<f4").astype(np.float32),
                policy_version=row.policy_version,
            )
    return found


def renew(s: Session, tenant_id: str, ids: Sequence[str], now: datetime) -> None:
    """Each training request that uses a sequence restarts its day (committed with the request)."""
    unique = sorted(set(ids))
    for start in range(0, len(unique), _LOOKUP_CHUNK):
        s.execute(sa.update(RecordedSequence).where(
            RecordedSequence.id.in_(unique[start:start + _LOOKUP_CHUNK]), RecordedSequence.tenant_id == tenant_id,
        ).values(expires_at=now + RETENTION))


def prune_expired(s: Session, now: datetime, force: bool = False) -> int:
    """Delete expired rows, at most once per PRUNE_INTERVAL_SECONDS in this process unless `force`."""
    global _last_prune
    if not force and time.monotonic() - _last_prune < PRUNE_INTERVAL_SECONDS:
        return 0
    _last_prune = time.monotonic()
    return s.execute(sa.delete(RecordedSequence).where(RecordedSequence.expires_at <= now)).rowcount or 0


# --- provenance -> loss inputs --------------------------------------------------------------------


def _unknown(where: str, sequence_id: str) -> InvalidInputError:
    return InvalidInputError(
        where, f"{sequence_id!r} is not a recorded sequence of this tenant, or it expired: sample with "
        "record_stability_info=True; a recorded sequence can be trained on for one day after sampling or "
        "after the last training request that used it")


def _tiles(spans: tuple[ProvenanceSpanWire, ...], n: int, where: str) -> None:
    total = sum(span.length for span in spans)
    if total != n:
        raise InvalidInputError(where, f"the spans cover {total} positions, but the field has {n}: they must tile it")


def _source(span: ProvenanceSpanWire, recorded: dict[str, Recorded], where: str) -> tuple[Recorded, np.ndarray]:
    """The recorded sequence a span names, and the positions it claims: [offset, offset + length) of
    its prompt or of its sampled tokens."""
    rec = recorded.get(span.sequence_id)
    if rec is None:
        raise _unknown(f"{where}.sequence_id", span.sequence_id)
    source, what = (rec.prompt, "prompt") if span.kind == "prompt" else (rec.tokens, "sampled tokens")
    if span.offset + span.length > source.size:
        raise InvalidInputError(where, f"covers positions [{span.offset}, {span.offset + span.length}) of the "
                                       f"{what} of {span.sequence_id!r}, which has {source.size}")
    return rec, source[span.offset:span.offset + span.length]


def _same_tokens(actual: np.ndarray, claimed: np.ndarray, start: int, span: ProvenanceSpanWire, field: str,
                 where: str) -> None:
    differ = np.flatnonzero(actual != claimed)
    if differ.size:
        j = int(differ[0])
        what = "prompt" if span.kind == "prompt" else "sampled tokens"
        raise InvalidInputError(where, f"{field} position {start + j} is token {int(actual[j])}, but position "
                                       f"{span.offset + j} of the {what} of {span.sequence_id!r} is {int(claimed[j])}")


def recorded_inputs(i: int, datum: DatumWire, recorded: dict[str, Recorded]) -> dict[str, np.ndarray]:
    """Datum i's RECORDED_LOGPROBS and RECORDED_SEQUENCE rows from its provenance, after checking
    every claim the spans make. Loss rows in prompt spans are checked for bounds only: the RL
    recipes put placeholder targets there (tinker-cookbook rl_loop: 0), and they carry no loss."""
    n = datum.tokens.size
    if not datum.loss_fn_input_spans:
        raise InvalidInputError(f"data[{i}].loss_fn_input_spans", "stable_reinforce needs provenance: sample with "
                                "record_stability_info=True and name each row's sequence (Datum.with_provenance)")
    if not datum.model_input_spans:
        raise InvalidInputError(f"data[{i}].model_input_spans",
                                "provenance comes as a pair: the input spans are missing")
    targets = datum.loss_fn_inputs.get("target_tokens")
    if targets is None or targets.shape != (n,):
        raise InvalidInputError(f"data[{i}].loss_fn_inputs['target_tokens']",
                                f"stable_reinforce needs one target per input position, shape ({n},)")
    _tiles(datum.model_input_spans, n, f"data[{i}].model_input_spans")
    _tiles(datum.loss_fn_input_spans, n, f"data[{i}].loss_fn_input_spans")

    start = 0
    for k, span in enumerate(datum.model_input_spans):
        where = f"data[{i}].model_input_spans[{k}]"
        _, claimed = _source(span, recorded, where)
        _same_tokens(datum.tokens[start:start + span.length], claimed, start, span, "model_input", where)
        start += span.length

    logprobs = np.zeros(n, dtype=np.float32)
    sequence = np.zeros(n, dtype=np.float32)
    numbers: dict[str, int] = {}  # sequence id -> k >= 1, in order of first sampled row
    start = 0
    for k, span in enumerate(datum.loss_fn_input_spans):
        where = f"data[{i}].loss_fn_input_spans[{k}]"
        rec, claimed = _source(span, recorded, where)
        rows = slice(start, start + span.length)
        if span.kind == "sampled":
            _same_tokens(targets[rows], claimed, start, span, "target_tokens", where)
            lps = rec.logprobs[span.offset:span.offset + span.length]
            if not np.isfinite(lps).all():
                raise InvalidInputError(where, f"the sampler recorded a non-finite logprob in {span.sequence_id!r}")
            logprobs[rows] = lps
            sequence[rows] = numbers.setdefault(span.sequence_id, len(numbers) + 1)
        start += span.length
    return {RECORDED_LOGPROBS: logprobs, RECORDED_SEQUENCE: sequence}


def attach_recorded_inputs(s: Session, tenant_id: str, wire: ForwardBackwardWire, proto: bytes,
                           now: datetime | None = None) -> tuple[ForwardBackwardWire, bytes]:
    """For a stable_reinforce request: the request and its (uncompressed) protobuf payload with each
    datum's recorded inputs added, the sequences it names renewed for a day. Other losses pass
    through unchanged. Raises InvalidInputError naming the field (an unknown or expired sequence_id,
    a span whose tokens are not the recorded ones, a recorded input sent by the client)."""
    spec = LOSS_SPECS.get(wire.loss_fn)
    if spec is None or not spec.server_inputs:
        return wire, proto
    now = now or utcnow()
    for i, datum in enumerate(wire.data):
        for key in spec.server_inputs:
            if key in datum.loss_fn_inputs:
                raise InvalidInputError(f"data[{i}].loss_fn_inputs[{key!r}]",
                                        "set by the server from the datum's provenance; do not send it")
    ids = [span.sequence_id for d in wire.data for span in (*d.model_input_spans, *d.loss_fn_input_spans)]
    recorded = lookup(s, tenant_id, ids, now)
    extra = [recorded_inputs(i, datum, recorded) for i, datum in enumerate(wire.data)]
    renew(s, tenant_id, ids, now)
    prune_expired(s, now)

    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(proto)
    for datum_msg, inputs in zip(msg.data, extra, strict=True):
        for name, values in inputs.items():
            tensor = datum_msg.loss_fn_inputs[name]
            tensor.dense = values.astype("<f4").tobytes()
            tensor.dtype = pb.DTYPE_FLOAT32
            tensor.shape[:] = [values.size]
    data = [replace(d, loss_fn_inputs={**d.loss_fn_inputs, **inputs}) for d, inputs in zip(wire.data, extra)]
    return replace(wire, data=data), msg.SerializeToString()
