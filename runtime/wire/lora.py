"""LoRA adapters on the wire: the load/unload RPCs and how an adapter appears in a cache namespace.

SGLang's names: `POST /load_lora_adapter` with `{"lora_name", "lora_path", "pinned"}`, `POST /unload_lora_adapter`
with `{"lora_name"}`; both answer with whether it worked, the error, and the adapters loaded afterwards.

Light module: msgspec only, so every process may import it.
"""

from __future__ import annotations

from typing import Optional

import msgspec

NAMESPACE_PREFIX = "lora:"


def namespace_part(lora_name: str) -> str:
    """The cache-namespace part of an adapter: KV computed under one adapter is never matched under another."""
    return NAMESPACE_PREFIX + lora_name


class LoadLoRAAdapterReq(msgspec.Struct, tag=True):
    rpc_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's: never evicted from the device slots (every adapter stays loaded here)


class UnloadLoRAAdapterReq(msgspec.Struct, tag=True):
    rpc_id: str
    lora_name: str


class LoRAAdapterReqOutput(msgspec.Struct, tag=True):
    rpc_id: str
    success: bool
    error_message: Optional[str] = None
    loaded_adapters: dict[str, str] = {}  # name -> path, after the call
    status_code: int = 200  # 400: the request was wrong (bad path, unknown or busy adapter)
