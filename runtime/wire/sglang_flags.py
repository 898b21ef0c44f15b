"""SGLang's server flags on radixserve's command line and in `Engine(**kwargs)`.

A command line written for `python -m sglang.launch_server` should run here unchanged, or fail saying exactly
which flag radixserve cannot honour. Each of SGLang's flags falls into one of these groups:

- radixserve's own flag of the same name (most of the common ones), or one of SGLang's other spellings of it
  (`ALIASES`);
- flags that ask for what radixserve always does (`ALWAYS`). They are accepted and logged with what they mean here;
- everything else (`sglang_flags.txt`, taken from SGLang 0.5.23's parser: hardware-specific kernels, all-to-all
  expert dispatch, pipeline parallelism, disaggregation, multimodal inputs, ...). These are
  recognized, and their use is refused with the flag's name and, where one is known, the reason (`REASONS`), never
  with argparse's "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

# radixserve field -> SGLang's other spellings of its flag.
ALIASES: dict[str, tuple[str, ...]] = {
    "dist_init_addr": ("--nccl-init-addr",),
    "tp_size": ("--tensor-parallel-size",),
    "dp_size": ("--data-parallel-size", "--dp"),  # SGLang reads --dp as --dp-size (argparse abbreviation)
    "ep_size": ("--expert-parallel-size",),
    "speculative_draft_model_path": ("--speculative-draft-model",),
    "enable_hierarchical_cache": ("--enable-hicache",),
}

# SGLang flags whose request is radixserve's only behaviour: accepted, with what they amount to.
ALWAYS: dict[str, str] = {
    "--enable-cache-report": "the OpenAI usage always reports cached prompt tokens (prompt_tokens_details)",
    "--disable-custom-all-reduce": "tensor parallelism always all-reduces through torch.distributed (NCCL or gloo)",
}

REASONS: dict[str, str] = {
    "--enable-torch-compile": "decode runs under CUDA graphs with fused Triton kernels; torch.compile is not wired "
                              "in (it has not measured faster here)",
    "--torch-compile-max-bs": "torch.compile is not supported",
    "--skip-tokenizer-init": "the server always loads the model's tokenizer",
    "--revision": "models are read from local paths and the local Hugging Face cache only",
    "--download-dir": "models are read from local paths and the local Hugging Face cache only",
    "--base-gpu-id": "ranks use CUDA devices 0..N-1 (set CUDA_VISIBLE_DEVICES to choose them)",
    "--enable-dp-attention": "data parallelism runs whole replicas (--dp-size)",
    "--log-requests": "requests are not logged (per-request figures are on /metrics)",
    "--cpu-offload-gb": "weights stay on the device; the host tier holds KV only (--enable-hierarchical-cache)",
}


@functools.lru_cache(maxsize=1)
def unsupported_flags() -> dict[str, str]:
    """SGLang's flags radixserve does not implement -> "flag" (no value), "value" (one) or "list" (any number)."""
    text = (Path(__file__).with_name("sglang_flags.txt")).read_text(encoding="utf-8")
    flags = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, kind = line.split()
            flags["--" + name] = kind
    return flags


class _Record(argparse.Action):
    """Remembers which of these flags the command line used (in `dest`, a list), whatever values they took."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Any = None) -> None:
        used = getattr(namespace, self.dest, None) or []
        setattr(namespace, self.dest, [*used, option_string])


def add_cli_args(parser: argparse.ArgumentParser, taken: set[str]) -> None:
    """Register SGLang's flags that `parser` does not already have (`taken`)."""
    for flag in ALWAYS:
        parser.add_argument(flag, nargs=0, action=_Record, dest="sglang_always", default=None,
                            help=f"accepted: {ALWAYS[flag]}")
    nargs = {"flag": 0, "value": None, "list": "*"}
    for flag, kind in unsupported_flags().items():
        if flag not in taken and flag not in ALWAYS:
            parser.add_argument(flag, nargs=nargs[kind], action=_Record, dest="sglang_unsupported", default=None,
                                help=argparse.SUPPRESS)


def check_cli_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the unsupported SGLang flags the command line used; log the accepted ones."""
    refused = getattr(args, "sglang_unsupported", None)
    if refused:
        raise ValueError(refusal(refused))
    for flag in getattr(args, "sglang_always", None) or []:
        logger.info("%s: %s", flag, ALWAYS[flag])


def refusal(flags: Sequence[str]) -> str:
    parts = [f"{flag} ({REASONS[flag]})" if flag in REASONS else flag for flag in dict.fromkeys(flags)]
    return (f"SGLang's {', '.join(parts)} {'is' if len(parts) == 1 else 'are'} not supported by radixserve; "
            "remove it (`radixserve serve --help` lists the flags radixserve takes)")


def flag_of(name: str) -> str:
    """The command-line flag of an Engine keyword: `enable_torch_compile` -> `--enable-torch-compile`."""
    return "--" + name.replace("_", "-")


def check_keywords(kwargs: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """`Engine(**kwargs)`'s counterpart of `check_cli_args`: the keywords without the accepted SGLang ones (logged);
    raises ValueError naming the unsupported SGLang options among those not in `known`."""
    extra = [name for name in kwargs if name not in known]
    refused = sorted(flag_of(name) for name in extra if flag_of(name) in unsupported_flags())
    if refused:
        raise ValueError(refusal(refused))
    for name in extra:
        if flag_of(name) in ALWAYS:
            logger.info("%s: %s", name, ALWAYS[flag_of(name)])
    return {name: value for name, value in kwargs.items() if flag_of(name) not in ALWAYS or name in known}
