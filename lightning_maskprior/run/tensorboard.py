"""Reading a run's TensorBoard event files back: ``read_hparams`` (the HPARAMS session
``callbacks.hparams.HparamsSession`` writes). The scalar readers live in ``run/scalars.py`` (``read_scalars`` /
``last_scalars`` read a run's scalars file, and its event files only for a run without one:
``read_event_scalars``) and are importable from here too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_maskprior.run.scalars import event_dirs, last_scalars, read_event_scalars, read_scalars

__all__ = ["event_dirs", "last_scalars", "read_event_scalars", "read_hparams", "read_scalars"]


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
