"""The runtime's models through the ModelRunner against Hugging Face `transformers` on the same weights.

- Greedy decoding (one batched extend over prompts of different lengths, then batched decode steps) yields
  exactly the token ids of `generate(do_sample=False)` run per prompt, unpadded, in float32 on CPU: the
  default model (plain and chat-template prompts) and tiny random Qwen2, Qwen3 and Llama-3-rope models.
- Extend on top of a cached prefix gives the logits of computing the whole prompt.
- Weight loading is strict; `dummy` weights are seeded.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import cpu_build
from radixserve.model_runner.cpu.dispatch import NARROW_PLAIN_FROM
from radixserve.model_runner.cpu.packed import PackedLinear, packing_supported
from radixserve.model_runner.forward_batch import ForwardMode
from radixserve.model_runner.layers import rope_inverse_frequencies
from radixserve.runtime.model_files import load_tokenizer
from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.models import get_model_class
from radixserve.model_runner.static_generate import assign_kv_slots, greedy_generate, make_forward_batch
from radixserve.runtime.wire.server_args import ServerArgs

MAX_NEW_TOKENS = 32

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that with head_dim 16 some frequencies are scaled, some smoothed and some kept.
    "original_max_position_embeddings": 32,
}


def make_runner(model_dir: str, **kwargs) -> ModelRunner:
    kwargs.setdefault("max_total_tokens", 4096)
    kwargs.setdefault("max_running_requests", 16)
    kwargs.setdefault("dtype", "float32")
    return ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_dir, device="cpu", **kwargs)))


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_ids: list[int]) -> list[int]:
    """HF greedy continuation of one unpadded prompt (stops at EOS, which it keeps, like ours)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_ids or None,
            pad_token_id=(eos_token_ids or [0])[0],
        )
    return out[0, len(prompt):].tolist()


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def assert_same_greedy_tokens(model_dir: str, prompts: list[list[int]], on_runner=None,
                              **runner_kwargs) -> list[list[int]]:
    runner = make_runner(model_dir, **runner_kwargs)
    eos = runner.model_config.eos_token_ids
    ours = greedy_generate(runner, prompts, MAX_NEW_TOKENS, stop_token_ids=eos)
    if on_runner is not None:
        on_runner(runner)
    reference = hf_model(model_dir)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(reference, prompt, MAX_NEW_TOKENS, eos), f"prompt {prompt[:8]}..."
    # Every slot and row went back to the pools.
    assert runner.allocator.available_size() == runner.max_total_num_tokens
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
    return ours


# ---- greedy decoding equals transformers ---------------------------------------------------------

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "1, 1, 2, 3, 5, 8,",
    "Water boils at",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "system", "content": "You answer like a pirate."}, {"role": "user", "content": "Describe the sea."}],
]


@pytest.fixture
def panel_linears():
    """The CPU kernels loaded before the runner is made, so its linears take the column-panel kernel from the first
    call (the runners the scheduler tests share keep it off: tests/scheduler_driver.py); whether this CPU runs it."""
    assert cpu_build.load(), "the CPU kernels failed to build (see the log)"
    return any(torch.ops.radixserve_cpu.panel_linear_supported(d) for d in (torch.float32, torch.bfloat16))


def test_default_model_matches_transformers(default_model_dir, panel_linears):
    """With the decode batches' linears on the column-panel kernel where the CPU has AVX-512."""
    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode(text) for text in PLAIN_PROMPTS]
    for messages in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) >= 5

    def panel_ran(runner):  # `usable` turns True at the first call the kernel takes
        assert runner.model.model.layers[0].mlp.down_proj.panel.usable is bool(panel_linears)

    outputs = assert_same_greedy_tokens(default_model_dir, prompts, on_runner=panel_ran)
    # Not a degenerate comparison: real text came out, and at least some requests ran all 32 steps.
    assert "Paris" in tokenizer.decode(outputs[0])
    assert any(len(tokens) == MAX_NEW_TOKENS for tokens in outputs)


def test_default_model_one_request_at_a_time_matches_transformers(default_model_dir):
    """Decode batches of one row: every float32 linear on the small-row kernel where its range starts at one row
    (CPUs whose BLAS streams one row slowly, model_runner/cpu/dispatch.py), on `F.linear` elsewhere."""
    tokenizer = load_tokenizer(default_model_dir)
    for text in PLAIN_PROMPTS[:2]:
        assert_same_greedy_tokens(default_model_dir, [tokenizer.encode(text)])


