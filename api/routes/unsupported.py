"""Tinker routes this server does not serve: a clear 400 naming the feature, instead of a bare 404.

A 400 is final for the SDK (it retries 408, 409, 429 and 5xx for five minutes), and the request guard
releases the seq_id of a refused training request (api/refusals.py), so the model goes on.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api.deps import CurrentTenant

router = APIRouter()

UNSUPPORTED = {
    ("POST", "/create_custom_loss"): "create_custom_loss (server-side custom losses): not supported by this server; "
                                     "the SDK's client-side forward_backward_custom works",
}


def _refuse(message: str):
    def refuse(_: CurrentTenant) -> None:  # authenticated like every route: no key is a 401
        raise HTTPException(400, message)
    return refuse


for (method, path), message in UNSUPPORTED.items():
    router.add_api_route(path, _refuse(message), methods=[method], include_in_schema=False)
