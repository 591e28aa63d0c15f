"""`loraplex-admin operator-keys issue | list | revoke`: keys for the dashboard's admin view."""

from __future__ import annotations

import sqlalchemy as sa
import typer

from admin.common import console, session
from admin.output import JSON_OPTION, show
from db.models import OperatorKey, utcnow

operator_keys_app = typer.Typer(no_args_is_help=True, help="issue, list, revoke: keys for the dashboard's admin view")


@operator_keys_app.command("issue")
def operator_keys_issue() -> None:
    """Issue an operator key (tmo-...), printed once: it logs into /dashboard and sees every tenant."""
    from db.operator_keys import issue_operator_key

    with session() as s:
        key = issue_operator_key(s)
    console.print("operator key (shown once, only its hash is stored):")
    print(key)


@operator_keys_app.command("list")
def operator_keys_list(as_json: bool = JSON_OPTION) -> None:
    with session() as s:
        rows = [{"key": k.key_prefix + "...", "created": k.created_at, "state": "revoked" if k.revoked_at else "active",
                     "revoked": k.revoked_at} for k in s.scalars(sa.select(OperatorKey).order_by(OperatorKey.created_at))]
    show("operator keys", rows, ["key", "created", "state", "revoked"], as_json)


@operator_keys_app.command("revoke")
def operator_keys_revoke(key_prefix: str = typer.Argument(..., help="the key's first characters, as `operator-keys list` shows")
                         ) -> None:
    """Revoke one operator key: its dashboard sessions end at once."""
    from db.operator_keys import matching_operator_keys

    with session() as s:
        matches = matching_operator_keys(s, key_prefix.removesuffix("..."))
        if len(matches) != 1:
            raise typer.BadParameter(f"{len(matches)} live operator keys match {key_prefix!r}; give more characters "
                                     "(`operator-keys list` shows them)", param_hint="KEY_PREFIX")
        matches[0].revoked_at = utcnow()
        s.commit()
        revoked = matches[0].key_prefix
    console.print(f"operator key {revoked}... revoked")
