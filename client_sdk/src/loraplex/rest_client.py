"""RestClient: training runs, checkpoints and samplers; checkpoint download as a PEFT folder."""

from __future__ import annotations

import asyncio
import io
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from loraplex.types import Checkpoint, TrainingRun

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

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> list[TrainingRun]:
        runs = self.service.call("GET", f"/training_runs?limit={limit}&offset={offset}")["training_runs"]
        return [TrainingRun.from_json(r) for r in runs]

    def get_training_run(self, run_id: str) -> TrainingRun:
        return TrainingRun.from_json(self.service.call("GET", f"/training_runs/{run_id}"))

    def list_checkpoints(self, run_id: str | None = None) -> list[Checkpoint]:
        path = f"/training_runs/{run_id}/checkpoints" if run_id else "/checkpoints"
        return [Checkpoint.from_json(c) for c in self.service.call("GET", path)["checkpoints"]]

    def delete_checkpoint(self, tinker_path: str) -> None:
        run, checkpoint = _split(tinker_path)
        self.service.call("DELETE", f"/training_runs/{run}/checkpoints/{checkpoint}")

    def publish_checkpoint(self, tinker_path: str) -> None:
        run, checkpoint = _split(tinker_path)
        self.service.call("POST", f"/training_runs/{run}/checkpoints/{checkpoint}/publish")

    def unpublish_checkpoint(self, tinker_path: str) -> None:
        run, checkpoint = _split(tinker_path)
        self.service.call("DELETE", f"/training_runs/{run}/checkpoints/{checkpoint}/publish")

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


for _name in ("list_training_runs", "get_training_run", "list_checkpoints", "delete_checkpoint", "publish_checkpoint",
              "unpublish_checkpoint", "set_checkpoint_ttl", "get_sampler", "download_checkpoint"):
    setattr(RestClient, f"{_name}_async", _async_twin(_name))
