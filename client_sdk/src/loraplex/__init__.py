"""Loraplex client SDK: train and sample LoRA adapters on a Loraplex server from a notebook.

The names are Tinker's, so a notebook ports by changing one import::

    import loraplex
    from loraplex import types

    service = loraplex.ServiceClient()          # LORAPLEX_BASE_URL / LORAPLEX_API_KEY, or arguments
    training = service.create_lora_training_client("loraplex/tiny", rank=8)
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    sampler = training.save_weights_and_get_sampling_client()
    sampler.sample(prompt, num_samples=4, sampling_params=types.SamplingParams(max_tokens=32)).result()

Every call returns an APIFuture (`.result()` or `await`); every method has an `_async` twin.
:mod:`loraplex.wire` holds the wire format, shared with the server. `pull_tokenizer(base_url, api_key,
model)` (console script: `loraplex tokenizer pull MODEL`) puts a base model's tokenizer into the local
Hugging Face cache, for loaders that take a hub id (tinker's `get_tokenizer()`, tinker-cookbook).
`RolloutsClient(service)` reads the rollout store (what harnesses sampled through the server's
OpenAI-compatible API) and turns trajectories into datums (:mod:`loraplex.rollouts`).
"""

__version__ = "0.1.0"

from loraplex import types  # noqa: E402
from loraplex.errors import (  # noqa: E402
    APIConnectionError, APIStatusError, AuthenticationError, BadRequestError, InternalServerError, LoraplexError,
    NotFoundError, PermissionDeniedError, RateLimitError, RequestFailedError,
)
from loraplex.futures import APIFuture  # noqa: E402
from loraplex.rest_client import RestClient  # noqa: E402
from loraplex.rl import check_sequence_extension, prefix_overlap  # noqa: E402
from loraplex.rollouts import RolloutsClient, Trajectory, TrajectoryDatums, trajectory_datums  # noqa: E402
from loraplex.sampling_client import SamplingClient  # noqa: E402
from loraplex.service_client import ServiceClient  # noqa: E402
from loraplex.tokenizers import PulledTokenizer, pull_tokenizer  # noqa: E402
from loraplex.training_client import SaveWeightsResponse, TrainingClient  # noqa: E402
from loraplex.types import (  # noqa: E402
    AdamParams, Datum, DimuonParams, ModelInput, SampledSequence, SampleResponse, SamplingParams, TensorData,
)

__all__ = [
    "APIConnectionError", "APIFuture", "APIStatusError", "AdamParams", "AuthenticationError", "BadRequestError",
    "Datum", "DimuonParams", "InternalServerError", "LoraplexError", "ModelInput", "NotFoundError", "PermissionDeniedError",
    "PulledTokenizer", "RateLimitError", "RequestFailedError", "RestClient", "RolloutsClient", "SampleResponse",
    "SampledSequence", "SamplingClient", "SamplingParams", "SaveWeightsResponse", "ServiceClient", "TensorData",
    "TrainingClient", "Trajectory", "TrajectoryDatums", "check_sequence_extension", "prefix_overlap",
    "pull_tokenizer", "trajectory_datums", "types",
]
