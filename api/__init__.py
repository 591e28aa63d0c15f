"""The HTTP API: the Tinker wire protocol under /api/v1 (docs/protocol.md, section "Transport")."""
