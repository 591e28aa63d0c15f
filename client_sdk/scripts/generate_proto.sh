#!/usr/bin/env bash
# Regenerate loraplex/wire/tinker_public_pb2.py(.pyi) from tinker_public.proto.
# Needs the dev extra: pip install -e 'client_sdk[dev]'  (grpcio-tools==1.81.1).
# The proto is compiled from its own folder so that its descriptor file name is
# "tinker_public.proto", as in the official SDK: both generated modules then register an
# identical file in protobuf's default pool and can be imported in one process.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wire="$here/src/loraplex/wire"
python="${PYTHON:-python}"
# Resolve a relative interpreter path before the cd below.
if [[ "$python" == */* ]]; then python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"; fi
cd "$wire"
"$python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. tinker_public.proto
echo "generated: $wire/tinker_public_pb2.py $wire/tinker_public_pb2.pyi"
