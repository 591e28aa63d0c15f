"""Forming one scheduler cycle from the runnable requests of many tenants.

Policy (fair under a token budget): forward/forward_backward requests of all tenants go into one
batched engine call of at most `token_budget` tokens. Tenants are visited round-robin, one request
per tenant per pass, starting one tenant later every cycle, so a tenant with a huge backlog gets
one turn per pass like everyone else and cannot starve a tenant with a small batch; within a
tenant, its models are served round-robin too. A request larger than the whole budget still runs
(alone if need be) so nothing waits forever. Why this policy: training requests are not
preemptible and are roughly proportional in cost to their tokens, so equal turns per pass under a
token cap bound every tenant's wait by one cycle per request ahead of it, whatever others send.
optim_steps of all models are batched into one call per cycle; other operations (create, save,
load) run one by one after the batched work.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from scheduler.ordering import BATCHABLE_KINDS, QueuedRequest


@dataclass
class Cycle:
    forward_backward: list[QueuedRequest] = field(default_factory=list)
    optim_steps: list[QueuedRequest] = field(default_factory=list)
    others: list[QueuedRequest] = field(default_factory=list)

    def all(self) -> list[QueuedRequest]:
        return self.forward_backward + self.optim_steps + self.others

    def __bool__(self) -> bool:
        return bool(self.forward_backward or self.optim_steps or self.others)


class CyclePlanner:
    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self._rotation = 0

    def plan(self, runnable: dict[str, list[QueuedRequest]]) -> Cycle:
        cycle = Cycle()
        # tenant -> list of per-model request runs (each run must be admitted as a prefix, in order)
        runs_by_tenant: dict[str, list[list[QueuedRequest]]] = defaultdict(list)
        for run in runnable.values():
            head = run[0]
            if head.kind in BATCHABLE_KINDS:
                runs_by_tenant[head.tenant_id].append(list(run))
            elif head.kind == "optim_step":
                cycle.optim_steps.append(head)
            else:
                cycle.others.append(head)

        tenants = sorted(runs_by_tenant)
        if tenants:
            start = self._rotation % len(tenants)
            tenants = tenants[start:] + tenants[:start]
            self._rotation += 1
        used = 0
        model_turn = defaultdict(int)
        open_tenants = list(tenants)
        while open_tenants:
            for tenant in list(open_tenants):
                runs = [r for r in runs_by_tenant[tenant] if r]
                if not runs:
                    open_tenants.remove(tenant)
                    continue
                run = runs[model_turn[tenant] % len(runs)]
                model_turn[tenant] += 1
                request = run[0]
                if used and used + request.num_tokens > self.token_budget:
                    open_tenants.remove(tenant)  # its next request waits for the next cycle
                    continue
                cycle.forward_backward.append(run.pop(0))
                used += request.num_tokens
        return cycle
