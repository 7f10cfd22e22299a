"""A run's scalars in a file of its own, whatever loggers it has: ``<run dir>/scalars.csv``, one ``step,tag,value``
row per logged point, which ``run.scalars_logger.ScalarsLogger`` writes. ``read_scalars`` / ``last_scalars`` read
it back for studies, reports and tests, and read TensorBoard event files instead for a run that has no such file (one
recorded before it existed: ``read_event_scalars``). Nothing here imports Lightning.
"""

from __future__ import annotations

import csv
from pathlib import Path

SCALARS = "scalars.csv"
HEADER = ("step", "tag", "value")


def read_scalars_file(path: str | Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of one scalars file; a point logged twice keeps the later value, and a row that is
    not ``step,tag,value`` (a half-written last row) is skipped."""
    series: dict[str, dict[int, float]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.reader(f):
            if len(row) != 3 or tuple(row) == HEADER:
                continue
            try:
                step, value = int(row[0]), float(row[2])
            except ValueError:
                continue
            series.setdefault(row[1], {})[step] = value
    return series


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series under ``log_dir`` (a run directory, or a directory holding runs, such as a study's run):
    ``{tag: [(step, value), ...]}`` sorted by step.

    Reads every ``scalars.csv`` below ``log_dir``; a directory of TensorBoard event files with no scalars file in
    it or above it (a run recorded before the file existed) is read from its events instead, the way TensorBoard
    shows them (``read_event_scalars``: a resumed run's ``purge_step`` hides what the killed run
    logged after its last checkpoint; the scalars file drops those points itself). Across files, oldest first, a
    point logged twice at the same step keeps the later value.
    """
    root = Path(log_dir)
    sources: list[tuple[float, Path, bool]] = []  # (mtime, path, is a scalars file)
    runs = set()
    for path in root.rglob(SCALARS):
        if path.is_file():
            sources.append((path.stat().st_mtime, path, True))
            runs.add(path.parent)
    for directory, mtime in event_dirs(root).items():
        if not any(parent in runs for parent in (directory, *directory.parents)):
            sources.append((mtime, directory, False))
    series: dict[str, dict[int, float]] = {}
    for _, path, is_file in sorted(sources, key=lambda s: s[0]):
        found = read_scalars_file(path) if is_file else read_event_scalars(path, recursive=False)
        for tag, points in found.items():
            series.setdefault(tag, {}).update(points if is_file else dict(points))
    return {tag: sorted(points.items()) for tag, points in series.items()}


def last_scalars(log_dir: str | Path, prefix: str = "") -> dict[str, float]:
    """The last logged value (the one at the highest step) of every scalar whose tag starts with ``prefix``."""
    return {tag: pts[-1][1] for tag, pts in read_scalars(log_dir).items() if tag.startswith(prefix) and pts}


def has_logged_values(path: str | Path) -> bool:
    """Whether a scalars file holds a row (a logged value), not only its header."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip()) > 1


def event_dirs(log_dir: str | Path) -> dict[Path, float]:
    """Every directory of TensorBoard event files under ``log_dir`` (itself included), with its newest file's
    modification time."""
    dirs: dict[Path, float] = {}
    for path in Path(log_dir).rglob("events.out.tfevents.*"):
        dirs[path.parent] = max(dirs.get(path.parent, 0.0), path.stat().st_mtime)
    return dirs


def read_event_scalars(log_dir: str | Path, recursive: bool = True) -> dict[str, list[tuple[int, float]]]:
    """The scalar series of TensorBoard event files: ``{tag: [(step, value), ...]}`` sorted by step.

    Reads every directory of event files below ``log_dir`` (only ``log_dir`` itself when not ``recursive``) the
    way TensorBoard does: a resumed run appends a new event file whose ``purge_step`` hides what the killed run
    logged after its last checkpoint. Across directories, a point logged twice at the same step keeps the later
    value. (``read_scalars`` reads a run's scalars file, and these files only for a run without one.)
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    dirs = event_dirs(log_dir) if recursive else {Path(log_dir): 0.0}
    for directory in sorted(dirs, key=dirs.get):
        accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            points = series.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                points[event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in series.items()}
