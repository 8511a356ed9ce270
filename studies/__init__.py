"""The ``python -m studies.X`` entry points (see :mod:`studies.cli` for ``varscope COMMAND``)."""

import sys

if sys.argv[:1] == ["-m"]:  # python -m studies.X: argv[0] is "-m" while the module is being found
    from var_core.errors import guard_imports

    guard_imports()  # Ctrl-C while torch & co. load exits 130 at once; run_cli ends the guard
