"""The results folder's per-arm sample spool (issue 26): where an arm's batches go while it is generated.

``arms/<slug>.partial/`` (:mod:`var_core.eval.store`) receives each finished batch as it finishes, so a study
holds one batch at a time while generating, and a study killed in the middle of an arm resumes at the arm's next
unfinished batch: the finished ones are read back, not generated again, and the records equal an uninterrupted
run's. The spool's ``key.json`` is the arm's record key; a spool of another configuration (other samples,
sampling, batch size, policy ...) is never resumed: it is removed and the arm starts from its first batch. Once
the arm's record and tensor file are written, its spool is removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from var_core.eval import records as rec
from var_core.eval.store import finished_batches, first_index, read_spool_key, write_spool_key

__all__ = ["spool_path", "open_spool", "close_spool"]


def spool_path(out_dir: str | Path, arm: str) -> Path:
    return Path(out_dir) / "arms" / f"{rec.arm_slug(arm)}.partial"


def open_spool(out_dir: str | Path, arm: str, key, batches_total: int, log: Callable[[str], None]
               ) -> tuple[Path, list[int]]:
    """The arm's spool folder, ready for generation, and the first indices of its finished batches (resumed)."""
    folder = spool_path(out_dir, arm)
    rec.check_no_links(folder, out_dir)
    key = rec.to_jsonable(key)
    if folder.is_dir():
        stored = read_spool_key(folder)
        done = finished_batches(folder)
        if stored == key and done:
            log(f"    resuming inside the arm: {len(done)} of {batches_total} batches were finished by an earlier "
                f"run (read back from {folder.name}/, not generated again)")
            return folder, [first_index(n) for n in done]
        if stored != key and done:
            log(f"note: {folder.name}/ holds {len(done)} unfinished batches of another configuration: removed, "
                f"the arm starts from its first batch")
        shutil.rmtree(folder)
    rec.make_dirs(folder, out_dir)
    write_spool_key(folder, key)
    return folder, []


def close_spool(out_dir: str | Path, arm: str) -> None:
    """Remove the arm's spool once its record and tensor file are written."""
    folder = spool_path(out_dir, arm)
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)
