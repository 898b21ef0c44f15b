"""What a request must pass once its prompts are tokenized, before the TokenizerManager sends any of it.

`tokenize_and_check` tokenizes each prompt given as text (on the TokenizerWorker's thread, through the manager's
`encode`), then applies the length rule (`SamplingParams.fit_context`) and what only the token ids or the engine's
present state decide: `logprob_start_len` within the prompt, the LoRA adapter among those loaded. The ValueError of a
prompt that fails names that prompt (`located`); the manager then sends nothing of the batch. `manager` is the
TokenizerManager, on its event loop.
"""

from __future__ import annotations

from typing import Any

from radixserve.runtime.wire.request import NormalizedRequest, located
from radixserve.runtime.wire.sampling_params import SamplingParams


async def tokenize_and_check(manager: Any,
                             request: NormalizedRequest) -> list[tuple[tuple[int, ...], SamplingParams]]:
    """Each prompt's token ids and its sampling parameters under the length rule (`fit_context`), once its
    length is known; and what the tokens or the engine's present state decide (logprob_start_len, the
    adapter)."""
    checked = []
    for prompt in request.prompts:
        try:
            input_ids = prompt.input_ids
            if input_ids is None:
                input_ids = tuple(await manager.encode(prompt.text))  # a tuple, as split_prompts makes them
            sampling = prompt.sampling_params.fit_context(len(input_ids), manager.limits)
            lora_name = prompt.options.lora_name
            if lora_name is not None and lora_name not in manager.lora_adapters:
                raise ValueError(_unknown_adapter(lora_name, manager.model_info.lora_enabled))
            start_len = prompt.options.logprob_start_len
            if not -1 <= start_len <= len(input_ids):
                raise ValueError(f"logprob_start_len must be -1 or in [0, {len(input_ids)}], got {start_len}")
        except ValueError as exc:
            raise located(exc, prompt.index, prompt.input_ids is not None, request.single) from None
        checked.append((input_ids, sampling))
    return checked


def _unknown_adapter(name: str, lora_enabled: bool) -> str:
    if not lora_enabled:
        return (f"lora_path: this server serves no LoRA adapters (start it with --enable-lora or --lora-paths); "
                f"got {name!r}")
    return f"lora_path: no LoRA adapter named {name!r} is loaded"
