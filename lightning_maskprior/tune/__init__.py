"""``maskprior tune``: an Optuna study whose trials are ordinary runs (see ``cli.py`` for the command).

    spec.py       the tune file: its options (Tune, Task, Param, Objective), validation, a trial's runs (TrialRun)
    storage.py    Optuna's storages from one URL (SQLite, any RDB, a journal file), with the heartbeat
    record.py     what a tune leaves in its out_dir (tune.json, trials.json, best.yaml) and its report
    cli.py        the command: parse, check, then one worker's loop of trials

Needs the ``tune`` extra (optuna). The pruning callback inside a trial's fit is
``lightning_maskprior.callbacks.OptunaPruning``.
"""
