"""Where a model's durable training state lives in the store, and reading it back (no torch).

Two "live" folders per model, `<live>/<model>` and `<live>/<model>.alt`, each a training-state
checkpoint whose manifest names the seq_id it reflects and the seq_id its history started at
(workers/trainer/live_state.py writes them and says why two). Reading and verifying them needs no
tensors: the scheduler's Celery executor (which state a worker will load) and the admin CLI read
them here without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contract.errors import EngineError
from storage import store
from storage.checkpoint_files import CheckpointError, read_manifest, verify_training_state

SLOTS = (("", "main copy"), (".alt", "alternate copy"))  # folder suffix, how errors name it
REPAIR = "loraplex-admin models rebuild"


class LiveStateError(EngineError):
    """A model's stored training state cannot be restored (category "server": the fault is the
    service's storage; the message says what was found and what the user or an operator can do)."""


@dataclass(frozen=True)
class Slot:
    path: str
    label: str
    manifest: dict | None  # None: missing or unreadable (not verified either way)

    @property
    def seq(self) -> int:
        return int(self.manifest.get("extra", {}).get("seq_id", -1)) if self.manifest else -1

    @property
    def lineage(self) -> int | None:
        """The seq_id of the create_model / load_weights its history starts at (None: written before
        manifests named it)."""
        return self.manifest.get("extra", {}).get("lineage_seq") if self.manifest else None

    def describe(self) -> str:
        return f"the {self.label} (after seq_id {self.seq})" if self.manifest else f"the {self.label}"


def slot_paths(live_dir: str | Path, model_id: str) -> tuple[str, str]:
    return tuple(store.join(live_dir, model_id + suffix) for suffix, _ in SLOTS)  # type: ignore[return-value]


def read_slots(live_dir: str | Path, model_id: str) -> list[Slot]:
    """Both slots, newest first by their manifests (which are not verified here); unreadable ones last."""
    slots = [Slot(path, label, read_manifest(path)) for path, (_, label) in zip(slot_paths(live_dir, model_id), SLOTS)]
    return sorted(slots, key=lambda s: (s.manifest is not None, s.seq, s.manifest.get("step", 0) if s.manifest else 0),
                  reverse=True)


def candidates(slots: list[Slot], problems: list[str]) -> list[Slot]:
    """The slots a model may be restored from, newest first: those with a manifest, down to the first
    whose history started elsewhere than the newest's (a state from before a load_weights is not a
    base for replaying the requests after it). What is wrong with the others goes to `problems`."""
    readable = [s for s in slots if s.manifest is not None]
    for slot in slots:
        if slot.manifest is None:
            found = "manifest.json is unreadable" if store.exists(slot.path) else "folder is missing"
            problems.append(f"{slot.describe()}: its {found}")
    usable = []
    for slot in readable:
        if usable and slot.lineage != readable[0].lineage:
            problems.append(f"{slot.describe()}: it predates the create_model or load_weights at seq_id "
                            f"{readable[0].lineage}, so the requests after it cannot be replayed onto it")
            break
        usable.append(slot)
    return usable


def newest_verified(live_dir: str | Path, model_id: str) -> tuple[Slot | None, list[str]]:
    """The newest slot whose tensors match their SHA-256, and what was wrong with the newer ones."""
    problems: list[str] = []
    for slot in candidates(read_slots(live_dir, model_id), problems):
        try:
            verify_training_state(slot.path)
        except CheckpointError as e:
            problems.append(f"{slot.describe()}: {e}")
            continue
        return slot, problems
    return None, problems


def cannot_restore(model_id: str, problems: list[str]) -> LiveStateError:
    found = "; ".join(problems) or "no stored state was found"
    return LiveStateError(
        f"the training state of model {model_id} cannot be restored: {found}. Its requests fail until it is "
        f"repaired: an operator can rebuild it from its last verified state or checkpoint and the requests after "
        f"it (`{REPAIR} {model_id}`), or you can continue from one of your saved checkpoints (load_state)")
