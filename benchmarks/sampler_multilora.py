"""Multi-LoRA sampling: Loraplex's vLLM sampler against the alternatives, side by side.

    .venv/bin/python benchmarks/sampler_multilora.py [--model SmolLM2-135M-Instruct] [--dtype bfloat16]
        [--device cpu|cuda] [--results PATH]

Every run generates `max_tokens` tokens per sequence (EOS ignored) from random-token prompts.
  mixed       8 adapters x 4 prompts in one engine, Loraplex's LoRA ops (segmented; dense at decode in bf16 on AMX / AVX512-BF16);
              the process's one OpenMP team, as in the embedded server (workers/compute_thread.py)
  beside      the same beside another thread's OpenMP team, as in an embedded server whose trainer
              has a thread of its own (LORAPLEX_COMPUTE_THREAD=false), with libgomp's defaults
  beside_spin the same with the embedded server's spin settings (service/openmp.py)
  stock       the same with vLLM's own CPU LoRA ops (gather a weight matrix per token)
  base        32 prompts, no adapter
  hf_peft     HF generate + peft, one adapter after another (4 prompts each)
  grpo_cache  GRPO group: 4 prompts (384 tokens) x n=8 on one adapter, prefix caching on
  grpo_none   the same with prefix caching off
and the first-request latency (1 new token) of a freshly saved adapter version vs a loaded one.
Each vLLM run has a process of its own (vLLM allows one engine per process); the ratios are
taken within this one run. Results go to benchmarks/results/sampler_multilora.md. On a GPU (vLLM's
CUDA build, whose own LoRA kernels run there) the CPU-only runs (beside, beside_spin, stock) are left out.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest.mock import patch

import torch
import typer

from service.openmp import SPIN_SETTINGS

RESULTS = Path(__file__).parent / "results" / "sampler_multilora.md"
ADAPTERS, PROMPTS_PER_ADAPTER, PROMPT_LEN, RANK = 8, 4, 32, 16


def make_snapshots(model_path: Path, folder: Path, count: int) -> list[str]:
    """Tenant adapters as the trainer saves them, with non-zero B (a fresh adapter's B is zero)."""
    from contract.configs import LoraConfig
    from workers.trainer.engine import TrainerEngine

    trainer = TrainerEngine(model_path, max_rank=RANK)
    paths = []
    for i in range(count):
        adapter = trainer.create_adapter(f"t{i}", LoraConfig(rank=RANK, seed=i))
        with torch.no_grad():
            for w in adapter.weights.values():
                w.lora_b.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(i))
        paths.append(str(trainer.save_sampler_weights(f"t{i}", folder / f"t{i}")))
    return paths


def prompts(count: int, length: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(100, 40000, (length,), generator=g).tolist()) for _ in range(count)]


def run_jobs(engine, jobs) -> tuple[float, int]:
    """Submit all jobs at once; (seconds until the last finished, tokens generated)."""
    results, done = {}, threading.Event()

    def on_done(request_id, outcome):
        results[request_id] = outcome
        if len(results) == len(jobs):
            done.set()

    start = time.perf_counter()
    for job in jobs:
        engine.submit(job, on_done)
    done.wait()
    seconds = time.perf_counter() - start
    failed = [r for r in results.values() if not hasattr(r, "sequences")]
    if failed:
        raise RuntimeError(f"sampling failed: {failed[0]}")
    return seconds, sum(len(s.tokens) for r in results.values() for s in r.sequences)


