"""What batching tenants buys: one training round of N tenants, five ways, timed side by side.

A round = every tenant does forward_backward (cross-entropy) on its sequences, then optim_step.
    (a) batched     one engine call for all N tenants' requests + one optim_step call
    (b) per-tenant  the engine called once per tenant (N forward_backward + N optim_step calls)
    (c) peft        one peft model holding N adapters, `set_adapter` + fwd/bwd + AdamW per tenant
    (d) one tenant  a single adapter holding all N tenants' sequences (same tokens as (a))
    (e) no LoRA     the same packed tokens, base model only, backward to the input embeddings
                    (the FLOP floor: LoRA adds ~1-2% FLOPs on top of this)
Ratios to read: a/d (cost of many tenants vs one), d/e (LoRA overhead), c/a (speed-up over peft
serial) against its ceiling c/e; capture = (c/a) / (c/e) = e/a. "a/d fb" is a/d of the
forward_backward alone, whose physical limit is 1.0 (same FLOPs); the optim_step's is not: N
adapters' AdamW states are N times the memory to update.

    .venv/bin/python benchmarks/trainer_multitenant.py [--models tiny,SmolLM2-135M-Instruct] [--tenants 1,2,4,8]
        [--workloads 2x128,1x32] [--modes abcde] [--reps 3] [--device cpu|cuda] [--results PATH] [--no-write]
        [--before REV --pairs 2]

`--models` takes any registered model; on a mixture of experts (`tiny-qwen3-moe`) every expert carries
LoRA too, and peft serial (c) uses peft's `target_parameters`, as the trainer's export does.

Modes are interleaved within each repetition and the median is reported, so machine noise hits
all modes alike; only the ratios are meaningful.

With `--before REV`, the same configurations run on REV's code (a temporary git worktree, see
benchmarks/before_tree.py) and on this tree, in alternating processes (`--pairs` per tree and
model, the order flipped every pair); the table gives each mode's median time on both and the
throughput ratio now/before (before ms / now ms), and a/d and d/e on both. It is written to
results/trainer_multitenant_before.md, beside the plain table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
import typer
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from workers.cpu_threads import intra_op_threads
from workers.trainer.batch import pack, prepare_request, split_into_passes
from workers.trainer.engine import TrainerEngine
from workers.trainer.lora_layers import RoutingPlan

try:
    from loraplex.types import AdamParams

    from contract.configs import LoraConfig
    from contract.inputs import EngineDatum, ForwardBackwardInput
except ModuleNotFoundError:  # the layout before the torch-free contract (c980d9e), for --before
    from workers.trainer.adapters import AdamParams, LoraConfig
    from workers.trainer.batch import Datum as EngineDatum
    from workers.trainer.batch import ForwardBackwardInput

RANK = 16
TARGETS = LoraConfig().target_modules()  # attention, MLP and unembedding: Tinker's defaults
ADAM = AdamParams(learning_rate=1e-4)
WORKLOADS = {"2x128": (2, 128), "1x32": (1, 32)}
RESULTS = Path(__file__).parent / "results" / "trainer_multitenant.md"
BEFORE_RESULTS = Path(__file__).parent / "results" / "trainer_multitenant_before.md"
MODES = "abcde"
# each ratio and the two modes it divides (capture = e/a)
RATIOS = {"a/d": "ad", "d/e": "de", "b/a": "ba", "c/a": "ca", "c/e": "ce", "capture": "ea"}


def tenant_data(n_tenants: int, seqs: int, length: int, vocab: int) -> list[list[EngineDatum]]:
    gen = torch.Generator().manual_seed(0)
    data = []
    for _ in range(n_tenants):
        tenant = []
        for _ in range(seqs):
            ids = torch.randint(0, vocab, (length + 1,), generator=gen)
            tenant.append(EngineDatum(ids[:-1], {"target_tokens": ids[1:], "weights": torch.ones(length)}))
        data.append(tenant)
    return data


def timed_optim_step(engine, steps) -> float:
    started = finished()
    engine.optim_step(steps)
    return finished() - started


def round_batched(engine, data):
    """Returns the seconds of its optim_step (as (d) does), so the forward_backward part shows alone."""
    engine.forward_backward([ForwardBackwardInput(f"t{i}", d) for i, d in enumerate(data)])
    return timed_optim_step(engine, [(f"t{i}", ADAM) for i in range(len(data))])


def round_per_tenant(engine, data):
    for i, d in enumerate(data):
        engine.forward_backward([ForwardBackwardInput(f"t{i}", d)])
        engine.optim_step([(f"t{i}", ADAM)])


def round_one_tenant(engine, data):
    engine.forward_backward([ForwardBackwardInput("all", [d for tenant in data for d in tenant])])
    return timed_optim_step(engine, [("all", ADAM)])


def round_lora_free(engine, data):
    """The engine's own passes (same pass size and threads) with an empty routing plan. The embeddings' output
    is made to require grad, so the backward runs through every layer as it must with LoRA, while
    no weight gradient is computed (not even the tied lm_head's)."""
    request = ForwardBackwardInput("all", [d for tenant in data for d in tenant])
    prepared = [prepare_request(0, request, engine.vocab_size, engine.max_seq_len)]
    hook = engine.model.get_input_embeddings().register_forward_hook(lambda m, i, out: out.requires_grad_())
    try:
        for pieces in split_into_passes(prepared, engine.max_pass_tokens, engine.min_shared_prefix):
            batch = pack(pieces, engine.min_shared_prefix)
            with intra_op_threads(engine.pass_threads(batch.input_ids.numel())):  # as the engine's passes
                engine.target_logprobs(batch, RoutingPlan([]))[:, 0].sum().backward()
    finally:
        hook.remove()


class PeftSerial:
    """The baseline a user would write with peft: one model, N named adapters, one at a time."""

    def __init__(self, model_path, n_tenants: int, device: str, experts: list[str] = ()):
        self.device = device
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        base.to(device)
        config = PeftLoraConfig(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS))
        if experts:  # a mixture of experts: the trainer's expert LoRA as its PEFT export writes it
            from storage.peft_export import expert_target_parameters, peft_target_modules

            config = PeftLoraConfig(r=RANK, lora_alpha=32, lora_dropout=0.0,
                                    target_modules=peft_target_modules(LoraConfig(), True),
                                    target_parameters=expert_target_parameters(experts))
        self.model = get_peft_model(base, config, adapter_name="t0")
        for i in range(1, n_tenants):
            self.model.add_adapter(f"t{i}", config)
        self.optimizers = {}
        for i in range(n_tenants):
            params = [p for n, p in self.model.named_parameters() if f".t{i}." in n]
            self.optimizers[f"t{i}"] = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(0.9, 0.95),
                                                         eps=ADAM.eps, fused=True)

    def round(self, data):
        for i, tenant in enumerate(data):
            self.model.set_adapter(f"t{i}")
            ids = torch.stack([torch.as_tensor(d.tokens) for d in tenant]).to(self.device)
            targets = torch.stack([d.loss_fn_inputs["target_tokens"] for d in tenant]).to(self.device)
            logits = self.model(input_ids=ids).logits.float()
            loss = -(torch.log_softmax(logits, -1).gather(-1, targets[..., None])).sum()
            loss.backward()
            self.optimizers[f"t{i}"].step()
            self.optimizers[f"t{i}"].zero_grad(set_to_none=True)


