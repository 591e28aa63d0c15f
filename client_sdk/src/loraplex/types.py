"""The SDK's data types, named as in the Tinker SDK so a notebook ports by changing one import.

Arrays are numpy; torch tensors and plain lists are accepted wherever an array is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import numpy as np

StopReason = Literal["stop", "length"]
# Tinker's default LoRA rank: what a model created without one gets (the server applies it too).
DEFAULT_LORA_RANK = 32


def as_array(value: Any) -> np.ndarray:
    """numpy from a numpy array, a torch tensor (any device), a TensorData or a list."""
    if isinstance(value, TensorData):
        return value.to_numpy()
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


@dataclass(frozen=True)
class EncodedTextChunk:
    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelInput:
    chunks: tuple[EncodedTextChunk, ...] = ()

    @classmethod
    def from_ints(cls, tokens) -> "ModelInput":
        return cls((EncodedTextChunk(tuple(int(t) for t in as_array(tokens).reshape(-1))),))

    @classmethod
    def empty(cls) -> "ModelInput":
        return cls(())

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    def append_int(self, token: int) -> "ModelInput":
        return ModelInput.from_ints(self.to_ints() + [int(token)])

    @property
    def length(self) -> int:
        return sum(c.length for c in self.chunks)

    def to_json(self) -> dict:
        return {"chunks": [{"type": "encoded_text", "tokens": list(c.tokens)} for c in self.chunks]}

    def __repr__(self) -> str:
        tokens = self.to_ints()
        shown = tokens if len(tokens) <= 8 else tokens[:4] + ["..."] + tokens[-2:]
        return f"ModelInput({self.length} tokens: {shown})"


@dataclass(frozen=True)
class TensorData:
    """A flat array with its dtype and shape (Tinker's TensorData)."""

    data: list
    dtype: Literal["int64", "float32"]
    shape: tuple[int, ...] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorData":
        dtype = "float32" if array.dtype.kind == "f" else "int64"
        return cls(array.reshape(-1).tolist(), dtype, tuple(array.shape))

    @classmethod
    def from_torch(cls, tensor) -> "TensorData":
        return cls.from_numpy(as_array(tensor))

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=np.float32 if self.dtype == "float32" else np.int64)
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self):
        import torch

        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def __repr__(self) -> str:
        return f"TensorData({self.dtype}, shape={list(self.shape or [len(self.data)])})"


@dataclass(frozen=True)
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, Any]  # name -> array-like (numpy, torch, list or TensorData)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: as_array(value) for name, value in self.loss_fn_inputs.items()}


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamParams, with its defaults. The Loraplex server's optimizer takes this same type:
    one definition for the client and the server."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 disables clipping

    def to_json(self) -> dict:
        return {"type": "adam", **self.__dict__}


@dataclass(frozen=True)
class DimuonParams:
    """Tinker's DimuonParams (one step of the Dimuon optimizer, chosen at model creation), with its
    defaults: a step that leaves a field out gets its default, never an earlier step's value. What
    each field does in Loraplex: docs/optimizers.md."""

    learning_rate: float  # no default: a step scale that fits AdamW does not fit Dimuon
    grad_clip_norm: float = 0.0  # <= 0 disables clipping
    beta1: float = 0.9
    damping: float = 1e-4
    rank_lr_correction_exponent: float = 0.175

    def to_json(self) -> dict:
        return {"type": "dimuon", **self.__dict__}


# the optimizers a model can be created with: Tinker's optimizer_config "type"
OPTIMIZERS = ("adamw", "dimuon")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


# Tinker's sampling defaults, defined once: the server's validation and its sampling jobs take them from here.
SAMPLING_DEFAULTS = SamplingParams()


@dataclass(frozen=True)
class ForwardBackwardOutput:
    loss_fn_outputs: list[dict[str, np.ndarray]]  # per datum, e.g. {"logprobs": array}
    metrics: dict[str, float]
    loss_fn_output_type: str = "ArrayRecord"

    def __repr__(self) -> str:
        return f"ForwardBackwardOutput({len(self.loss_fn_outputs)} datums, metrics={self.metrics})"


@dataclass(frozen=True)
class OptimStepResponse:
    metrics: dict[str, float] = field(default_factory=dict)


def format_sequence_id(prefix: str, index: int, policy_version: int | None) -> str:
    """A sampled sequence's id, `<prefix>:<index>@v<optimizer steps>` (`@base`: the base model), so async
    RL reads the policy version that produced a sample from its id alone."""
    return f"{prefix}:{index}@{'base' if policy_version is None else f'v{policy_version}'}"


def policy_version_of(sequence_id: str) -> int | None:
    """The policy version a sequence id names (None: the base model, or an id of another format)."""
    tag = sequence_id.rpartition("@")[2]
    return int(tag[1:]) if tag.startswith("v") and tag[1:].isdigit() else None


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    sequence_id: str
    topk_logprobs: list[list[tuple[int, float]] | None] | None = None

    @property
    def policy_version(self) -> int | None:
        """Optimizer steps of the adapter snapshot that sampled this (None: the base model)."""
        return policy_version_of(self.sequence_id)

    def __repr__(self) -> str:
        return (f"SampledSequence({len(self.tokens)} tokens, stop_reason={self.stop_reason!r}, "
                f"policy_version={self.policy_version})")


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_cache_hit_tokens: int = 0


def _known(cls, d: dict) -> dict:
    """The entries of `d` that are fields of `cls` (a newer server may answer more)."""
    return {f.name: d[f.name] for f in fields(cls) if f.name in d}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as the REST API answers it; the server builds its answers from this same type."""

    checkpoint_id: str
    checkpoint_type: str  # "training" or "sampler"
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    time: str | None = None  # ISO 8601, UTC
    expires_at: str | None = None
    user_metadata: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Checkpoint":
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class TrainingRun:
    """A training run as the REST API answers it; the server builds its answers from this same type."""

    training_run_id: str
    base_model: str
    lora_rank: int | None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict | None = None
    model_owner: str | None = None
    is_lora: bool = True
    corrupted: bool = False
    last_request_time: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TrainingRun":
        known = _known(cls, d)
        for name in ("last_checkpoint", "last_sampler_checkpoint"):
            if known.get(name):
                known[name] = Checkpoint.from_json(known[name])
        return cls(**known)


@dataclass(frozen=True)
class TrainingRunsResponse:
    """A page of `RestClient.list_training_runs` (tinker's shape): the runs and the server's cursor."""

    training_runs: list[TrainingRun]
    cursor: dict | None = None


@dataclass(frozen=True)
class CheckpointsListResponse:
    """A page of `RestClient.list_user_checkpoints` (tinker's shape)."""

    checkpoints: list[Checkpoint]
    cursor: dict | None = None
