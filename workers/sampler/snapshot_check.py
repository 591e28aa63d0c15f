"""What the sampler checks in a snapshot folder before vLLM loads it, and how a refusal is worded.

1. Integrity: every file must match the SHA-256 its manifest recorded when save_weights_for_sampler
   wrote it (storage/checkpoint_files.py). A finite change to `lora_B` bytes otherwise changed
   the greedy tokens without any error. A mismatch is the service's storage's fault ("server").
2. Finite weights: a snapshot holding NaN or inf is not sampled: its rows would only hold garbage,
   and NaN left in the KV cache blocks it used reached other tenants' later requests through vLLM's
   CPU attention (seen with the tiny model: a base request's prompt logprobs turned NaN). If the
   file matches its manifest the weights were saved that way, i.e. the training run diverged (the
   tenant's problem: "user"); if it does not, the file is corrupt and the message says so.
Both are checked once per load (a SmolLM2 rank-16 snapshot: about 30 ms for the NaN scan).
"""

from __future__ import annotations

from pathlib import Path

from contract.errors import EngineError, InvalidInputError
from storage.checkpoint_files import PEFT_WEIGHTS, snapshot_integrity

FIELD = "sampling_session_id"


class SnapshotCorruptError(EngineError):
    """A snapshot file that differs from what was saved (category "server")."""


def first_non_finite(weights: Path) -> str | None:
    """The name of the first tensor in a safetensors file holding NaN or inf, or None."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():
            if not f.get_tensor(name).isfinite().all():
                return name
    return None


def check_snapshot(folder: Path) -> None:
    """Raise SnapshotCorruptError or InvalidInputError if the snapshot must not be sampled."""
    failed = snapshot_integrity(folder)  # None: written before snapshots had a manifest
    weights = folder / PEFT_WEIGHTS
    non_finite, unreadable = None, None
    if weights.exists() and (not failed or PEFT_WEIGHTS in failed):
        try:
            non_finite = first_non_finite(weights)
        except Exception as e:  # a header or size that does not parse: only corruption does that
            unreadable = f"{PEFT_WEIGHTS} cannot be read ({e})"
    if failed:
        found = f"; {PEFT_WEIGHTS} holds NaN or inf in tensor {non_finite}" if non_finite else ""
        raise SnapshotCorruptError(
            f"{FIELD}: the sampler snapshot's file {', '.join(failed)} failed its SHA-256 check: its bytes differ "
            f"from what save_weights_for_sampler wrote, so the file is corrupt{found}. Save the weights for the "
            f"sampler again and sample from the new snapshot")
    if unreadable:
        raise SnapshotCorruptError(f"{FIELD}: the sampler snapshot is corrupt: {unreadable}")
    if non_finite:
        cause = ("the file matches the SHA-256 it was saved with, so the weights themselves are non-finite: the "
                 "training run diverged (sample an earlier snapshot, or train on with a lower learning rate)"
                 if failed == [] else "the snapshot has no manifest (it was saved before snapshots had one), so "
                 "whether the training run diverged or the file was corrupted cannot be told")
        raise InvalidInputError(FIELD, f"tensor {non_finite} of the snapshot's file {PEFT_WEIGHTS} holds NaN or inf: "
                                       f"{cause}")
