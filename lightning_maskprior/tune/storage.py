"""Where a tune's Optuna study lives: Optuna's own storages, opened from one URL.

    sqlite:///runs/tune/quick/tune.db                    one file, nothing to start (the default, in out_dir)
    postgresql://USER:PASSWORD@HOST:5432/DB              any SQLAlchemy URL Optuna's RDBStorage takes (mysql+pymysql...)
    /shared/tune/quick.log                               a path without '://': an Optuna journal file

Workers (processes, SLURM array tasks, Ray tasks) that name the same storage and study share one study. In an RDB
storage each worker beats (Optuna's heartbeat): a trial whose worker died is failed after ``grace_period`` seconds
and retried (``RetryHeartbeatStaleTrialCallback``). The pruning callback inside a trial's fit opens the same
storage, without a heartbeat, to report to its trial, and rebuilds the tune's pruner (``instantiate``): this module
imports Optuna and jsonargparse only, so the callback imports nothing of the tune's.
"""

from __future__ import annotations

import re
from typing import Any

import optuna


class StorageError(ValueError):
    """A storage URL that cannot be opened; the message names it (without its password)."""


def is_journal(url: str) -> bool:
    """Whether ``url`` names a journal file (a path) rather than an RDB (``scheme://...``)."""
    return "://" not in url


def redacted(url: str) -> str:
    """``url`` without its password (for messages and the files a tune writes)."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def open_storage(url: str, heartbeat_interval: int | None = None, grace_period: int | None = None,
                 max_retry: int | None = 3) -> optuna.storages.BaseStorage:
    """Optuna's storage for ``url``: an RDBStorage (with the heartbeat when ``heartbeat_interval`` is given, and a
    stale trial retried up to ``max_retry`` times) or a JournalStorage on a file. A StorageError naming the URL when
    it cannot be opened."""
    import warnings

    # The heartbeat and its retry callback are marked experimental in Optuna; this project relies on them.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        if is_journal(url):
            from pathlib import Path

            from optuna.storages.journal import JournalFileBackend, JournalStorage

            Path(url).expanduser().parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(Path(url).expanduser())))
        heartbeat: dict[str, Any] = {}
        if heartbeat_interval is not None:
            heartbeat = {
                "heartbeat_interval": heartbeat_interval, "grace_period": grace_period,
                "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=max_retry, inherit_intermediate_values=True),
            }
        engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # wait for other writers
        return _rdb(url, engine, heartbeat)
    except Exception as err:  # noqa: BLE001  (SQLAlchemy's and the OS's errors alike: the URL cannot be opened)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StorageError(
            f"storage {redacted(url)!r} cannot be opened: {reason[:300]}; expected an Optuna RDB URL "
            "(sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB, ...) it can connect to, or the path of a journal "
            "file in a writable directory"
        ) from None


def _rdb(url: str, engine: dict | None, heartbeat: dict[str, Any], attempts: int = 5) -> optuna.storages.RDBStorage:
    """Optuna's RDBStorage; workers that start together on a new database race to create its tables (one of them
    gets an IntegrityError or a locked database): such an error is retried after a moment, the others are not."""
    import time

    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine, **heartbeat)
        except (IntegrityError, OperationalError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def has_heartbeat(storage: optuna.storages.BaseStorage) -> bool:
    """Whether dead workers' trials are detected in ``storage`` (Optuna's heartbeat: RDB storages)."""
    interval = getattr(storage, "get_heartbeat_interval", None)
    return interval is not None and interval() is not None


def instantiate(spec: dict[str, Any], base: type, seed_offset: int = 0) -> Any:
    """The sampler or pruner ``spec`` (``{class_path, init_args}``) describes; a seed in its init_args is offset by
    ``seed_offset``."""
    from jsonargparse import ArgumentParser

    init_args = dict(spec["init_args"])
    if isinstance(init_args.get("seed"), int):
        init_args["seed"] += seed_offset
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--value", type=base)
    return parser.instantiate(parser.parse_object({"value": {**spec, "init_args": init_args}})).value


def trial_sampler(spec: dict[str, Any], number: int) -> Any:
    """The sampler ``spec`` describes for trial ``number``: its seed plus the number, which the storage gives out
    once, so workers that start together draw different trials and one worker draws the same ones each time."""
    import optuna

    return instantiate(spec, optuna.samplers.BaseSampler, number)
