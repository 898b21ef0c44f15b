"""Server flags through the real command line: every boolean can be turned on and off, flags that cannot work
are refused at start-up with a clear message, and a server started with `--no-enable-metrics` has no /metrics."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import httpx
import pytest

from radixserve.__main__ import _parser
from radixserve.runtime.wire.server_args import ServerArgs
from http_fixtures import ServerProcess

BOOL_FIELDS = [f.name for f in fields(ServerArgs) if str(f.type) in ("bool", "Optional[bool]")]


def _parse(*flags: str) -> ServerArgs:
    return ServerArgs.from_cli_args(_parser().parse_args(["serve", *flags]))


def test_every_boolean_flag_can_be_set_and_cleared():
    assert {"enable_metrics", "check_invariants_when_idle", "disable_radix_cache"} <= set(BOOL_FIELDS)
    defaults = _parse()
    for name in BOOL_FIELDS:
        flag = "--" + name.replace("_", "-")
        assert getattr(defaults, name) == getattr(ServerArgs(), name), name
        assert getattr(_parse(flag), name) is True, flag
        assert getattr(_parse("--no-" + flag[2:]), name) is False, flag
    assert _parse("--no-enable-metrics").enable_metrics is False
    assert _parse("--no-check-invariants-when-idle").check_invariants_when_idle is False
    assert _parse("--enable-metrics").enable_metrics is True


def test_numeric_flags_that_are_read_by_the_runtime():
    args = _parse("--watchdog-timeout", "12.5", "--sampling-backend", "pytorch", "--tp-size", "1")
    assert (args.watchdog_timeout, args.sampling_backend, args.tp_size) == (12.5, "pytorch", 1)


@pytest.mark.parametrize("flags, message", [
    (["--sampling-backend", "flashinfer"], "samples with PyTorch only"),
    (["--sampling-backend", "nonsense"], "samples with PyTorch only"),
    (["--tp-size", "2", "--nnodes", "2"], "nnodes > 1 needs dist_init_addr"),
    (["--watchdog-timeout", "0"], "watchdog_timeout must be positive"),
])
def test_flags_that_cannot_work_are_refused_at_start_up(flags, message):
    done = subprocess.run([sys.executable, "-m", "radixserve", "serve", *flags], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_a_server_with_metrics_turned_off():
    server = ServerProcess("--no-enable-metrics", "--no-check-invariants-when-idle", "--sampling-backend", "pytorch",
                           "--log-level", "warning")
    try:
        assert httpx.get(server.url + "/metrics", timeout=30.0).status_code == 404
        info = server.server_info()
        assert info["sampling_backend"] == "pytorch"
        ok = httpx.post(server.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
                        timeout=60.0)
        assert ok.status_code == 200
    finally:
        assert server.stop() == 0
