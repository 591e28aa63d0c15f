"""Shared fixtures: base models are built once per machine into the registry cache."""

import pytest

from workers.models.registry import resolve_model


@pytest.fixture(scope="session")
def tiny_model_path():
    return resolve_model("tiny")
