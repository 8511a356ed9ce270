"""The W&B mirror of a study, read back from the offline run's own file: runs grouped per study, tagged with
family, model and presets, and a ``study`` artifact holding the arm records and the table.

The offline run file (``run-<id>.wandb``) is W&B's LevelDB-style log of protobuf records; it is read here with a
few lines (7-byte chunk headers in 32 KiB blocks) and W&B's own protobuf classes, so the test sees what a later
``wandb sync`` would upload, not what our code meant to send.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from pathlib import Path

import pytest

from ablations.runner import StudyOptions, run_study

STUDY = dict(family="method", arms=("fastvar",), model="official-tiny", samples=2, batch_size=2, warmup=0,
             progress=False, seed=1, threads=1, wandb="offline", plots=False, timing_rounds=1, grid_samples=2)


def _records_of(run_file: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            out.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            out.append(pending + chunk)
    records = []
    for raw in out:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def _md5_b64(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


@pytest.fixture(scope="module")
def offline_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("wandb") / "study"
    first = run_study(StudyOptions(out=str(out), **STUDY), log=lambda s: None)
    second = run_study(StudyOptions(out=str(out), **STUDY), log=lambda s: None)  # a resume: a second run
    return out, first, second


def _run_file(outputs) -> Path:
    files = list(Path(outputs["wandb"]).glob("run-*.wandb"))
    assert len(files) == 1, outputs
    return files[0]


def test_runs_are_grouped_per_study_and_tagged(offline_study):
    out, first, second = offline_study
    group = f"method-official-tiny-{hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:8]}"
    runs = []
    for result in (first, second):
        records = _records_of(_run_file(result.outputs))
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        runs.append(run)
    assert first.outputs["wandb"] != second.outputs["wandb"]  # two runs ...
    for run in runs:  # ... in one group
        assert run.run_group == group
        assert list(run.tags) == ["family:method", "model:official-tiny", "preset:fastvar"]


def test_the_study_artifact_holds_the_records_and_the_table(offline_study):
    out, first, _ = offline_study
    records = _records_of(_run_file(first.outputs))
    studies = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact" and r.artifact.type == "study"]
    assert len(studies) == 1
    artifact = studies[0]
    assert artifact.name == f"study-method-official-tiny-{hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:8]}"
    entries = {e.path: e.digest for e in artifact.manifest.contents}
    assert set(entries) == {"arms/baseline.json", "arms/fastvar.json", "table.md", "table.csv",
                            "timing_interleaved.json"}
    # the artifact's files are those the first run left (the second rewrote the table; the records are unchanged)
    for name in ("arms/baseline.json", "arms/fastvar.json", "timing_interleaved.json"):
        assert entries[name] == _md5_b64(out / name), name
