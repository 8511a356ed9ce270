"""Acceleration components and their composition (DESIGN.md, seam 3)."""

from .policy import AccelPolicy, PolicyConfig, build_policy, component_config
from .registry import REGISTRIES

__all__ = ["AccelPolicy", "PolicyConfig", "REGISTRIES", "build_policy", "component_config"]
