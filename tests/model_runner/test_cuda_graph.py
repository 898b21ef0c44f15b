"""Decode CUDA graphs: batch-size selection, padding, and replayed logits against eager ones.

On the CPU (CI): the captured sizes and the bisection to the next size; the static input buffers put the
padding request into every spare row, also after a larger batch left its values behind; a padded static
batch run eagerly (torch_native) gives the unpadded batch's logits and writes K/V only at the batch's
slots and the dummy slot 0; a CPU runner captures nothing.

On a GPU (skipped without one): a tiny random Llama with the triton backend in float32 and the flashinfer
backend in bfloat16 (head_dim 128, FlashInfer's compiled shape): graph replay gives the eager logits and
K/V for exact and padded batch sizes, a padded replay after a larger one touches no stale slot, a batch
larger than every graph runs eagerly, and greedy generation is the same with and without graphs.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model_runner.cuda_graph import (
    DecodeInputBuffers,
    PADDING_ROW,
    PADDING_SLOT,
    capture_batch_sizes,
    choose_graph_max_batch_size,
    padded_batch_size,
    supports_cuda_graph,
)
from radixserve.model_runner.forward_batch import ForwardBatch, ForwardMode
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.model_runner.static_generate import assign_kv_slots, greedy_generate, make_forward_batch
from radixserve.runtime.wire.server_args import ServerArgs

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")

# Tiny Llama with FlashInfer's head_dim; 8 query heads on 2 KV heads (tensor-core decode, as Llama-3-8B).
GPU_MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=128, max_position_embeddings=512)


class Requests:
    """Requests driven straight through a ModelRunner: one extend for all prompts, then decode batches of
    any subset, each request feeding back its greedy token."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]) -> None:
        self.runner = runner
        self.rows = [runner.req_to_token_pool.alloc() for _ in prompts]
        loc = assign_kv_slots(runner.allocator, runner.req_to_token_pool, self.rows, [0] * len(prompts),
                              [len(p) for p in prompts])
        batch = make_forward_batch(ForwardMode.EXTEND, self.rows, [0] * len(prompts), prompts, loc,
                                   runner.req_to_token_pool, runner.token_to_kv_pool)
        self.next_tokens = runner.forward(batch).argmax(-1).tolist()
        self.seq_lens = [len(p) for p in prompts]

    def decode_batch(self, members: list[int]) -> ForwardBatch:
        """A DECODE batch of requests `members` (their KV slots allocated and recorded)."""
        rows = [self.rows[i] for i in members]
        prefix_lens = [self.seq_lens[i] for i in members]
        loc = assign_kv_slots(self.runner.allocator, self.runner.req_to_token_pool, rows, prefix_lens,
                              [1] * len(members))
        for i in members:
            self.seq_lens[i] += 1
        return make_forward_batch(ForwardMode.DECODE, rows, prefix_lens, [[self.next_tokens[i]] for i in members],
                                  loc, self.runner.req_to_token_pool, self.runner.token_to_kv_pool)

    def accept(self, members: list[int], logits: torch.Tensor) -> None:
        for i, token in zip(members, logits.argmax(-1).tolist()):
            self.next_tokens[i] = token


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def kv_snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    pool = runner.token_to_kv_pool
    return [buffer.clone() for buffer in pool.k_buffer + pool.v_buffer]


def changed_slots(runner: ModelRunner, before: list[torch.Tensor]) -> set[int]:
    pool = runner.token_to_kv_pool
    changed: set[int] = set()
    for old, new in zip(before, pool.k_buffer + pool.v_buffer):
        differs = (old != new).flatten(1).any(dim=1)
        changed.update(differs.nonzero().flatten().tolist())
    return changed


# ---- CPU: sizes, buffers, padding --------------------------------------------------------------------

def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    sizes = capture_batch_sizes(256)
    assert sizes[:8] == [1, 2, 4, 8, 12, 16, 24, 32] and sizes[-1] == 256
    assert all(b - a == 16 for a, b in zip(sizes[7:], sizes[8:]))
    assert capture_batch_sizes(100)[-2:] == [96, 100]


def test_graph_max_batch_size_follows_the_flag_then_the_gpu_memory():
    assert choose_graph_max_batch_size(None, 141 << 30, 2048) == 1024  # an H200
    assert choose_graph_max_batch_size(None, 24 << 30, 2048) == 256
    assert choose_graph_max_batch_size(None, 141 << 30, 300) == 300  # never above max_running_requests
    assert choose_graph_max_batch_size(64, 141 << 30, 2048) == 64
    assert choose_graph_max_batch_size(2048, 24 << 30, 512) == 512


def test_padded_batch_size_is_the_next_captured_size():
    captured = [1, 2, 4, 8, 12]
    assert [padded_batch_size(bs, captured) for bs in range(1, 13)] == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
    assert padded_batch_size(13, captured) is None


