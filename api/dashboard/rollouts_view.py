"""The dashboard's view of a run's RL rollouts (docs/dashboard.md): its RL groups per step and prompt
(the rollout store's, and those inferred from its SDK samples and trained datums), and one
trajectory's tokens with the sampler's and the trainer's logprob of each."""

from __future__ import annotations

from collections import defaultdict
from typing import Annotated

import numpy as np
import sqlalchemy as sa
from fastapi import HTTPException, Query, Request
from loraplex.wire.client import decode_forward_backward_output
from loraplex.wire.codec import decode_forward_backward_request
from sqlalchemy.orm import Session

from api.dashboard.auth import CurrentViewer
from api.dashboard.data import Step, router, visible_run
from api.deps import DB
from api.input_policy import readable
from api.served_models import served
from contract.kinds import RequestKind
from db.models import Request as RequestRow
from db.models import RequestState, RolloutSample, RolloutTrajectory, RolloutTurn
from db.rl_groups import run_groups, step_summaries

TRAINER_SEARCH = 50  # newest forward/forward_backward requests of the run searched for a trajectory's tokens


def _ints(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype="<i4")


def _floats(raw: bytes) -> list[float]:
    return np.frombuffer(raw, dtype="<f4").tolist()


@router.get("/runs/{run_id}/rl_groups")
def rl_groups(run_id: str, request: Request, viewer: CurrentViewer, db: DB, since: Step = -1,
              good_above: Annotated[float, Query(allow_inf_nan=False)] = 0.0) -> dict:
    """The run's RL groups per step (db/rl_groups.py)."""
    run = visible_run(db, viewer, run_id)
    groups = run_groups(db, run.tenant_id, run_id, since)
    steps = step_summaries(groups, good_above)
    if steps:
        from api.inference.rendering import tokenizer_of  # transformers: loaded on first use

        tokenizer = tokenizer_of(str(served(request).stored(run.base_model, "run_id").info.path))
        for step in steps:
            for group in step["groups"]:
                group["prompt_text"] = tokenizer.decode(group.pop("prompt_ids"))
    return {"run_id": run_id, "steps": steps}


def _trainer_logprobs(db: Session, run_id: str, since, sequences: list[np.ndarray]) -> list[list[float] | None]:
    """For each full sequence (prompt + sampled tokens), the logprobs of its sampled part from the newest
    forward/forward_backward of the run whose datum begins with exactly those tokens; None if none does."""
    found: list[list[float] | None] = [None] * len(sequences)
    rows = db.execute(sa.select(RequestRow.payload, RequestRow.result).where(
        RequestRow.model_id == run_id, RequestRow.state == RequestState.DONE, RequestRow.created_at >= since,
        RequestRow.kind.in_([RequestKind.FORWARD, RequestKind.FORWARD_BACKWARD]))
        .order_by(RequestRow.created_at.desc()).limit(TRAINER_SEARCH))
    for payload, result in rows:
        if all(f is not None for f in found):
            break
        data = decode_forward_backward_request(payload, None).data
        outputs = decode_forward_backward_output(result)[0]
        for datum, output in zip(data, outputs):
            targets = datum.loss_fn_inputs.get("target_tokens")
            if targets is None or targets.ndim != 1 or "logprobs" not in output or output["logprobs"].ndim != 1:
                continue
            full = np.concatenate([datum.tokens, targets[-1:]])
            for i, (seq, prompt_len) in enumerate(sequences):
                if found[i] is None and len(full) >= len(seq) and np.array_equal(full[:len(seq)], seq):
                    found[i] = output["logprobs"][prompt_len - 1:len(seq) - 1].tolist()
    return found


def _new_input(tokenizer, previous, turn, by_turn) -> str | None:
    """What came between a turn and the one before it (a tool's output, the environment's answer, the
    user's next message): the part of its prompt after the previous prompt and that turn's sampled
    tokens, when it extends them; None for the first turn, or when the history was rendered again."""
    if previous is None or len(by_turn[previous.id]) != 1:
        return None
    before = np.concatenate([_ints(previous.prompt_tokens), _ints(by_turn[previous.id][0].tokens)])
    prompt = _ints(turn.prompt_tokens)
    if len(prompt) < len(before) or not np.array_equal(prompt[:len(before)], before):
        return None
    return tokenizer.decode(prompt[len(before):].tolist())


def _messages(body) -> list[dict] | None:
    """A chat call's messages, role and text (tool and environment turns included), as the harness sent them."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # parts: their text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append({"role": str(m.get("role", "")), "content": readable(content if isinstance(content, str) else "")})
    return out


@router.get("/runs/{run_id}/trajectories/{session_id}")
def trajectory(run_id: str, session_id: str, request: Request, viewer: CurrentViewer, db: DB) -> dict:
    run = visible_run(db, viewer, run_id)
    row = db.scalar(sa.select(RolloutTrajectory).where(RolloutTrajectory.tenant_id == run.tenant_id,
                                                       RolloutTrajectory.session_id == session_id))
    turns = [] if row is None else db.scalars(sa.select(RolloutTurn).where(RolloutTurn.trajectory_id == row.id)
                                              .order_by(RolloutTurn.turn)).all()
    if not any(t.sampler_path and t.sampler_path.startswith(f"tinker://{run_id}/") for t in turns):
        raise HTTPException(404, f"session_id: no trajectory {session_id[:200]!r} sampled by run {run_id[:200]!r}")
    samples = db.scalars(sa.select(RolloutSample).where(RolloutSample.turn_id.in_([t.id for t in turns]))
                         .order_by(RolloutSample.turn_id, RolloutSample.choice)).all()
    by_turn = defaultdict(list)
    for sample in samples:
        by_turn[sample.turn_id].append(sample)
    choices = [(t, s) for t in turns for s in by_turn[t.id]]
    sequences = [(np.concatenate([_ints(t.prompt_tokens), _ints(s.tokens)]).astype(np.int64), len(t.prompt_tokens) // 4)
                 for t, s in choices]
    trainer = _trainer_logprobs(db, run_id, row.created_at, sequences)
    from api.inference.rendering import tokenizer_of  # transformers: loaded on first use

    tokenizer = tokenizer_of(str(served(request).stored(run.base_model, "run_id").info.path))
    out_turns = {t.id: {"turn": t.turn, "policy_version": t.policy_version, "prompt_tokens": len(t.prompt_tokens) // 4,
                        "prompt_text": tokenizer.decode(_ints(t.prompt_tokens).tolist()),
                        "new_input_text": _new_input(tokenizer, previous, t, by_turn),
                        "messages": _messages(t.request_body), "choices": []}
                 for previous, t in zip([None, *turns], turns)}
    for (t, s), trained in zip(choices, trainer):
        tokens = _ints(s.tokens).tolist()
        out_turns[t.id]["choices"].append({
            "choice": s.choice, "reward": s.reward, "finish_reason": s.finish_reason, "tokens": tokens,
            "token_texts": [tokenizer.decode([tok]) for tok in tokens], "sampler_logprobs": _floats(s.logprobs),
            "trainer_logprobs": trained})
    return {"run_id": run_id, "session_id": session_id, "reward": row.reward, "turns": list(out_turns.values())}
