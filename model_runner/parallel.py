"""Tensor parallelism inside the model: how each weight is split across ranks, and the collectives.

Megatron's split, one all-reduce per sub-layer:

- q/k/v: column-parallel by heads. Rank r holds query heads `[r*H/tp, (r+1)*H/tp)`. With `tp <= Hkv` it holds
  KV heads `[r*Hkv/tp, (r+1)*Hkv/tp)`; with `tp > Hkv` (tp a multiple of Hkv) every rank holds one KV head,
  `r * Hkv // tp`, replicated over the `tp / Hkv` ranks whose query heads read it. Attention is then local.
- o_proj, down_proj: row-parallel (input features split), partial sums all-reduced; a bias is added after.
- gate/up: column-parallel by intermediate features (the SiLU-and-multiply is elementwise, hence local).
- embedding and LM head: vocab-parallel, `ceil(V/tp)` rows per rank (the last shard zero-padded). The
  embedding looks up only its own ids and all-reduces (exactly one rank contributes each row, so the sum is
  exact); the LM head computes its vocabulary slice and all-gathers the logits, identical on every rank.

`TPGroup` carries the rank, the size and the process group; `TPGroup.single()` (size 1) turns every
collective into a no-op, so a model built without TP runs unchanged.

Expert parallelism (`ep_size`, SGLang's `--ep-size`) shards a mixture of experts' routed experts inside the TP
group: `ExpertShard` says which whole experts a rank holds and which slice of their intermediate dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (`group` None: the default process group)."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None
    ep_size: int = 1  # expert-parallel ranks inside the group (a divisor of `size`); see ExpertShard

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place); `x` itself when alone."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                           group=self.group)
        return x


@dataclass(frozen=True)
class HeadLayout:
    """Which heads of a layer one rank holds: query heads `[q_start, q_start + num_heads)` and KV heads
    `[kv_start, kv_start + num_kv_heads)` of the full model."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int

    @classmethod
    def of(cls, total_heads: int, total_kv_heads: int, tp: TPGroup) -> "HeadLayout":
        check_tp_divides(total_heads, total_kv_heads, tp.size)
        num_heads = total_heads // tp.size
        if tp.size <= total_kv_heads:
            num_kv = total_kv_heads // tp.size
            kv_start = tp.rank * num_kv
        else:  # each rank keeps the one KV head its query heads attend to
            num_kv = 1
            kv_start = tp.rank * total_kv_heads // tp.size
        return cls(num_heads, num_kv, tp.rank * num_heads, kv_start)


