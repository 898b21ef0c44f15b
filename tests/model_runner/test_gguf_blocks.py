"""`--quantization gguf`: a GGUF model's linear layers compute on the file's own blocks (model_runner/cpu/gguf_linear.py,
model_runner/loader/gguf_blocks.py), and `--quantization` refuses, with the reason, every value it does not run.

The reference is Hugging Face `transformers` on the converted checkpoint, whose weights are the GGUF's dequantized
values: the embedded SmolLM2 GGUF (Q4_1 projections, a Q8_0 embedding tied to the LM head) gives the same greedy ids
over 32 tokens on every prompt. A tiny random llama written at test time in Q4_K, Q5_K and Q6_K (tests/gguf_kquants.py;
its linears multiply int8 activations as llama.cpp does) keeps Hugging Face's greedy ids on at least 15 of 16.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file

from gguf_kquants import write_llama_gguf

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.gguf_linear import GGUFLinear
from radixserve.model_runner.loader.file_checks import check_gguf
from radixserve.model_runner.loader.gguf_blocks import read_block_matrices, source_gguf
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.static_generate import greedy_generate
from radixserve.runtime.model_files import load_tokenizer, resolve_model
from radixserve.runtime.wire.server_args import ServerArgs
from test_model_forward import MAX_NEW_TOKENS, hf_greedy, hf_model

PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,",
    "1, 1, 2, 3, 5, 8,", "Water boils at", "The quick brown fox", "In 1492, Columbus", "import numpy as np\n",
    "My favourite food is", "The theory of relativity says", "Here is a list of fruits:", "Dear Sir or Madam,",
    "The best way to learn programming is", "SELECT * FROM", "Photosynthesis is the process", "Paris is known for",
]


def test_block_matrices_dequantize_to_the_converted_weights(default_model_dir):
    matrices = read_block_matrices(source_gguf(default_model_dir))
    converted = load_file(f"{default_model_dir}/model.safetensors")
    assert {m.type_name for m in matrices.values()} == {"Q4_1", "Q8_0"}
    assert matrices["model.embed_tokens.weight"].type_name == "Q8_0"
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.5.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(matrices[name].dequantize(), converted[name]), name  # rows in Hugging Face's order


@pytest.mark.slow  # Hugging Face generates 16 x 32 tokens
def test_default_model_on_its_blocks_gives_transformers_greedy_ids(default_model_dir):
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        device="cpu", quantization="gguf", max_total_tokens=4096, max_running_requests=16)))
    layer = runner.model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, GGUFLinear) and linear.ggml_type == 3  # Q4_1
    assert isinstance(runner.model.logits_head, GGUFLinear) and runner.model.logits_head.ggml_type == 8  # Q8_0
    assert not any(p.dim() == 2 for name, p in runner.model.named_parameters() if "layers." in name)  # floats dropped

    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    eos = runner.model_config.eos_token_ids
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS, stop_token_ids=eos)
    reference = hf_model(default_model_dir)
    agree = sum(tokens == hf_greedy(reference, prompt, MAX_NEW_TOKENS, eos) for prompt, tokens in zip(prompts, ours))
    assert agree >= 15, f"{agree} of {len(prompts)} prompts give Hugging Face's greedy ids"


def test_int8_activations_keep_most_of_the_float_paths_greedy_ids(default_model_dir):
    """`--gguf-activations int8` on the embedded model: every block linear rounds its activations to int8 (at every row
    count on interleaved blocks, prefill included, as llama.cpp computes), another function than the float path's. The
    greedy ids still start as the float path's on almost every prompt and run together for most of 32 tokens (7 of 16
    prompts keep all 32 on the AVX-512 VNNI CPU measured, the first token on 15, 19 tokens in common on average;
    int8 rounding carries a change in the last bits of its input, as another summation order makes, into tokens, so
    the bounds leave room). Both on the whole thread team."""
    runners = {name: ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        device="cpu", max_total_tokens=4096, max_running_requests=16, disable_cpu_thread_governor=True, **kwargs)))
        for name, kwargs in (("int8", {"quantization": "gguf", "gguf_activations": "int8"}),
                             ("float path", {"quantization": "none"}))}
    layer = runners["int8"].model.model.layers[0]
    interleaved = torch.ops.radixserve_cpu.gguf_interleaved_vectorized()
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj, runners["int8"].model.logits_head):
        assert isinstance(linear, GGUFLinear) and linear.activation_bits == 8
        assert linear.interleaved == interleaved and linear.every_row == interleaved

    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    eos = runners["int8"].model_config.eos_token_ids
    ours, reference = (greedy_generate(runners[name], prompts, MAX_NEW_TOKENS, stop_token_ids=eos)
                       for name in ("int8", "float path"))
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ours, reference)]
    assert sum(a == b for a, b in zip(ours, reference)) >= 4, common
    assert sum(length > 0 for length in common) >= 13, common
    assert sum(common) / len(common) >= 12, common


KQUANT_LAYERS = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


@pytest.fixture(scope="module")
def kquant_gguf(tiny_model_dir, default_model_dir, tmp_path_factory) -> tuple[str, str, str]:
    """(GGUF path, its converted directory, the conversion cache) of a tiny random llama (hidden 256: whole
    super-blocks) whose layers are Q4_K, Q5_K and Q6_K and whose embedding, tied to the LM head, is Q6_K."""
    model_dir = tiny_model_dir("llama", with_tokenizer=True, hidden_size=256, intermediate_size=512, head_dim=64,
                               num_hidden_layers=len(KQUANT_LAYERS), tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("kquants")
    path = str(folder / "tiny-kquants.gguf")
    write_llama_gguf(model_dir, path, source_gguf(default_model_dir), KQUANT_LAYERS, GGMLQuantizationType.Q6_K)
    cache = str(folder / "cache")
    return path, resolve_model(path, cache_dir=cache).model_dir, cache


@pytest.mark.parametrize("which", ["embedded", "kquants"])
def test_header_reader_agrees_with_gguf_py(default_model_dir, kquant_gguf, which):
    """The header `check_gguf` returns (one pass, arrays skipped) lists the tensors and the scalar metadata gguf-py's
    reader does, and its data start is where gguf-py finds the first tensor's bytes."""
    from gguf import GGUFReader, GGUFValueType

    path = source_gguf(default_model_dir) if which == "embedded" else kquant_gguf[0]
    header, reader = check_gguf(path), GGUFReader(path)
    assert [(t.name, t.dims, t.ggml_type) for t in header.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors]
    assert header.data_start + header.tensors[0].offset == reader.tensors[0].data_offset
    scalars = {key: field.contents() for key, field in reader.fields.items()
               if field.types and field.types[0] != GGUFValueType.ARRAY and not key.startswith("GGUF.")}
    assert header.metadata.keys() == scalars.keys() and len(scalars) > 10
    for key, value in scalars.items():
        assert header.metadata[key] == pytest.approx(value) if isinstance(value, float) else \
            header.metadata[key] == value, key


