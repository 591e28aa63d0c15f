"""The JSON payload of each request kind: what the API stores with the request and the executor reads.

A forward/forward_backward's payload is its protobuf body (loraplex.wire.codec decodes it); a
sample's is a `SampleJob` (contract/sampling.py); every other kind's is one of these models.
The API builds the model and stores `to_bytes()`; the executor `parse`s it back. Fields left unset
are left out of the bytes, as they were before these models existed, so stored rows of either age
read the same.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from loraplex.types import AdamParams, DimuonParams
from pydantic import BaseModel, Discriminator, Tag

from contract.configs import LoraConfig
from contract.kinds import RequestKind


class Payload(BaseModel):
    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(exclude_unset=True)).encode()

    @classmethod
    def parse(cls, raw: bytes):
        return cls.model_validate_json(raw)


Optimizer = Literal["adamw", "dimuon"]  # a model's optimizer: Tinker's optimizer_config "type"


class CreateModelPayload(Payload):
    lora_config: LoraConfig  # resolved: the seed drawn, the defaults filled in
    optimizer: Optimizer = "adamw"


def _params_family(value) -> str:
    if isinstance(value, dict):
        return "dimuon" if "damping" in value else "adamw"  # stored with every field: Dimuon's has damping
    return "dimuon" if isinstance(value, DimuonParams) else "adamw"


class OptimStepPayload(Payload):
    # either family's hyperparameters, all fields resolved at the door (contract.configs.optim_params_from);
    # the key keeps its first name so stored rows of every age read the same
    adam_params: Annotated[Annotated[AdamParams, Tag("adamw")] | Annotated[DimuonParams, Tag("dimuon")],
                           Discriminator(_params_family)]


class SaveWeightsPayload(Payload):
    """save_weights, save_weights_for_sampler and save_weights_external: where the files go, and the
    checkpoint the scheduler records."""

    kind: Literal["training_state", "sampler", "external"]  # the checkpoint's (db CheckpointKind)
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    # an unnamed snapshot for save_weights_and_get_sampling_client: the sampler it serves
    sampling_session_id: str | None = None
    ephemeral: bool = False
    base_model: str | None = None  # save_weights_external: the base model's name, as its export names it
    age_recipients: list[str] | None = None  # save_weights_external: encrypt every file to these (checked)
    name: str
    tinker_path: str
    storage_path: str  # a path or fsspec URL in the checkpoint store


class LoadWeightsPayload(Payload):
    storage_path: str
    optimizer: bool  # load the optimizer's state (moments, momentum) and step too
    # the optimizer the model runs after the load: the checkpoint's (with `optimizer`), the model's own
    # (a load into an existing model) or the request's optimizer_config (a new weights-only model)
    optimizer_type: Optimizer = "adamw"
    tinker_path: str  # how errors name the checkpoint (its storage path holds the tenant's id)


class RejectedPayload(Payload):
    """Nothing: a refused request's error is on its row, and the scheduler answers it from there."""


JSON_PAYLOADS: dict[RequestKind, type[Payload]] = {
    RequestKind.CREATE_MODEL: CreateModelPayload,
    RequestKind.OPTIM_STEP: OptimStepPayload,
    RequestKind.SAVE_WEIGHTS: SaveWeightsPayload,
    RequestKind.SAVE_WEIGHTS_FOR_SAMPLER: SaveWeightsPayload,
    RequestKind.SAVE_WEIGHTS_EXTERNAL: SaveWeightsPayload,
    RequestKind.LOAD_WEIGHTS: LoadWeightsPayload,
    RequestKind.REJECTED: RejectedPayload,
}
