"""RL groups the service infers for runs driven without the rollout store (the official tinker SDK,
tinker-cookbook recipes), from what the requests table already holds, read when the dashboard asks
(docs/dashboard.md). Nothing is computed or stored on the request's path.

- A finished sample request of one of the run's snapshots with num_samples > 1: its n samples of one
  prompt at one policy version are one group, at the step they feed (policy_version + 1). No reward:
  the SDK sends none.
- A finished forward_backward whose datums carry `advantages`: each such datum is a member of the
  group of its prompt, at the step the forward_backward fed. Its prompt is its tokens before the first
  trained position: the first nonzero advantage, or for a datum whose advantages are all zero (a
  uniform group: no learning signal), the first nonzero sampler logprob or weight. Its advantage is
  the mean of its nonzero advantages (0 when there are none).

What is known of such a group is its members' advantages, not their rewards. Advantages are rewards
less one baseline of the group (tinker-cookbook: the group's mean reward), so equal advantages (all
zero, as a rule) say every member scored alike ("uniform"), both signs say they differed ("mixed");
anything else says nothing.
The parsing (`datum_member`, `advantage_outcome`) works on plain arrays; `sample_groups` and
`datum_members` read the rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import sqlalchemy as sa
from loraplex.wire.client import decode_sample_response
from loraplex.wire.codec import decode_forward_backward_request
from sqlalchemy.orm import Session

from contract.kinds import RequestKind
from db.models import Request, RequestState, ServiceMetric

ROWS_PER_QUERY = 50  # payloads per query: forward_backward bodies can be megabytes each
ADVANTAGE_DATUMS = "advantage_datums"  # the trainer's count of a forward_backward's datums with advantages
SAMPLES = "samples"  # a sample row's number of sequences (db/run_metrics.record_sample)


@dataclass(frozen=True)
class DatumMember:
    prompt: np.ndarray  # int64: the tokens before the first trained position
    completion: np.ndarray  # int64: the rest of the datum's sequence (its last target included)
    advantage: float


def prompt_key(tokens) -> bytes:
    """A prompt as the rollout store keys it: int32 little-endian bytes."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def _first_nonzero(values: np.ndarray | None, length: int) -> int | None:
    if values is None or values.ndim != 1 or len(values) != length:
        return None
    nonzero = np.flatnonzero(values)
    return int(nonzero[0]) if nonzero.size else None


def datum_member(tokens: np.ndarray, inputs: dict[str, np.ndarray]) -> DatumMember | None:
    """A datum with advantages as a group member; None when it has none, or no position says where its
    prompt ends. Position i of a loss input belongs to target i, the sequence's token i + 1."""
    advantages = inputs.get("advantages")
    if advantages is None or advantages.ndim != 1 or len(advantages) != len(tokens) or not len(tokens):
        return None
    first = _first_nonzero(advantages, len(tokens))
    for fallback in ("logprobs", "weights"):  # all-zero advantages: where the sampled tokens begin
        if first is None:
            first = _first_nonzero(inputs.get(fallback), len(tokens))
    if first is None:
        return None
    targets = inputs.get("target_tokens")
    last = targets[-1:] if targets is not None and targets.ndim == 1 and len(targets) == len(tokens) else []
    sequence = np.concatenate([np.asarray(tokens, dtype=np.int64), np.asarray(last, dtype=np.int64)])
    trained = advantages[advantages != 0].astype(np.float64)  # (exact for equal values: they compare equal)
    return DatumMember(prompt=sequence[:first + 1], completion=sequence[first + 1:],
                       advantage=float(trained.mean()) if trained.size else 0.0)


def advantage_outcome(advantages: list[float]) -> str | None:
    """Of two or more members' advantages: "uniform" when they are equal (all zero, for advantages centred
    in the group), "mixed" when they have both signs, else None (unknown)."""
    if len(advantages) < 2:
        return None
    if all(a == advantages[0] for a in advantages):
        return "uniform"
    if any(a > 0 for a in advantages) and any(a < 0 for a in advantages):
        return "mixed"
    return None


def _rows(s: Session, tenant_id: str, source: str, run_id: str, min_step: int) -> list:
    return s.execute(sa.select(ServiceMetric.request_id, ServiceMetric.step, ServiceMetric.numbers).where(
        ServiceMetric.tenant_id == tenant_id, ServiceMetric.run_id == run_id, ServiceMetric.source == source,
        ServiceMetric.step >= min_step).order_by(ServiceMetric.step, ServiceMetric.created_at)).all()


def _bodies(s: Session, tenant_id: str, ids: list[str], *columns) -> Iterator:
    for start in range(0, len(ids), ROWS_PER_QUERY):
        found = {row.id: row for row in s.execute(sa.select(Request.id, *columns).where(
            Request.tenant_id == tenant_id, Request.state == RequestState.DONE,
            Request.id.in_(ids[start:start + ROWS_PER_QUERY])))}
        yield from (found[i] for i in ids[start:start + ROWS_PER_QUERY] if i in found)


def sample_groups(s: Session, tenant_id: str, run_id: str, since: int,
                  skip: set[str]) -> Iterator[tuple[int, bytes, list[list[int]]]]:
    """(step, prompt key, each sample's tokens) of the run's sample requests with num_samples > 1 that
    feed a step after `since`, leaving out the request ids in `skip` (those the rollout store holds)."""
    rows = [r for r in _rows(s, tenant_id, RequestKind.SAMPLE, run_id, since)  # policy_version v feeds v + 1
            if r.request_id not in skip and (r.numbers or {}).get(SAMPLES, 2) > 1]  # older rows: read the body
    step_of = {r.request_id: r.step + 1 for r in rows}
    for row in _bodies(s, tenant_id, list(step_of), Request.payload, Request.result):
        job = json.loads(row.payload)
        if job.get("num_samples", 1) > 1 and row.result:
            sequences = decode_sample_response(row.result)["sequences"]
            yield step_of[row.id], prompt_key(job["prompt"]), [list(seq.tokens) for seq in sequences]


def datum_members(s: Session, tenant_id: str, run_id: str, since: int) -> Iterator[tuple[int, DatumMember]]:
    """(step, member) of each datum with advantages in the run's finished forward_backwards that fed a
    step after `since`, in the order they were trained."""
    rows = [r for r in _rows(s, tenant_id, RequestKind.FORWARD_BACKWARD, run_id, since + 1)
            if (r.numbers or {}).get(ADVANTAGE_DATUMS, 1) > 0]  # rows from before the count: read the body
    step_of = {r.request_id: r.step for r in rows}
    for row in _bodies(s, tenant_id, list(step_of), Request.payload):
        for datum in decode_forward_backward_request(row.payload, None).data:
            member = datum_member(datum.tokens, datum.loss_fn_inputs)
            if member is not None:
                yield step_of[row.id], member
