"""Values pinned against hand-worked inputs where a one-line change used to pass the fast suite (issue 25):
DPG-Bench import of two-column files, the presets benchmark's bandwidth-aware column, the DDP merge order, the
testbed classifier's input range."""

from __future__ import annotations

import pytest


# ----- DPG-Bench import: a headerless (id, score) file keeps its first prompt ----------------------------------
@pytest.mark.parametrize("header", ["", "prompt_id,score\n", "id\toverall\n"])
def test_dpg_two_column_file_with_and_without_header(tmp_path, header):
    from ablations.imports import import_results

    scores = [0.5, 0.75, 1.0, 0.25]
    sep = "\t" if "\t" in header else ","
    path = tmp_path / "dpg.csv"
    path.write_text(header + "".join(f"p{i}{sep}{v}\n" for i, v in enumerate(scores)))
    done = import_results(tmp_path, "dpg", path, arm="nova", arm_names=["baseline", "nova"])
    entry = done["arms"]["nova"]
    overall = entry["summary"]["dpg_overall"]
    # hand-worked: (0.5 + 0.75 + 1.0 + 0.25) / 4 over 4 prompts (dropping p0 as a header gives 0.667 over 3)
    assert overall["mean"] == pytest.approx(0.625) and overall["n"] == 4 and entry["n_prompts"] == 4
    assert [p["id"] for p in entry["per_prompt"]] == ["p0", "p1", "p2", "p3"]
    assert set(entry["summary"]) == {"dpg_overall"}  # a two-column file holds no category
