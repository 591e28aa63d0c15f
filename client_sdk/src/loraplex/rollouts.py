"""The rollout store from Python: what agent harnesses sampled through the server's OpenAI-compatible
inference API (`<server>/oai/api/v1`), as trajectories, and those trajectories as training datums.

    rollouts = loraplex.RolloutsClient(service)
    rollouts.list_trajectories()                   # newest first
    trajectory = rollouts.get_trajectory("episode-17")
    rollouts.set_reward("episode-17", 1.0)         # or turn=..., choice=... for one sampled choice
    built = rollouts.datums("episode-17")          # TrajectoryDatums: .datums, .per_trajectory, .reason
    training.forward_backward(built.datums, "importance_sampling")            # a loraplex TrainingClient
    training.forward_backward(built.tinker_datums(), "importance_sampling")   # an official tinker one

`trajectory_datums` is the rule, run by the server's datums route (and usable offline on a fetched
`Trajectory`): when every turn has one sampled choice and each turn's prompt starts with the previous
prompt followed by exactly its sampled tokens (`check_sequence_extension`), the whole trajectory is
one datum; otherwise each (turn, choice) is a datum of its own, and `reason` says why. Loss inputs sit
only on sampled tokens: `kind="rl"` gives `target_tokens`, the sampler's `logprobs` and `advantages`
(importance_sampling, ppo, cispo, dro); `kind="sft"` gives `target_tokens` and `weights` (cross_entropy).
The tokens trained are exactly the tokens sampled: nothing is decoded and encoded again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import numpy as np

from loraplex.rest_client import _async_twin
from loraplex.rl import check_sequence_extension
from loraplex.types import Datum, ModelInput

if TYPE_CHECKING:
    from loraplex.service_client import ServiceClient

KINDS = ("rl", "sft")


@dataclass(frozen=True)
class RolloutSample:
    """One sampled choice of a turn: its tokens (stop token included) and the sampler's logprob of each."""

    choice: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    reward: float | None = None  # this choice's own; None: the trajectory's

    @classmethod
    def from_json(cls, d: dict) -> "RolloutSample":
        return cls(d["choice"], list(d["tokens"]), list(d["logprobs"]), d["finish_reason"], d.get("reward"))

    def to_json(self) -> dict:
        return {"choice": self.choice, "tokens": self.tokens, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason, "reward": self.reward}


@dataclass(frozen=True)
class RolloutTurn:
    """One call of a trajectory: the prompt exactly as the sampler saw it, and which weights answered."""

    id: str  # the response's id, without OpenAI's "chatcmpl-" / "cmpl-" prefix
    turn: int
    api: str  # "chat.completions" | "completions"
    model: str  # as the call named it: a sampler path, a policy alias or the base model
    sampler_path: str | None  # the tinker:// checkpoint it resolved to; None: the base model
    policy_version: int | None  # optimizer steps of that snapshot; None: the base model
    prompt_tokens: list[int]
    samples: list[RolloutSample]
    created_at: str | None = None
    request: dict | None = None  # the request and the response as they went over the wire
    response: dict | None = None

    @classmethod
    def from_json(cls, d: dict) -> "RolloutTurn":
        return cls(d["id"], d["turn"], d["api"], d["model"], d.get("sampler_path"), d.get("policy_version"),
                   list(d["prompt_tokens"]), [RolloutSample.from_json(s) for s in d["samples"]], d.get("created_at"),
                   d.get("request"), d.get("response"))

    def to_json(self) -> dict:
        return {"id": self.id, "turn": self.turn, "api": self.api, "model": self.model,
                "sampler_path": self.sampler_path, "policy_version": self.policy_version,
                "prompt_tokens": self.prompt_tokens, "samples": [s.to_json() for s in self.samples],
                "created_at": self.created_at, "request": self.request, "response": self.response}


@dataclass(frozen=True)
class Trajectory:
    session_id: str
    turns: list[RolloutTurn]
    reward: float | None = None
    created_at: str | None = None
    updated_at: str | None = None

    @classmethod
    def from_json(cls, d: dict) -> "Trajectory":
        return cls(d["session_id"], [RolloutTurn.from_json(t) for t in d["turns"]], d.get("reward"),
                   d.get("created_at"), d.get("updated_at"))

    def to_json(self) -> dict:
        return {"session_id": self.session_id, "reward": self.reward, "created_at": self.created_at,
                "updated_at": self.updated_at, "turns": [t.to_json() for t in self.turns]}