def test_kquant_block_matrices_dequantize_to_the_converted_weights(kquant_gguf):
    path, converted_dir, _ = kquant_gguf
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"
    matrices = read_block_matrices(path)
    converted = load_file(f"{converted_dir}/model.safetensors")
    assert {m.type_name for m in matrices.values()} == {"Q4_K", "Q5_K", "Q6_K"}
    for name, matrix in matrices.items():
        assert torch.equal(matrix.dequantize(), converted[name]), name  # rows in Hugging Face's order
        assert torch.equal(torch.ops.radixserve_cpu.gguf_dequantize(matrix.blocks, matrix.ggml_type), converted[name])


@pytest.mark.slow  # Hugging Face generates 16 x 32 tokens on a 49k vocabulary
def test_kquant_model_on_its_blocks_gives_transformers_greedy_ids(kquant_gguf):
    path, converted_dir, cache = kquant_gguf
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        model_path=path, model_cache_dir=cache, device="cpu", quantization="gguf", max_total_tokens=4096,
        max_running_requests=16)))
    for layer, ggml_type in zip(runner.model.model.layers, KQUANT_LAYERS):
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear, GGUFLinear) and linear.ggml_type == int(ggml_type)
    assert runner.model.logits_head.ggml_type == int(GGMLQuantizationType.Q6_K)

    tokenizer = load_tokenizer(converted_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS, stop_token_ids=[])
    reference = hf_model(converted_dir)
    agree = sum(tokens == hf_greedy(reference, prompt, MAX_NEW_TOKENS, []) for prompt, tokens in zip(prompts, ours))
    assert agree >= 15, f"{agree} of {len(prompts)} prompts give Hugging Face's greedy ids"


def test_the_gguf_default_follows_its_isa_table(default_model_dir, tiny_model_dir, monkeypatch):
    """The CPU default for a GGUF model (model_runner/cpu/gguf_default.py): its float conversion while the table of
    CPUs is empty (today); with this CPU's ISA in the table its blocks, except wherever something asks for the float
    path."""
    from radixserve.model_runner.cpu import gguf_default

    def resolved(**kwargs):
        return RunnerConfig.from_server_args(ServerArgs(device="cpu", **kwargs)).quantization

    def keeps_float(**kwargs):
        return RunnerConfig.from_server_args(ServerArgs(device="cpu", **kwargs)).gguf_keep_float

    monkeypatch.setattr(gguf_default, "GGUF_DEFAULT_ISA_FLAGS", ())
    assert resolved() is None
    monkeypatch.setattr(gguf_default, "GGUF_DEFAULT_ISA_FLAGS", tuple(cpu_build.cpu_isa().split(",")))
    assert resolved() == "gguf" and keeps_float()  # chosen by default: the float projections stay for prefill
    assert resolved(quantization="gguf") == "gguf" and not keeps_float(quantization="gguf")  # asked: blocks alone
    for kwargs in ({"quantization": "none"}, {"dtype": "float32"}, {"dtype": "bfloat16"}, {"cpu_kernels": "torch"},
                   {"enable_deterministic_inference": True}, {"model_path": tiny_model_dir("llama")}):
        assert resolved(**kwargs) is None, kwargs


