"""Bad input fails alone, with an error naming the datum and field, before any state changes."""

from __future__ import annotations

import math

import pytest
import torch
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.errors import InvalidInputError
from contract.inputs import EngineDatum, ForwardBackwardInput
from tests.workers.trainer.peft_reference import random_datum
from workers.trainer.engine import TrainerEngine

VOCAB = 512


@pytest.fixture
def engine(tiny_model_path):
    engine = TrainerEngine(tiny_model_path, max_rank=16)
    engine.create_adapter("victim", LoraConfig(rank=4, seed=1))
    engine.create_adapter("bystander", LoraConfig(rank=4, seed=2))
    return engine


def good(seed=0, n=6, loss_fn="cross_entropy"):
    return random_datum(loss_fn, n, torch.Generator().manual_seed(seed), VOCAB)


def with_input(key, value, loss_fn="cross_entropy"):
    d = good(loss_fn=loss_fn)
    return EngineDatum(d.tokens, {**d.loss_fn_inputs, key: value})


BAD_REQUESTS = {
    "length mismatch": (
        ForwardBackwardInput("victim", [good(), with_input("weights", torch.ones(5))]),
        "data[1].loss_fn_inputs['weights']",
    ),
    "target length mismatch": (
        ForwardBackwardInput("victim", [with_input("target_tokens", torch.ones(7, dtype=torch.long))]),
        "data[0].loss_fn_inputs['target_tokens']",
    ),
    "token id beyond vocab": (
        ForwardBackwardInput("victim", [good(), EngineDatum([1, 2, VOCAB], good(n=3).loss_fn_inputs)]),
        "data[1].model_input",
    ),
    "negative token id": (
        ForwardBackwardInput("victim", [EngineDatum([1, -2, 3], good(n=3).loss_fn_inputs)]),
        "data[0].model_input",
    ),
    "target id beyond vocab": (
        ForwardBackwardInput("victim", [with_input("target_tokens", torch.full((6,), VOCAB + 1))]),
        "data[0].loss_fn_inputs['target_tokens']",
    ),
    "NaN advantage": (
        ForwardBackwardInput("victim", [with_input("advantages", torch.tensor([0, 1, math.nan, 0, 0, 0.0]), "ppo")], "ppo"),
        "data[0].loss_fn_inputs['advantages']",
    ),
    "infinite weight": (
        ForwardBackwardInput("victim", [with_input("weights", torch.tensor([1, 1, 1, math.inf, 1, 1.0]))]),
        "data[0].loss_fn_inputs['weights']",
    ),
    "unknown loss": (ForwardBackwardInput("victim", [good()], "mse"), "loss_fn"),
    "missing RL input": (
        ForwardBackwardInput("victim", [EngineDatum([1, 2], {"target_tokens": [2, 3]})], "importance_sampling"),
        "data[0].loss_fn_inputs['logprobs']",
    ),
    "unknown input key": (
        ForwardBackwardInput("victim", [with_input("advantage", torch.ones(6), "ppo")], "ppo"),
        "data[0].loss_fn_inputs['advantage']",
    ),
    "unknown config key": (
        ForwardBackwardInput("victim", [good(loss_fn="ppo")], "ppo", {"clip_eps": 0.2}),
        "loss_fn_config['clip_eps']",
    ),
    "NaN config": (
        ForwardBackwardInput("victim", [good(loss_fn="dro")], "dro", {"beta": math.nan}),
        "loss_fn_config['beta']",
    ),
    "empty model input": (ForwardBackwardInput("victim", [EngineDatum([], {"target_tokens": []})]), "data[0].model_input"),
    "float token ids": (ForwardBackwardInput("victim", [EngineDatum([1.5, 2.0], {"target_tokens": [1, 2]})]), "data[0].model_input"),
    "no data": (ForwardBackwardInput("victim", []), "data"),
    "unknown adapter": (ForwardBackwardInput("nobody", [good()]), "adapter_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_fails_alone_and_changes_nothing(engine, case):
    bad, field = BAD_REQUESTS[case]
    victim = engine.adapter("victim")
    weights_before = [p.detach().clone() for p in victim.parameters()]
    ok = ForwardBackwardInput("bystander", [good(seed=3)])

    results = engine.forward_backward([bad, ok])

    assert isinstance(results[0], InvalidInputError)
    assert results[0].field == field and results[0].category == "user"
    assert str(results[0]).startswith(field)
    assert not victim.has_gradients()
    assert all(torch.equal(p, q) for p, q in zip(victim.parameters(), weights_before))
    assert math.isfinite(results[1].metrics["loss:sum"]) and engine.adapter("bystander").has_gradients()


def test_rank_above_max_is_refused(engine):
    with pytest.raises(InvalidInputError, match="rank") as err:
        engine.create_adapter("big", LoraConfig(rank=32))
    assert err.value.field == "lora_config.rank" and "big" not in engine.adapters


def test_bad_adam_params_fail_alone(engine):
    engine.forward_backward([ForwardBackwardInput(a, [good()]) for a in ("victim", "bystander")])
    before = [p.detach().clone() for p in engine.adapter("victim").parameters()]
    results = engine.optim_step([("victim", AdamParams(learning_rate=math.nan)), ("bystander", AdamParams())])
    assert isinstance(results[0], InvalidInputError) and results[0].field == "adam_params.learning_rate"
    assert all(torch.equal(p, q) for p, q in zip(engine.adapter("victim").parameters(), before))
    assert engine.adapter("victim").has_gradients()  # its accumulated gradient is kept for a corrected retry
    assert results[1]["step"] == 1.0
