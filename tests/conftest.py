"""Shared fixtures: base models are built once per machine into the registry cache."""

import os

import pytest
import torch

# Without a GPU, Triton kernels can only run under its interpreter, which must be switched on
# before anything imports triton (peft and transformers may): hence here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workers.models.registry import resolve_model


@pytest.fixture(scope="session")
def tiny_model_path():
    return resolve_model("tiny")
