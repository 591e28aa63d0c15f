"""Datums of one request that begin with the same tokens compute that beginning once.

An RL group (n completions of one prompt) repeats its prompt n times. A datum's hidden states at
positions 0..i depend only on its tokens 0..i and its adapter, so within one request (one
adapter) a datum that begins like the group's first datum, its leader, needs packed rows only
for its own tail. Those rows attend to the leader's first rows (`group_mask`), its logprobs at
the shared positions are read off the leader's rows with its own targets, and the backward sums
every member's gradient into the shared rows: each datum gets what it gets alone, within float
rounding. Rows are never shared across requests, so never across adapters or tenants.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Below this, a shared beginning saves too few rows to pay for the group's attention mask.
MIN_SHARED_TOKENS = 8


def common_prefix(a: Tensor, b: Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.numel() else n


def shared_length(leader: Tensor | None, tokens: Tensor, min_shared: int) -> int:
    """How many of `tokens`' first rows it can take from `leader`: their common beginning, less
    its last token (a datum keeps at least one row of its own); 0 if that is below `min_shared`
    (min_shared <= 0 turns sharing off)."""
    if leader is None or min_shared <= 0:
        return 0
    shared = min(common_prefix(leader, tokens), tokens.numel() - 1)
    return shared if shared >= min_shared else 0


def share_plan(tokens: list[Tensor], min_shared: int) -> list[int]:
    """For each datum in order, the rows it shares with its group's leader; 0 starts a new group
    with that datum as its leader."""
    plan, leader = [], None
    for t in tokens:
        shared = shared_length(leader, t, min_shared)
        if shared == 0:
            leader = t
        plan.append(shared)
    return plan


def group_mask(leader_length: int, members: list[tuple[int, int]]) -> Tensor:
    """Who attends to whom in a group laid out as the leader's rows, then each member's own rows.

    members: (shared rows, own rows) per member. Leader rows attend causally among themselves; a
    member row attends to the leader's first `shared` rows and causally to its member's own rows.
    Returns a boolean [rows, rows] mask, True where the query row (first index) may attend."""
    owner = [torch.zeros(leader_length, dtype=torch.int64)]  # 0: the leader, m: member m
    position = [torch.arange(leader_length)]
    shares = [0]
    for m, (shared, own) in enumerate(members, start=1):
        owner.append(torch.full((own,), m, dtype=torch.int64))
        position.append(torch.arange(shared, shared + own))
        shares.append(shared)
    owner_t, position_t = torch.cat(owner), torch.cat(position)
    visible_prefix = torch.tensor(shares)[owner_t]  # how many leader rows each query row sees
    same_owner = owner_t[:, None] == owner_t[None, :]
    causal = position_t[None, :] <= position_t[:, None]
    from_leader = (owner_t[None, :] == 0) & (position_t[None, :] < visible_prefix[:, None])
    return (same_owner & causal) | from_leader
