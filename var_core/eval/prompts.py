"""Prompt sets for text-to-image studies, read from the files the evaluators publish.

``load_prompt_set(path)`` returns a :class:`PromptSet`: the prompts in file order, each with its ``tag`` and
``category`` (``None`` where the format has none) and its source row (``metadata``). The format is detected from
the file name and its content (``fmt=`` forces one):

* ``text`` — plain text, one prompt per line. Blank lines and lines whose first character is ``#`` are skipped
  (so a file can carry a comment header); surrounding white space is stripped.
* ``geneval`` — GenEval's ``evaluation_metadata.jsonl``: one JSON object per line with ``prompt``, ``tag`` (its
  task: ``single_object``, ``two_object``, ``counting``, ``colors``, ``position``, ``color_attr``) and
  ``include`` (the objects its detector checks). The whole object is kept as ``metadata``: the exporter
  (:mod:`var_core.eval.export`) writes it back as the sample folder's ``metadata.jsonl``, which is what GenEval's
  evaluator reads. A ``.jsonl`` of objects with only ``prompt`` (and optionally ``tag`` / ``category``) reads the
  same way and is reported as format ``jsonl``.
* ``csv`` — DPG-Bench's ``dpg_bench.csv`` (columns ``item_id, text, …, category_broad``; its several question rows
  of one item are one prompt, in order of first appearance), DrawBench-style CSV (``Prompts, Category``), or any
  CSV / TSV with a prompt column (``prompt``, ``prompts``, ``text``, ``caption``; case-insensitive) and optionally
  ``category`` / ``category_broad`` and ``tag`` columns.
* ``coco`` — COCO captions JSON (``captions_val2014.json``: ``images`` + ``annotations``): one prompt per image,
  images in file order, each with its first caption (lowest annotation id). ``coco_captions="all"`` keeps every
  caption as its own prompt instead (RECONSTRUCTED choice: papers reporting COCO FID-30K differ on this; the
  option selects the alternative). ``metadata`` keeps ``image_id`` and ``file_name``.
* ``mjhq`` — MJHQ-30K's ``meta_data.json`` (``{image_id: {"prompt", "category"}}``), in file order; ``metadata``
  keeps the image id.
* ``json`` — a JSON list of prompt strings, or of objects with ``prompt`` (and optionally ``tag``, ``category``).

A ``path`` that does not exist but names a prompt file shipped with varscope (``demo``: our own eight-prompt set,
in ``var_core/data/prompts/``) reads that file. Nothing here ships or downloads prompts written by others.
Every problem with a file is a :class:`~var_core.errors.UserError` naming the file (and the line, for JSONL and
CSV): an unreadable file, a NUL byte (a binary or UTF-16 file), JSON that is invalid or nested too deeply, a CSV
quote left open, a prompt that is not text, a tag or category that is not a plain value.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError, did_you_mean

__all__ = ["PromptSet", "load_prompt_set", "with_rewritten_prompts", "FORMATS", "BUILTIN_DIR", "builtin_prompt_sets"]

FORMATS = ("text", "geneval", "jsonl", "csv", "coco", "mjhq", "json")
BUILTIN_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"

_PROMPT_COLUMNS = ("prompt", "prompts", "text", "caption", "sentence")
_CATEGORY_COLUMNS = ("category", "category_broad", "categories", "class")
_TAG_COLUMNS = ("tag", "task")
_ID_COLUMNS = ("item_id", "prompt_id", "id")


@dataclass(frozen=True, eq=False)
class PromptSet:
    """Prompts in file order with their tag, category and source row; ``source`` is the file, ``format`` how it was
    read (one of :data:`FORMATS`), ``sha256`` the hash of its bytes (recorded with a study's samples)."""

    prompts: tuple[str, ...]
    tags: tuple[str | None, ...]
    categories: tuple[str | None, ...]
    metadata: tuple[dict, ...]
    source: str
    format: str
    sha256: str
    rewritten: dict | None = None  # --prompts-rewritten: {"file", "sha256", "prompts"} (with_rewritten_prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def conditions(self, num_samples: int | None = None, base_seed: int = 0):
        """The :class:`~var_core.eval.lightning.ConditionSet` of ``num_samples`` samples (sample ``i`` uses prompt
        ``i mod P``; ``None``: one per prompt)."""
        from .lightning import ConditionSet

        return ConditionSet.from_prompts(self.prompts, num_samples, base_seed, tags=self.tags,
                                         categories=self.categories)

    def geneval_metadata(self, index: int) -> dict:
        """The line GenEval's evaluator reads for prompt ``index``: the source object for a GenEval file, else
        ``prompt`` with the ``tag`` / ``category`` we know."""
        if self.format == "geneval":
            return dict(self.metadata[index])
        out: dict[str, Any] = {"prompt": self.prompts[index]}
        if self.tags[index] is not None:
            out["tag"] = self.tags[index]
        if self.categories[index] is not None:
            out["category"] = self.categories[index]
        return out

    def describe(self) -> dict:
        """What a study records about the prompt file."""
        counts: dict[str, int] = {}
        for c in self.categories:
            if c is not None:
                counts[c] = counts.get(c, 0) + 1
        tags: dict[str, int] = {}
        for t in self.tags:
            if t is not None:
                tags[t] = tags.get(t, 0) + 1
        return {"source": self.source, "format": self.format, "sha256": self.sha256, "prompts": len(self),
                "categories": counts or None, "tags": tags or None, "rewritten": self.rewritten}


def with_rewritten_prompts(prompt_set: PromptSet, path: str | Path) -> PromptSet:
    """``prompt_set`` generating from the rewritten prompts of ``path`` (one per line, or a ``.jsonl`` of objects
    with ``prompt``), line ``i`` for prompt ``i``; the metadata (GenEval's ``evaluation_metadata`` rows, which its
    evaluator scores against), tags and categories stay the original's. varscope never rewrites prompts itself:
    Infinity's GenEval numbers with its prompt rewriter differ from those without (Infinity issue #16)."""
    import hashlib

    p = Path(path).expanduser()
    try:
        raw = p.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--prompts-rewritten {p}: cannot read it as UTF-8 text ({type(exc).__name__})") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if p.suffix == ".jsonl":
        rewritten = []
        for n, ln in enumerate(lines, 1):
            try:
                row = json.loads(ln)
            except ValueError:
                raise UserError(f"--prompts-rewritten {p}, line {n}: not JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UserError(f"--prompts-rewritten {p}, line {n}: expected an object with a 'prompt' string")
            rewritten.append(row["prompt"])
    else:
        rewritten = [ln.strip() for ln in lines]
    if len(rewritten) != len(prompt_set):
        raise UserError(f"--prompts-rewritten {p} has {len(rewritten)} prompts, --prompts {prompt_set.source} has "
                        f"{len(prompt_set)}: give one rewritten prompt per metadata row, in the same order")
    info = {"file": str(p), "sha256": hashlib.sha256(raw).hexdigest(), "prompts": len(rewritten),
            "changed": sum(a != b for a, b in zip(rewritten, prompt_set.prompts))}
    return dataclasses.replace(prompt_set, prompts=tuple(rewritten), rewritten=info)


def builtin_prompt_sets() -> dict[str, Path]:
    """Prompt files shipped with varscope, by name (file stem)."""
    if not BUILTIN_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(BUILTIN_DIR.iterdir()) if p.suffix in (".txt", ".jsonl", ".csv", ".json")}


def _resolve(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if p.is_file():
        return p
    shipped = builtin_prompt_sets()
    if str(path) in shipped:
        return shipped[str(path)]
    if p.is_dir():
        raise UserError(f"--prompts {path} is a folder: give the prompt file itself (e.g. "
                        f"{p / 'evaluation_metadata.jsonl'})")
    hint = ""
    if p.parent.is_dir():
        hint = did_you_mean(p.name, [q.name for q in p.parent.iterdir()])
    raise UserError(f"prompt file {path} does not exist.{hint} Give a prompt file (plain text, GenEval "
                    f"evaluation_metadata.jsonl, CSV, COCO captions JSON or MJHQ meta_data.json) or a shipped set: "
                    f"{', '.join(shipped) or 'none'}")


def load_prompt_set(path: str | Path, fmt: str | None = None, *, coco_captions: str = "first") -> PromptSet:
    """Read a prompt file (see the module docstring for the formats); ``fmt`` forces a format."""
    if fmt is not None and fmt not in FORMATS:
        raise UserError(f"unknown prompt format {fmt!r}.{did_you_mean(fmt, FORMATS)} Formats: {', '.join(FORMATS)}")
    if coco_captions not in ("first", "all"):
        raise UserError(f"coco_captions must be 'first' or 'all', got {coco_captions!r}")
    file = _resolve(path)
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise UserError(f"prompt file {file} cannot be read ({exc.strerror or exc}): check its permissions, or "
                        f"copy it somewhere readable") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"prompt file {file} is not UTF-8 text ({exc}); save it as UTF-8") from None
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise UserError(f"prompt file {file}, line {line}: contains a NUL byte, so it is a binary file or UTF-16 "
                        f"text, not a prompt file; save it as UTF-8 text")
    fmt = fmt or _detect(file, text)
    readers = {"text": _read_text, "geneval": _read_jsonl, "jsonl": _read_jsonl, "csv": _read_csv,
               "coco": lambda f, t: _read_coco(f, t, coco_captions), "mjhq": _read_mjhq, "json": _read_json_list}
    rows, fmt = readers[fmt](file, text)
    if not rows:
        raise UserError(f"prompt file {file} holds no prompts (read as {fmt}): give a file with at least one prompt")
    prompts, tags, categories, metadata = [], [], [], []
    for n, row in enumerate(rows):
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"prompt file {file}: entry {n + 1} has no prompt text ({_short(row)})")
        if "\x00" in prompt:  # a JSON escape (\u0000): no tokenizer should see it
            raise UserError(f"prompt file {file}: entry {n + 1} has a NUL character in its prompt "
                            f"({_short(prompt)}); remove it")
        prompts.append(prompt.strip())
        tags.append(_opt(row.get("tag"), file, n, "tag"))
        categories.append(_opt(row.get("category"), file, n, "category"))
        metadata.append(row.get("metadata", {}))
    return PromptSet(tuple(prompts), tuple(tags), tuple(categories), tuple(metadata), str(file), fmt,
                     hashlib.sha256(raw).hexdigest())


