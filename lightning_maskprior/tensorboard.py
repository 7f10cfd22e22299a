"""Read scalars back from a run's TensorBoard event files (for studies, tests and reports)."""

from __future__ import annotations

from pathlib import Path


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series under ``log_dir``: ``{tag: [(step, value), ...]}`` sorted by step.

    Reads every directory of event files below ``log_dir`` the way TensorBoard does: a resumed run
    appends a new event file whose ``purge_step`` hides what the killed run logged after its last
    checkpoint. Across directories, a point logged twice at the same step keeps the later value.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, dict[int, float]] = {}
    dirs: dict[Path, float] = {}
    for path in Path(log_dir).rglob("events.out.tfevents.*"):
        dirs[path.parent] = max(dirs.get(path.parent, 0.0), path.stat().st_mtime)
    for directory in sorted(dirs, key=dirs.get):
        accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            points = series.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                points[event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in series.items()}


def last_scalars(log_dir: str | Path, prefix: str = "") -> dict[str, float]:
    """The last logged value of every scalar whose tag starts with ``prefix``."""
    return {tag: pts[-1][1] for tag, pts in read_scalars(log_dir).items() if tag.startswith(prefix) and pts}
