"""Loraplex client SDK.

Today this package holds only :mod:`loraplex.wire`, the Tinker-compatible wire format
(protobuf schema, generated bindings and numpy codecs) shared by the Loraplex server and,
later, the notebook SDK. It depends on protobuf, zstandard and numpy only (no torch).
"""

__version__ = "0.1.0"
