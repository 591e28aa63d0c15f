"""What prefetch saves a cycle, without HTTP: one in-process SmolLM2 trainer, runs paged out under a budget.

    .venv/bin/python -m benchmarks.prefetch_cycle [trials]   # from the repository root (default 6 trials)

16 rank-8 runs are created and stepped once each under a budget of 4.5 stepped runs, so the earliest are
paged out. Each trial then steps (a forward_backward cycle of 2 x 32 tokens per run, then an optim_step
cycle) three groups of 4 runs, taking turns: 4 paged-out runs read on the cycle's path, 4 paged-out runs
read ahead first (the hint, waited for, as when it arrives a cycle early), and those 4 again, resident.
Side by side on one engine, so other load on the machine falls on all three alike. Prints the medians.
"""
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
import numpy as np
from contract.queue import Cycle, Job, QueuedRequest
from loraplex.wire.client import encode_forward_backward_request
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor

def req(m, seq, kind, payload):
    q = QueuedRequest(f"{m}-{seq}", f"t-{m}", m, seq, kind, 64)
    return q, Job(q, payload)

def fb(m, seq):
    rng = np.random.default_rng(seq)
    rows = [rng.integers(0, 500, 33) for _ in range(2)]
    data = [(r[:-1], {"target_tokens": r[1:], "weights": np.ones(32, np.float32)}) for r in rows]
    return req(m, seq, "forward_backward", encode_forward_backward_request(m, seq, data, "cross_entropy", compress=False))

def run(ex, reqs, kind):
    cyc = Cycle(forward_backward=[q for q, _ in reqs] if kind == "fb" else [],
                optim_steps=[q for q, _ in reqs] if kind == "opt" else [],
                others=[q for q, _ in reqs] if kind == "create" else [])
    t = time.perf_counter()
    out = ex.run_cycle(cyc, {q.id: j for q, j in reqs})
    assert all(o.error is None for o in out.values()), out
    return time.perf_counter() - t

engine = TrainerEngine("/root/.cache/loraplex/models/SmolLM2-135M-Instruct", max_rank=16)
N, GROUP = 16, 4
ex = InProcessExecutor(engine, Path(tempfile.mkdtemp()) / "live", memory_budget=int(4.5 * 45.4e6), prefetch_bytes=int(8 * 46e6))
models = [f"m{i}" for i in range(N)]
seq = {m: 0 for m in models}
for m in models:
    run(ex, [req(m, 0, "create_model", json.dumps({"lora_config": {"rank": 8, "seed": 1}}).encode())], "create")
def step(ms, prefetch):
    if prefetch:
        ex.prefetch(ms)
        deadline = time.time() + 30
        while not all(ex.live.prefetcher.holds(m) for m in ms) and time.time() < deadline:
            time.sleep(0.01)
    for m in ms: seq[m] += 1
    t = run(ex, [fb(m, seq[m]) for m in ms], "fb")
    for m in ms: seq[m] += 1
    t += run(ex, [req(m, seq[m], "optim_step", json.dumps({"adam_params": {"learning_rate": 1e-4}}).encode()) for m in ms], "opt")
    return t
for i in range(0, N, GROUP):  # every run steps once: moments exist; the first ones are paged out by the end
    step(models[i:i + GROUP], False)
ex.live.writer.flush()
results = {"cold, read on the path": [], "cold, read ahead": [], "resident": []}
groups = [models[i:i + GROUP] for i in range(0, N, GROUP)]
for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    # groups 0 and 1 are paged out (least recently used): 0 is read on the path, 1 ahead, then 1 again resident
    order = [(groups[0], False, "cold, read on the path"), (groups[1], True, "cold, read ahead"), (groups[1], False, "resident")]
    for ms, pre, label in order:
        as_labelled = all(ex.residency.is_paged(m) for m in ms) if label != "resident" else \
            all(m in ex.engine.adapters for m in ms)
        t = step(ms, pre)
        ex.live.writer.flush()
        results[label].append(t if as_labelled else float("nan"))
    groups = groups[2:] + groups[:2]  # next trial: two other groups, paged out since
st = ex.residency_stats()
for k, v in results.items():
    print(f"{k}: median {1000 * statistics.median(v):.0f} ms per step of {GROUP} runs (fb + optim cycles); all {[round(1000 * x) for x in v]}")
print(f"page-ins {st.page_ins}, hits {st.prefetch_hits}, misses {st.prefetch_misses}, mean page-in on the path {1000 * st.page_in_seconds / max(1, st.page_ins):.1f} ms")
ex.close()
