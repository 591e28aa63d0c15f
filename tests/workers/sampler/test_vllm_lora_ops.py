"""The sampler's punica wrapper (vLLM's LoRA op interface) against each row's own adapter in fp32:
decode-sized steps (the dense path where the CPU has its kernel) and prefill-sized ones (segmented
bmm), interleaved adapters, rows without an adapter, and a diverged-but-finite adapter."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.layers.utils import LoRAMapping

from workers.sampler import dense_lora
from workers.sampler.vllm_lora_ops import SegmentedPunicaWrapper

pytestmark = pytest.mark.vllm  # no engine, but vLLM's LoRA interface (its import alone takes ~3 s)
MAX_LORAS, RANK, IN = 4, 16, 64
SLICES = (64, 32, 32)  # a q/k/v layer
SLOT_IDS = [11, 12, None, 14]  # adapter id per slot; slot 2 is empty


def stacked_weights(dtype, gen):
    """vLLM's layout: per slice A [max_loras, 1, rank, in], B [max_loras, 1, out, rank]."""
    a = [torch.randn(MAX_LORAS, 1, RANK, IN, generator=gen).mul_(0.1).to(dtype) for _ in SLICES]
    b = [torch.randn(MAX_LORAS, 1, out, RANK, generator=gen).mul_(0.1).to(dtype) for out in SLICES]
    return a, b


def wrapper_for(token_ids: list[int]) -> SegmentedPunicaWrapper:
    """A wrapper set up for one step whose tokens carry these adapter ids (0: the base model)."""
    wrapper = SegmentedPunicaWrapper(512, 64, "cpu")
    wrapper.update_metadata(LoRAMapping(tuple(token_ids), tuple(token_ids), is_prefill=False),
                            SLOT_IDS, MAX_LORAS, 1000)
    return wrapper


def reference(y, x, a, b, token_ids, scale):
    """Each row plus its own adapter's product, in fp32."""
    out = y.float().clone()
    for row, adapter in enumerate(token_ids):
        if adapter == 0:
            continue
        slot = SLOT_IDS.index(adapter)
        o0 = 0
        for a_s, b_s, width in zip(a, b, SLICES):
            out[row, o0: o0 + width] += scale * (x[row].float() @ a_s[slot, 0].float().T) @ b_s[slot, 0].float().T
            o0 += width
    return out


def token_ids_for(rows: int, gen) -> list[int]:
    """Interleaved adapters 11, 12, 14 and the base model (0), in a random order."""
    choices = torch.tensor([11, 12, 14, 0])
    return choices[torch.randint(0, 4, (rows,), generator=gen)].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, dense_lora.DENSE_MAX_ROWS, 200])
