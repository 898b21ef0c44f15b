"""The files of runtime/http/static/ (package data: the cache page, its stylesheet and script)."""

from __future__ import annotations

from importlib import resources


def static_text(name: str) -> str:
    """The text of runtime/http/static/`name`, from the installed package (or the source tree in development)."""
    return resources.files("radixserve.runtime.http").joinpath("static", name).read_text(encoding="utf-8")
