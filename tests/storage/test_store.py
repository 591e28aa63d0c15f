"""The checkpoint store on local disk and on a real remote filesystem (WebDAV through fsspec):
whole folders published atomically, read back, replaced, deleted; and adapters that live there."""

from __future__ import annotations

import pytest
from loraplex.types import AdamParams

from contract.configs import LoraConfig
from contract.inputs import EngineDatum, ForwardBackwardInput
from storage import store
from storage.checkpoint_files import read_manifest
from tests.workers.trainer.test_eviction import run
from workers.trainer.engine import TrainerEngine
from workers.trainer.executor import InProcessExecutor


@pytest.fixture(params=["local", "webdav"])
def location(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store" / "folder")
    return store.join(request.getfixturevalue("webdav_store")(), "folder")


def test_a_folder_is_published_whole_and_replaced_whole(location):
    assert store.local_folder(location) is None and store.read_json(location, "meta.json") is None
    with store.writing(location) as folder:
        (folder / "meta.json").write_text('{"version": 1}')
        (folder / "data.bin").write_bytes(b"x" * 1000)
    assert store.read_json(location, "meta.json") == {"version": 1}
    assert (store.local_folder(location) / "data.bin").read_bytes() == b"x" * 1000
    assert 1000 < store.size(location) < 1100  # one version: the old one is removed on replace

    with pytest.raises(RuntimeError), store.writing(location) as folder:
        (folder / "meta.json").write_text('{"version": 2}')
        raise RuntimeError("the writer failed half way")
    assert store.read_json(location, "meta.json") == {"version": 1}  # nothing of the failed write shows

    with store.writing(location) as folder:
        (folder / "meta.json").write_text('{"version": 3}')
    assert store.read_json(location, "meta.json") == {"version": 3}
    assert sorted(p.name for p in store.local_folder(location).iterdir()) == ["meta.json"]
    assert store.size(location) < 100

    store.delete(location)
    assert store.local_folder(location) is None
    store.delete(location)  # deleting what is gone is fine


def test_a_remote_folder_is_downloaded_into_the_cache_the_process_chose(webdav_store, tmp_path):
    """Each process's entry point sets the cache from Settings.store_cache when it starts."""
    location = store.join(webdav_store(), "cached")
    with store.writing(location) as folder:
        (folder / "data.bin").write_bytes(b"x")
    store.use_cache_dir(tmp_path / "cache")
    try:
        assert store.local_folder(location).is_relative_to(tmp_path / "cache")
    finally:
        store.use_cache_dir("")  # empty: the default
    assert store.local_folder(location).is_relative_to(store.DEFAULT_CACHE_DIR)


def test_training_state_round_trip_through_the_store(location, tiny_model_path):
    engine = TrainerEngine(tiny_model_path, max_rank=16)
    engine.create_adapter("a", LoraConfig(rank=4, seed=3))
    datum = EngineDatum(list(range(10, 30)), {"target_tokens": list(range(11, 31)), "weights": [1.0] * 20})
    engine.forward_backward([ForwardBackwardInput("a", [datum])])
    engine.optim_step([("a", AdamParams(learning_rate=1e-2))])
    engine.save_state("a", location, extra={"seq_id": 2})
    assert read_manifest(location)["extra"] == {"seq_id": 2}

    engine.load_state("b", location)
    forward = [ForwardBackwardInput(name, [datum]) for name in ("a", "b")]
    a, b = (out.loss_fn_outputs[0]["logprobs"].tolist() for out in engine.forward(forward))
    assert a == b
    assert engine.adapters["b"].step == 1  # the Adam state came along


def test_evicted_adapters_on_a_remote_store_continue_exactly(webdav_store, tiny_model_path, tmp_path):
    kept, _ = run(InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), tmp_path / "all"))
    remote = InProcessExecutor(TrainerEngine(tiny_model_path, max_rank=16), store.join(webdav_store(), "live"),
                               max_resident=1)
    moved, _ = run(remote)
    assert moved == kept
