"""A component that never acts in a study is reported (issue 31): NOVA + LD-Pruning's SATS gave numbers identical to
NOVA's because SATS never fired; the record's activity, the table and the printed summary now say so. Here SATS
at threshold 0 can never fire (γ_k < 0 is impossible) and at a threshold above any γ_k fires for every sample."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_a_guidance_stop_that_never_fires_is_reported(tmp_path, capsys, monkeypatch):
    from studies.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "study"
    code = main(["ablate", "scorer", "--extra-arm", "never=nova+guidance=sats:delta=0", "--extra-arm",
                 "always=nova+guidance=sats:delta=1000000", "--arms", "never,always", "--samples", "2",
                 "--batch-size", "2", "--timing-rounds", "0", "--threads", "1", "--wandb", "disabled", "--no-plots",
                 "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    records = {r["arm"]: r for r in (json.loads(p.read_text()) for p in (out / "arms").glob("*.json"))}
    never, always = records["never"]["activity"], records["always"]["activity"]
    assert never["guidance_stopped"] == {"samples": 0, "of": 2} and never["inactive"] == ["guidance sats"]
    assert always["guidance_stopped"] == {"samples": 2, "of": 2} and always["inactive"] == []
    line = "Components that never acted in this study: `never`: guidance sats (the arm runs as if they were absent)."
    assert line in (out / "table.md").read_text() and line in printed
