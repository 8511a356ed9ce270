"""The tracing seam: named spans the loop opens around its work, implemented by ``profilers``.

The engine defines the protocol and a null implementation; ``profilers`` supplies timers and
``torch.profiler.record_function`` tracers. With the null tracer every span is a shared no-op context
manager, so instrumentation costs one attribute lookup and one call per span when off.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

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


class _CompositeSpan:
    __slots__ = ("_contexts",)

    def __init__(self, contexts: list[ContextManager]):
        self._contexts = contexts

    def __enter__(self) -> "_CompositeSpan":
        entered = []
        try:
            for context in self._contexts:
                context.__enter__()
                entered.append(context)
        except BaseException:
            for context in reversed(entered):
                context.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)


class CompositeTracer(Tracer):
    """Forwards every span and scale hook to several tracers (entered in order, exited in reverse order), since
    the loop takes one tracer. ``None`` entries are dropped.

    Put a timer first if the other tracers' span overhead should be inside its timed regions, last otherwise.
    """

    def __init__(self, *tracers: Tracer | None):
        self.tracers = tuple(t for t in tracers if t is not None)
        self.enabled = any(getattr(t, "enabled", False) for t in self.tracers)

    def span(self, component: str, scale: int | None = None, block: int | None = None) -> ContextManager:
        return _CompositeSpan([t.span(component, scale, block) for t in self.tracers])

    def scale_begin(self, scale: int) -> None:
        for tracer in self.tracers:
            tracer.scale_begin(scale)

    def scale_end(self, scale: int) -> None:
        for tracer in reversed(self.tracers):
            tracer.scale_end(scale)
