"""The vLLM sampler engine against peft / HF, on the tiny model in fp32.

Adapters are trained with the trainer engine (so their B matrices are not zero and they change
the output), saved as PEFT snapshot folders, and sampled by one multi-LoRA vLLM engine.
"""

from __future__ import annotations

import multiprocessing
import shutil
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import pytest
import torch
from loraplex.types import AdamParams
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from contract.configs import LoraConfig
from contract.errors import EngineError
from contract.inputs import EngineDatum, ForwardBackwardInput
from contract.sampling import SampleJob, SampleResult, SamplingOptions
from storage.checkpoint_files import write_snapshot_manifest
from workers.compute_thread import ComputeThread
from workers.sampler import dense_lora
from workers.sampler.engine import SamplerConfig, SamplerEngine
from workers.trainer.engine import TrainerEngine

pytestmark = pytest.mark.vllm
PROMPT = (5, 6, 7, 8, 9)
GREEDY = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def snapshots(tiny_model_path, tmp_path_factory):
    """Two tenants' trained adapters (different data, ranks, parts) as PEFT snapshot folders."""
    folder = tmp_path_factory.mktemp("snapshots")
    trainer = TrainerEngine(tiny_model_path, max_rank=16)
    configs = {"alice": LoraConfig(rank=8, seed=1), "bob": LoraConfig(rank=4, seed=2, train_mlp=False)}
    data = {"alice": list(range(10, 40)), "bob": list(range(100, 160, 2))}
    for name, cfg in configs.items():
        trainer.create_adapter(name, cfg)
        tokens = data[name]
        datum = EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        for _ in range(6):
            trainer.forward_backward([ForwardBackwardInput(name, [datum], "cross_entropy")])
            trainer.optim_step([(name, AdamParams(learning_rate=2e-2))])
    return {name: str(trainer.save_sampler_weights(name, folder / name)) for name in configs}


def start_engine(model_path, compute: ComputeThread | None = None, lora_ops: str = "segmented") -> SamplerEngine:
    """Two adapter slots and two loaded adapters at most: a third snapshot evicts one (LRU)."""
    config = SamplerConfig(model_path, max_model_len=512, max_lora_rank=16, max_loras=2, max_cpu_loras=2,
                           kv_cache_gib=0.25, lora_ops=lora_ops)
    engine = SamplerEngine(config, compute).start()
    engine.wait_ready(timeout=300)
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    compute = ComputeThread()  # vLLM's work on a compute thread of its own, as in the embedded server
    engine = start_engine(tiny_model_path, compute)
    yield engine
    engine.close()
    compute.close()


def run(engine: SamplerEngine, jobs: list[SampleJob],
        callback_threads: set[str] | None = None) -> dict[str, SampleResult | EngineError]:
    """Submit all jobs at once (so they share the engine's batches) and wait for every result
    (`callback_threads`: gets the names of the threads the results arrived on)."""
    results: dict[str, SampleResult | EngineError] = {}
    done = threading.Event()

    def on_done(request_id, outcome):
        if callback_threads is not None:
            callback_threads.add(threading.current_thread().name)
        results[request_id] = outcome
        if len(results) == len(jobs):
            done.set()

    for job in jobs:
        engine.submit(job, on_done)
    assert done.wait(120), "the sampler did not finish"
    return results


def job(request_id: str, adapter: str | None, options=GREEDY, **kw) -> SampleJob:
    return SampleJob(request_id, PROMPT, kw.pop("num_samples", 1), options, adapter, **kw)


@pytest.fixture(scope="module")
def peft_models(tiny_model_path, snapshots):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return base, {name: PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), path).eval()
        for name, path in snapshots.items()}


