"""Reading a run's TensorBoard event files back: ``read_scalars`` / ``last_scalars`` / ``read_hparams`` (for
studies, tests and reports). The HPARAMS session is written by ``callbacks.hparams.HparamsSession``."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