def _decode_batch(bs: int, device: str = "cpu") -> ForwardBatch:
    """A decode batch with distinctive values (request i: row 10 + i, slot 100 + i, length 20 + i)."""
    def ints(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    seq_lens = [20 + i for i in range(bs)]
    return ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=ints([7 + i for i in range(bs)]), positions=ints([s - 1 for s in seq_lens]),
        out_cache_loc=ints([100 + i for i in range(bs)]), req_pool_indices=ints([10 + i for i in range(bs)]),
        seq_lens=ints(seq_lens), prefix_lens=ints([s - 1 for s in seq_lens]), extend_lens=ints([1] * bs),
        seq_lens_cpu=seq_lens, prefix_lens_cpu=[s - 1 for s in seq_lens], extend_lens_cpu=[1] * bs,
        req_to_token_pool=None, token_to_kv_pool=None,
    )


def _assert_padding_rows(buffers: DecodeInputBuffers, view: ForwardBatch, start: int) -> None:
    end = view.batch_size
    assert buffers.out_cache_loc[start:end].eq(PADDING_SLOT).all()
    assert buffers.req_pool_indices[start:end].eq(PADDING_ROW).all()
    assert buffers.seq_lens[start:end].eq(1).all() and buffers.positions[start:end].eq(0).all()
    assert view.seq_lens_cpu[start:] == [1] * (end - start) and view.prefix_lens_cpu[start:] == [0] * (end - start)


def test_load_fills_real_rows_and_padding():
    buffers = DecodeInputBuffers(8, torch.device("cpu"))
    view4 = buffers.batch_view(4, None, None)
    batch = _decode_batch(3)
    buffers.load(batch, view4)
    assert view4.out_cache_loc.tolist()[:3] == [100, 101, 102]
    assert view4.req_pool_indices.tolist()[:3] == [10, 11, 12]
    assert view4.seq_lens.tolist()[:3] == [20, 21, 22] and view4.positions.tolist()[:3] == [19, 20, 21]
    assert view4.prefix_lens.tolist() == view4.positions.tolist()  # a decode prefix ends at the new position
    assert view4.input_ids.tolist()[:3] == [7, 8, 9]
    assert view4.seq_lens_cpu[:3] == [20, 21, 22] and view4.extend_lens_cpu == [1] * 4
    _assert_padding_rows(buffers, view4, 3)

    # A smaller batch after a larger one: the rows the larger one used become padding again.
    buffers.load(_decode_batch(4), view4)
    buffers.load(_decode_batch(2), view4)
    _assert_padding_rows(buffers, view4, 2)

    # Left-behind rows beyond a small view stay known as stale until a view covering them is loaded.
    view8, view2 = buffers.batch_view(8, None, None), buffers.batch_view(2, None, None)
    buffers.load(_decode_batch(7), view8)
    buffers.load(_decode_batch(2), view2)
    buffers.load(_decode_batch(1), view8)
    _assert_padding_rows(buffers, view8, 1)


def test_padded_static_batch_matches_unpadded_on_cpu(tiny_model_dir):
    """The padding request changes neither the real requests' logits nor any KV slot but the dummy one."""
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=tiny_model_dir("llama"), device="cpu",
        dtype="float32", max_total_tokens=2048, max_running_requests=8)))
    assert runner.cuda_graph_runner is None and not supports_cuda_graph(runner.attn_backend)
    requests = Requests(runner, random_prompts(runner.vocab_size, [5, 9, 3, 7]))
    members = [0, 1, 2]
    batch = requests.decode_batch(members)
    eager = runner.forward(batch).clone()
    before = kv_snapshot(runner)

    buffers = DecodeInputBuffers(8, runner.device)
    view = buffers.batch_view(4, runner.req_to_token_pool, runner.token_to_kv_pool)
    buffers.load(batch, view)
    padded = runner.forward(view)
    assert padded.shape == (4, runner.vocab_size)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    changed = changed_slots(runner, before)
    assert PADDING_SLOT in changed and changed <= {PADDING_SLOT} | set(batch.out_cache_loc.tolist())


def test_padded_static_batch_writes_window_slots_on_cpu(tiny_model_dir):
    """A sliding-window model whose window layers have slots of their own (radix_cache/swa_pool.py): the static
    batch's window layers write at the map's window slots (the padding row at the dummy one), as an eager decode."""
    runner = ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=tiny_model_dir("gemma3"), device="cpu",
        dtype="float32", max_total_tokens=2048, max_running_requests=8)))
    pool = runner.token_to_kv_pool
    assert pool.window_map is not None
    requests = Requests(runner, random_prompts(runner.vocab_size, [5, 19, 3, 11]))
    batch = requests.decode_batch([0, 1, 2])
    eager = runner.forward(batch).clone()
    before = kv_snapshot(runner)

    buffers = DecodeInputBuffers(8, runner.device)
    view = buffers.batch_view(4, runner.req_to_token_pool, pool)
    buffers.load(batch, view)
    assert view.window_cache_loc.tolist() == pool.window_map[batch.out_cache_loc].tolist() + [0]
    padded = runner.forward(view)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    window_slots = set(view.window_cache_loc.tolist())
    for layer, (old_k, new_k) in enumerate(zip(before[:pool.num_layers], pool.k_buffer)):
        changed = set((old_k != new_k).flatten(1).any(dim=1).nonzero().flatten().tolist())
        allowed = window_slots if pool.is_window_layer(layer) else set(batch.out_cache_loc.tolist()) | {PADDING_SLOT}
        assert changed <= allowed, layer


