"""Tinker's distillation fields from whole prompt rows: `target_prompt_logprobs` (the logprobs of named
ids at each prompt position) and `prompt_alt_tokens_k` (k draws per prompt position at the request's
temperature).

Both need the model's whole next-token distribution at every prompt position, not vLLM's top k: the
engine asks vLLM for prompt logprobs over the entire vocabulary (`prompt_logprobs=-1`) in the prefill
that serves the request, and these pure functions read the answers off those rows. The logprobs are the
ones vLLM computes for any prompt token (log-softmax of the logits, before any sampling processor), so a
named id's value is exact, and the draws come from exactly the model's distribution at temperature T
(softmax(logprob / T), T = 0: the most likely token). Cost: (len(prompt) - 1) x vocab values per request,
kept by vLLM in flat arrays (`flat_logprobs`: no object per value) and read here with numpy; the API
caps it (api/routes/sampling.py).
"""

from __future__ import annotations

import numpy as np
import torch


def full_rows(rows) -> torch.Tensor:
    """vLLM's whole-vocabulary prompt logprobs, as its flat container holds them (`flat_logprobs`: one
    array of ids and one of logprobs, a [start, end) range per prompt position, empty at position 0), as a
    [len(prompt) - 1, vocab] float32 tensor: row i is the distribution over prompt token i + 1."""
    ids = np.asarray(rows.token_ids, dtype=np.int64)
    logprobs = np.asarray(rows.logprobs, dtype=np.float32)
    vocab = int(ids.max()) + 1  # every id is listed (the prompt token once more, with the same value)
    out = np.full((len(rows) - 1, vocab), -np.inf, dtype=np.float32)
    for i, (start, end) in enumerate(zip(rows.start_indices[1:], rows.end_indices[1:])):
        out[i, ids[start:end]] = logprobs[start:end]
    return torch.from_numpy(out)


def prompt_token_logprobs(full: torch.Tensor, prompt: tuple[int, ...]) -> list[float | None]:
    """`prompt_logprobs` from the whole rows: None at position 0, then each prompt token's logprob."""
    tokens = torch.tensor(prompt[1:], dtype=torch.int64).unsqueeze(1)
    return [None, *full.gather(1, tokens).squeeze(1).tolist()]


def topk_rows(full: torch.Tensor, k: int) -> list[list[tuple[int, float]] | None]:
    """`topk_prompt_logprobs` from the whole rows: None at position 0, then the k most likely ids."""
    values, ids = torch.topk(full, k, dim=1)
    return [None, *[list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]]


def target_logprobs(full: torch.Tensor, ids: list[list[int]]) -> list[list[float]]:
    """The logprob of each named id (row i: prompt position i + 1); 0.0 where the id is -1 (skip)."""
    wanted = torch.tensor(ids, dtype=torch.int64).reshape(full.shape[0], -1)
    values = full.gather(1, wanted.clamp(min=0))
    return torch.where(wanted < 0, torch.zeros_like(values), values).tolist()


def alt_draws(full: torch.Tensor, k: int, temperature: float,
              seed: int | None) -> tuple[list[list[int]], list[list[float]]]:
    """k draws with replacement per row from softmax(row / temperature) (the row's most likely token k
    times at temperature 0), with the model's own (temperature 1) logprob of each."""
    if temperature == 0:
        tokens = full.argmax(dim=1, keepdim=True).expand(-1, k)
    else:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        probs = torch.softmax(full / temperature, dim=1)
        tokens = torch.multinomial(probs, k, replacement=True, generator=generator)
    return tokens.tolist(), full.gather(1, tokens).tolist()
