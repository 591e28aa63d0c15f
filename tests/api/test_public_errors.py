"""Errors answered to users name checkpoints by tinker:// path, never by server path or tenant id."""

from api.public_errors import public_error

STORE = "/srv/loraplex/data"
CHECKPOINTS = f"{STORE}/checkpoints"
TENANT = "0b7d4c9e-2f57-4d1e-9a51-3c1f0f2b7a10"
RUN = "5a43d369-aaaa-bbbb-cccc-000000000000:train:0"


def test_a_checkpoint_file_becomes_its_tinker_path():
    message = (f"{CHECKPOINTS}/{TENANT}/{RUN}/sampler_weights/s1/seq-3/adapter_model.safetensors "
               "failed its integrity check")
    public = public_error(message, CHECKPOINTS, STORE)
    assert public == (f"tinker://{RUN}/sampler_weights/s1 (file adapter_model.safetensors) failed its integrity check")
    assert TENANT not in public and STORE not in public


def test_a_checkpoint_folder_and_other_store_paths():
    message = f"'{CHECKPOINTS}/{TENANT}/{RUN}/weights/ckpt-1': no checkpoint there; state at {STORE}/live/{RUN}/state"
    public = public_error(message, CHECKPOINTS, STORE)
    assert public == f"'tinker://{RUN}/weights/ckpt-1': no checkpoint there; state at <store>/live/{RUN}/state"


def test_other_text_is_left_alone():
    assert public_error("seq_id 2: never arrived", CHECKPOINTS, STORE) == "seq_id 2: never arrived"