def hf_greedy(model, n: int) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.gpu  # also vLLM's GPU multi-LoRA sampling against peft, where there is a GPU
def test_greedy_tokens_equal_peft_and_a_mixed_batch_equals_each_request_alone(engine, snapshots, peft_models):
    base, adapters = peft_models
    expected = {"base": hf_greedy(base, 12)} | {name: hf_greedy(m, 12) for name, m in adapters.items()}
    assert len({tuple(v) for v in expected.values()}) == 3, "the adapters must change the greedy output"
    targets = {"base": None} | snapshots
    alone = {name: run(engine, [job(f"alone-{name}", path)])[f"alone-{name}"] for name, path in targets.items()}
    # base and both tenants in one engine at once, interleaved, several times over
    mixed = run(engine, [job(f"mixed-{i}-{name}", path) for i in range(3) for name, path in targets.items()])
    for name in targets:
        assert alone[name].sequences[0].tokens == expected[name], name
        for i in range(3):
            assert mixed[f"mixed-{i}-{name}"].sequences[0].tokens == expected[name], (name, i)
            assert mixed[f"mixed-{i}-{name}"].sequences[0].logprobs == pytest.approx(
                alone[name].sequences[0].logprobs, abs=1e-5)


def test_a_diverged_adapter_is_refused_and_changes_no_one_elses_tokens(engine, snapshots, tmp_path):
    """A snapshot whose weights went to NaN (a diverged run) fails its own jobs with a user error;
    the base-model request and the other tenant's request submitted with it get what they get alone."""
    diverged = tmp_path / "diverged"
    shutil.copytree(snapshots["alice"], diverged)
    weights = load_file(diverged / "adapter_model.safetensors")
    weights = {k: v.clone() for k, v in weights.items()}
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, diverged / "adapter_model.safetensors")
    write_snapshot_manifest(diverged)  # as the trainer saves diverged weights (else the file reads as corrupt)
    alone = run(engine, [job("base", None), job("bob", snapshots["bob"])])
    callback_threads: set[str] = set()
    together = run(engine, [job("nan", str(diverged)), job("base", None), job("bob", snapshots["bob"])],
                   callback_threads)
    assert callback_threads == {"sampler-engine"}  # callbacks store outcomes: never on the compute thread
    assert isinstance(together["nan"], EngineError) and together["nan"].category == "user"
    assert "NaN or inf" in str(together["nan"])
    for name in ("base", "bob"):
        assert together[name].sequences[0].tokens == alone[name].sequences[0].tokens, name


def test_prompt_logprobs_of_mixed_batches_equal_peft(engine, snapshots, peft_models):
    """Prompt logprobs go through the adapter's lm_head LoRA too (every adapter here trains unembed)."""
    base, adapters = peft_models
    results = run(engine, [job(f"lp-{name}", path, SamplingOptions(max_tokens=1), prompt_logprobs=True)
                           for name, path in ({"base": None} | snapshots).items()])
    for name, model in ({"base": base} | adapters).items():
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], -1)
        expected = [logprobs[i, t].item() for i, t in enumerate(PROMPT[1:])]
        got = results[f"lp-{name}"].prompt_logprobs
        assert got[0] is None
        assert got[1:] == pytest.approx(expected, abs=1e-4), name


