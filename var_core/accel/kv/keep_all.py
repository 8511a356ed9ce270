"""Every cached key stays (the plain KV cache)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import KVPolicy
from ..knobs import ComponentConfig
from ..registry import KV_POLICIES


@KV_POLICIES.register("keep_all")
class KeepAll(KVPolicy):
    """Every cached key stays for every later scale (the default; no eviction)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass
