"""Tinker's sampling fields for distillation through the official `tinker` SDK, on a real embedded server:
`target_prompt_logprobs` (dense and CSR), `prompt_alt_tokens_k` and `topk_prompt_logprobs`, each checked
against the trainer's forward logprobs on the same weights (the sampler's vLLM and the trainer both run
fp32: only their summation order differs)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from tinker import types

from tests.servers import running_server

pytestmark = pytest.mark.vllm  # the module's server runs the vLLM sampler

PROMPT = [5, 6, 7, 8, 9, 31, 32, 33, 300, 301, 12]
ROWS = len(PROMPT) - 1
TOLERANCE = 1e-4  # as tests/service/test_sampling.py: measured gaps are ~1e-6; a wrong row moves them ~1e-1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("loraplex")) as running:
        yield running


@pytest.fixture(scope="module")
def trained(service_client):
    """(training client, sampling client of its weights, vocab size) after a few SFT steps."""
    tc = service_client.create_lora_training_client(base_model="tiny", rank=8, seed=5).result()
    tokens = list(range(10, 40))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                        "weights": np.ones(len(tokens) - 1, dtype=np.float32)})
    for _ in range(3):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    vocab = tc.get_tokenizer().vocab_size
    return tc, tc.save_weights_and_get_sampling_client(), vocab


def trainer_logprobs(tc, ids: np.ndarray) -> np.ndarray:
    """The trainer's forward logprob of ids[i, j] as prompt token i + 1 (one datum per column)."""
    data = [types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": np.maximum(ids[:, j], 0).astype(np.int64),
                                        "weights": np.ones(ROWS, dtype=np.float32)}) for j in range(ids.shape[1])]
    outputs = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    return np.stack([out["logprobs"].to_numpy() for out in outputs], axis=1)


def sample(sampler, **fields) -> types.SampleResponse:
    params = types.SamplingParams(max_tokens=2, temperature=fields.pop("temperature", 1.0), seed=7, stop=[])
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params, **fields).result()


def test_target_prompt_logprobs_dense_and_csr_equal_the_trainers(trained):
    tc, sampler, vocab = trained
    ids = np.random.default_rng(0).integers(0, vocab, size=(ROWS, 3))
    ids[:, 0] = PROMPT[1:]  # the prompt's own tokens among them
    ids[2, 1] = ids[4, 2] = -1  # skipped cells
    expected = np.where(ids < 0, 0.0, trainer_logprobs(tc, ids))

    dense = sample(sampler, target_prompt_logprobs=types.TensorData.from_numpy(ids))
    got = dense.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [ROWS, 3] and got.sparse_crow_indices is None
    np.testing.assert_allclose(got.to_numpy(), expected, atol=TOLERANCE)
    assert got.to_numpy()[2, 1] == 0.0 == got.to_numpy()[4, 2]

    # CSR (pad -1): only the listed cells are asked, and answered in the same layout
    sparse_ids = np.full((ROWS, 3), -1)
    sparse_ids[1, 0], sparse_ids[5, 2], sparse_ids[9, 1] = ids[1, 0], ids[5, 2], ids[9, 1]
    asked = types.TensorData.from_torch_sparse(torch.from_numpy(sparse_ids), pad_value=-1)
    assert asked.sparse_crow_indices is not None
    answer = sample(sampler, target_prompt_logprobs=asked).target_prompt_logprobs
    assert (answer.sparse_crow_indices, answer.sparse_col_indices, answer.shape) == (
        asked.sparse_crow_indices, asked.sparse_col_indices, [ROWS, 3])
    cells = [(1, 0), (5, 2), (9, 1)]
    np.testing.assert_allclose(answer.data, [expected[r, c] for r, c in cells], atol=TOLERANCE)


def test_prompt_alt_tokens_are_draws_at_the_requests_temperature_with_the_trainers_logprobs(trained):
    tc, sampler, _ = trained
    drawn = sample(sampler, prompt_alt_tokens_k=6, temperature=0.8).prompt_alt_tokens
    tokens, logprobs = drawn.tokens.to_numpy(), drawn.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (ROWS, 6) and drawn.logprobs.dtype == "float32"
    np.testing.assert_allclose(logprobs, trainer_logprobs(tc, tokens), atol=TOLERANCE)
    # seeded: the same draws again; greedy: the most likely token, as the top-1 prompt logprob says
    again = sample(sampler, prompt_alt_tokens_k=6, temperature=0.8).prompt_alt_tokens
    assert (again.tokens.to_numpy() == tokens).all()
    greedy = sample(sampler, prompt_alt_tokens_k=2, topk_prompt_logprobs=1, temperature=0.0)
    top1 = [row[0][0] for row in greedy.topk_prompt_logprobs[1:]]
    assert (greedy.prompt_alt_tokens.tokens.to_numpy() == np.array(top1)[:, None]).all()