# ---- GPU: capture and replay -------------------------------------------------------------------------

GPU_BACKENDS = [
    pytest.param("triton", "float32", 1e-4, id="triton-float32"),
    pytest.param("flashinfer", "bfloat16", 3e-2, id="flashinfer-bfloat16"),
    pytest.param(None, "bfloat16", 3e-2, id="default-bfloat16"),  # flashinfer's extends, triton's decode
]


def gpu_runner(model_dir: str, backend: str, dtype: str, **kwargs) -> ModelRunner:
    if backend in ("flashinfer", None):
        pytest.importorskip("flashinfer")
    kwargs.setdefault("cuda_graph_max_bs", 8)
    return ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=model_dir, device="cuda", dtype=dtype,
        attention_backend=backend, max_total_tokens=8192, max_running_requests=16, **kwargs)))


def _assert_logits_close(graph: torch.Tensor, eager: torch.Tensor, tolerance: float, same_argmax: bool) -> None:
    scale = eager.abs().max().item()
    torch.testing.assert_close(graph, eager, atol=tolerance * scale, rtol=tolerance)
    if same_argmax:
        assert torch.equal(graph.argmax(-1), eager.argmax(-1))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype,tolerance", GPU_BACKENDS)
def test_replay_matches_eager(tiny_model_dir, backend, dtype, tolerance):
    runner = gpu_runner(tiny_model_dir("llama", **GPU_MODEL), backend, dtype)
    if backend is None:
        from radixserve.model_runner.attention.hybrid import HybridAttentionBackend
        from radixserve.model_runner.attention.triton_backend import TritonAttentionBackend

        assert isinstance(runner.attn_backend, HybridAttentionBackend)
        assert isinstance(runner.attn_backend.decode, TritonAttentionBackend)
    graphs = runner.cuda_graph_runner
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8]
    requests = Requests(runner, random_prompts(runner.vocab_size, [5, 40, 3, 17, 64, 9, 1, 30, 12, 8]))
    # Exact sizes, padded sizes, a shrinking batch after a full one, and one larger than every graph.
    for members in ([0], [0, 1, 2, 3], [0, 1, 2], list(range(8)), [1, 3, 5], [2, 4, 6, 7, 9], list(range(10))):
        batch = requests.decode_batch(members)
        eager = runner.forward(batch, use_cuda_graph=False).clone()
        kv_eager = kv_snapshot(runner)
        assert graphs.can_run(batch) == (len(members) <= 8)
        graph = runner.forward(batch).clone()
        # bfloat16 rounding (the padded batch runs other matmul shapes) may flip a near tie.
        _assert_logits_close(graph, eager, tolerance, same_argmax=dtype == "float32")
        # Only the batch's own slots and the dummy slot may change; the batch's K/V is the eager one's.
        slots = set(batch.out_cache_loc.tolist())
        assert changed_slots(runner, kv_eager) <= slots | {PADDING_SLOT}
        pool = runner.token_to_kv_pool
        loc = batch.out_cache_loc
        for old, new in zip(kv_eager, pool.k_buffer + pool.v_buffer):
            torch.testing.assert_close(new[loc].float(), old[loc].float(), atol=tolerance * 4, rtol=tolerance)
        requests.accept(members, eager)


@needs_gpu
@pytest.mark.gpu
def test_greedy_generation_same_with_and_without_graphs(tiny_model_dir):
    model_dir = tiny_model_dir("llama", **GPU_MODEL)
    prompts = random_prompts(512, [4, 33, 12, 7, 20])  # 5 requests: replayed in the graph of 8
    with_graphs = gpu_runner(model_dir, "triton", "float32")
    without = gpu_runner(model_dir, "triton", "float32", disable_cuda_graph=True)
    assert with_graphs.cuda_graph_runner is not None and without.cuda_graph_runner is None
    assert greedy_generate(with_graphs, prompts, 24) == greedy_generate(without, prompts, 24)


@needs_gpu
@pytest.mark.gpu
def test_window_slots_replay_matches_eager(tiny_model_dir):
    """A sliding-window model with window slots (radix_cache/swa_pool.py) decodes in Triton's graphs: the decode kernel
    reads the window layers through the pool's map, the static batch writes their window slots."""
    runner = gpu_runner(tiny_model_dir("gemma3"), "triton", "float32")
    assert runner.token_to_kv_pool.window_map is not None and runner.cuda_graph_runner is not None
    requests = Requests(runner, random_prompts(runner.vocab_size, [5, 40, 3, 17, 64, 9]))
    for members in ([0], [0, 1, 2, 3], [0, 1, 2], [1, 3, 5]):
        batch = requests.decode_batch(members)
        eager = runner.forward(batch, use_cuda_graph=False).clone()
        graph = runner.forward(batch).clone()
        _assert_logits_close(graph, eager, 1e-4, same_argmax=True)
        requests.accept(members, eager)
