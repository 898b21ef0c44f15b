"""Importing this module makes `radixserve.<folder>` importable straight from the source tree.

The project installs its top-level folders as `radixserve.<folder>` (see pyproject.toml). Where it is not
installed (a GPU host without the project's wheel), this module loads the checkout's `radixserve/` package with
the checkout root on the *package's* search path, so every folder beside `radixserve/` resolves as
`radixserve.<folder>`, while the root itself stays off `sys.path` (a bare `import kernels` from a dependency must
find Hugging Face's package, not the checkout's folder). Where the project is installed, it changes nothing.

Used by the benchmark scripts (`import _srcpath` from `benchmarks/`) and as a pytest plugin on the GPU host:
`PYTHONPATH=$PWD/benchmarks python -P -m pytest -p _srcpath tests/...` (the plugin is imported before any
conftest, so the tests' own `radixserve` imports resolve; `-P` keeps the working directory off `sys.path`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def map_source_tree() -> None:
    """Idempotent: make `radixserve.<folder>` resolve to `ROOT/<folder>` unless it already resolves."""
    try:
        import radixserve.kernels  # noqa: F401  (only whether it resolves)

        return
    except ImportError:
        pass
    package = sys.modules.get("radixserve")
    if package is None:
        spec = importlib.util.spec_from_file_location(
            "radixserve", ROOT / "radixserve" / "__init__.py",
            submodule_search_locations=[str(ROOT / "radixserve"), str(ROOT)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["radixserve"] = package
        spec.loader.exec_module(package)
    elif str(ROOT) not in package.__path__:
        package.__path__.append(str(ROOT))


map_source_tree()
