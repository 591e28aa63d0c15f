"""The base models one API serves, each with the scheduler that trains its runs and the sampler that
samples it. A server started with one base model holds one; `--base-model a --base-model b` holds
several, side by side in one deployment (docs/models.md#several-base-models).

Every request is answered by the served model it concerns: a new run or sampler by the base_model
it names, everything after by the base model stored with its run, sampler or checkpoint (its hub id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from sqlalchemy.orm import Session

from api.lookups import checkpoint_base_model
from db.models import Checkpoint
from models.registry import ModelInfo, hub_id, names_of


@dataclass(frozen=True)
class ServedModel:
    info: ModelInfo
    scheduler: Any  # anything with .submit(QueuedRequest): a SchedulerService, or the Redis inbox to one
    sampling: Any | None = None  # SamplingDispatcher or RemoteSampling; None where this model is not sampled
    sampling_unavailable: str = ""  # why `sampling` is None
    # what streams its samples and aborts them where `sampling` does not (a distributed API replica's
    # RemoteStreams, messaging/remote_streams.py); None: `sampling` does, or nothing does
    streams: Any | None = None

    @property
    def name(self) -> str:
        return self.info.name

    def require_sampling(self):
        """The sampler, or a 400 naming why this model cannot be sampled here."""
        if self.sampling is None:
            raise HTTPException(400, f"sampling is not available for {self.name}: {self.sampling_unavailable}")
        return self.sampling


class ServedModels:
    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("a server serves at least one base model")
        self.all = tuple(models)
        self._by_name = {model.name: model for model in self.all}

    @property
    def default(self) -> ServedModel:
        """The first one named: what a request that names no base model gets."""
        return self.all[0]

    def find(self, name: str) -> ServedModel | None:
        """The served model `name` names, by its hub id or an alias; None if none is served."""
        return self._by_name.get(hub_id(name))

    def named(self, name: str) -> ServedModel:
        """The served model a request's `base_model` names; a 400 naming what is served if none."""
        model = self.find(name)
        if model is None:
            raise HTTPException(400, f"base_model: {name[:200]!r} is not served here; served: {self.described()}")
        return model

    def stored(self, name: str, what: str = "model_id") -> ServedModel:
        """The served model of a run, sampler or checkpoint stored under base model `name` (its hub id).
        One this server no longer serves (restarted with other --base-model) is a 400, not a crash."""
        model = self.find(name)
        if model is None:
            raise HTTPException(400, f"{what}: its base model {name[:200]!r} is not served here; served: "
                                     f"{self.described()}")
        return model

    def of_checkpoint(self, db: Session, checkpoint: Checkpoint, field: str) -> ServedModel:
        """The served model a checkpoint was trained on (its run's); 404 naming `field` if the run is gone."""
        base_model = checkpoint_base_model(db, checkpoint)
        if base_model is None:
            raise HTTPException(404, f"{field}: the run of {checkpoint.tinker_path!r} is gone")
        return self.stored(base_model, field)

    def described(self) -> str:
        """The served models' names, for an error: "'loraplex/tiny' (also named 'tiny'), ..."."""
        parts = []
        for model in self.all:
            name, *aliases = names_of(model.name)
            parts.append(repr(name) + (f" (also named {', '.join(map(repr, aliases))})" if aliases else ""))
        return ", ".join(parts)


def served(request: Request) -> ServedModels:
    return request.app.state.models
