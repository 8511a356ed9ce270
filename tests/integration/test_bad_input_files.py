"""Bad input files and faults of the generation-side commands (issue 25, "Bad inputs and faults"): each ends in one
``error:`` line that names the file and says what to do, exit 2, no traceback, nothing finished lost.

Classes of input: prompt files (every format), weights (a truncated or HTML ``var.safetensors``, a truncated
``testbed.json``), metric weights asked for by name (``--classifier``, ``--lpips-backbone`` / ``--lpips-lin``), a
results folder or image folder on a read-only or full file system (``ablate --out`` / ``--save-images``, ``demo
--out``), Ctrl-C while the modules load, ``verify`` on a folder whose manifest lists a link leading out of it, and a
training checkpoint that carries a pickled payload. The commands run in-process through ``run_cli`` (the path of
``__main__``) where the other CLI tests do; the Ctrl-C cases need a real signal, so they run as subprocesses.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from studies import ablate, demo
from studies._cli import run_cli
from var_core.errors import run_command
from var_core.eval.records import record_paths

REPO = Path(__file__).resolve().parents[2]
TESTBED = REPO / "var_core" / "testbed" / "weights"
ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", WANDB_SILENT="true",
           PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))


def assert_one_error(rc: int, err: str, *fragments: str) -> str:
    """rc 2, no traceback, the first non-empty line starts with ``error:`` and is the only one; returns it."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)
    return lines[0]


