"""Studies as files: ``--config study.yaml|json`` and ``--print-config`` for any argparse parser (the ``ablate``,
``sweep`` and ``sensitivity`` commands), as LightningCLI users expect.

A study file is a mapping of option names (the dest, ``batch_size``, or the long name, ``batch-size`` / ``param``)
and positional argument names to values; :func:`parse_with_config` turns it into the command-line words of those
options, placed before the user's, so that flags given on the command line override the file. YAML (of which JSON
is a subset) is read with PyYAML's ``safe_load``. :func:`format_config` writes the resolved study back.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from var_core.errors import UserError, did_you_mean

#: options that are about the invocation itself, never part of a study file
_NOT_IN_CONFIG = {"help", "config", "print_config"}


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` (a study as a file: JSON or YAML, every option; flags on the command line override it)
    and ``--print-config`` (write the resolved study as YAML and exit), as LightningCLI users expect."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read the study's options from a YAML or JSON file (keys: the option names, e.g. "
                        "batch_size or batch-size, and the positional arguments' names); flags given on the command "
                        "line override the file. 'COMMAND ... --print-config > study.yaml' writes one")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved options (file, then flags, then defaults) as YAML and exit without "
                        "running; '--config' of that output runs the same study")


def _config_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in _NOT_IN_CONFIG and a.dest != argparse.SUPPRESS}


def _config_aliases(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a study file may use for an option: its dest (``params``) and its long name (``param``)."""
    out = dict(_config_actions(parser))
    for action in list(out.values()):
        for name in action.option_strings:
            if name.startswith("--"):
                out.setdefault(name[2:].replace("-", "_"), action)
    return out


def read_config(path: str) -> dict:
    """The mapping a study file holds (YAML, of which JSON is a subset); one-line errors for a missing file, a
    parse error or a file that is not a mapping."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        hint = did_you_mean(file.name, [q.name for q in file.parent.iterdir()]) if file.parent.is_dir() else ""
        raise UserError(f"--config {path}: no such file.{hint}")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        reason = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise UserError(f"--config {path}: not valid YAML or JSON{line}: {reason}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option names to values (e.g. samples: 64), got "
                        f"a {type(data).__name__}")
    return data


def _option_string(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _tokens_of(action: argparse.Action, value, path: str) -> list[str]:
    """The command-line words that give ``action`` the file's ``value``."""
    name = _option_string(action)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise UserError(f"--config {path}: {action.dest} must be true or false, got {value!r}")
        return [name] if value != action.default else []
    if value is None:
        return []
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    if many:
        values = value if isinstance(value, (list, tuple)) else [value]
        if isinstance(action, argparse._AppendAction):
            return [word for v in values for word in (name, str(v))]
        return [name, *map(str, values)] if values else []
    if action.nargs == "?" and value is True and action.const is True:
        return [name]
    if isinstance(value, (list, tuple)):  # GPU indices: 0,1 (a single index keeps its comma: 3, is GPU 3)
        return [name, ",".join(map(str, value)) + ("," if len(value) == 1 else "")]
    if isinstance(value, dict):
        raise UserError(f"--config {path}: {action.dest} takes a single value, got a mapping")
    return [name, str(value).lower() if isinstance(value, bool) else str(value)]


def _given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[set[str], int]:
    """The dests of the options the command line gives, and how many positional words it has."""
    by_string = {s: a for a in parser._actions for s in a.option_strings}
    given: set[str] = set()
    positionals = 0
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            positionals += len(argv) - i - 1
            break
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            name = word.split("=", 1)[0]
            action = by_string.get(name) or next((a for s, a in by_string.items() if s.startswith(name)), None)
            i += 1
            if action is None:
                continue
            given.add(action.dest)
            if "=" in word or action.nargs == 0:
                continue
            if action.nargs in (None, 1):
                i += 1
            else:  # ?, +, *: the following words that are not options
                while i < len(argv) and not (argv[i].startswith("-") and not _is_number(argv[i])):
                    i += 1
                    if action.nargs == "?":
                        break
            continue
        positionals += 1
        i += 1
    return given, positionals


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--config FILE`` read first: every key of the file becomes the words of its
    option (a positional's key: its value, unless the command line gives positionals), placed before the command
    line's words, so a flag on the command line wins (a repeatable option given there replaces the file's list).
    An unknown key is one error line with a did-you-mean. The caller prints :func:`format_config` and stops when
    ``args.print_config``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config", default=None)
    known, _ = probe.parse_known_args([w for w in argv if w not in ("-h", "--help")])
    words: list[str] = []
    if known.config:
        data = read_config(known.config)
        actions = _config_aliases(parser)
        given, positional_words = _given_on_command_line(parser, argv)
        leading: dict[str, str] = {}
        for raw_key, value in data.items():
            key = str(raw_key).lstrip("-").replace("-", "_")
            action = actions.get(key)
            if action is None:
                keys = sorted(_config_actions(parser))
                raise UserError(f"--config {known.config}: unknown key {raw_key!r}.{did_you_mean(key, keys)} Keys: "
                                f"{', '.join(keys)}")
            if not action.option_strings:  # a positional argument
                if value is not None and positional_words == 0:
                    leading[action.dest] = str(value)
                continue
            if action.dest in given:
                continue  # the command line gives it
            words += _tokens_of(action, value, known.config)
        order = [a.dest for a in parser._actions if not a.option_strings and a.dest in leading]
        argv = [leading[dest] for dest in order] + words + argv
    return parser.parse_args(argv)


def config_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The resolved study: every option and positional of ``parser`` with its value (given or default)."""
    out = {}
    for dest in _config_actions(parser):
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        out[dest] = list(value) if isinstance(value, tuple) else value
    return out


def format_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """:func:`config_of` as YAML (``--config`` reads it back)."""
    import yaml

    header = f"# {parser.prog} --config FILE: a study as a file (flags on the command line override it)\n"
    return header + yaml.safe_dump(config_of(parser, args), sort_keys=False, default_flow_style=None)
