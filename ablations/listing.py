"""What ``varscope ls`` / ``python -m studies.ablate ls [TOPIC]`` prints, and the summary of a finished study.

Topics (:data:`LS_TOPICS`): ``families`` (each with the paper table it reproduces, its arms and analysis),
``components`` (per registry), ``presets`` (each preset's full description and its resolved setting per model
family), ``metrics`` (:func:`var_core.eval.metric_registry.describe_metrics`: can each run with the weights given)
and ``models`` (every zoo entry: what it is, the files it needs, its scale schedule and token count, read from the
zoo's specs and the fixtures' ``config.json`` — nothing is loaded). :func:`listing` returns the text;
:func:`study_summary` is what ``studies.ablate FAMILY`` prints after a study (the table, counts and the files).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from .model_key import model_schedule, study_model_key  # noqa: F401 - re-exported (ls models)

LS_TOPICS = ("families", "components", "presets", "metrics", "models")


def families_lines() -> list[str]:
    from ablations.base import build_arms, family_info, family_names

    lines = ["Ablation families (python -m studies.ablate FAMILY):"]
    for name in family_names():
        info = family_info(name)
        lines.append(f"  {name:<11} {info.doc}{_origin('family', name)}")
        lines.append(f"  {'':<11} reproduces: {info.table or 'no paper table (beyond the papers)'}")
        try:
            arms = build_arms(name)
            bad = [a for a in arms if not a.ok]
            lines.append(f"  {'':<11} arms: {', '.join(a.name for a in arms)}")
            for arm in bad:
                lines.append(f"  {'':<11} unavailable: {arm.name}: {arm.error}")
        except Exception as exc:  # noqa: BLE001 - reported, the listing goes on
            lines.append(f"  {'':<11} ERROR building arms: {exc}")
        if info.analysis is not None:
            doc = (info.analysis.__doc__ or "").strip().splitlines()
            lines.append(f"  {'':<11} analysis: {doc[0] if doc else info.analysis.__name__}")
    return lines


def components_lines() -> list[str]:
    from var_core.accel.registry import REGISTRIES

    lines = ["Components per registry:"]
    for kind, registry in REGISTRIES.items():
        lines.append(f"  {kind}:")
        for name in registry.names():
            lines.append(f"    {name:<20} {registry.summary(name)}{_origin(kind, name)}")
    return lines


def presets_lines() -> list[str]:
    """Each preset's whole docstring (not its first line) and, where presets resolve per model, the setting used on
    each family."""
    from var_core.accel import presets

    resolved = getattr(presets, "resolved_settings", None)
    from var_core.plugins import load_plugins

    load_plugins()
    lines = ["Presets (python -m studies.ablate method runs them all):"]
    for name, fn in presets.PRESETS.items():
        doc = inspect.cleandoc(fn.__doc__ or "").splitlines() or [""]
        lines.append(f"  {name}{_origin('preset', name)}")
        lines += [f"      {line}".rstrip() for line in doc]
        if resolved is not None:
            try:
                settings = resolved(name)
            except Exception as exc:  # noqa: BLE001 - reported, the listing goes on
                settings = {"*": f"cannot resolve: {type(exc).__name__}: {exc}"}
            lines.append("      resolved setting per model family:")
            lines += [f"        {family}: {text}" for family, text in settings.items()]
        lines.append("")
    return lines


def metrics_lines(args=None) -> list[str]:
    """Every metric (var_core.eval.metric_registry): direction, proxy flag, weights source, what enables it and
    whether it can run with the weights given on this command line (``args``: the parsed options, or None)."""
    from var_core.eval.metric_registry import describe_metrics

    return list(describe_metrics(args))


# ----- models ------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fixture(name: str):
    """``(folder, environment variable)`` of an official-code fixture entry, else None."""
    from var_core import zoo

    return {"official-tiny": (zoo.default_fixture_dir, "VARSCOPE_VAR_FIXTURE"),
            "official-infinity-tiny": (zoo.default_infinity_fixture_dir, "VARSCOPE_INFINITY_FIXTURE"),
            "official-hart-tiny": (zoo.default_hart_fixture_dir, "VARSCOPE_HART_FIXTURE")}.get(name)


def model_weights(name: str) -> str:
    """The files zoo entry ``name`` needs, in words (what ``--weights`` must hold, the text encoder)."""
    from var_core import zoo

    base = name.removeprefix("random:")
    spec = zoo.ZOO[base]
    fixture = _fixture(base)
    if zoo.is_testbed(base):
        folder = zoo.testbed_folder(base).relative_to(zoo.TESTBED_DIR.parents[2])
        return f"shipped in {folder.as_posix()}/ (nothing to download)"
    if fixture is not None:
        folder, env = fixture
        where = folder()
        state = "found" if (where / "config.json").is_file() else "not found"
        return f"the official-code fixture folder: --weights DIR, default ${env} or {where} ({state})"
    if spec.family == "hart":
        hart = zoo.HART_SPECS[base]
        if not hart.needs_text_encoder:
            return f"none: use random:{base} (seeded random weights, random text encoder)"
        return (f"--weights: the {base}-1024px folder (llm/ with {zoo.HART_EMA_FILE} preferred, tokenizer/); text "
                f"encoder: a {zoo.HART_TEXT_DIR_NAME} folder (--text-encoder, beside the weights, or "
                f"${zoo.HART_TEXT_ENV})")
    transformer, vae = zoo.accepted_file_names(base)
    files = " or ".join(transformer) + (" (a folder of shards)" if base in zoo.SHARDED_ENTRIES else "")
    text = f"--weights DIR holding {files} + {' or '.join(vae)}"
    if spec.family == "infinity":
        inf = zoo.INFINITY_SPECS[base]
        if not inf.needs_t5:
            return f"none: use random:{base} (or {text})"
        text += (f"; text encoder: a flan-t5-xl folder (--text-encoder, beside the weights, ${zoo.T5_ENV} or the "
                 f"Hugging Face cache)")
    return text


def model_rows() -> list[dict]:
    """One row per zoo entry: ``name``, ``family``, ``description``, ``weights`` (:func:`model_weights`),
    ``schedule`` (:func:`model_schedule`) and ``tokens`` (Σ h·w over the scales; None without a schedule)."""
    from var_core import zoo

    rows = []
    for name, spec in zoo.ZOO.items():
        schedule = model_schedule(name)
        rows.append({"name": name, "family": spec.family, "description": spec.description,
                     "weights": model_weights(name), "schedule": schedule,
                     "tokens": sum(h * w for h, w in schedule) if schedule else None})
    return rows


def _schedule_text(schedule) -> str:
    if not schedule:
        return "read from the fixture's config.json (not found)"
    square = all(h == w for h, w in schedule)
    sides = " ".join(str(h) if square else f"{h}x{w}" for h, w in schedule)
    return f"{len(schedule)} scales, {'sides ' if square else ''}{sides}"


def models_lines(width: int = 118) -> list[str]:
    """Per entry: name, family and description, then ``weights:`` and ``schedule:`` lines (wrapped at ``width``)."""
    import textwrap

    indent = " " * 35
    lines = ["Models (--model NAME; random:NAME: the same architecture with seeded random weights, no files):"]
    for row in model_rows():
        tokens = f", {row['tokens']} tokens" if row["tokens"] else ""
        for first, text in ((f"  {row['name']:<22} {row['family']:<9} ", row["description"]),
                            (indent, f"weights: {row['weights']}"),
                            (indent, f"schedule: {_schedule_text(row['schedule'])}{tokens}")):
            lines += textwrap.wrap(text, width, initial_indent=first, subsequent_indent=indent + "  ",
                                   break_on_hyphens=False)
    return lines


def _origin(kind: str, name: str) -> str:
    """`` [plugin LABEL]`` for an entry a plugin registered (var_core.plugins), else ``''`` (built-in)."""
    from var_core.plugins import origin

    where = origin(kind, name)
    return "" if where == "built-in" else f"  [{where}]"


def plugins_lines() -> list[str]:
    """The plugin modules loaded (entry points ``varscope.plugins``, ``--plugins`` / ``$VARSCOPE_PLUGINS``)."""
    from var_core.plugins import load_plugins

    loaded = load_plugins()
    if not loaded:
        return ["Plugins: none loaded (every entry below is built-in)"]
    lines = ["Plugins loaded (entries they registered are marked [plugin NAME]; the others are built-in):"]
    for p in loaded:
        version = f" {p['distribution']} {p['version']}" if p.get("version") else ""
        lines.append(f"  {p['name']:<20} {p['source']}{version}  module {p['module']}  sha256 {p['sha256'][:16]}  "
                     f"{p.get('path') or ''}".rstrip())
    return lines


def listing(topic: str | None = None, args=None) -> str:
    """The text of ``ls`` (every topic, a blank line between them) or ``ls TOPIC``; an unknown topic is a
    :class:`~var_core.errors.UserError` with a did-you-mean."""
    from var_core.errors import UserError, did_you_mean

    if topic is not None and topic not in LS_TOPICS:
        raise UserError(f"unknown ls topic {topic!r}.{did_you_mean(topic, LS_TOPICS)} Topics: {', '.join(LS_TOPICS)}")
    makers = {"families": families_lines, "components": components_lines, "presets": presets_lines,
              "metrics": lambda: metrics_lines(args), "models": models_lines}
    text = "\n\n".join("\n".join(makers[t]()) for t in LS_TOPICS if topic in (None, t))
    return "\n".join(plugins_lines()) + "\n\n" + text if topic is None or load_plugins_any() else text


def load_plugins_any() -> bool:
    from var_core.plugins import load_plugins

    return bool(load_plugins())


# ----- the summary of a finished study ---------------------------------------------------------------------------
def study_summary(result, options) -> str:
    """What ``studies.ablate FAMILY`` prints when the study is done: the results table of ``table.md``, arms
    computed / reused / unavailable, and where every output went (``result``: ``ablations.runner.run_study``'s,
    ``options``: its :class:`~ablations.runner.StudyOptions`)."""
    lines = [""]
    table = result.out_dir / "table.md"
    if table.is_file():
        text = table.read_text().splitlines()
        start = next((i for i, line in enumerate(text) if line.startswith("| arm")), None)
        if start is not None:
            end = start
            while end < len(text) and text[end].startswith("|"):
                end += 1
            lines += text[start:end] + [""]
        # var_core.eval.activity: components that never acted, said where the user reads the result
        lines += [line for line in text if line.startswith("Components that never acted")]
    o = result.outputs
    lines.append(f"done in {result.seconds:.1f} s: {len(result.computed)} arms computed, {len(result.reused)} reused"
                 + (f", {len(result.unavailable)} unavailable" if result.unavailable else ""))
    lines.append(f"results folder : {result.out_dir}")
    lines.append(f"  manifest     : {result.out_dir / 'study.json'}")
    lines.append(f"  arm records  : {result.out_dir / 'arms'}/*.json ({len(result.records)})")
    lines.append(f"  table        : {o.get('markdown')}  and  {o.get('csv')}")
    lines += [f"  plot         : {path}" for path in (o.get("plots") or {}).values()]
    grids = o.get("grids") or {}
    if grids:
        lines.append(f"  sample grids : {result.out_dir / 'grids'} ({len(grids)} files; overview.png: one row per "
                     f"arm, same seeds)")
    if options.save_images is not None:
        from ablations.runner import images_root

        lines.append(f"  images       : {images_root(options.save_images, result.out_dir) / 'images'}/<arm>/ (flat/, "
                     f"geneval/ or samples.npz, samples.jsonl)")
    if o.get("wandb"):
        lines.append(f"  W&B ({options.wandb}) : {o['wandb']}" + ("  (sync later: wandb sync " + o["wandb"] + ")"
                                                                 if options.wandb == "offline" else ""))
    elif o.get("wandb_error"):
        lines.append(f"  W&B          : failed ({o['wandb_error']})")
    else:
        lines.append("  W&B          : disabled")
    return "\n".join(lines)
