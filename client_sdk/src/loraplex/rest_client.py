"""RestClient: training runs, checkpoints and samplers; checkpoint download as a PEFT folder.

The calls that tinker's RestClient answers with a future (listing runs and a user's checkpoints,
publishing) answer with one here too, under tinker's names, so code written for either runs on both."""

from __future__ import annotations

import asyncio
import io
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from loraplex.futures import APIFuture
from loraplex.types import Checkpoint, CheckpointsListResponse, TrainingRun, TrainingRunsResponse

if TYPE_CHECKING:
    from loraplex.service_client import ServiceClient


def _split(tinker_path: str) -> tuple[str, str]:
    """tinker://<run>/<kind>/<name> -> (run, "<kind>/<name>")."""
    parts = tinker_path.removeprefix("tinker://").split("/")
    if not tinker_path.startswith("tinker://") or len(parts) != 3:
        raise ValueError(f"tinker_path: expected tinker://<run_id>/<kind>/<name>, got {tinker_path!r}")
    return parts[0], f"{parts[1]}/{parts[2]}"


class RestClient:
    def __init__(self, service: "ServiceClient") -> None:
        self.service = service

    def _future(self, method: str, path: str, convert, description: str) -> APIFuture:
        async def call():
            return convert(await self.service._call(method, path))
        return APIFuture(self.service.transport, call(), description)

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> APIFuture[TrainingRunsResponse]:
        """The tenant's runs, newest first: a future (`.result()`, or await it), as tinker's."""
        return self._future("GET", f"/training_runs?limit={limit}&offset={offset}", lambda r: TrainingRunsResponse(
            [TrainingRun.from_json(run) for run in r["training_runs"]], r.get("cursor")), "list_training_runs")

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        """Every checkpoint of the tenant's runs: a future, as tinker's."""
        return self._future("GET", f"/checkpoints?limit={limit}&offset={offset}", lambda r: CheckpointsListResponse(
            [Checkpoint.from_json(c) for c in r["checkpoints"]], r.get("cursor")), "list_user_checkpoints")

    def get_training_run(self, run_id: str) -> TrainingRun:
        return TrainingRun.from_json(self.service.call("GET", f"/training_runs/{run_id}"))

    def list_checkpoints(self, run_id: str | None = None) -> list[Checkpoint]:
        path = f"/training_runs/{run_id}/checkpoints" if run_id else "/checkpoints"
        return [Checkpoint.from_json(c) for c in self.service.call("GET", path)["checkpoints"]]

    def delete_checkpoint(self, tinker_path: str) -> None:
        run, checkpoint = _split(tinker_path)
        self.service.call("DELETE", f"/training_runs/{run}/checkpoints/{checkpoint}")

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Make the checkpoint readable by other tenants: a future, as tinker's."""
        run, checkpoint = _split(tinker_path)
        return self._future("POST", f"/training_runs/{run}/checkpoints/{checkpoint}/publish", lambda r: None,
                            f"publish {tinker_path}")

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        run, checkpoint = _split(tinker_path)
        return self._future("DELETE", f"/training_runs/{run}/checkpoints/{checkpoint}/publish", lambda r: None,
                            f"unpublish {tinker_path}")

    def set_checkpoint_ttl(self, tinker_path: str, ttl_seconds: int | None) -> None:
        run, checkpoint = _split(tinker_path)
        self.service.call("PUT", f"/training_runs/{run}/checkpoints/{checkpoint}/ttl", {"ttl_seconds": ttl_seconds})

    def get_sampler(self, sampler_id: str) -> dict:
        """{"sampler_id", "base_model", "model_path", "policy_version"}."""
        return self.service.call("GET", f"/samplers/{sampler_id}")

    def download_checkpoint(self, tinker_path: str, dest: str | Path) -> Path:
        """Write the checkpoint's adapter to `dest` as a PEFT folder (adapter_config.json +
        adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads."""
        run, checkpoint = _split(tinker_path)
        buffer = io.BytesIO()
        with tqdm(desc=f"downloading {checkpoint}", unit="B", unit_scale=True, disable=None) as bar:
            def write(chunk: bytes, total: int | None) -> None:
                bar.total = total
                buffer.write(chunk)
                bar.update(len(chunk))

            transport = self.service.transport
            transport.run(transport.stream_to(f"/training_runs/{run}/checkpoints/{checkpoint}/archive", write)).result()
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            buffer.seek(0)
            with tarfile.open(fileobj=buffer, mode="r:gz") as archive:
                archive.extractall(tmp, filter="data")
            if dest.exists():
                raise FileExistsError(f"dest: {dest} exists")
            Path(tmp, "adapter").rename(dest)
        return dest


def _async_twin(name: str):
    async def twin(self, *args, **kwargs):
        return await asyncio.to_thread(getattr(self, name), *args, **kwargs)
    twin.__name__ = twin.__qualname__ = f"{name}_async"
    twin.__doc__ = f"`{name}`, awaitable (runs in a worker thread)."
    return twin


def _async_result(name: str):
    async def twin(self, *args, **kwargs):
        return await getattr(self, name)(*args, **kwargs)  # an APIFuture is awaitable
    twin.__name__ = twin.__qualname__ = f"{name}_async"
    twin.__doc__ = f"`{name}`, awaited: its result."
    return twin


for _name in ("get_training_run", "list_checkpoints", "delete_checkpoint", "set_checkpoint_ttl", "get_sampler",
              "download_checkpoint"):
    setattr(RestClient, f"{_name}_async", _async_twin(_name))
for _name in ("list_training_runs", "list_user_checkpoints", "publish_checkpoint_from_tinker_path",
              "unpublish_checkpoint_from_tinker_path"):
    setattr(RestClient, f"{_name}_async", _async_result(_name))
