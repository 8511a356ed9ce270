"""Plugins from outside the package (issue 31): a scorer registered only through the ``varscope.plugins`` entry
point of a distribution in a temporary site folder appears in ``varscope ls``, runs as ``--extra-arm`` and under
``--swap`` in ``varscope ablate scorer``, and its records name the plugin with its version and file sha256.

The plugin is a copy of the built-in entropy scorer under a new name, so its arm must reproduce the built-in arm it
copies (``entropy@tau=0.8`` = NOVA with the entropy scorer) sample for sample: that pins that the plugin's code is
what ran, not a fallback."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--samples", "2", "--timing-rounds", "0", "--threads", "1", "--wandb", "disabled", "--no-plots",
        "--batch-size", "2"]


def make_site(root: Path) -> Path:
    """A site folder holding the distribution ``mine-pkg 0.1``: the package ``mine_pkg`` (entropy.py with its
    registered name changed) and a dist-info whose only link to varscope is its entry point."""
    site = root / "site"
    package = site / "mine_pkg"
    package.mkdir(parents=True)
    source = (REPO / "var_core" / "accel" / "scorers" / "entropy.py").read_text()
    assert source.count('@SCORERS.register("entropy")') == 1
    source = source.replace('@SCORERS.register("entropy")', '@SCORERS.register("mine_entropy")')
    source = source.replace("from ..", "from var_core.accel.")
    (package / "__init__.py").write_text(source)
    info = site / "mine_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mine-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[varscope.plugins]\nmine = mine_pkg\n")
    (info / "RECORD").write_text("")
    return site


def varscope(args: list[str], site: Path | None, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    paths = [str(REPO)] + ([str(site)] if site else []) + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                           else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("VARSCOPE_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "studies.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return make_site(tmp_path_factory.mktemp("plugin"))


def test_entry_point_plugin_is_listed_with_its_origin(site, tmp_path):
    done = varscope(["ls", "components"], site, tmp_path)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith("mine_entropy "))
    assert line.rstrip().endswith("[plugin mine (mine_pkg)]")
    built_in = next(line for line in done.stdout.splitlines() if line.strip().startswith("entropy "))
    assert "[plugin" not in built_in
    sha = hashlib.sha256((site / "mine_pkg" / "__init__.py").read_bytes()).hexdigest()
    header = next(line for line in done.stdout.splitlines() if line.strip().startswith("mine "))
    assert "entry point mine-pkg 0.1" in header and f"sha256 {sha[:16]}" in header
    # without the site folder the name is unknown: nothing of the plugin lives in the project
    assert "mine_entropy" not in varscope(["ls", "components"], None, tmp_path).stdout


def _record(out: Path, arm: str) -> dict:
    files = [p for p in (out / "arms").glob("*.json") if json.loads(p.read_text()).get("arm") == arm]
    assert len(files) == 1, sorted(p.name for p in (out / "arms").glob("*"))
    return json.loads(files[0].read_text())


@pytest.mark.slow
def test_plugin_scorer_runs_as_extra_arm_and_swap_and_records_name_it(site, tmp_path):
    out = tmp_path / "extra"
    done = varscope(["ablate", "scorer", "--extra-arm", "mine=nova+scorer=mine_entropy", "--arms",
                     "mine,entropy@tau=0.8", "--out", str(out), *TINY], site, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    mine, copied = _record(out, "mine"), _record(out, "entropy@tau=0.8")
    sha = hashlib.sha256((site / "mine_pkg" / "__init__.py").read_bytes()).hexdigest()
    assert mine["plugins"] == [{"name": "mine", "module": "mine_pkg", "source": "entry point",
                                "distribution": "mine-pkg", "version": "0.1",
                                "path": str(site / "mine_pkg" / "__init__.py"), "sha256": sha}]
    assert mine["policy"]["scorer"]["name"] == "mine_entropy" and copied["policy"]["scorer"]["name"] == "entropy"
    assert mine["key"]["plugins"] == [f"mine=0.1:{sha}"]
    # a copy of the entropy scorer on NOVA is NOVA's entropy arm, sample for sample
    assert mine["metrics"]["per_sample"]["psnr"] == copied["metrics"]["per_sample"]["psnr"]
    assert mine["activity"]["kept_per_scale"] == copied["activity"]["kept_per_scale"]
    assert min(mine["activity"]["kept_per_scale"]) < 1  # it pruned

    # the same arm built with --swap on a plain preset arm: no project file edited, the same configuration
    swapped = tmp_path / "swap"
    done = varscope(["ablate", "scorer", "--extra-arm", "mine=nova", "--swap", "scorer=mine_entropy", "--arms", "mine",
                     "--out", str(swapped), *TINY], site, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    again = _record(swapped, "mine")
    assert again["config_hash"] == mine["config_hash"] and again["plugins"] == mine["plugins"]
    assert "swap scorer: entropy -> mine_entropy" in again["changes"]
    assert again["metrics"]["per_sample"]["psnr"] == mine["metrics"]["per_sample"]["psnr"]


def test_unknown_plugin_swap_name_is_one_error_line(site, tmp_path):
    done = varscope(["ablate", "scorer", "--swap", "scorer=mine_entrop", *TINY], site, tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --swap scorer=mine_entrop: unknown scorer 'mine_entrop'. "
                                                   "Did you mean 'mine_entropy'"), done.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("args,hint", [
    (["--swap", "scorr=entropy"], "--swap scorr=entropy: unknown component kind 'scorr'. Did you mean 'scorer'"),
    (["--swap", "scorer=entropy:sorce=lens"], "scorer 'entropy' has no knob 'sorce'. Did you mean 'source'"),
    (["--swap", "schedule=fixed_table:ratios=(0.4,2)"], "--swap schedule=fixed_table:ratios=(0.4,2): "),
    (["--extra-arm", "mine=novaa"], "unknown preset 'novaa'. Did you mean 'nova'"),
    (["--extra-arm", "mine=nova+schedule.tua=0.5"], "has no knob 'tua'. Did you mean 'tau'"),
    (["--extra-arm", "baseline=nova"], "the arm needs a name other than 'baseline'"),
    (["--extra-arm", "mine=nova", "--extra-arm", "mine=fastvar"], "already has an arm named 'mine'"),
])
def test_bad_swaps_and_extra_arms_are_one_error_line(tmp_path, monkeypatch, capsys, args, hint):
    from studies.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["ablate", "scorer", *args, *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and hint in err[0], err
    assert not (tmp_path / "results").exists()
