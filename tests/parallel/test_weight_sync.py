"""Weights broadcast by a trainer process into a served TP=2 group over gloo (init_weights_update_group +
update_weights_from_distributed), as an RL trainer pushes each step's weights to its rollout engine.

The trainer is a separate process: rank 0 of a group of its own with both engine ranks (rank_offset 1: ranks 1 and
2). Each engine rank receives every whole tensor and keeps its shard. The reference is Hugging Face greedy decoding
with the same new weights.
"""

from __future__ import annotations

import datetime
import multiprocessing
import socket

import pytest
import torch

from test_weight_updates import GREEDY, _prompts, hf_greedy, hf_model, perturbed_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
GROUP = "rl_weights"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _trainer(port: int, world_size: int, model_dir: str, go, done) -> None:
    """Rank 0: host the rendezvous, then broadcast the perturbed weights in the order the engine was told."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(GROUP, store), 0, world_size, timeout)
    state = perturbed_state(hf_model(model_dir))
    go.get(timeout=120)
    for tensor in state.values():
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([tensor.contiguous()], options).wait()
    done.put(True)


def test_update_weights_from_distributed_into_tp2(tiny_model_dir):
    from radixserve import Engine

    model_dir = tiny_model_dir("llama", with_tokenizer=True)
    model = hf_model(model_dir)
    state = perturbed_state(model)  # what the trainer sends (same seed)
    prompts = _prompts(model.config.vocab_size)
    ctx = multiprocessing.get_context("spawn")
    go, done = ctx.Queue(), ctx.Queue()
    port = _free_port()
    trainer = ctx.Process(target=_trainer, args=(port, 3, model_dir, go, done), daemon=True)
    trainer.start()
    try:
        with Engine(model_path=model_dir, device="cpu", dtype="float32", tp_size=2, log_level="warning") as engine:
            engine.generate(input_ids=prompts, sampling_params=GREEDY)
            success, message = engine.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=3,
                                                                group_name=GROUP, backend="gloo")
            assert success, message
            names = list(state)
            go.put(True)
            success, message = engine.update_weights_from_distributed(
                names, [state[n].dtype for n in names], [state[n].shape for n in names], group_name=GROUP)
            assert success, message
            assert done.get(timeout=60)

            after = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in after] == hf_greedy(model, prompts)
            assert [r["meta_info"]["cached_tokens"] for r in after] == [0, 0, 0]
            assert {r["meta_info"]["weight_version"] for r in after} == {"1"}

            # A request the engine cannot take part in is refused before any broadcast is joined.
            success, message = engine.update_weights_from_distributed(["model.norm.weight"], [torch.float32],
                                                                      [[7]], group_name=GROUP)
            assert not success and "shape" in message
            success, message = engine.update_weights_from_distributed(["model.norm.weight"], [torch.float32],
                                                                      [[64]], group_name="nope")
            assert not success and "no weight-update group" in message
            assert engine.destroy_weights_update_group(GROUP)[0]
    finally:
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
