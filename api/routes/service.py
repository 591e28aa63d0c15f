"""Bootstrap and service endpoints: client config, health, capabilities, telemetry."""

from fastapi import APIRouter, Request

from api.deps import CurrentTenant
from api.served_models import served

router = APIRouter()


@router.post("/client/config")
def client_config(request: Request) -> dict:
    # Every other SDK default fits this server. With tokens on, the SDK exchanges its key for one
    # (POST /auth/token) and whoami reads it; off, the SDK sends its API key on every request.
    return {"pjwt_auth_enabled": request.app.state.tokens is not None}


@router.post("/client/dynamic_config")
def dynamic_config() -> dict:
    return {"refresh_interval_sec": 300}


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def capabilities(request: Request) -> dict:
    return {"supported_models": [
        {"model_name": model.name, "max_context_length": model.info.max_context, "trainable": True,
         "sampleable": model.sampling is not None}
        for model in served(request).all
    ]}


@router.post("/telemetry")
def telemetry(_: CurrentTenant) -> dict:
    return {"status": "accepted"}  # accepted and dropped: this server keeps no client telemetry
