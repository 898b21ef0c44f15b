"""Convert a GGUF file (llama.cpp format) into a Hugging Face model directory, once, in a cache.

The output directory holds `config.json` (written by transformers' config class, so in the transformers-5
format), `generation_config.json` (bos/eos/pad ids from the GGUF, and the model card's recommended sampling
values for models listed in MODEL_CARD_SAMPLING), `model.safetensors` (dequantized weights
under Hugging Face names, float32; bfloat16 only where the GGUF tensor is bfloat16), the tokenizer files
(`tokenizer.json`, `tokenizer_config.json`, chat template) and `radixserve_source.json` (what was converted).

Weights are dequantized with `gguf.quants.dequantize`. llama.cpp permutes the rows of the Q and K projections
of llama-architecture files (it stores rotary pairs interleaved; Hugging Face stores them as two halves), so
those rows are permuted back here. Qwen2/Qwen3 files are stored unpermuted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Iterator

import numpy as np
import torch

from radixserve.model_runner.loader.file_checks import check_gguf
from radixserve.runtime.wire.model_files import CONVERTER_VERSION, gguf_cache_entry, is_converted

logger = logging.getLogger(__name__)

# Sampling values a model card recommends, for GGUF files named after that model (GGUF metadata carries none):
# (words the file name holds, lower case) -> generation_config.json entries. SmolLM2-Instruct's card recommends
# temperature 0.2 and top_p 0.9.
MODEL_CARD_SAMPLING: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("smollm2", "instruct"), {"temperature": 0.2, "top_p": 0.9}),
)

# GGUF general.architecture -> (HF architecture, transformers config class name)
_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp adds that have no Hugging Face counterpart (precomputed RoPE frequency factors).
_SKIPPED_TENSORS = {"rope_freqs"}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFConversionError(ValueError):
    """The GGUF file uses an architecture or tensor this converter does not handle."""


def hf_tensor_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its Hugging Face name; None for tensors that are dropped."""
    match = _LAYER_TENSOR.match(gguf_name)
    if match:
        layer, base, kind = match.groups()
        if base not in _LAYER_NAMES:
            raise GGUFConversionError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _SKIPPED_TENSORS:
        return None
    if base not in _GLOBAL_NAMES:
        raise GGUFConversionError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved rotary pairs back to two halves.

    llama.cpp stores head rows in the order (0, d/2, 1, d/2+1, ...); Hugging Face uses (0, 1, ..., d-1)
    with the rotation pairing row i with row i + d/2. `num_heads` is the number of heads in this projection
    (query heads for Q, key/value heads for K).
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float32_value(value: float) -> float:
    # GGUF stores floats as float32; shortest repr of that float32 (9.9999997e-06 -> 1e-05).
    return float(str(np.float32(value)))


def _hf_config_kwargs(reader) -> tuple[str, str, dict]:
    """Read the model hyper-parameters from GGUF metadata -> (HF architecture, config class, kwargs)."""
    gguf_arch = _field(reader, "general.architecture")
    name = str(_field(reader, "general.name", "") or "")
    arch_key = "mistral" if gguf_arch == "llama" and "mistral" in name.lower() else gguf_arch
    if arch_key not in _GGUF_ARCHITECTURES:
        raise GGUFConversionError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(sorted(_GGUF_ARCHITECTURES))}"
        )
    architecture, config_class = _GGUF_ARCHITECTURES[arch_key]

    def meta(suffix: str, default: Any = None) -> Any:
        return _field(reader, f"{gguf_arch}.{suffix}", default)

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    vocab_size = meta("vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    scaling_type = meta("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_parameters["rope_type"] = scaling_type
        rope_parameters["factor"] = float(meta("rope.scaling.factor", 1.0))
        original = meta("rope.scaling.original_context_length")
        if original is not None:
            rope_parameters["original_max_position_embeddings"] = int(original)
    kwargs = {
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": int(meta("attention.key_length", hidden // num_heads)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rms_norm_eps": _float32_value(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }
    return architecture, config_class, kwargs


def _iter_hf_tensors(reader, config_kwargs: dict, permute_qk: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from tqdm import tqdm

    if any(t.name.startswith("rope_freqs") for t in reader.tensors):
        logger.warning("GGUF has rope_freqs (llama3-style RoPE scaling); it is dropped, so contexts beyond the "
                       "original training length will differ from the source model")
    for tensor in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor", delay=1.0):
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        # dequantize may return a read-only view of the memory-mapped file; copy before handing it to torch.
        values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), copy=True))
        values = values.to(torch.bfloat16 if tensor.tensor_type == GGMLQuantizationType.BF16 else torch.float32)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rotary_rows(values, config_kwargs["num_attention_heads"])
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rotary_rows(values, config_kwargs["num_key_value_heads"])
        yield name, values.contiguous()


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write the Hugging Face directory for `gguf_path` into the existing empty folder `out_dir`."""
    import transformers
    from gguf import GGUFReader
    from safetensors.torch import save_file

    check_gguf(gguf_path)  # a malformed header is a ModelFileError naming its defect, not an error deep in the reader
    reader = GGUFReader(gguf_path)
    architecture, config_class, kwargs = _hf_config_kwargs(reader)
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [architecture]
    config.save_pretrained(out_dir)
    generation = {k: kwargs[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if kwargs[k] is not None}
    generation.update(model_card_sampling(gguf_path))
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)

    permute_qk = _field(reader, "general.architecture") == "llama"
    tensors = dict(_iter_hf_tensors(reader, kwargs, permute_qk))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors

    # transformers builds a fast tokenizer (vocab, merges, special tokens, chat template) from GGUF metadata.
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.save_pretrained(out_dir)

    stat = os.stat(gguf_path)
    with open(os.path.join(out_dir, "radixserve_source.json"), "w", encoding="utf-8") as f:
        json.dump({"gguf_path": os.path.realpath(gguf_path), "size": stat.st_size,
                   "mtime_ns": stat.st_mtime_ns, "converter_version": CONVERTER_VERSION}, f, indent=2)


def model_card_sampling(gguf_path: str) -> dict[str, float]:
    """The recommended sampling values for the model a GGUF file is named after ({} when none are known)."""
    name = os.path.basename(gguf_path).lower()
    for words, values in MODEL_CARD_SAMPLING:
        if all(word in name for word in words):
            return dict(values)
    return {}


def converted_gguf_dir(gguf_path: str, cache_dir: str) -> str:
    """Return the cached Hugging Face directory for `gguf_path`, converting it first if not cached.

    The conversion writes into a temporary folder beside the entry and renames it into place, so a crash
    mid-conversion never leaves a partial entry, and a concurrent conversion of the same file is harmless
    (the loser discards its copy).
    """
    os.makedirs(cache_dir, exist_ok=True)
    final_dir = gguf_cache_entry(gguf_path, cache_dir)  # named with CONVERTER_VERSION: bump it with the layout
    if is_converted(final_dir):
        return final_dir
    logger.info("Converting %s to a Hugging Face directory in %s (once)", gguf_path, final_dir)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}.tmp-", dir=cache_dir)
    try:
        convert_gguf(gguf_path, tmp_dir)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not is_converted(final_dir):
                raise
            shutil.rmtree(tmp_dir, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return final_dir
