"""What an uninterrupted run gives: the reference for tests that kill an engine or a worker."""

from __future__ import annotations

from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from workers.trainer.engine import TrainerEngine


def logprobs_after_steps(model_path, tokens: list[int], *, rank: int, seed: int, steps: int, lr: float,
                         fwd_bwd_per_step: int = 1) -> list[float]:
    """Forward logprobs of `tokens` after `steps` rounds of (`fwd_bwd_per_step` cross-entropy
    forward_backward calls, optim_step)."""
    engine = TrainerEngine(model_path, max_rank=max(rank, 16))
    engine.create_adapter("x", LoraConfig(rank=rank, seed=seed))
    datum = EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    for _ in range(steps):
        for _ in range(fwd_bwd_per_step):
            engine.forward_backward([ForwardBackwardInput("x", [datum])])
        engine.optim_step([("x", AdamParams(learning_rate=lr))])
    return engine.forward([ForwardBackwardInput("x", [datum])])[0].loss_fn_outputs[0]["logprobs"].tolist()
