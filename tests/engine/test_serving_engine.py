"""The engine an HTTP app serves (runtime/serving_engine.py): the in-process Engine and the Ray ingress's EngineProxy
both implement the ServingEngine protocol. Checked statically (mypy, on a function typed with the protocol called
with both), member by member against the protocol's signatures (so a method added to one and not the other fails
here), and by create_app at run time. The Engine's own isinstance check is in tests/engine/test_engine.py."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.http.server import create_app
from radixserve.runtime.ray_serve.proxy import EngineProxy
from radixserve.runtime.serving_engine import ServingEngine
from radixserve.runtime.wire.server_args import ServerArgs

# Coroutine methods of the Engine that are its Python API, not the HTTP app's (which uses generate_request and the
# typed async_server_info): a new one must be added to the protocol or here.
ENGINE_ONLY = {"async_generate", "async_get_server_info"}
# Third-party packages whose own types do not matter here: not analysed, so the check takes seconds.
UNTYPED = ("torch", "transformers", "ray", "fastapi", "starlette", "pydantic", "numpy", "zmq", "tokenizers",
           "xgrammar", "triton", "safetensors", "gguf", "huggingface_hub", "jinja2", "uvicorn", "psutil", "tqdm",
           "httpx", "prometheus_client", "orjson", "flashinfer")
SUBPACKAGES = ("runtime", "tokenizer_manager", "scheduler", "detokenizer_manager", "radix_cache", "model_runner",
               "kernels", "frontend")


def protocol_methods() -> dict[str, inspect.Signature]:
    methods = {}
    for name, member in vars(ServingEngine).items():
        if name.startswith("_"):
            continue
        function = member.fget if isinstance(member, property) else member
        methods[name] = inspect.signature(function)
    return methods


def test_engine_and_proxy_have_the_protocols_signatures():
    methods = protocol_methods()
    assert {"generate_request", "async_server_info", "abort", "is_healthy", "lora_adapters"} <= set(methods)
    for name, expected in methods.items():
        members = [inspect.getattr_static(cls, name) for cls in (Engine, EngineProxy)]
        if isinstance(inspect.getattr_static(ServingEngine, name), property):
            assert all(isinstance(member, property) for member in members), name
            members = [member.fget for member in members]
        for cls, member in zip((Engine, EngineProxy), members):
            assert inspect.signature(member) == expected, f"{cls.__name__}.{name}{inspect.signature(member)}"
        engine_member, proxy_member = members
        for kind in (inspect.iscoroutinefunction, inspect.isasyncgenfunction):
            assert kind(engine_member) == kind(proxy_member), f"{name}: one is {kind.__name__[2:]} and not the other"


def test_nothing_public_outside_the_protocol():
    members = set(protocol_methods()) | set(ServingEngine.__annotations__)
    proxy_public = {name for name in vars(EngineProxy) if not name.startswith("_")}
    assert proxy_public <= members, f"EngineProxy's {sorted(proxy_public - members)} belong in ServingEngine"
    engine_async = {name for name, member in vars(Engine).items()
                    if not name.startswith("_") and inspect.iscoroutinefunction(member)}
    assert engine_async - members <= ENGINE_ONLY, (
        f"Engine's {sorted(engine_async - members - ENGINE_ONLY)}: in ServingEngine (and EngineProxy), or in "
        "ENGINE_ONLY")


def source_tree(root: Path) -> Path:
    """The package as a plain folder tree (links to the folders the installed package maps), which mypy reads
    where it cannot follow the editable install's import hook."""
    package = root / "radixserve"
    package.mkdir(parents=True)
    (package / "__init__.py").symlink_to(importlib.import_module("radixserve").__file__)
    for name in SUBPACKAGES:
        (package / name).symlink_to(Path(importlib.import_module(f"radixserve.{name}").__file__).parent)
    return root


def test_mypy_accepts_both_and_refuses_a_partial_engine(tmp_path):
    root = source_tree(tmp_path / "src")
    (tmp_path / "both.py").write_text(
        "from radixserve.runtime.engine import Engine\n"
        "from radixserve.runtime.ray_serve.proxy import EngineProxy\n"
        "from radixserve.runtime.serving_engine import ServingEngine\n\n\n"
        "def serve(engine: ServingEngine) -> None: ...\n\n\n"
        "def check(engine: Engine, proxy: EngineProxy) -> None:\n"
        "    serve(engine)\n"
        "    serve(proxy)\n")
    (tmp_path / "partial.py").write_text(
        "from radixserve.runtime.serving_engine import ServingEngine\n\n\n"
        "class Partial:\n"
        "    def is_healthy(self) -> bool:\n"
        "        return True\n\n\n"
        "def serve(engine: ServingEngine) -> None: ...\n\n\n"
        "serve(Partial())\n")
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nfollow_imports = silent\nignore_missing_imports = True\nincremental = False\n\n"
        f"[mypy-{','.join(name + '.*' for name in UNTYPED)}]\nfollow_imports = skip\n")
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "both.py", "partial.py"],
                            cwd=tmp_path, env={"MYPYPATH": str(root), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("partial.py:12:"), result.stdout + result.stderr
    assert '"Partial"; expected "ServingEngine"' in errors[0]


def test_create_app_refuses_what_is_not_a_serving_engine():
    with pytest.raises(TypeError, match="ServingEngine"):
        create_app(object(), ServerArgs())
