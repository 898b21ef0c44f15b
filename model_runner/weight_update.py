"""Weights replaced while the model serves: from a checkpoint folder, from tensors a trainer hands over, or broadcast
by a trainer over a process group of its own (SGLang's RL calls, docs/rl.md).

Every path copies into the parameters the model already has (`load_weights`, which takes each rank's shard), so
every pointer stays valid: CUDA graphs captured on them replay the new values. The CPU kernels' packed copies of a
weight (model_runner/cpu/) are derived from it; `refresh_weight_copies` makes them again after every update.

Names and shapes are checked against the checkpoint layout before the first copy, so a bad request changes no weight.
What the old weights computed (the prefix cache) is the scheduler's to drop (scheduler/weights.py).

Weight-update groups: the trainer's rank 0 and every engine rank (rank `rank_offset + tp_rank`) meet at
`master_address:master_port` (a TCPStore the trainer hosts) and form a process group of their own, gloo on the CPU or
NCCL on GPUs, apart from the tensor-parallel group. The trainer broadcasts each tensor from rank 0.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from radixserve.model_runner.loader import iter_weights
from radixserve.model_runner.loader.weights import dummy_weight_shapes
from radixserve.model_runner.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Tensors the loader skips whatever the model (rotary tables some checkpoints carry).
_IGNORED = ("rotary_emb.inv_freq",)
GROUP_TIMEOUT_S = 600.0


def refresh_weight_copies(model: torch.nn.Module) -> int:
    """Remake every derived copy of a weight (packed CPU layouts) from the weights' current values; returns how many
    modules held one."""
    refreshed = 0
    for module in model.modules():
        refresh = getattr(module, "refresh", None)
        if callable(refresh):
            refresh()
            refreshed += 1
    return refreshed


def check_named_tensors(config: ModelConfig, named: list[tuple[str, torch.Tensor]]) -> None:
    """ValueError unless every name is a checkpoint tensor of this model with the checkpoint's (whole) shape."""
    shapes = dummy_weight_shapes(config)
    for name, tensor in named:
        if any(part in name for part in _IGNORED):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in shapes:
            raise ValueError(f"weight {name!r} is not a tensor of this {config.architecture} checkpoint")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)}, the model expects {shapes[name]}")
        if not tensor.is_floating_point():
            raise ValueError(f"weight {name!r}: dtype {tensor.dtype} is not a floating-point type")


class WeightUpdater:
    """A ModelRunner's weight updates and weight-update groups."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.groups: dict[str, tuple[dist.ProcessGroup, torch.device]] = {}  # name -> (group, its tensors' device)

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @torch.no_grad()
    def load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy the given checkpoint tensors (whole, under Hugging Face names) into the model; each rank keeps its
        shard. A subset of the weights is fine. ValueError (nothing changed) for a name or shape the model lacks."""
        check_named_tensors(self.runner.model_config, named)
        self.model.load_weights(((name, tensor.to(self.runner.dtype)) for name, tensor in named), strict=False)
        refresh_weight_copies(self.model)

    @torch.no_grad()
    def load_from_disk(self, model_path: str, load_format: Optional[str]) -> None:
        """Every weight from the safetensors of `model_path`, which must hold the same architecture and shapes
        (ValueError otherwise, before any weight changes; FileNotFoundError without weights)."""
        config = ModelConfig.from_path(model_path)
        ours = self.runner.model_config
        if (config.architecture, config.num_hidden_layers, config.hidden_size, config.vocab_size) != (
                ours.architecture, ours.num_hidden_layers, ours.hidden_size, ours.vocab_size):
            raise ValueError(f"{model_path} holds a {config.architecture} of other shapes than the served "
                             f"{ours.architecture}; only the weights can change, not the model")
        shapes = dummy_weight_shapes(ours)
        for name, tensor in iter_weights(model_path, lazy=True):
            expected = shapes.get(name)
            if expected is not None and tuple(tensor.get_shape()) != expected:
                raise ValueError(f"{model_path}: weight {name!r} has shape {tuple(tensor.get_shape())}, the model "
                                 f"expects {expected}")
        self.model.load_weights(iter_weights(model_path, lazy=self.runner.tp.size > 1))
        refresh_weight_copies(self.model)

    def parameter(self, name: str, truncate_size: int) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (its rows inside a fused projection), first
        `truncate_size` rows, on the CPU. ValueError for an unknown name."""
        target, rows = self.model.locate_weight(name)
        params = dict(self.model.named_parameters())
        if target not in params:
            raise ValueError(f"no weight named {name!r} in this model")
        value = params[target].detach()
        if rows is not None:
            value = value[rows[0]:rows[1]]
        return value[:truncate_size].to("cpu", copy=True)

    # ---- weight-update groups ------------------------------------------------------------------------
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> None:
        """Join the trainer's group as rank `rank_offset + tp_rank` (blocks until every member joined)."""
        if group_name in self.groups:
            raise ValueError(f"a weight-update group named {group_name!r} exists already; destroy it first")
        rank = rank_offset + self.runner.tp.rank
        if not 0 < rank < world_size:
            raise ValueError(f"rank_offset {rank_offset} puts tensor-parallel rank {self.runner.tp.rank} at rank "
                             f"{rank}, outside 1..{world_size - 1} (rank 0 is the trainer's)")
        if backend == "nccl" and self.runner.device.type != "cuda":
            raise ValueError("backend nccl needs CUDA devices; this engine runs on the CPU (use gloo)")
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore(group_name, store)
        if backend == "nccl":
            group, device = dist.ProcessGroupNCCL(store, rank, world_size), self.runner.device
        else:
            group, device = dist.ProcessGroupGloo(store, rank, world_size, timeout), torch.device("cpu")
        self.groups[group_name] = (group, device)
        logger.info("joined weight-update group %s as rank %d of %d (%s)", group_name, rank, world_size, backend)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                group_name: str) -> list[tuple[str, torch.Tensor]]:
        """The tensors the trainer broadcasts from rank 0 of `group_name`, in order. The caller checks names, dtypes
        and shapes first (`check_broadcast`): every member must take part in every broadcast."""
        group, device = self.groups[group_name]
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([tensor], options).wait()
            received.append((name, tensor))
        return received

    def check_broadcast(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str) -> None:
        """ValueError for an update this engine cannot take part in (before any broadcast is joined)."""
        if group_name not in self.groups:
            raise ValueError(f"no weight-update group named {group_name!r}; call init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                             f"{len(shapes)})")
        for dtype in dtypes:
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
        check_named_tensors(self.runner.model_config,
                            [(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
                             for name, dtype, shape in zip(names, dtypes, shapes)])

    def destroy_group(self, group_name: str) -> None:
        entry = self.groups.pop(group_name, None)
        if entry is None:
            raise ValueError(f"no weight-update group named {group_name!r}")
        group = entry[0]
        shutdown = getattr(group, "shutdown", None)
        if callable(shutdown):
            shutdown()

