"""RL groups of a run (the dashboard's RL view, docs/dashboard.md): from the rollout store, and
inferred from the run's own sample requests and training datums (db/inferred_groups.py).

A group is the first-turn samples of one prompt at one step: the n choices of one call, and the
trajectories that began with the same prompt tokens; the n samples of one SDK sample request; the
datums with advantages of that prompt trained at that step. A datum's advantage goes to the member
whose sampled tokens begin its completion (the same sample, stored twice), else it is a member of
its own. A member's reward is its own, else its trajectory's; its output tokens are its sampled
tokens, with a one-choice trajectory's later turns. Reading the rows (`run_groups`) and summarising
them (`step_summaries`) are apart, so the summary is plain arithmetic over plain data.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean
from typing import NamedTuple

import numpy as np
import sqlalchemy as sa
from sqlalchemy.orm import Session

from db.inferred_groups import DatumMember, advantage_outcome, datum_members, prompt_key, sample_groups
from db.models import RolloutSample, RolloutTrajectory, RolloutTurn

IN_LIST = 500  # ids per IN (...) query: bounded for every database
OUTCOMES = ("all_good", "all_bad", "mixed", "uniform")
Groups = dict[tuple[int, bytes], list[dict]]  # (step, prompt as int32 bytes) -> members


class RolloutGroups(NamedTuple):
    groups: Groups
    requests: set[str]  # the sample requests the turns came from
    later_prompts: set[tuple[int, bytes]]  # (step, prompt) of later turns: a datum of one is no group member


def of_run(run_id: str):
    """Turns sampled from the run's snapshots (their tinker:// sampler path names the run)."""
    return RolloutTurn.sampler_path.startswith(f"tinker://{run_id}/", autoescape=True)


def group_members(s: Session, tenant_id: str, run_id: str, since: int) -> RolloutGroups:
    """(step, prompt tokens) -> the group's members, for the run's turns after step `since`. A turn
    sampled from policy_version v is at step v + 1, the optimizer step its rollouts feed (as every
    sample on the dashboard's axis: db/run_metrics.py)."""
    turns = s.execute(
        sa.select(RolloutTurn.id, RolloutTurn.trajectory_id, RolloutTurn.turn, RolloutTurn.policy_version,
                  RolloutTurn.prompt_tokens, RolloutTurn.request_id, RolloutTrajectory.session_id,
                  RolloutTrajectory.reward)
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
    groups: Groups = defaultdict(list)
    for t in turns:
        if t.turn != 0:
            continue
        only = len(samples[t.id]) == 1
        for sample in samples[t.id]:
            groups[(t.policy_version + 1, t.prompt_tokens)].append({
                "source": "rollouts", "session_id": t.session_id, "turn": 0, "choice": sample.choice,
                "reward": sample.reward if sample.reward is not None else t.reward, "advantage": None,
                "output_tokens": len(sample.tokens) // 4 + (later_tokens[t.trajectory_id] if only else 0),
                "_tokens": np.frombuffer(sample.tokens, dtype="<i4")})
    return RolloutGroups(groups, {t.request_id for t in turns},
                         {(t.policy_version + 1, t.prompt_tokens) for t in turns if t.turn > 0})


def add_datum(members: list[dict], datum: DatumMember) -> None:
    """A trained datum's advantage on the member it was built from (the first without one whose sampled
    tokens begin the datum's completion), else the datum as a member of its own."""
    for member in members:
        tokens = member.get("_tokens")
        if (member["advantage"] is None and tokens is not None and len(tokens) <= len(datum.completion)
                and np.array_equal(datum.completion[:len(tokens)], tokens)):
            member["advantage"] = datum.advantage
            return
    members.append({"source": "datum", "session_id": None, "turn": 0, "choice": None, "reward": None,
                    "advantage": datum.advantage, "output_tokens": len(datum.completion)})


def run_groups(s: Session, tenant_id: str, run_id: str, since: int) -> Groups:
    """Every group of the run at steps after `since`: the rollout store's, the SDK's samples of one
    prompt (num_samples > 1), and the datums with advantages the run trained on."""
    groups, recorded, later_prompts = group_members(s, tenant_id, run_id, since)
    for step, prompt, sequences in sample_groups(s, tenant_id, run_id, since, recorded):
        groups[(step, prompt)].extend({
            "source": "sample", "session_id": None, "turn": 0, "choice": choice, "reward": None, "advantage": None,
            "output_tokens": len(tokens), "_tokens": np.asarray(tokens, dtype=np.int64)}
            for choice, tokens in enumerate(sequences))
    for step, datum in datum_members(s, tenant_id, run_id, since):
        key = (step, prompt_key(datum.prompt))
        if key not in later_prompts:  # a later turn's own datum (its history rendered anew): not a group's
            add_datum(groups[key], datum)
    return groups


def _stats(values: list[float]) -> dict | None:
    return {"best": max(values), "mean": fmean(values), "worst": min(values)} if values else None


def _outcome(rewards: list[float], advantages: list[float], good_above: float) -> str:
    """By the rewards where there are any; else what the advantages tell (uniform or mixed); else unknown."""
    if rewards:
        return ("all_good" if all(r > good_above for r in rewards)
                else "all_bad" if not any(r > good_above for r in rewards) else "mixed")
    return advantage_outcome(advantages) or "unrewarded"


def _group_json(prompt: bytes, members: list[dict], good_above: float) -> dict:
    members = [{k: v for k, v in m.items() if k != "_tokens"} for m in members]
    rewards = [m["reward"] for m in members if m["reward"] is not None]
    advantages = [m["advantage"] for m in members if m["advantage"] is not None]
    ids = np.frombuffer(prompt, dtype="<i4").tolist()  # (the route decodes them to text)
    return {"prompt_tokens": len(ids), "prompt_ids": ids, "size": len(members),
            "outcome": _outcome(rewards, advantages, good_above), "reward": _stats(rewards),
            "advantage": _stats(advantages), "mean_output_tokens": fmean(m["output_tokens"] for m in members),
            "members": members}


def step_summaries(groups: Groups, good_above: float) -> list[dict]:
    """Per step: its groups, the reward over all members, and the fraction of each outcome among the
    groups whose outcome is known, by rewards or advantages (a reward above `good_above` is good)."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for (step, prompt), members in groups.items():
        by_step[step].append(_group_json(prompt, members, good_above))
    steps = []
    for step in sorted(by_step):
        step_groups = by_step[step]
        known = [g for g in step_groups if g["outcome"] != "unrewarded"]
        members = [m for g in step_groups for m in g["members"]]
        steps.append({
            "step": step, "groups": step_groups,
            "reward": _stats([m["reward"] for m in members if m["reward"] is not None]),
            "mean_output_tokens": fmean(m["output_tokens"] for m in members),
            "fractions": {k: (sum(g["outcome"] == k for g in known) / len(known) if known else 0.0)
                          for k in OUTCOMES},
        })
    return steps
