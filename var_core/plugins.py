"""Outside code: components, presets and families loaded from plugins, each named in every record.

Two ways in, as pytest plugins and lm-evaluation-harness ``--include_path`` taught users to expect:

* an installed distribution declares an entry point in the group ``varscope.plugins`` whose value names a module
  (``[project.entry-points."varscope.plugins"] mine = "my_package.scorers"``); the module is imported and
  registers what it defines with the ordinary decorators (``@SCORERS.register``, ``@preset``, ``@family``);
* ``--plugins PATH`` (any command; repeatable) or ``VARSCOPE_PLUGINS=PATH[:PATH...]`` names a ``.py`` file or a
  folder (its ``*.py`` files and packages, in name order) for quick experiments without installing anything.

Plugins load once per process, the first time a registry, the preset table or the family table is read
(:func:`load_plugins`); ``--plugins`` is put into the environment so DDP children load the same files.
:func:`loaded_plugins` describes each module loaded — name, source, distribution version, sha256 of its files —
and every record carries that list (``record["plugins"]``), so a result made with outside code says so.
:func:`origin` says where a registered name came from (``varscope ls`` marks every entry with it).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError

GROUP = "varscope.plugins"
ENV = "VARSCOPE_PLUGINS"

_LOADED: list[dict] = []  # one entry per plugin module imported (see loaded_plugins)
_ORIGINS: dict[tuple[str, str], str] = {}  # (kind, name) -> plugin label, for names a plugin registered
_STATE = {"loading": False, "done": False, "env": None}
_CURRENT: list[str] = []  # the plugin being imported (innermost last)


class PluginError(UserError):
    """A plugin that cannot be found or imported (a user error: one line, exit 2)."""


BUILT_IN_PACKAGES = ("var_core", "ablations", "sweeps", "studies", "profilers")


def note_registration(kind: str, name: str, module: str | None = None) -> None:
    """Called by the registries' decorators: remember which plugin (if any) is registering ``name``. ``module``:
    where the registered object is defined; the project's own modules are built-in even when a plugin's import
    triggered their loading."""
    if module is not None and module.split(".")[0] in BUILT_IN_PACKAGES:
        return
    if _CURRENT:
        _ORIGINS[(kind, name)] = _CURRENT[-1]


def origin(kind: str, name: str) -> str:
    """Where the registered ``kind`` ``name`` came from: ``built-in`` or ``plugin <label>``."""
    label = _ORIGINS.get((kind, name))
    return f"plugin {label}" if label else "built-in"


def _sha256_of(paths: list[Path]) -> str:
    """The file's sha256 (``sha256sum``); for a package, the sha256 of its files' names and contents in order."""
    if len(paths) == 1:
        return hashlib.sha256(paths[0].read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _module_files(module) -> list[Path]:
    """The source files of a module: its file, or every ``.py`` under a package's folder."""
    file = getattr(module, "__file__", None)
    if not file:
        return []
    path = Path(file)
    if path.name == "__init__.py":
        return sorted(p for p in path.parent.rglob("*.py") if "__pycache__" not in p.parts)
    return [path]


@contextmanager
def _registering(label: str):
    _CURRENT.append(label)
    try:
        yield
    finally:
        _CURRENT.pop()


def _entry_points():
    from importlib import metadata

    found = metadata.entry_points()
    if hasattr(found, "select"):
        return list(found.select(group=GROUP))
    return list(found.get(GROUP, ()))  # Python < 3.10


def _load_entry_point(ep) -> None:
    dist = getattr(ep, "dist", None)
    dist_name = getattr(dist, "name", None) or (dist.metadata["Name"] if dist is not None else None)
    label = f"{ep.name} ({ep.value})"
    with _registering(label):
        try:
            module = importlib.import_module(ep.value.split(":", 1)[0].strip())
        except Exception as exc:  # noqa: BLE001 - one line naming the plugin
            raise PluginError(f"plugin {ep.name!r} (entry point {GROUP} -> {ep.value}, distribution "
                              f"{dist_name or '?'}) failed to import: {type(exc).__name__}: {exc}; fix or uninstall "
                              f"it") from None
    files = _module_files(module)
    _LOADED.append({"name": ep.name, "module": module.__name__, "source": "entry point",
                    "distribution": dist_name, "version": getattr(dist, "version", None),
                    "path": str(files[0].parent if len(files) > 1 else files[0]) if files else None,
                    "sha256": _sha256_of(files) if files else None})