def check_tp_divides(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """ValueError naming the numbers unless the heads split evenly over `tp_size` ranks."""
    if num_heads % tp_size != 0:
        raise ValueError(f"tp_size {tp_size} does not divide the model's {num_heads} attention heads")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size != 0:
        raise ValueError(f"tp_size {tp_size} does not divide the model's {num_kv_heads} KV heads")
    if tp_size > num_kv_heads and tp_size % num_kv_heads != 0:
        raise ValueError(
            f"tp_size {tp_size} exceeds the model's {num_kv_heads} KV heads and is not a multiple of them, "
            "so KV heads cannot be replicated evenly")


def split_size(total: int, tp: TPGroup, what: str) -> int:
    """`total / tp.size`, or ValueError naming `what` when it does not divide."""
    if total % tp.size != 0:
        raise ValueError(f"tp_size {tp.size} does not divide the model's {what} ({total})")
    return total // tp.size


def check_ep_divides(num_experts: Optional[int], tp_size: int, ep_size: int) -> None:
    """ValueError naming the numbers unless `ep_size` divides both `tp_size` and the model's routed experts
    (`num_experts` None: a dense model, which has no experts to shard)."""
    if ep_size < 1 or tp_size % ep_size != 0:
        raise ValueError(f"ep_size {ep_size} does not divide tp_size {tp_size}: the expert-parallel ranks are "
                         "ranks of the tensor-parallel group")
    if ep_size == 1:
        return
    if num_experts is None:
        raise ValueError(f"ep_size {ep_size} shards a mixture-of-experts model's experts, and this model is dense: "
                         "leave ep_size at 1")
    if num_experts % ep_size != 0:
        raise ValueError(f"ep_size {ep_size} does not divide the model's {num_experts} experts")


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one rank holds: experts `[first_expert, first_expert + num_local_experts)` whole in
    their hidden dimension, rows `[intermediate_start, intermediate_start + intermediate_size)` of each one's
    intermediate dimension (of `intermediate_size * num_slices`).

    SGLang's layout: the `tp` ranks form `ep` groups of `tp / ep` consecutive ranks; group g holds experts
    `[g*E/ep, (g+1)*E/ep)`, split over its ranks by intermediate features as tensor parallelism splits a dense
    MLP. `ep == 1` is plain tensor parallelism (every rank a slice of every expert); `ep == tp` gives every rank
    E/tp whole experts. Either way each rank's experts give a partial sum of the layer's output and the TP
    all-reduce completes it.
    """

    num_experts: int  # of the model: the router's ids run over these
    first_expert: int
    num_local_experts: int
    intermediate_start: int
    intermediate_size: int  # this rank's rows of each local expert
    num_slices: int  # ranks sharing each expert (tp / ep)

    @classmethod
    def of(cls, num_experts: int, intermediate_size: int, tp: TPGroup) -> "ExpertShard":
        check_ep_divides(num_experts, tp.size, tp.ep_size)
        num_slices = tp.size // tp.ep_size
        ep_rank, slice_rank = divmod(tp.rank, num_slices)
        if intermediate_size % num_slices != 0:
            raise ValueError(f"tp_size {tp.size} / ep_size {tp.ep_size} = {num_slices} does not divide the model's "
                             f"experts' intermediate size ({intermediate_size})")
        per_rank = num_experts // tp.ep_size
        local = intermediate_size // num_slices
        return cls(num_experts, ep_rank * per_rank, per_rank, slice_rank * local, local, num_slices)

    def holds(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local_experts


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first id, end id within the vocabulary, padded rows per rank) of this rank's vocabulary slice."""
    per_rank = -(-vocab_size // tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding of this rank's vocabulary slice; ids outside it contribute zeros, the all-reduce fills them."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.end, per_rank = vocab_shard(vocab_size, tp)
        self.weight = torch.nn.Parameter(torch.empty(per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.end)
        local = torch.where(outside, torch.zeros_like(input_ids), input_ids - self.start)
        hidden = torch.nn.functional.embedding(local, self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)


class RowParallelLinear(torch.nn.Module):
    """`x @ W.T (+ b)` with `W`'s input features split over the ranks: local product, all-reduce, then bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(torch.nn.functional.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def plain_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Module]]:
    """`(parent name, parent, attribute, layer)` for each `nn.Linear` and `RowParallelLinear` of `model` (exactly those
    types: layers already replaced by another kind are not listed), for passes that swap in other linears."""
    return [(parent_name, parent, name, child) for parent_name, parent in model.named_modules()
            for name, child in parent.named_children() if type(child) in (torch.nn.Linear, RowParallelLinear)]


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Float32 logits over the whole vocabulary from this rank's (padded) slice of the LM head."""
    local = torch.nn.functional.linear(hidden, weight)
    return tp.all_gather_last(local)[..., :vocab_size].float()


def narrow_source(tensor: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (`dim` 0) or columns (`dim` 1) `[start, start + length)` of a tensor or of a lazy safetensors
    slice, reading only that part from a slice."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, length)
    index = (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
    return tensor[index]


def full_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


# ---- joining the group ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TPContext:
    """What one rank needs after joining: the device it runs on, the model's group (NCCL on CUDA, gloo on CPU)
    and a separate gloo group for the scheduler's object broadcasts (so they never interleave with the
    forward pass's collectives, which under overlap run on another thread)."""

    device: torch.device
    tp: TPGroup
    cpu_group: Optional[Any]
    rendezvous: Optional[Any] = None  # model_runner/rendezvous.py's Rendezvous: the store and its forwarder


@dataclass(frozen=True)
class ReplicaPlacement:
    """Which data-parallel replica a rank belongs to: replica i uses the host's CUDA devices
    [i * ranks_per_node, (i + 1) * ranks_per_node), or on the CPU a 1/num_replicas share of the cores."""

    dp_rank: int = 0
    num_replicas: int = 1


def join_tp_group(
    tp_size: int, rank: int, init_addr: str, device_type: str, timeout_s: float, ranks_per_node: int,
    replica: ReplicaPlacement = ReplicaPlacement(), ep_size: int = 1, secret: Optional[bytes] = None,
) -> TPContext:
    """Join (create, for rank 0) the process group of `tp_size` ranks at `init_addr` ("host:port"); this host
    runs `ranks_per_node` of them (of each replica), each on its own CUDA device (local index
    `replica.dp_rank * ranks_per_node + rank % ranks_per_node`). `ep_size` of them shard the experts. With the
    group's `secret` the ranks meet through the authenticated rendezvous (model_runner/rendezvous.py)."""
    import datetime
    import os

    from radixserve.model_runner.rendezvous import gloo_bound_to, meet

    device = torch.device(device_type)
    if device_type == "cuda":
        count = torch.cuda.device_count()
        needed = ranks_per_node * replica.num_replicas
        if needed > count:
            raise ValueError(f"tp_size {tp_size} x dp_size {replica.num_replicas} puts {needed} ranks on this "
                             f"host, which has only {count} CUDA devices")
        if tp_size > 1 or replica.num_replicas > 1:
            device = torch.device("cuda", replica.dp_rank * ranks_per_node + rank % ranks_per_node)
            torch.cuda.set_device(device)
    elif tp_size > 1 or replica.num_replicas > 1:  # the ranks of every replica share this host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (ranks_per_node * replica.num_replicas)))
    if tp_size == 1:
        return TPContext(device, TPGroup.single(), None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    rendezvous = meet(init_addr, rank, tp_size, timeout_s, secret)
    with gloo_bound_to(init_addr, multi_node=ranks_per_node < tp_size):
        dist.init_process_group(backend, store=rendezvous.store, world_size=tp_size, rank=rank, timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    # NCCL creates its communicator on the first collective; have that happen now, not inside a CUDA graph
    # capture (where it cannot).
    dist.all_reduce(torch.zeros(1, device=device))
    return TPContext(device, TPGroup(rank, tp_size, None, ep_size), cpu_group, rendezvous)


def min_over_ranks(value: int, cpu_group: Optional[Any]) -> int:
    """The smallest `value` of all ranks (every rank must call it); `value` itself without a group."""
    if cpu_group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=cpu_group)
    return int(tensor.item())
