"""What a request asks for: its kind, stored in every request row and queued with it.

The values are the strings the database rows and Redis messages have always held (RequestKind is a
str, so rows and messages written before it existed read the same).
"""

from __future__ import annotations

from enum import StrEnum


class RequestKind(StrEnum):
    CREATE_MODEL = "create_model"
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    LOAD_WEIGHTS = "load_weights"
    # A request refused at the door, or a seq_id that never arrived: it runs nothing, only passes its
    # seq_id, with its recorded error as the outcome (scheduler/service.py).
    REJECTED = "rejected"
    # Samples bypass the trainer's seq_id order: the sampling dispatcher runs them (scheduler/sampling.py).
    SAMPLE = "sample"


# Operations that only read weights and add to gradients: consecutive ones of one model commute
# with each other, so a run of them can share one engine call.
BATCHABLE_KINDS = (RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD)
# Operations that give a model a new training state, whatever it held before: a model's history
# (what a replay starts from) begins at the last of them.
STARTS_HISTORY = (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS)
