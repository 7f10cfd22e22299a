"""One study at a time per output directory: a file lock that also works on shared filesystems.

Two studies in one ``out_dir`` would take each other's unfinished runs for interrupted ones and resume
or delete them. A study holds ``<out_dir>/.study.lock`` (``filelock``: flock, released by the OS when the
holder dies, so a lock is never stale) and writes who holds it into ``.study.lock.json`` beside it, for
the message the second study gets.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from lightning_maskprior.study.spec import StudyError

LOCK_NAME = ".study.lock"
OWNER_NAME = ".study.lock.json"  # host, pid and start time of the holder (the lock file itself stays empty)


def lock_owner(out_dir: Path) -> dict:
    """Who holds (or last held) the lock of ``out_dir``: ``{"host", "pid", "started"}``, or {} if unknown."""
    try:
        owner = json.loads((Path(out_dir) / OWNER_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


@contextlib.contextmanager
def study_lock(out_dir: Path):
    """Hold ``<out_dir>/.study.lock`` while a study runs there; a second study fails at once naming the first."""
    from filelock import FileLock, Timeout

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    lock = FileLock(path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        owner = lock_owner(out_dir)
        who = (f"host {owner.get('host', '?')}, process {owner.get('pid', '?')}, started at "
               f"{owner.get('started', '?')}") if owner else "its owner file is not written yet"
        raise StudyError(
            f"another study ({who}) is running in {out_dir}; wait for it to finish or stop it, or give this one "
            f"another --out_dir (lock file: {path})"
        ) from None
    owner_path = out_dir / OWNER_NAME
    tmp = owner_path.with_name(f"{OWNER_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}) + "\n")
    tmp.replace(owner_path)
    try:
        yield path
    finally:
        owner_path.unlink(missing_ok=True)
        lock.release()
