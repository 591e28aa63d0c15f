"""Tinker-compatible wire format: the ``tinker_public`` protobuf schema and numpy codecs.

``tinker_public_pb2`` is generated from ``tinker_public.proto`` by
``client_sdk/scripts/generate_proto.sh``; its descriptor is byte-identical to the one in the
official ``tinker`` SDK, so both can be imported in one process.
"""

from .codec import *  # noqa: F403 -- the codec's public API, listed once in codec.__all__
from .codec import __all__  # noqa: F401
