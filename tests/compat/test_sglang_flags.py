"""SGLang's server flags on radixserve's command line (runtime/wire/sglang_flags.py): a launch line written for
SGLang parses (and serves, through `python -m radixserve.launch_server`), the flags radixserve honours take effect,
and each of SGLang's other flags is refused by name."""

from __future__ import annotations

import json

import subprocess
import sys

import httpx
import pytest

from http_fixtures import ServerProcess
from radixserve.__main__ import _parser
from radixserve.model_runner.model_runner import ModelRunner
from radixserve.model_runner.runner_config import RunnerConfig
from radixserve.runtime.model_files import server_tokenizer
from radixserve.runtime.wire import sglang_flags
from radixserve.runtime.wire.server_args import ServerArgs, make_server_args
from scheduler_driver import SchedulerDriver


def _parse(*flags: str) -> ServerArgs:
    return ServerArgs.from_cli_args(_parser().parse_args(["serve", *flags]))


def test_sglang_spellings_of_dp_dtype_and_chat_template():
    """SGLang's parser reads `--dp` as `--dp-size` and takes `--dtype half` and the built-in `--chat-template
    chatml`; here they are aliases (radixserve has other `--dp-*` flags, so argparse alone would call `--dp`
    ambiguous)."""
    args = _parse("--dp", "1", "--dtype", "half", "--chat-template", "chatml")
    assert (args.dp_size, args.dtype, args.chat_template) == (1, "float16", "chatml")
    assert _parse("--dtype", "float").dtype == "float32"
    with pytest.raises(ValueError, match="dtype"):
        _parse("--dtype", "float64")
    from radixserve.tokenizer_manager.tokenize import load_chat_template

    assert load_chat_template("chatml").startswith("{%- for message in messages")
    with pytest.raises(ValueError, match="chatml"):  # an unknown name lists the built-in ones
        load_chat_template("no-such-template")


def test_an_sglang_launch_line_parses():
    args = _parse("--model-path", "m", "--trust-remote-code", "--tensor-parallel-size", "1", "--data-parallel-size",
                  "1", "--mem-fraction-static", "0.8", "--enable-cache-report", "--disable-custom-all-reduce",
                  "--grammar-backend", "xgrammar", "--stream-interval", "4", "--tokenizer-mode", "auto",
                  "--enable-hicache", "--nccl-init-addr", "127.0.0.1:5000", "--host", "0.0.0.0", "--port", "30001")
    assert args.trust_remote_code and args.enable_hierarchical_cache
    assert (args.tp_size, args.dp_size, args.stream_interval, args.grammar_backend) == (1, 1, 4, "xgrammar")
    assert args.dist_init_addr == "127.0.0.1:5000"
    assert _parse("--tp", "1").tp_size == 1  # argparse's prefix of --tp-size, as with SGLang
    gc_args = _parse("--gc-threshold", "50000", "20", "--gc-warning-threshold-secs", "0.5")
    assert (gc_args.gc_threshold, gc_args.gc_warning_threshold_secs) == ([50000, 20], 0.5)


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-mode", "slow"], "fast tokenizers only"),
    (["--grammar-backend", "outlines"], "xgrammar"),
    (["--stream-interval", "0"], "stream_interval must be >= 1"),
    (["--prefill-attention-backend", "triton"], "must be flashinfer .* or fa3"),
    (["--prefill-attention-backend", "fa3", "--attention-backend", "triton"],
     "the triton attention backend has its own"),
    (["--prefill-attention-backend", "fa3", "--kv-cache-dtype", "fp8_e4m3"], "fa3 reads a KV cache in the model's"),
    (["--decode-attention-backend", "fa3"], "decode_attention_backend must be one of"),
    (["--decode-attention-backend", "cpu", "--device", "cuda"], "decode_attention_backend: the cpu attention backend"),
    (["--decode-attention-backend", "flashinfer", "--enable-deterministic-inference", "--device", "cuda"],
     "row-invariant kernel"),
    (["--decode-attention-backend", "torch_native", "--enable-deterministic-inference", "--device", "cpu"],
     "decodes on the cpu backend's row-invariant kernel"),
])
def test_values_radixserve_cannot_honour(flags, message):
    with pytest.raises(ValueError, match=message):
        _parse(*flags)


