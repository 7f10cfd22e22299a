"""Build the wheel as a user does and check what it ships: no setuptools warning, and every config under configs/.

    python .ci/check_wheel.py OUT_DIR

Builds with `pip wheel -v --no-deps` (an isolated build: the newest setuptools the registry serves), fails on any
warning line in the build's output (a "Package would be ignored" block, a deprecation), installs the wheel with
--no-deps into OUT_DIR/site and asks the installed CLI, from an empty directory, which configs it ships: the list
must be every YAML file under configs/, read from inside OUT_DIR/site. Exit 1 with what differs.
"""

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARNING = re.compile(r"warning|deprecat", re.IGNORECASE)


def build(out_dir: Path) -> Path:
    """The wheel, built verbosely; exits when the build warns."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # else distutils warns of it
    pip = [sys.executable, "-m", "pip"]
    done = subprocess.run([*pip, "wheel", "-v", "--no-deps", "-w", str(out_dir), str(ROOT)],
                          capture_output=True, text=True, env=env)
    log = done.stdout + done.stderr
    warned = [line.strip() for line in log.splitlines() if WARNING.search(line)]
    if done.returncode or warned:
        sys.exit(f"wheel build: exit code {done.returncode}, {len(warned)} warning lines:\n" + "\n".join(warned)
                 + ("" if warned else "\n" + log[-3000:]))
    (wheel,) = out_dir.glob("lightning_maskprior-*.whl")
    return wheel


def shipped_configs(wheel: Path, site: Path) -> list[str]:
    """The configs the installed package lists, asked from an empty directory, and checked to lie in the wheel."""
    prefix = "lightning_maskprior/configs/"
    in_wheel = sorted(n[len(prefix):] for n in zipfile.ZipFile(wheel).namelist()
                      if n.startswith(prefix) and n.endswith(".yaml"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True)
    with tempfile.TemporaryDirectory() as empty:
        listed = subprocess.run([sys.executable, "-m", "lightning_maskprior.cli", "configs"], cwd=empty, check=True,
                                capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(site)}).stdout
    header, *names = listed.splitlines()
    if f"({site.resolve() / 'lightning_maskprior' / 'configs'})" not in header:
        sys.exit(f"the installed CLI reads its configs elsewhere: {header}")
    names = [name.strip() for name in names]
    if names != in_wheel:
        sys.exit(f"the CLI lists {len(names)} configs, the wheel holds {len(in_wheel)}")
    return names


def main() -> None:
    out_dir = Path(sys.argv[1]).resolve()
    wheel = build(out_dir)
    shipped = shipped_configs(wheel, out_dir / "site")
    expected = sorted(p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml"))
    missing, extra = sorted(set(expected) - set(shipped)), sorted(set(shipped) - set(expected))
    if missing or extra:
        sys.exit(f"configs/ has {len(expected)} YAML files, the wheel ships {len(shipped)}; "
                 f"missing: {missing}; not in configs/: {extra}")
    print(f"wheel: {wheel.name}, built with no warning, ships all {len(shipped)} configs where the CLI reads them")


if __name__ == "__main__":
    main()
