"""Building the runner's LoRAManager from its config, with the adapters of `--lora-paths` loaded."""

from __future__ import annotations

import json
import os
from typing import Any

from radixserve.model_runner.lora.adapter import CONFIG_FILE, LoRAAdapterError
from radixserve.model_runner.lora.manager import LoRAManager

DEFAULT_MAX_LORA_RANK = 16


def startup_adapters(lora_paths: "list[str] | tuple[str, ...]") -> list[tuple[str, str]]:
    """(name, path) of each "name=path" entry (ServerArgs has normalised every accepted form to that)."""
    return [(item.partition("=")[0], item.partition("=")[2]) for item in lora_paths or []]


def resolved_max_rank(max_lora_rank: Any, adapters: list[tuple[str, str]]) -> int:
    """`--max-lora-rank`, or the largest rank among the start-up adapters (DEFAULT_MAX_LORA_RANK without any)."""
    if max_lora_rank is not None:
        return int(max_lora_rank)
    ranks = []
    for name, path in adapters:
        config = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(config):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path!r}")
        with open(config, encoding="utf-8") as f:
            ranks.append(int(json.load(f).get("r", 0)))
    return max(ranks, default=DEFAULT_MAX_LORA_RANK)


def create_lora_manager(runner: Any) -> LoRAManager:
    args = runner.config
    if runner.model_config.moe is not None:  # the adapters' MLP targets have no counterpart in the stacked experts
        raise ValueError(f"LoRA adapters are not supported on mixture-of-experts models "
                         f"({runner.model_config.architecture})")
    adapters = startup_adapters(args.lora_paths)
    manager = LoRAManager(runner.model, runner.model_config, args.max_loras_per_batch,
                          resolved_max_rank(args.max_lora_rank, adapters), runner.dtype, runner.device)
    for name, path in adapters:
        manager.load(name, path)
    return manager
