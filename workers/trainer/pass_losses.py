"""The losses of every request of one packed pass, with one loss call per kind of request.

Requests that share a loss function, its config, the shape of their targets and `forward_only`
are one group: their datums' tokens are concatenated and the loss runs once over all of them (a
loss is per token, and its per-sequence terms go by `datum_index`, so a datum's loss does not
depend on what else is in the group). Eight tenants' small RL updates with one loss then cost one
loss call and one gather of the target logprobs, not eight of each. Each request's `loss:sum` is
the sum of its own tokens' losses, accumulated in float64 one token after another in datum order,
whatever groups the pass made (a request whose datums have targets of two shapes is in two).
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.trainer.batch import EngineOutput, PackedBatch, PreparedRequest
from workers.trainer.losses import LOSS_FUNCTIONS


def pass_losses(prepared: list[PreparedRequest], batch: PackedBatch,
                target_logprobs: Tensor) -> tuple[list[EngineOutput], Tensor | None]:
    """Each request's output (per-datum target logprobs, `loss:sum`), and the loss to
    backpropagate: the sum over the requests that are not forward_only (None if all are)."""
    device = target_logprobs.device
    groups: dict[tuple, list[tuple[int, int]]] = {}  # group key -> its (request, datum) pairs
    for r, p in enumerate(prepared):
        config = tuple(sorted(p.config.items()))
        for d, inputs in enumerate(p.inputs):
            key = (p.request.loss_fn, config, tuple(inputs["target_tokens"].shape[1:]), p.request.forward_only)
            groups.setdefault(key, []).append((r, d))
    per_datum: list[list[Tensor | None]] = [[None] * len(p.tokens) for p in prepared]
    datum_losses: list[list[Tensor | None]] = [[None] * len(p.tokens) for p in prepared]  # per token
    total: Tensor | None = None
    for (_, _, _, forward_only), members in groups.items():
        first = prepared[members[0][0]]
        lengths = [prepared[r].tokens[d].numel() for r, d in members]
        starts = [batch.datum_offsets[prepared[r].index][d] for r, d in members]
        positions = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, lengths)]).to(device)
        names = first.inputs[members[0][1]]
        inputs = {k: torch.cat([prepared[r].inputs[d][k] for r, d in members]).to(device) for k in names}
        targets = inputs.pop("target_tokens")
        tlp = target_logprobs[positions, 0] if targets.dim() == 1 else target_logprobs[positions, : targets.shape[1]]
        datum_index = torch.repeat_interleave(torch.arange(len(members), device=device),
                                              torch.tensor(lengths, device=device))
        token_losses = LOSS_FUNCTIONS[first.request.loss_fn](tlp, inputs, first.config, datum_index, len(members))
        token_sums = token_losses.detach().reshape(len(tlp), -1).sum(1)  # over an (N, K) datum's K targets
        for (r, d), sums in zip(members, token_sums.cpu().double().split(lengths)):
            datum_losses[r][d] = sums
        if not forward_only:
            total = token_losses.sum() if total is None else total + token_losses.sum()
        for (r, d), lp in zip(members, tlp.detach().cpu().split(lengths)):
            per_datum[r][d] = lp
    request_of_token = torch.repeat_interleave(
        torch.arange(len(prepared)), torch.tensor([sum(t.numel() for t in p.tokens) for p in prepared]))
    request_losses = torch.zeros(len(prepared), dtype=torch.float64).index_add_(  # in order, token by token
        0, request_of_token, torch.cat([sums for datums in datum_losses for sums in datums]))
    outputs = [
        EngineOutput(loss_fn_outputs=[{"logprobs": lp} for lp in datums], metrics={"loss:sum": loss})
        for datums, loss in zip(per_datum, request_losses.tolist())
    ]
    return outputs, total
