"""The launchers by name: what a study file's ``launcher`` may say (a study validates it before importing any)."""

#: name -> "module:Class", imported when used (slurm needs submitit, ray needs ray).
LAUNCHERS: dict[str, str] = {
    "local": "lightning_maskprior.study.launchers.local:LocalLauncher",
    "inprocess": "lightning_maskprior.study.launchers.local:InProcessLauncher",
    "slurm": "lightning_maskprior.study.launchers.slurm:SlurmLauncher",
    "ray": "lightning_maskprior.study.launchers.ray:RayLauncher",
}
