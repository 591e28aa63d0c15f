"""Forming one scheduler cycle from the runnable requests of many tenants.

Policy (fair under a token budget): forward/forward_backward requests of all tenants go into one
batched engine call of at most `token_budget` tokens. Tenants are visited round-robin, one request
per tenant per pass, starting one tenant later every cycle, so a tenant with a huge backlog gets
one turn per pass like everyone else and cannot starve a tenant with a small batch; within a
tenant, its models are served round-robin too. Why this policy: training requests are not
preemptible and are roughly proportional in cost to their tokens, so equal turns per pass under a
token cap bound every tenant's wait by one cycle per request ahead of it, whatever others send.
optim_steps of all models are batched into one call per cycle; other operations (create, save,
load) run one by one after the batched work.

Large requests run in parts (`split_requests`). A request is not preemptible, so one of 128 x
2,048 tokens used to hold every tenant for its whole run (31.8 s, measured); now a
forward/forward_backward larger than a tenant's share of a cycle runs as parts, one per cycle
(one turn of its tenant), cut at datum boundaries, each at most that share: the whole budget when
its tenant is the only one with work, half of it otherwise, so the other half stays for the other
tenants' turns. Its model runs nothing else until the last part (the reorder buffer keeps it
running), so seq_id order holds, and gradients accumulate across the parts as across calls. The
scheduler runs a cycle's parts in an engine call after its other requests, which are answered
first (scheduler/service.py), so a small request waits about one part, the one running when it
arrived, not the largest request queued. A request cut into parts has the bits it has whole and
alone (workers/trainer/parts.py). The executor cuts after whole engine passes, so a part is at
least one pass (a datum longer than its share still runs, whole); with `split_requests` off a
request larger than the budget runs alone, so nothing waits forever.

Admission (`tenant_max_tokens_in_flight`, 0: none): a tenant's tokens in flight are those of its
requests started and not yet run, that is the remaining parts of its split requests plus what
this cycle gives it. A new request of a tenant starts only while that stays within the limit, or
when the tenant has nothing in flight (so a request larger than the limit still runs, alone for its
tenant). Requests over it wait in the queue; none is refused: a 429 would make the Tinker SDK,
which sends the chunks of a large batch concurrently, retry one chunk while later seq_ids wait
behind it, and a retry later than the seq_id gap timeout would fail the batch. So the limit bounds
what one tenant holds in the engine at once (its half-run requests' inputs and results, and their
gradients), not what it may queue; quotas at the API (api/quotas.py) do that.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime

from contract.kinds import BATCHABLE_KINDS, RequestKind
from contract.queue import Cycle, Part, PartProgress, QueuedRequest


@dataclass
class Split:
    """A request the scheduler runs in parts, and how far it has got."""

    request: QueuedRequest
    datums_done: int = 0
    tokens_done: int = 0
    begun: bool = False  # its first part was planned: its model is started in the reorder buffer
    started_at: datetime | None = None  # when its first part ran (the request's started_at)

    @property
    def remaining(self) -> int:
        return max(1, self.request.num_tokens - self.tokens_done)


@dataclass
class _Filling:
    """One cycle as the planner fills it."""

    cycle: Cycle
    runnable: dict[str, list[QueuedRequest]]
    share: int  # the most tokens one part may take
    used: int = 0  # tokens planned so far
    in_flight: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # tenant -> tokens started, not run


class CyclePlanner:
    def __init__(self, token_budget: int, split_requests: bool = True, tenant_max_tokens_in_flight: int = 0) -> None:
        self.token_budget = token_budget
        self.split_requests = split_requests
        self.tenant_max_tokens_in_flight = tenant_max_tokens_in_flight
        self.splits: dict[str, Split] = {}  # request id -> a request being run in parts
        self._rotation = 0

    # --- requests run in parts: what the scheduler reports back ----------------------------------

    def advanced(self, request_id: str, progress: PartProgress) -> None:
        """A part ran (or was found run already): the next one starts where it stopped."""
        split = self.splits[request_id]
        split.datums_done, split.tokens_done = progress.datums, progress.tokens

    def restart(self, request_id: str) -> None:
        """The engine that ran its parts lost them (it died): run it from its first datum again."""
        split = self.splits[request_id]
        split.datums_done = split.tokens_done = 0

    def finished(self, request_id: str) -> None:
        self.splits.pop(request_id, None)

    # --- planning --------------------------------------------------------------------------------

    def plan(self, runnable: dict[str, list[QueuedRequest]]) -> Cycle:
        """One cycle from each model's runnable requests (in seq_id order): the policy above."""
        cycle = Cycle()
        queues = self._queues(runnable, cycle)
        tenants = self._rotated(sorted(queues))
        # a part's share of the cycle: all of it for a tenant alone, else half, so that the other
        # tenants' turns find room in every cycle
        share = self.token_budget if len(tenants) < 2 else max(1, self.token_budget // 2)
        filling = _Filling(cycle, runnable, share)
        for split in self.splits.values():
            filling.in_flight[split.request.tenant_id] += split.remaining
        model_turn: dict[str, int] = defaultdict(int)
        open_tenants = list(tenants)
        while open_tenants:  # passes: one turn per open tenant each
            for tenant in list(open_tenants):
                waiting = [q for q in queues[tenant] if q]
                if not waiting:
                    open_tenants.remove(tenant)
                    continue
                queue = waiting[model_turn[tenant] % len(waiting)]
                model_turn[tenant] += 1
                if not self._take_turn(queue, filling):
                    open_tenants.remove(tenant)  # its next request or part waits for the next cycle
        return cycle

    def _queues(self, runnable: dict[str, list[QueuedRequest]], cycle: Cycle) -> dict[str, list[list]]:
        """tenant -> its queues: per-model runs of batchable requests (each admitted as a prefix, in
        order) and, as one-item queues, its requests being run in parts. optim_steps and other
        operations go straight into the cycle."""
        queues: dict[str, list[list]] = defaultdict(list)
        for run in runnable.values():
            head = run[0]
            if head.kind in BATCHABLE_KINDS:
                queues[head.tenant_id].append(list(run))
            elif head.kind == RequestKind.OPTIM_STEP:
                cycle.optim_steps.append(head)
            else:
                cycle.others.append(head)
        for split in self.splits.values():
            queues[split.request.tenant_id].append([split])
        return queues

    def _rotated(self, tenants: list[str]) -> list[str]:
        """The tenants, starting one later every cycle."""
        if not tenants:
            return tenants
        start = self._rotation % len(tenants)
        self._rotation += 1
        return tenants[start:] + tenants[:start]

    def _take_turn(self, queue: list, filling: _Filling) -> bool:
        """Plan the head of one of a tenant's queues; False when it does not fit in this cycle."""
        item = queue[0]
        if isinstance(item, Split):
            tokens, whole = min(item.remaining, filling.share), False
        else:
            tenant, limit = item.tenant_id, self.tenant_max_tokens_in_flight
            if limit and filling.in_flight[tenant] and filling.in_flight[tenant] + item.num_tokens > limit:
                queue.clear()  # this model waits until the tenant has less in flight
                return True
            whole = not (self.split_requests and item.num_tokens > filling.share)
            if not whole and item is not filling.runnable[item.model_id][0]:
                queue.clear()  # behind requests of its model that run now: it starts next cycle
                return True
            tokens = item.num_tokens if whole else filling.share
        if filling.used and filling.used + tokens > self.token_budget:
            return False
        filling.used += tokens
        if isinstance(item, Split):
            self._add_part(filling.cycle, item, tokens)
            queue.clear()
            return True
        filling.in_flight[item.tenant_id] += item.num_tokens
        if whole:
            filling.cycle.forward_backward.append(queue.pop(0))
        else:
            split = self.splits[item.id] = Split(item)
            self._add_part(filling.cycle, split, tokens)
            queue.clear()  # the model's later requests wait for its last part
        return True

    @staticmethod
    def upcoming(runnable: dict[str, list[QueuedRequest]], cycle: Cycle) -> list[str]:
        """The models with runnable requests that `cycle` left for the next ones (over its token budget, or
        its tenant over its limit): the executor can page them in meanwhile (executor.prefetch)."""
        planned = {q.model_id for q in cycle.all()}
        return [model_id for model_id in runnable if model_id not in planned]

    @staticmethod
    def _add_part(cycle: Cycle, split: Split, tokens: int) -> None:
        cycle.forward_backward.append(replace(split.request, num_tokens=tokens))
        cycle.parts[split.request.id] = Part(split.datums_done, tokens)
        if split.begun:
            cycle.continuing.add(split.request.id)
        split.begun = True
