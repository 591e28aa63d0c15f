"""The CPU backends of the segmented LoRA autograd functions agree: the padded-bmm path against the
segment loop (which matches peft), on the grid's view layout and its gather layout."""

from __future__ import annotations

import pytest
import torch

from workers.sgmv import segmented_lora
from workers.sgmv.padded_segments import segment_grid
from workers.sgmv.segment_ops import padded_groups, padded_lora_
from workers.sgmv.segmented_lora import Segment, apply_lora_group, apply_segmented_lora

IN, OUT = 24, 40


def _segments(bounds, ranks, dtype, gen):
    segments = []
    for (start, end), rank in zip(bounds, ranks):
        a = torch.randn(rank, IN, generator=gen).to(dtype).requires_grad_()
        b = torch.randn(OUT, rank, generator=gen).to(dtype).requires_grad_()
        segments.append(Segment(start, end, a, b, scale=float(rank) / 3))
    return segments


def _run(backend, bounds, ranks, dtype, n_rows):
    """Output, dX and every segment's dA, dB of one pass through apply_segmented_lora."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n_rows, IN, generator=gen).to(dtype).requires_grad_()
    base = torch.randn(n_rows, OUT, generator=gen).to(dtype)
    grad_out = torch.randn(n_rows, OUT, generator=gen).to(dtype)
    segments = _segments(bounds, ranks, dtype, gen)
    out = apply_segmented_lora(x * 1, base.clone(), segments, backend)  # x * 1: a non-leaf, like a layer input
    out.backward(grad_out)
    return [out.detach(), x.grad] + [w.grad for s in segments for w in (s.lora_a, s.lora_b)]


LAYOUTS = {
    "equal, back to back (a view)": ([(4, 12), (12, 20), (20, 28)], 32),
    "ragged, with gaps (a gather)": ([(0, 5), (7, 19), (19, 20), (24, 30)], 33),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bmm_path_equals_segment_loop(layout, dtype):
    bounds, n_rows = LAYOUTS[layout]
    ranks = [4, 8, 2, 8][: len(bounds)]  # different ranks: the stacked weights are zero-padded
    got = _run("bmm", bounds, ranks, dtype, n_rows)
    want = _run("loop", bounds, ranks, torch.float32, n_rows)  # bf16 runs are checked against fp32
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and g.shape == w.shape, i
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"tensor {i}")
        else:  # bf16 rounding of inputs and of v: the loop itself is off by up to ~0.6% of the largest value
            assert (g.float() - w).abs().max() <= 2e-2 * w.abs().max(), f"tensor {i}"
    covered = torch.zeros(n_rows, dtype=torch.bool)
    for start, end in bounds:
        covered[start:end] = True
    assert not got[1][~covered].any()  # rows outside every segment get no gradient through LoRA


def test_grid_layouts():
    view = segment_grid(((2, 6), (6, 10)), 12)
    assert view.is_view and (view.groups, view.width) == (2, 4)
    rows = torch.arange(12.0).view(12, 1)
    assert view.to_cells(rows).flatten().tolist() == list(range(2, 10))
    back = torch.zeros(12, 1)
    view.add_bmm_(back, view.to_cells(rows), torch.ones(2, 1, 1))
    assert back.flatten().tolist() == [0, 0, *range(2, 10), 0, 0]

    gather = segment_grid(((0, 3), (5, 6)), 7)
    assert not gather.is_view and gather.width == 3  # the longest segment
    cells = gather.to_cells(rows[:7] + 1)
    assert cells.flatten().tolist() == [1, 2, 3, 6, 0, 0]
    back = torch.full((7, 1), -1.0)
    gather.add_bmm_(back, cells.fill_(float("nan")), torch.ones(2, 1, 1))
    assert back[[3, 4, 6]].flatten().tolist() == [-1, -1, -1]  # rows outside every segment are not touched


def test_rows_without_adapter_are_untouched_by_a_diverged_adapter():
    """The sampler's interleaved layout: rows of the base model (slot -1) beside rows of a tenant
    whose adapter holds NaN keep exactly the base output."""
    slots = torch.tensor([0, -1, 1, 0, -1, 1])
    groups = padded_groups(slots)
    x = torch.randn(6, IN)
    a_t, b_t = torch.randn(2, IN, 3), torch.randn(2, 3, OUT)
    a_t[0] = float("nan")
    out = torch.zeros(6, OUT)
    padded_lora_(out, x, groups, a_t, [b_t])
    assert not out[[1, 4]].any()  # exactly the base output (zero here)
    assert out[[0, 3]].isnan().all() and out[[2, 5]].isfinite().all()
    torch.testing.assert_close(out[[2, 5]], x[[2, 5]] @ a_t[1] @ b_t[1])


@pytest.mark.parametrize("bounds,out_features,expected", [
    (((0, 8),), 40, "loop"),  # one adapter: nothing to batch
    (((0, 8), (8, 16)), 40, "bmm"),
    (((0, 30), (30, 31), (31, 32)), 40, "loop"),  # padding to 30 rows each would triple the work
    (((0, 8), (8, 16)), segmented_lora.BMM_MAX_OUT_FEATURES + 1, "loop"),  # an unembedding
])
def test_auto_choice_on_cpu(bounds, out_features, expected):
    x = torch.zeros(bounds[-1][1], 4)
    assert segmented_lora._choose("auto", x, out_features, bounds) == expected


GROUP_OUTS = (40, 16, 16)  # a q/k/v-like group: layers of different widths reading one input


PRESET = 0.5  # what a gradient destination holds before the pass: gradients are added to it


def _group_run(grouped: bool, backend: str, bounds, ranks, n_rows, into_destinations: bool = False):
    """Outputs, dX and every dA, dB of a group of layers, computed as one node or layer by layer;
    with `into_destinations`, each dA and dB as added into the segment's own gradient tensors."""
    gen = torch.Generator().manual_seed(11)
    layers = [torch.nn.Linear(IN, out, bias=i == 1) for i, out in enumerate(GROUP_OUTS)]  # one with a bias
    for layer in layers:
        layer.requires_grad_(False)
        for tensor in layer.parameters():
            torch.nn.init.normal_(tensor, generator=gen)
    segments = []
    for out in GROUP_OUTS:
        layer_segments = []
        for (start, end), rank in zip(bounds, ranks):
            a = torch.randn(rank, IN, generator=gen).requires_grad_()
            b = torch.randn(out, rank, generator=gen).requires_grad_()
            dests = (torch.full_like(a, PRESET), torch.full_like(b, PRESET)) if into_destinations else (None, None)
            layer_segments.append(Segment(start, end, a, b, float(rank) / 3, *dests))
        segments.append(layer_segments)
    x = torch.randn(n_rows, IN, generator=gen).requires_grad_()
    grad_outs = [torch.randn(n_rows, out, generator=gen) for out in GROUP_OUTS]
    if grouped:
        outs = apply_lora_group(x * 1, layers, segments, backend)
        assert len({out.grad_fn for out in outs}) == 1  # one autograd node for the whole group
    else:
        outs = [apply_segmented_lora(x * 1, layer(x * 1), segs, backend) for layer, segs in zip(layers, segments)]
    torch.autograd.backward(outs, grad_outs)
    weights = [w.grad for segs in segments for s in segs for w in (s.lora_a, s.lora_b)]
    if into_destinations:
        assert all(w is None for w in weights)  # autograd got None for every weight
        weights = [d - PRESET for segs in segments for s in segs for d in (s.grad_a, s.grad_b)]
    return [out.detach() for out in outs] + [x.grad] + weights


