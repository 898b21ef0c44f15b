"""LoRA adapters on the wire: the load/unload RPCs, how an adapter appears in a cache namespace, and the forms of
`--lora-paths` (`parse_lora_paths`, which ServerArgs checks it with).

SGLang's names: `POST /load_lora_adapter` with `{"lora_name", "lora_path", "pinned"}`, `POST /unload_lora_adapter`
with `{"lora_name"}`; both answer with whether it worked, the error, and the adapters loaded afterwards.

Light module: msgspec only, so every process may import it.
"""

from __future__ import annotations

import json
from typing import Any, Optional

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


def parse_lora_paths(value: Any) -> list[str]:
    """SGLang's forms of lora_paths as a list of "name=path": a list of "name=path", "path" or JSON objects
    {"lora_name", "lora_path"[, "pinned"]}, or a dict name -> path. Raises ValueError for anything else."""
    if isinstance(value, dict):
        value = [f"{name}={path}" for name, path in value.items()]
    if isinstance(value, str):
        value = [value]
    out: list[str] = []
    for item in value:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            item = json.loads(item)
        if isinstance(item, dict):
            unknown = set(item) - {"lora_name", "lora_path", "pinned"}
            if unknown or not isinstance(item.get("lora_name"), str) or not isinstance(item.get("lora_path"), str):
                raise ValueError(f"lora_paths: an adapter object needs lora_name and lora_path, got {item!r}")
            item = f"{item['lora_name']}={item['lora_path']}"
        if not isinstance(item, str) or not item:
            raise ValueError(f"lora_paths: expected 'name=path' or a path, got {item!r}")
        name, sep, path = item.partition("=")
        out.append(item if sep else f"{item}={item}")
        if sep and (not name or not path):
            raise ValueError(f"lora_paths: expected 'name=path', got {item!r}")
    names = [item.partition("=")[0] for item in out]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_paths: adapter names must be distinct, got {names}")
    return out
