"""Weights replaced while an Engine serves (runtime/post_training.py, scheduler/weights.py): from tensors, from disk,
and read back; the reference is Hugging Face greedy decoding with the same new weights.

After an update the prefix cache computed under the old weights is gone (a prompt cached before reports 0 cached
tokens), the weight version moves, and a bad update (an unknown name, a wrong shape) changes nothing.
"""

from __future__ import annotations

import pytest
import torch

MAX_NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}


def _prompts(vocab_size: int, lengths=(9, 14, 5)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def perturbed_state(model, seed: int = 1, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Every weight of `model` moved by seeded noise (enough to change greedy tokens), set into `model` too."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied LM head; tied embeddings
def test_update_weights_from_tensor_serves_the_new_weights(tiny_model_dir, arch):
    from radixserve import Engine

    model_dir = tiny_model_dir(arch, with_tokenizer=True)
    model = hf_model(model_dir)
    prompts = _prompts(model.config.vocab_size)
    with Engine(model_path=model_dir, device="cpu", dtype="float32", log_level="warning") as engine:
        before = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in before] == hf_greedy(model, prompts)
        assert {r["meta_info"]["weight_version"] for r in before} == {"default"}
        cached = engine.generate(input_ids=prompts[:1], sampling_params=GREEDY)[0]
        assert cached["meta_info"]["cached_tokens"] > 0

        state = perturbed_state(model)
        success, message = engine.update_weights_from_tensor(list(state.items()))
        assert success, message
        expected = hf_greedy(model, prompts)
        assert expected != [r["output_ids"] for r in before], "the perturbation must change the greedy tokens"

        after = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in after] == expected
        assert [r["meta_info"]["cached_tokens"] for r in after] == [0, 0, 0]
        assert {r["meta_info"]["weight_version"] for r in after} == {"1"}
        assert engine.get_server_info()["weight_version"] == "1"

        # The weights read back are the new ones (a fused q rows slice and a whole tensor).
        name = "model.layers.1.self_attn.k_proj.weight"
        assert torch.equal(torch.tensor(engine.get_weights_by_name(name, truncate_size=3)), state[name][:3])
        assert torch.equal(torch.tensor(engine.get_weights_by_name("model.norm.weight")), state["model.norm.weight"])

        # A subset (one tensor) with a version label; the cache stays when the caller says so.
        norm = state["model.norm.weight"] * 1.5
        success, message = engine.update_weights_from_tensor([("model.norm.weight", norm)], flush_cache=False,
                                                             weight_version="step-2")
        assert success, message
        again = engine.generate(input_ids=prompts[:1], sampling_params=GREEDY)[0]
        assert again["meta_info"]["cached_tokens"] > 0 and again["meta_info"]["weight_version"] == "step-2"


@pytest.mark.slow
def test_a_bad_update_changes_nothing(tiny_model_dir):
    from radixserve import Engine

    model_dir = tiny_model_dir("llama", with_tokenizer=True)
    model = hf_model(model_dir)
    prompts = _prompts(model.config.vocab_size)
    expected = hf_greedy(model, prompts)
    good = model.state_dict()["model.norm.weight"] * 2
    with Engine(model_path=model_dir, device="cpu", dtype="float32", log_level="warning") as engine:
        for named, error in [
            ([("model.norm.weight", good), ("model.layers.0.mlp.nope.weight", good)], "not a tensor"),
            ([("model.norm.weight", good), ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))], "shape"),
        ]:
            success, message = engine.update_weights_from_tensor(named)
            assert not success and error in message
        assert [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
        assert engine.get_server_info()["weight_version"] == "default"
        with pytest.raises(ValueError, match="no weight named"):
            engine.get_weights_by_name("model.layers.9.mlp.up_proj.weight")


@pytest.mark.slow
def test_update_weights_from_disk(tiny_model_dir, tmp_path):
    """A checkpoint of the same shapes replaces every weight; one of another architecture is refused."""
    from radixserve import Engine

    model_dir = tiny_model_dir("llama", with_tokenizer=True)
    other_dir = tiny_model_dir("llama", seed=5, with_tokenizer=True)
    prompts = _prompts(1000)
    with Engine(model_path=model_dir, device="cpu", dtype="float32", log_level="warning") as engine:
        engine.generate(input_ids=prompts, sampling_params=GREEDY)
        success, message = engine.update_weights_from_disk(other_dir)
        assert success, message
        after = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in after] == hf_greedy(hf_model(other_dir), prompts)
        assert [r["meta_info"]["cached_tokens"] for r in after] == [0, 0, 0]
        success, message = engine.update_weights_from_disk(tiny_model_dir("qwen3"))
        assert not success and "only the weights can change" in message
        success, message = engine.update_weights_from_disk(str(tmp_path))
        assert not success