def _run(main, argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = run_cli(main, [str(a) for a in argv])
    return rc, capsys.readouterr().err


# ----- prompt files ------------------------------------------------------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000
# (file name, content, fragments of the error line: the file, the line where the format has lines, the cause)
PROMPT_FILES = [
    pytest.param("captions.json", json.dumps({"images": [{"id": 1}, {"id": 2}], "annotations": [
        {"id": 1, "image_id": 1, "caption": "a cat"}, {"id": 2, "image_id": 2, "caption": 42}]}),
        ("annotation 2", "caption that is not text"), id="coco-caption-number"),
    pytest.param("captions.json", json.dumps({"images": [1, 2], "annotations": [{"id": 1, "image_id": 1,
                                                                                  "caption": "a"}]}),
                 ("COCO image 1",), id="coco-images-numbers"),
    pytest.param("captions.json", json.dumps({"images": {"a": 1}, "annotations": []}), ("'images' must be a list",),
                 id="coco-images-object"),
    pytest.param("deep.json", DEEP, ("nested deeper",), id="json-nested-100000"),
    pytest.param("deep.jsonl", '{"prompt": "a cat"}\n' + DEEP + "\n", ("line 2", "nested deeper"),
                 id="jsonl-nested-100000"),
    pytest.param("nul.csv", "prompt,category\na cat,animal\na d\x00og,animal\n", ("line 3", "NUL byte"),
                 id="csv-nul-byte"),
    pytest.param("open.csv", 'prompt,category\na cat,animal\n"a dog,animal\na fish,animal\n',
                 ("line 3", "not valid CSV"), id="csv-quote-never-closed"),
    pytest.param("late.csv", 'prompt,category\na cat,animal\n"a dog,animal\na fish",animal\na bird,animal\n',
                 ("line 3", "runs over lines 3-4"), id="csv-quote-closed-a-line-later"),
    pytest.param("after.csv", 'prompt,category\na cat,animal\n"a dog" big,animal\n', ("line 3", "not valid CSV"),
                 id="csv-text-after-closing-quote"),
    pytest.param("nul.txt", "a cat\na dog\x00\n", ("line 2", "NUL byte"), id="text-nul-byte"),
    pytest.param("utf16.txt", "a cat\n".encode("utf-16-le").decode("latin-1"), ("NUL byte",),
                 id="text-utf16-without-bom"),
    pytest.param("nul.jsonl", '{"prompt": "a \\u0000 cat"}\n', ("entry 1", "NUL character"), id="jsonl-nul-escape"),
    pytest.param("meta_data.json", json.dumps({"1": {"prompt": "a cat", "category": {"x": 1}}}),
                 ("entry 1", "category that is not a plain value"), id="mjhq-category-object"),
]


def _no_study(monkeypatch):
    """A file that should have been refused must not start a study (it would run for minutes)."""
    import ablations.runner

    def ran(*args, **kwargs):
        raise AssertionError("the bad file was accepted: the study started")

    monkeypatch.setattr(ablations.runner, "run_study", ran)


@pytest.mark.parametrize("name, content, fragments", PROMPT_FILES)
def test_bad_prompt_file_is_one_error_line(name, content, fragments, tmp_path, monkeypatch, capsys):
    _no_study(monkeypatch)
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1") if name == "utf16.txt" else content.encode("utf-8"))
    out = tmp_path / "out"
    rc, err = _run(ablate.main, ["method", "--model", "random:infinity-tiny", "--prompts", path, "--threads", "1",
                                 "--wandb", "disabled", "--out", out], capsys)
    assert_one_error(rc, err, str(path), *fragments)
    assert not out.exists()  # refused while parsing, before any model is loaded


def test_prompt_file_without_read_permission(tmp_path, monkeypatch, capsys):
    _no_study(monkeypatch)
    if os.geteuid() == 0:
        pytest.skip("root reads any file: chmod cannot take the permission away")
    path = tmp_path / "prompts.txt"
    path.write_text("a cat\n")
    path.chmod(0)
    rc, err = _run(ablate.main, ["method", "--model", "random:infinity-tiny", "--prompts", path,
                                 "--out", tmp_path / "out"], capsys)
    assert_one_error(rc, err, str(path), "cannot be read")


# ----- weights -----------------------------------------------------------------------------------------------
def _testbed_copy(folder: Path, broken: str, content: bytes) -> Path:
    """The shipped testbed folder (links to its files) with ``broken`` replaced by ``content``."""
    folder.mkdir()
    for name in ("testbed.json", "var.safetensors", "vqvae.safetensors"):
        if name == broken:
            (folder / name).write_bytes(content)
        else:
            (folder / name).symlink_to(TESTBED / name)
    return folder


WEIGHT_FILES = [
    pytest.param("var.safetensors", lambda real: real[: len(real) // 2], ("var.safetensors", "corrupt or truncated"),
                 id="var-safetensors-truncated"),
    pytest.param("var.safetensors", lambda real: real[:5], ("var.safetensors", "corrupt or truncated"),
                 id="var-safetensors-cut-in-the-header"),
    pytest.param("var.safetensors", lambda real: b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n",
                 ("var.safetensors", "corrupt or truncated", "HTML page"), id="var-safetensors-html"),
    pytest.param("testbed.json", lambda real: real[: len(real) // 3], ("testbed.json", "corrupt or truncated"),
                 id="testbed-json-truncated"),
    pytest.param("testbed.json", lambda real: b"[" * 100_000 + b"]" * 100_000,
                 ("testbed.json", "corrupt or truncated", "nested too deeply"), id="testbed-json-nested"),
    pytest.param("testbed.json", lambda real: b'{"var_config": {"depth": 2}}',
                 ("testbed.json", "corrupt", "var_config / vqvae_config"), id="testbed-json-without-vqvae-config"),
]


@pytest.mark.skipif(not (TESTBED / "var.safetensors").is_file(), reason="the testbed weights are not shipped")
@pytest.mark.parametrize("broken, make, fragments", WEIGHT_FILES)
def test_bad_testbed_weights_are_one_error_line(broken, make, fragments, tmp_path, capsys):
    folder = _testbed_copy(tmp_path / "weights", broken, make((TESTBED / broken).read_bytes()))
    out = tmp_path / "grid.png"
    rc, err = _run(demo.main, ["--weights", folder, "--out", out], capsys)
    assert_one_error(rc, err, str(folder / broken), *fragments)
    assert not out.exists()


# ----- metric weights asked for by name ----------------------------------------------------------------------
STUDY = ["cache", "--samples", "2", "--batch-size", "2", "--warmup", "0", "--timing-rounds", "0", "--threads", "1",
         "--wandb", "disabled", "--no-plots", "--no-progress", "--arms", "identity@t_est=5"]


@pytest.fixture
def garbage(tmp_path) -> Path:
    path = tmp_path / "garbage.bin"
    path.write_bytes(b"this is not a weights file\n" * 20)
    return path


@pytest.mark.skipif(not (TESTBED / "var.safetensors").is_file(), reason="the testbed weights are not shipped")
@pytest.mark.parametrize("kind", ["garbage", "truncated", "other-model"])
def test_named_classifier_that_cannot_load_stops_before_generation(kind, garbage, tmp_path, capsys):
    """The study used to run on with class accuracy / FID-proxy n/a; a classifier asked for by name is an error."""
    if kind == "garbage":
        path, model = garbage, "testbed"
    elif kind == "truncated":
        real = (TESTBED / "classifier.safetensors").read_bytes()
        path, model = tmp_path / "classifier.safetensors", "testbed"
        path.write_bytes(real[: len(real) // 2])
    else:  # a readable classifier for the testbed's classes, named for a model it cannot judge
        path, model = TESTBED / "classifier.safetensors", "official-tiny"
    out = tmp_path / "run"
    rc, err = _run(ablate.main, [*STUDY, "--model", model, "--classifier", path, "--out", out], capsys)
    assert_one_error(rc, err, f"--classifier {path}", "cannot be used")
    assert not (out / "arms").exists() or not any((out / "arms").iterdir())  # nothing generated


@pytest.mark.parametrize("which", ["both-garbage", "backbone-only", "lin-only"])
def test_named_lpips_weights_that_cannot_load_stop_before_generation(which, garbage, fixture_dir, tmp_path, capsys):
    args = {"both-garbage": ["--lpips-backbone", garbage, "--lpips-lin", garbage],
            "backbone-only": ["--lpips-backbone", garbage], "lin-only": ["--lpips-lin", garbage]}[which]
    out = tmp_path / "run"
    rc, err = _run(ablate.main, [*STUDY, "--model", "official-tiny", *args, "--out", out], capsys)
    line = assert_one_error(rc, err, "LPIPS", str(garbage))
    if which != "both-garbage":
        assert "without" in line  # the other file of the pair is named as missing
    assert not (out / "arms").exists() or not any((out / "arms").iterdir())


# ----- a read-only or full file system ----------------------------------------------------------------------
def _records(out: Path) -> dict[str, bytes]:
    arms = out / "arms"
    if not arms.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(arms.iterdir()) if p.is_file() and not p.name.startswith(".")}


def _fail_saving_the_arm(monkeypatch, fault):
    """torch.save works for the baseline and fails like a full disk for the second arm's tensors."""
    import var_core.eval.lightning as lightning_module

    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        name = str(getattr(f, "name", f))
        calls.append(name)
        if "identity" in Path(name).name:
            fault()
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(lightning_module.torch, "save", save)
    return calls


def _enospc_oserror():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write on a handle: no file name


def _enospc_torch_writer():
    """What torch.save on a file handle raises on a full disk: the C++ writer's RuntimeError, with the OSError as
    its context (reproduced on a 200 KiB tmpfs)."""
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


@pytest.mark.parametrize("fault", [_enospc_oserror, _enospc_torch_writer], ids=["oserror", "torch-inline-container"])
def test_full_disk_while_saving_an_arm_keeps_the_finished_baseline(fault, fixture_dir, tmp_path, monkeypatch,
                                                                   capsys):
    out = tmp_path / "run"
    _fail_saving_the_arm(monkeypatch, fault)
    rc, err = _run(ablate.main, [*STUDY, "--model", "official-tiny", "--out", out], capsys)
    assert_one_error(rc, err, f"cannot write {record_paths(out, 'identity@t_est=5')[1]}: No space left on device",
                     "ENOSPC", "disk is full", f"kept in {out}")
    kept = _records(out)
    assert {"baseline.json", "baseline.pt"} <= set(kept)  # the finished arm stays
    assert not [p for p in (out / "arms").iterdir() if p.name.startswith(".")]  # no temporary file left
    # and a re-run on a disk with room reuses it instead of recomputing it
    monkeypatch.undo()
    rc, err = _run(ablate.main, [*STUDY, "--model", "official-tiny", "--out", out], capsys)
    assert rc == 0, err
    assert _records(out)["baseline.pt"] == kept["baseline.pt"]


def test_read_only_results_folder_is_one_error_line(fixture_dir, tmp_path, monkeypatch, capsys):
    """``--out`` below a folder that cannot be written. A chmod-ed folder where that works (not as root); else the
    mkdir fails as on a read-only mount (EROFS, reproduced on a read-only tmpfs)."""
    parent = tmp_path / "ro"
    parent.mkdir()
    out = parent / "run"
    if os.geteuid() != 0:
        parent.chmod(0o555)
        fragments = ("Permission denied", "EACCES")
    else:
        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self == out or out in self.parents:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
        fragments = ("Read-only file system", "EROFS")
    try:
        rc, err = _run(ablate.main, [*STUDY, "--model", "official-tiny", "--out", out], capsys)
    finally:
        parent.chmod(0o755)
    line = assert_one_error(rc, err, f"cannot write {out}", *fragments)
    assert "kept in" not in line  # nothing was made, so nothing is said to be kept


def test_read_only_save_images_folder_keeps_the_records(fixture_dir, tmp_path, monkeypatch, capsys):
    """``--save-images DIR`` on a read-only file system: one line naming the image, the arm records stay."""
    from PIL import Image

    out, images = tmp_path / "run", tmp_path / "images"
    real_save = Image.Image.save

    def save(self, fp, *args, **kwargs):
        if images in Path(fp).parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(fp))
        return real_save(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)
    rc, err = _run(ablate.main, [*STUDY, "--model", "official-tiny", "--save-images", images, "--out", out], capsys)
    line = assert_one_error(rc, err, f"cannot write {images}", "Read-only file system", f"kept in {out}")
    assert "baseline.json" in _records(out)


@pytest.mark.skipif(not (TESTBED / "var.safetensors").is_file(), reason="the testbed weights are not shipped")
@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC], ids=["read-only", "full"])
def test_demo_out_on_a_read_only_or_full_file_system(code, tmp_path, monkeypatch, capsys):
    """As on a real read-only / full tmpfs: on a read-only one PIL's open() fails naming the temporary file, and
    removing that file fails too (EROFS, not ENOENT); on a full one the write fails without a file name and leaves
    half a file. The line names the PNG either way, and no half-written PNG is left."""
    from PIL import Image

    out = tmp_path / "grid.png"
    real_unlink = Path.unlink

    def save(self, fp, *args, **kwargs):
        if code == errno.EROFS:
            raise OSError(code, os.strerror(code), str(fp))
        Path(fp).write_bytes(b"\x89PNG half")
        raise OSError(code, os.strerror(code))

    def unlink(self, missing_ok=False):
        if code == errno.EROFS and self.parent == tmp_path:
            raise OSError(code, os.strerror(code), str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Image.Image, "save", save)
    monkeypatch.setattr(Path, "unlink", unlink)
    rc, err = _run(demo.main, ["--per-class", "1", "--classes", "2", "--out", out], capsys)
    assert_one_error(rc, err, f"cannot write {out}:", os.strerror(code), errno.errorcode[code])
    assert list(tmp_path.iterdir()) == []  # neither a PNG nor its temporary file


# ----- Ctrl-C while loading ----------------------------------------------------------------------------------
SWALLOWING_IMPORT = """
    import importlib, os, signal, sys, time

    real = importlib.import_module

    def import_module(name, *args):
        # what torch's C code does when Ctrl-C lands while it imports numpy: the KeyboardInterrupt is dropped
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
        except KeyboardInterrupt:
            pass
        return real(name, *args)

    importlib.import_module = import_module
"""


# A process started from a background job inherits SIGINT ignored (as CI's may be), and Python then installs no
# KeyboardInterrupt handler: give the child the handler an interactive terminal gives it.
AS_FROM_A_TERMINAL = "import signal as _signal; _signal.signal(_signal.SIGINT, _signal.default_int_handler)\n"


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", AS_FROM_A_TERMINAL + textwrap.dedent(code), *args], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=120)


def test_ctrl_c_while_varscope_imports_its_command_exits_130():
    """The bug: an interrupt swallowed inside an import let the command run to the end and exit 0."""
    proc = _python(SWALLOWING_IMPORT + """
    from studies.cli import main
    sys.exit(main(["ls", "families"]))
    """)
    assert proc.returncode == 130, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "interrupted (while loading; nothing was computed)."]
    assert proc.stdout == ""  # the command did not run