def _opt(value, file: Path | None = None, n: int = 0, what: str = "value") -> str | None:
    """A tag or category as text (numbers are accepted: ``3`` -> ``"3"``); a list or object is an error."""
    if value is None:
        return None
    if isinstance(value, (dict, list)):
        raise UserError(f"prompt file {file}: entry {n + 1} has a {what} that is not a plain value "
                        f"({_short(value)}); give a string")
    value = str(value).strip()
    return value or None


def _json(text: str, file: Path, where: str = ""):
    """``json.loads`` whose failures are :class:`UserError` naming the file: invalid JSON, and JSON nested so deeply
    that the parser runs out of stack (``RecursionError``; no prompt file nests more than a few levels)."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UserError(f"prompt file {file}{where} is not valid JSON ({exc}): is it truncated? Fix or re-export "
                        f"it") from None
    except RecursionError:
        raise UserError(f"prompt file {file}{where}: JSON nested deeper than Python's parser allows (about "
                        f"1,000 levels; a prompt file needs three or four): a corrupt or hostile file, not prompts; "
                        f"give the prompt file itself") from None


def _short(value, n: int = 80) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= n else text[: n - 1] + "…"


def _detect(file: Path, text: str) -> str:
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return "geneval"
    if suffix in (".csv", ".tsv"):
        return "csv"
    if suffix == ".json":
        data = _json(text, file)
        if isinstance(data, dict) and "annotations" in data and "images" in data:
            return "coco"
        if isinstance(data, dict) and data and all(isinstance(v, dict) and "prompt" in v for v in data.values()):
            return "mjhq"
        if isinstance(data, list):
            return "json"
        raise UserError(f"prompt file {file}: JSON that is neither COCO captions (images + annotations), MJHQ-30K "
                        f"meta_data.json ({{id: {{prompt, category}}}}) nor a list of prompts (top-level keys: "
                        f"{sorted(data)[:6] if isinstance(data, dict) else type(data).__name__})")
    return "text"


def _read_text(file: Path, text: str):
    rows = [{"prompt": line.strip(), "metadata": {"line": n}}
            for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.lstrip().startswith("#")]
    return rows, "text"


def _read_jsonl(file: Path, text: str):
    rows, geneval = [], True
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise UserError(f"prompt file {file}, line {n}: not JSON ({exc}); a .jsonl file holds one JSON object "
                            f"per line (GenEval's evaluation_metadata.jsonl)") from None
        except RecursionError:
            obj = _json(line, file, f", line {n}")
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise UserError(f"prompt file {file}, line {n}: expected an object with a \"prompt\" (GenEval: prompt, "
                            f"tag, include), got {_short(obj)}")
        geneval = geneval and "include" in obj and "tag" in obj
        rows.append({"prompt": obj["prompt"], "tag": obj.get("tag"), "category": obj.get("category"),
                     "metadata": obj})
    return rows, "geneval" if geneval and rows else "jsonl"


def _column(fields: list[str], names: tuple[str, ...]) -> str | None:
    lowered = {f.strip().lower(): f for f in fields}
    return next((lowered[n] for n in names if n in lowered), None)


def _read_csv(file: Path, text: str):
    dialect = "excel-tab" if file.suffix.lower() == ".tsv" else "excel"
    # strict: a quoted field left open at the end of the file, or text after a closing quote, is a csv.Error
    reader = csv.DictReader(io.StringIO(text), dialect=dialect, strict=True)
    rows: list[tuple[int, int, dict]] = []  # (first line, last line, row): a quoted field may span lines
    end = 0
    try:
        fields = reader.fieldnames or []
        end = reader.line_num
        for row in reader:
            rows.append((end + 1, reader.line_num, row))
            end = reader.line_num
    except csv.Error as exc:
        raise UserError(f"prompt file {file}, line {end + 1}: not valid CSV ({exc}): a quote opened and never "
                        f"closed, or text after a closing quote? Inside a quoted field write a quote twice (\"\"); "
                        f"fix the line") from None
    return _csv_prompts(file, fields, rows)


def _csv_prompts(file: Path, fields: list[str], lines_rows: list):
    prompt_col = _column(fields, _PROMPT_COLUMNS)
    if prompt_col is None:
        raise UserError(f"prompt file {file}: no prompt column among {fields}; name it one of "
                        f"{', '.join(_PROMPT_COLUMNS)} (DPG-Bench: text, DrawBench: Prompts)")
    cat_col, tag_col, id_col = (_column(fields, _CATEGORY_COLUMNS), _column(fields, _TAG_COLUMNS),
                                _column(fields, _ID_COLUMNS))
    rows, seen = [], set()
    for start, end, row in lines_rows:
        prompt = (row.get(prompt_col) or "").strip()
        if "\n" in prompt or "\r" in prompt:  # a quote opened on one line and closed lines later
            raise UserError(f"prompt file {file}, line {start}: the prompt runs over lines {start}-{end} (a quoted "
                            f"field that swallows the lines after it: a quote opened and closed only on a later "
                            f"line?); close the quote on line {start}, or write a quote inside a quoted field twice "
                            f"(\"\")")
        if not prompt:
            continue
        if id_col is not None:  # DPG-Bench: one row per question, several per prompt
            key = (row.get(id_col) or "").strip()
            if key and key in seen:
                continue
            seen.add(key)
        rows.append({"prompt": prompt, "category": row.get(cat_col) if cat_col else None,
                     "tag": row.get(tag_col) if tag_col else None,
                     "metadata": {k: v for k, v in row.items() if k is not None}})
    return rows, "csv"


def _read_coco(file: Path, text: str, captions: str):
    data = _json(text, file)
    if not isinstance(data, dict):
        raise UserError(f"prompt file {file}: COCO captions JSON is an object with images and annotations, got "
                        f"{type(data).__name__}")
    images, annotations = data.get("images") or [], data.get("annotations") or []
    for key, value in (("images", images), ("annotations", annotations)):
        if not isinstance(value, list):
            raise UserError(f"prompt file {file}: COCO {key!r} must be a list of objects, got "
                            f"{type(value).__name__} ({_short(value)})")
    by_image: dict[Any, list[dict]] = {}
    for n, ann in enumerate(annotations):
        if not isinstance(ann, dict):
            raise UserError(f"prompt file {file}: COCO annotation {n + 1} is not an object ({_short(ann)}); each is "
                            f"{{\"id\", \"image_id\", \"caption\"}}")
        if "caption" in ann and "image_id" in ann:
            if not isinstance(ann["caption"], str):
                raise UserError(f"prompt file {file}: COCO annotation {n + 1} has a caption that is not text "
                                f"({_short(ann['caption'])}); captions are strings")
            if isinstance(ann["image_id"], (dict, list)):
                raise UserError(f"prompt file {file}: COCO annotation {n + 1} has an image_id that is not a plain "
                                f"value ({_short(ann['image_id'])})")
            by_image.setdefault(ann["image_id"], []).append(ann)
    rows = []
    for n, image in enumerate(images):
        if not isinstance(image, dict) or isinstance(image.get("id"), (dict, list)):
            raise UserError(f"prompt file {file}: COCO image {n + 1} is not an object with an id ({_short(image)})")
        anns = sorted(by_image.get(image.get("id"), []), key=_annotation_order)
        for ann in anns if captions == "all" else anns[:1]:
            rows.append({"prompt": ann["caption"], "metadata": {"image_id": image.get("id"),
                                                                "file_name": image.get("file_name"),
                                                                "annotation_id": ann.get("id")}})
    return rows, "coco"


def _annotation_order(ann: dict):
    """Lowest annotation id first; numeric ids before any other (a file mixing ids 1 and "x" stays sortable)."""
    key = ann.get("id", 0)
    return (0, key, "") if isinstance(key, (int, float)) and not isinstance(key, bool) else (1, 0, str(key))


def _read_mjhq(file: Path, text: str):
    data = _json(text, file)
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise UserError(f"prompt file {file}: MJHQ-30K meta_data.json is {{image_id: {{prompt, category}}}}, got "
                        f"{_short(data)}")
    rows = [{"prompt": v.get("prompt"), "category": v.get("category"), "metadata": {"image_id": k, **v}}
            for k, v in data.items()]
    return rows, "mjhq"


def _read_json_list(file: Path, text: str):
    data = _json(text, file)
    if not isinstance(data, list):
        raise UserError(f"prompt file {file}: expected a JSON list of prompts, got {type(data).__name__}")
    rows = []
    for n, item in enumerate(data):
        if isinstance(item, str):
            rows.append({"prompt": item, "metadata": {}})
        elif isinstance(item, dict):
            rows.append({"prompt": item.get("prompt"), "tag": item.get("tag"), "category": item.get("category"),
                         "metadata": item})
        else:
            raise UserError(f"prompt file {file}: item {n + 1} is neither a prompt string nor an object with "
                            f"\"prompt\" ({_short(item)})")
    return rows, "json"
