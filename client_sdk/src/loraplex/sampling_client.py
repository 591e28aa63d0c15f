"""SamplingClient: sample from one adapter snapshot (or the base model), and score prompts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex._seq import Counter
from loraplex.futures import APIFuture, retrieve
from loraplex.types import ModelInput, SampledSequence, SampleResponse, SamplingParams
from loraplex.wire.client import decode_sample_response

if TYPE_CHECKING:
    from loraplex.service_client import ServiceClient


class SamplingClient:
    def __init__(self, service: "ServiceClient", sampler_id: str, base_model: str, model_path: str | None = None):
        self.service = service
        self.sampler_id = sampler_id
        self.base_model = base_model
        self.model_path = model_path
        self._seq = Counter()

    def __repr__(self) -> str:
        return f"SamplingClient({self.sampler_id!r}, base_model={self.base_model!r}, model_path={self.model_path!r})"

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None, *,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
               topk_sample_logprobs: int = 0) -> APIFuture[SampleResponse]:
        """Sample `num_samples` continuations of `prompt`; each sequence carries its policy version."""
        body = {
            "sampling_session_id": self.sampler_id, "seq_id": self._seq.next(), "num_samples": num_samples,
            "prompt": prompt.to_json(), "sampling_params": (sampling_params or SamplingParams()).to_json(),
            "prompt_logprobs": include_prompt_logprobs, "topk_prompt_logprobs": topk_prompt_logprobs,
            "topk_sample_logprobs": topk_sample_logprobs, "type": "sample",
        }
        return APIFuture(self.service.transport, self._sample(body), f"sample ({num_samples} x {prompt.length} tokens)")

    async def _sample(self, body: dict) -> SampleResponse:
        transport = self.service.transport
        accepted = (await transport.request("POST", "/asample", json=body,
                                            headers={"X-Tinker-Sampling-Backpressure": "1"})).json()
        decoded = await retrieve(transport, accepted["request_id"], "Sample", lambda raw, _: decode_sample_response(raw))
        sequences = [SampledSequence(list(s.tokens), list(s.logprobs), s.stop_reason, sid, s.topk_logprobs)
                     for s, sid in zip(decoded["sequences"], accepted["sample_sequence_ids"])]
        return SampleResponse(sequences, decoded["prompt_logprobs"], decoded["topk_prompt_logprobs"],
                              decoded["prompt_cache_hit_tokens"])

    def get_tokenizer(self):
        """The base model's tokenizer, as TrainingClient.get_tokenizer (pulled into the local cache)."""
        from loraplex.tokenizers import load_tokenizer

        return load_tokenizer(self.service.config, self.base_model)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """log p(token i | tokens before it) for every prompt position (None at position 0)."""
        return APIFuture(self.service.transport, self._logprobs(prompt), f"logprobs of {prompt.length} tokens")

    async def _logprobs(self, prompt: ModelInput) -> list[float | None]:
        body = {"sampling_session_id": self.sampler_id, "seq_id": self._seq.next(), "num_samples": 1,
                "prompt": prompt.to_json(), "sampling_params": {"max_tokens": 1}, "prompt_logprobs": True,
                "type": "sample"}
        return (await self._sample(body)).prompt_logprobs

    async def sample_async(self, *args, **kwargs) -> APIFuture[SampleResponse]:
        return self.sample(*args, **kwargs)

    async def compute_logprobs_async(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        return self.compute_logprobs(prompt)
