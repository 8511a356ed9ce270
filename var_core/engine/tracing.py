"""The tracing seam: named spans the loop opens around its work, implemented by ``profilers``.

The engine defines the protocol and a null implementation; ``profilers`` supplies timers and
``torch.profiler.record_function`` tracers. With the null tracer every span is a shared no-op context
manager, so instrumentation costs one attribute lookup and one call per span when off.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

_NULL_CONTEXT = contextlib.nullcontext()


class Tracer:
    """Base tracer: ``span(component, scale=None, block=None)`` returns a context manager.

    Component names used by the loop: ``embed``, ``attn``, ``ffn``, ``cross``, ``plan``, ``restore``, ``head``,
    ``lens``, ``sampling``, ``latent_update``, ``vq_decode``, ``text_encode``; policies use ``accel/<name>``.
    """

    enabled = False

    def span(self, component: str, scale: int | None = None, block: int | None = None) -> ContextManager:
        return _NULL_CONTEXT

    def scale_begin(self, scale: int) -> None:  # noqa: D401 - hook for memory/timing per scale
        """Called before a scale starts (e.g. to reset CUDA peak-memory counters)."""

    def scale_end(self, scale: int) -> None:
        """Called after a scale's latent update."""


NULL_TRACER = Tracer()
