"""The engine gives the same numbers with the Triton SGMV kernels as with the torch segment loop, on
every architecture Loraplex serves (models/architectures.py: Phi-3's fused projections are wider).

Without a GPU the kernels run under the Triton interpreter (see tests/conftest.py).
"""

import pytest
import torch

from contract.configs import LoraConfig
from contract.inputs import ForwardBackwardInput
from models.architectures import ARCHITECTURES
from models.registry import resolve_model
from tests.workers.trainer.peft_reference import random_datum, rel_err
from workers.trainer.engine import TrainerEngine

pytestmark = pytest.mark.gpu
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_triton_backend_matches_torch_backend(model_type):
    arch = ARCHITECTURES[model_type]
    path = resolve_model(arch.tiny)
    engines = {b: TrainerEngine(path, sgmv_backend=b, device=DEVICE) for b in ("loop", "triton")}
    configs = {"a": LoraConfig(rank=2, seed=1, train_unembed=arch.unembed_lora),
               "b": LoraConfig(rank=8, seed=2, train_attn=False, train_unembed=arch.unembed_lora)}
    gen = torch.Generator().manual_seed(0)
    b_values = {}
    for engine in engines.values():
        for adapter_id, cfg in configs.items():
            adapter = engine.create_adapter(adapter_id, cfg)
            with torch.no_grad():
                for path, w in adapter.weights.items():
                    key = (adapter_id, path)
                    b_values.setdefault(key, 0.1 * torch.randn(w.lora_b.shape, generator=gen))
                    w.lora_b.copy_(b_values[key])
    requests = [
        ForwardBackwardInput("a", [random_datum("ppo", n, gen, 512) for n in (6, 3)], "ppo"),
        ForwardBackwardInput("b", [random_datum("cross_entropy", 9, gen, 512)]),
    ]
    results = {b: engine.forward_backward(requests) for b, engine in engines.items()}
    # fp32 with a different summation order (kernel blocks vs torch): 1.2e-5 relative seen
    tolerance = 3e-5
    for ours, ref in zip(results["triton"], results["loop"]):
        assert abs(ours.metrics["loss:sum"] - ref.metrics["loss:sum"]) <= tolerance * abs(ref.metrics["loss:sum"])
        for o, r in zip(ours.loss_fn_outputs, ref.loss_fn_outputs):
            assert rel_err(o["logprobs"], r["logprobs"]) <= tolerance
    for adapter_id in configs:
        pairs = zip(engines["triton"].adapter(adapter_id).named_parameters(),
                    engines["loop"].adapter(adapter_id).named_parameters())
        for (name, p), (_, q) in pairs:
            assert rel_err(p.grad.cpu(), q.grad.cpu()) <= tolerance, name
