"""Every ``python -m studies.X`` mistake is one ``error:`` line and exit 2 — never a traceback, never a study that
runs anyway — and Ctrl-C exits 130 naming the kept results folder.

Most cases run in-process through ``run_cli(main, argv)`` (the same path as ``__main__``); a few run as real
subprocesses to prove the ``__main__`` wiring. Every case fails before anything is generated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from studies import ablate, bench, demo, latency, report, sensitivity, sweep
from studies._cli import run_cli

REPO = Path(__file__).resolve().parents[2]
STUDIES = ("ablate", "sweep", "sensitivity", "latency", "bench", "report", "demo")
MODULES = {"ablate": ablate, "sweep": sweep, "sensitivity": sensitivity, "latency": latency, "bench": bench,
           "report": report, "demo": demo}
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA GPU")


def assert_user_error(rc: int, err: str, fragment: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert lines and lines[0].startswith("error:"), err
    assert len(lines) <= 3, err
    assert fragment in err, err


@pytest.fixture
def folders(tmp_path, fixture_dir):
    """Weight folders in the official-tiny fixture layout, each broken one way, and a plain file."""
    def folder(name: str, var: bytes | None, vae: bool = True) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_bytes((fixture_dir / "config.json").read_bytes())
        if var is not None:
            (d / "var.pth").write_bytes(var)
        if vae:
            (d / "vae.pth").write_bytes((fixture_dir / "vae.pth").read_bytes())
        return d

    real = (fixture_dir / "var.pth").read_bytes()
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a folder\n")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    return {
        "garbage": folder("garbage", b"this is not a checkpoint\n" * 10),
        "html": folder("html", b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n"),  # a failed download
        "truncated": folder("truncated", real[: len(real) // 3]),
        "no_vae": folder("no_vae", real, vae=False),
        "file": a_file,
        "empty": empty,
        "out": tmp_path / "out",
    }


# (study, argv with {garbage}/{out}/... placeholders, expected fragment)
CASES = [
    pytest.param("ablate", ["options", "--method", "novaa", "--out", "{out}"], "Did you mean 'nova'",
                 id="ablate-method-typo"),
    pytest.param("ablate", ["scorer", "--model", "var-d61", "--out", "{out}"], "'var-d16'", id="ablate-model-typo"),
    pytest.param("ablate", ["scorer", "--out", "{file}"], "is a file", id="ablate-out-is-a-file"),
    pytest.param("ablate", ["scorer", "--out", "{file}/sub"], "which is a file", id="ablate-out-under-a-file"),
    pytest.param("ablate", ["scorer", "--accelerator", "gpu", "--out", "{out}"], "no CUDA GPU",
                 marks=no_gpu_only, id="ablate-accelerator-gpu"),
    pytest.param("ablate", ["scorer", "--accelerator", "cdua", "--out", "{out}"], "Did you mean 'cuda'",
                 id="ablate-accelerator-typo"),
    pytest.param("ablate", ["scorer", "--threads", "0", "--out", "{out}"], "--threads", id="ablate-threads-0"),
    pytest.param("ablate", ["scorer", "--threads", "atuo", "--out", "{out}"], "'auto'", id="ablate-threads-typo"),
    pytest.param("ablate", ["scorer", "--devices", "0", "--out", "{out}"], "--devices: must be >= 1",
                 id="ablate-devices-0"),
    pytest.param("ablate", ["scorer", "--warmup", "-1", "--out", "{out}"], "--warmup: must be >= 0",
                 id="ablate-warmup-negative"),
    pytest.param("ablate", ["scorer", "--timing-rounds", "-3", "--out", "{out}"], "--timing-rounds: must be >= 0",
                 id="ablate-timing-rounds-negative"),
    pytest.param("ablate", ["scorer", "--batch-size", "0", "--out", "{out}"], "--batch-size: must be >= 1",
                 id="ablate-batch-size-0"),
    pytest.param("ablate", ["scorer", "--samples", "ten", "--out", "{out}"], "whole number", id="ablate-samples-text"),
    pytest.param("ablate", ["scorer", "--weights", "{out}/nope", "--out", "{out}"], "does not exist",
                 id="ablate-weights-missing"),
    pytest.param("ablate", ["scorer", "--model", "official-tiny", "--weights", "{garbage}", "--threads", "1",
                            "--out", "{out}"], "var.pth", id="ablate-garbage-weights"),
    pytest.param("ablate", ["scorer", "--model", "official-tiny", "--weights", "{html}", "--threads", "1",
                            "--out", "{out}"], "var.pth", id="ablate-html-page-as-weights"),
    pytest.param("ablate", ["scorer", "--model", "official-tiny", "--weights", "{truncated}", "--threads", "1",
                            "--out", "{out}"], "var.pth", id="ablate-truncated-weights"),
    pytest.param("ablate", ["scorer", "--model", "official-tiny", "--weights", "{no_vae}", "--threads", "1",
                            "--out", "{out}"], "vae.pth", id="ablate-missing-vae"),
    pytest.param("ablate", ["nonsense"], "unknown command", id="ablate-unknown-family"),
    pytest.param("sweep", ["nova", "--workers", "0", "--out", "{out}"], "--workers: must be >= 1",
                 id="sweep-workers-0"),
    pytest.param("sweep", ["nova", "--trials", "0", "--out", "{out}"], "--trials: must be >= 1", id="sweep-trials-0"),
    pytest.param("sweep", ["novaa", "--out", "{out}"], "Did you mean 'nova'", id="sweep-method-typo"),
    pytest.param("sweep", ["nova", "--out", "{file}"], "is a file", id="sweep-out-is-a-file"),
    pytest.param("sensitivity", ["tau", "--values", "abc", "--out", "{out}"], "'abc'", id="sensitivity-values-text"),
    pytest.param("sensitivity", ["tau", "--values", "0.7", "--batch-size", "0", "--out", "{out}"],
                 "--batch-size: must be >= 1", id="sensitivity-batch-size-0"),
    pytest.param("sensitivity", ["tau", "--values", "0.7", "--model", "tesbed", "--out", "{out}"],
                 "Did you mean 'testbed'", id="sensitivity-model-typo"),
    pytest.param("latency", ["--compare", "fastvr", "--out", "{out}"], "Did you mean 'fastvar'",
                 id="latency-compare-typo"),
    pytest.param("latency", ["--device", "cuda", "--out", "{out}"], "no CUDA GPU", marks=no_gpu_only,
                 id="latency-device-cuda"),
    pytest.param("latency", ["--repeats", "0", "--out", "{out}"], "--repeats: must be >= 1", id="latency-repeats-0"),
    pytest.param("latency", ["--threads", "0", "--out", "{out}"], "--threads: must be >= 1", id="latency-threads-0"),
    pytest.param("latency", ["--arch-flops", "--model", "testbed"], "no arch-only config", id="latency-arch-flops"),
    pytest.param("bench", ["engine", "--batch-sizes", "0"], "--batch-sizes: must be >= 1", id="bench-batch-0"),
    pytest.param("bench", ["presets", "--presets", "nvoa"], "Did you mean 'nova'", id="bench-preset-typo"),
    pytest.param("report", ["{out}/nope"], "does not exist", id="report-missing-folder"),
    pytest.param("report", ["{empty}"], "finished arm record", id="report-empty-folder"),
    pytest.param("demo", ["--per-class", "0", "--out", "{out}/g.png"], "--per-class: must be >= 1",
                 id="demo-per-class-0"),
    pytest.param("demo", ["--out", "{empty}"], "is a folder", id="demo-out-is-a-folder"),
    pytest.param("demo", ["--model", "official-tiny", "--weights", "{truncated}", "--out", "{out}/g.png"], "var.pth",
                 id="demo-truncated-weights"),
]


def _fill(argv: list[str], folders: dict) -> list[str]:
    return [a.format(**{k: str(v) for k, v in folders.items()}) for a in argv]


@pytest.mark.parametrize("study, argv, fragment", CASES)
def test_user_error_in_process(study, argv, fragment, folders, capsys):
    capsys.readouterr()
    rc = run_cli(MODULES[study].main, _fill(argv, folders))
    captured = capsys.readouterr()
    assert_user_error(rc, captured.err, fragment)
    assert not (folders["out"] / "arms").exists() or not any((folders["out"] / "arms").iterdir())  # nothing ran


SUBPROCESS_CASES = [
    pytest.param("ablate", ["options", "--method", "novaa", "--out", "{out}"], "Did you mean 'nova'",
                 id="ablate-method-typo"),
    pytest.param("bench", ["presets", "--model", "random:var-d61", "--threads", "1"], "'random:var-d16'",
                 id="bench-model-typo"),
    pytest.param("sweep", ["nova", "--samples", "-1", "--threads", "1", "--out", "{out}"], "--samples: must be >= 2",
                 id="sweep-samples-negative"),
    pytest.param("latency", ["--model", "random:infinity-tiny", "--method", "novaa", "--out", "{out}"],
                 "Did you mean 'nova'", id="latency-method-typo"),
]


@pytest.mark.parametrize("study, argv, fragment", SUBPROCESS_CASES)
def test_user_error_as_subprocess(study, argv, fragment, folders, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", WANDB_SILENT="true",
               PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    proc = subprocess.run([sys.executable, "-m", f"studies.{study}", *_fill(argv, folders)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert_user_error(proc.returncode, proc.stderr, fragment)
    assert not folders["out"].exists()  # refused before the results folder was made


@pytest.mark.parametrize("study", STUDIES)
def test_every_entry_point_runs_under_run_cli(study):
    source = (REPO / "studies" / f"{study}.py").read_text()
    assert 'if __name__ == "__main__":\n    sys.exit(run_cli(main))' in source


# ----- Ctrl-C and bugs -----------------------------------------------------------------------------------------
def _interrupted_study(options, *args, **kwargs):
    Path(options.out).mkdir(parents=True)  # the study had started (a folder never made is not named as kept)
    raise KeyboardInterrupt


def _lightning_interrupted_study(options, *args, **kwargs):
    Path(options.out).mkdir(parents=True)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:  # what lightning.pytorch.trainer.call does after its graceful shutdown
        sys.exit(1)


@pytest.mark.parametrize("study", [_interrupted_study, _lightning_interrupted_study], ids=["plain", "lightning"])
def test_ctrl_c_names_the_kept_results_folder(study, tmp_path, monkeypatch, capsys):
    import ablations.runner

    monkeypatch.setattr(ablations.runner, "run_study", study)
    out = tmp_path / "kept_run"
    rc = run_cli(ablate.main, ["scorer", "--model", "official-tiny", "--out", str(out), "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 130, err
    assert "interrupted" in err and str(out) in err and "Traceback" not in err


def test_a_bug_of_ours_keeps_its_traceback():
    def broken(argv):
        raise ZeroDivisionError("ours")

    with pytest.raises(ZeroDivisionError):
        run_cli(broken, [])
