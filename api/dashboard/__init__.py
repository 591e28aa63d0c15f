"""The dashboard served at /dashboard (docs/dashboard.md): login (auth.py), the JSON API (data.py,
rollouts_view.py) and the pages built on it."""

from fastapi import APIRouter


def json_routers() -> list[APIRouter]:
    """Login/logout and the JSON API, for api/app.py."""
    from api.dashboard import auth, data, rollouts_view  # noqa: F401  (rollouts_view adds its routes to data's)

    return [auth.router, data.router]
