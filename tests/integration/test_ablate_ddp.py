"""Two processes give the same records as one (same thread count per process), however they are started:
``ddp_spawn`` (the caller starts the workers), ``--strategy ddp`` (Lightning's launcher re-runs the command in each
process) and ``torchrun`` (every process started from outside). With ``ddp`` and torchrun every rank runs the whole
CLI: rank 0 takes the results-folder lock and writes the records, rank 1 only joins the generations."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations.runner import LOCK_NAME, StudyOptions, run_study  # noqa: E402
from var_core.eval import records as rec  # noqa: E402
from var_core.eval.lightning import GenerationRun  # noqa: E402

pytestmark = pytest.mark.slow  # two processes per arm: ~15-60 s each on 2 cores

REPO = Path(__file__).resolve().parents[2]
SAME = ("arm", "config_hash", "key", "policy", "samples", "sampling")
# LD-Pruning: ragged per-sample keep counts and tied Haar energies, where batch dependence would show
COMMON = dict(family="method", model="official-tiny", samples=6, batch_size=2, warmup=0, progress=False,
              wandb="disabled", plots=False, arms=("ldpruning",), threads=1, seed=3, timing_rounds=0)
CLI = ["method", "--model", "official-tiny", "--samples", "6", "--batch-size", "2", "--warmup", "0",
       "--no-progress", "--no-plots", "--arms", "ldpruning", "--threads", "1", "--seed", "3", "--timing-rounds", "0",
       "--wandb", "disabled"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, fixture_dir):
    out = tmp_path_factory.mktemp("one")
    result = run_study(StudyOptions(out=str(out), devices=1, **COMMON), log=lambda s: None)
    assert result.computed == ["baseline", "ldpruning"]
    return out


def assert_same_records(one: Path, two: Path, strategy: str, names=("baseline", "ldpruning"), samples: int = 6,
                        batches=((0, 0), (2, 1), (4, 0))) -> None:
    for name in names:
        a = rec.read_record(rec.record_paths(one, name)[0])
        b = rec.read_record(rec.record_paths(two, name)[0])
        assert a is not None and b is not None, name
        for key in SAME:
            assert a[key] == b[key], key
        assert a["metrics"]["index"] == b["metrics"]["index"] == list(range(samples))
        assert a["metrics"]["per_sample"] == b["metrics"]["per_sample"]
        assert a["metrics"]["per_scale"]["entropy"] == b["metrics"]["per_scale"]["entropy"]
        assert a["metrics"]["per_scale"]["token_agreement"] == b["metrics"]["per_scale"]["token_agreement"]
        assert a["metrics"]["activation_scale"] == b["metrics"]["activation_scale"]
        assert a["timing"]["flops_per_image"] == b["timing"]["flops_per_image"]
        env = b["environment"]
        assert [p["rank"] for p in env["processes"]] == [0, 1]
        assert env["strategy"] == strategy and env["devices"] == 2 and env["num_nodes"] == 1
        assert all(p["device"] == "cpu" and p["threads"] == 1 and p["dtype"] == "float32" for p in env["processes"])
        # whole batches dealt round-robin: rank 0 got the batches starting at 0 and 4, rank 1 the one at 2
        assert sorted((x["first_index"], x["rank"]) for x in b["timing"]["batches"]) == list(batches)
        ra = GenerationRun.load(rec.record_paths(one, name)[1])
        rb = GenerationRun.load(rec.record_paths(two, name)[1])
        assert torch.equal(ra.images_u8[:], rb.images_u8[:])  # stored samples, read back whole here
        for ta, tb in zip(ra.tokens, rb.tokens):
            assert all(torch.equal(x, y) for x, y in zip(ta, tb))
        assert ra.content_hash() == rb.content_hash()
    assert not (two / LOCK_NAME).exists()  # released by rank 0, the only rank that took it
    assert not list(two.rglob("*.tmp"))


def _cli_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                        "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID") and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    return env


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; a hang (e.g. ranks waiting on each other) is killed with every rank
    it started and fails the test."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[2:6])} … did not finish in {timeout:.0f} s (ranks waiting on each other?):\n"
                    + out[-2000:] + err[-2000:])
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_two_process_ddp_spawn_gives_the_same_records(tmp_path, one_process):
    two = run_study(StudyOptions(out=str(tmp_path / "two"), devices=2, strategy="ddp_spawn", **COMMON),
                    log=lambda s: None)
    assert two.computed == ["baseline", "ldpruning"]
    assert_same_records(one_process, tmp_path / "two", "ddp_spawn")


def test_ddp_launcher_reruns_the_cli_and_gives_the_same_records(tmp_path, one_process):
    out = tmp_path / "ddp"
    proc = _run([sys.executable, "-m", "studies.ablate", *CLI, "--devices", "2", "--strategy", "ddp",
                 "--out", str(out)])
    assert "rank 1: joined 2 generation(s) of rank 0" in proc.stdout  # the re-run CLI followed rank 0
    assert_same_records(one_process, out, "ddp")
    # resuming with the same command: rank 0 reuses both arms and releases rank 1, which generated nothing
    again = _run([sys.executable, "-m", "studies.ablate", *CLI, "--devices", "2", "--strategy", "ddp",
                  "--out", str(out)])
    assert "0 arms computed, 2 reused" in again.stdout
    assert "rank 1: joined 0 generation(s) of rank 0" in again.stdout


def test_torchrun_gives_the_same_records(tmp_path, one_process):
    out = tmp_path / "torchrun"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "-m", "studies.ablate", *CLI, "--out", str(out)])
    assert "rank 1: joined 2 generation(s) of rank 0" in proc.stdout
    assert "torchrun started 2 processes" in proc.stdout  # --devices left out: the launcher's count is adopted
    assert_same_records(one_process, out, "ddp")


# The default model (testbed) with every default metric: class accuracy and probability, FID / KID / IS proxies and
# FID against held-out images run on rank 0 while rank 1 waits for its next message. Before issue 25 a torchmetrics
# cross-process sync inside the FID proxy hung both ranks (official-tiny above never runs those metrics).
TESTBED = dict(COMMON, model="testbed", samples=4, arms=("fastvar",))
TESTBED_CLI = ["method", "--model", "testbed", "--samples", "4", "--batch-size", "2", "--warmup", "0",
               "--no-progress", "--no-plots", "--arms", "fastvar", "--threads", "1", "--seed", "3",
               "--timing-rounds", "0", "--wandb", "disabled"]
TESTBED_METRICS = ("class_correct", "class_prob")
TESTBED_SET_METRICS = ("fid_proxy", "kid_proxy", "is_proxy", "fid_real", "kid_real")


@pytest.mark.timeout(420)
def test_ddp_on_the_testbed_with_every_default_metric(tmp_path):
    from var_core.testbed.classifier import default_weights_path

    if not default_weights_path().is_file():
        pytest.skip("the shipped testbed classifier is not in this checkout")
    one = tmp_path / "one"
    result = run_study(StudyOptions(out=str(one), devices=1, **TESTBED), log=lambda s: None)
    assert result.computed == ["baseline", "fastvar"]
    two = tmp_path / "ddp"
    proc = _run([sys.executable, "-m", "studies.ablate", *TESTBED_CLI, "--devices", "2", "--strategy", "ddp",
                 "--out", str(two)], timeout=300)
    assert "rank 1: joined 2 generation(s) of rank 0" in proc.stdout
    assert_same_records(one, two, "ddp", names=("baseline", "fastvar"), samples=4, batches=((0, 0), (2, 1)))
    for name in ("baseline", "fastvar"):
        a = rec.read_record(rec.record_paths(one, name)[0])
        b = rec.read_record(rec.record_paths(two, name)[0])
        for metric in TESTBED_METRICS:  # computed (not n/a), per sample, the same as in one process
            assert len(b["metrics"]["per_sample"][metric]) == 4 and None not in b["metrics"]["per_sample"][metric]
        wanted = TESTBED_SET_METRICS if name != "baseline" else ("is_proxy", "fid_real", "kid_real")
        for metric in wanted:
            assert metric in b["metrics"]["set_level"], (name, metric, b["metrics"]["unavailable"].get(metric))
            assert a["metrics"]["set_level"][metric] == b["metrics"]["set_level"][metric]
