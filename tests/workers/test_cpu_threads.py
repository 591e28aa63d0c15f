"""This thread's intra-op thread count, and the engine's choice of it per pass."""

import sys
import threading

import pytest
import torch

from workers import cpu_threads
from workers.cpu_threads import intra_op_threads
from workers.trainer.engine import TrainerEngine

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the torch wheel's libgomp and MKL")


def test_the_knobs_are_found_in_this_torch_build():
    assert cpu_threads.available()


def test_one_thread_inside_the_block_only_on_this_thread_and_restored_after():
    if torch.get_num_threads() < 2:
        pytest.skip("needs 2 CPUs")
    before = cpu_threads.current()
    seen_elsewhere = []
    with intra_op_threads(1):
        assert cpu_threads.current() == (1, 1 if before[1] is not None else None)
        assert torch.get_num_threads() == 1
        other = threading.Thread(target=lambda: seen_elsewhere.append(cpu_threads.current()))
        other.start()
        other.join()
    assert seen_elsewhere == [before]
    assert cpu_threads.current() == before


def test_set_on_a_fresh_thread_before_its_first_torch_op():
    """torch sets a new thread's count lazily, at its first parallel op: that must not undo ours."""
    seen = []

    def fresh():
        with intra_op_threads(1):
            torch.randn(256, 256).exp().sum()
            seen.append(cpu_threads.current()[0])

    thread = threading.Thread(target=fresh)
    thread.start()
    thread.join()
    assert seen == [1]


def test_none_leaves_the_count_alone():
    before = cpu_threads.current()
    with intra_op_threads(None):
        assert cpu_threads.current() == before


def test_restored_when_the_block_raises():
    before = cpu_threads.current()
    with pytest.raises(RuntimeError):
        with intra_op_threads(1):
            raise RuntimeError("boom")
    assert cpu_threads.current() == before


def test_engine_runs_small_passes_on_one_thread_and_large_ones_on_the_default():
    engine = TrainerEngine("tiny", parallel_min_macs=1e9)
    per_row = engine.parallel_min_macs / sum(p.numel() for p in engine.model.parameters())
    assert engine.pass_threads(32) == 1
    assert engine.pass_threads(int(per_row) + 1) is None
    assert TrainerEngine("tiny", parallel_min_macs=0).pass_threads(1) is None
