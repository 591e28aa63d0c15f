"""Starting Loraplex's processes for the distributed tests: Celery trainer and sampler workers, the
API and the scheduler, each with the command an operator (or docker-compose.yml) uses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import redis

from contract.redis_keys import sampler_key, worker_key
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def service_env(redis_url: str, data_dir: Path, **more: str) -> dict[str, str]:
    return os.environ | {"LORAPLEX_BASE_MODEL": "tiny", "LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_REDIS_URL": redis_url,
                         "LORAPLEX_MAX_LORA_RANK": "16"} | more


def _wait_registered(process: subprocess.Popen, redis_url: str, key: str, seconds: float = 180) -> None:
    """Wait until the worker registered itself; one that does not is killed, so that it cannot take
    later tests' tasks from its queue."""
    client = redis.Redis.from_url(redis_url)

    def registered() -> bool:
        assert process.poll() is None, f"the process registering {key} exited"
        return client.get(key) is not None

    try:
        wait_until(registered, f"something to register {key}", timeout=seconds, interval=0.1)
    except BaseException:
        process.kill()
        process.wait()
        raise


def celery_worker(module: str, name: str, queue: str, env: dict[str, str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "celery", "-A", module, "worker", "--pool", "solo", "-Q", queue,
               "-n", f"{name}@localhost", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"]
    return subprocess.Popen(command, cwd=ROOT, env=env | {"LORAPLEX_WORKER_ID": name})


def start_worker(name: str, data_dir: Path, redis_url: str, **more: str) -> subprocess.Popen:
    """A trainer worker, once it is registered (`more`: further environment variables)."""
    process = celery_worker("service.celery_worker", name, f"trainer.{name}", service_env(redis_url, data_dir, **more))
    _wait_registered(process, redis_url, worker_key(name))
    return process


def start_sampler(name: str, data_dir: Path, redis_url: str, **more: str) -> subprocess.Popen:
    """A sampler worker, once it is registered (its vLLM engine may still be loading: jobs wait)."""
    env = service_env(redis_url, data_dir, LORAPLEX_SAMPLER_KV_CACHE_GIB="0.25", **more)
    process = celery_worker("service.sampler_worker", name, f"sampler.{name}", env)
    _wait_registered(process, redis_url, sampler_key(name))
    return process


def start_service(command: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    """`python -m service <command>` (api or scheduler)."""
    return subprocess.Popen([sys.executable, "-m", "service", command, *args], cwd=ROOT, env=env)


def stop_all(processes) -> None:
    """SIGTERM every process (a warm shutdown), then wait for each, killing one that outlasts 20 s."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_healthy(process: subprocess.Popen, base_url: str, seconds: float = 120) -> None:
    def healthy() -> bool:
        assert process.poll() is None, "the API exited"
        try:
            return httpx.get(f"{base_url}/api/v1/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, "the API to answer", timeout=seconds, interval=0.2)


def create_tenant_key(database_url: str, name: str) -> str:
    """A tenant in the deployment's database (as `loraplex-admin tenants create` does); its API key."""
    from db.session import make_engine, make_session_factory
    from db.tenants import create_tenant

    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as s:
            return create_tenant(s, name)[1]
    finally:
        engine.dispose()


def wait_for(post, request_id: str, seconds: float = 120) -> bytes:
    """Long-poll a request until it finished; its result body (failing on an error)."""

    def result() -> list[bytes]:  # in a list: an empty body is a result too
        response = post("retrieve_future", json={"request_id": request_id})
        assert response.status_code == 200, response.text
        if response.headers["content-type"].startswith("application/json"):
            body = response.json()
            assert "error" not in body, body
            if body.get("type") == "try_again":
                return []
        return [response.content]

    return wait_until(result, f"{request_id} to finish", timeout=seconds, interval=0)[0]
