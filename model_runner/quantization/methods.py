"""Quantization methods: which checkpoint tensors make one quantized linear, how they become the runtime's layout,
and which product runs it. One method per model, chosen by `quantization_method` from the checkpoint's
`quantization_config` and `--quantization`:

| format (config `quant_method`)         | tensors of one linear                                   | method       |
| -------------------------------------- | ------------------------------------------------------- | ------------ |
| `--quantization fp8`, 16-bit checkpoint | `weight` (quantized at load, one scale per tensor)      | `Fp8Method`  |
| `--quantization w8a8_fp8`, same        | `weight` (quantized at load, one scale per channel)      | `Fp8Method`  |
| Hugging Face fine-grained FP8 (`fp8`)  | `weight` e4m3, `weight_scale_inv` per 128x128 block      | `Fp8Method`  |
| Hugging Face FP8 per tensor (`fp8`)    | `weight` e4m3, `weight_scale`, `input_scale` if static   | `Fp8Method`  |
| compressed-tensors `float-quantized`   | `weight` e4m3, `weight_scale` (tensor, channel, block)   | `Fp8Method`  |
| compressed-tensors `pack-quantized`    | `weight_packed`, `weight_scale`, `weight_zero_point`     | `Int4Method` |
| AWQ, GEMM layout (`awq`)               | `qweight`, `qzeros`, `scales`                            | `Int4Method` |
| GPTQ (`gptq`), act-order or not        | `qweight`, `qzeros`, `scales`, `g_idx`                   | `Int4Method` |

gpt-oss's MXFP4 experts (`mxfp4`) take no method: its loader dequantizes them to the model's dtype
(models/gpt_oss.py, quantization/mxfp4.py), and its other layers are 16-bit.

A method also quantizes random weights (`--load-format dummy`) into its layout, so large shapes can be measured
without a checkpoint. Anything else a config names is refused with the reason, never loaded as something it is not.
The two online spellings mean what they mean in SGLang: `fp8` one scale per weight and dynamic per-tensor activations,
`w8a8_fp8` one scale per output channel and dynamic per-token activations.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, Optional, Union

import torch

from radixserve.model_runner.quantization.fp8 import FP8_DTYPE, ActivationScheme, Fp8Weight, fp8_linear
from radixserve.model_runner.quantization.int4 import PACK_FACTOR, Int4Weight, int4_linear, pack_rows, unpack_rows

QuantizedWeight = Union[Fp8Weight, Int4Weight]

# AutoAWQ packs eight output features per word in this order: nibble j holds feature AWQ_ORDER[j] of the eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


try:  # the parser of Python's own re (its tree of repeats and branches); re._parser from Python 3.11
    from re import _parser as _regex_parser
except ImportError:  # Python 3.10
    import sre_parse as _regex_parser


def bounded_pattern(pattern: str) -> str:
    """A checkpoint's `re:` pattern, refused (ValueError) unless Python's backtracking `re` matches it in time linear in
    the name: no repeat of anything that itself repeats or branches, such as `(a+)+` or `(a|aa)*` (the patterns
    compressed-tensors writes, `re:.*lm_head`, `re:model.layers.\\d+.mlp.gate$`, pass). The pattern comes from a model
    file, which must not be able to stall the server's start."""
    try:
        parsed = _regex_parser.parse(pattern)
    except re.error as error:
        raise ValueError(f"checkpoint ignore pattern {pattern!r} is not a regular expression: {error}") from None

    def nested(items, inside_repeat: bool) -> bool:
        for op, value in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                if inside_repeat or nested(value[2], True):
                    return True
            elif name == "SUBPATTERN":
                if nested(value[-1], inside_repeat):
                    return True
            elif name == "BRANCH":
                if inside_repeat or any(nested(branch, inside_repeat) for branch in value[1]):
                    return True
            elif name in ("ASSERT", "ASSERT_NOT", "GROUPREF", "GROUPREF_EXISTS"):
                return True
        return False

    if len(pattern) > 256 or nested(parsed, False):
        raise ValueError(f"checkpoint ignore pattern {pattern!r} is refused: a repeat of a repeat or of alternatives "
                         f"(or a look-around or back-reference) can take exponential time in Python's re")
    return pattern


