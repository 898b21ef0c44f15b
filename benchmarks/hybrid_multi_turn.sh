#!/usr/bin/env bash
# A hybrid linear-attention model against a dense one of the same size, on the CPU: multi-turn conversations with the
# prefix cache on and off. One server per configuration, started, used and stopped by this script; the same client
# command against each:
#
#   benchmarks/hybrid_multi_turn.sh [OUT_DIR]        (default benchmarks/results/hybrid_multi_turn-<time>)
#
# Models (random weights, float32, built here with transformers' config classes and the embedded SmolLM2 tokenizer):
# a Qwen3.5 text model (Gated DeltaNet in 3 of 4 layers, full attention in the 4th) and a Qwen3 model with the same
# hidden size (256), layers (8), heads (4 query, 2 KV, head_dim 64) and MLP (512).
# Workload: 8 conversations x 6 turns (first prompt 128 tokens, 32 new user tokens and 16 output tokens per turn),
# closed loop with 4 requests in flight. Reported per run: the server's cache hit rate, TTFT (median, p99), and the
# memory a request holds at the end of its conversation (KV of its tokens, plus the hybrid's recurrent state).
# Settings (environment): PORT, NUM_CONVERSATIONS.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
PORT=${PORT:-30120}
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-8}
TURNS=6 FIRST=128 USER=32 OUTPUT=16
OUT=${1:-benchmarks/results/hybrid_multi_turn-$(date +%Y%m%d-%H%M%S)}
MODELS=$(mktemp -d)  # the random-weight models (100 MB each with SmolLM2's vocabulary) stay out of the records
mkdir -p "$OUT"
OUT=$(realpath "$OUT")
if grep -qw amx_tile /proc/cpuinfo; then ISA=amx; elif grep -qw avx512_bf16 /proc/cpuinfo; then ISA=avx512_bf16
elif grep -qw avx512f /proc/cpuinfo; then ISA=avx512f; elif grep -qw avx2 /proc/cpuinfo; then ISA=avx2; else ISA=other; fi
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, ISA $ISA; records and logs: $OUT"

# Run from outside the checkout: a bare `python` in the root would import its `kernels` folder as the hub package.
(cd /tmp && "$OLDPWD/$PY" - "$MODELS" <<'PY'
import os, shutil, sys
import torch, transformers
from radixserve.runtime.model_files import resolve_model

out = sys.argv[1]
tokenizer_dir = resolve_model(None).model_dir
vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
shape = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
configs = {
    "hybrid": transformers.Qwen3_5TextConfig(**shape, linear_num_key_heads=2, linear_num_value_heads=4,
                                             linear_key_head_dim=64, linear_value_head_dim=64),
    "dense": transformers.Qwen3Config(**shape),
}
for name, config in configs.items():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(f"{out}/model-{name}")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), f"{out}/model-{name}")
PY
)

SERVER_PID=
stop_server() {  # SIGTERM to the server, which stops its children; what is left of its group after 60 s
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 -- "-$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap 'stop_server; rm -rf "$MODELS"' EXIT

for model in hybrid dense; do
    for cache in on off; do
        flags=()
        [ "$cache" = off ] && flags=(--disable-radix-cache)
        setsid "$PY" -m radixserve serve --model-path "$MODELS/model-$model" --port "$PORT" --log-level warning \
            --dtype float32 --max-total-tokens 16384 "${flags[@]}" >"$OUT/server-$model-$cache.log" 2>&1 &
        SERVER_PID=$!
        for _ in $(seq 600); do
            curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
            kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited at startup; see $OUT/server-$model-$cache.log"; exit 1; }
            sleep 1
        done
        "$PY" benchmarks/serving.py --base-url "http://127.0.0.1:$PORT" --disable-tqdm --dataset multi-turn \
            --tokenizer "$MODELS/model-$model" --num-prompts "$NUM_CONVERSATIONS" --mt-turns $TURNS \
            --mt-first-len $FIRST --mt-user-len $USER --mt-output-len $OUTPUT --max-concurrency 4 \
            --label "$model-cache-$cache" --output-file "$OUT/serving-$model-$cache.json"
        stop_server
    done
done
(cd /tmp && "$OLDPWD/$PY" - "$OUT" "$ISA" "$MODELS" $TURNS $FIRST $USER $OUTPUT <<'PY'
import json, sys
import torch
from radixserve.model_runner.model_config import ModelConfig
from radixserve.model_runner.state_memory import bytes_per_slot
from radixserve.radix_cache.pool import TokenToKVPool

out, isa, models = sys.argv[1], sys.argv[2], sys.argv[3]
turns, first, user, output = map(int, sys.argv[4:])
tokens = first + (turns - 1) * user + turns * output  # a conversation's last request, its answer included
rows = []
for model in ("hybrid", "dense"):
    config = ModelConfig.from_path(f"{models}/model-{model}")
    kv = TokenToKVPool.bytes_per_token(config.num_kv_layers, config.num_key_value_heads, config.head_dim, torch.float32)
    state = bytes_per_slot(config, torch.float32, torch.float32) if config.is_hybrid else 0
    for cache in ("on", "off"):
        r = json.load(open(f"{out}/serving-{model}-{cache}.json"))
        hit = r["cache_hit_rate"]
        rows.append((model, cache, hit, r["ttft_ms"]["median"], r["ttft_ms"]["p99"], (tokens * kv + state) / 2**20))
print(f"| model | cache | hit rate | TTFT median (ms) | TTFT p99 (ms) | memory per request (MiB, {tokens} tokens) |")
print("| --- | --- | --- | --- | --- | --- |")
for model, cache, hit, median, p99, mib in rows:
    hit_text = "n/a" if hit is None else f"{hit:.1%}"
    print(f"| {model} | {cache} | {hit_text} | {median:.0f} | {p99:.0f} | {mib:.2f} |")
print(f"(CPU ISA {isa})")
PY
)