def test_prompt_alt_tokens_follow_the_distribution(trained):
    """256 draws per position at temperature 1 and 0.25 fit softmax(logprob / T) over the top 5 tokens (a
    chi-square over every position, within 5 sigma), and do not fit the other temperature's."""
    _, sampler, _ = trained
    fits = {}
    for temperature in (1.0, 0.25):
        response = sample(sampler, prompt_alt_tokens_k=256, topk_prompt_logprobs=5, temperature=temperature)
        drawn = response.prompt_alt_tokens.tokens.to_numpy()
        for assumed in (1.0, 0.25):
            chi2, df = 0.0, 0
            for row, top in zip(drawn, response.topk_prompt_logprobs[1:]):
                seen = np.array([(row == t).sum() for t, _ in top], dtype=float)
                scaled = np.array([lp for _, lp in top]) / assumed
                expected = seen.sum() * np.exp(scaled - np.logaddexp.reduce(scaled))  # given a top-5 draw
                keep = expected >= 5  # the chi-square's usual validity rule
                chi2 += ((seen[keep] - expected[keep]) ** 2 / expected[keep]).sum()
                df += max(int(keep.sum()) - 1, 0)
            fits[temperature, assumed] = (chi2, df)
    for temperature in (1.0, 0.25):
        chi2, df = fits[temperature, temperature]
        assert df >= 10 and chi2 < df + 5 * np.sqrt(2 * df), fits
        wrong, wrong_df = fits[temperature, 1.25 - temperature]
        assert wrong > wrong_df + 5 * np.sqrt(2 * wrong_df), fits


def test_topk_prompt_logprobs_equal_the_trainers(trained):
    tc, sampler, _ = trained
    rows = sample(sampler, topk_prompt_logprobs=3).topk_prompt_logprobs
    assert rows[0] is None and len(rows) == len(PROMPT)
    ids = np.array([[t for t, _ in row] for row in rows[1:]])
    values = np.array([[lp for _, lp in row] for row in rows[1:]])
    assert (np.diff(values, axis=1) <= 0).all()  # ranked
    np.testing.assert_allclose(values, trainer_logprobs(tc, ids), atol=TOLERANCE)


def test_bad_distillation_fields_name_the_field(server, api_key, trained):
    _, sampler, vocab = trained
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "base_model": "tiny",
            "sampling_params": {"max_tokens": 1}}
    for fields, message in (
            ({"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}}, "shape [len(prompt) - 1"),
            ({"target_prompt_logprobs": {"data": [vocab] * ROWS, "dtype": "int64", "shape": [ROWS, 1]}},
             "token ids in"),
            ({"target_prompt_logprobs": {"data": [-1] * ROWS, "dtype": "int64", "shape": [ROWS, 1]}}, "names no"),
            ({"target_prompt_logprobs": {"data": [0.5] * ROWS, "dtype": "float32", "shape": [ROWS, 1]}}, "int64"),
            ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k"),
            ({"prompt_alt_tokens_k": 2, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]}},
             "2 or more tokens")):
        answer = httpx.post(f"{server.base_url}/api/v1/asample", json={**body, **fields},
                            headers={"X-API-Key": api_key})
        assert answer.status_code in (400, 422) and message in answer.text, answer.text  # 422: pydantic's bounds


def test_the_cookbooks_decision_recipe_runs_unchanged(trained, tiny_model_path):
    """tinker-cookbook's decisions recipe scores one answer token per choice with a CSR
    target_prompt_logprobs; its probabilities are the softmax of the trainer's logprobs of those tokens."""
    import asyncio

    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.decisions import Decision, DecisionRenderer, sample_decision
    from transformers import AutoTokenizer

    tc, sampler, _ = trained
    renderer = renderers.get_renderer("qwen3_instruct", AutoTokenizer.from_pretrained(tiny_model_path))
    rendering = DecisionRenderer(renderer).render(
        Decision("Which is larger?", [("one", "the number 1"), ("two", "the number 2"), ("three", "")]))
    got = asyncio.run(sample_decision(sampler, rendering))

    labels, tokens, data = rendering.labels, rendering.tokens, []
    for label in labels:  # the label's token at the answer position
        swapped = tokens[:rendering.choice_pos] + [rendering.label_tokens[label]] + tokens[rendering.choice_pos + 1:]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(swapped[:-1]),
                                loss_fn_inputs={"target_tokens": np.array(swapped[1:], dtype=np.int64),
                                                "weights": np.ones(len(swapped) - 1, dtype=np.float32)}))
    outputs = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    logprobs = np.array([out["logprobs"].to_numpy()[rendering.choice_pos - 1] for out in outputs])
    expected = np.exp(logprobs - np.logaddexp.reduce(logprobs))
    assert list(got) == labels
    np.testing.assert_allclose(list(got.values()), expected, atol=1e-4)
