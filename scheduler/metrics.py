"""Prometheus metrics of the scheduler's cycles, served at GET /metrics (the sampler engine's are
in workers/sampler/engine.py).

Each process exposes its own registry: the embedded server everything; in distributed mode the
scheduler and the sampler workers theirs on `LORAPLEX_METRICS_PORT`. No tenant or model ids in
labels: the set of series stays small and reveals nobody's activity.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

CYCLE_SECONDS = Histogram("loraplex_cycle_seconds", "Executor time of one scheduler cycle", buckets=SECONDS)
CYCLE_TOKENS = Histogram("loraplex_cycle_tokens", "Tokens in the batched forward/backward of one cycle",
                         buckets=(32, 128, 512, 1024, 2048, 4096, 8192, 16384, 65536))
CYCLE_TENANTS = Histogram("loraplex_cycle_tenants", "Tenants sharing the batched forward/backward of one cycle",
                          buckets=COUNTS)
REQUESTS_FINISHED = Counter("loraplex_requests_finished", "Training requests finished by the scheduler",
                            ["kind", "outcome"])
RECOVERING_MODELS = Gauge("loraplex_recovering_models",
                          "Models replaying the work their engine lost in a restart; their new requests wait")
