"""The TCP ports of a tensor-parallel group, and what stray clients on them do to it. One command:

    python benchmarks/tp_ports.py                       # TP=2 on the CPU (gloo)
    python benchmarks/tp_ports.py --device cuda         # TP=2 on two GPUs (NCCL for the model, gloo for the relay)

Without --model-path it serves a tiny random-weight Qwen2 (4 heads, 2 KV heads) with the embedded model's tokenizer,
made with transformers in a temporary folder: the ids only need to stay the same. Starts an Engine with `--tp-size` ranks, generates greedy ids for a few prompts, and lists every listening TCP
socket of its processes (address, port, process) with the library that opened it where it can tell (the store is
rank 0's; gloo's and NCCL's are the rest). Then, for each port, a stray client connects and sends garbage, another
sends nothing and closes; the Engine generates again. The table shows each port and whether it is on loopback; the
last lines say whether the group stayed healthy and its ids unchanged. Writes $OUT/tp_ports.json (or --out). Exit
status 1 if a port listens off loopback or the ids changed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import _srcpath  # noqa: F401  (makes the source tree importable when run from a checkout)

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
LOOPBACK = {"127.0.0.1", "::1"}


def listening(pids) -> list[dict]:
    import psutil

    processes = []
    for pid in pids:
        process = psutil.Process(pid)
        processes += [process, *process.children(recursive=True)]
    found = []
    for process in processes:
        for conn in process.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.append({"address": conn.laddr.ip, "port": conn.laddr.port, "pid": process.pid,
                              "process": process.name()})
    return sorted(found, key=lambda entry: (entry["pid"], entry["port"]))


def poke(address: str, port: int, payload: bytes) -> str:
    host = "127.0.0.1" if address in ("0.0.0.0", "::") else address
    try:
        with socket.create_connection((host, port), timeout=5) as stray:
            stray.sendall(payload)
        return "sent"
    except OSError as error:
        return f"refused: {error}"


def tiny_model(out_dir: str) -> str:
    """A random-weight Qwen2 small enough for any host, with the embedded model's tokenizer files."""
    import shutil

    import torch
    import transformers

    from radixserve.runtime.model_files import resolve_model

    tokenizer_dir = resolve_model(None).model_dir
    vocab_size = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import tempfile

    from radixserve import Engine

    dtype = "float32" if args.device == "cpu" else "bfloat16"
    model_path = args.model_path or tiny_model(tempfile.mkdtemp(prefix="tp-ports-"))
    with Engine(model_path=model_path, device=args.device, dtype=dtype, tp_size=args.tp_size,
                max_running_requests=8) as engine:
        before = [out["output_ids"] for out in engine.generate(PROMPTS, PARAMS)]
        ports = listening(engine._resources.children.pids().values())
        for entry in ports:
            entry["garbage"] = poke(entry["address"], entry["port"], os.urandom(4096))
            entry["empty"] = poke(entry["address"], entry["port"], b"")
        time.sleep(1.0)
        after = [out["output_ids"] for out in engine.generate(PROMPTS, PARAMS)]
        healthy = engine.is_healthy()

    print(f"{'address':<16} {'port':>6} {'pid':>8} {'process':<24} {'loopback':<8} garbage")
    for entry in ports:
        print(f"{entry['address']:<16} {entry['port']:>6} {entry['pid']:>8} {entry['process'][:24]:<24} "
              f"{str(entry['address'] in LOOPBACK):<8} {entry['garbage']}")
    off_loopback = [entry for entry in ports if entry["address"] not in LOOPBACK]
    print(f"ports: {len(ports)}, off loopback: {len(off_loopback)}; healthy after the stray clients: {healthy}; "
          f"ids unchanged: {after == before}")
    record = {"device": args.device, "tp_size": args.tp_size, "ports": ports, "healthy": healthy,
              "ids_unchanged": after == before, "ids": before}
    out_dir = Path(args.out or os.environ.get("OUT") or "benchmarks/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tp_ports.json").write_text(json.dumps(record, indent=1))
    sys.exit(0 if not off_loopback and after == before and healthy else 1)


if __name__ == "__main__":
    main()