@pytest.mark.parametrize("backend", ["loop", "bmm"])
@pytest.mark.parametrize("layout", [*LAYOUTS, "one adapter, every row"])
def test_group_equals_layer_by_layer(layout, backend):
    bounds, n_rows = LAYOUTS.get(layout, ([(0, 9)], 9))
    ranks = [4, 8, 2, 8][: len(bounds)]
    got = _group_run(True, backend, bounds, ranks, n_rows)
    want = _group_run(False, "loop", bounds, ranks, n_rows)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, i
        # fp32 rounding of products summed in another order: ~1e-7 of the largest value
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()), msg=f"tensor {i}")


@pytest.mark.parametrize("grouped", [True, False], ids=["group", "layer by layer"])
@pytest.mark.parametrize("backend", ["loop", "bmm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_gradients_added_into_destinations_equal_autograds(layout, backend, grouped):
    """Segments that name gradient tensors (the trainer's flat .grad views) get dA and dB added
    there, equal to what autograd gets without them; outputs and dX are unchanged."""
    bounds, n_rows = LAYOUTS[layout]
    ranks = [4, 8, 2, 8][: len(bounds)]
    got = _group_run(grouped, backend, bounds, ranks, n_rows, into_destinations=True)
    want = _group_run(grouped, backend, bounds, ranks, n_rows)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()), msg=f"tensor {i}")


def test_group_rejects_layers_with_different_segments():
    layers = [torch.nn.Linear(IN, 8), torch.nn.Linear(IN, 8)]
    a, b = torch.zeros(2, IN), torch.zeros(8, 2)
    with pytest.raises(ValueError, match="same segments"):
        apply_lora_group(torch.zeros(6, IN), layers, [[Segment(0, 6, a, b, 1.0)], [Segment(0, 5, a, b, 1.0)]])


def test_padded_lora_on_ragged_groups_equals_each_rows_own_adapter():
    """Groups of 3 and 1 rows (padding cells hold some other row) and base rows, one of them NaN:
    each row with an adapter gets its own delta, the others nothing."""
    slots = torch.tensor([0, 1, 0, -1, 0, -1])
    x = torch.randn(6, IN)
    x[5] = float("nan")  # a base row's own business
    a_t, b_t = torch.randn(2, IN, 3), torch.randn(2, 3, OUT)
    out = torch.zeros(6, OUT)
    padded_lora_(out, x, padded_groups(slots), a_t, [b_t], scale=0.5)
    for row, slot in enumerate(slots.tolist()):
        expected = torch.zeros(OUT) if slot < 0 else 0.5 * x[row] @ a_t[slot] @ b_t[slot]
        torch.testing.assert_close(out[row], expected)
