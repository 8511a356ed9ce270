"""The examples of docs/extending.md run (issue 31): the page's file blocks are written into a temporary site folder
as the plugin package they describe, its pyproject.toml's ``varscope.plugins`` entry point becomes the package's
dist-info, and then ``varscope ls`` lists what the package registers, the page's ``run`` blocks execute, and the
example family runs as a study whose records name the plugin. If the page and the code drift apart, this fails."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "extending.md"
BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str, str]]:
    """(language, info after it, body) of every fenced block of the page."""
    return [(m.group(1), m.group(2).strip(), m.group(3)) for m in BLOCK.finditer(DOC.read_text())]


def files() -> dict[str, str]:
    return {info.removeprefix("file=").strip(): body for _, info, body in blocks() if info.startswith("file=")}


def test_the_page_has_the_four_examples():
    names = set(files())
    assert {"my_varscope_plugins/residual_norm.py", "my_varscope_plugins/presets.py",
            "my_varscope_plugins/families.py", "my_varscope_plugins/__init__.py", "pyproject.toml"} <= names
    assert any(info == "run" for _, info, _ in blocks())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The page's package in a site folder, with the dist-info its pyproject.toml describes (what pip would write)."""
    root = tmp_path_factory.mktemp("extending")
    site = root / "site"
    for name, body in files().items():
        target = (root if name == "pyproject.toml" else site) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    points = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items())
                     for group, entries in project["entry-points"].items())
    (info / "entry_points.txt").write_text(points)
    return site


def run(args: list[str], site: Path, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(REPO), str(site)] + ([os.environ["PYTHONPATH"]]
                                                                    if os.environ.get("PYTHONPATH") else [])))
    env.pop("VARSCOPE_PLUGINS", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_ls_lists_the_example_package(site, tmp_path):
    done = run(["-m", "studies.cli", "ls"], site, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    mark = "[plugin residual (my_varscope_plugins)]"
    for name in ("residual_norm", "nova_residual", "residual_demo"):
        lines = [line for line in done.stdout.splitlines() if line.strip().startswith(name + " ")
                 or line.strip() == f"{name}  {mark}"]
        assert lines and all(line.rstrip().endswith(mark) for line in lines), (name, lines)


def test_run_blocks_execute(site, tmp_path):
    runs = [body for _, info, body in blocks() if info == "run"]
    for body in runs:
        script = tmp_path / "block.py"
        script.write_text("import var_core.plugins; var_core.plugins.load_plugins()\n" + body)
        done = run([str(script)], site, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "residual_norm: 4 score maps carry information" in done.stdout


@pytest.mark.slow
def test_example_family_runs_as_a_study(site, tmp_path):
    out = tmp_path / "study"
    done = run(["-m", "studies.cli", "ablate", "residual_demo", "--samples", "2", "--batch-size", "2",
                "--timing-rounds", "0", "--threads", "1", "--wandb", "disabled", "--no-plots", "--out", str(out)],
               site, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["arm"]: r for r in (json.loads(p.read_text()) for p in (out / "arms").glob("*.json"))}
    # the testbed is a VAR model: the recipe read ctx.model and added the per-model arm
    assert set(records) == {"baseline", "nova", "scorer=residual_norm", "fastvar", "residual_norm@tau=0.5"}
    files_sha = hashlib.sha256()
    for path in sorted((site / "my_varscope_plugins").rglob("*.py")):
        files_sha.update(path.name.encode() + b"\0" + path.read_bytes())
    plugin = records["scorer=residual_norm"]["plugins"]
    assert [(p["name"], p["distribution"], p["version"], p["sha256"]) for p in plugin] == [
        ("residual", "my-varscope-plugins", "0.1.0", files_sha.hexdigest())]
    assert records["scorer=residual_norm"]["policy"]["scorer"]["name"] == "residual_norm"
    assert records["residual_norm@tau=0.5"]["policy"]["schedule"]["tau"] == 0.5
    kept = records["scorer=residual_norm"]["activity"]["kept_per_scale"]
    assert min(kept) < 1 and "Activity per arm" in (out / "table.md").read_text()