def _plugin_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    out = []
    for child in sorted(path.iterdir()):
        if child.name.startswith(("_", ".")):
            continue
        if child.suffix == ".py" or (child.is_dir() and (child / "__init__.py").is_file()):
            out.append(child)
    return out


def _load_path(text: str) -> None:
    path = Path(text).expanduser()
    if not path.exists():
        raise PluginError(f"plugin path {text!r} does not exist (--plugins / ${ENV} name a .py file or a folder "
                          f"of them)")
    if path.is_file() and path.suffix != ".py":
        raise PluginError(f"plugin file {text!r} is not a .py file (--plugins / ${ENV} name a .py file or a "
                          f"folder of them)")
    for item in _plugin_files(path.resolve()):
        file = item / "__init__.py" if item.is_dir() else item
        stem = item.name if item.is_dir() else item.stem
        name = "varscope_plugin_" + hashlib.sha1(str(item).encode()).hexdigest()[:8] + "_" + stem
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(
            name, file, submodule_search_locations=[str(item)] if item.is_dir() else None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with _registering(f"{item.name} ({item})"):
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - one line naming the file
                sys.modules.pop(name, None)
                raise PluginError(f"plugin {str(item)!r} failed to import: {type(exc).__name__}: {exc}") from None
        files = _module_files(module)
        _LOADED.append({"name": item.name, "module": name, "source": "path", "distribution": None,
                        "version": None, "path": str(item), "sha256": _sha256_of(files)})


def loading() -> bool:
    """True while a plugin module is being imported (registries then load their built-ins first, so a plugin
    that takes a built-in name is refused)."""
    return bool(_CURRENT)


def pending() -> bool:
    """True when plugins were loaded but ``$VARSCOPE_PLUGINS`` changed since (a later ``--plugins``)."""
    return _STATE["done"] and not _STATE["loading"] and _STATE["env"] != os.environ.get(ENV)


def plugin_paths() -> list[str]:
    return [p for p in (os.environ.get(ENV) or "").split(os.pathsep) if p.strip()]


def load_plugins() -> list[dict]:
    """Import every plugin once (entry points first, then ``$VARSCOPE_PLUGINS`` paths); a path added to the
    environment later (``--plugins`` after the first load) is loaded on the next call. Returns
    :func:`loaded_plugins`."""
    env = os.environ.get(ENV)
    if _STATE["loading"] or (_STATE["done"] and _STATE["env"] == env):
        return loaded_plugins()
    _STATE["loading"] = True
    try:
        if not _STATE["done"]:
            for ep in sorted(_entry_points(), key=lambda e: e.name):
                _load_entry_point(ep)
        for text in plugin_paths():
            _load_path(text)
        _STATE["done"], _STATE["env"] = True, env
    finally:
        _STATE["loading"] = False
    return loaded_plugins()


def loaded_plugins() -> list[dict]:
    """Each plugin module imported so far: name, module, source (entry point / path), distribution and version,
    path, sha256 of its source files. Empty when no outside code ran."""
    return [dict(p) for p in _LOADED]


def take_plugin_args(argv: list[str]) -> list[str]:
    """``argv`` without its ``--plugins PATH`` / ``--plugins=PATH`` options, whose paths are appended to
    ``$VARSCOPE_PLUGINS`` (read before argument parsing, so ``--method`` / ``--swap`` may name plugin code, and
    inherited by child processes)."""
    out, paths, i = [], [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--plugins":
            if i + 1 >= len(argv):
                raise PluginError("--plugins needs a path (a .py file or a folder of them)")
            paths.append(argv[i + 1])
            i += 2
            continue
        if word.startswith("--plugins="):
            paths.append(word.split("=", 1)[1])
        else:
            out.append(word)
        i += 1
    if paths:
        for text in paths:
            if not Path(text).expanduser().exists():
                raise PluginError(f"--plugins {text!r}: no such file or folder")
        current = plugin_paths()
        resolved = [str(Path(t).expanduser().resolve()) for t in paths]
        os.environ[ENV] = os.pathsep.join(current + [p for p in resolved if p not in current])
    return out
