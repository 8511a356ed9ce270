"""The default results folder names --resolution / --aspect when given (two sizes of one model never share a
folder, whose records would replace each other's), and is unchanged without them (issue 26)."""

from __future__ import annotations

from ablations.runner import StudyOptions, default_out_dir


def _name(**kw) -> str:
    return str(default_out_dir(StudyOptions(family="method", samples=4, seed=1, **kw), "random:infinity-tiny"))


def test_default_out_names_resolution_and_aspect_only_when_given():
    assert _name() == "results/ablate/method_random-infinity-tiny_n4_seed1"
    assert _name(resolution="1M") == "results/ablate/method_random-infinity-tiny_n4_seed1_res-1M"
    assert _name(aspect=0.5) == "results/ablate/method_random-infinity-tiny_n4_seed1_aspect0.5"
    assert _name(resolution="0.25M", aspect=2.0) == \
        "results/ablate/method_random-infinity-tiny_n4_seed1_res-0.25M_aspect2"
    assert len({_name(), _name(resolution="1M"), _name(resolution="0.25M"), _name(aspect=0.5),
                _name(aspect=2.0)}) == 5