def test_ctrl_c_while_python_m_studies_imports_exits_130():
    """``python -m studies.X``: the package turns the guard on while the module is found (argv[0] == "-m")."""
    proc = _python("""
    import os, signal, sys, time
    sys.argv = ["-m"]  # as during python -m studies.ablate
    import studies
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    except KeyboardInterrupt:
        pass  # swallowed, as inside torch's import
    print("ran on")
    """)
    assert proc.returncode == 130, (proc.stdout, proc.stderr)
    assert "ran on" not in proc.stdout and "Traceback" not in proc.stderr


def test_ctrl_c_while_the_model_loads_exits_130(monkeypatch, tmp_path, capsys):
    import studies.demo as demo_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_module, "load_model", interrupted)
    rc, err = _run(demo.main, ["--out", tmp_path / "g.png"], capsys)
    assert rc == 130 and "interrupted" in err and "Traceback" not in err


# ----- verify: a manifest proves completeness, not authenticity ----------------------------------------------
def _fixture_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(folder: Path) -> None:
    lines = []
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        if line.strip():
            name = line.split(maxsplit=1)[1].lstrip(" *")
            lines.append(f"{hashlib.sha256((folder / name).read_bytes()).hexdigest()}  {name}")
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def test_verify_refuses_a_listed_file_that_links_out_of_the_folder(fixture_dir, tmp_path, capsys):
    from var_core.verify import main

    folder = _fixture_copy(fixture_dir, tmp_path / "fx")
    elsewhere = tmp_path / "elsewhere.pt"
    elsewhere.write_bytes((folder / "golden_vqvae.pt").read_bytes())
    (folder / "golden_vqvae.pt").unlink()
    (folder / "golden_vqvae.pt").symlink_to(elsewhere)  # same bytes: the manifest's hash still matches
    capsys.readouterr()
    rc = main([str(folder)])
    captured = capsys.readouterr()
    assert_one_error(rc, captured.err, str(folder / "golden_vqvae.pt"), "symbolic link", str(elsewhere))
    assert captured.out == ""  # refused before any check ran