@dataclass(frozen=True)
class TrajectorySummary:
    session_id: str
    num_turns: int
    reward: float | None
    policy_versions: list[int | None]  # of its turns, in order
    created_at: str | None = None
    updated_at: str | None = None

    @classmethod
    def from_json(cls, d: dict) -> "TrajectorySummary":
        return cls(d["session_id"], d["num_turns"], d.get("reward"), list(d.get("policy_versions", [])),
                   d.get("created_at"), d.get("updated_at"))


@dataclass(frozen=True)
class TrajectoryDatums:
    datums: list[Datum]
    per_trajectory: bool  # True: one datum for the whole trajectory; False: one per (turn, choice)
    reason: str  # why, in words (where the extension broke, or which turn had several choices)
    sources: list[list[tuple[int, int]]]  # per datum: the (turn, choice) pairs whose sampled tokens it trains

    def tinker_datums(self) -> list:
        """`datums` as the official `tinker` SDK's `types.Datum`, for a tinker TrainingClient (this SDK's own
        clients take `datums` as they are). Needs `tinker` installed."""
        from tinker import types as tinker_types

        return [tinker_types.Datum(model_input=tinker_types.ModelInput.from_ints(d.model_input.to_ints()),
                                   loss_fn_inputs={name: tinker_types.TensorData.from_numpy(array)
                                                   for name, array in d.arrays().items()})
                for d in self.datums]

    def to_json(self) -> dict:
        return {"per_trajectory": self.per_trajectory, "reason": self.reason,
                "sources": [[list(pair) for pair in pairs] for pairs in self.sources],
                "datums": [_datum_json(d) for d in self.datums]}

    @classmethod
    def from_json(cls, d: dict) -> "TrajectoryDatums":
        return cls([_datum_from_json(x) for x in d["datums"]], d["per_trajectory"], d["reason"],
                   [[(int(t), int(c)) for t, c in pairs] for pairs in d["sources"]])


def _datum_json(datum: Datum) -> dict:
    inputs = {}
    for name, array in datum.arrays().items():
        dtype = "float32" if array.dtype.kind == "f" else "int64"
        inputs[name] = {"data": array.reshape(-1).tolist(), "dtype": dtype, "shape": list(array.shape)}
    return {"model_input": datum.model_input.to_json(), "loss_fn_inputs": inputs}


def _datum_from_json(d: dict) -> Datum:
    tokens = [t for chunk in d["model_input"]["chunks"] for t in chunk["tokens"]]
    inputs = {name: np.asarray(t["data"], dtype=np.float32 if t["dtype"] == "float32" else np.int64)
              .reshape(t["shape"]) for name, t in d["loss_fn_inputs"].items()}
    return Datum(ModelInput.from_ints(tokens), inputs)


# --- the rule ------------------------------------------------------------------------------------


def _value(trajectory: Trajectory, turn: RolloutTurn, sample: RolloutSample, advantage: float | None) -> float:
    """The advantage of a sample's tokens: `advantage` if given, else the sample's reward, else the trajectory's."""
    for value in (advantage, sample.reward, trajectory.reward):
        if value is not None:
            return float(value)
    raise ValueError(f"advantage: trajectory {trajectory.session_id!r} turn {turn.turn} choice {sample.choice} has no "
                     "reward: attach one (set_reward) or pass advantage")


def _datum(tokens: list[int], spans: list[tuple[int, list[float], float]], kind: str) -> Datum:
    """A Tinker-aligned datum over `tokens` (row j predicts tokens[j + 1]) whose loss inputs are set only
    on the sampled spans, each (its first position in `tokens`, the sampler's logprobs, its value)."""
    n = len(tokens) - 1
    logprobs, advantages, weights = (np.zeros(n, dtype=np.float32) for _ in range(3))
    for start, span_logprobs, value in spans:
        rows = slice(start - 1, start - 1 + len(span_logprobs))
        logprobs[rows], advantages[rows], weights[rows] = span_logprobs, value, 1.0
    targets = np.asarray(tokens[1:], dtype=np.int64)
    inputs = ({"target_tokens": targets, "logprobs": logprobs, "advantages": advantages} if kind == "rl"
              else {"target_tokens": targets, "weights": weights})
    return Datum(ModelInput.from_ints(tokens[:-1]), inputs)


