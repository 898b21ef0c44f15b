"""Model registry: Hugging Face architecture names -> runtime model classes."""

from __future__ import annotations

from torch import nn

from radixserve.model_runner.models.bert import BertModel
from radixserve.model_runner.models.gemma3 import Gemma3ForCausalLM
from radixserve.model_runner.models.gemma4 import Gemma4ForCausalLM
from radixserve.model_runner.models.gpt_oss import GptOssForCausalLM
from radixserve.model_runner.models.llama import LlamaForCausalLM
from radixserve.model_runner.models.mixtral import MixtralForCausalLM
from radixserve.model_runner.models.qwen2 import Qwen2ForCausalLM
from radixserve.model_runner.models.qwen2_moe import Qwen2MoeForCausalLM
from radixserve.model_runner.models.qwen3 import Qwen3ForCausalLM
from radixserve.model_runner.models.qwen3_5 import Qwen3_5ForCausalLM
from radixserve.model_runner.models.qwen3_moe import Qwen3MoeForCausalLM
from radixserve.model_runner.models.qwen3_next import Qwen3NextForCausalLM
from radixserve.model_runner.models.sequence_classification import (LlamaForSequenceClassification,
                                                                    Qwen2ForSequenceClassification,
                                                                    Qwen3ForSequenceClassification)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "BertModel": BertModel,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class serving `architecture` (as in config.json's `architectures`); ValueError if none does."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


__all__ = ["MODEL_REGISTRY", "BertModel", "Gemma3ForCausalLM", "Gemma4ForCausalLM", "GptOssForCausalLM",
           "LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
           "Qwen3ForSequenceClassification", "get_model_class", "LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
           "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM",
           "Qwen3NextForCausalLM"]
