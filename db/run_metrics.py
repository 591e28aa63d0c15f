"""Training runs' metrics for the dashboard: what the service measured (stored with each outcome),
what the client logged, and both read back as series on one step axis (docs/dashboard.md).

Writes happen where the numbers appear: the scheduler stores a forward_backward's or optim_step's
`Outcome.metrics` with the outcome (workers/trainer/run_metrics.py computes them on the trainer, in
embedded and distributed mode alike), the sampling dispatcher a sample's tokens and logprobs, the
rollouts route the policy versions of the trajectories it turns into datums. Rows hold sums; reads
add a step's rows up and divide once.

The step axis is the optimizer step, and every number sits at the step it belongs to: the training
requests at the step their optim_step made, samples of snapshot v (policy_version v) at step v + 1,
the step their rollouts feed (`feeds_step`). Times are what a stopwatch shows: the wall time during
which any of a step's requests ran (`wall_seconds`), never a sum over concurrent requests.
"""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import datetime
from typing import Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contract.kinds import RequestKind
from contract.queue import Outcome, QueuedRequest
from db.models import Checkpoint, ClientMetric, Request, Sampler, ServiceMetric, TrainingModel, utcnow

ROLLOUT_DATUMS = "rollout_datums"  # the source of staleness rows

# name -> (unit, how a step's summed numbers give it)
SERVICE_SERIES = {
    "loss": ("nats/token", lambda n: n["loss_sum"] / n["tokens"] if n.get("tokens") else None),
    "tokens": ("tokens", lambda n: n.get("tokens")),
    "grad_norm": ("", lambda n: n.get("grad_norm")),
    "learning_rate": ("", lambda n: n.get("learning_rate")),
    "train/queue_seconds": ("s", lambda n: n.get("train_queue_seconds")),
    "train/compute_seconds": ("s", lambda n: n.get("train_compute_seconds")),
    "logprob_gap/mean_abs": ("nats", lambda n: n["gap_abs_sum"] / n["gap_tokens"] if n.get("gap_tokens") else None),
    "logprob_gap/kl": ("nats", lambda n: n["gap_k3_sum"] / n["gap_tokens"] if n.get("gap_tokens") else None),
    "prefix_overlap": ("fraction", lambda n: n["shared_tokens"] / n["input_tokens"] if n.get("input_tokens") else None),
    "sample/tokens": ("tokens", lambda n: n.get("sample_tokens")),
    "sample/tokens_per_second": ("tokens/s", lambda n: n["sample_tokens"] / n["sample_seconds"]
                                 if n.get("sample_seconds") else None),
    "sample/seconds": ("s", lambda n: n.get("sample_seconds")),
    "entropy": ("nats/token", lambda n: -n["logprob_sum"] / n["logprob_tokens"] if n.get("logprob_tokens") else None),
    "staleness": ("steps", lambda n: n["staleness_sum"] / n["trajectories"] if n.get("trajectories") else None),
}


# --- writing -----------------------------------------------------------------------------------------


def outcome_rows(requests: Iterable[QueuedRequest], outcomes: dict[str, Outcome]) -> list[dict]:
    """Rows for the outcomes that carry metrics (the scheduler inserts them with the outcomes)."""
    rows = []
    for q in requests:
        outcome = outcomes.get(q.id)
        if outcome is None or not outcome.metrics or outcome.error:
            continue
        numbers = {k: v for k, v in outcome.metrics.items() if math.isfinite(v)}  # JSON holds no inf or NaN
        step = int(numbers.pop("step"))
        rows.append({"tenant_id": q.tenant_id, "run_id": q.model_id, "source": str(q.kind), "request_id": q.id,
                     "step": step, "numbers": numbers})
    return rows


def store_outcomes(s: Session, requests: Iterable[QueuedRequest], outcomes: dict[str, Outcome]) -> None:
    """Insert the rows of `outcome_rows` in the caller's transaction (a Core insert: about a fifth of a
    millisecond for a cycle's rows, on the request's latency path)."""
    rows = outcome_rows(requests, outcomes)
    if rows:
        s.execute(ServiceMetric.__table__.insert(), rows)


