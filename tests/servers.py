"""A real embedded server for a test module: the tiny model, a small vLLM sampler, short long-polls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.embedded import ServerThread, free_port
from service.settings import Settings


@contextmanager
def running_server(data_dir: Path, **overrides) -> Iterator[ServerThread]:
    settings = dict(data_dir=data_dir, port=free_port(), base_model="tiny", long_poll_seconds=5, max_lora_rank=16,
                    sampler_kv_cache_gib=0.25)
    server = ServerThread(Settings(**(settings | overrides)))
    try:
        for stack in server.embedded.stacks:  # (one per base model served)
            if stack.sampling is not None:
                # a sampler that failed to start answers 503, which the SDK retries: fail here, with the cause
                stack.sampling.engine.wait_ready(300)
        yield server
    finally:
        server.stop()


def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of the server's Prometheus metrics (GET /metrics), 0 if it has none yet."""
    text = httpx.get(f"{base_url}/metrics").text
    return next((s.value for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), 0.0)