def test_lora_linear_equals_each_rows_own_adapter(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    token_ids = token_ids_for(rows, gen)
    a, b = stacked_weights(dtype, gen)
    x = torch.randn(rows, IN, generator=gen).to(dtype)
    y = torch.randn(rows, sum(SLICES), generator=gen).to(dtype)
    expected = reference(y, x, a, b, token_ids, scale=0.5)
    base_rows = [r for r, t in enumerate(token_ids) if t == 0]
    y_before = y.clone()

    wrapper_for(token_ids).add_lora_linear(y, x, tuple(a), tuple(b), 0.5, SLICES)

    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the rank-16 product rounded twice
    torch.testing.assert_close(y.float(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(y[base_rows], y_before[base_rows])  # bit for bit


@pytest.mark.skipif(not dense_lora.available(torch.bfloat16), reason="no AMX or AVX512-BF16 GEMM kernel here")
def test_dense_path_is_used_at_decode_sizes_and_isolates_rows_from_a_huge_adapter():
    gen = torch.Generator().manual_seed(3)
    token_ids = token_ids_for(32, gen)
    a, b = stacked_weights(torch.bfloat16, gen)
    a[0][SLOT_IDS.index(11)].fill_(1e30)  # finite, but x @ A overflows to inf
    x = torch.randn(32, IN, generator=gen).bfloat16()
    y = torch.randn(32, sum(SLICES), generator=gen).bfloat16()
    y_before = y.clone()
    wrapper = wrapper_for(token_ids)

    wrapper.add_lora_linear(y, x, tuple(a), tuple(b), 1.0, SLICES)

    assert wrapper._dense, "the dense path did not run"
    others = [r for r, t in enumerate(token_ids) if t != 11]
    expected = reference(y_before, x, a, b, token_ids, scale=1.0)
    torch.testing.assert_close(y[others].float(), expected[others], rtol=3e-2, atol=3e-2)
    base_rows = [r for r, t in enumerate(token_ids) if t == 0]
    assert torch.equal(y[base_rows], y_before[base_rows])


@pytest.mark.skipif(not dense_lora.available(torch.bfloat16), reason="no AMX or AVX512-BF16 GEMM kernel here")
def test_dense_weights_refuse_shapes_the_kernel_cannot_take():
    a = [torch.zeros(MAX_LORAS, 1, RANK, 40, dtype=torch.bfloat16)]  # in_features 40: not a multiple of 32
    b = [torch.zeros(MAX_LORAS, 1, 64, RANK, dtype=torch.bfloat16)]
    assert dense_lora.DenseLoRA.build(a, b, (0, 1)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [8, 100])
def test_lora_logits_equal_each_rows_own_adapter(dtype, rows):
    """The sampled rows' logits, with an adapter that pads the vocabulary further than the model."""
    gen = torch.Generator().manual_seed(rows)
    token_ids = token_ids_for(rows, gen)
    vocab, adapter_vocab = 96, 128
    a = torch.randn(MAX_LORAS, 1, RANK, IN, generator=gen).mul_(0.1).to(dtype)
    b = torch.randn(MAX_LORAS, 1, adapter_vocab, RANK, generator=gen).mul_(0.1).to(dtype)
    x = torch.randn(rows, IN, generator=gen).to(dtype)
    y = torch.randn(rows, vocab, generator=gen).to(dtype)
    expected = y.float().clone()
    for row, adapter in enumerate(token_ids):
        if adapter:
            slot = SLOT_IDS.index(adapter)
            expected[row] += 0.5 * ((x[row].float() @ a[slot, 0].float().T) @ b[slot, 0].float().T)[:vocab]

    wrapper_for(token_ids).add_lora_logits(y, x, a, b, 0.5)

    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not dense_lora.available(torch.bfloat16), reason="no AMX or AVX512-BF16 GEMM kernel here")
def test_dense_weights_are_reused_while_adapters_finish_and_rebuilt_for_a_lone_one():
    gen = torch.Generator().manual_seed(5)
    a, b = stacked_weights(torch.bfloat16, gen)
    wrapper = SegmentedPunicaWrapper(512, 64, "cpu")
    built = []
    for token_ids in ([11, 12, 14, 0] * 4, [12, 0, 11] * 4, [14, 0] * 4):  # three decode steps
        wrapper.update_metadata(LoRAMapping(tuple(token_ids), tuple(token_ids)), SLOT_IDS, MAX_LORAS, 1000)
        x = torch.randn(len(token_ids), IN, generator=gen).bfloat16()
        y = torch.randn(len(token_ids), sum(SLICES), generator=gen).bfloat16()
        expected = reference(y, x, a, b, token_ids, scale=1.0)
        wrapper.add_lora_linear(y, x, tuple(a), tuple(b), 1.0, SLICES)
        torch.testing.assert_close(y.float(), expected, rtol=3e-2, atol=3e-2)
        (_, slots, weights), = wrapper._dense.values()
        built.append((slots, weights))
    assert built[1][1] is built[0][1]  # 2 of its 3 adapters left: the same packed weights
    assert built[2][0] == (SLOT_IDS.index(14),)  # 1 of 3: repacked for that one


def test_embedding_lora_adds_only_the_adapters_that_have_one_and_follows_slot_changes():
    """vLLM runs the embedding's LoRA for every adapter, zeros where it has none; rows of such an
    adapter (and base rows) are left as they are, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    token_ids = [11, 12, 14, 0] * 4
    x = torch.randn(len(token_ids), RANK, generator=gen)  # each row's A-embedding (vLLM looks it up)
    b = torch.zeros(MAX_LORAS, 1, IN, RANK)
    b[SLOT_IDS.index(12)] = torch.randn(1, IN, RANK, generator=gen)  # only adapter 12 has one
    y = torch.randn(len(token_ids), IN, generator=gen)
    expected = y.clone()
    rows_12 = [r for r, t in enumerate(token_ids) if t == 12]
    expected[rows_12] += x[rows_12] @ b[SLOT_IDS.index(12), 0].T
    wrapper = wrapper_for(token_ids)

    wrapper.add_lora_embedding(y, x, b, add_inputs=True)

    torch.testing.assert_close(y, expected)
    others = [r for r, t in enumerate(token_ids) if t != 12]
    assert torch.equal(y[others], expected[others])

    b[SLOT_IDS.index(14)] = torch.randn(1, IN, RANK, generator=gen)  # another adapter put in slot 3
    new_ids = [11, 12, None, 15]
    wrapper.update_metadata(LoRAMapping(tuple([15] * 4), tuple([15] * 4), is_prefill=False), new_ids, MAX_LORAS, 1000)
    y = torch.zeros(4, IN)
    wrapper.add_lora_embedding(y, x[:4], b, add_inputs=True)
    torch.testing.assert_close(y, x[:4] @ b[SLOT_IDS.index(14), 0].T)
