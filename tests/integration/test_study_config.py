"""Issue 27, "Studies as files": ``--config study.yaml|json`` for ablate / sweep / sensitivity (every option; flags
on the command line override the file; unknown keys are one error line with a did-you-mean), ``--print-config``
(``varscope ablate scorer --print-config > study.yaml`` then ``varscope ablate --config study.yaml`` is the same
study) and ``varscope --version``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from studies._args import parse_with_config

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO.parent / "shared" / "fixtures" / "official_var_tiny"


def _cli(argv, capsys):
    from studies.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _parser(command: str):
    import importlib

    return importlib.import_module(f"studies.{command}").build_parser()


@pytest.mark.parametrize("command, argv", [
    ("ablate", ["scorer", "--samples", "8", "--set", "schedule.tau=0.7", "--set", "granularity=branch",
                "--accelerator", "cpu", "--precision", "bf16-autocast", "--devices", "1", "--no-plots",
                "--threads", "1"]),
    ("sweep", ["nova", "--param", "tau", "--param", "rho=0.2:0.8", "--trials", "3", "--cost", "latency",
               "--accelerator", "cpu", "--precision", "tf32", "--no-default-trial", "--samples", "4"]),
    ("sensitivity", ["tau", "--values", "0.6", "0.8", "--metrics", "psnr", "ssim", "--batch-size", "2",
                     "--accelerator", "cpu", "--dtype", "bfloat16"]),
])
def test_print_config_then_config_is_the_same_study(command, argv, tmp_path, capsys):
    """The file --print-config writes, read back with --config, parses to exactly what argparse makes of the
    original command line (the reference: the parser without any file), and prints the same file again."""
    code, text, err = _cli([command, *argv, "--print-config"], capsys)
    assert code == 0, err
    study = tmp_path / "study.yaml"
    study.write_text(text)
    reference = vars(_parser(command).parse_args(argv))
    from_file = vars(parse_with_config(_parser(command), ["--config", str(study)]))
    for name in ("config", "print_config"):
        reference.pop(name), from_file.pop(name)
    assert from_file == reference
    code, again, err = _cli([command, "--config", str(study), "--print-config"], capsys)
    assert code == 0 and again == text


def test_flags_override_the_file_and_json_works(tmp_path):
    study = tmp_path / "study.json"
    study.write_text(json.dumps({"command": "cache", "samples": 8, "batch-size": 4, "set": ["schedule.tau=0.5"],
                                 "no_plots": True, "accelerator": "cpu", "devices": [0], "wandb": "disabled"}))
    args = parse_with_config(_parser("ablate"), ["--config", str(study), "--samples", "4", "--set", "a.b=1"])
    assert (args.command, args.samples, args.batch_size, args.no_plots) == ("cache", 4, 4, True)
    assert args.overrides == ["a.b=1"]  # a repeatable option given on the command line replaces the file's list
    assert args.wandb == "disabled" and args.accelerator == "cpu"
    args = parse_with_config(_parser("ablate"), ["linkage", "--config", str(study)])
    assert args.command == "linkage" and args.overrides == ["schedule.tau=0.5"]  # the positional given wins
    # the option's own name is a key too (--param, dest params)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("method: ldpruning\nparam: [rho, delta]\ntrials: 5\n")
    args = parse_with_config(_parser("sweep"), ["--config", str(sweep)])
    assert (args.method, args.params, args.trials) == ("ldpruning", ["rho", "delta"], 5)


@pytest.mark.parametrize("content, expected", [
    ('{"sampels": 3}', "error: --config {path}: unknown key 'sampels'. Did you mean 'samples'"),
    ("[1, 2]", "error: --config {path}: expected a mapping of option names to values"),
    ("samples: [1, 2\n", "error: --config {path}: not valid YAML or JSON"),
    ("samples: -1\n", "error: argument --samples: must be >= 2"),
])
def test_a_bad_study_file_is_one_error_line(content, expected, tmp_path, capsys):
    study = tmp_path / "study.yaml"
    study.write_text(content)
    code, out, err = _cli(["ablate", "scorer", "--config", str(study)], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(path=study)), err
    code, out, err = _cli(["sweep", "nova", "--config", str(tmp_path / "studdy.yaml")], capsys)
    assert code == 2 and err.strip() == (f"error: --config {tmp_path / 'studdy.yaml'}: no such file. Did you mean "
                                         f"'study.yaml'?")


@pytest.mark.skipif(not (FIXTURE / "config.json").exists(), reason="official VAR fixture not found")
def test_a_study_file_runs(tmp_path, capsys):
    study = tmp_path / "study.yaml"
    study.write_text(f"command: cache\nmodel: official-tiny\nweights: {FIXTURE}\nsamples: 2\nbatch_size: 2\n"
                     f"arms: baseline\ntiming_rounds: 0\nno_plots: true\nno_progress: true\nthreads: 1\n"
                     f"wandb: disabled\naccelerator: cpu\nprecision: bf16-autocast\nout: {tmp_path / 'out'}\n")
    code, out, err = _cli(["ablate", "--config", str(study)], capsys)
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "arms" / "baseline.json").read_text())
    assert record["environment"]["precision"] == "bf16-autocast" and len(record["metrics"]["index"]) == 2


def test_version_is_the_project_version(capsys):
    expected = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    code, out, err = _cli(["--version"], capsys)
    assert code == 0 and out.startswith(f"varscope {expected}")
