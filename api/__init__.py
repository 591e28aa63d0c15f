"""The HTTP API: the Tinker wire protocol under /api/v1 (see ../shared/tinker-protocol.md)."""