def run_of_snapshot(s: Session, tenant_id: str, adapter_path: str | None, sampler_id: str | None) -> str | None:
    """The tenant's own training run whose sampler snapshot folder this is: by the checkpoint that
    holds the folder now, else by the sampler's tinker:// path (a later save under the same name
    moved the checkpoint to a new folder). None: the base model, or another tenant's published
    snapshot (its owner is not shown who samples it)."""
    if adapter_path is None:
        return None
    run_id = s.scalar(sa.select(Checkpoint.model_id).where(Checkpoint.storage_path == adapter_path,
                                                           Checkpoint.tenant_id == tenant_id).limit(1))
    if run_id is None and sampler_id is not None:
        model_path = s.scalar(sa.select(Sampler.model_path).where(Sampler.id == sampler_id,
                                                                   Sampler.adapter_path == adapter_path))
        if model_path and model_path.startswith("tinker://"):
            owner = model_path.removeprefix("tinker://").split("/", 1)[0]
            run_id = s.scalar(sa.select(TrainingModel.id).where(TrainingModel.id == owner,
                                                                TrainingModel.tenant_id == tenant_id))
    return run_id


def record_sample(s: Session, row: Request, adapter_path: str | None, policy_version: int | None,
                  sequences: Sequence) -> None:
    """A finished sample of a run's snapshot: its generated tokens, the sum of their logprobs (the
    entropy estimate) and its time from acceptance to now. Added to the caller's transaction."""
    run_id = run_of_snapshot(s, row.tenant_id, adapter_path, row.model_id)
    if run_id is None or policy_version is None:
        return
    logprobs = [float(lp) for seq in sequences for lp in (seq.logprobs if seq.logprobs is not None else ())]
    finite = [lp for lp in logprobs if math.isfinite(lp)]
    s.add(ServiceMetric(tenant_id=row.tenant_id, run_id=run_id, source=RequestKind.SAMPLE, request_id=row.id,
                        step=policy_version, numbers={
                            "sample_tokens": sum(len(seq.tokens) for seq in sequences),
                            "samples": len(sequences),  # > 1: an RL group (db/inferred_groups.py)
                            "sample_seconds": (utcnow() - row.created_at).total_seconds(),
                            "logprob_sum": sum(finite), "logprob_tokens": len(finite)}))


def last_learning_rate(s: Session, run_id: str) -> float | None:
    """The learning rate of the run's newest optim_step (None before its first)."""
    numbers = s.scalar(sa.select(ServiceMetric.numbers).where(
        ServiceMetric.run_id == run_id, ServiceMetric.source == RequestKind.OPTIM_STEP)
        .order_by(ServiceMetric.step.desc()).limit(1))
    return (numbers or {}).get("learning_rate")


def current_step(s: Session, run_id: str) -> int:
    """The run's optimizer steps so far, as its optim_steps reported them (0 before the first)."""
    return int(s.scalar(sa.select(sa.func.coalesce(sa.func.max(ServiceMetric.step), 0)).where(
        ServiceMetric.run_id == run_id, ServiceMetric.source == RequestKind.OPTIM_STEP)))


def record_staleness(s: Session, tenant_id: str, session_id: str,
                     turns: Sequence[tuple[str | None, int | None]]) -> None:
    """A trajectory turned into training datums: for each of the tenant's runs whose snapshots sampled
    it, the run's steps since the oldest of those snapshots (0: sampled by the newest). It counts at
    the step the datums feed (the run's step now + 1); fetching the datums again replaces the record.
    `turns`: (tinker:// sampler path, policy version) of each turn. Commits."""
    oldest: dict[str, int] = {}
    for sampler_path, version in turns:
        if sampler_path is None or version is None or not sampler_path.startswith("tinker://"):
            continue  # the base model: no run, no staleness
        run_id = sampler_path.removeprefix("tinker://").split("/", 1)[0]
        oldest[run_id] = min(version, oldest.get(run_id, version))
    owned = set(s.scalars(sa.select(TrainingModel.id).where(TrainingModel.id.in_(list(oldest)),
                                                            TrainingModel.tenant_id == tenant_id))) if oldest else set()
    for run_id in sorted(owned):  # (a public snapshot of another tenant's run is not this tenant's to chart)
        now = current_step(s, run_id)
        s.execute(sa.delete(ServiceMetric).where(ServiceMetric.run_id == run_id, ServiceMetric.source == ROLLOUT_DATUMS,
                                                 ServiceMetric.request_id == session_id))
        s.add(ServiceMetric(tenant_id=tenant_id, run_id=run_id, source=ROLLOUT_DATUMS, request_id=session_id,
                            step=now + 1, numbers={"trajectories": 1, "staleness_sum": max(0, now - oldest[run_id])}))
    s.commit()


