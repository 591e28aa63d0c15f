"""The embedded server as a process of its own (`python -m service serve`, the README's command):
what a memory bound or a SIGKILL needs, since a server on a thread shares the test's memory."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.distributed.processes import create_tenant_key, start_service, wait_healthy


def start_serve(data_dir: Path, port: int, **env: str) -> subprocess.Popen:
    """`python -m service serve` on the tiny model without a sampler, once it answers."""
    environment = os.environ | {"LORAPLEX_BASE_MODEL": "tiny", "LORAPLEX_SAMPLER_ENABLED": "false",
                                "LORAPLEX_LONG_POLL_SECONDS": "5", "LORAPLEX_MAX_LORA_RANK": "16"} | env
    process = start_service("serve", environment, "--port", str(port), "--data-dir", str(data_dir))
    wait_healthy(process, f"http://127.0.0.1:{port}")
    return process


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tenant_key(data_dir: Path, name: str) -> str:
    """A new tenant in the server's SQLite database (as `loraplex-admin tenants create` does); its key."""
    return create_tenant_key(f"sqlite:///{(data_dir / 'loraplex.db').resolve()}", name)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for {pid}")


class RssSampler:
    """Samples a process's RSS every `interval` seconds on a thread, from start to stop: its peak."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), rss_bytes(self.pid)))
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(rss for _, rss in self.samples)
