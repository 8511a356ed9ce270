"""``--plugins PATH`` / ``$VARSCOPE_PLUGINS`` (var_core.plugins): a file or folder of plugins is loaded, named with
its file sha256 and marked as its registrations' origin; a plugin that takes a built-in name or does not exist is
one error line, exit 2 (issue 31)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCORER = '''
from dataclasses import dataclass
import torch
from var_core.accel.base import Scorer
from var_core.accel.knobs import ComponentConfig
from var_core.accel.registry import SCORERS


@SCORERS.register("{name}")
class Mine(Scorer):
    """Test plugin scorer: the block input's norm."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass

    def score(self, ctx, block, branch, x_RNC, signals):
        return x_RNC.float().norm(dim=-1)
'''
PRESET = '''
import dataclasses
from var_core.accel.presets import get_preset, preset


@preset("nova_mine")
def nova_mine():
    """NOVA with the test plugin scorer."""
    return dataclasses.replace(get_preset("nova").replace_component("scorer", "mine_norm"), name="nova_mine")
'''


def python(code: str, cwd: Path, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_a_folder_of_plugins_from_the_environment(tmp_path):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "a_scorer.py").write_text(SCORER.format(name="mine_norm"))
    (folder / "b_preset.py").write_text(PRESET)
    (folder / "_private.py").write_text("raise RuntimeError('a file starting with _ is not a plugin')\n")
    code = ("import json\nfrom var_core.accel.presets import get_preset\nfrom var_core import plugins\n"
            "config = get_preset('nova_mine')\n"
            "print(json.dumps({'scorer': config.scorer.component_name, 'loaded': plugins.loaded_plugins(),"
            " 'origins': [plugins.origin('scorer', 'mine_norm'), plugins.origin('preset', 'nova_mine'),"
            " plugins.origin('preset', 'nova'), plugins.origin('scorer', 'entropy')]}))")
    done = python(code, tmp_path, {"VARSCOPE_PLUGINS": str(folder)})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["scorer"] == "mine_norm"
    assert [(p["name"], p["source"], p["sha256"]) for p in out["loaded"]] == [
        (name, "path", hashlib.sha256((folder / name).read_bytes()).hexdigest())
        for name in ("a_scorer.py", "b_preset.py")]
    assert out["origins"] == [f"plugin a_scorer.py ({folder / 'a_scorer.py'})",
                              f"plugin b_preset.py ({folder / 'b_preset.py'})", "built-in", "built-in"]


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("VARSCOPE_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "studies.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_a_plugin_taking_a_built_in_name_is_refused(tmp_path):
    bad = tmp_path / "clash.py"
    bad.write_text(SCORER.format(name="entropy"))
    done = _cli(["ls", "components", "--plugins", str(bad)], tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: plugin '{bad}' failed to import: ValueError: scorer "
                                                   f"'entropy' is already registered by EntropyScorer"), done.stderr


def test_a_missing_plugin_path_is_one_error_line(tmp_path):
    done = _cli(["ls", "--plugins", str(tmp_path / "nowhere.py")], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: --plugins {str(tmp_path / 'nowhere.py')!r}: no such file "
                                                f"or folder"]
