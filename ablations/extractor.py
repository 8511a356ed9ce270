"""``extractor``: the high-frequency energy extractor inside LD-Pruning's LHEP scorer (LD-Pruning Fig. 6, right).

Base: ``ldpruning`` at the matched kept count of the ``criterion`` family (issue 28): the energy-fraction schedule
with ``counts="tokens"`` at ``ρ = criterion.MATCHED_RHO`` (``ceil(0.21·N)`` tokens at each pruned scale, LHEP's own
cost on the default testbed; see :mod:`ablations.criterion`). With LD-Pruning's energy rule each extractor's
energy map is more or less peaked and so keeps a different number of tokens, which would compare costs rather than
extractors; at the matched count every arm computes the same tokens and differs from the base (``haar``) in the
scorer's ``extractor`` knob only. Arms: every value of that knob (haar, fft, laplacian, sobel, …), read from the
knob's declared choices so a new extractor joins the study without an edit here; plus ``extractor=haar@energy``,
``ldpruning`` itself (Haar with the energy rule), the operating point the matched count stands in for.
"""

from __future__ import annotations

from .base import Arm, FamilyContext, baseline_arm, component_choices, compose, family, swap_option
from .criterion import MATCHED_RHO, matched_edit

FALLBACK = ("haar", "fft", "laplacian", "sobel")


@family("extractor", "haar vs fft vs laplacian vs sobel inside LD-Pruning's LHEP scorer, at one kept count",
        table="LD-Pruning Fig. 6 (right)")
def extractor_family(ctx: FamilyContext) -> list[Arm]:
    try:
        choices = component_choices("scorer", "lhep", "extractor") or FALLBACK
    except Exception:  # noqa: BLE001 - the scorer is not registered: the arms report it
        choices = FALLBACK
    base = compose("ldpruning", "extractor=haar", matched_edit(), role="base",
                   description=f"ldpruning at the matched count ceil({MATCHED_RHO:g}·N) per pruned scale, extractor "
                               f"haar (LD-Pruning's)")
    arms = [baseline_arm(), base]
    for name in choices:
        if name != "haar" and base.ok:
            arms.append(swap_option(base.config, "scorer", "extractor", name, arm_name=f"extractor={name}",
                                    description=f"the haar arm with the extractor {name} (same kept count)"))
    arms.append(compose("ldpruning", "extractor=haar@energy", description="ldpruning itself: Haar with the energy "
                        "rule (rho = 0.5 of the energy; the operating point the matched count stands in for)"))
    return arms
