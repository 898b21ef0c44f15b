"""Build and load the C++ CPU kernels (`cpu_attention.cpp`, `cpu_elementwise.cpp`, `cpu_linear.cpp`,
`cpu_gguf_linear.cpp`, ...) once per machine, at first use.

The source is compiled by torch's C++ extension builder (g++ with `-O3 -march=native`, ninja) into a cache folder
keyed by the source, the torch version and this CPU's instruction set, so a build made on one CPU is never loaded
on another; later processes only load the library (about a second). `make setup` builds it, so a fresh server
does not wait; where it was not built, `start_background_build` builds it in a thread and the callers use the
torch path until `ready()` turns true. `--cpu-kernels torch` turns the kernels off (`set_enabled`); which kernel
runs for which call is the runner's dispatch table (model_runner/cpu/dispatch.py).

    python -m radixserve.kernels.cpu_build      # build now, print where and how long
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in (
    "cpu_attention.cpp", "cpu_elementwise.cpp", "cpu_linear.cpp", "cpu_amx_linear.cpp",
    "cpu_argmax.cpp", "cpu_panel_linear.cpp", "cpu_gguf_linear.cpp", "cpu_decode_layers.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in (
    "cpu_vec.h", "cpu_gguf_kquants.h", "cpu_gguf_q8.h", "cpu_gguf_x16.h", "cpu_attention_amx.h",
    "cpu_attention_dots.h", "cpu_attention_lanes.h")]
# -fopenmp: ATen's parallel_for is inline OpenMP; the library binds to the libgomp torch already loaded (same
# soname), so there is one thread pool.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
LIBRARY_NAME = "radixserve_cpu"  # the TORCH_LIBRARY namespace: torch.ops.radixserve_cpu.*
LIBRARY_FILE = "radixserve_cpu_kernels.so"
BUILT_STAMP = "built"  # written once the library is whole: a folder without it is built (again) before loading

_lock = threading.Lock()
_loaded = False
_error: Optional[str] = None
_thread: Optional[threading.Thread] = None
_enabled = True


def set_enabled(on: bool) -> None:
    """`--cpu-kernels`: `auto` (on, the default) or `torch` (every CPU op on torch's own path, even where the kernels
    are loaded). Process-wide, as the kernels are: the ModelRunner sets it from its server arguments."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


@functools.lru_cache(maxsize=None)
def _cpuinfo_field(name: str) -> str:
    """The first `name` line's value in `/proc/cpuinfo` (read once per field and process); empty where
    unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def cpu_flags() -> str:
    """The CPU's instruction-set flags (`/proc/cpuinfo`), sorted; empty where unreadable."""
    return " ".join(sorted(_cpuinfo_field("flags").split()))


@functools.lru_cache(maxsize=None)
def has_cpu_flag(flag: str) -> bool:
    """Whether `/proc/cpuinfo` lists `flag` (`avx512f`, `amx_bf16`, ...) for this CPU."""
    return flag in cpu_flags().split()


def cpu_vendor() -> str:
    """The CPU's vendor as `/proc/cpuinfo` names it (`GenuineIntel`, `AuthenticAMD`, ...); empty where
    unreadable."""
    return _cpuinfo_field("vendor_id")


# The flags that decide CPU speed here (AVX2 only: bfloat16 is slow; VNNI: the GGUF blocks' integer dot products;
# AMX: bfloat16 matmuls on tiles).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def cpu_isa() -> str:
    """Which of `ISA_FLAGS` this CPU has, comma-separated (the machine's name where none is known), printed
    with every CPU figure."""
    return ",".join(f for f in ISA_FLAGS if has_cpu_flag(f)) or platform.machine()


def cpu_model() -> str:
    """The CPU's name and generation as `/proc/cpuinfo` gives them (`AMD EPYC, family 26 model 2`), printed beside
    `cpu_isa()`: machines of one name differ by generation (a family-25 and a family-26 EPYC run the same 512-bit
    kernels at different widths); empty where unreadable."""
    name, family, model = (_cpuinfo_field(f) for f in ("model name", "cpu family", "model"))
    return f"{name}, family {family} model {model}" if name and family else name


