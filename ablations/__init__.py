"""Ablation families (recipes of arms), the shared runner and the report writer.

``ablations.base`` defines :class:`Arm`, the ``@family`` registry and the swap helpers; one file per family
(``scorer``, ``activation``, ``linkage``, ``cache``, ``guidance``, ``extractor``, ``method``, ``options``);
``ablations.runner.run_study`` runs a family end to end (``python -m studies.ablate FAMILY``).
"""

from .base import FAMILIES, Arm, FamilyContext, build_arms, family, family_names, get_family

__all__ = ["FAMILIES", "Arm", "FamilyContext", "build_arms", "family", "family_names", "get_family"]
