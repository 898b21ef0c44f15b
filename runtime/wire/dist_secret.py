"""The shared secret of a tensor-parallel group that spans hosts (docs/security.md, "Across hosts").

Every node of a group started with `--nnodes N > 1` holds the same secret: the content of the file named by
`--dist-auth-secret-file` (a regular file of this user that nobody else may read or write), else the environment
variable `RADIXSERVE_DIST_SECRET`. The rendezvous admits a connection only after both ends prove they hold it
(model_runner/dist_auth.py). The secret itself never enters ServerArgs, so server info and logs cannot show it.

This module is light (no torch) so ServerArgs can check the secret before anything starts.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

SECRET_ENV = "RADIXSERVE_DIST_SECRET"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096  # a secret file is a line or two; a larger file is a mistake, not a key


def load_dist_secret(path: Optional[str]) -> Optional[bytes]:
    """The group's secret, surrounding whitespace stripped: the file at `path` when given, else the environment
    variable's value, else None. ValueError naming the defect for a file that is not a regular file of this user,
    that others may read or write, or a secret shorter than MIN_SECRET_BYTES."""
    if path is not None:
        secret = _read_secret_file(path)
        source = f"dist_auth_secret_file {path!r}"
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV].encode().strip()
        source = SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source} holds {len(secret)} bytes; the group's secret needs at least {MIN_SECRET_BYTES} "
                         "(for example `openssl rand -hex 32`)")
    return secret


def _read_secret_file(path: str) -> bytes:
    """The file's bytes, checked on the descriptor read (so a file swapped in after the check is never read)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ValueError(f"dist_auth_secret_file {path!r} cannot be opened: {error.strerror} (a symbolic link is "
                         "refused too)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"dist_auth_secret_file {path!r} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ValueError(f"dist_auth_secret_file {path!r} belongs to uid {info.st_uid}, not to this user "
                             f"(uid {os.geteuid()})")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(f"dist_auth_secret_file {path!r} has mode {stat.S_IMODE(info.st_mode):o}: others may "
                             f"read or change it; `chmod 600 {path}`")
        if info.st_size > MAX_SECRET_BYTES:
            raise ValueError(f"dist_auth_secret_file {path!r} holds {info.st_size} bytes, more than a secret's "
                             f"{MAX_SECRET_BYTES}")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(MAX_SECRET_BYTES + 1).strip()
    finally:
        os.close(fd)