def finished() -> float:
    """The clock once the device's queued work is done (GPU kernels run asynchronously)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def measure(model: str, tenants: list[int], workloads: list[str], reps: int, device: str, modes: str = MODES,
            show: bool = True) -> list[dict]:
    engine = TrainerEngine(model, device=device)
    max_n = max(tenants)
    for i in range(max_n):
        engine.create_adapter(f"t{i}", LoraConfig(rank=RANK, alpha=32, seed=i))
    engine.create_adapter("all", LoraConfig(rank=RANK, alpha=32, seed=99))
    experts = [path for path, w in engine.adapter("all").weights.items() if w.lora_a.dim() == 3]  # a MoE's
    peft_serial = PeftSerial(engine.model_path, max_n, device, experts) if "c" in modes else None
    rows = []
    for workload in workloads:
        seqs, length = WORKLOADS[workload]
        for n in tenants:
            data = tenant_data(n, seqs, length, engine.vocab_size)
            rounds = {
                "a": lambda: round_batched(engine, data),
                "b": lambda: round_per_tenant(engine, data),
                "c": lambda: peft_serial.round(data),
                "d": lambda: round_one_tenant(engine, data),
                "e": lambda: round_lora_free(engine, data),
            }
            rounds = {k: v for k, v in rounds.items() if k in modes}
            times = {k: [] for k in rounds}
            optim_times = {k: [] for k in "ad" if k in rounds}
            for rep in range(reps + 1):  # the first repetition warms up and is discarded
                for key, run in rounds.items():
                    started = finished()
                    optim_seconds = run()
                    if rep:
                        times[key].append(finished() - started)
                        if key in optim_times:
                            optim_times[key].append(optim_seconds)
            t = {k: statistics.median(v) for k, v in times.items()}
            row = {"model": model, "workload": workload, "N": n, **{f"{k}_ms": 1000 * v for k, v in t.items()},
                   **{f"{k}_fb_ms": 1000 * (t[k] - statistics.median(v)) for k, v in optim_times.items()}}
            rows.append(with_ratios(row))
            if show:
                print(format_row(row, modes), flush=True)
    return rows


def with_ratios(row: dict) -> dict:
    """The row with the ratios its modes allow ("a/d fb": a/d of the forward_backward alone)."""
    for name, (x, y) in RATIOS.items():
        if f"{x}_ms" in row and f"{y}_ms" in row:
            row[name] = row[f"{x}_ms"] / row[f"{y}_ms"]
    if "a/d" in row:
        row["a/d fb"] = row["a_fb_ms"] / row["d_fb_ms"]
    return row


def ratio_names(modes: str) -> list[str]:
    row = with_ratios({f"{k}_ms": 1.0 for k in modes} | {f"{k}_fb_ms": 1.0 for k in "ad" if k in modes})
    return [k for k in ("a/d", "a/d fb", "d/e", "b/a", "c/a", "c/e", "capture") if k in row]


def header(modes: str) -> str:
    columns = [f"{k} ms" for k in modes] + ratio_names(modes)
    return (f"| model | tenants x workload | {' | '.join(columns)} |\n"
            f"|---|---|{'---|' * len(columns)}")


def format_row(r: dict, modes: str = MODES) -> str:
    cells = [f"{r[f'{k}_ms']:.0f}" for k in modes] + [f"{r[k]:.2f}" for k in ratio_names(modes)]
    return f"| {r['model']} | {r['N']} x {r['workload']} | {' | '.join(cells)} |"


def compare_with_before(before: str, pairs: int, models: list[str], args: list[str], modes: str) -> list[str]:
    """Each model measured in `pairs` processes per tree, alternating; per configuration and tree the
    median over processes of each process's medians. Returns the table's lines."""
    from before_tree import ROOT, run_in_tree, short_rev, worktree

    runs: dict[str, list[list[dict]]] = {"before": [], "now": []}
    with worktree(before) as old:
        for model in models:
            for pair in range(pairs):
                order = (("before", old), ("now", ROOT)) if pair % 2 == 0 else (("now", ROOT), ("before", old))
                for label, tree in order:
                    rows = run_in_tree(tree, Path(__file__).resolve(), "--models", model, *args, "--json")["rows"]
                    runs[label].append(rows)
                    print(label, model, "pair", pair + 1, json.dumps(rows), flush=True)
    medians = {label: median_rows(processes) for label, processes in runs.items()}
    rev = short_rev(before)
    columns = ([f"{k} ms {rev} / now" for k in modes] + [f"{k} throughput now/{rev}" for k in modes]
               + [f"{r} {rev} / now" for r in ("a/d", "d/e") if r in ratio_names(modes)])
    lines = [f"| model | tenants x workload | {' | '.join(columns)} |", f"|---|---|{'---|' * len(columns)}"]
    for key, was in medians["before"].items():
        now = medians["now"][key]
        cells = ([f"{milliseconds(was[f'{k}_ms'])} / {milliseconds(now[f'{k}_ms'])}" for k in modes]
                 + [f"**{was[f'{k}_ms'] / now[f'{k}_ms']:.2f}**" for k in modes]
                 + [f"{was[r]:.2f} / {now[r]:.2f}" for r in ("a/d", "d/e") if r in ratio_names(modes)])
        lines.append(f"| {key[0]} | {key[2]} x {key[1]} | {' | '.join(cells)} |")
    return lines


def milliseconds(ms: float) -> str:
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def median_rows(processes: list[list[dict]]) -> dict[tuple, dict]:
    """Per (model, workload, N): the median over processes of each time, the ratios taken from those."""
    by_key: dict[tuple, list[dict]] = {}
    for rows in processes:
        for r in rows:
            by_key.setdefault((r["model"], r["workload"], r["N"]), []).append(r)
    out = {}
    for key, rs in by_key.items():
        times = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_ms")}
        out[key] = with_ratios(times)
    return out


def main(models: str = "tiny,SmolLM2-135M-Instruct", tenants: str = "1,2,4,8", workloads: str = "2x128,1x32",
         modes: str = MODES, reps: int = 3, device: str = "cpu", results: Path | None = None, write: bool = True,
         before: str | None = None, pairs: int = 2,
         json_rows: bool = typer.Option(False, "--json", hidden=True)) -> None:
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    modes = "".join(k for k in MODES if k in modes)
    args = ["--tenants", tenants, "--workloads", workloads, "--modes", modes, "--reps", str(reps), "--device", device]
    command = f".venv/bin/python benchmarks/trainer_multitenant.py --models {models} {' '.join(args)}"
    on = torch.cuda.get_device_name() if device.startswith("cuda") else f"CPU, torch threads: {torch.get_num_threads()}"
    if before is not None:
        lines = compare_with_before(before, pairs, models.split(","), args, modes)
        text = (f"Command: `{command} --before {before} --pairs {pairs}`\n\nOn {on}, LoRA rank {RANK} on all linear "
                f"layers; per tree, {pairs} processes per model alternating with the other tree's, each the median of "
                f"{reps} interleaved repetitions; the median over processes.\n\n" + "\n".join(lines) + "\n")
        print(text)
        if write:
            (results or BEFORE_RESULTS).write_text(text)
        return
    if not json_rows:
        print(header(modes))
    rows = []
    for model in models.split(","):
        rows += measure(model, [int(n) for n in tenants.split(",")], workloads.split(","), reps, device, modes,
                        show=not json_rows)
    if json_rows:  # a child of --before: its rows, on one line
        print(json.dumps({"rows": rows}))
        return
    if write:
        results = results or RESULTS
        results.parent.mkdir(parents=True, exist_ok=True)
        lines = [header(modes)] + [format_row(r, modes) for r in rows]
        results.write_text(
            f"Command: `{command}`\n\nOn {on}, LoRA rank {RANK} on all linear "
            f"layers, median of {reps} interleaved repetitions.\n\n" + "\n".join(lines) + "\n"
        )
        print(f"written to {results}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # before_tree, beside this file
    typer.run(main)
