"""Keep the checkout's top-level folders from being importable under their bare names.

radixserve's folders (`kernels/`, `runtime/`, `scheduler/`, ...) install as `radixserve.<folder>`. A process whose
`sys.path` holds the folder above them (the repository root: `python -m ...` or `python -c ...` run from there
put the working directory first) would let a dependency's bare `import kernels` (transformers >= 5.25 imports
Hugging Face's `kernels`) find radixserve's folder instead. Every process radixserve starts calls
`drop_checkout_from_sys_path()` before it imports anything that could do such an import.

Light on purpose: the standard library only, nothing of the project.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

# The subpackages that pyproject.toml maps from a top-level folder of the same name.
MAPPED_FOLDERS = ("runtime", "tokenizer_manager", "scheduler", "detokenizer_manager", "radix_cache",
                  "model_runner", "kernels", "frontend")


def _folder_of(package: str) -> Path | None:
    """Where `radixserve.<package>` lives, without importing it (None if it does not resolve)."""
    try:
        spec = importlib.util.find_spec(f"radixserve.{package}")
    except ImportError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def shadowing_entries(path: list[str] | None = None) -> list[str]:
    """The entries of `path` (default `sys.path`) from which a bare `import <folder>` finds one of radixserve's
    own folders. An empty entry stands for the working directory."""
    folders = {folder: _folder_of(folder) for folder in MAPPED_FOLDERS}
    shadowing = []
    for entry in sys.path if path is None else path:
        base = Path(entry or os.getcwd())
        try:
            base = base.resolve()
        except OSError:
            continue
        if any(location is not None and base / name == location for name, location in folders.items()):
            shadowing.append(entry)
    return shadowing


def drop_checkout_from_sys_path() -> list[str]:
    """Remove every `sys.path` entry that would make radixserve's folders importable under their bare names;
    return the entries removed. Idempotent."""
    removed = shadowing_entries()
    if removed:
        sys.path[:] = [entry for entry in sys.path if entry not in removed]
        importlib.invalidate_caches()
    return removed


def bare_imports_into_checkout() -> dict[str, str]:
    """{folder name: the file a bare `import <folder>` would load} for each of radixserve's folders that such an
    import would find in the checkout. Empty when the process is clean."""
    found = {}
    for name in MAPPED_FOLDERS:
        own = _folder_of(name)
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module is not None else None
        if origin is None:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            origin = spec.origin if spec is not None else None
        if origin and own is not None and Path(origin).resolve().parent == own:
            found[name] = origin
    return found
