"""RL groups of a run, read from the rollout store (the dashboard's RL view, docs/dashboard.md).

A group is the first-turn samples of one prompt at one step: the n choices of one call, and the
trajectories that began with the same prompt tokens. A member's reward is its own, else its
trajectory's; its output tokens are its sampled tokens, with a one-choice trajectory's later turns.
Reading the rows (`group_members`) and summarising them (`step_summaries`) are apart, so the
summary is plain arithmetic over plain data.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean

import numpy as np
import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.models import RolloutSample, RolloutTrajectory, RolloutTurn

IN_LIST = 500  # ids per IN (...) query: bounded for every database
OUTCOMES = ("all_good", "all_bad", "mixed")


def of_run(run_id: str):
    """Turns sampled from the run's snapshots (their tinker:// sampler path names the run)."""
    return RolloutTurn.sampler_path.startswith(f"tinker://{run_id}/", autoescape=True)


def group_members(s: Session, tenant_id: str, run_id: str, since: int) -> dict[tuple[int, bytes], list[dict]]:
    """(step, prompt tokens) -> the group's members, for the run's turns after step `since`. A turn
    sampled from policy_version v is at step v + 1, the optimizer step its rollouts feed (as every
    sample on the dashboard's axis: db/run_metrics.py)."""
    turns = s.execute(
        sa.select(RolloutTurn.id, RolloutTurn.trajectory_id, RolloutTurn.turn, RolloutTurn.policy_version,
                  RolloutTurn.prompt_tokens, RolloutTrajectory.session_id, RolloutTrajectory.reward)
        .join(RolloutTrajectory, RolloutTrajectory.id == RolloutTurn.trajectory_id)
        .where(RolloutTurn.tenant_id == tenant_id, of_run(run_id), RolloutTurn.policy_version >= since)  # feeds step > since
        .order_by(RolloutTurn.trajectory_id, RolloutTurn.turn)).all()
    samples: dict[str, list] = defaultdict(list)
    for chunk in range(0, len(turns), IN_LIST):
        ids = [t.id for t in turns[chunk:chunk + IN_LIST]]
        for sample in s.execute(sa.select(RolloutSample.turn_id, RolloutSample.choice, RolloutSample.tokens,
                                          RolloutSample.reward).where(RolloutSample.turn_id.in_(ids))
                                .order_by(RolloutSample.turn_id, RolloutSample.choice)):
            samples[sample.turn_id].append(sample)
    later_tokens: dict[str, int] = defaultdict(int)  # a trajectory's tokens sampled after its first turn
    for t in turns:
        if t.turn > 0 and len(samples[t.id]) == 1:
            later_tokens[t.trajectory_id] += len(samples[t.id][0].tokens) // 4
    groups: dict[tuple[int, bytes], list[dict]] = defaultdict(list)
    for t in turns:
        if t.turn != 0:
            continue
        only = len(samples[t.id]) == 1
        for sample in samples[t.id]:
            groups[(t.policy_version + 1, t.prompt_tokens)].append({
                "session_id": t.session_id, "turn": 0, "choice": sample.choice,
                "reward": sample.reward if sample.reward is not None else t.reward,
                "output_tokens": len(sample.tokens) // 4 + (later_tokens[t.trajectory_id] if only else 0)})
    return groups


def _stats(values: list[float]) -> dict | None:
    return {"best": max(values), "mean": fmean(values), "worst": min(values)} if values else None


def _group_json(prompt: bytes, members: list[dict], good_above: float) -> dict:
    rewards = [m["reward"] for m in members if m["reward"] is not None]
    outcome = ("unrewarded" if not rewards else "all_good" if all(r > good_above for r in rewards)
               else "all_bad" if not any(r > good_above for r in rewards) else "mixed")
    ids = np.frombuffer(prompt, dtype="<i4").tolist()  # (the route decodes them to text)
    return {"prompt_tokens": len(ids), "prompt_ids": ids, "size": len(members), "outcome": outcome,
            "reward": _stats(rewards), "mean_output_tokens": fmean(m["output_tokens"] for m in members),
            "members": members}


def step_summaries(groups: dict[tuple[int, bytes], list[dict]], good_above: float) -> list[dict]:
    """Per step: its groups, the reward over all members, and the fraction of each outcome among the
    rewarded groups (a reward above `good_above` is good)."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for (step, prompt), members in groups.items():
        by_step[step].append(_group_json(prompt, members, good_above))
    steps = []
    for step in sorted(by_step):
        step_groups = by_step[step]
        rewarded = [g for g in step_groups if g["outcome"] != "unrewarded"]
        members = [m for g in step_groups for m in g["members"]]
        steps.append({
            "step": step, "groups": step_groups,
            "reward": _stats([m["reward"] for m in members if m["reward"] is not None]),
            "mean_output_tokens": fmean(m["output_tokens"] for m in members),
            "fractions": {k: (sum(g["outcome"] == k for g in rewarded) / len(rewarded) if rewarded else 0.0)
                          for k in OUTCOMES},
        })
    return steps