def build_directory() -> Path:
    """The cache folder of this checkout's build. Its key holds the sources' folder too: torch's builder writes
    the source paths into its ninja file, so two checkouts of the same sources sharing one folder would each
    rebuild the library (both cores for about 30 s, on the torch path meanwhile) whenever the other used it last."""
    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES + HEADERS), str(SOURCES[0].parent.resolve()).encode(),
                 torch.__version__.encode(), cpu_flags().encode(), " ".join(CFLAGS).encode()):
        key.update(part)
    root = Path(os.environ.get("RADIXSERVE_CACHE_DIR", Path.home() / ".cache" / "radixserve"))
    return root / "kernels" / f"cpu-{key.hexdigest()[:16]}"


def load() -> bool:
    """Build (if needed) and load the kernels, blocking; True when `torch.ops.radixserve_cpu` is usable. A
    failed build is logged once and remembered, and the callers keep the torch path."""
    global _loaded, _error
    with _lock:
        if _loaded or _error is not None or not enabled():
            return _loaded
        started = time.perf_counter()
        try:
            directory = build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            with _build_lock(directory):
                if not (directory / BUILT_STAMP).is_file():
                    _build(directory)
                torch.ops.load_library(str(directory / LIBRARY_FILE))
            _loaded = True
            logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - started, directory)
        except Exception as exc:  # noqa: BLE001 - any build failure means the torch path
            _error = f"{type(exc).__name__}: {exc}"
            logger.warning("CPU kernels unavailable, using the torch path: %s", _error)
        return _loaded


def _build(directory: Path) -> None:
    """Compile the library into `directory` in a child process, and mark it built.

    torch's extension builder runs `ninja` by name; the `ninja` package installs its binary in the environment's
    scripts folder, which is not on PATH when the environment's Python runs without being activated. The child is
    given a PATH that holds the binary found here, so this process's own environment stays as it was. Building in
    a child also keeps the builder's import of setuptools (which swaps `distutils` modules in `sys.modules`) away
    from imports running in this process's other threads."""
    ninja = shutil.which("ninja") or shutil.which("ninja", path=sysconfig.get_path("scripts"))
    if ninja is None:
        raise RuntimeError("no ninja binary on PATH or in this environment (pip install ninja)")
    options = {"name": LIBRARY_FILE.removesuffix(".so"), "sources": [str(s) for s in SOURCES],
               "extra_cflags": CFLAGS, "extra_include_paths": [str(SOURCES[0].parent)],
               "extra_ldflags": ["-fopenmp"], "build_directory": str(directory), "is_python_module": False,
               "verbose": False}
    script = "import json, sys; from torch.utils.cpp_extension import load; load(**json.loads(sys.argv[1]))"
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(ninja), os.environ.get("PATH", "")]),
           "PYTHONSAFEPATH": "1"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(options)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the build failed:\n{(done.stdout + done.stderr)[-4000:]}")
    (directory / BUILT_STAMP).write_text(f"{LIBRARY_FILE} built\n", encoding="utf-8")


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads from `directory`, under an OS file lock that dies with its holder.

    torch's builder marks a build in progress with a `lock` file and makes every other process wait for it to go; a
    build killed half-way (Ctrl-C during `make setup`) leaves that file behind, and every later build would wait on
    it forever. Whoever holds this lock knows no build is running, so a `lock` file it finds is stale and is
    removed."""
    with open(directory / "build.flock", "w", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing a stale build lock left by a process that died mid-build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_library(path: str) -> None:
    """Load a library built before (another checkout's or commit's, from its cache folder) instead of building
    this one's: for benchmarks that compare two builds. Once loaded, this process keeps it."""
    global _loaded
    with _lock:
        if _loaded:
            raise RuntimeError("the CPU kernels are already loaded in this process")
        torch.ops.load_library(str(Path(path).expanduser()))
        _loaded = True


def ready() -> bool:
    """Whether the kernels are loaded and enabled (never blocks)."""
    return _loaded and _enabled


def start_background_build() -> None:
    """Load the kernels in a daemon thread unless loaded, failed or already loading."""
    global _thread
    if _loaded or _error is not None or not enabled() or (_thread is not None and _thread.is_alive()):
        return
    _thread = threading.Thread(target=load, name="cpu-kernel-build", daemon=True)
    _thread.start()


def wait(timeout: Optional[float] = None) -> bool:
    """Wait for a background build; True when the kernels are loaded."""
    if _thread is not None:
        _thread.join(timeout)
    return _loaded


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    began = time.perf_counter()
    ok = load()
    print(f"CPU kernels {'ready' if ok else 'NOT built: ' + str(_error)} in {time.perf_counter() - began:.1f} s: "
          f"{build_directory()}")
    raise SystemExit(0 if ok else 1)
