"""Shared fixtures: base models are built once per machine into the registry cache; a module
that defines a `server` fixture (an embedded ServerThread) gets `api_key` and `service_client`."""

import os

import pytest
import tinker
import torch

# Without a GPU, Triton kernels can only run under its interpreter, which must be switched on
# before anything imports triton (peft and transformers may): hence here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workers.models.registry import resolve_model


@pytest.fixture(scope="session")
def tiny_model_path():
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def api_key(server):
    """A new tenant's key on this module's `server`."""
    return server.new_tenant()


@pytest.fixture(scope="module")
def service_client(server, api_key):
    return tinker.ServiceClient(base_url=server.base_url, api_key=api_key)
