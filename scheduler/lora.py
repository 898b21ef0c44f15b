"""The scheduler's side of LoRA: which requests may run (a known adapter), which fit a batch
(`--max-loras-per-batch` distinct adapters among the running requests and the batch being built), and the
load/unload RPCs.

Unloading refuses while a request of the adapter is queued or running (the caller retries once they finish),
then drops the adapter's cache namespaces: KV computed under it is freed, never matched again, even by a new
adapter loaded later under the same name.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

from radixserve.runtime.wire.lora import (
    LoadLoRAAdapterReq, LoRAAdapterReqOutput, UnloadLoRAAdapterReq, namespace_part,
)
from radixserve.scheduler.req import Req

logger = logging.getLogger(__name__)


class LoRAScheduling:
    def __init__(self, manager: Any) -> None:
        self.manager = manager  # the runner's LoRAManager, or None when LoRA is off

    def check(self, req: Req) -> Optional[str]:
        """Why `req` cannot run (a 400 message), or None."""
        if req.lora_name is None:
            return None
        if self.manager is None:
            return (f"lora_path: this server serves no LoRA adapters (start it with --enable-lora or "
                    f"--lora-paths); got {req.lora_name!r}")
        if req.lora_name not in self.manager.adapters:
            return f"lora_path: no LoRA adapter named {req.lora_name!r} is loaded"
        return None

    def fits(self, req: Req, batch_reqs: Iterable[Req]) -> bool:
        """Whether `req` may join a batch whose other requests (running ones included) are `batch_reqs`."""
        if req.lora_name is None or self.manager is None:
            return True
        names = {r.lora_name for r in batch_reqs if r.lora_name is not None}
        return req.lora_name in names or len(names) < self.manager.max_loras_per_batch

    def handle(self, msg: Any, reqs: dict[str, Req], cache: Any) -> LoRAAdapterReqOutput:
        """Answer a load or unload RPC; `reqs` are the scheduler's requests not yet released, `cache` its prefix
        cache (an unloaded adapter's namespaces are evicted from it)."""
        if self.manager is None:
            return self._reply(msg, "this server serves no LoRA adapters (start it with --enable-lora)")
        try:
            if isinstance(msg, LoadLoRAAdapterReq):
                self.manager.load(msg.lora_name, msg.lora_path)
            elif isinstance(msg, UnloadLoRAAdapterReq):
                error = self._unload(msg.lora_name, reqs, cache)
                if error is not None:
                    return self._reply(msg, error)
        except ValueError as error:  # LoRAAdapterError, or a malformed adapter file
            return self._reply(msg, str(error))
        except OSError as error:
            return self._reply(msg, f"cannot read LoRA adapter {msg.lora_name!r}: {error}")
        return self._reply(msg, None)

    def _unload(self, name: str, reqs: dict[str, Req], cache: Any) -> Optional[str]:
        if name not in self.manager.adapters:
            return f"no LoRA adapter named {name!r} is loaded"
        users = [r.rid for r in reqs.values() if r.lora_name == name]
        if users:
            return (f"LoRA adapter {name!r} is in use by {len(users)} queued or running request(s); unload it "
                    "once they finish")
        self.manager.unload(name)
        part = namespace_part(name)
        freed = cache.evict_namespaces(lambda namespace: part in namespace)
        logger.info("LoRA adapter %s unloaded; %d cached tokens of it freed", name, freed)
        return None

    def _reply(self, msg: Any, error: Optional[str]) -> LoRAAdapterReqOutput:
        loaded = self.manager.loaded() if self.manager is not None else {}
        return LoRAAdapterReqOutput(msg.rpc_id, error is None, error, loaded, 200 if error is None else 400)
