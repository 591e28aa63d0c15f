"""Every architecture Loraplex serves (models/architectures.py), sampled: an adapter the trainer trained
on the architecture's tiny model, saved as a PEFT snapshot, is loaded by vLLM and by peft, and both
give the trainer's logprobs, over a prompt longer than Mistral's and Gemma 2's sliding window, and
on the tokens vLLM samples after it. (Training them: tests/workers/trainer/test_architectures.py.)"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from models.architectures import ARCHITECTURES

pytestmark = pytest.mark.vllm
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(40)]  # 40 tokens: past the 16-token window, twice
NEW_TOKENS = 8


def sample_and_score(tiny: str, unembed: bool, folder: str) -> dict:
    """In a process of its own (one vLLM engine per process): train an adapter on `tiny`, save its
    snapshot, sample it with vLLM (prompt logprobs, greedy tokens with their logprobs) and score the
    same tokens with the trainer and with peft on the snapshot."""
    from loraplex.types import AdamParams
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from contract.configs import LoraConfig
    from contract.inputs import EngineDatum, ForwardBackwardInput
    from contract.sampling import SampleJob, SamplingOptions
    from models.registry import resolve_model
    from workers.sampler.engine import SamplerConfig, SamplerEngine
    from workers.trainer.engine import TrainerEngine

    path = resolve_model(tiny)
    trainer = TrainerEngine(path, max_rank=16)
    trainer.create_adapter("a", LoraConfig(rank=8, seed=1, train_unembed=unembed))
    tokens = list(range(20, 60))
    datum = EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(4):
        trainer.forward_backward([ForwardBackwardInput("a", [datum], "cross_entropy")])
        trainer.optim_step([("a", AdamParams(learning_rate=2e-2))])
    snapshot = str(trainer.save_sampler_weights("a", f"{folder}/snapshot"))

    sampler = SamplerEngine(SamplerConfig(path, max_model_len=512, max_lora_rank=16, kv_cache_gib=0.25)).start()
    try:
        sampler.wait_ready(timeout=300)
        done, results = threading.Event(), {}

        def on_done(request_id, outcome):
            results[request_id] = outcome
            done.set()

        options = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        sampler.submit(SampleJob("s", tuple(PROMPT), 1, options, snapshot, prompt_logprobs=True), on_done)
        assert done.wait(120), "the sampler did not answer"
    finally:
        sampler.close()
    result = results["s"]
    if isinstance(result, Exception):
        raise result
    sequence = result.sequences[0]
    full = PROMPT + list(sequence.tokens)

    def trainer_logprobs() -> list[float]:
        scored = EngineDatum(full[:-1], {"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
        return trainer.forward([ForwardBackwardInput("a", [scored])])[0].loss_fn_outputs[0]["logprobs"].tolist()

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager"),
                                      snapshot).eval()
    with torch.no_grad():
        logits = model(torch.tensor([full[:-1]])).logits[0]
    peft = torch.log_softmax(logits, -1).gather(1, torch.tensor(full[1:])[:, None])[:, 0].tolist()
    return {"prompt_logprobs": result.prompt_logprobs, "tokens": list(sequence.tokens),
            "logprobs": list(sequence.logprobs), "trainer": trainer_logprobs(), "peft": peft}


@pytest.fixture(scope="module")
def child():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        yield pool


# an architecture the sampler refuses (the MoE rows: models/architectures.py's no_sampling) is never sampled; its
# PEFT export is proven in peft by tests/workers/trainer/test_moe_experts.py, its refusal there too
@pytest.mark.parametrize("model_type", sorted(m for m, a in ARCHITECTURES.items() if not a.no_sampling))
def test_vllm_and_peft_give_the_trainers_logprobs(model_type, child, tmp_path):
    arch = ARCHITECTURES[model_type]
    got = child.submit(sample_and_score, arch.tiny, arch.unembed_lora, str(tmp_path)).result(timeout=600)
    trainer, n = got["trainer"], len(PROMPT)
    assert got["prompt_logprobs"][0] is None
    assert got["prompt_logprobs"][1:] == pytest.approx(trainer[:n - 1], abs=1e-4)  # vLLM scoring the prompt
    assert got["logprobs"] == pytest.approx(trainer[n - 1:], abs=1e-4)  # vLLM's sampled tokens
    assert got["peft"] == pytest.approx(trainer, abs=1e-5)  # the PEFT export in peft
