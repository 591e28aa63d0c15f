"""TrainingClient: one LoRA training run (forward, forward_backward, optim_step, save and load)."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np

from loraplex._seq import Counter
from loraplex.futures import APIFuture, json_result, retrieve
from loraplex.types import AdamParams, Datum, DimuonParams, ForwardBackwardOutput, OptimStepResponse
from loraplex.wire.client import decode_forward_backward_output, encode_forward_backward_request
from loraplex.wire.codec import PROTOBUF

if TYPE_CHECKING:
    from loraplex.sampling_client import SamplingClient
    from loraplex.service_client import ServiceClient


@dataclass(frozen=True)
class SaveWeightsResponse:
    path: str


class TrainingClient:
    def __init__(self, service: "ServiceClient", model_id: str, base_model: str, next_seq_id: int = 1):
        self.service = service
        self.model_id = model_id
        self.base_model = base_model
        self._seq = Counter(next_seq_id)  # seq_id 0 was the create (or create-via-load)

    def __repr__(self) -> str:
        return f"TrainingClient({self.model_id!r}, base_model={self.base_model!r})"

    @property
    def _transport(self):
        return self.service.transport

    # --- forward / backward ----------------------------------------------------------------------

    def forward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: dict[str, Any] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Logprobs (and the loss) under the current weights; no gradients."""
        return self._forward_backward(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, Any] | None = None) -> APIFuture[ForwardBackwardOutput]:
        """Accumulate the gradient of the summed loss; `optim_step` applies it."""
        return self._forward_backward(data, loss_fn, loss_fn_config, forward_only=False)

    def _forward_backward(self, data, loss_fn, loss_fn_config, forward_only, seq_id: int | None = None
                          ) -> APIFuture[ForwardBackwardOutput]:
        body = encode_forward_backward_request(
            self.model_id, self._seq.next() if seq_id is None else seq_id,
            [(d.model_input.to_ints(), d.arrays()) for d in data], loss_fn, loss_fn_config, forward_only,
        )
        kind = "Forward" if forward_only else "ForwardBackward"
        return APIFuture(self._transport, self._post_proto(body, kind), f"{kind.lower()} ({len(data)} datums)")

    async def _post_proto(self, body: bytes, kind: str) -> ForwardBackwardOutput:
        headers = {"Content-Type": PROTOBUF, "Content-Encoding": "zstd"}  # forward_only travels in the body
        accepted = (await self._transport.request("POST", "/forward_backward", content=body, headers=headers)).json()
        outputs, metrics, output_type = await retrieve(
            self._transport, accepted["request_id"], kind, lambda raw, _: decode_forward_backward_output(raw))
        return ForwardBackwardOutput(outputs, metrics, output_type)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: Callable[[Sequence[Datum], list], tuple[Any, dict[str, float]]],
    ) -> APIFuture[ForwardBackwardOutput]:
        """A loss computed here, in torch, from the server's logprobs: `loss_fn(data, logprobs)`
        returns (loss tensor, metrics). Its gradient reaches the weights through the linear
        surrogate sum(-dloss/dlogprobs * logprobs) (cross_entropy with those weights)."""
        if importlib.util.find_spec("torch") is None:
            raise ImportError("forward_backward_custom needs torch (pip install torch)")
        seq_ids = self._seq.next(), self._seq.next()  # both now: calls made after this one run after it
        return APIFuture(self._transport, self._custom(list(data), loss_fn, seq_ids),
                         f"forward_backward_custom ({len(data)} datums)")

    async def _custom(self, data: list[Datum], loss_fn, seq_ids: tuple[int, int]) -> ForwardBackwardOutput:
        import torch

        forward = await self._forward_backward(data, "cross_entropy", None, True, seq_ids[0])
        logprobs = [torch.tensor(o["logprobs"], dtype=torch.float32, requires_grad=True) for o in forward.loss_fn_outputs]
        try:
            loss, metrics = loss_fn(data, logprobs)
            grads = torch.autograd.grad(loss, logprobs, allow_unused=True)
        except Exception:
            # the server waits for every seq_id in order: fill the reserved one with a no-op
            await self._forward_backward(data, "cross_entropy", None, True, seq_ids[1])
            raise
        surrogate = [
            Datum(d.model_input, {"target_tokens": d.arrays()["target_tokens"],
                                  "weights": (-(g if g is not None else torch.zeros_like(lp))).numpy().astype(np.float32)})
            for d, lp, g in zip(data, logprobs, grads)
        ]
        result = await self._forward_backward(surrogate, "cross_entropy", None, False, seq_ids[1])
        return ForwardBackwardOutput(result.loss_fn_outputs,
                                     {**result.metrics, **metrics, "loss:sum": float(loss.detach())}, result.loss_fn_output_type)

    # --- optimizer, save, load -------------------------------------------------------------------

    def optim_step(self, params: AdamParams | DimuonParams | None = None) -> APIFuture[OptimStepResponse]:
        """One step of the optimizer the model was created with; `params` of that optimizer's kind."""
        key = "optimizer_params" if isinstance(params, DimuonParams) else "adam_params"
        return self._json_request("optim_step", {key: (params or AdamParams()).to_json()},
                                  lambda r: OptimStepResponse(r.get("metrics", {})), "optim_step")

    def _json_request(self, kind: str, fields: dict[str, Any], convert: Callable[[dict], Any],
                      description: str) -> APIFuture:
        """POST one of the model's JSON requests (it takes the next seq_id now: calls run in the order they
        are made) to /<kind>; the future of its result, `convert`ed. model_id and seq_id go first: the
        server finds them in the first bytes of a body too large to read whole (its refusal passes the seq_id)."""
        body = {"model_id": self.model_id, "seq_id": self._seq.next(), **fields, "type": kind}
        request_type = "".join(word.title() for word in kind.split("_"))  # save_weights -> SaveWeights
        return APIFuture(self._transport, self._json_call(f"/{kind}", body, request_type, convert), description)

    async def _json_call(self, path: str, body: dict, kind: str, convert):
        accepted = (await self._transport.request("POST", path, json=body)).json()
        return convert(await retrieve(self._transport, accepted["request_id"], kind, json_result))

    def save_state(self, name: str, ttl_seconds: int | None = None) -> APIFuture[SaveWeightsResponse]:
        """Weights, Adam moments and step, as tinker://<model>/weights/<name>."""
        return self._json_request("save_weights", {"path": name, "ttl_seconds": ttl_seconds},
                                  lambda r: SaveWeightsResponse(r["path"]), f"save_state {name}")

    def load_state(self, path: str, *, with_optimizer: bool = False) -> APIFuture[dict]:
        return self._json_request("load_weights", {"path": path, "optimizer": with_optimizer}, dict,
                                  f"load_state {path}")

    def load_state_with_optimizer(self, path: str) -> APIFuture[dict]:
        return self.load_state(path, with_optimizer=True)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> APIFuture[SaveWeightsResponse]:
        """A PEFT snapshot, tinker://<model>/sampler_weights/<name>, for samplers and download."""
        return self._json_request("save_weights_for_sampler", {"path": name, "ttl_seconds": ttl_seconds},
                                  lambda r: SaveWeightsResponse(r["path"]), f"save {name}")

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> "SamplingClient":
        """A sampler of the weights as of now; training can go on while it samples them."""
        from loraplex.sampling_client import SamplingClient

        if name is not None:
            path = self.save_weights_for_sampler(name).result().path
            return self.service.create_sampling_client(model_path=path)
        sampler_seq = self.service.next_sampling_seq()
        result = self._json_request("save_weights_for_sampler", {"sampling_session_seq_id": sampler_seq}, dict,
                                    "snapshot for sampling").result()
        return SamplingClient(self.service, result["sampling_session_id"], self.base_model)

    def create_sampling_client(self, model_path: str) -> "SamplingClient":
        """A sampler of saved weights (tinker://.../sampler_weights/...), as tinker's TrainingClient has it."""
        return self.service.create_sampling_client(model_path=model_path)

    def get_info(self) -> dict:
        return self.service.call("POST", "/get_info", {"model_id": self.model_id, "type": "get_info"})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> dict:
        """Store numbers only the client knows (rewards, evals) with this run, charted by the service's
        dashboard beside its own (docs/dashboard.md): up to 64 names of 1..128 characters from
        `A-Za-z0-9_./:-`, finite values. `step`: the optimizer step they belong to (None: the run's
        step now, as the server has it). Logging a name again at a step replaces its value."""
        values = {}
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise ValueError(f"metrics[{name!r}]: must be a finite number, got {value!r}")
            values[name] = float(value)
        return self.service.call("POST", f"/training_runs/{quote(self.model_id, safe=':')}/metrics",
                                 {"metrics": values, "step": step})

    def get_tokenizer(self):
        """The base model's tokenizer (needs transformers), pulled from the server into the local
        Hugging Face cache under its hub id if it is not there yet (loraplex.tokenizers)."""
        from loraplex.tokenizers import load_tokenizer

        return load_tokenizer(self.service.config, self.get_info()["model_data"]["tokenizer_id"])

    # --- async twins: the same calls, awaitable from an event loop --------------------------------

    async def forward_async(self, *args, **kwargs) -> APIFuture[ForwardBackwardOutput]:
        return self.forward(*args, **kwargs)

    async def forward_backward_async(self, *args, **kwargs) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward(*args, **kwargs)

    async def forward_backward_custom_async(self, *args, **kwargs) -> APIFuture[ForwardBackwardOutput]:
        return self.forward_backward_custom(*args, **kwargs)

    async def optim_step_async(self, *args, **kwargs) -> APIFuture[OptimStepResponse]:
        return self.optim_step(*args, **kwargs)

    async def save_state_async(self, *args, **kwargs) -> APIFuture[SaveWeightsResponse]:
        return self.save_state(*args, **kwargs)

    async def load_state_async(self, *args, **kwargs) -> APIFuture[dict]:
        return self.load_state(*args, **kwargs)

    async def save_weights_for_sampler_async(self, *args, **kwargs) -> APIFuture[SaveWeightsResponse]:
        return self.save_weights_for_sampler(*args, **kwargs)

    async def log_metrics_async(self, metrics: Mapping[str, float], step: int | None = None) -> dict:
        import asyncio

        return await asyncio.to_thread(self.log_metrics, metrics, step)

    async def create_sampling_client_async(self, model_path: str) -> "SamplingClient":
        import asyncio

        return await asyncio.to_thread(self.create_sampling_client, model_path)

    async def save_weights_and_get_sampling_client_async(self, name: str | None = None) -> "SamplingClient":
        import asyncio

        return await asyncio.to_thread(self.save_weights_and_get_sampling_client, name)