class LinearMethod(ABC):
    """How the quantized linears of one model load and multiply."""

    name: str
    suffixes: tuple[str, ...]  # the checkpoint tensors of one linear, after `module.` (biases load as usual)

    def __init__(self, ignored: tuple[str, ...] = ()) -> None:
        self.ignored = ignored  # module names (or `re:` patterns) the checkpoint keeps in 16 bits

    def quantizes(self, hf_module: str) -> bool:
        """Whether the checkpoint's linear `hf_module` (`model.layers.0.self_attn.q_proj`) is quantized."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(bounded_pattern(pattern[3:]), hf_module):
                    return False
            elif hf_module == pattern or hf_module.endswith("." + pattern) or ("." + pattern + ".") in hf_module:
                return False
        return True

    @abstractmethod
    def from_checkpoint(self, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The runtime layout of one linear from its checkpoint tensors (keys: `suffixes`)."""

    @abstractmethod
    def from_dense(self, weight: torch.Tensor) -> QuantizedWeight:
        """A float weight `[N, K]` quantized into this method's layout."""

    @abstractmethod
    def apply(self, weight: QuantizedWeight, x: torch.Tensor, tensor_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """`x [M, K] @ W.T` in x's dtype."""

    def describe(self) -> str:
        return self.name


class Fp8Method(LinearMethod):
    """FP8 e4m3 weights with activations quantized at each call (model_runner/quantization/fp8.py)."""

    def __init__(self, name: str, activation: ActivationScheme, block: Optional[tuple[int, int]] = None,
                 scale_name: str = "weight_scale", ignored: tuple[str, ...] = (), per_tensor: bool = False) -> None:
        super().__init__(ignored)
        self.name, self.activation, self.block, self.scale_name = name, activation, block, scale_name
        self.per_tensor = per_tensor  # a 16-bit weight quantized at load takes one scale (else one per channel)
        self.suffixes = ("weight", scale_name) + (("input_scale",) if activation is ActivationScheme.STATIC else ())

    def from_checkpoint(self, tensors: dict[str, torch.Tensor]) -> Fp8Weight:
        weight, scale = tensors["weight"], tensors[self.scale_name].float()
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{self.name}: expected float8_e4m3fn weights, the checkpoint holds {weight.dtype}")
        n, k = weight.shape
        if self.block is not None:
            expected = (-(-n // self.block[0]), -(-k // self.block[1]))
            if tuple(scale.shape) != expected:
                raise ValueError(f"{self.name}: block scales of shape {tuple(scale.shape)} for a {n}x{k} weight in "
                                 f"{self.block[0]}x{self.block[1]} blocks (expected {expected})")
            return Fp8Weight(weight, scale.contiguous(), self.block)
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(n).contiguous()
        elif scale.numel() != n:
            raise ValueError(f"{self.name}: a scale of shape {tuple(scale.shape)} for a {n}x{k} weight is neither per "
                             "tensor nor per output channel")
        input_scale = tensors["input_scale"].float().reshape(()) if "input_scale" in tensors else None
        return Fp8Weight(weight, scale.reshape(n), None, input_scale)

    def from_dense(self, weight: torch.Tensor) -> Fp8Weight:
        quantized = Fp8Weight.quantize(weight, self.block, self.per_tensor)
        if self.activation is ActivationScheme.STATIC:  # no calibration for random weights: a scale of 1
            quantized.input_scale = torch.ones((), device=weight.device)
        return quantized

    def apply(self, weight: Fp8Weight, x: torch.Tensor, tensor_scale: Optional[torch.Tensor]) -> torch.Tensor:
        return fp8_linear(x, weight, self.activation, tensor_scale)

    def describe(self) -> str:
        layout = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per channel"
        layout = "per tensor" if self.per_tensor else layout
        return f"{self.name} (FP8 weights {layout}, activations per {self.activation.value})"


class Int4Method(LinearMethod):
    """4-bit grouped weights, 16-bit activations (model_runner/quantization/int4.py). `layout` is the checkpoint's
    packing: "compressed-tensors", "awq" or "gptq"."""

    _SUFFIXES = {
        "compressed-tensors": ("weight_packed", "weight_scale"),
        "awq": ("qweight", "qzeros", "scales"),
        "gptq": ("qweight", "qzeros", "scales"),
    }

    def __init__(self, name: str, layout: str, group_size: int, dtype: torch.dtype, symmetric: bool = True,
                 zero_offset: int = 0, act_order: bool = False, ignored: tuple[str, ...] = ()) -> None:
        super().__init__(ignored)
        self.act_order = act_order  # each linear carries a g_idx that must load with it
        self.name, self.layout, self.group_size, self.dtype = name, layout, group_size, dtype
        self.symmetric = symmetric
        self.zero_offset = zero_offset  # GPTQ's v1 checkpoints store each zero point minus one
        self.suffixes = self._SUFFIXES[layout]
        if layout == "compressed-tensors" and not symmetric:
            self.suffixes += ("weight_zero_point",)

    def _group_size_for(self, k: int) -> int:
        return k if self.group_size <= 0 else self.group_size

    def from_checkpoint(self, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        if self.layout == "compressed-tensors":
            return self._from_pack_quantized(tensors)
        if self.layout == "awq":
            return self._from_awq(tensors)
        return self._from_gptq(tensors)

    def _from_pack_quantized(self, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        # compressed-tensors: value k of row n at bits 4 * (k % 8) of weight_packed[n, k // 8], stored as the signed
        # value plus 8; scales [N, groups]; an asymmetric zero point is signed, packed the same way along N.
        packed = tensors["weight_packed"]
        n = packed.shape[0]
        k = packed.shape[1] * PACK_FACTOR
        if "weight_shape" in tensors:
            n_shape, k_shape = (int(v) for v in tensors["weight_shape"].tolist())
            if (n_shape, k_shape) != (n, k):
                raise ValueError(f"{self.name}: weight_shape {(n_shape, k_shape)} does not match weight_packed "
                                 f"{tuple(packed.shape)} (input features must be a multiple of 8)")
        scales = tensors["weight_scale"].T.to(self.dtype).contiguous()
        if self.symmetric:
            zeros = torch.full_like(scales, 8)
        else:
            # packed zero points hold the signed value plus 8: the unsigned domain's zero point itself
            zeros = unpack_rows(tensors["weight_zero_point"])[:n].T.to(self.dtype)
        g_idx = tensors.get("weight_g_idx")
        # Eight values of one row along K per word: transposed, the runtime's qweight [K / 8, N] bit for bit.
        return Int4Weight(packed.T.contiguous(), scales, zeros.contiguous(), self._group_size_for(k),
                          None if g_idx is None else g_idx.to(torch.int32))

    def _from_awq(self, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        # AutoAWQ's GEMM layout: qweight [K, N / 8] and qzeros [groups, N / 8], eight output features per word in
        # AWQ_ORDER; scales [groups, N]; W = (q - zero) * scale.
        values = _unpack_columns(tensors["qweight"], AWQ_ORDER)  # [K, N]
        zeros = _unpack_columns(tensors["qzeros"], AWQ_ORDER).to(self.dtype)
        k = values.shape[0]
        return Int4Weight(pack_rows(values), tensors["scales"].to(self.dtype).contiguous(), zeros,
                          self._group_size_for(k))

    def _from_gptq(self, tensors: dict[str, torch.Tensor]) -> Int4Weight:
        # GPTQ: qweight [K / 8, N] packed along K (the runtime's own layout), qzeros [groups, N / 8] packed along N in
        # order, scales [groups, N], g_idx [K]; v1 checkpoints store each zero point minus one.
        qweight = tensors["qweight"].to(torch.int32)
        zeros = (_unpack_columns(tensors["qzeros"], tuple(range(PACK_FACTOR))).to(torch.int32)
                 + self.zero_offset) & 0xF
        k = qweight.shape[0] * PACK_FACTOR
        g_idx = tensors.get("g_idx")
        return Int4Weight(qweight.contiguous(), tensors["scales"].to(self.dtype).contiguous(), zeros.to(self.dtype),
                          self._group_size_for(k), None if g_idx is None else g_idx.to(torch.int32))

    def from_dense(self, weight: torch.Tensor) -> Int4Weight:
        return Int4Weight.quantize(weight, self._group_size_for(weight.shape[1]), self.dtype)

    def apply(self, weight: Int4Weight, x: torch.Tensor, tensor_scale: Optional[torch.Tensor]) -> torch.Tensor:
        return int4_linear(x, weight)

    def describe(self) -> str:
        return f"{self.name} (4-bit weights in groups of {self.group_size}, 16-bit activations)"


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 `[R, C / 8]` holding eight columns per word (nibble j: column `8c + order[j]`) to uint8 `[R, C]`."""
    rows, words = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8] by nibble
    columns = torch.empty_like(nibbles)
    columns[..., list(order)] = nibbles
    return columns.reshape(rows, words * PACK_FACTOR).to(torch.uint8)


# ---- choosing the method ---------------------------------------------------------------------------

CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")


def quantization_method(flag: Optional[str], hf_config: dict[str, Any], dtype: torch.dtype) -> Optional[LinearMethod]:
    """The method for a model whose config.json is `hf_config`, served with `--quantization flag` (None: not asked;
    "gguf" is the CPU's own path, not a linear method) and activations of `dtype`. A checkpoint's
    `quantization_config` decides its format; a flag that names another one is a ValueError, as is a format this
    module does not run. Without a `quantization_config`, `fp8` quantizes the checkpoint's weights at load."""
    config = hf_config.get("quantization_config")
    if flag == "gguf":
        if config:
            raise ValueError("quantization 'gguf' computes on a GGUF file's blocks; this model's config names "
                             f"{config.get('quant_method')!r} weights")
        return None
    if not config:
        if flag is None:
            return None
        if flag == "fp8":  # SGLang's online FP8: one scale per weight, one per call for the activations
            return Fp8Method("fp8", ActivationScheme.TENSOR, per_tensor=True)
        if flag == "w8a8_fp8":  # SGLang's online W8A8 FP8: per output channel, activations per token
            return Fp8Method("w8a8_fp8", ActivationScheme.TOKEN)
        raise ValueError(f"quantization {flag!r} loads checkpoints in that format, and this model's config.json has "
                         "no quantization_config (only 'fp8' and 'w8a8_fp8' quantize a 16-bit checkpoint at load)")
    if flag == "w8a8_fp8":
        raise ValueError("quantization 'w8a8_fp8' quantizes a 16-bit checkpoint at load; this checkpoint's "
                         f"quantization_config says {config.get('quant_method')!r} (drop the flag)")
    method = str(config.get("quant_method", "")).lower()
    if flag is not None and flag != method:
        raise ValueError(f"--quantization {flag} asks for {flag!r} weights, and the checkpoint's quantization_config "
                         f"says {method!r}")
    if method == "mxfp4":  # gpt-oss's experts, dequantized to the model's dtype by its loader (models/gpt_oss.py)
        if "GptOssForCausalLM" not in (hf_config.get("architectures") or []):
            raise ValueError("MXFP4 weights are read for gpt-oss's experts only; this model is "
                             f"{(hf_config.get('architectures') or ['of no named architecture'])[0]}")
        return None
    if method == "fp8":
        return _hf_fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config, dtype)
    if method == "awq":
        return _awq(config, dtype)
    if method == "gptq":
        return _gptq(config, dtype)
    raise ValueError(f"this model's weights are quantized as {method!r}, which radixserve does not run "
                     f"(it runs {', '.join(CHECKPOINT_METHODS)})")


def _ignored(config: dict, key: str) -> tuple[str, ...]:
    return tuple(config.get(key) or ())


def _hf_fp8(config: dict) -> Fp8Method:
    block = config.get("weight_block_size")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"FP8 checkpoint: unknown activation_scheme {scheme!r}")
    ignored = _ignored(config, "modules_to_not_convert")
    if block is not None:
        if scheme != "dynamic":
            raise ValueError("FP8 checkpoint: block-quantized weights need dynamic activations")
        return Fp8Method("fp8", ActivationScheme.GROUP, (int(block[0]), int(block[1])), "weight_scale_inv", ignored)
    activation = ActivationScheme.STATIC if scheme == "static" else ActivationScheme.TENSOR
    return Fp8Method("fp8", activation, None, "weight_scale", ignored)


def _compressed_tensors(config: dict, dtype: torch.dtype) -> LinearMethod:
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoint with {len(groups)} config groups; radixserve runs one scheme "
                         "for every linear")
    group = groups[0]
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"compressed-tensors checkpoint targeting {targets}; radixserve runs schemes that target "
                         "every Linear")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    ignored = _ignored(config, "ignore")
    fmt = group.get("format") or config.get("format")
    what = f"compressed-tensors {fmt} ({weights.get('type')} {weights.get('num_bits')}-bit weights)"
    if weights.get("type") == "float" and weights.get("num_bits") == 8 and fmt in ("float-quantized",
                                                                                   "naive-quantized"):
        strategy = weights.get("strategy")
        block = None
        if strategy == "block":
            block = tuple(int(v) for v in weights.get("block_structure") or ())
            if len(block) != 2:
                raise ValueError(f"{what}: block strategy without a two-number block_structure")
        elif strategy not in ("tensor", "channel"):
            raise ValueError(f"{what}: weight strategy {strategy!r} is not supported (tensor, channel, block are)")
        return Fp8Method("compressed-tensors", _ct_activation(what, inputs, block), block, "weight_scale", ignored)
    if weights.get("type") == "int" and weights.get("num_bits") == 4 and fmt == "pack-quantized":
        if inputs is not None:
            raise ValueError(f"{what}: quantized activations with 4-bit weights are not supported (W4A16 is)")
        strategy = weights.get("strategy")
        if strategy == "group":
            group_size = int(weights["group_size"])
        elif strategy == "channel":
            group_size = -1
        else:
            raise ValueError(f"{what}: weight strategy {strategy!r} is not supported (group, channel are)")
        return Int4Method("compressed-tensors", "compressed-tensors", group_size, dtype,
                          symmetric=bool(weights.get("symmetric", True)),
                          act_order=weights.get("actorder") is not None, ignored=ignored)
    raise ValueError(f"{what} is not supported; radixserve runs FP8 float-quantized and W4A16 pack-quantized")


def _ct_activation(what: str, inputs: Optional[dict], block: Optional[tuple[int, int]]) -> ActivationScheme:
    if not inputs:
        raise ValueError(f"{what}: FP8 weights with 16-bit activations (W8A16) are not supported; W8A8 is")
    if inputs.get("type") != "float" or inputs.get("num_bits") != 8:
        raise ValueError(f"{what}: activations of {inputs.get('type')} {inputs.get('num_bits')} bits are not supported")
    strategy, dynamic = inputs.get("strategy"), bool(inputs.get("dynamic"))
    if strategy == "token" and dynamic:
        return ActivationScheme.TOKEN
    if strategy == "tensor" and block is None:
        return ActivationScheme.TENSOR if dynamic else ActivationScheme.STATIC
    if strategy == "group" and dynamic and block is not None and int(inputs.get("group_size") or 0) == block[1]:
        return ActivationScheme.GROUP
    raise ValueError(f"{what}: activation strategy {strategy!r} (dynamic {dynamic}) is not supported with these "
                     "weights")


def _awq(config: dict, dtype: torch.dtype) -> Int4Method:
    bits, version = config.get("bits", config.get("w_bit")), str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(f"AWQ checkpoint with {bits}-bit weights in the {version!r} layout; radixserve runs 4-bit GEMM")
    if not config.get("zero_point", True):
        raise ValueError("AWQ checkpoint without zero points is not supported")
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    return Int4Method("awq", "awq", group_size, dtype, symmetric=False,
                      ignored=_ignored(config, "modules_to_not_convert"))


def _gptq(config: dict, dtype: torch.dtype) -> Int4Method:
    bits = config.get("bits")
    if bits != 4:
        raise ValueError(f"GPTQ checkpoint with {bits}-bit weights; radixserve runs 4-bit")
    checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported (gptq, gptq_v2 are)")
    return Int4Method("gptq", "gptq", int(config.get("group_size", 128)), dtype,
                      symmetric=bool(config.get("sym", True)), zero_offset=1 if checkpoint_format == "gptq" else 0,
                      act_order=bool(config.get("desc_act", False)),
                      ignored=_ignored(config, "modules_to_not_convert"))
