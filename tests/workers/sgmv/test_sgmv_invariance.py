"""The segmented LoRA ops give a segment the same bits whatever else they compute: other segments
(ranks, lengths, gaps), its position, the CPU path (loop, bmm), the thread count, and on the Triton
kernels (under the interpreter without a GPU) the launch's longest segment and largest rank.
A segment's weight gradients add one product per piece (a request's rows) in order; one piece
instead of two is equal within the fp32 bound of docs/decisions/0022-batch-invariant-training.md."""

from __future__ import annotations

import pytest
import torch

from workers.cpu_threads import intra_op_threads
from workers.sgmv.segmented_lora import Segment, apply_lora_group, apply_segmented_lora

IN, OUTS = 48, (40, 16, 16)  # a q/k/v-like group


def layers(gen: torch.Generator) -> list[torch.nn.Linear]:
    group = [torch.nn.Linear(IN, out, bias=i == 1) for i, out in enumerate(OUTS)]
    for layer in group:
        layer.requires_grad_(False)
        for tensor in layer.parameters():
            torch.nn.init.normal_(tensor, generator=gen)
    return group


def adapter(rank: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rank, IN, generator=gen), torch.randn(out, rank, generator=gen)) for out in OUTS]


def group_run(segments_spec, n_rows: int, backend: str, data_seed: int = 0, grads=None):
    """Run one LoRA group over `n_rows` rows: segments_spec is [(start, end, rank, seed, pieces)].
    Returns per segment (output rows, dX rows, [dA, dB per layer]); its gradients are added into
    `grads` (per segment, per layer (dA, dB)) when given, else into zeros."""
    gen = torch.Generator().manual_seed(data_seed)
    base = layers(torch.Generator().manual_seed(1))
    x = torch.randn(n_rows, IN, generator=gen).requires_grad_()
    grad_outs = [torch.randn(n_rows, out, generator=gen) for out in OUTS]
    grads = grads or [[(torch.zeros(rank, IN), torch.zeros(out, rank)) for out in OUTS]
                      for _, _, rank, _, _ in segments_spec]
    per_layer = [[] for _ in OUTS]
    for (start, end, rank, seed, pieces), segment_grads in zip(segments_spec, grads):
        for layer, ((a, b), (grad_a, grad_b)) in enumerate(zip(adapter(rank, seed), segment_grads)):
            per_layer[layer].append(Segment(start, end, a, b, 4.0 / rank, grad_a, grad_b, pieces))
    outs = apply_lora_group(x * 1, base, per_layer, backend)
    torch.autograd.backward(outs, grad_outs)
    return [([out[start:end].detach() for out in outs], x.grad[start:end], segment_grads)
            for (start, end, *_), segment_grads in zip(segments_spec, grads)]


def assert_equal_bits(got, want):
    outs, dx, grads = got
    outs_w, dx_w, grads_w = want
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_w)), "outputs"
    assert torch.equal(dx, dx_w), "dX"
    for (a, b), (a_w, b_w) in zip(grads, grads_w):
        assert torch.equal(a, a_w) and torch.equal(b, b_w), "dA, dB"


MINE = (30, 4, 7)  # rows, rank, seed


@pytest.mark.parametrize("backend", ["auto", "loop", "bmm"])
@pytest.mark.parametrize("company", [
    [],  # alone, at another position
    [(20, 4, 1)],  # one of the same rank: the bmm path's view grid
    [(3, 8, 2), (50, 2, 3)],  # other ranks and lengths: a gather grid, one bmm per rank
    [(1, 1, 4), (30, 4, 5), (9, 16, 6)],  # rank 1 (computed 2 wide), a one-row segment
])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_segments_bits_do_not_depend_on_the_other_segments(company, backend, threads):
    rows, rank, seed = MINE
    alone = group_run([(5, 5 + rows, rank, seed, ((5, 5 + 12), (17, 5 + rows)))], 5 + rows + 3, "auto")[0]
    spec, start = [], 2  # a gap of two rows, then the segments, mine in the middle
    for i, (n, r, s) in enumerate(company):
        if i == len(company) // 2:
            spec.append((start, start + rows, rank, seed, ((start, start + 12), (start + 12, start + rows))))
            start += rows
        spec.append((start, start + n, r, s, ()))
        start += n
    if not company:
        spec.append((start, start + rows, rank, seed, ((start, start + 12), (start + 12, start + rows))))
        start += rows
    mine = next(i for i, (_, _, r, s, _) in enumerate(spec) if (r, s) == (rank, seed))
    # my rows carry the same data: draw the others' around them from another seed
    with intra_op_threads(threads):
        got = group_run_with_rows_of(spec, start + 1, backend, mine, spec[mine][0])
    assert_equal_bits(got, alone)