def test_default_model_in_bfloat16_on_cpu(default_model_dir, panel_linears):
    """The CPU bfloat16 mode: next-token logits are as close to float32 ones as Hugging Face's own bfloat16
    model's are, and the top token agrees with float32 on every prompt."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(default_model_dir)
    prompts = [tokenizer.encode(text) for text in PLAIN_PROMPTS]
    runner = make_runner(default_model_dir, dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.token_to_kv_pool.dtype == torch.bfloat16
    if packing_supported():  # the projections run on pre-packed oneDNN weights
        layer = runner.model.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.self_attn.o_proj, PackedLinear)
        assert isinstance(layer.mlp.down_proj, PackedLinear) and isinstance(runner.model.logits_head, PackedLinear)
    ours = run_extend(runner, prompts, [0] * len(prompts)).float()
    if packing_supported() and torch.ops.radixserve_cpu.panel_linear_supported(torch.bfloat16):
        amx_cpu = cpu_build.has_cpu_flag("amx_bf16")  # the AMX kernel has these rows there
        assert runner.model.model.layers[0].mlp.down_proj.panel.usable is (not amx_cpu)

    def hf_last_logits(dtype):
        model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=dtype).eval()
        with torch.inference_mode():
            return torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in prompts])

    exact, hf_bf16 = hf_last_logits(torch.float32), hf_last_logits(torch.bfloat16)
    our_error = (ours - exact).abs().max(dim=-1).values
    hf_error = (hf_bf16 - exact).abs().max(dim=-1).values
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))
    assert bool((our_error <= 2 * hf_error + 0.05).all()), (our_error, hf_error)


@pytest.mark.skipif(not packing_supported(), reason="needs oneDNN bfloat16 support on this CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(bias):
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16).requires_grad_(False)
    packed = PackedLinear(linear)
    plain_from = NARROW_PLAIN_FROM[torch.bfloat16]
    for shape in [(7, 96), (64, 96), (2, 5, 96), (plain_from, 96)]:  # past the small-row kernel's rows
        x = torch.randn(shape, generator=generator).to(torch.bfloat16)
        assert torch.equal(packed(x), linear(x))


PROMPT_LENGTHS = [3, 17, 8, 1, 25, 12, 5, 30]


@pytest.mark.parametrize("arch,page_size", [("qwen2", 1), ("qwen3", 4)])
def test_tiny_qwen_matches_transformers(tiny_model_dir, arch, page_size):
    model_dir = tiny_model_dir(arch)
    config = ModelConfig.from_path(model_dir)
    assert config.attention_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
    prompts = random_prompts(config.vocab_size, PROMPT_LENGTHS, seed=1)
    assert_same_greedy_tokens(model_dir, prompts, page_size=page_size)


# YaRN also scales cos/sin by its attention factor (0.1 ln 4 + 1 here), which the greedy ids check.
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize("rope_scaling", [LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}, YARN_ROPE])
def test_tiny_llama_rope_scaling_matches_transformers(tiny_model_dir, rope_scaling):
    model_dir = tiny_model_dir("llama", rope_scaling=rope_scaling)
    config = ModelConfig.from_path(model_dir)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == rope_scaling["rope_type"]
    # The scaled frequencies are HF's, and really differ from unscaled RoPE.
    ours = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    plain = rope_inverse_frequencies(config.head_dim, config.rope_theta, None)
    assert torch.equal(ours, hf_model(model_dir).model.rotary_emb.inv_freq)
    assert not torch.allclose(ours, plain)
    prompts = random_prompts(config.vocab_size, PROMPT_LENGTHS, seed=2)
    assert_same_greedy_tokens(model_dir, prompts)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_scaling_is_refused(rope_type):
    with pytest.raises(ValueError, match=rope_type):
        rope_inverse_frequencies(16, 10000.0, {"rope_type": rope_type, "factor": 4.0})


# ---- extend on a cached prefix ---------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_on_cached_prefix_matches_full_prompt(tiny_model_dir, page_size):
    """Requests whose first k tokens already have KV in the pool (k page-aligned or not) get, for the
    remaining tokens, the logits of computing the whole prompt in one extend."""
    runner = make_runner(tiny_model_dir("qwen3"), page_size=page_size)
    prompt = random_prompts(runner.vocab_size, [23], seed=3)[0]
    prefix_lens = [0, 1, 4, 5, 8, 13, 22]  # 0: a fresh request; 22: one new token, as a decoding request

    full = run_extend(runner, [prompt], [0], logits_at_every_token=True)
    rows = [runner.req_to_token_pool.alloc() for _ in prefix_lens]
    # Cache each request's prefix with its own extend, then extend all the rests together in one batch.
    for row, k in zip(rows, prefix_lens):
        if k:
            run_extend(runner, [prompt[:k]], [0], rows=[row])
    rests = [prompt[k:] for k in prefix_lens]
    logits = run_extend(runner, rests, prefix_lens, rows=rows, logits_at_every_token=True, mode=ForwardMode.MIXED)
    start = 0
    for k in prefix_lens:
        n = len(prompt) - k
        torch.testing.assert_close(logits[start:start + n], full[k:], atol=1e-4, rtol=1e-4)
        start += n


def run_extend(runner, token_lists, prefix_lens, rows=None, logits_at_every_token=False, mode=ForwardMode.EXTEND):
    """One extend batch; allocates rows when none are given (it does not free anything: tests own a fresh
    runner)."""
    rows = rows or [runner.req_to_token_pool.alloc() for _ in token_lists]
    extend_lens = [len(t) for t in token_lists]
    loc = assign_kv_slots(runner.allocator, runner.req_to_token_pool, rows, prefix_lens, extend_lens)
    logits_indices = torch.arange(sum(extend_lens)) if logits_at_every_token else None
    batch = make_forward_batch(mode, rows, prefix_lens, token_lists, loc, runner.req_to_token_pool,
                               runner.token_to_kv_pool, logits_indices=logits_indices)
    return runner.forward(batch)


# ---- loading and sizing ------------------------------------------------------------------------------

def test_runner_sizes_pools(tiny_model_dir):
    runner = make_runner(tiny_model_dir("llama"), page_size=4, max_total_tokens=1001, max_running_requests=5)
    config = runner.model_config
    assert runner.max_total_num_tokens == 1000 and runner.allocator.size == 1000
    assert runner.context_len == config.max_position_embeddings == runner.req_to_token_pool.max_context_len
    assert runner.req_to_token_pool.size >= runner.max_running_requests == 5
    assert runner.token_to_kv_pool.k_buffer[0].shape == (1000 + 4, config.num_key_value_heads, config.head_dim)
    assert len(runner.token_to_kv_pool.k_buffer) == config.num_hidden_layers
    assert runner.vocab_size == config.vocab_size and runner.dtype == torch.float32

    # Without max_total_tokens the CPU pool is sized from RAM, capped, and still page-aligned.
    sized = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=tiny_model_dir("llama"), device="cpu",
        page_size=4)))
    assert 0 < sized.max_total_num_tokens <= 64 * sized.context_len and sized.max_total_num_tokens % 4 == 0
    assert sized.max_running_requests == 128


def test_dummy_weights_are_seeded(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    prompts = random_prompts(512, [6, 9], seed=4)

    def logits(**kwargs):
        runner = make_runner(model_dir, **kwargs)
        return run_extend(runner, prompts, [0, 0])

    dummy_a, dummy_b = logits(load_format="dummy", random_seed=7), logits(load_format="dummy", random_seed=7)
    assert torch.isfinite(dummy_a).all() and torch.equal(dummy_a, dummy_b)
    assert not torch.equal(dummy_a, logits(load_format="dummy", random_seed=8))
    assert not torch.allclose(dummy_a, logits(), atol=1e-3)


def test_load_weights_is_strict(tiny_model_dir):
    from radixserve.model_runner.loader import iter_weights

    model_dir = tiny_model_dir("llama")
    config = ModelConfig.from_path(model_dir)
    weights = dict(iter_weights(model_dir))

    def load(tensors):
        model = get_model_class(config.architecture)(config)
        model.load_weights(tensors.items())

    load(weights)
    without_k = {name: t for name, t in weights.items() if name != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="missing.*qkv_proj.weight\\[shard 1\\]"):
        load(without_k)
    with pytest.raises(ValueError, match="no matching parameter"):
        load({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)})
    bad_shape = dict(weights)
    bad_shape["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        load(bad_shape)
