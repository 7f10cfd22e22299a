"""A run's directory and the facts derived from its files, in one place (``load.py`` reopens a finished run).

A fit writes ``<root>/<name>/<version>/`` (a :class:`RunDir`, e.g. ``runs/2parity-mask-seed0/version_0``)::

    config.yaml          the whole configuration the fit started with (precision as used), written once
    changes.yaml         one segment per resume that changed an option: its step, old and new value (record.py)
    hparams.yaml         the module's hyperparameters (Lightning's)
    scalars.csv          every scalar the run logged, ``step,tag,value`` (run/scalars.py), whatever its loggers
    checkpoints/         last.ckpt after every epoch (or at a ModelCheckpoint's cadence) and at the end; the others
    predictions.csv      what ``maskprior predict`` wrote from one of its checkpoints
    events.out.tfevents.* TensorBoard (the default logger's; another logger writes where it is configured to)

A study runs each fit in a :class:`StudyRunDir` (``<out_dir>/<task>/<init>/seed<k>/``), which holds the run's
record (``run.json``, written by the study), its result (``result.json``, written by the run), the console output
and the fit's own run directory under ``lightning_logs/`` (whatever loggers the run has), with the test's beside it.

:class:`Checkpoint` is one checkpoint file, read at most once (safely: tensors and plain values only) however many
checks look at it.
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
import zipfile
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_maskprior.checkpoints import CheckpointError
from lightning_maskprior.run.precision import FALLBACK
from lightning_maskprior.run.scalars import SCALARS
from lightning_maskprior.run.scalars import has_logged_values as _scalars_logged


class RunDir:
    """A fit's run directory (the ``log_dir`` of the CLI's ``ScalarsLogger``, first among the run's loggers)."""

    CONFIG = "config.yaml"
    HPARAMS = "hparams.yaml"
    TOKENIZER = "tokenizer.json"  # the language datamodules' tokenizer, saved beside the config
    CHECKPOINTS = "checkpoints"
    LAST = "last.ckpt"
    PREDICTIONS = "predictions.csv"
    CHANGES = "changes.yaml"  # options a resumed fit changed, with the step they took effect at (run/record.py)
    SCALARS = SCALARS  # every logged scalar (run/scalars.py)
    FILES_WITHOUT_RESULTS = (CONFIG, HPARAMS, TOKENIZER)  # what a run writes before it has measured anything

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and self.path == other.path

    def __hash__(self) -> int:
        return hash(self.path)

    @classmethod
    def of_checkpoint(cls, ckpt: str | Path | None) -> RunDir | None:
        """The run directory of ``<run>/checkpoints/x.ckpt``, or None for a checkpoint kept elsewhere."""
        path = Path(ckpt) if ckpt else None
        return cls(path.parent.parent) if path is not None and path.parent.name == cls.CHECKPOINTS else None

    # ------------------------------------------------------------------------------------------------ files
    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / self.LAST

    @property
    def predictions(self) -> Path:
        return self.path / self.PREDICTIONS

    @property
    def changes(self) -> Path:
        return self.path / self.CHANGES

    @property
    def scalars(self) -> Path:
        return self.path / self.SCALARS

    # ------------------------------------------------------------------------------------------------ facts
    def config(self) -> dict[str, Any]:
        """The run's ``config.yaml`` ({} when it has none or it cannot be read)."""
        try:
            config = yaml.safe_load(self.config_path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return {}
        return config if isinstance(config, dict) else {}

    def trained_config(self) -> dict[str, Any]:
        """What the run trained with last: its ``config.yaml`` with every segment of ``changes.yaml`` (the options a
        resume changed) applied in order, nested as config.yaml is ({} without one). A changes.yaml that is not a
        list of segments is not applied here; ``record.segments`` names it."""
        config = self.config()
        for option, value in self.changed_options().items():
            *parents, leaf = option.split(".")
            node = config
            for key in parents:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            node[leaf] = value
        return config

    def changed_options(self) -> dict[str, Any]:
        """``{dotted.option: value}``: each option a resume changed (``changes.yaml``), at its last segment's value
        ({} for a run never resumed with a change, or a changes.yaml that is not a list of segments)."""
        try:
            entries = yaml.safe_load(self.changes.read_text(encoding="utf-8")) if self.changes.is_file() else None
        except (OSError, yaml.YAMLError):
            entries = None
        options: dict[str, Any] = {}
        for entry in entries if isinstance(entries, list) else []:
            changed = entry.get("changed") if isinstance(entry, dict) else None
            for option, change in (changed if isinstance(changed, dict) else {}).items():
                # {old, new}; a segment written before the record had its own file format said {checkpoint, config}
                options[str(option)] = change.get("new", change.get("config")) if isinstance(change, dict) else change
        return options

    def precision(self, default: str | None = FALLBACK) -> str | None:
        """The ``trainer.precision`` the run trained and validated in last (the CLI writes the one it used:
        bf16-mixed on a CPU without native bf16 becomes 32-true; a resume that changed it, the segment's), else
        ``default``. Give it to the Trainer that re-validates a reopened run, and the metrics come out as logged."""
        trainer = self.trained_config().get("trainer")
        value = trainer.get("precision") if isinstance(trainer, dict) else None
        return default if value is None else str(value)

    def data_spec(self) -> dict[str, Any] | None:
        """The ``data`` entry of what the run trained with last (class_path and init_args; a resume may have changed
        how it is evaluated), or None."""
        data = self.trained_config().get("data")
        return data if isinstance(data, dict) and data.get("class_path") else None

    def find_checkpoint(self) -> Path:
        """``checkpoints/last.ckpt``, else the newest ``.ckpt``; for a directory holding runs (a study's run
        directory), the newest run's."""
        dirs = [self.checkpoints] if self.checkpoints.is_dir() else sorted(
            self.path.rglob(self.CHECKPOINTS), key=lambda p: p.stat().st_mtime, reverse=True)
        for directory in dirs:
            if (directory / self.LAST).is_file():
                return directory / self.LAST
            found = sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
            if found:
                return found[-1]
        raise FileNotFoundError(f"no checkpoint under {self.path} (looked for {self.CHECKPOINTS}/{self.LAST} and "
                                f"*/{self.CHECKPOINTS}/*.ckpt)")

    def remove_if_empty(self) -> bool:
        """Remove a run directory a failed run left with nothing in it, and its parent (the run's name, e.g.
        ``runs/2parity-mask-seed0``) if that is then empty; True if removed.

        Nothing means: only ``FILES_WITHOUT_RESULTS``, a scalars file or event files without a logged value (a header,
        hyperparameters only) and empty folders (``checkpoints/``). Anything else (a scalar, an image, a
        checkpoint, a file of the user's) keeps it.
        """
        if not self.path.is_dir():
            return False
        for path in self.path.rglob("*"):
            if path.is_dir() or (path.parent == self.path and path.name in self.FILES_WITHOUT_RESULTS):
                continue
            if path.name.startswith("events.out.tfevents.") and not _has_logged_values(path):
                continue
            if path.parent == self.path and path.name == self.SCALARS and not _scalars_logged(path):
                continue
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # only if empty: no other version of that name
        return True

    # ------------------------------------------------------------------------------------------------ roots
    @classmethod
    def newest_last(cls, root: str | Path) -> Path | None:
        """The newest ``<root>/<name>/<version>/checkpoints/last.ckpt``, or None: what ``--ckpt_path last``
        resumes, and what a study's cell resumes an interrupted run from."""
        found = sorted(Path(root).glob(f"*/*/{cls.CHECKPOINTS}/{cls.LAST}"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    @classmethod
    def lasts(cls, root: str | Path) -> list[Path]:
        """Every ``<root>/<name>/<version>/checkpoints/last.ckpt``, the newest first."""
        return sorted(Path(root).glob(f"*/*/{cls.CHECKPOINTS}/{cls.LAST}"), key=lambda p: p.stat().st_mtime,
                      reverse=True)

    @classmethod
    def resolve_last(cls, root: str | Path, last: Path | None = None) -> tuple[Path | None, str | None]:
        """What ``--ckpt_path last`` means under ``root`` (or for the run of ``last``): the newest run's
        ``last.ckpt``, or, when that file is not intact, the newest intact checkpoint beside it. Returns the path
        (None: no checkpoint at all) and a line saying what was chosen instead, if anything was."""
        last = last if last is not None else cls.newest_last(root)
        if last is None:
            return None, None
        if Checkpoint(last).is_intact():
            return last, None
        others = sorted((p for p in last.parent.glob("*.ckpt") if p != last and Checkpoint(p).is_intact()),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        if not others:
            return last, None  # reading it names the problem
        return others[0], f"{last} is not a complete checkpoint (truncated?); using the newest intact one, {others[0]}"


class StudyRunDir:
    """One run of a study: ``<out_dir>/<task>/<init>/seed<k>/``."""

    RUN = "run.json"  # what the run executes, written by the study before launching it
    RESULT = "result.json"  # how it ended, written by the run
    FIT_DONE = "fit.json"  # written when the fit has finished: a run stopped during its test only tests again
    MAPS = "attention_maps.npz"  # the fit's attention maps at the start and the end of training
    LOGS = "lightning_logs"  # the fit's run directories (version_N)
    LOCK = ".cell.lock"  # held by the process executing the run, so nothing deletes or reruns it meanwhile

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def run_record(self) -> Path:
        return self.path / self.RUN

    @property
    def result(self) -> Path:
        return self.path / self.RESULT

    @property
    def fit_done(self) -> Path:
        return self.path / self.FIT_DONE

    @property
    def maps(self) -> Path:
        return self.path / self.MAPS

    @property
    def lock(self) -> Path:
        return self.path / self.LOCK

    def output(self, stage: str, stream: str) -> Path:
        """The console output of a stage (``fit`` / ``test``): ``stream`` is ``out`` or ``err``."""
        return self.path / f"{stage}.{stream}"

    def fit_dir(self) -> RunDir | None:
        """The fit's run directory: the newest ``lightning_logs/version_*`` with a config.yaml."""
        dirs = [p.parent for p in self.path.glob(f"{self.LOGS}/version_*/{RunDir.CONFIG}")]
        return RunDir(max(dirs, key=lambda p: p.stat().st_mtime)) if dirs else None

    def resume_checkpoint(self) -> Path | None:
        """The newest intact ``last.ckpt`` of the fit under this directory, if any."""
        return RunDir.newest_last(self.path)


class Checkpoint:
    """One checkpoint file, read at most once, safely (``torch.load(weights_only=True)``, memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r})"

    @property
    def run_dir(self) -> RunDir | None:
        return RunDir.of_checkpoint(self.path)

    def is_intact(self) -> bool:
        """Whether the file is complete: torch.save writes a zip archive, whose directory is at its end."""
        return self.path.is_file() and self.path.stat().st_size > 0 and zipfile.is_zipfile(self.path)

    def check_file(self) -> None:
        """Raise, naming the file, unless it is an intact checkpoint archive (nothing is unpickled)."""
        path = self.path
        if not path.exists():
            raise FileNotFoundError(f"ckpt_path {path} does not exist; expected a .ckpt file written by a fit")
        if path.is_dir():
            raise CheckpointError(f"ckpt_path {path} is a directory; expected a .ckpt file (e.g. {path}/last.ckpt)")
        with open(path, "rb"):
            pass  # a file it may not read is a PermissionError, not "not a zip archive" (is_zipfile hides it)
        if path.stat().st_size == 0:
            raise self._not_readable("the file is empty")
        if not zipfile.is_zipfile(path):
            raise self._not_readable("it is not a complete zip archive, which torch.save writes")

    @cached_property
    def contents(self) -> dict[str, Any]:
        """The checkpoint's dict (tensors and plain values only), or a CheckpointError naming the file."""
        self.check_file()
        path = self.path
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception:  # noqa: BLE001 - the list is only for the message
                unsafe = []
            if unsafe:
                raise CheckpointError(
                    f"checkpoint {path} holds Python objects a safe load refuses ({', '.join(unsafe[:4])}); "
                    "expected tensors and plain values only, as maskprior's checkpoints hold. Do not load a file "
                    "you did not write yourself."
                ) from None
            raise self._not_readable("its pickled content is corrupt") from None
        except OSError:
            raise  # no permission, an I/O error...: the machine's error, not a broken file (cli.py names it)
        except Exception as err:  # noqa: BLE001 - any reader error: say which file
            raise self._not_readable(_short_reason(err)) from None
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            held = f"a {type(checkpoint).__name__}"
            if isinstance(checkpoint, dict):
                held = f"a dict with keys {sorted(map(str, checkpoint))[:6]}"
            raise CheckpointError(
                f"checkpoint {path} holds {held}; expected a Lightning checkpoint (a dict with a 'state_dict')"
            )
        _check_version(checkpoint.get("pytorch-lightning_version"), path)
        return checkpoint

    @property
    def is_read(self) -> bool:
        """Whether ``contents`` has been read (and so checked) already."""
        return "contents" in self.__dict__

    @property
    def hparams(self) -> dict[str, Any]:
        return self.contents.get("hyper_parameters") or {}

    @property
    def global_step(self) -> int:
        return int(self.contents.get("global_step") or 0)

    def _not_readable(self, reason: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.path} is not a readable PyTorch checkpoint (truncated or not a checkpoint): {reason}"
        )


OLDEST_LIGHTNING = "2.0"  # the oldest Lightning whose checkpoints this project's loops and callbacks read


def _check_version(version: Any, path: Path) -> None:
    """Refuse a checkpoint whose recorded Lightning version is not a version, or is older than Lightning 2: its
    migration would fail inside Lightning with a KeyError or InvalidVersion."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        raise CheckpointError(f"checkpoint {path} records no Lightning version ('pytorch-lightning_version'); "
                              "expected a checkpoint a Lightning fit wrote")
    try:
        old = Version(str(version)) < Version(OLDEST_LIGHTNING)
    except InvalidVersion:
        raise CheckpointError(f"checkpoint {path} records Lightning version {version!r}, which is not a version; "
                              "expected the version the fit ran with (e.g. 2.6.6): edited or corrupt") from None
    if old:
        raise CheckpointError(f"checkpoint {path} was written by Lightning {version}; expected one of Lightning "
                              f"{OLDEST_LIGHTNING} or later, as maskprior fit writes")


def _short_reason(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else ""
    if not first or "weights_only" in first:  # never pass on torch's advice to load unsafely
        return type(err).__name__
    return first[:200]


def _has_logged_values(path: Path) -> bool:
    """Whether an event file holds a logged value (a scalar, an image...): anything but hyperparameters."""
    if path.stat().st_size == 0:
        return False
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                # A TensorBoardLogger with default_hp_metric (not the CLI's) logs hp_metric = -1 with its hparams.
                if value.metadata.plugin_data.plugin_name != "hparams" and value.tag != "hp_metric":
                    return True
    except Exception:  # noqa: BLE001 - unreadable: keep the directory
        return True
    return False


# ---------------------------------------------------------------------------------------- reopening a run
def find_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint of a run (a run directory, a directory holding runs, or a checkpoint file itself)."""
    return Path(run_dir) if Path(run_dir).is_file() else RunDir(run_dir).find_checkpoint()


class ResultDir:
    """A study's result directory, by the names of its files: the data files ``collect`` writes and ``load`` reads,
    and what the report makes of them (tables.py, figures.py, report.py)."""

    STUDY = "study.json"
    RESULTS = "results.csv"
    CURVES = "curves.csv.gz"
    MAPS = "attention_maps.npz"
    DATA = (STUDY, RESULTS, CURVES, MAPS)
    TABLE = "table.md"
    TABLE_CSV = "table.csv"
    PER_SEED = "per_seed.csv"
    FIGURES = "figures"

    @classmethod
    def holds_results(cls, path: Path) -> bool:
        """Whether ``path`` holds the two files a report needs (study.json and results.csv)."""
        return (Path(path) / cls.STUDY).is_file() and (Path(path) / cls.RESULTS).is_file()
