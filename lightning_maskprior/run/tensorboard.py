"""Reading a run's TensorBoard event files back: ``read_event_scalars`` (the scalars of a run recorded before runs
kept a scalars file) and ``read_hparams`` (the HPARAMS session ``callbacks.hparams.HparamsSession`` writes).
``read_scalars`` / ``last_scalars`` live in ``run/scalars.py`` (they read the scalars file first) and are
importable from here too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_maskprior.run.scalars import last_scalars, read_scalars

__all__ = ["event_dirs", "last_scalars", "read_event_scalars", "read_hparams", "read_scalars"]


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


def read_hparams(log_dir: str | Path) -> tuple[dict[str, Any], list[str]]:
    """``(hyperparameters, metric tags)`` of the HPARAMS session in ``log_dir``'s event files (the first one, as
    TensorBoard shows it); ``({}, [])`` when there is none."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    params: dict[str, Any] | None = None
    metrics: list[str] | None = None
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != metadata.PLUGIN_NAME:
                    continue
                data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
                if value.tag == metadata.SESSION_START_INFO_TAG and params is None:
                    params = {k: _proto_value(v) for k, v in data.session_start_info.hparams.items()}
                elif value.tag == metadata.EXPERIMENT_TAG and metrics is None:
                    metrics = [m.name.tag for m in data.experiment.metric_infos]
    return params or {}, metrics or []


def _proto_value(value) -> Any:
    kind = value.WhichOneof("kind")
    return getattr(value, kind) if kind else None
