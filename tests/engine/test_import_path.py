"""No process radixserve starts can import one of the checkout's top-level folders under its bare name.

The folders install as `radixserve.<folder>`; with the repository root on `sys.path`, a dependency's bare
`import kernels` (transformers >= 5.25 imports Hugging Face's `kernels` when it builds a model) would load
radixserve's `kernels/` instead. Checked here for the suite itself, for the CLI (the servers' entry point) started
from the root, and for the Engine's spawned children of a parent whose `sys.path` starts with the root.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import zmq

from radixserve.runtime.import_path import MAPPED_FOLDERS, bare_imports_into_checkout, shadowing_entries
from radixserve.runtime.launch import ChildProcesses, EngineStartupError
from radixserve.runtime.wire.ipc import IpcPaths, make_pull, make_push
from radixserve.runtime.wire.messages import ProcessFailed, ProcessReady, encode
from radixserve.runtime.wire.server_args import ServerArgs

ROOT = Path(__file__).resolve().parents[2]


def test_every_mapped_folder_is_a_folder_of_the_checkout():
    top_level = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"radixserve"}
    assert top_level == set(MAPPED_FOLDERS)


def test_the_suite_imports_no_folder_by_its_bare_name():
    assert shadowing_entries() == [], f"sys.path holds the repository root: {sys.path}"
    assert bare_imports_into_checkout() == {}


def test_a_hugging_face_model_builds_in_the_suite():
    """The failure a root-first `sys.path` causes: transformers building a model imports `kernels`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long)).logits
    assert logits.shape == (1, 3, 64)
    kernels = sys.modules.get("kernels")
    if kernels is not None:
        assert Path(kernels.__file__).resolve().parent != ROOT / "kernels", kernels.__file__


def test_cli_started_from_the_root_imports_no_folder_by_its_bare_name():
    """`python -m radixserve ...` from the root puts the root first on `sys.path`; the CLI drops it before
    anything else runs (the servers start through the same `main`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-m", "radixserve", "check-env"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "import path: clean" in done.stdout
    kernels_line = next(line for line in done.stdout.splitlines() if line.startswith("import kernels:"))
    assert str(ROOT / "kernels") not in kernels_line
    for name in ("torch", "transformers", "xgrammar", "flashinfer-python"):
        assert any(line.startswith(f"{name}: ") for line in done.stdout.splitlines()), name


def _probe_entry(server_args: ServerArgs, ipc: IpcPaths, parent_pid: int) -> None:
    """A child entry that reports ready only if no bare import reaches the checkout."""
    context = zmq.Context()
    sender = make_push(context, ipc.detokenizer_to_tokenizer)
    try:
        found = bare_imports_into_checkout()
        assert not found and not shadowing_entries(), f"bare imports {found}, sys.path {sys.path}"
        assert importlib.util.find_spec("radixserve.kernels") is not None
        sender.send(encode(ProcessReady(process="probe")))
    except Exception:
        sender.send(encode(ProcessFailed(process="probe", error=traceback.format_exc())))
    sender.close(linger=5000)
    context.term()


def test_engine_children_drop_the_root_from_a_parents_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # a user's script run from the root
    assert shadowing_entries() == [str(ROOT)]
    ipc = IpcPaths.create()
    context = zmq.Context()
    socket = make_pull(context, ipc.detokenizer_to_tokenizer)
    children = ChildProcesses(ServerArgs(), ipc, entries={"probe": _probe_entry})
    try:
        children.start()
        try:
            children.wait_ready(socket, timeout_s=120)
        except EngineStartupError as error:
            pytest.fail(str(error))
    finally:
        children.stop()
        socket.close(linger=0)
        context.term()
