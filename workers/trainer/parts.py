"""One large forward/forward_backward request run in parts, on one engine, over several calls.

The scheduler runs a request larger than a cycle in parts, each in a cycle of its own, so other
tenants' work runs between them (scheduler/planner.py). Gradients accumulate across calls until
optim_step, so parts that together cover every datum once leave the gradient of the whole.

Where a part ends: after whole engine passes (`split_into_passes` of the request's remaining
datums alone), as many as fit `max_tokens` (at least one). A part then runs with `own_passes`, so
its passes are exactly those the whole request gets when it runs alone: its logprobs, loss and
gradient are those bits, not just the same within rounding. Its result merges the parts as the
Tinker SDK merges the chunks of a large request (`merge_metrics`): per-datum outputs concatenated
in order, `:sum` summed, `:mean` weighted by datums, `:min` / `:max`; over the per-pass metrics,
in pass order, as the engine merges its passes, so a `:sum` adds up in the order it does alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from contract.inputs import ForwardBackwardInput
from contract.queue import PartProgress
from workers.trainer.batch import EngineOutput, PreparedRequest, prepare_request, split_into_passes


def merge_metrics(pieces: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """Metrics of pieces of one request ((metrics, datums) each, in datum order) as one result.
    Reductions by the name's suffix, as the Tinker SDK's chunk merge; like it, a metric missing from
    a piece or of another reduction (Tinker's slack, hash2, unique: no engine metric uses them) is left out."""
    if not pieces:
        return {}
    merged: dict[str, float] = {}
    for key in pieces[0][0]:
        if not all(key in metrics for metrics, _ in pieces):
            continue
        values = [float(metrics[key]) for metrics, _ in pieces]
        reduction = key.rpartition(":")[2]
        if reduction == "sum":
            total = 0.0
            for v in values:  # left to right from 0.0: the engine's own accumulation over passes
                total += v
            merged[key] = total
        elif reduction == "mean":
            weights = [n for _, n in pieces]
            merged[key] = math.fsum(v * w for v, w in zip(values, weights)) / sum(weights)
        elif reduction == "min":
            merged[key] = min(values)
        elif reduction == "max":
            merged[key] = max(values)
    return merged


@dataclass
class SplitRun:
    """A request being run in parts on one engine: validated whole once, its parts' results so far."""

    request_id: str
    prepared: PreparedRequest
    done: int = 0  # datums run
    tokens_done: int = 0
    outputs: list[dict] = field(default_factory=list)  # per datum run, in order
    pieces: list[tuple[dict[str, float], int]] = field(default_factory=list)  # per engine pass, in order
    _next_end: int = 0

    @classmethod
    def begin(cls, request_id: str, request: ForwardBackwardInput, vocab_size: int, max_len: int) -> "SplitRun":
        """Validate the whole request before any part runs (InvalidInputError naming the field,
        datum indices of the whole request): a bad request fails before any gradient is applied."""
        return cls(request_id, prepare_request(0, request, vocab_size, max_len))

    @property
    def total(self) -> int:
        return len(self.prepared.tokens)

    @property
    def complete(self) -> bool:
        return self.done == self.total

    @property
    def progress(self) -> PartProgress:
        return PartProgress(self.done, self.tokens_done)

    def next_input(self, max_tokens: float, max_pass_tokens: int, min_shared: int) -> ForwardBackwardInput:
        """The next part: whole passes from datum `done`, as many as fit `max_tokens` (at least one)."""
        rest = replace(self.prepared, tokens=self.prepared.tokens[self.done:], inputs=self.prepared.inputs[self.done:])
        end, used = self.done, 0
        for (piece,) in split_into_passes([rest], max_pass_tokens, min_shared):  # one request: one piece a pass
            tokens = sum(t.numel() for t in piece.tokens)
            if used and used + tokens > max_tokens:
                break
            end, used = self.done + piece.datum_ids[-1] + 1, used + tokens
        self._next_end = end
        whole = self.prepared.request
        return replace(whole, data=whole.data[self.done:end], own_passes=True)

    def add(self, output: EngineOutput) -> None:
        """The result of the part `next_input` gave."""
        self.tokens_done += sum(t.numel() for t in self.prepared.tokens[self.done:self._next_end])
        self.done = self._next_end
        self.outputs.extend(output.loss_fn_outputs)
        self.pieces.extend(output.pass_metrics)

    def result(self) -> EngineOutput:
        """The whole request's result, once complete."""
        return EngineOutput(self.outputs, merge_metrics(self.pieces), list(self.pieces))
