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
from dataclasses import dataclass, replace
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
        cycle = Cycle()
        # tenant -> its queues: per-model request runs (each admitted as a prefix, in order) and,
        # as one-item queues, its requests being run in parts
        queues: dict[str, list[list]] = defaultdict(list)
        for run in runnable.values():
            head = run[0]
            if head.kind in BATCHABLE_KINDS:
                queues[head.tenant_id].append(list(run))
            elif head.kind == RequestKind.OPTIM_STEP:
                cycle.optim_steps.append(head)
            else:
                cycle.others.append(head)
        in_flight: dict[str, int] = defaultdict(int)
        for split in self.splits.values():
            queues[split.request.tenant_id].append([split])
            in_flight[split.request.tenant_id] += split.remaining

        tenants = sorted(queues)
        if tenants:
            start = self._rotation % len(tenants)
            tenants = tenants[start:] + tenants[:start]
            self._rotation += 1
        # a part's share of the cycle: all of it for a tenant alone, else half, so that the other
        # tenants' turns find room in every cycle
        share = self.token_budget if len(tenants) < 2 else max(1, self.token_budget // 2)
        used = 0
        model_turn: dict[str, int] = defaultdict(int)
        open_tenants = list(tenants)
        while open_tenants:
            for tenant in list(open_tenants):
                waiting = [q for q in queues[tenant] if q]
                if not waiting:
                    open_tenants.remove(tenant)
                    continue
                queue = waiting[model_turn[tenant] % len(waiting)]
                model_turn[tenant] += 1
                item = queue[0]
                if isinstance(item, Split):
                    tokens = min(item.remaining, share)
                    if used and used + tokens > self.token_budget:
                        open_tenants.remove(tenant)  # its next part waits for the next cycle
                        continue
                    self._add_part(cycle, item, tokens)
                    queue.clear()
                    used += tokens
                    continue
                request: QueuedRequest = item
                limit = self.tenant_max_tokens_in_flight
                if limit and in_flight[tenant] and in_flight[tenant] + request.num_tokens > limit:
                    queue.clear()  # this model waits until the tenant has less in flight
                    continue
                if self.split_requests and request.num_tokens > share:
                    if request is not runnable[request.model_id][0]:
                        queue.clear()  # behind requests of its model that run now: it starts next cycle
                        continue
                    tokens = share
                    if used and used + tokens > self.token_budget:
                        open_tenants.remove(tenant)
                        continue
                    split = self.splits[request.id] = Split(request)
                    self._add_part(cycle, split, tokens)
                    queue.clear()  # the model's later requests wait for its last part
                    used += tokens
                    in_flight[tenant] += request.num_tokens
                    continue
                if used and used + request.num_tokens > self.token_budget:
                    open_tenants.remove(tenant)  # its next request waits for the next cycle
                    continue
                cycle.forward_backward.append(queue.pop(0))
                used += request.num_tokens
                in_flight[tenant] += request.num_tokens
        return cycle

    @staticmethod
    def _add_part(cycle: Cycle, split: Split, tokens: int) -> None:
        cycle.forward_backward.append(replace(split.request, num_tokens=tokens))
        cycle.parts[split.request.id] = Part(split.datums_done, tokens)
        if split.begun:
            cycle.continuing.add(split.request.id)
        split.begun = True