def vllm_run(scenario: str, model_path: str, dtype: str, snapshots: list[str], max_tokens: int,
             fresh_snapshots: list[str]) -> dict:
    """One scenario in this (child) process: start an engine, warm it up, time the jobs."""
    from contract.sampling import SampleJob, SamplingOptions
    from workers.sampler.engine import SamplerConfig, SamplerEngine

    if scenario.startswith("beside"):  # a parallel op on this thread gives it an OpenMP team, like the trainer's
        torch.ones(512, 512) @ torch.ones(512, 512)
    engine = SamplerEngine(SamplerConfig(Path(model_path), max_model_len=2048, max_lora_rank=RANK,
                                         max_loras=ADAPTERS, dtype=dtype, kv_cache_gib=2.0,
                                         prefix_caching=scenario != "grpo_none",
                                         lora_ops="vllm" if scenario == "stock" else "segmented")).start()
    engine.wait_ready(600)
    options = SamplingOptions(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    warm = [SampleJob(f"warm-{i}", p, 1, SamplingOptions(max_tokens=4, ignore_eos=True), a)
            for i, (p, a) in enumerate(zip(prompts(ADAPTERS, PROMPT_LEN, 99), snapshots or [None] * ADAPTERS))]
    run_jobs(engine, warm)
    out: dict = {}
    if scenario in ("mixed", "stock", "base", "beside", "beside_spin"):
        jobs = [SampleJob(f"{scenario}-{i}", p, 1, options, None if scenario == "base" else snapshots[i % ADAPTERS])
                for i, p in enumerate(prompts(ADAPTERS * PROMPTS_PER_ADAPTER, PROMPT_LEN, 0))]
        out["seconds"], out["tokens"] = run_jobs(engine, jobs)
    else:  # a GRPO step: a group of n samples per prompt, long prompts
        jobs = [SampleJob(f"grpo-{i}", p, 8, options, snapshots[0]) for i, p in enumerate(prompts(4, 384, 1))]
        out["seconds"], out["tokens"] = run_jobs(engine, jobs)
    if scenario == "mixed":  # first use of a new adapter version (loaded from disk) vs a loaded one
        one = SamplingOptions(max_tokens=1, ignore_eos=True)
        probe = prompts(1, PROMPT_LEN, 5)[0]
        fresh, loaded = [], []
        for i, path in enumerate(fresh_snapshots):
            fresh.append(run_jobs(engine, [SampleJob(f"fresh-{i}", probe, 1, one, path)])[0])
            loaded.append(run_jobs(engine, [SampleJob(f"loaded-{i}", probe, 1, one, path)])[0])
        out["fresh_ms"], out["loaded_ms"] = 1000 * sorted(fresh)[len(fresh) // 2], 1000 * sorted(loaded)[len(loaded) // 2]
    engine.close()
    return out


def hf_peft_serial(model_path: Path, dtype: str, snapshots: list[str], max_tokens: int, device: str) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    model = PeftModel.from_pretrained(base, snapshots[0], adapter_name="t0").eval()
    for i, path in enumerate(snapshots[1:], start=1):
        model.load_adapter(path, adapter_name=f"t{i}")
    batches = prompts(ADAPTERS * PROMPTS_PER_ADAPTER, PROMPT_LEN, 0)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, top_k=0, pad_token_id=0)
    model.generate(torch.tensor(batches[:1], device=device), **(kw | {"max_new_tokens": 4, "min_new_tokens": 4}))  # warm-up
    start, tokens = time.perf_counter(), 0
    with torch.no_grad():
        for i in range(ADAPTERS):
            model.set_adapter(f"t{i}")
            ids = torch.tensor(batches[i * PROMPTS_PER_ADAPTER: (i + 1) * PROMPTS_PER_ADAPTER], device=device)
            tokens += (model.generate(ids, **kw).shape[1] - PROMPT_LEN) * len(ids)  # (.shape waits for the GPU)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def main(model: str = "SmolLM2-135M-Instruct", dtype: str = "bfloat16", max_tokens: int = 64, device: str = "cpu",
         results_path: Path = typer.Option(RESULTS, "--results")) -> None:
    from models.registry import model_info

    info = model_info(model)
    folder = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    snapshots = make_snapshots(info.path, folder, ADAPTERS)
    fresh = make_snapshots(info.path, folder / "fresh", 5)
    results = {}
    spawn = multiprocessing.get_context("spawn")
    on_cpu = device == "cpu"
    scenarios = ("base", "mixed") + (("beside", "beside_spin", "stock") if on_cpu else ()) + ("grpo_cache", "grpo_none")
    for scenario in scenarios:
        # a spawned child takes this environment: libgomp reads it when the child loads torch
        child_env = SPIN_SETTINGS if scenario == "beside_spin" else {}
        with patch.dict(os.environ, child_env), ProcessPoolExecutor(1, mp_context=spawn) as pool:
            results[scenario] = pool.submit(vllm_run, scenario, str(info.path), dtype, snapshots, max_tokens,
                                             fresh).result()
        print(scenario, results[scenario], flush=True)
    results["hf_peft"] = hf_peft_serial(info.path, dtype, snapshots, max_tokens, device)
    print("hf_peft", results["hf_peft"], flush=True)

    tps = {k: v["tokens"] / v["seconds"] for k, v in results.items()}
    rows = [
        ("vLLM base, 32 prompts (tok/s)", f"{tps['base']:.0f}"),
        ("vLLM 8 adapters x 4 prompts mixed, Loraplex's LoRA ops (tok/s)" if on_cpu
         else "vLLM 8 adapters x 4 prompts mixed, vLLM's GPU LoRA kernels (tok/s)", f"{tps['mixed']:.0f}"),
    ]
    if on_cpu:
        rows.append(("vLLM 8 adapters x 4 prompts mixed, vLLM's own CPU LoRA ops (tok/s)", f"{tps['stock']:.0f}"))
    rows += [
        ("HF generate + peft, adapter after adapter (tok/s)", f"{tps['hf_peft']:.1f}"),
        ("**mixed LoRA / base** (target >= 0.7)", f"**{tps['mixed'] / tps['base']:.2f}x**"),
        ("**mixed LoRA / HF+peft serial** (target >= 8)", f"**{tps['mixed'] / tps['hf_peft']:.1f}x**"),
        ("vLLM base / HF+peft serial (what mixed / HF+peft would be if LoRA cost nothing)",
         f"{tps['base'] / tps['hf_peft']:.1f}x"),
    ]
    if on_cpu:
        rows += [
            ("Loraplex's ops / vLLM's own ops", f"{tps['mixed'] / tps['stock']:.2f}x"),
            ("mixed beside another OpenMP team (LORAPLEX_COMPUTE_THREAD=false), libgomp defaults / spin settings "
             "(tok/s)", f"{tps['beside']:.0f} / {tps['beside_spin']:.0f}"),
        ]
    rows += [
        ("GRPO group 4 x n=8, prompt 384: prefix caching on / off (time)",
         f"{results['grpo_none']['seconds'] / results['grpo_cache']['seconds']:.2f}x faster"),
        ("first request of a freshly saved adapter version / of a loaded one (1 token)",
         f"{results['mixed']['fresh_ms']:.0f} / {results['mixed']['loaded_ms']:.0f} ms"),
    ]
    import vllm

    where = (f"{torch.get_num_threads()} CPU threads" if on_cpu else torch.cuda.get_device_name())
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    text = (f"Command: `.venv/bin/python benchmarks/sampler_multilora.py --model {model} --dtype {dtype} "
            f"--max-tokens {max_tokens} --device {device}` (vLLM {vllm.__version__}, {where}, LoRA rank {RANK} on "
            f"every linear layer and lm_head, EOS ignored)\n\n| measure | value |\n|---|---|\n{table}\n")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(text)
    print(text)


if __name__ == "__main__":
    typer.run(main)
