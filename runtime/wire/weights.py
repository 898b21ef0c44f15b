"""Post-training on the wire: weight updates, memory release and resume, pause and continue (SGLang's RPCs and
their arguments, docs/rl.md).

    UpdateWeightsFromDiskReq         reload every weight from a checkpoint folder of the same architecture
    UpdateWeightsFromTensorReq       copy the given tensors (Hugging Face names) into the model
    InitWeightsUpdateGroupReq        join a trainer's process group (rank_offset + TP rank; the trainer is rank 0)
    UpdateWeightsFromDistributedReq  receive tensors broadcast by the trainer's rank 0 in that group
    DestroyWeightsUpdateGroupReq     leave it
    GetWeightsByNameReq              read a weight back (this rank's part of it)
    ReleaseMemoryOccupationReq       free the KV pool (tag "kv_cache") and/or the weights ("weights")
    ResumeMemoryOccupationReq        take them back
    PauseGenerationReq               stop scheduling: "abort" the requests, "retract" them to the queue, or keep them
                                     "in_place"
    ContinueGenerationReq            schedule again

Every one is answered with a `ControlReqOutput` (a `GetWeightsByNameReqOutput` for the read). A tensor crosses the
socket as a `TensorPayload`: its dtype's name, shape and raw bytes (no pickle; runtime/tensor_payload.py converts).

Light module: msgspec only.
"""

from __future__ import annotations

from typing import Optional

import msgspec

MEMORY_TAGS = ("kv_cache", "weights")
PAUSE_MODES = ("abort", "retract", "in_place")
UPDATE_GROUP_BACKENDS = ("gloo", "nccl")
LOAD_FORMATS = (None, "auto", "safetensors")
DEFAULT_WEIGHT_VERSION = "default"


class TensorPayload(msgspec.Struct, array_like=True):
    name: str
    dtype: str  # torch's name without the "torch." prefix: "float32", "bfloat16", ...
    shape: list[int]
    data: bytes


class UpdateWeightsFromDiskReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    model_path: str
    load_format: Optional[str] = None
    weight_version: Optional[str] = None  # the version to report afterwards (None: the update count)


class UpdateWeightsFromTensorReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    named_tensors: list[TensorPayload]
    load_format: Optional[str] = None
    flush_cache: bool = True
    weight_version: Optional[str] = None


class InitWeightsUpdateGroupReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class UpdateWeightsFromDistributedReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: Optional[str] = None


class DestroyWeightsUpdateGroupReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    group_name: str = "weight_update_group"


class GetWeightsByNameReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    name: str
    truncate_size: int = 100


class GetWeightsByNameReqOutput(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    success: bool
    message: str = ""
    parameter: Optional[TensorPayload] = None  # its first `truncate_size` rows (this rank's part under TP)


class ReleaseMemoryOccupationReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    tags: Optional[list[str]] = None  # None: every tag of MEMORY_TAGS


class ResumeMemoryOccupationReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    tags: Optional[list[str]] = None


class PauseGenerationReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str
    mode: str = "abort"


class ContinueGenerationReq(msgspec.Struct, tag=True, kw_only=True):
    rpc_id: str


class ControlReqOutput(msgspec.Struct, tag=True, kw_only=True):
    """The answer to every request of this module but the read: whether it worked, why not (`status_code` 400 for a
    request that cannot be honoured as asked), and the weight version afterwards."""

    rpc_id: str
    success: bool
    message: str = ""
    weight_version: str = DEFAULT_WEIGHT_VERSION
    status_code: int = 200


def check_tags(tags: Optional[list[str]]) -> list[str]:
    """The memory tags a release or resume acts on (ValueError for an unknown one)."""
    if tags is None:
        return list(MEMORY_TAGS)
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"tags: unknown memory tag(s) {unknown}; expected some of {list(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


CONTROL_REQUESTS = (
    UpdateWeightsFromDiskReq, UpdateWeightsFromTensorReq, InitWeightsUpdateGroupReq, UpdateWeightsFromDistributedReq,
    DestroyWeightsUpdateGroupReq, GetWeightsByNameReq, ReleaseMemoryOccupationReq, ResumeMemoryOccupationReq,
    PauseGenerationReq, ContinueGenerationReq,
)
