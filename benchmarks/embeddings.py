"""Embeddings per second: radixserve's `Engine.encode` against sentence-transformers on the same model, same inputs,
same device and dtype, in one run.

Both pool the last token and L2-normalize (the Qwen3-Embedding recipe). Inputs are random token ids (lengths uniform in
[input_len / 2, input_len]) given to both as ids, so the figure compares the model paths, not tokenizers:
radixserve gets every input in one `encode` call (its scheduler batches them); sentence-transformers runs its own
`forward` (Transformer, Pooling(lasttoken), Normalize) over length-sorted, right-padded batches of `--batch-size`, as its
`encode` does after tokenizing. Both are loaded side by side and warmed up, then timed in alternation `--repeats` times
(so a change in the machine's load reaches both); the median counts. The run also checks that the two agree (the
largest cosine distance between their embeddings of the same input).

    pip install sentence-transformers   # the baseline; not a dependency of radixserve
    # CPU, the embedded model (SmolLM2-135M) served as an embedding model:
    python benchmarks/embeddings.py --device cpu --dtype float32
    # GPU, a Qwen3-Embedding-0.6B shape with random weights (saved once, loaded by both):
    python benchmarks/embeddings.py --shape qwen3-embedding-0.6b --device cuda --dtype bfloat16 --num-inputs 2048 \
        --input-len 256 --batch-size 64

It prints a table and writes a JSON record (`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _srcpath  # noqa: E402,F401  (radixserve importable from the source tree)

# Qwen3-Embedding-0.6B's config (the shape; weights are random).
SHAPES = {
    "qwen3-embedding-0.6b": dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True),
}


def make_inputs(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(max(1, input_len // 2), input_len))]
            for _ in range(num)]


def build_shape(name: str, out_dir: str, dtype: str) -> str:
    """A random-weight Qwen3 of `name`'s shape saved with a minimal tokenizer (sentence-transformers loads one)."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    config = transformers.Qwen3Config(**SHAPES[name], architectures=["Qwen3ForCausalLM"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config).to(getattr(torch, dtype))
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.02)
    model.save_pretrained(out_dir)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]")), pad_token="[PAD]")
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_sentence_transformers(model_dir: str, args):
    import torch
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(model_dir, model_kwargs={"dtype": getattr(torch, args.dtype)})
    dimension = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    pooling = models.Pooling(dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device=args.device).eval()


def encode_sentence_transformers(model, inputs: list[list[int]], args) -> list[list[float]]:
    """sentence-transformers' forward over length-sorted, right-padded batches, as its `encode` runs them."""
    import torch

    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    out: dict[int, list[float]] = {}
    with torch.inference_mode():
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            width = max(len(inputs[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, :len(inputs[i])] = 1
            features = {"input_ids": ids.to(args.device), "attention_mask": mask.to(args.device)}
            embeddings = model(features)["sentence_embedding"].float().cpu()
            out.update(zip(batch, embeddings.tolist()))
    return [out[i] for i in range(len(inputs))]


def time_both(model_dir: str, input_sets: list[list[list[int]]], args) -> dict[str, Any]:
    """Both systems loaded side by side, warmed up, then timed in alternation (radixserve, then sentence-transformers,
    once per input set), so a change in the machine's load reaches both. Each repeat encodes a fresh set of inputs:
    encoding the same ids again would be a prefix-cache hit for radixserve and time the cache, not the model."""
    from radixserve import Engine

    extra = {} if args.device == "cpu" else {"mem_fraction_static": 0.6}
    seconds: dict[str, list[float]] = {"radixserve Engine.encode": [], "sentence-transformers": []}
    with Engine(model_path=model_dir, is_embedding=True, pooling_method="last", device=args.device, dtype=args.dtype,
                log_level="warning", **extra) as engine:
        baseline = load_sentence_transformers(model_dir, args)
        warm, timed_sets = input_sets[0][:32], input_sets[1:]
        engine.encode(warm)
        encode_sentence_transformers(baseline, warm, args)
        runs = {"radixserve Engine.encode": lambda xs: [r["embedding"] for r in engine.encode(xs)],
                "sentence-transformers": lambda xs: encode_sentence_transformers(baseline, xs, args)}
        vectors = {}
        for inputs in timed_sets:
            for name, run in runs.items():
                if args.device == "cuda":
                    import torch

                    torch.cuda.synchronize()
                start = time.perf_counter()
                vectors[name] = run(inputs)
                seconds[name].append(time.perf_counter() - start)
    return {"seconds": seconds, "vectors": vectors}


def max_cosine_distance(a: list[list[float]], b: list[list[float]]) -> float:
    import torch

    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((1 - torch.nn.functional.cosine_similarity(x, y, dim=1)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args()

    from radixserve.kernels import cpu_build
    from radixserve.runtime.model_files import resolve_model

    with tempfile.TemporaryDirectory(prefix="radixserve-embed-bench-") as scratch:
        if args.shape is not None:
            model_dir = build_shape(args.shape, scratch, args.dtype)
            vocab = SHAPES[args.shape]["vocab_size"]
        else:
            model_dir = resolve_model(args.model).model_dir
            with open(os.path.join(model_dir, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
        input_sets = [make_inputs(args.num_inputs, args.input_len, vocab, args.seed + r) for r in range(args.repeats + 1)]
        tokens = statistics.mean(sum(len(x) for x in inputs) for inputs in input_sets[1:])
        timed = time_both(model_dir, input_sets, args)
        inputs = input_sets[1]

    rows = []
    for name, seconds in timed["seconds"].items():
        median = statistics.median(seconds)
        rows.append({"system": name, "seconds": median, "embeddings_per_s": len(inputs) / median,
                     "tokens_per_s": tokens / median, "all_seconds": seconds})
    speedup = rows[0]["embeddings_per_s"] / rows[1]["embeddings_per_s"]
    distance = max_cosine_distance(*timed["vectors"].values())
    isa = cpu_build.cpu_isa() if args.device == "cpu" else None
    device_name = args.device
    if args.device == "cuda":
        import torch

        device_name = torch.cuda.get_device_name()
    print(f"{args.shape or args.model or 'embedded model'} on {device_name} ({args.dtype}), ISA {isa}: "
          f"{len(inputs)} inputs, {tokens:.0f} tokens per set")
    print(f"{'system':28} {'seconds':>9} {'emb/s':>9} {'tok/s':>10}")
    for row in rows:
        print(f"{row['system']:28} {row['seconds']:9.3f} {row['embeddings_per_s']:9.1f} {row['tokens_per_s']:10.0f}")
    print(f"speed-up {speedup:.2f}x; largest cosine distance between the two: {distance:.2e}")
    record: dict[str, Any] = {"benchmark": "embeddings", "model": args.shape or args.model or "embedded",
                              "device": device_name, "dtype": args.dtype, "isa": isa, "num_inputs": len(inputs),
                              "input_tokens": tokens, "batch_size": args.batch_size, "rows": rows,
                              "speedup": speedup, "max_cosine_distance": distance}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
