"""A run whose engine is killed mid-way ends with the bits of a run that never was: the replay of its
acknowledged requests recomputes their gradients alone (they first ran beside another tenant's
requests), and batch-invariant training (docs/decisions/0022-batch-invariant-training.md) makes
those the same bits. The final adapter (weights and Adam moments) is compared with torch.equal
against an engine that trained the model alone, and so is a forward's logprobs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import tinker
import torch
from loraplex.types import AdamParams
from tinker import types

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from storage.live_slots import read_slots
from tests.servers import running_server
from workers.trainer.engine import TrainerEngine

pytestmark = pytest.mark.slow  # an embedded server whose engine child process is killed and replaced
STEPS, KILL_AFTER, LR = 4, 2, 1e-2


def sequences(step: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(step)
    return [rng.integers(10, 400, length + 1).tolist() for length in rng.integers(5, 30, n)]


def sdk_datums(step: int, n: int) -> list[types.Datum]:
    return [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                        "weights": np.ones(len(tokens) - 1, np.float32)})
            for tokens in sequences(step, n)]


def engine_datums(step: int, n: int) -> list[EngineDatum]:
    return [EngineDatum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)})
            for tokens in sequences(step, n)]


def train_beside_a_neighbour(tc, neighbour, steps: int, kill_after: int, kill: Callable[[], None]) -> None:
    """`steps` steps of the model `tc` whose forward_backwards share a cycle with a neighbour's (another
    tenant's model, another rank); `kill()` runs once step `kill_after`'s gradient is acknowledged."""
    for step in range(steps):
        # sent together: one cycle, one pass for both models
        futures = [neighbour.forward_backward(sdk_datums(100 + step, 3), "cross_entropy"),
                   tc.forward_backward(sdk_datums(step, 2), "cross_entropy")]
        for future in futures:
            future.result()
        if step == kill_after:
            kill()
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        neighbour.optim_step(types.AdamParams(learning_rate=3 * LR)).result()


def trained_alone(engine: TrainerEngine, steps: int):
    """The model's adapter trained on `engine` alone, never stopped (rank 4, seed 2, as `tc`)."""
    engine.create_adapter("x", LoraConfig(rank=4, seed=2))
    for step in range(steps):
        engine.forward_backward([ForwardBackwardInput("x", engine_datums(step, 2))])
        engine.optim_step([("x", AdamParams(learning_rate=LR))])
    return engine.adapter("x")


def assert_same_bits(restored, alone) -> None:
    """Weights and Adam moments, bit for bit."""
    assert torch.equal(restored.flat_weights, alone.flat_weights)
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(restored.optimizer_state[name], alone.optimizer_state[name]), name


def test_a_killed_engine_replays_to_the_bits_of_an_uninterrupted_run(tmp_path, tiny_model_path):
    with running_server(tmp_path, engine_process=True, sampler_enabled=False, state_write_interval_seconds=0,
                        cycle_gather_seconds=0.2) as server:
        client = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant())
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        neighbour = tinker.ServiceClient(base_url=server.base_url, api_key=server.new_tenant()) \
            .create_lora_training_client(base_model="tiny", rank=8, seed=3).result()

        def kill_the_engine() -> None:  # the gradient just computed lives in the engine process only
            executor = server.embedded.executor
            executor._proc.kill()
            executor._proc.join()
            with pytest.raises(Exception, match="engine process died"):
                tc.forward(sdk_datums(0, 1), "cross_entropy").result()

        train_beside_a_neighbour(tc, neighbour, STEPS, KILL_AFTER, kill_the_engine)
        served = tc.forward(sdk_datums(99, 2), "cross_entropy").result()
    newest = read_slots(tmp_path / "live", tc.model_id)[0]  # written after the last step (interval 0)
    assert newest.manifest["step"] == STEPS
    restored = TrainerEngine(tiny_model_path).load_state("restored", newest.path)

    reference = TrainerEngine(tiny_model_path)
    assert_same_bits(restored, trained_alone(reference, STEPS))
    expected = reference.forward([ForwardBackwardInput("x", engine_datums(99, 2))])[0]
    for got, want in zip(served.loss_fn_outputs, expected.loss_fn_outputs):
        assert np.array_equal(np.asarray(got["logprobs"].tolist(), np.float32), want["logprobs"].numpy())  # bits