@pytest.mark.slow  # two runners of the embedded model generate 8 x 32 tokens
def test_blocks_chosen_by_default_decode_on_blocks_and_prefill_on_the_float_linears(default_model_dir, monkeypatch):
    """Where the ISA table picks the blocks, each projection keeps its float linear (packed as on the float path) for
    prefill rows and reads the blocks at decode rows, unless its blocks are interleaved (their kernel is ahead of the
    float linear at every row count: none is kept); the greedy ids are the float path's."""
    from radixserve.model_runner.cpu import gguf_default
    from radixserve.model_runner.cpu.small_batch import SmallBatchLinear

    monkeypatch.setattr(gguf_default, "GGUF_DEFAULT_ISA_FLAGS", tuple(cpu_build.cpu_isa().split(",")))
    runners = {quantization: ModelRunner(RunnerConfig.from_server_args(ServerArgs(
        device="cpu", quantization=quantization, max_total_tokens=4096, max_running_requests=8)))
        for quantization in (None, "none")}
    interleaved = torch.ops.radixserve_cpu.gguf_interleaved_vectorized()
    layer = runners[None].model.model.layers[0]
    head = runners[None].model.logits_head
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                   head):
        assert isinstance(linear, GGUFLinear) and linear.interleaved == interleaved
        assert linear.dense is None if interleaved else isinstance(linear.dense, SmallBatchLinear)
    if not interleaved:  # the blocks at a few rows, the float path's head at many
        assert head.dense.weight is runners[None].model.lm_head_weight  # the embedding's matrix, not a copy
        prefill_rows = torch.randn(40, layer.mlp.down_proj.in_features)
        assert torch.equal(layer.mlp.down_proj(prefill_rows), layer.mlp.down_proj.dense(prefill_rows))

    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS[:8]]
    ours, reference = (greedy_generate(runners[q], prompts, MAX_NEW_TOKENS, stop_token_ids=[]) for q in (None, "none"))
    agree = sum(a == b for a, b in zip(ours, reference))
    assert agree >= 7, f"{agree} of {len(prompts)} prompts keep the float path's greedy ids"


def test_the_blocks_keep_keys_and_values_in_float16_unless_asked_otherwise(default_model_dir):
    """Under the blocks on the CPU, `--kv-cache-dtype auto` stores keys and values as float16 (llama.cpp's default;
    the greedy ids stay those of the float32 pool, docs/quantization.md) and a decode step attends over them on the
    kernel; an explicit dtype, or the float path, keeps its own."""
    def runner(**kwargs) -> ModelRunner:
        return ModelRunner(RunnerConfig.from_server_args(ServerArgs(
            device="cpu", max_total_tokens=1024, max_running_requests=4, **kwargs)))

    blocks, float32_pool = runner(quantization="gguf"), runner(quantization="gguf", kv_cache_dtype="float32")
    assert blocks.kv_cache_dtype == torch.float16 and blocks.token_to_kv_pool.k_buffer[0].dtype == torch.float16
    assert float32_pool.kv_cache_dtype == torch.float32
    assert runner(quantization="none").kv_cache_dtype == torch.float32

    def no_reference_path(*args, **kwargs):
        raise AssertionError("a batch over the float16 pool went to torch_native")

    blocks.attn_backend.fallback.forward = blocks.attn_backend.fallback.run = no_reference_path
    prompts = [load_tokenizer(default_model_dir).encode(text) for text in PROMPTS[:4]]
    ours, reference = (greedy_generate(r, prompts, 16, stop_token_ids=[]) for r in (blocks, float32_pool))
    assert sum(a == b for a, b in zip(ours, reference)) >= 3


@pytest.mark.parametrize("kwargs, message", [
    ({"quantization": "int3"}, "unknown quantization 'int3'; SGLang's names are gguf, fp8"),
    ({"quantization": "w8a8_int8"}, "quantization 'w8a8_int8' is not supported: W8A8 INT8 .* GPU GEMM kernels"),
    ({"quantization": "marlin"}, "quantization 'marlin' is not supported: Marlin-serialized weights .* awq_marlin"),
    ({"quantization": "gguf", "dtype": "bfloat16"}, "computes in float32 around its blocks; drop --dtype bfloat16"),
    ({"quantization": "gguf", "tp_size": 2}, "runs on one rank"),
    ({"quantization": "gguf", "cpu_kernels": "torch"}, "cpu_kernels 'torch' turns off"),
    ({"quantization": "gguf", "enable_lora": True}, "LoRA adapters apply to float weights"),
    ({"gguf_activations": "int8"}, "gguf_activations int8 .* needs --quantization gguf"),
    ({"quantization": "gguf", "gguf_activations": "int4"}, "gguf_activations must be float32 or int8, got 'int4'"),
])
def test_values_that_cannot_run_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(device="cpu", **kwargs)


def test_a_model_that_is_not_gguf_is_refused(tiny_model_dir):
    config = RunnerConfig.from_server_args(ServerArgs(model_path=tiny_model_dir("llama"), device="cpu",
                                                      quantization="gguf"))
    with pytest.raises(ValueError, match="computes on a GGUF file's blocks"):
        ModelRunner(config)
