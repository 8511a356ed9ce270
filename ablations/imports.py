"""Result files of external benchmarks joined to an ablation folder: GenEval and DPG-Bench.

GenEval (Ghosh et al., NeurIPS 2023) judges images with a Mask2Former detector and CLIP, DPG-Bench (Hu et al.,
ELLA, 2024) with the mPLUG-large VQA model; both stacks are heavy and their own, so we do not reimplement them.
The workflow::

    python -m studies.ablate method --model infinity-2b --prompts evaluation_metadata.jsonl --samples 2212 \\
        --save-images                       # 553 GenEval prompts x 4 images, every arm exported
    # for each arm, with GenEval's own environment:
    python geneval/evaluation/evaluate_images.py RESULTS/images/<arm>/geneval --outfile geneval_<arm>.jsonl ...
    python -m studies.report RESULTS --import geneval geneval_nova.jsonl --import geneval geneval_baseline.jsonl

Image layout (written by ``--save-images``, :mod:`var_core.eval.export`; agreed between the two modules)::

    <results folder>/images/<arm>/geneval/<index:05d>/metadata.jsonl        the prompt's GenEval metadata line
    <results folder>/images/<arm>/geneval/<index:05d>/samples/<k:04d>.png   its k-th image

``<arm>`` is the arm name made file-safe (:func:`var_core.eval.records.arm_slug`), ``<index>`` the prompt's line in
the prompt file. ``--save-images DIR`` puts the same ``images/`` tree under ``DIR``.

**GenEval** result file: what its ``evaluate_images.py`` writes — JSONL, one object per image with ``filename``
(the image's path), ``tag`` (``single_object``, ``two_object``, ``counting``, ``colors``, ``position``,
``color_attr``), ``prompt``, ``correct`` (bool), ``reason`` and ``metadata``. The arm of a line is the folder
before ``geneval`` in its ``filename`` (``.../images/<arm>/geneval/<index>/samples/<k>.png``), so one file may
hold several arms; ``--import-arm ARM`` assigns every line to one arm instead. Scores as GenEval's
``summary_scores.py``: a task's accuracy is the fraction of its images judged correct, **overall** the mean of the
task accuracies. Intervals: 95 % percentile bootstrap over *prompts* (all images of a prompt resampled together,
prompts resampled within their task, 2000 resamples, seed 0) — images of one prompt are not independent.
Columns as the papers print them: Single Obj., Two Obj., Counting, Colors, Position, Color Attri. (attribute
binding), Overall; fractions in ``[0, 1]`` (ToProVAR's Table 1 prints the tasks as percentages).

**DPG-Bench** result file: a CSV (or TSV) with one row per prompt: an id column (``item_id``, ``prompt_id``,
``id``, ``filename`` or ``image``), one column per question category present (``global``, ``entity``,
``attribute``, ``relation``, ``other``; a prompt without questions of a category leaves it empty) and the prompt's
score (``overall`` or ``score``: its fraction of questions answered correctly, as DPG-Bench's
``compute_dpg_bench.py`` computes it). A headerless two-column file (id, score) is read as overall only. The arm:
an ``arm`` column, an id that is a path through ``images/<arm>/``, or ``--import-arm``. Each category: mean over
the prompts that have it; **overall**: mean over prompts; BCa bootstrap intervals over prompts. Values are kept on
the file's scale (DPG-Bench reports percentages, e.g. 83.41).

Refused, in one error naming the file (and line or key): a file that is not UTF-8 text, a line that is not a
result (a tag, filename or prompt that is not a string), a result given twice for one arm, and more images
(GenEval) or prompts (DPG-Bench) for an arm than the samples it generated — results of another study.

What is written: ``<results folder>/imports/<kind>.json`` (schema ``varscope.import/1``): per arm the summaries
(``geneval_<task>`` / ``dpg_<category>`` and ``*_overall``), counts and per-prompt values, plus each source file's
path and sha256. A later import of the same kind replaces the arms it contains and keeps the others. The arm
records are not touched; ``ablations.report`` joins the summaries into the table (:func:`merge_imports`) and names
the sources in the footer (:func:`import_footer`).
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import io
import json
import math
from pathlib import Path, PurePath
from typing import Any, Iterable, Sequence

import numpy as np

from var_core.errors import UserError, did_you_mean
from var_core.eval import records as rec
from var_core.eval.stats import Summary, bootstrap_ci

__all__ = ["KINDS", "GENEVAL_TASKS", "GENEVAL_LABELS", "DPG_CATEGORIES", "DPG_LABELS", "import_results",
           "read_geneval", "read_dpg", "geneval_summary", "dpg_summary", "merge_imports", "import_footer",
           "imports_dir", "SCHEMA", "N_RESAMPLES"]

SCHEMA = "varscope.import/1"
KINDS = ("geneval", "dpg")
GENEVAL_TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
GENEVAL_LABELS = {"single_object": "Single Obj.", "two_object": "Two Obj.", "counting": "Counting",
                  "colors": "Colors", "position": "Position", "color_attr": "Color Attri.", "overall": "Overall"}
DPG_CATEGORIES = ("global", "entity", "attribute", "relation", "other")
DPG_LABELS = {"global": "Global", "entity": "Entity", "attribute": "Attribute", "relation": "Relation",
              "other": "Other", "overall": "Overall"}
N_RESAMPLES = 2000
_ID_COLUMNS = ("item_id", "prompt_id", "id", "filename", "file", "image", "image_path", "name")
_OVERALL_COLUMNS = ("overall", "score", "total", "mean")


def imports_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "imports"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----- arms from image paths -------------------------------------------------------------------------------
def _arm_from_path(path: str, slugs: dict[str, str], marker: str | None) -> str | None:
    """The arm whose slug is the folder before ``marker`` in ``path`` (or, without a marker match, the last path
    component that is an arm's slug)."""
    parts = PurePath(str(path).replace("\\", "/")).parts
    if marker is not None:
        for i in range(len(parts) - 1, 0, -1):
            if parts[i] == marker and parts[i - 1] in slugs:
                return slugs[parts[i - 1]]
    for part in reversed(parts[:-1]):
        if part in slugs:
            return slugs[part]
    return None


def _geneval_prompt_index(path: str) -> int | None:
    parts = PurePath(str(path).replace("\\", "/")).parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == "samples" and parts[i - 1].isdigit():
            return int(parts[i - 1])
    return None


def _resolve_arm(arm: str | None, arm_names: Sequence[str]) -> str | None:
    if arm is None:
        return None
    if arm in arm_names:
        return arm
    by_slug = {rec.arm_slug(a): a for a in arm_names}
    if arm in by_slug:
        return by_slug[arm]
    raise UserError(f"--import-arm {arm!r} is not an arm of this folder.{did_you_mean(arm, arm_names)} Arms: "
                    f"{', '.join(arm_names)}")


# ----- GenEval ---------------------------------------------------------------------------------------------
def read_geneval(path: str | Path) -> list[dict]:
    """The lines of a GenEval results JSONL (each must hold ``tag`` and ``correct``)."""
    path = Path(path)
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(_not_text(path, exc, n, "GenEval results file (JSONL)")) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise UserError(f"{path}:{n} is not JSON ({exc}); a GenEval results file has one JSON object "
                                f"per line (evaluate_images.py --outfile)") from None
            if not isinstance(row, dict) or "tag" not in row or "correct" not in row:
                raise UserError(f"{path}:{n} lacks 'tag' or 'correct': not a GenEval results line (fields: "
                                f"filename, tag, prompt, correct, reason, metadata)")
            if not isinstance(row["correct"], bool):
                raise UserError(f"{path}:{n}: 'correct' must be true or false, got {row['correct']!r}")
            for key in ("tag", "filename", "prompt"):  # a task name, an image path, the prompt: text
                if (key == "tag" or row.get(key) is not None) and not isinstance(row.get(key), str):
                    raise UserError(f"{path}:{n}: {key!r} must be a string, got {_short(row.get(key))}"
                                    + (f" (GenEval tags: {', '.join(GENEVAL_TASKS)})" if key == "tag" else ""))
            rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no GenEval result line")
    return rows


def _short(value: Any) -> str:
    text = repr(value)
    return (text[:60] + "…" if len(text) > 60 else text) + f" ({type(value).__name__})"


def _not_text(path: Path, exc: UnicodeDecodeError, line: int | None, what: str) -> str:
    where = f"{path}:{line}" if line else str(path)
    return (f"{where} is not UTF-8 text (byte {exc.object[exc.start:exc.start + 1]!r} at offset {exc.start}"
            f"{' of the line' if line else ''}): a binary file? A {what} is text")


def _cluster_stats(groups: dict[str, list[tuple[Any, int, int]]], rng_seed: int = 0, level: float = 0.95,
                   n_resamples: int = N_RESAMPLES) -> dict[str, dict]:
    """Per task: image-level accuracy with a bootstrap over its prompts; ``overall``: the mean of the task
    accuracies, prompts resampled within each task. ``groups[task]`` = ``[(prompt key, correct, images)]``."""
    rng = np.random.default_rng(rng_seed)
    tasks = list(groups)
    point, boots, out = {}, {}, {}
    for task in tasks:
        correct = np.asarray([c for _, c, _ in groups[task]], dtype=float)
        images = np.asarray([m for _, _, m in groups[task]], dtype=float)
        point[task] = float(correct.sum() / images.sum())
        idx = rng.integers(0, len(correct), (n_resamples, len(correct)))
        boots[task] = correct[idx].sum(1) / images[idx].sum(1)
        lo, hi = np.quantile(boots[task], [(1 - level) / 2, (1 + level) / 2])
        out[task] = Summary(point[task], float(lo), float(hi), len(correct), level,
                            method=f"accuracy over {int(images.sum())} images; percentile bootstrap over "
                                   f"{len(correct)} prompts").to_dict()
    overall = float(np.mean([point[t] for t in tasks]))
    boot = np.mean([boots[t] for t in tasks], axis=0)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    n_prompts = sum(len(groups[t]) for t in tasks)
    out["overall"] = Summary(overall, float(lo), float(hi), n_prompts, level,
                             method=f"mean of {len(tasks)} task accuracies; percentile bootstrap over prompts "
                                    f"within tasks").to_dict()
    return out


def geneval_summary(rows: Iterable[dict], seed: int = 0) -> dict:
    """GenEval scores of one arm's result lines: ``{"summary": {geneval_<task>: Summary dict, geneval_overall},
    "n_images", "n_prompts", "per_prompt": [...], "tags": [...]}``."""
    prompts: dict[tuple, dict] = {}
    for row in rows:
        index = _geneval_prompt_index(row.get("filename", ""))
        key = (row["tag"], index if index is not None else json.dumps(row.get("metadata"), sort_keys=True)
               if row.get("metadata") is not None else row.get("prompt"))
        entry = prompts.setdefault(key, {"tag": row["tag"], "index": index, "prompt": row.get("prompt"),
                                         "correct": 0, "images": 0})
        entry["correct"] += int(bool(row["correct"]))
        entry["images"] += 1
    groups: dict[str, list] = {}
    order = [t for t in GENEVAL_TASKS if any(p["tag"] == t for p in prompts.values())]
    order += sorted({p["tag"] for p in prompts.values()} - set(order))
    for task in order:
        groups[task] = [(k, p["correct"], p["images"]) for k, p in prompts.items() if p["tag"] == task]
    stats = _cluster_stats(groups, seed)
    return {"summary": {f"geneval_{k}": v for k, v in stats.items()},
            "n_images": sum(p["images"] for p in prompts.values()), "n_prompts": len(prompts), "tags": order,
            "per_prompt": sorted(prompts.values(), key=lambda p: (p["index"] is None, p["index"] or 0, p["tag"]))}


# ----- DPG-Bench -------------------------------------------------------------------------------------------
def _float(value) -> float | None:
    if value is None:
        return None
    text = str(value).strip()
    if text == "" or text.lower() in ("nan", "none", "null", "-"):
        return None
    try:
        v = float(text)
    except ValueError:
        return math.nan
    return v if math.isfinite(v) else None


def read_dpg(path: str | Path) -> list[dict]:
    """Rows ``{"id", "arm" (or None), "<category>": float | None, "overall": float}`` of a DPG-Bench result file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(_not_text(path, exc, None, "DPG-Bench result file (CSV / TSV)")) from None
    if "\x00" in text:
        raise UserError(f"{path}:{text[:text.index(chr(0))].count(chr(10)) + 1} holds a NUL byte: a binary file? A "
                        f"DPG-Bench result file (CSV / TSV) is text")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"{path} is empty (a DPG-Bench result file has one row per prompt)")
    delimiter = "\t" if "\t" in lines[0] else ","
    header = [h.strip().lower() for h in next(csv.reader([lines[0]], delimiter=delimiter))]
    known = {*_ID_COLUMNS, *_OVERALL_COLUMNS, *DPG_CATEGORIES, "arm"}
    first_line = 2
    second = _float(header[1]) if len(header) == 2 else None
    # headerless "id, score": two cells, no column name, and a second cell that is a number (or empty), not a word
    if len(header) == 2 and not known.intersection(header) and not (second is not None and math.isnan(second)):
        header = ["id", "overall"]
        body, first_line = lines, 1
    else:
        body = lines[1:]
    id_col = next((c for c in _ID_COLUMNS if c in header), None)
    overall_col = next((c for c in _OVERALL_COLUMNS if c in header), None)
    if id_col is None or overall_col is None:
        raise UserError(f"{path}: need an id column ({' / '.join(_ID_COLUMNS[:4])}) and a score column "
                        f"({' / '.join(_OVERALL_COLUMNS[:2])}); the header is {', '.join(header)}")
    rows = []
    for n, values in enumerate(csv.reader(io.StringIO("\n".join(body)), delimiter=delimiter), first_line):
        if len(values) != len(header):
            raise UserError(f"{path}:{n} has {len(values)} fields, the header {len(header)}")
        cells = dict(zip(header, (v.strip() for v in values)))
        row = {"id": cells[id_col], "arm": cells.get("arm") or None}
        for col in (*DPG_CATEGORIES, "overall"):
            src = overall_col if col == "overall" else col
            if src in cells:
                value = _float(cells[src])
                if value is not None and math.isnan(value):
                    raise UserError(f"{path}:{n}: {src} = {cells[src]!r} is not a number")
                row[col] = value
        if row.get("overall") is None:
            raise UserError(f"{path}:{n}: the prompt {row['id']!r} has no score")
        rows.append(row)
    return rows


def dpg_summary(rows: Iterable[dict], seed: int = 0) -> dict:
    rows = list(rows)
    summary = {}
    for col in (*DPG_CATEGORIES, "overall"):
        values = [r[col] for r in rows if r.get(col) is not None]
        if values:
            s = bootstrap_ci(values, seed=seed)
            summary[f"dpg_{col}"] = dict(s.to_dict(), method=f"{s.method} bootstrap over {len(values)} prompts")
    return {"summary": summary, "n_prompts": len(rows),
            "per_prompt": [{k: v for k, v in r.items() if k != "arm"} for r in rows]}


# ----- import ----------------------------------------------------------------------------------------------
def _arm_names(out_dir: Path) -> list[str]:
    """The arms with a readable finished record in ``out_dir/arms`` (what the report would show)."""
    from var_core.eval.records import RecordError, load_record

    names = []
    for path in sorted((Path(out_dir) / "arms").glob("*.json")):
        try:
            record = load_record(path)
        except RecordError:
            continue
        if record and record.get("status") == "complete" and record.get("arm"):
            names.append(record["arm"])
    return names


def _arm_samples(out_dir: Path) -> dict[str, int]:
    """Samples generated per arm (``samples.n`` of each finished record)."""
    from var_core.eval.records import RecordError, load_record

    counts = {}
    for path in sorted((Path(out_dir) / "arms").glob("*.json")):
        try:
            record = load_record(path)
        except RecordError:
            continue
        n = ((record or {}).get("samples") or {}).get("n") if isinstance((record or {}).get("samples"), dict) else None
        if record and record.get("arm") and isinstance(n, int):
            counts[record["arm"]] = n
    return counts


def _check_counts(path: Path, kind: str, name: str, rows: list[dict], samples: int | None) -> None:
    """Refuse an arm's results that cannot come from its images: a line repeated, or more images (GenEval) /
    prompts (DPG-Bench) than the arm generated samples."""
    key = "filename" if kind == "geneval" else "id"
    seen: set = set()
    for row in rows:
        value = row.get(key)
        if value is not None and value in seen:
            raise UserError(f"{path}: {value!r} appears twice for arm {name!r}: one result per "
                            f"{'image' if kind == 'geneval' else 'prompt'}; remove the repeated line")
        seen.add(value)
    if samples is not None and len(rows) > samples:
        unit = "images" if kind == "geneval" else "prompts"
        raise UserError(f"{path}: {len(rows)} {unit} for arm {name!r}, but it generated {samples} samples "
                        f"(arms/{rec.arm_slug(name)}.json): these results are not of this folder's images (another "
                        f"study, or --import-arm on the wrong file)")


def import_results(out_dir: str | Path, kind: str, path: str | Path, *, arm: str | None = None,
                   arm_names: Sequence[str] | None = None, seed: int = 0,
                   arm_samples: dict[str, int] | None = None) -> dict:
    """Read ``path`` (a ``kind`` result file), summarise it per arm and merge it into
    ``<out_dir>/imports/<kind>.json``. Returns ``{"arms": {arm: summary}, "unmatched": [...], "lines": n,
    "file": ...}``. ``arm_samples`` (default: read from the records): samples per arm, an upper bound on its
    images (GenEval) or prompts (DPG-Bench) in the file."""
    out_dir = Path(out_dir)
    if kind not in KINDS:
        raise UserError(f"unknown import kind {kind!r}.{did_you_mean(kind, KINDS)} Kinds: {', '.join(KINDS)}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"--import {kind} {path}: no such file")
    names = list(arm_names) if arm_names is not None else _arm_names(out_dir)
    if not names:
        raise UserError(f"{out_dir} has no finished arm to import {kind} results into")
    forced = _resolve_arm(arm, names)
    slugs = {rec.arm_slug(a): a for a in names}
    by_arm: dict[str, list] = {}
    unmatched: list[str] = []
    if kind == "geneval":
        for row in read_geneval(path):
            name = forced or _arm_from_path(row.get("filename", ""), slugs, "geneval")
            if name is None:
                unmatched.append(str(row.get("filename")))
            else:
                by_arm.setdefault(name, []).append(row)
        summarise = geneval_summary
    else:
        for row in read_dpg(path):
            name = forced or (_resolve_arm(row["arm"], names) if row.get("arm") else
                              _arm_from_path(row["id"], slugs, None))
            if name is None:
                unmatched.append(str(row["id"]))
            else:
                by_arm.setdefault(name, []).append(row)
        summarise = dpg_summary
    counts = arm_samples if arm_samples is not None else _arm_samples(out_dir)
    for name, rows in by_arm.items():
        _check_counts(path, kind, name, rows, counts.get(name))
    if not by_arm:
        example = unmatched[0] if unmatched else "?"
        raise UserError(f"none of the {len(unmatched)} results in {path} belongs to an arm of {out_dir} (e.g. "
                        f"{example!r}): {kind} image paths must run through images/<arm>/"
                        + ("geneval/<index>/samples/ " if kind == "geneval" else "") +
                        f"as --save-images writes them (arms: {', '.join(slugs)}), or pass --import-arm ARM")
    source = {"path": str(path.resolve()), "sha256": _sha256(path), "arms": sorted(by_arm),
              "imported": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "unmatched": len(unmatched)}
    arms = {}
    for name, rows in by_arm.items():
        arms[name] = dict(summarise(rows, seed), source=source["sha256"])
    side = imports_dir(out_dir) / f"{kind}.json"
    data = _read_side(side) or {"schema": SCHEMA, "kind": kind, "arms": {}, "sources": []}
    data["arms"].update(arms)
    kept = []
    for s in data.get("sources", []):  # an earlier file keeps the arms this one does not replace
        remaining = [a for a in s.get("arms", []) if a not in arms]
        if s.get("sha256") != source["sha256"] and remaining:
            kept.append(dict(s, arms=remaining))
    data["sources"] = kept + [source]
    side.parent.mkdir(parents=True, exist_ok=True)
    rec.write_json_atomic(side, data)
    return {"arms": arms, "unmatched": unmatched, "file": side,
            "lines": len(unmatched) + sum(len(rows) for rows in by_arm.values())}


def _read_side(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} ({type(exc).__name__}: {exc}); delete it and import again") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("arms"), dict):
        raise UserError(f"{path} is not an import file of this project (schema {SCHEMA}); delete it and import "
                        f"again")
    bad = _side_problem(data)
    if bad:
        raise UserError(f"{path}: {bad}; delete it and import again (python -m studies.report RUN_DIR --import "
                        f"KIND FILE)")
    return data


def _side_problem(data: dict) -> str | None:
    """What in an ``imports/<kind>.json`` the report cannot use, naming the arm and key."""
    for name, entry in data["arms"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("summary"), dict):
            return f"arm {name!r} has no 'summary' object"
        if not isinstance(entry.get("n_prompts"), int) or isinstance(entry.get("n_prompts"), bool):
            return f"arm {name!r}: 'n_prompts' is {_short(entry.get('n_prompts'))}, not a count"
        for key, value in entry["summary"].items():
            if not isinstance(value, dict):
                return f"arm {name!r}: summary.{key} is {_short(value)}, not an interval"
            for part in ("mean", "low", "high", "n"):
                v = value.get(part)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    return f"arm {name!r}: summary.{key}.{part} is {_short(v)}, not a number"
    sources = data.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(x, dict) and isinstance(x.get("path"), str)
                                                and isinstance(x.get("sha256"), str) for x in sources):
        return "'sources' is not a list of {path, sha256} objects"
    return None


# ----- report ----------------------------------------------------------------------------------------------
def _imports(out_dir: Path) -> dict[str, dict]:
    out = {}
    for kind in KINDS:
        data = _read_side(imports_dir(out_dir) / f"{kind}.json")
        if data is not None:
            out[kind] = data
    return out


def merge_imports(out_dir: str | Path, records: list[dict]) -> list[dict]:
    """Copies of ``records`` whose ``summary`` also holds the imported ``geneval_*`` / ``dpg_*`` summaries of their
    arm (records of arms without imported results are returned unchanged)."""
    found = _imports(Path(out_dir))
    if not found:
        return records
    out = []
    for r in records:
        extra = {}
        for data in found.values():
            entry = data["arms"].get(r["arm"])
            if entry:
                extra.update(entry["summary"])
        out.append(dict(r, summary=dict(r["summary"], **extra)) if extra else r)
    return out


def import_footer(out_dir: str | Path, records: list[dict]) -> list[str]:
    """Footer lines of the table: each import's sources, the arms it lacks; for a text-to-image folder without
    imports, how to add them."""
    out_dir = Path(out_dir)
    found = _imports(out_dir)
    lines = []
    arms = [r["arm"] for r in records]
    for kind, data in found.items():
        label = "GenEval" if kind == "geneval" else "DPG-Bench"
        lines.append(f"Imported {label} results (imports/{kind}.json), intervals over prompts:\n")
        for s in data.get("sources", []):
            lines.append(f"- `{s['path']}` (sha256 {s['sha256'][:16]}, {s.get('imported')}): arms "
                         f"{', '.join(s.get('arms', []))}" + (f"; {s['unmatched']} lines matched no arm"
                                                              if s.get("unmatched") else ""))
        for name in arms:
            entry = data["arms"].get(name)
            if entry is None:
                lines.append(f"- `{name}`: no {label} results imported (n/a in the table)")
            else:
                counts = (f"{entry['n_prompts']} prompts" + (f", {entry['n_images']} images" if "n_images" in entry
                                                             else ""))
                lines.append(f"- `{name}`: {counts}")
        lines.append("")
    families = {(r.get("model") or {}).get("family") for r in records}
    missing = [k for k in KINDS if k not in found]
    if missing and "infinity" in families:
        lines.append("Not imported: " + "; ".join(
            f"`{k}` (export with --save-images, run {'GenEval' if k == 'geneval' else 'DPG-Bench'} on "
            f"images/<arm>/, then python -m studies.report {out_dir} --import {k} FILE)" for k in missing) + "\n")
    return lines
