"""The Engine's post-training calls, in SGLang's names and arguments (docs/rl.md maps each to its use in verl and
slime):

    update_weights_from_disk(model_path, load_format=None)
    update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)
    init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name, backend)
    update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache=True)
    destroy_weights_update_group(group_name)
    get_weights_by_name(name, truncate_size=100)
    release_memory_occupation(tags=None) / resume_memory_occupation(tags=None)
    pause_generation(mode="abort") / continue_generation()

Each returns `(success, message)` as SGLang's Engine does (`get_weights_by_name`: the values, a nested list). The HTTP routes
(runtime/http/weights_api.py) await `Engine.async_post_training` with the same requests. A call reaches every scheduler (every TP rank, every DP
replica) and succeeds only if all of them did (scheduler/weights.py says what each does there).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from radixserve.runtime.wire.weights import (
    ContinueGenerationReq, DestroyWeightsUpdateGroupReq, GetWeightsByNameReq, InitWeightsUpdateGroupReq,
    PauseGenerationReq, ReleaseMemoryOccupationReq, ResumeMemoryOccupationReq, UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq,
)

NamedTensors = Sequence[tuple[str, Any]]  # (Hugging Face name, torch.Tensor)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class PostTrainingCalls:
    """Mixed into the Engine, which provides `_post_training(request_type, **fields)`: the schedulers' merged reply
    to a request of runtime/wire/weights.py."""

    def _post_training(self, request_type: type, **fields: Any) -> Any:
        raise NotImplementedError

    # ---- weights -------------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Reload every weight from the safetensors of `model_path` (the same architecture and shapes)."""
        return _outcome(self._post_training(UpdateWeightsFromDiskReq, model_path=model_path, load_format=load_format,
                                            weight_version=weight_version))

    def update_weights_from_tensor(self, named_tensors: NamedTensors, load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Copy `named_tensors` (whole checkpoint tensors under Hugging Face names; any subset) into the model."""
        from radixserve.runtime.tensor_payload import tensor_payload  # torch: only for the callers that hold tensors

        payloads = [tensor_payload(name, tensor) for name, tensor in named_tensors]
        return _outcome(self._post_training(UpdateWeightsFromTensorReq, named_tensors=payloads,
                                            load_format=load_format, flush_cache=flush_cache,
                                            weight_version=weight_version))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo") -> tuple[bool, str]:
        """Join the trainer's process group (the trainer is rank 0; TP rank r joins as `rank_offset + r`). Blocks
        until every member joined: the trainer joins from its own process meanwhile."""
        return _outcome(self._post_training(InitWeightsUpdateGroupReq, master_address=master_address,
                                            master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                                            group_name=group_name, backend=backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Sequence[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Receive each tensor from the trainer's broadcast (rank 0 of `group_name`, in this order) and load it."""
        return _outcome(self._post_training(
            UpdateWeightsFromDistributedReq, names=list(names), dtypes=[_dtype_name(d) for d in dtypes],
            shapes=[list(shape) for shape in shapes], group_name=group_name, flush_cache=flush_cache,
            weight_version=weight_version))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        return _outcome(self._post_training(DestroyWeightsUpdateGroupReq, group_name=group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of checkpoint tensor `name` as served (rank 0's part under TP), as a
        nested list. Raises ValueError for an unknown name."""
        from radixserve.runtime.tensor_payload import payload_tensor

        reply = self._post_training(GetWeightsByNameReq, name=name, truncate_size=truncate_size)
        if not reply.success:
            raise ValueError(reply.message)
        return payload_tensor(reply.parameter).float().tolist()

    # ---- memory and flow -----------------------------------------------------------------------------
    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> tuple[bool, str]:
        """Free the KV pool ("kv_cache") and/or the weights ("weights"); None: both. No batch runs until resumed."""
        return _outcome(self._post_training(ReleaseMemoryOccupationReq, tags=tags))

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> tuple[bool, str]:
        return _outcome(self._post_training(ResumeMemoryOccupationReq, tags=tags))

    def pause_generation(self, mode: str = "abort") -> tuple[bool, str]:
        """Stop running batches: "abort" the requests, "retract" the running ones to the queue, or keep them
        "in_place"."""
        return _outcome(self._post_training(PauseGenerationReq, mode=mode))

    def continue_generation(self) -> tuple[bool, str]:
        return _outcome(self._post_training(ContinueGenerationReq))


def _outcome(reply: Any) -> tuple[bool, str]:
    return reply.success, reply.message
