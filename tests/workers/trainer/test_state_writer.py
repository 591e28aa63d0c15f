"""The background writer of durable training states: newest state wins, flush waits for it."""

import threading
import time

import torch

from storage.checkpoint_files import read_manifest
from workers.trainer.checkpoints import TrainingState
from workers.trainer.state_writer import StateWriter


class HeldState(TrainingState):
    """A real training state whose write waits until the test lets it go."""

    started: threading.Event
    release: threading.Event

    def write(self, path, extra=None):
        self.started.set()
        self.release.wait(timeout=30)
        return super().write(path, extra)


def state(step: int, release: threading.Event | None = None) -> TrainingState:
    tensors = {"weight/layer.lora_A": torch.full((2, 3), float(step))}
    if release is None:
        return TrainingState("m", {"rank": 2}, step, tensors)
    held = HeldState("m", {"rank": 2}, step, tensors)
    object.__setattr__(held, "started", threading.Event())
    object.__setattr__(held, "release", release)
    return held


def test_a_newer_state_replaces_one_still_waiting_and_flush_waits_for_it(tmp_path):
    writer = StateWriter()
    release = threading.Event()
    first = state(1, release)
    writer.submit("m", tmp_path / "m", first, {"seq_id": 1})
    assert first.started.wait(30)  # being written, held
    writer.submit("m", tmp_path / "m", state(2), {"seq_id": 2})  # waits ...
    writer.submit("m", tmp_path / "m", state(3), {"seq_id": 3})  # ... and is replaced by this one
    writer.submit("other", tmp_path / "other", state(7), {"seq_id": 7})

    flushed = threading.Event()
    threading.Thread(target=lambda: (writer.flush("m"), flushed.set())).start()
    assert not flushed.wait(0.3)  # step 1 is still being written
    release.set()
    assert flushed.wait(30)
    assert read_manifest(tmp_path / "m")["extra"] == {"seq_id": 3}
    writer.close()  # writes what is still queued
    assert read_manifest(tmp_path / "other")["step"] == 7


def test_a_failed_write_is_logged_and_the_writer_goes_on(tmp_path, caplog):
    writer = StateWriter()
    (tmp_path / "file").write_text("not a folder")
    writer.submit("bad", tmp_path / "file" / "m", state(1), {"seq_id": 1})
    writer.submit("good", tmp_path / "good", state(2), {"seq_id": 2})
    writer.close()
    assert "writing the training state of bad failed" in caplog.text
    assert read_manifest(tmp_path / "good")["step"] == 2


def test_when_written_runs_after_the_models_newest_write_and_never_after_a_failed_one(tmp_path):
    writer = StateWriter()
    ran = []
    writer.when_written("m", lambda: ran.append("nothing pending: at once"))
    release = threading.Event()
    first = state(1, release)
    writer.submit("m", tmp_path / "m", first, {"seq_id": 1})
    assert first.started.wait(30)
    writer.when_written("m", lambda: ran.append("after the newest write"))
    writer.submit("m", tmp_path / "m", state(2), {"seq_id": 2})  # newer, waiting behind the one being written
    release.set()
    writer.flush("m")
    assert ran == ["nothing pending: at once", "after the newest write"]
    assert read_manifest(tmp_path / "m")["extra"]["seq_id"] == 2  # it ran once the newest was written
    (tmp_path / "blocked").write_text("a file where the state's folder should go")
    writer.submit("x", tmp_path / "blocked" / "x", state(3), {"seq_id": 3})
    writer.when_written("x", lambda: ran.append("never"))
    writer.flush("x")
    assert ran[-1] != "never"
    writer.close()


def test_submit_waits_while_the_copies_waiting_pass_their_bound(tmp_path):
    release = threading.Event()
    first = state(1, release)
    writer = StateWriter(max_pending_bytes=first.nbytes)  # room for one copy waiting
    writer.submit("a", tmp_path / "a", first, {"seq_id": 1})
    assert first.started.wait(30)  # being written: nothing waits
    writer.submit("b", tmp_path / "b", state(2), {"seq_id": 1})  # one waits
    submitted = threading.Event()
    threading.Thread(target=lambda: (writer.submit("c", tmp_path / "c", state(3), {"seq_id": 1}), submitted.set()),
                     daemon=True).start()
    assert not submitted.wait(0.5)  # a second would pass the bound: it waits for the writer
    release.set()
    assert submitted.wait(30)
    writer.close()


def test_a_flush_waits_for_what_runs_after_the_write(tmp_path):
    """A restore flushes the model first: the slot a page-out's callback removes must be gone by then."""
    writer = StateWriter()
    release = threading.Event()
    first = state(1, release)
    writer.submit("m", tmp_path / "m", first, {"seq_id": 1})
    assert first.started.wait(30)
    finished = []
    writer.when_written("m", lambda: (time.sleep(0.3), finished.append(True)))
    release.set()
    writer.flush("m")
    assert finished == [True]
    writer.when_written("m", lambda: finished.append("at once"))  # nothing pending: here and now
    assert finished == [True, "at once"]
    writer.close()
