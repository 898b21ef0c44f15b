"""SGLang's server flags on radixserve's command line and in `Engine(**kwargs)`.

A command line written for `python -m sglang.launch_server` should run here unchanged, or fail saying exactly
which flag radixserve cannot honour. Each of SGLang's flags falls into one of these groups:

- radixserve's own flag of the same name (most of the common ones), or one of SGLang's other spellings of it
  (`ALIASES`);
- flags that ask for what radixserve always does (`ALWAYS`), or take a value that does (`ALWAYS_VALUES`, for example
  `--moe-runner-backend triton`). They are accepted and logged with what they mean here; another value is refused;
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

# SGLang value flags some of whose values ask for radixserve's only behaviour: flag -> (those values, what they amount
# to). Any other value is refused by name, as the flags of sglang_flags.txt are.
ALWAYS_VALUES: dict[str, tuple[tuple[str, ...], str]] = {
    "--moe-runner-backend": (("auto", "triton"), "mixtures of experts run on radixserve's fused Triton kernels on a "
                                                 "GPU (grouped GEMMs on the CPU)"),
    "--moe-a2a-backend": (("none",), "tokens reach their experts through the tensor-parallel all-reduce, with no "
                                     "all-to-all dispatch"),
    "--fp8-gemm-backend": (("auto",), "FP8 products take cuBLASLt or radixserve's Triton kernels by shape"),
    "--ep-num-redundant-experts": (("0",), "each expert lives on one expert-parallel rank"),
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


class _RecordValue(argparse.Action):
    """Remembers each (flag, value) of `ALWAYS_VALUES` the command line used (in `dest`, a list)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Any = None) -> None:
        used = getattr(namespace, self.dest, None) or []
        setattr(namespace, self.dest, [*used, (option_string, str(values))])


def add_cli_args(parser: argparse.ArgumentParser, taken: set[str]) -> None:
    """Register SGLang's flags that `parser` does not already have (`taken`)."""
    for flag in ALWAYS:
        parser.add_argument(flag, nargs=0, action=_Record, dest="sglang_always", default=None,
                            help=f"accepted: {ALWAYS[flag]}")
    for flag, (values, meaning) in ALWAYS_VALUES.items():
        if flag not in taken:
            parser.add_argument(flag, action=_RecordValue, dest="sglang_values", default=None,
                                help=f"accepted as {' or '.join(values)}: {meaning}")
    nargs = {"flag": 0, "value": None, "list": "*"}
    for flag, kind in unsupported_flags().items():
        if flag not in taken and flag not in ALWAYS and flag not in ALWAYS_VALUES:
            parser.add_argument(flag, nargs=nargs[kind], action=_Record, dest="sglang_unsupported", default=None,
                                help=argparse.SUPPRESS)


def check_cli_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the unsupported SGLang flags the command line used; log the accepted ones."""
    refused = list(getattr(args, "sglang_unsupported", None) or [])
    given = getattr(args, "sglang_values", None) or []
    refused += [f"{flag} {value}" for flag, value in given if value not in ALWAYS_VALUES[flag][0]]
    if refused:
        raise ValueError(refusal(refused))
    for flag in getattr(args, "sglang_always", None) or []:
        logger.info("%s: %s", flag, ALWAYS[flag])
    for flag, value in given:
        logger.info("%s %s: %s", flag, value, ALWAYS_VALUES[flag][1])


def refusal(flags: Sequence[str]) -> str:
    """The message refusing `flags` (each a flag, or `flag value` for a refused value of `ALWAYS_VALUES`)."""
    parts = [f"{flag} ({_reason(flag)})" if _reason(flag) else flag for flag in dict.fromkeys(flags)]
    return (f"SGLang's {', '.join(parts)} {'is' if len(parts) == 1 else 'are'} not supported by radixserve; "
            "remove it (`radixserve serve --help` lists the flags radixserve takes)")


def _reason(flag: str) -> str:
    name = flag.split(" ", 1)[0]
    if name in ALWAYS_VALUES and name != flag:
        values, meaning = ALWAYS_VALUES[name]
        return f"{meaning}; it takes {' or '.join(values)}"
    return REASONS.get(flag, "")


def flag_of(name: str) -> str:
    """The command-line flag of an Engine keyword: `enable_torch_compile` -> `--enable-torch-compile`."""
    return "--" + name.replace("_", "-")


def check_keywords(kwargs: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """`Engine(**kwargs)`'s counterpart of `check_cli_args`: the keywords without the accepted SGLang ones (logged);
    raises ValueError naming the unsupported SGLang options among those not in `known`."""
    extra = [name for name in kwargs if name not in known]
    refused = sorted(flag_of(name) for name in extra
                     if flag_of(name) in unsupported_flags() and flag_of(name) not in ALWAYS_VALUES)
    refused += [f"{flag_of(name)} {kwargs[name]}" for name in extra if flag_of(name) in ALWAYS_VALUES
                and str(kwargs[name]) not in ALWAYS_VALUES[flag_of(name)][0]]
    if refused:
        raise ValueError(refusal(refused))
    for name in extra:
        if flag_of(name) in ALWAYS:
            logger.info("%s: %s", name, ALWAYS[flag_of(name)])
        elif flag_of(name) in ALWAYS_VALUES:
            logger.info("%s=%s: %s", name, kwargs[name], ALWAYS_VALUES[flag_of(name)][1])
    accepted = set(ALWAYS) | set(ALWAYS_VALUES)
    return {name: value for name, value in kwargs.items() if flag_of(name) not in accepted or name in known}
