"""The Redis database of each test module that uses Redis: one each (Redis has 16), so that modules
running at once (pytest-xdist workers each take whole modules: docs/architecture.md#tests) never
flush or read each other's keys."""

REDIS_DB = {
    "tests.workers.trainer.test_live_state_integrity": 5,
    "tests.distributed.test_separate_processes": 6,
    "tests.distributed.test_celery_workers": 7,
    "tests.distributed.test_registrations": 8,
    "tests.distributed.test_stream_channels": 9,
    "tests.distributed.test_split_requests": 10,
    "tests.distributed.test_resent_cycles": 11,
    "tests.distributed.test_streaming": 12,
    "tests.distributed.test_replay_bits": 13,
    "tests.dashboard.test_dashboard_distributed": 14,
    "tests.distributed.test_several_base_models": 15,
}
assert len(set(REDIS_DB.values())) == len(REDIS_DB) and all(0 <= db < 16 for db in REDIS_DB.values())


def redis_url(module: str) -> str:
    """The loopback Redis URL of the test module named `module` (its `__name__`)."""
    return f"redis://127.0.0.1:6379/{REDIS_DB[module]}"