def test_decode_attention_backend_resolves_as_sglang_does():
    """Decode on the backend asked for; with none, on the attention backend asked for; with neither, on CUDA triton's
    decode beside flashinfer's extends."""
    assert _parse("--device", "cuda").resolved_decode_attention_backend() == "triton"
    assert _parse("--device", "cuda").resolved_attention_backend() == "flashinfer"
    assert _parse("--device", "cuda", "--attention-backend", "flashinfer").resolved_decode_attention_backend() == \
        "flashinfer"
    assert _parse("--device", "cuda", "--attention-backend", "flashinfer", "--decode-attention-backend",
                  "triton").resolved_decode_attention_backend() == "triton"
    assert _parse("--device", "cpu").resolved_decode_attention_backend() == "cpu"


def test_every_other_sglang_flag_is_refused_by_name():
    flags = sglang_flags.unsupported_flags()
    assert len(flags) > 400 and "--enable-torch-compile" in flags
    parser = _parser()
    for flag, kind in flags.items():
        values = {"flag": [], "value": ["1"], "list": ["a", "b"]}[kind]
        with pytest.raises(ValueError) as refused:
            ServerArgs.from_cli_args(parser.parse_args(["serve", flag, *values]))
        assert flag in str(refused.value) and "not supported by radixserve" in str(refused.value), flag
    with pytest.raises(ValueError, match="--revision .models are read from local paths.*--enable-torch-compile"):
        _parse("--revision", "main", "--enable-torch-compile")


def test_sglang_value_flags_that_name_radixserves_behaviour():
    """`--moe-runner-backend triton` (or auto), `--moe-a2a-backend none`, `--fp8-gemm-backend auto` and
    `--ep-num-redundant-experts 0` ask for what radixserve does: accepted; another value is refused by name, with the
    values that are taken."""
    args = _parse("--moe-runner-backend", "triton", "--moe-a2a-backend", "none", "--fp8-gemm-backend", "auto",
                  "--ep-num-redundant-experts", "0")
    assert args.tp_size == 1
    with pytest.raises(ValueError, match=r"--moe-runner-backend deep_gemm \(mixtures of experts run on radixserve's "
                                         r"fused Triton kernels .*; it takes auto or triton\)"):
        _parse("--moe-runner-backend", "deep_gemm")
    with pytest.raises(ValueError, match=r"--moe-a2a-backend deepep .*it takes none"):
        _parse("--moe-a2a-backend", "deepep")
    assert make_server_args(moe_runner_backend="auto", moe_a2a_backend="none").tp_size == 1
    with pytest.raises(ValueError, match=r"--ep-num-redundant-experts 8 .*it takes 0"):
        make_server_args(ep_num_redundant_experts=8)


def test_engine_keywords_follow_the_same_rules():
    with pytest.raises(ValueError, match="--enable-torch-compile .decode runs under CUDA graphs"):
        make_server_args(enable_torch_compile=True)
    assert make_server_args(enable_cache_report=True, trust_remote_code=True).trust_remote_code
    with pytest.raises(ValueError, match="unknown server argument.*no_such_option"):
        make_server_args(no_such_option=1)


def test_the_command_line_refuses_before_starting_anything():
    done = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--enable-torch-compile"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "SGLang's --enable-torch-compile" in done.stderr and "not supported by radixserve" in done.stderr


def test_trust_remote_code_reaches_the_tokenizer(default_model_dir):
    tokenizer = server_tokenizer(default_model_dir, ServerArgs(trust_remote_code=True))
    assert tokenizer.encode("Hello") == server_tokenizer(default_model_dir, ServerArgs()).encode("Hello")


