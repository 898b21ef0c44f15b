"""`global_config`: the DSL's process-wide settings (SGLang's `sgl.global_config`).

    from radixserve import global_config
    global_config.default_backend                  # the same as get_default_backend()
    global_config.verbosity = 2                    # print each program's text when its run ends
    global_config.enable_precache_with_tracing = False

Only the settings below exist; setting any other name raises AttributeError (an SGLang setting that
radixserve does not implement is refused rather than silently ignored).
"""

from __future__ import annotations

from typing import Any

from radixserve.frontend.backends.default import get_default_backend, set_default_backend


class GlobalConfig:
    """Settings read by every program run:

    - `default_backend`: the backend programs run on without `backend=`, as set_default_backend was given it (a
      Runtime stays a Runtime: programs run on its endpoint).
    - `verbosity`: 2 or more prints a program's text when `run` finishes (0 by default).
    - `enable_precache_with_tracing`: `run_batch` prefills the prefix its programs share before running them
      (see tracing.py); True by default.
    - `skip_special_tokens_in_output`, `spaces_between_special_tokens_in_out`: the `skip_special_tokens` and
      `spaces_between_special_tokens` sampling parameters of every gen (True by default, as in SGLang).
    """

    _SETTINGS = {"verbosity": int, "enable_precache_with_tracing": bool, "skip_special_tokens_in_output": bool,
                 "spaces_between_special_tokens_in_out": bool}
    __slots__ = tuple(_SETTINGS)

    def __init__(self) -> None:
        self.verbosity = 0
        self.enable_precache_with_tracing = True
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True

    @property
    def default_backend(self) -> Any:
        return get_default_backend()

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        set_default_backend(backend)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "default_backend":
            object.__setattr__(self, name, value)
            return
        kind = self._SETTINGS.get(name)
        if kind is None:
            raise AttributeError(f"global_config has no setting {name!r}; radixserve supports "
                                 f"{['default_backend', *self._SETTINGS]}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"global_config.{name} must be {kind.__name__}, got {type(value).__name__}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._SETTINGS)
        return f"GlobalConfig(default_backend={self.default_backend!r}, {values})"


global_config = GlobalConfig()