@pytest.fixture(scope="module")
def child():
    """A spawned process for engines beside this process's own (vLLM allows one engine per process
    at a time), one after another: vLLM loads there once for the tests below."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def stock_ops_tokens(model_path, jobs: list[SampleJob]) -> dict[str, list[int]]:
    """Greedy tokens from an engine with vLLM's own CPU LoRA ops (run in a child process: vLLM
    allows one engine per process at a time)."""
    engine = start_engine(model_path, lora_ops="vllm")
    try:
        return {request_id: r.sequences[0].tokens for request_id, r in run(engine, jobs).items()}
    finally:
        engine.close()


def test_segmented_lora_ops_give_the_tokens_of_vllms_own_ops(tiny_model_path, snapshots, engine, child):
    """Same adapters, LoRA-only batch (vLLM's own CPU ops leak adapters into base rows, so no base here)."""
    jobs = [job(f"{name}-{i}", path) for i in range(2) for name, path in snapshots.items()]
    ours = run(engine, jobs)
    stock = child.submit(stock_ops_tokens, tiny_model_path, jobs).result(timeout=600)
    for j in jobs:
        assert ours[j.request_id].sequences[0].tokens == stock[j.request_id]


def dense_and_segmented_tokens(model_path, jobs: list[SampleJob]) -> tuple[dict, dict, int]:
    """Greedy tokens of a bf16 engine with the dense decode path and with the segmented path only,
    and how many dense LoRA calls ran (a child process: one vLLM engine per process)."""
    from workers.sampler import dense_lora

    calls = 0
    add, max_rows = dense_lora.DenseLoRA.add_, dense_lora.DENSE_MAX_ROWS

    def counted_add(self, *args):
        nonlocal calls
        calls += 1
        add(self, *args)

    dense_lora.DenseLoRA.add_ = counted_add
    config = SamplerConfig(model_path, max_model_len=512, max_lora_rank=16, max_loras=2, dtype="bfloat16",
                           kv_cache_gib=0.25)
    engine = SamplerEngine(config).start()
    engine.wait_ready(timeout=300)
    try:
        dense = {k: r.sequences[0].tokens for k, r in run(engine, jobs).items()}
        dense_lora.DENSE_MAX_ROWS = 0
        segmented = {k: r.sequences[0].tokens for k, r in run(engine, [replace(j, request_id=j.request_id + "'")
                                                                         for j in jobs]).items()}
        return dense, {k.rstrip("'"): v for k, v in segmented.items()}, calls
    finally:
        engine.close()
        dense_lora.DenseLoRA.add_, dense_lora.DENSE_MAX_ROWS = add, max_rows  # the child runs other engines


@pytest.mark.skipif(not dense_lora.available(torch.bfloat16), reason="no AMX or AVX512-BF16 GEMM kernel here")
def test_dense_decode_path_gives_the_tokens_of_the_segmented_path_in_bf16(tiny_model_path, snapshots, child):
    jobs = [job(f"{name}-{i}", path) for i in range(2) for name, path in (snapshots | {"base": None}).items()]
    dense, segmented, dense_calls = child.submit(dense_and_segmented_tokens, tiny_model_path, jobs).result(timeout=600)
    assert dense_calls > 0
    assert dense == segmented


def test_sampling_options(engine, snapshots):
    alice = snapshots["alice"]
    hot = SamplingOptions(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    results = run(engine, [
        job("seeded-1", alice, hot), job("seeded-2", alice, hot),
        job("group", alice, SamplingOptions(max_tokens=10, temperature=1.0, seed=3), num_samples=4),
        job("greedy-n", alice, GREEDY, num_samples=3),
        job("topk", alice, SamplingOptions(max_tokens=4, temperature=1.0, seed=1), topk_sample_logprobs=3),
    ])
    assert results["seeded-1"].sequences[0].tokens == results["seeded-2"].sequences[0].tokens
    group = results["group"].sequences
    assert len(group) == 4 and len({tuple(s.tokens) for s in group}) > 1
    greedy = results["greedy-n"].sequences
    assert len(greedy) == 3 and all(s.tokens == greedy[0].tokens for s in greedy)
    seq = results["topk"].sequences[0]
    for token, logprob, top in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert logprob <= top[0][1] + 1e-6
        assert token not in dict(top) or dict(top)[token] == pytest.approx(logprob)


def test_stops(engine, snapshots):
    alice = snapshots["alice"]
    free = run(engine, [job("free", alice)])["free"].sequences[0]
    stop_token = free.tokens[3]
    first = free.tokens.index(stop_token)
    results = run(engine, [
        job("stop-id", alice, SamplingOptions(max_tokens=12, temperature=0.0, stop_token_ids=(stop_token,))),
        job("length", alice, SamplingOptions(max_tokens=2, temperature=0.0)),
    ])
    stopped = results["stop-id"].sequences[0]
    assert stopped.tokens == free.tokens[: first + 1] and stopped.stop_reason == "stop"  # the stop token included
    assert results["length"].sequences[0].stop_reason == "length"
    assert len(results["length"].sequences[0].tokens) == 2


def test_a_missing_snapshot_fails_alone(engine, snapshots, tmp_path):
    results = run(engine, [job("gone", str(tmp_path / "nothing")), job("fine", snapshots["bob"])])
    assert isinstance(results["gone"], EngineError) and results["gone"].category == "user"
    assert "sampling_session_id" in str(results["gone"])
    assert isinstance(results["fine"], SampleResult)


def test_a_slow_snapshot_download_does_not_hold_up_other_samples(engine, snapshots, webdav_store, monkeypatch):
    """A snapshot on a remote store downloads off the engine thread: while its download is held
    up, other tenants' and base-model samples finish; then its own job samples that snapshot."""
    from storage import store

    remote = store.join(webdav_store(), "alice-v1")
    with store.writing(remote) as folder:
        shutil.copytree(snapshots["alice"], folder, dirs_exist_ok=True)
    release, download = threading.Event(), store.local_folder

    def slow_download(location):
        if location == remote:
            assert release.wait(120), "the test never released the download"
        return download(location)

    monkeypatch.setattr(store, "local_folder", slow_download)
    remote_done = threading.Event()
    remote_result = {}
    engine.submit(job("remote", remote), lambda request_id, outcome: (remote_result.update(r=outcome), remote_done.set()))
    try:
        others = run(engine, [job("other-tenant", snapshots["bob"]), job("base", None)])
        assert all(isinstance(r, SampleResult) for r in others.values())
        assert not remote_done.is_set()
    finally:
        release.set()
    assert remote_done.wait(120), "the remote snapshot's job did not finish"
    expected = run(engine, [job("local", snapshots["alice"])])["local"].sequences[0].tokens
    assert remote_result["r"].sequences[0].tokens == expected


def test_more_snapshots_than_slots_are_evicted_and_reloaded(engine, snapshots, tmp_path):
    """Copies of the snapshots are new versions (new paths): four versions through two slots."""
    versions = {}
    for name, path in snapshots.items():
        copy = tmp_path / f"{name}-copy"
        shutil.copytree(path, copy)
        versions[name], versions[f"{name}-copy"] = path, str(copy)
    expected = {name: run(engine, [job(f"ref-{name}", path)])[f"ref-{name}"].sequences[0].tokens
                for name, path in snapshots.items()}
    for round_ in range(2):  # all at once (two per batch at most), then again after the evictions
        results = run(engine, [job(f"{round_}-{name}", path) for name, path in versions.items()])
        for name in versions:
            assert results[f"{round_}-{name}"].sequences[0].tokens == expected[name.removesuffix("-copy")]


def test_seeded_groups_with_long_prompts(engine, snapshots):
    """A GRPO step: 4 prompts x n=8, seeded, prompts longer than one step's token budget would
    hold together (vLLM on CPU failed whole steps here when it split seeded prompts over steps)."""
    g = torch.Generator().manual_seed(1)
    long_prompts = [tuple(torch.randint(10, 500, (384,), generator=g).tolist()) for _ in range(4)]
    options = SamplingOptions(max_tokens=6, temperature=1.0, seed=9)

    def group(tag):
        return [SampleJob(f"{tag}-{i}", p, 8, options, snapshots["alice"]) for i, p in enumerate(long_prompts)]

    first, second = run(engine, group("a")), run(engine, group("b"))
    for i in range(4):
        assert [s.tokens for s in first[f"a-{i}"].sequences] == [s.tokens for s in second[f"b-{i}"].sequences]
        assert len(first[f"a-{i}"].sequences) == 8


# --- the vLLM internals workers/sampler/vllm_lora_ops.py relies on (its docstring lists them) ----------

def test_the_lora_ops_were_checked_against_this_vllm():
    import vllm

    from workers.sampler.vllm_lora_ops import VERIFIED_WITH_VLLM

    assert vllm.__version__.split("+")[0] == VERIFIED_WITH_VLLM, (
        f"vLLM {vllm.__version__} is not the release workers/sampler/vllm_lora_ops.py was checked against "
        f"({VERIFIED_WITH_VLLM}): run this module's coupling tests, recheck the couplings its docstring lists, "
        "then update VERIFIED_WITH_VLLM")


def test_a_layer_passes_the_same_stacked_weights_on_every_step(engine, snapshots, monkeypatch):
    """The per-layer weight caches are found by the stacked tensors a layer passes."""
    from workers.sampler.vllm_lora_ops import SegmentedPunicaWrapper

    passed: list[set[int]] = [set()]
    original = SegmentedPunicaWrapper._grouped_weights

    def recording(self, lora_a_stacked, lora_b_stacked, slots):
        passed[-1].add(id(lora_a_stacked[0]))
        return original(self, lora_a_stacked, lora_b_stacked, slots)

    monkeypatch.setattr(SegmentedPunicaWrapper, "_grouped_weights", recording)
    monkeypatch.setattr("workers.sampler.dense_lora.DENSE_MAX_ROWS", 0)  # every step through the cached weights
    for round_ in range(2):
        run(engine, [job(f"same-{round_}-{name}", path) for name, path in snapshots.items()])
        passed.append(set())
    assert passed[0], "the segmented path did not run"
    assert passed[0] == passed[1], (
        "vLLM passed other stacked LoRA weight tensors for the same layers on a later step: the per-layer "
        "caches of workers/sampler/vllm_lora_ops.py (_PerLayer) would rebuild every step; recheck them")


def test_sampling_and_prompt_logprobs_pass_the_logits_rows_the_lora_ops_expect(engine, snapshots, monkeypatch):
    """Sampling's logits input is a tensor of its own, one row per sequence; prompt logprobs pass one
    request's rows as a slice of the step's hidden states, found by its storage offset."""
    from workers.sampler.vllm_lora_ops import SegmentedPunicaWrapper

    calls: list[tuple[bool, list[int]]] = []  # (took the sampling branch, each row's slot)
    original = SegmentedPunicaWrapper._logits_groups

    def recording(self, x):
        groups, slots = original(self, x)
        calls.append((self._sampled_rows(x), slots.tolist()))
        return groups, slots

    monkeypatch.setattr(SegmentedPunicaWrapper, "_logits_groups", recording)
    run(engine, [job(f"rows-{name}", path) for name, path in snapshots.items()])
    assert calls and all(sampling for sampling, _ in calls), (
        "vLLM's sampling no longer passes the sampled positions' hidden states as a tensor of their own: "
        "SegmentedPunicaWrapper._logits_groups would read rows' adapters from storage offsets; recheck it")

    calls.clear()
    alice = snapshots["alice"]
    run(engine, [job("rows-lp-alice", alice, SamplingOptions(max_tokens=1), prompt_logprobs=True),
                 job("rows-lp-base", None, SamplingOptions(max_tokens=1), prompt_logprobs=True)])
    prompt_calls = [slots for sampling, slots in calls if not sampling]
    assert prompt_calls, "no prompt-logprob logits call was recognized as a slice of the step's hidden states"
    for slots in prompt_calls:
        assert len(set(slots)) == 1, (
            f"a prompt-logprob logits call mixed rows of several requests ({slots}): the storage-offset mapping "
            "in SegmentedPunicaWrapper._logits_groups no longer matches vLLM's layout; recheck it")
    assert {slots[0] for slots in prompt_calls} >= {-1}, "the base request's prompt rows were given an adapter"
    assert any(slots[0] >= 0 for slots in prompt_calls), "the adapter request's prompt rows lost their adapter"
