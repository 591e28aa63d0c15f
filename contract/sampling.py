"""A sampling job and its result: plain data, so the API can build jobs without importing vLLM.

A job names its adapter by the snapshot folder (immutable: every save writes a new one), never by
the training model, so a sampler keeps sampling exactly the weights it was created from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from loraplex.types import SAMPLING_DEFAULTS
from loraplex.wire.codec import SampledSequenceWire


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int
    temperature: float = SAMPLING_DEFAULTS.temperature
    top_k: int = SAMPLING_DEFAULTS.top_k  # -1: no limit
    top_p: float = SAMPLING_DEFAULTS.top_p
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # Tinker's `stop: []` disables every stop, EOS included
    # a grammar every sample follows: an xgrammar structural tag (JSON), vLLM's structured outputs
    # (the inference API's forced and strict tool calls, api/inference/tool_grammar.py); None: free
    structural_tag: str | None = None


@dataclass(frozen=True)
class SampleJob:
    request_id: str
    prompt: tuple[int, ...]
    num_samples: int
    options: SamplingOptions
    adapter_path: str | None = None  # a PEFT snapshot folder; None samples the base model
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None  # only the last n prompt positions are scored
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    # Tinker's distillation fields (workers/sampler/prompt_rows.py): the ids whose logprobs to return,
    # dense [len(prompt) - 1, K] (-1: skip), and the request's CSR layout (crow, col) when it came as CSR;
    # k draws per prompt position at the request's temperature
    target_prompt_ids: list[list[int]] | None = None
    target_prompt_csr: tuple[list[int], list[int]] | None = None
    prompt_alt_tokens_k: int = 0
    # record_stability_info: the sequence ids (as asample answered) to record the samples under, for
    # stable_reinforce (db/stability.py); empty: nothing is recorded
    recorded_sequence_ids: tuple[str, ...] = ()
    policy_version: int | None = None  # optimizer steps of the snapshot; None: the base model
    # the engine also reports each step's new tokens (SampleDelta) as it makes them (the API's
    # `stream: true`); the outcome is the same either way
    stream: bool = False
    # distributed mode: the Redis channel of the API replica that follows the stream (workers/sampler/
    # stream_channels.py); None: it is followed in this process
    stream_to: str | None = None
    # the hub id of the base model sampled, for a server serving several (api/served_models.py); None: its
    # first (a job stored before it said which)
    base_model: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "SampleJob":
        d = json.loads(raw)
        opts = d.pop("options")
        opts["stop_strings"], opts["stop_token_ids"] = tuple(opts["stop_strings"]), tuple(opts["stop_token_ids"])
        ids = tuple(d.pop("recorded_sequence_ids", ()))  # absent from jobs stored before it existed
        return cls(**{**d, "prompt": tuple(d["prompt"]), "options": SamplingOptions(**opts),
                      "recorded_sequence_ids": ids})


@dataclass(frozen=True)
class SampleDelta:
    """New tokens of one sample (choice `index`) from one engine step, with their logprobs and top-k
    rows (when the job asked for them). A sample's deltas, joined in order, are its final sequence."""

    index: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    topk_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


@dataclass
class SampleResult:
    sequences: list[SampledSequenceWire]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_cache_hit_tokens: int = 0
    topk: int | None = None  # width of the top-k tables
    target_prompt_logprobs: list[list[float]] | None = None  # dense, as SampleJob.target_prompt_ids
    target_prompt_csr: tuple[list[int], list[int]] | None = None  # the request's CSR layout, answered in it
    prompt_alt_tokens: tuple[list[list[int]], list[list[float]]] | None = None  # (ids, logprobs) [len-1, k]

    def mask_prompt_logprobs(self, last_n: int | None) -> None:
        """Tinker's prompt_logprobs_last_n: positions before the last n are not scored (None)."""
        if last_n is None or self.prompt_logprobs is None:
            return
        cut = max(len(self.prompt_logprobs) - last_n, 0)
        self.prompt_logprobs[:cut] = [None] * cut
        if self.topk_prompt_logprobs is not None:
            self.topk_prompt_logprobs[:cut] = [None] * cut