def group_run_with_rows_of(spec, n_rows, backend, mine, my_start):
    """group_run where segment `mine` sees the rows (x, output gradients) it saw alone at row 5."""
    gen = torch.Generator().manual_seed(0)
    alone_rows = MINE[0] + 8
    x_alone = torch.randn(alone_rows, IN, generator=gen)
    g_alone = [torch.randn(alone_rows, out, generator=gen) for out in OUTS]
    other = torch.Generator().manual_seed(99)
    x = torch.randn(n_rows, IN, generator=other)
    grad_outs = [torch.randn(n_rows, out, generator=other) for out in OUTS]
    rows = slice(my_start, my_start + MINE[0])
    x[rows] = x_alone[5: 5 + MINE[0]]
    for g, g_a in zip(grad_outs, g_alone):
        g[rows] = g_a[5: 5 + MINE[0]]
    base = layers(torch.Generator().manual_seed(1))
    x.requires_grad_()
    grads = [[(torch.zeros(rank, IN), torch.zeros(out, rank)) for out in OUTS] for _, _, rank, _, _ in spec]
    per_layer = [[] for _ in OUTS]
    for (start, end, rank, seed, pieces), segment_grads in zip(spec, grads):
        for layer, ((a, b), (grad_a, grad_b)) in enumerate(zip(adapter(rank, seed), segment_grads)):
            per_layer[layer].append(Segment(start, end, a, b, 4.0 / rank, grad_a, grad_b, pieces))
    outs = apply_lora_group(x * 1, base, per_layer, backend)
    torch.autograd.backward(outs, grad_outs)
    return [out[rows].detach() for out in outs], x.grad[rows], grads[mine]


def test_two_pieces_in_one_call_add_as_two_calls_do():
    """A segment of two requests (two pieces) adds each piece's product in turn: the same
    additions as the two requests in two calls."""
    rows, rank, seed = MINE
    together = group_run([(0, rows, rank, seed, ((0, 12), (12, rows)))], rows, "loop")[0]
    first = group_run([(0, 12, rank, seed, ())], rows, "loop")[0]
    then = group_run([(12, rows, rank, seed, ())], rows, "loop", grads=[first[2]])[0]
    for (a, b), (a_w, b_w) in zip(then[2], together[2]):
        assert torch.equal(a, a_w) and torch.equal(b, b_w)


def test_one_piece_instead_of_two_is_within_the_fp32_bound():
    """G + (P1 + P2 summed as one product) against (G + P1) + P2: each is within gamma_n of the exact
    sum, so they differ by at most 2 * gamma_(n+2) * sum |terms| (n rows, u = 2^-24, gamma_n =
    n u / (1 - n u)), element by element; here well inside it."""
    rows, rank, seed = MINE
    one = group_run([(0, rows, rank, seed, ())], rows, "loop")[0]
    two = group_run([(0, rows, rank, seed, ((0, 12), (12, rows)))], rows, "loop")[0]
    u = 2.0 ** -24
    gamma = (rows + 2) * u / (1 - (rows + 2) * u)
    gen = torch.Generator().manual_seed(0)  # group_run's data, for the bound's sum of |terms|
    x = torch.randn(rows, IN, generator=gen)
    grad_outs = [torch.randn(rows, out, generator=gen) for out in OUTS]
    a_s, b_s = zip(*adapter(rank, seed))
    scale = 4.0 / rank
    v = x @ torch.cat(a_s).t() * scale  # [rows, 3 * rank], the scaled v
    dv = torch.cat([g @ b for g, b in zip(grad_outs, b_s)], dim=1) * scale
    for layer, ((a1, b1), (a2, b2)) in enumerate(zip(one[2], two[2])):
        cols = slice(layer * rank, (layer + 1) * rank)
        bound_a = 2 * gamma * (dv[:, cols].abs().t() @ x.abs())
        bound_b = 2 * gamma * (grad_outs[layer].abs().t() @ v[:, cols].abs())
        assert ((a1 - a2).abs() <= bound_a).all() and ((b1 - b2).abs() <= bound_b).all()
    assert any(not torch.equal(a1, a2) for (a1, _), (a2, _) in zip(one[2], two[2]))  # not the same bits


