"""Two checks from RL practice, on token ids.

`prefix_overlap`: how much of a batch of trajectories is shared prefix (GRPO groups, multi-turn
rollouts): the work a prefix cache or packed trie saves. `check_sequence_extension`: whether a
multi-turn rollout can be trained as one sequence, i.e. each turn's prompt starts with the
previous prompt followed by exactly the tokens sampled for it. Chat templates that rewrite history
(e.g. strip earlier <think> reasoning) break it, and then every turn must be its own datum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def prefix_overlap(trajectories: Sequence[Sequence[int]]) -> float:
    """1 - (nodes of the token trie of all trajectories / total tokens): 0 when nothing is shared."""
    root: dict = {}
    nodes = total = 0
    for trajectory in trajectories:
        node = root
        for token in trajectory:
            total += 1
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                nodes += 1
            node = child
    return 0.0 if total == 0 else 1.0 - nodes / total


@dataclass(frozen=True)
class TurnCheck:
    turn: int  # index of the assistant message whose successor prompt was checked
    extends: bool
    break_at: int | None = None  # first token position (in the next prompt) where it differs
    expected: int | None = None  # the token the extension needed there (None: the prompt ended early)
    got: int | None = None  # the token the next prompt has there (None: it is too short)


@dataclass(frozen=True)
class ExtensionReport:
    turns: list[TurnCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(t.extends for t in self.turns)

    @property
    def first_break(self) -> TurnCheck | None:
        return next((t for t in self.turns if not t.extends), None)


def check_sequence_extension(render: Callable[[list[dict]], list[int]], conversation: Sequence[dict]) -> ExtensionReport:
    """`render(messages)` gives the prompt tokens for the next assistant turn after `messages`;
    every assistant message in `conversation` carries the sampled `tokens` (stop token included).
    For each assistant turn k followed by another: does prompt(k+1) start with prompt(k) + tokens(k)?"""
    assistant = [i for i, m in enumerate(conversation) if m.get("role") == "assistant"]
    checks = []
    for k, (i, j) in enumerate(zip(assistant, assistant[1:])):
        if "tokens" not in conversation[i]:
            raise ValueError(f"conversation[{i}].tokens: assistant messages need the sampled token ids")
        expected = list(render(list(conversation[:i]))) + list(conversation[i]["tokens"])
        following = list(render(list(conversation[:j])))
        mismatch = next((p for p, (a, b) in enumerate(zip(expected, following)) if a != b), None)
        if mismatch is None and len(following) >= len(expected):
            checks.append(TurnCheck(k, True))
        elif mismatch is None:  # the next prompt is a strict prefix of what it should start with
            checks.append(TurnCheck(k, False, len(following), expected[len(following)], None))
        else:
            checks.append(TurnCheck(k, False, mismatch, expected[mismatch], following[mismatch]))
    return ExtensionReport(checks)
