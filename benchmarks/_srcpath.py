"""Importing this module makes `radixserve.<folder>` importable straight from the source tree.

The project installs its top-level folders as `radixserve.<folder>` (see pyproject.toml). Where it is not
pip-installed (the GPU host runs the checkout with `PYTHONPATH=<checkout>`), `import radixserve.kernels`
would look for `radixserve/kernels`; this module appends the checkout root to the `radixserve` package
path so that every folder beside `radixserve/` resolves. Where the project is installed, it changes nothing.

Used by the benchmark scripts (`import _srcpath` from `benchmarks/`) and as a pytest plugin on the GPU host:
`PYTHONPATH=$PWD/benchmarks:$PWD python -m pytest -p _srcpath tests/...` (the plugin is imported before
any conftest, so the tests' own `radixserve` imports resolve).
"""

from __future__ import annotations

import sys
import types
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
        try:
            import radixserve as package  # the checkout's radixserve/ on sys.path
        except ImportError:
            package = types.ModuleType("radixserve")
            package.__path__ = [str(ROOT / "radixserve")]
            sys.modules["radixserve"] = package
    if str(ROOT) not in package.__path__:
        package.__path__.append(str(ROOT))


map_source_tree()
