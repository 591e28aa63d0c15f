"""Integer fields of requests, bounded by what the wire and the databases hold: a larger value
(seq_id 10**30, seed 2**70) used to reach the database or vLLM and come back as a 500."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

INT32_MAX = 2**31 - 1  # seq_id is int32 on the wire (tinker_public.proto)
INT64_MAX = 2**63 - 1  # a BIGINT column; what torch and vLLM take as a seed

SeqId = Annotated[int, Field(ge=1, le=INT32_MAX)]  # a training request's place in its model's order
SessionSeq = Annotated[int, Field(ge=0, le=INT32_MAX)]  # model_seq_id, sampling_session_seq_id
Seed = Annotated[int, Field(ge=0, le=INT64_MAX)]