def test_verify_says_the_manifest_proves_completeness_not_authenticity(fixture_dir, tmp_path, capsys):
    """A fixture whose files and manifest were edited together passes the manifest check: the line says what that
    proves and prints the manifest's own sha256 to compare with a trusted copy."""
    from var_core.verify.common import Fixture

    folder = _fixture_copy(fixture_dir, tmp_path / "fx")
    config = json.loads((folder / "config.json").read_text())
    config["edited"] = True
    (folder / "config.json").write_text(json.dumps(config))
    _rewrite_manifest(folder)
    (line,) = [c.line() for c in Fixture(folder).integrity_checks()]
    own = hashlib.sha256((folder / "SHA256SUMS").read_bytes()).hexdigest()
    assert line.startswith("PASS  manifest/sha256") and "not authenticity" in line and own[:16] in line
    assert hashlib.sha256((fixture_dir / "SHA256SUMS").read_bytes()).hexdigest()[:16] not in line


# ----- a training checkpoint with a pickled payload ----------------------------------------------------------
class _Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): the proof that a checkpoint ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_resume_refuses_a_checkpoint_carrying_code(tmp_path, capsys):
    from var_core.testbed import train

    out, marker = tmp_path / "train", tmp_path / "pwned"
    out.mkdir()
    torch.save({"global_step": 3, "state_dict": {}, "callbacks": _Payload(marker)}, out / "vqvae_last.ckpt")
    capsys.readouterr()
    rc = run_command(train.main, ["vqvae", "--out", str(out), "--preset", "tiny", "--resume", "--no-cache",
                                  "--threads", "1", "--max-steps", "1"])
    err = capsys.readouterr().err
    assert not marker.exists()  # the payload did not run
    assert_one_error(rc, err, f"refusing training checkpoint {out / 'vqvae_last.ckpt'}", "could run code")
    # the reader itself, on the same file
    with pytest.raises(Exception, match="refusing training checkpoint"):
        train.read_checkpoint(out / "vqvae_last.ckpt")
    assert not marker.exists()
