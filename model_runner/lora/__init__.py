"""Multi-LoRA serving: PEFT adapters read from disk (adapter.py), batched deltas over the base projections
(layers.py), and the runner's adapter slots (manager.py). See docs/lora.md."""

from radixserve.model_runner.lora.adapter import LoRAAdapter, LoRAAdapterError, read_adapter
from radixserve.model_runner.lora.manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRAManager", "read_adapter"]
