"""The dashboard's times are what a stopwatch shows, and every number sits at the step it belongs to:
a run whose request timings are known, written as the scheduler and the sampler write them, read back
through `run_metrics.series`."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from contract.kinds import RequestKind
from db import run_metrics
from db.models import ClientSession, Request, RequestState, ServiceMetric, TrainingModel
from db.session import make_engine, make_session_factory, upgrade_to_head
from db.tenants import create_tenant

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
RUN = "run-1:train:0"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def sessions(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_to_head(url)
    return make_session_factory(make_engine(url))


def add(s, tenant_id: str, kind: str, step: int, numbers: dict, created: float, started: float | None,
        finished: float) -> None:
    request = Request(tenant_id=tenant_id, model_id=RUN, kind=kind, state=RequestState.DONE, payload=b"",
                      payload_content_type="application/json", created_at=at(created),
                      started_at=None if started is None else at(started), finished_at=at(finished))
    s.add(request)
    s.flush()
    s.add(ServiceMetric(tenant_id=tenant_id, run_id=RUN, source=kind, request_id=request.id, step=step,
                        numbers=numbers))


def test_times_are_wall_clock_and_samples_sit_at_the_step_they_feed(sessions):
    with sessions() as s:
        tenant, _ = create_tenant(s, "rl")
        session = ClientSession(tenant_id=tenant.id, tags=[], user_metadata={})
        s.add(session)
        s.flush()
        s.add(TrainingModel(id=RUN, tenant_id=tenant.id, session_id=session.id, base_model="tiny",
                            lora_config={"rank": 4}, user_metadata={}))
        # Step 1's rollouts: 50 concurrent samples of policy_version 0, accepted at t = 0, 0.02, ... 0.98 s and
        # finished 14 s after each, 40 tokens each: a stopwatch shows 14.98 s of sampling, 2,000 / 14.98 tokens/s.
        for i in range(50):
            add(s, tenant.id, RequestKind.SAMPLE, 0, {"sample_tokens": 40, "sample_seconds": 14.0,
                                                      "logprob_sum": -40.0, "logprob_tokens": 40},
                created=i / 50, started=None, finished=14 + i / 50)
        # ... trained by two forward_backwards that ran together (accepted at 15 s, started 16 s, finished
        # 20 s) and an optim_step (accepted 20 s, started 21 s, finished 21.5 s): 1 + 1 s waiting with
        # nothing of the step computing, 4 + 0.5 s computing.
        for _ in range(2):
            add(s, tenant.id, RequestKind.FORWARD_BACKWARD, 1, {"loss_sum": 10.0, "tokens": 5}, 15, 16, 20)
        add(s, tenant.id, RequestKind.OPTIM_STEP, 1, {"grad_norm": 1.5, "learning_rate": 1e-3}, 20, 21, 21.5)
        s.commit()

        series = run_metrics.series(s, RUN)["series"]
    value = {name: dict(entry["points"]) for name, entry in series.items()}
    assert value["sample/seconds"] == {1: pytest.approx(14.98)}  # summed, it was 700 s
    assert value["sample/tokens"] == {1: 2000}
    assert value["sample/tokens_per_second"] == {1: pytest.approx(2000 / 14.98, rel=1e-3)}
    assert value["entropy"] == {1: pytest.approx(1.0)}
    assert value["train/queue_seconds"] == {1: pytest.approx(2.0)}
    assert value["train/compute_seconds"] == {1: pytest.approx(4.5)}
    assert value["loss"] == {1: pytest.approx(2.0)}  # 20 nats over 10 tokens


def test_wall_seconds_counts_overlapping_intervals_once():
    intervals = [(at(0), at(10)), (at(5), at(12)), (at(20), at(21))]
    assert run_metrics.wall_seconds(intervals) == 13.0
    assert run_metrics.wall_seconds(intervals, outside=[(at(8), at(20.5))]) == 8.5
    assert run_metrics.wall_seconds([]) == 0.0
