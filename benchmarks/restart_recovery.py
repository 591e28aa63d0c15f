"""A restart with a backlog to replay: how soon the server answers, how soon another tenant is served,
and how soon the model with the backlog runs again; this tree beside another revision, in one run.

    .venv/bin/python -m benchmarks.restart_recovery [--backlog 3] [--datums 32] [--tokens 2048] \
        [--interval 5] [--before REV]   # from the repository root

Tenant A's model runs `backlog` forward_backwards of `datums` x `tokens` tokens (model tiny) with no
optim_step after them; then `python -m service serve` (SQLite, no sampler) is SIGKILLed and started
again on the same data dir (LORAPLEX_STATE_WRITE_INTERVAL_SECONDS=`interval`; 3600 writes nothing
after create_model, the worst case). From the restart: the first /healthz answer, tenant B's
6-token forward_backward sent as soon as the server answers, and A's optim_step sent with it, which
needs A's replayed gradients. A bare HTTP client (httpx), as the SDKs speak.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import typer

from loraplex.wire.client import encode_forward_backward_request
from service.embedded import free_port
from tests.distributed.processes import start_service, wait_healthy
from tests.reliability.client import PROTOBUF, TOKENS, Api
from tests.reliability.processes import stop, tenant_key

RESULTS = Path(__file__).parent / "results" / "restart_recovery.md"


def large_body(model_id: str, seq_id: int, datums: int, tokens: int) -> bytes:
    rows = np.random.default_rng(seq_id).integers(0, 512, (datums, tokens + 1))
    data = [(r[:-1], {"target_tokens": r[1:], "weights": np.ones(tokens, np.float32)}) for r in rows]
    return encode_forward_backward_request(model_id, seq_id, data, "cross_entropy")


def serve(data_dir: Path, port: int, interval: float):
    """`python -m service serve` (tiny, no sampler) on `data_dir`, not waited for."""
    env = os.environ | {"LORAPLEX_BASE_MODEL": "tiny", "LORAPLEX_SAMPLER_ENABLED": "false", "LORAPLEX_MAX_LORA_RANK": "16",
                        "LORAPLEX_STATE_WRITE_INTERVAL_SECONDS": str(interval)}
    return start_service("serve", env, "--port", str(port), "--data-dir", str(data_dir))


def measure(backlog: int, datums: int, tokens: int, interval: float) -> dict:
    """One restart of this process's tree; seconds of each measure."""
    data_dir = Path(tempfile.mkdtemp(prefix="loraplex-restart-"))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = serve(data_dir, port, interval)
    wait_healthy(server, base_url)
    a, b = (Api(base_url, tenant_key(data_dir, name), timeout=600) for name in ("a", "b"))
    model_a, model_b = (api.create_model(api.new_session()) for api in (a, b))
    started = time.monotonic()
    for seq_id in range(1, backlog + 1):
        a.result(a.accept("forward_backward", content=large_body(model_a, seq_id, datums, tokens), headers=PROTOBUF),
                 seconds=600)
    built = time.monotonic() - started
    if interval < 60:  # killed once an interval has passed (a timer writes what is due), else at once
        time.sleep(interval + 1)
    server.send_signal(signal.SIGKILL)
    server.wait()

    restarted = time.monotonic()
    server = serve(data_dir, port, interval)
    try:
        wait_healthy(server, base_url, seconds=900)
        served = time.monotonic() - restarted
        other = b.forward_backward(model_b, 1, TOKENS)
        step = a.optim_step(model_a, backlog + 1)
        b.result(other, seconds=900)
        other_done = time.monotonic() - restarted
        a.result(step, seconds=900)
        recovered = time.monotonic() - restarted
    finally:
        stop(server)
    return {"backlog_s": built, "serve_s": served, "other_s": other_done, "recovered_s": recovered}


def main(backlog: int = 3, datums: int = 32, tokens: int = 2048, interval: float = 5.0, before: str = "",
         measure_only: bool = False, write: bool = True) -> None:
    if measure_only:  # the child's part: this tree's code, one restart, its JSON last
        print(json.dumps(measure(backlog, datums, tokens, interval)))
        return
    from benchmarks.before_tree import run_in_tree, short_rev, worktree

    args = ["--measure-only", "--backlog", str(backlog), "--datums", str(datums), "--tokens", str(tokens),
            "--interval", str(interval)]
    root = Path(__file__).resolve().parent.parent
    results = {"this tree": run_in_tree(root, Path(__file__), *args)}
    if before:
        with worktree(before) as tree:
            results[short_rev(before)] = run_in_tree(tree, Path(__file__), *args)
    names = list(results)
    lines = ["| from the restart (s) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, key in (("the backlog took, before the kill", "backlog_s"), ("**the API answers**", "serve_s"),
                       ("**another tenant's request answered**", "other_s"),
                       ("the model with the backlog steps again", "recovered_s")):
        lines.append(f"| {label} | " + " | ".join(f"{results[n][key]:.1f}" for n in names) + " |")
    print("\n".join(lines))
    if write:
        command = " ".join(["--backlog", str(backlog), "--datums", str(datums), "--tokens", str(tokens),
                            "--interval", f"{interval:g}"] + (["--before", before] if before else []))
        RESULTS.write_text(f"Command: `.venv/bin/python -m benchmarks.restart_recovery {command}` (model tiny, "
                           "SQLite, `python -m service serve` without a sampler, SIGKILLed and started again)\n\n"
                           + "\n".join(lines) + "\n")


if __name__ == "__main__":
    typer.run(main)
