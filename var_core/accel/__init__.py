"""Acceleration components and their composition (DESIGN.md, seam 3)."""

from .policy import AccelPolicy, PolicyConfig, build_policy, component_config
from .registry import REGISTRIES
from . import presets  # noqa: F401,E402 - registers the per-model resolver with .policy

__all__ = ["AccelPolicy", "PolicyConfig", "REGISTRIES", "build_policy", "component_config"]
