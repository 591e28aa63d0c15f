"""The calls the SDK makes before it has a session: client config, health, capabilities, telemetry."""

from types import SimpleNamespace

from api.served_models import ServedModel, ServedModels


def test_client_config_health_and_telemetry(api):
    assert api.client.post("/client/config", json={"sdk_version": "0.38.0"}).json() == {"pjwt_auth_enabled": True}
    assert api.client.post("/client/dynamic_config", json={}).json() == {"refresh_interval_sec": 300}
    assert api.client.get("/healthz").json() == {"status": "ok"}
    telemetry = api.as_tenant(api.key("ada")).post("/telemetry", json={"events": [{"name": "x"}]})
    assert telemetry.status_code == 200 and telemetry.json() == {"status": "accepted"}


def test_capabilities_name_the_served_model_and_whether_it_samples(api, tiny_info):
    (model,) = api.client.get("/get_server_capabilities").json()["supported_models"]
    assert model == {"model_name": tiny_info.name, "max_context_length": tiny_info.max_context, "trainable": True,
                     "sampleable": False}
    api.app.state.models = ServedModels([ServedModel(tiny_info, api.scheduler, SimpleNamespace())])  # any sampler
    assert api.client.get("/get_server_capabilities").json()["supported_models"][0]["sampleable"]