# --- the Triton kernels (under the interpreter on CPU) ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("company", [[(20, 4)], [(3, 16), (70, 2)]])
def test_triton_gives_a_segment_the_same_bits_beside_others(company):
    """A segment's output, dX, dA and dB from the Triton backend do not depend on the launch's
    longest segment (block sizes) or largest rank (zero padding): bit for bit."""
    from workers.sgmv import triton_kernels  # noqa: F401  (the interpreter is set up in tests/conftest.py)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, rank, seed = 24, 4, 7
    gen = torch.Generator().manual_seed(0)
    x_mine, g_mine = torch.randn(rows, IN, generator=gen), torch.randn(rows, OUTS[0], generator=gen)

    def run(spec, n_rows, mine_at):
        other = torch.Generator().manual_seed(5)
        x, g = torch.randn(n_rows, IN, generator=other), torch.randn(n_rows, OUTS[0], generator=other)
        x[mine_at: mine_at + rows], g[mine_at: mine_at + rows] = x_mine, g_mine
        x, g = x.to(device).requires_grad_(), g.to(device)
        segments, dests = [], []
        for start, end, r, s, pieces in spec:
            a, b = (t.to(device) for t in adapter(r, s)[0])
            dest = (torch.zeros_like(a), torch.zeros_like(b))
            dests.append(dest)
            segments.append(Segment(start, end, a, b, 4.0 / r, *dest, pieces))
        base = torch.zeros(n_rows, OUTS[0], device=device)
        out = apply_segmented_lora(x * 1, base, segments, "triton")
        out.backward(g)
        mine = next(i for i, (start, *_) in enumerate(spec) if start == mine_at)
        return out[mine_at: mine_at + rows].detach(), x.grad[mine_at: mine_at + rows], dests[mine]

    pieces = lambda start: ((start, start + 10), (start + 10, start + rows))  # noqa: E731
    alone = run([(0, rows, rank, seed, pieces(0))], rows, 0)
    spec, start = [], 0
    for n, r in company:
        spec.append((start, start + n, r, 3, ()))
        start += n + 1  # a gap row
    spec.append((start, start + rows, rank, seed, pieces(start)))
    got = run(spec, start + rows, start)
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    assert torch.equal(got[2][0], alone[2][0]) and torch.equal(got[2][1], alone[2][1])


@pytest.mark.gpu
def test_triton_weight_grad_pieces_adds_each_piece_in_turn():
    """sgmv_weight_grad_pieces: init + P_1 + P_2, each piece reduced on its own."""
    from workers.sgmv import triton_kernels as tk
    from workers.sgmv.grad_pieces import grad_pieces

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    left, right = torch.randn(50, 24, generator=gen).to(device), torch.randn(50, 16, generator=gen).to(device)
    init = torch.randn(2, 24, 16, generator=gen).to(device)
    pieces = grad_pieces((((0, 7), (7, 40)), ((42, 50),)))
    got = tk.sgmv_weight_grad_pieces(left, right, tk.piece_table(pieces, device), init=init.clone())
    one = tk.sgmv_weight_grad_pieces(left, right, tk.piece_table(grad_pieces((((0, 7),), ((42, 50),))), device),
                                     init=init.clone())
    two = tk.sgmv_weight_grad_pieces(left, right, tk.piece_table(grad_pieces((((7, 40),), ())), device),
                                     init=one[:1].clone())
    assert torch.equal(got[0], two[0]) and torch.equal(got[1], one[1])
    torch.testing.assert_close(got[0], init[0] + left[:40].T @ right[:40], rtol=1e-5, atol=1e-5)
