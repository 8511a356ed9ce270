"""``varscope``, the one console command (issue 17): its help lists every command with one line, each command runs
its study with the remaining words, a mistyped command gets a did-you-mean (exit 2), and ``varscope ls models``
lists every zoo entry with the files it needs, its schedule and its token count (counts worked by hand below).

Run through ``python -m studies.cli`` in a subprocess (what the console script calls), plus the console script of
the environment the tests run in (``pip install -e .`` puts it beside the interpreter).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _varscope(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "studies.cli", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_every_command_on_one_line():
    from studies.cli import COMMANDS

    proc = _varscope("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: varscope COMMAND")
    listed = [line.split()[0] for line in proc.stdout.split("commands:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == ["ablate", "sweep", "sensitivity", "latency", "bench", "report", "verify", "ls", "calibrate",
                      "gpucheck", "demo", "fid-reference", "frontier", "claims", "preset-flops"] == list(COMMANDS)
    bare = _varscope()
    assert bare.returncode == 2 and "commands:" in bare.stderr  # no command: the list, and a failure status


def test_every_study_module_is_a_command():
    """Each ``python -m studies.X`` (public module with a ``main``) is reachable as a ``varscope`` command."""
    import importlib

    from studies.cli import COMMANDS

    studies = {p.stem for p in (REPO / "studies").glob("*.py") if not p.stem.startswith("_") and p.stem != "cli"}
    targets = {module for module, _, _ in COMMANDS.values()}
    assert {f"studies.{s}" for s in studies} <= targets
    for module in targets:
        assert callable(importlib.import_module(module).main), module


def test_mistyped_command_did_you_mean():
    proc = _varscope("abalte", "scorer")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown command 'abalte'. Did you mean 'ablate'")
    assert "Traceback" not in proc.stderr


def test_dispatch_hands_the_rest_to_the_study():
    """``varscope latency --arch-flops --model var-d16`` is ``python -m studies.latency --arch-flops ...``: VAR-d16's
    dense generation covers 1² + 2² + 3² + 4² + 5² + 6² + 8² + 10² + 13² + 16² = 680 tokens, and its last two scales
    (169 + 256 = 425 tokens) are 425 / 680 = 62.5 % of them."""
    proc = _varscope("latency", "--arch-flops", "--model", "var-d16")
    assert proc.returncode == 0, proc.stderr
    assert "total: 680 tokens" in proc.stdout and "62.5 % of tokens" in proc.stdout
    # a study's own user error comes back as its one-line error, exit 2
    bad = _varscope("verify", str(REPO / "no-such-fixture"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "config.json" in bad.stderr
    typo = _varscope("ls", "model")
    assert typo.returncode == 2 and "Did you mean 'models'" in typo.stderr
    helped = _varscope("help", "latency")
    assert helped.returncode == 0 and "--arch-flops" in helped.stdout


def _model_blocks(text: str) -> dict[str, str]:
    """``ls models`` output -> {entry: its three (wrapped) lines joined}."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines()[1:]:
        match = re.match(r"^  (\S+)\s+(var|infinity|hart)\s", line)
        if match:
            current = match.group(1)
            blocks[current] = []
        blocks[current].append(line.strip())
    return {name: " ".join(lines) for name, lines in blocks.items()}


def test_ls_models_lists_every_zoo_entry():
    from var_core.zoo import ZOO

    proc = _varscope("ls", "models")
    assert proc.returncode == 0, proc.stderr
    blocks = _model_blocks(proc.stdout)
    assert set(blocks) == set(ZOO)
    for name, text in blocks.items():
        assert ZOO[name].family in text.split()[1] and "weights:" in text and "schedule:" in text, name
    # token counts worked by hand from the published schedules
    assert "10 scales, sides 1 2 3 4 5 6 8 10 13 16, 680 tokens" in blocks["var-d16"]
    # VAR-d36 at 512 px: 1 + 4 + 9 + 16 + 36 + 81 + 169 + 324 + 576 + 1024
    assert "sides 1 2 3 4 6 9 13 18 24 32, 2240 tokens" in blocks["var-d36"]
    # Infinity 1M, 1:1: 1 + 4 + 16 + 36 + 64 + 144 + 256 + 400 + 576 + 1024 + 1600 + 2304 + 4096
    assert "13 scales, sides 1 2 4 6 8 12 16 20 24 32 40 48 64, 10521 tokens" in blocks["infinity-2b"]
    # HART-0.7B: the 14 sides up to 64 of its patch_nums; 1 + 4 + 9 + ... + 2304 + 4096
    assert "14 scales, sides 1 2 3 4 5 7 9 12 16 21 27 36 48 64, 9451 tokens" in blocks["hart-0.7b"]
    assert "5 scales, sides 1 2 4 6 8, 121 tokens" in blocks["infinity-tiny"]
    # the files each needs
    assert "var_d16.pth + vae_ch160v4096z32.pth" in blocks["var-d16"]
    assert "infinity_vae_d32_reg.pth or infinity_vae_d32reg.pth" in blocks["infinity-2b"]
    assert "flan-t5-xl" in blocks["infinity-2b"] and "shards" in blocks["infinity-8b"]
    assert "Qwen2-VL-1.5B-Instruct" in blocks["hart-0.7b"] and "shipped" in blocks["testbed"]
    assert "none: use random:hart-tiny" in blocks["hart-tiny"]


def test_ls_models_reads_the_fixture_schedule(fixture_dir):
    """official-tiny's schedule comes from the fixture's config.json: patch_nums 1 2 3 4 5 6 8 → 155 tokens."""
    from ablations.listing import model_rows

    row = next(r for r in model_rows() if r["name"] == "official-tiny")
    assert row["schedule"] == ((1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (8, 8)) and row["tokens"] == 155
    assert "$VARSCOPE_VAR_FIXTURE" in row["weights"] and row["weights"].endswith("(found)")


def test_console_script_is_installed():
    script = Path(sysconfig.get_path("scripts")) / ("varscope.exe" if os.name == "nt" else "varscope")
    if not script.exists():
        pytest.fail(f"{script} is missing: reinstall the package (pip install -e '.[test]') so that "
                    f"[project.scripts] varscope is installed")
    proc = subprocess.run([str(script), "--help"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "preset-flops" in proc.stdout
