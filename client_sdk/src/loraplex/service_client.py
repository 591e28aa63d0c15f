"""ServiceClient: the entry point. One client session; it creates training and sampling clients."""

from __future__ import annotations

import asyncio
from typing import Any

from loraplex import __version__
from loraplex._transport import Transport
from loraplex.config import ClientConfig
from loraplex._seq import Counter
from loraplex.futures import APIFuture, json_result, retrieve
from loraplex.rest_client import RestClient
from loraplex.sampling_client import SamplingClient
from loraplex.training_client import TrainingClient
from loraplex.types import DEFAULT_LORA_RANK


class ServiceClient:
    """`ServiceClient(base_url=None, api_key=None)`: arguments, else LORAPLEX_BASE_URL /
    LORAPLEX_API_KEY, else ~/.config/loraplex/config.toml. `retry_seconds`: how long a call is retried
    while the server is unreachable or answers 408, 429 or 5xx (the first retry is logged at once)."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 user_metadata: dict[str, str] | None = None, timeout: float = 60.0,
                 retry_seconds: float = 120.0) -> None:
        self.config = ClientConfig.resolve(base_url, api_key)
        self.transport = Transport(self.config, timeout=timeout, retry_seconds=retry_seconds)
        body = {"tags": [], "user_metadata": user_metadata or {}, "sdk_version": f"loraplex-{__version__}",
                "type": "create_session"}
        self.session_id: str = self.call("POST", "/create_session", body)["session_id"]
        self._model_seq = Counter()
        self._sampling_seq = Counter()

    def __repr__(self) -> str:
        return f"ServiceClient({self.config.base_url!r}, session={self.session_id!r})"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """A synchronous JSON call (retried while transient)."""
        return self.transport.run(self._call(method, path, body)).result()

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        return (await self.transport.request(method, path, json=body)).json()

    def next_sampling_seq(self) -> int:
        """Sampling sessions and ephemeral snapshots share one counter per session."""
        return self._sampling_seq.next()

    def get_server_capabilities(self) -> list[dict]:
        return self.call("GET", "/get_server_capabilities")["supported_models"]

    def create_lora_training_client(self, base_model: str, rank: int = DEFAULT_LORA_RANK, *, seed: int | None = None,
                                    alpha: float | None = None, train_mlp: bool = True, train_attn: bool = True,
                                    train_unembed: bool = True, user_metadata: dict | None = None) -> TrainingClient:
        """A new LoRA adapter on `base_model` and its training client."""
        lora = {"rank": rank, "seed": seed, "alpha": alpha, "train_mlp": train_mlp, "train_attn": train_attn,
                "train_unembed": train_unembed}
        body = {"session_id": self.session_id, "model_seq_id": self._model_seq.next(), "base_model": base_model,
                "lora_config": {k: v for k, v in lora.items() if v is not None}, "user_metadata": user_metadata,
                "type": "create_model"}
        result = APIFuture(self.transport, self._create("/create_model", body, "CreateModel"), "create_model").result()
        return TrainingClient(self, result["model_id"], base_model)

    def create_training_client_from_state(self, path: str, *, with_optimizer: bool = False) -> TrainingClient:
        """A new training run starting from a saved training state (tinker://.../weights/...)."""
        body = {"session_id": self.session_id, "model_seq_id": self._model_seq.next(), "path": path,
                "optimizer": with_optimizer, "type": "load_weights"}
        result = APIFuture(self.transport, self._create("/load_weights", body, "LoadWeights"), "load_weights").result()
        info = self.call("POST", "/get_info", {"model_id": result["model_id"], "type": "get_info"})
        return TrainingClient(self, result["model_id"], info["model_name"])

    async def _create(self, path: str, body: dict, kind: str) -> dict:
        accepted = await self._call("POST", path, body)
        return await retrieve(self.transport, accepted["request_id"], kind, json_result)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """A sampler of a saved snapshot (tinker://.../sampler_weights/...) or of a base model."""
        if (model_path is None) == (base_model is None):
            raise ValueError("model_path or base_model: give exactly one")
        body = {"session_id": self.session_id, "sampling_session_seq_id": self.next_sampling_seq(),
                "base_model": base_model, "model_path": model_path, "type": "create_sampling_session"}
        sampler_id = self.call("POST", "/create_sampling_session", body)["sampling_session_id"]
        info = self.call("GET", f"/samplers/{sampler_id}")
        return SamplingClient(self, sampler_id, info["base_model"], model_path)

    def create_rest_client(self) -> RestClient:
        return RestClient(self)

    async def create_lora_training_client_async(self, *args, **kwargs) -> TrainingClient:
        return await asyncio.to_thread(self.create_lora_training_client, *args, **kwargs)

    async def create_sampling_client_async(self, *args, **kwargs) -> SamplingClient:
        return await asyncio.to_thread(self.create_sampling_client, *args, **kwargs)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