def test_stream_interval_batches_a_stream(default_model_dir):
    prompt = list(range(300, 340))
    outputs = {}
    for interval in (1, 3):
        driver = SchedulerDriver(default_model_dir, stream_interval=interval)
        driver.submit("s", prompt, max_new_tokens=8, ignore_eos=True)
        driver.submit("whole", prompt, max_new_tokens=8, ignore_eos=True, stream=False)
        results = driver.run_until_idle()
        driver.close()
        outputs[interval] = results
    assert outputs[1]["s"].output_ids == outputs[3]["s"].output_ids == outputs[3]["whole"].output_ids
    assert outputs[1]["s"].num_messages == 8
    # The first token at once, then every 3 (tokens 4 and 7), then the end: 4 messages.
    assert outputs[3]["s"].num_messages == 4
    assert outputs[3]["whole"].num_messages == 1


def test_sglang_launch_command_serves():
    """`python -m radixserve.launch_server` with a launch line written for SGLang, streaming every 2 tokens."""
    server = ServerProcess("--trust-remote-code", "--tensor-parallel-size", "1", "--enable-cache-report",
                           "--stream-interval", "2", "--log-level", "warning", "--gc-threshold", "60000", "15",
                           "--gc-warning-threshold-secs", "0.000001", command=("-m", "radixserve.launch_server"))
    try:
        body = {"text": "Count to ten:", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                "stream": True}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120.0) as response:
            assert response.status_code == 200
            chunks = [line for line in response.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
        # The first token, then every 2: tokens 1, 3, 5, then the end (6). Where the server had two of those chunks
        # waiting when it wrote (a busy machine), one chunk carries both, so a chunk ends at one of those counts.
        counts = [json.loads(chunk[len("data:"):])["meta_info"]["completion_tokens"] for chunk in chunks]
        assert counts == sorted(set(counts)) and set(counts) <= {1, 3, 5, 6} and counts[-1] == 6, counts
        assert len(chunks) >= 2, counts
        # Every process settles its heap at start-up with a collection, which the warning threshold catches.
        assert server.log_text().count("long garbage collection: generation 2") >= 3, server.log_text()[-3000:]
    finally:
        assert server.stop() == 0


def test_prefill_attention_backend_is_refused_where_flashinfer_does_not_run(tiny_model_dir):
    assert _parse("--prefill-attention-backend", "flashinfer").prefill_attention_backend == "flashinfer"
    refusal = "--prefill-attention-backend fa3 picks the flashinfer backend's extend kernels, and this cpu runs the cpu"
    with pytest.raises(ValueError, match=refusal):
        ModelRunner(RunnerConfig.from_server_args(ServerArgs(model_path=tiny_model_dir("llama"), device="cpu",
            prefill_attention_backend="fa3")))


def test_an_attention_backend_for_another_device_is_refused_before_anything_starts(monkeypatch):
    """The server arguments refuse it, so a server fails at once instead of after loading the model."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for backend, device, refusal in (("flashinfer", "cpu", "flashinfer attention backend needs a CUDA device"),
                                     ("triton", "cpu", "triton attention backend needs a CUDA device"),
                                     ("cpu", "cuda", "cpu attention backend runs on the CPU")):
        with pytest.raises(ValueError, match=refusal):
            ServerArgs(device=device, attention_backend=backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter runs it on the CPU (the suite's kernel tests)
    assert ServerArgs(device="cpu", attention_backend="triton").attention_backend == "triton"


def test_hybrid_swa_memory_flags():
    """SGLang's sliding-window memory flags (docs/sliding_window.md): the ratio of window slots to full slots, or one
    slot space for every layer."""
    args = _parse("--swa-full-tokens-ratio", "0.25", "--disable-hybrid-swa-memory")
    assert args.swa_full_tokens_ratio == 0.25 and args.disable_hybrid_swa_memory
    assert _parse().swa_full_tokens_ratio == 0.8 and not _parse().disable_hybrid_swa_memory
    with pytest.raises(ValueError, match=r"swa_full_tokens_ratio must be in \(0, 1\]"):
        _parse("--swa-full-tokens-ratio", "0")
