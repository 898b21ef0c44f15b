"""What the mixture-of-experts families share on top of the Llama decoder: the per-layer choice between the sparse
block and a dense MLP, and loading each expert's checkpoint tensors into the stacked `[E, ...]` parameters.

Checkpoints store one tensor per expert and projection (`mlp.experts.<e>.gate_proj.weight`, ...); `FusedMoE` holds
`w13_weight [E, 2I, H]` (gate rows, then up rows) and `w2_weight [E, H, I]`. Under tensor parallelism each rank
copies only its slice of every expert's intermediate dimension (read lazily from the safetensors file); under expert
parallelism only its own experts (`FusedMoE.shard`): another rank's expert tensors are passed over unread. Quantized
experts load as the quantized loader hands them over (model_runner/quantization/loader.py): FP8 (`FusedMoE.keep_fp8`)
as `<...>.weight` and its scales `<...>.weight_scale`, in the layout `FusedMoE` holds; 4-bit (`FusedMoE.keep_int4`) as
`Int4Weight`'s `qweight`, scales and zero points under `.weight`, `.weight_scale`, `.weight_zeros`. Each is cut to the
rank's slice in its own units.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

from torch import nn

from radixserve.model_runner.models.llama import LlamaForCausalLM, LlamaMLP
from radixserve.model_runner.moe import FusedMoE, SparseMoeBlock
from radixserve.model_runner.parallel import TPGroup, full_shape, narrow_source

if TYPE_CHECKING:
    from radixserve.model_runner.model_config import ModelConfig

_EXPERT_TENSOR = re.compile(
    r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_zeros)$")


def sparse_or_dense_mlp(config: "ModelConfig", layer_id: int, tp: TPGroup) -> nn.Module:
    """The sparse block on the config's sparse layers, a dense MLP of `intermediate_size` on the others
    (Qwen's `mlp_only_layers` and `decoder_sparse_step`)."""
    if config.moe is not None and layer_id in config.moe.sparse_layers:
        return SparseMoeBlock(config.hidden_size, config.moe, tp)
    return LlamaMLP(config.hidden_size, config.intermediate_size, tp)


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-style causal LM whose layers may hold `SparseMoeBlock`s; loads per-expert checkpoint tensors.

    Shard ids of the stacked parameters (for the loader's completeness check), by the model's expert ids: `w13_weight`
    shard `2e` is expert e's gate, `2e + 1` its up; `w2_weight` shard `e` is expert e's down. A rank expects the
    shards of the experts it holds (and of their scales, for FP8 experts).
    """

    # The quantized loader may keep the experts quantized (model_runner/quantization/loader.py): this loader takes them.
    loads_quantized_experts = True
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # the family's checkpoint names -> the names loaded here

    def expert_of(self, hf_name: str) -> Optional[tuple[str, int, str]]:
        """`expert_tensor_parts` of a checkpoint tensor's name as the checkpoint spells it."""
        for old, new in self.checkpoint_renames:
            hf_name = hf_name.replace(old, new)
        return expert_tensor_parts(hf_name)

    def _expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, int]]:
        expected = super()._expected_shards(params)
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                experts = range(module.shard.first_expert, module.shard.first_expert + module.shard.num_local_experts)
                expected -= {(f"{name}.w13_weight", -1), (f"{name}.w2_weight", -1)}
                stacked = ["weight"] + (["weight_scale"] if module.scale_blocks is not None else []) + (
                    ["weight_zeros"] if module.is_int4 else [])
                expected -= {(f"{name}.{w}_{tensor}", -1) for w in ("w13", "w2")
                             for tensor in ("weight_scale", "weight_zeros")}
                for tensor in stacked:
                    expected.update((f"{name}.w13_{tensor}", 2 * e + part) for e in experts for part in (0, 1))
                    expected.update((f"{name}.w2_{tensor}", e) for e in experts)
        return expected

    def _load_tensor(self, hf_name: str, tensor, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        parts = expert_tensor_parts(hf_name)
        if parts is None:
            return super()._load_tensor(hf_name, tensor, params)
        prefix, expert, projection = parts
        if f"{prefix}.w13_weight" not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
        parameter, shard = load_expert_tensor(self.get_submodule(prefix), hf_name, expert, projection, tensor)
        return f"{prefix}.{parameter}", shard


def expert_tensor_parts(name: str) -> Optional[tuple[str, int, str]]:
    """(the experts' module path, expert id, projection) of one expert's checkpoint tensor
    (`<prefix>.experts.<e>.<gate_proj|up_proj|down_proj>.weight`, or `.weight_scale` / `.weight_zeros` for quantized
    experts); None for any other name."""
    match = _EXPERT_TENSOR.match(name)
    return None if match is None else (match.group(1), int(match.group(2)), match.group(3))


def load_expert_tensor(experts: FusedMoE, hf_name: str, expert: int, projection: str, tensor) -> tuple[str, int]:
    """Copy this rank's part of expert `expert`'s `projection` into the stacked parameters of `experts`; returns the
    parameter's name inside `experts` and the shard it filled (see `MoEForCausalLM`). Another expert-parallel rank's
    expert is passed over unread."""
    if expert >= experts.num_experts:
        raise ValueError(f"checkpoint tensor {hf_name!r} names expert {expert} of {experts.num_experts}")
    layout = experts.shard
    suffix = hf_name.rsplit(".", 1)[-1]
    if projection == "down_proj":
        target, shard = f"w2_{suffix}", expert
    else:
        target, shard = f"w13_{suffix}", 2 * expert + (0 if projection == "gate_proj" else 1)
    if not layout.holds(expert):
        return target, shard  # another expert-parallel rank's: its lazy slice is never indexed, so never read
    _copy_expert_tensor(experts, hf_name, expert - layout.first_expert, projection, suffix, tensor)
    return target, shard


def _copy_expert_tensor(experts: FusedMoE, hf_name: str, index: int, projection: str, suffix: str,
                        tensor) -> None:
    """Copy this rank's slice of one expert tensor into local expert `index`: a 16-bit weight (converted to the
    model's dtype), or a quantized one's weight, scales or zero points (`suffix`, never converted), each cut in its own
    units (values, words of 8, scale blocks or groups)."""
    stacked = getattr(experts, f"{'w2' if projection == 'down_proj' else 'w13'}_{suffix}")
    if stacked is None:
        raise ValueError(f"checkpoint tensor {hf_name!r} belongs to quantized experts, but the experts load in 16 bits")
    layout, down = experts.shard, projection == "down_proj"
    part = 1 if projection == "up_proj" else 0
    if experts.is_int4:  # [E, K / 8 or groups, N]: gate and up side by side along N, down cut along K
        if down:
            unit = 8 if suffix == "weight" else experts.scale_blocks[1][1]
            destination, dim = stacked.data[index], 0
        else:
            columns = stacked.shape[2] // 2
            destination, dim, unit = stacked.data[index, :, part * columns:(part + 1) * columns], 1, 1
    else:  # 16-bit or FP8 [E, N, K] (FP8 scales [E, N / bn, K / bk]): gate's rows, then up's; down cut along K
        unit = 1
        if suffix == "weight_scale":
            block = experts.scale_blocks[1 if down else 0]
            unit = block[1] if down else block[0]
        if down:
            destination, dim = stacked.data[index], 1
        else:
            rows = stacked.shape[1] // 2
            destination, dim = stacked.data[index, part * rows:(part + 1) * rows], 0
    whole = list(destination.shape)
    whole[dim] = -(-layout.intermediate_size * layout.num_slices // unit)
    if tuple(whole) != full_shape(tensor):
        raise ValueError(f"shape mismatch for {hf_name!r}: checkpoint {full_shape(tensor)}, model expects "
                         f"{tuple(whole)}")
    source = narrow_source(tensor, dim, layout.intermediate_start // unit, destination.shape[dim])
    if experts.scale_blocks is not None and source.dtype != destination.dtype:
        raise ValueError(f"{hf_name!r} is {source.dtype}, the quantized experts hold {destination.dtype}")
    destination.copy_(source)


def rename_tensors(weights, renames: tuple[tuple[str, str], ...]):
    """The checkpoint's `(name, tensor)` pairs with each `old` substring of a name replaced by `new`."""
    for name, tensor in weights:
        for old, new in renames:
            name = name.replace(old, new)
        yield name, tensor