def store_client_metrics(s: Session, tenant_id: str, run_id: str, step: int, metrics: dict[str, float]) -> None:
    """Logged again at a step, a name's value is replaced. Commits."""
    s.execute(sa.delete(ClientMetric).where(ClientMetric.run_id == run_id, ClientMetric.step == step,
                                            ClientMetric.name.in_(list(metrics))))
    s.add_all(ClientMetric(run_id=run_id, name=name, step=step, tenant_id=tenant_id, value=value)
              for name, value in metrics.items())
    s.commit()


# --- reading -----------------------------------------------------------------------------------------


def seconds_between(later, earlier) -> float | None:
    return (later - earlier).total_seconds() if later is not None and earlier is not None else None


def feeds_step(source: str, step: int) -> int:
    """The optimizer step a stored row belongs to on the axis: a sample of policy_version v feeds step v + 1."""
    return step + 1 if source == RequestKind.SAMPLE else step


Interval = tuple[datetime, datetime]


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The time the intervals cover, as disjoint intervals in order."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def wall_seconds(intervals: Iterable[Interval], outside: Iterable[Interval] = ()) -> float:
    """Seconds covered by `intervals` and not by `outside`: what a stopwatch running while any of them ran
    (and none of `outside` did) shows."""
    total = 0.0
    cuts = merged(outside)
    for start, end in merged(intervals):
        total += (end - start).total_seconds()
        for cut_start, cut_end in cuts:
            overlap = (min(end, cut_end) - max(start, cut_start)).total_seconds()
            total -= max(0.0, overlap)
    return total


def series(s: Session, run_id: str, since: int = -1) -> dict:
    """Every series of the run with step > since: {"last_step", "series": {name: {unit, source, points}}}.
    The service's points of a step appear once its optim_step is done (before, its forward_backwards
    are still adding up); the client's as logged."""
    sums: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    # step -> the wall-clock intervals of its requests: waiting and computing on the trainer, sampling
    waits, computes, samples = defaultdict(list), defaultdict(list), defaultdict(list)
    now = current_step(s, run_id)
    rows = s.execute(
        sa.select(ServiceMetric.source, ServiceMetric.step, ServiceMetric.numbers,
                  Request.created_at, Request.started_at, Request.finished_at)
        .outerjoin(Request, Request.id == ServiceMetric.request_id)
        .where(ServiceMetric.run_id == run_id, ServiceMetric.step >= since,
               ServiceMetric.step <= now))  # (a sample's row holds its policy_version: it feeds the next step)
    for source, stored_step, numbers, created, started, finished in rows:
        step = feeds_step(source, stored_step)
        if step <= since:
            continue
        step_sums = sums[step]
        for name, value in numbers.items():
            step_sums[name] += value
        if source in (RequestKind.FORWARD_BACKWARD, RequestKind.OPTIM_STEP) and None not in (created, started, finished):
            waits[step].append((created, started))
            computes[step].append((started, finished))
        elif source == RequestKind.SAMPLE and None not in (created, finished):
            samples[step].append((created, finished))
    for step in computes:  # stopwatch times, replacing sums over concurrent requests
        sums[step]["train_compute_seconds"] = wall_seconds(computes[step])
        sums[step]["train_queue_seconds"] = wall_seconds(waits[step], outside=computes[step])
    for step in samples:
        sums[step]["sample_seconds"] = wall_seconds(samples[step])
    out: dict[str, dict] = {}
    for step in sorted(sums):
        for name, (unit, value_of) in SERVICE_SERIES.items():
            value = value_of(sums[step])
            if value is not None:
                out.setdefault(name, {"unit": unit, "source": "service", "points": []})["points"].append([step, value])
    client = s.execute(sa.select(ClientMetric.name, ClientMetric.step, ClientMetric.value)
                       .where(ClientMetric.run_id == run_id, ClientMetric.step > since)
                       .order_by(ClientMetric.name, ClientMetric.step))
    for name, step, value in client:  # a client name that a service series has is shown as client/<name>
        key = f"client/{name}" if name in SERVICE_SERIES else name
        out.setdefault(key, {"unit": "", "source": "client", "points": []})["points"].append([step, value])
    steps = [p[0] for entry in out.values() for p in entry["points"]]
    return {"last_step": max(steps, default=max(since, 0)), "series": out}