def _merge_check(turns: list[RolloutTurn]) -> str | None:
    """None when the turns are one sequence; else why not."""
    several = next((t for t in turns if len(t.samples) != 1), None)
    if several is not None:
        return f"turn {several.turn} has {len(several.samples)} sampled choices: one datum per turn and choice"
    conversation = [{"role": "assistant", "tokens": t.samples[0].tokens} for t in turns]
    report = check_sequence_extension(lambda messages: turns[len(messages)].prompt_tokens, conversation)
    broken = report.first_break
    if broken is None:
        return None
    k = broken.turn
    where = (f"position {broken.break_at} is token {broken.got}, the sampled sequence has {broken.expected}"
             if broken.got is not None else f"it ends at position {broken.break_at}, before the sampled tokens do")
    return (f"turn {turns[k + 1].turn}'s prompt does not extend turn {turns[k].turn}'s prompt and sampled tokens "
            f"({where}; a chat template re-rendering the history changes tokens): one datum per turn")


def trajectory_datums(trajectory: Trajectory, kind: str = "rl", advantage: float | None = None) -> TrajectoryDatums:
    """Training datums of a stored trajectory (the rule is in this module's docstring). Raises
    ValueError naming the field when a value is missing (no reward and no advantage, for kind "rl")."""
    if kind not in KINDS:
        raise ValueError(f"kind: one of {', '.join(KINDS)}, got {kind!r}")
    turns = sorted(trajectory.turns, key=lambda t: t.turn)
    if not turns:
        raise ValueError(f"session_id: trajectory {trajectory.session_id!r} has no turns")

    def value(turn: RolloutTurn, sample: RolloutSample) -> float:
        return _value(trajectory, turn, sample, advantage) if kind == "rl" else 1.0

    why_not = _merge_check(turns)
    if why_not is None:
        spans = [(len(t.prompt_tokens), t.samples[0].logprobs, value(t, t.samples[0])) for t in turns]
        tokens = turns[-1].prompt_tokens + turns[-1].samples[0].tokens
        reason = ("one turn" if len(turns) == 1 else
                  f"each of its {len(turns)} turns' prompts extends the previous prompt and its sampled tokens")
        return TrajectoryDatums([_datum(tokens, spans, kind)], True, reason, [[(t.turn, 0) for t in turns]])
    datums, sources = [], []
    for turn in turns:
        for sample in turn.samples:
            spans = [(len(turn.prompt_tokens), sample.logprobs, value(turn, sample))]
            datums.append(_datum(turn.prompt_tokens + sample.tokens, spans, kind))
            sources.append([(turn.turn, sample.choice)])
    return TrajectoryDatums(datums, False, why_not, sources)


# --- the client ----------------------------------------------------------------------------------


def _path(session_id: str, suffix: str = "") -> str:
    return f"/rollouts/trajectories/{quote(session_id, safe='')}{suffix}"


class RolloutsClient:
    """The rollout store's REST routes (`/api/v1/rollouts/...`), scoped to the key's tenant."""

    def __init__(self, service: "ServiceClient") -> None:
        self.service = service

    def list_trajectories(self, limit: int = 20, offset: int = 0) -> list[TrajectorySummary]:
        """The tenant's trajectories, most recently updated first."""
        found = self.service.call("GET", f"/rollouts/trajectories?{urlencode({'limit': limit, 'offset': offset})}")
        return [TrajectorySummary.from_json(t) for t in found["trajectories"]]

    def get_trajectory(self, session_id: str) -> Trajectory:
        return Trajectory.from_json(self.service.call("GET", _path(session_id)))

    def set_reward(self, session_id: str, reward: float | None, *, turn: int | None = None,
                   choice: int | None = None) -> None:
        """The trajectory's reward, or with `turn` (and `choice`: else all of the turn's) a sample's own.
        None clears it."""
        self.service.call("PUT", _path(session_id, "/reward"), {"reward": reward, "turn": turn, "choice": choice})

    def delete_trajectory(self, session_id: str) -> None:
        self.service.call("DELETE", _path(session_id))

    def datums(self, session_id: str, *, kind: str = "rl", advantage: float | None = None) -> TrajectoryDatums:
        """The trajectory as training datums (`trajectory_datums`, run by the server)."""
        query: dict[str, Any] = {"kind": kind} | ({"advantage": advantage} if advantage is not None else {})
        return TrajectoryDatums.from_json(self.service.call("GET", _path(session_id, f"/datums?{urlencode(query)}")))


for _name in ("list_trajectories", "get_trajectory", "set_reward", "delete_trajectory", "datums"):
    setattr(RolloutsClient, f"{_name}_async", _async_twin(_name))
