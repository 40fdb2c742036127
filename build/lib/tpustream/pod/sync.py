"""--sync: ship this checkout's files to every host and install them there."""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tpustream.errors import ConfigError, TpustreamError
from tpustream.pod.commands import new_remote_tarball, sync_commands
from tpustream.pod.processes import Console, run_streamed
from tpustream.pod.spec import LaunchSpec

# Not shipped by --sync when the source is not a git checkout.
_SKIP_ANYWHERE = {".git", ".venv", "venv", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache"}
_SKIP_TOP_LEVEL = {"data", "outputs", "multirun", "build", "dist"}


def find_source_root() -> Path:
    """The checkout tpustream is installed from (editable install: src/tpustream/pod/sync.py)."""
    root = Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "train.py").is_file():
        return root
    raise ConfigError(
        f"--sync copies a tpustream checkout, but tpustream is installed in {root.parent}; "
        "pass --source DIR (the folder with pyproject.toml and train.py)"
    )


def source_files(root: Path) -> list[str]:
    """Paths relative to root that --sync ships: git's tracked files, or a filtered walk without git.

    Tracked files only, so that data, outputs and virtualenvs lying in the
    checkout are not copied to every host.
    """
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True
        ).stdout.decode()
        files = sorted(f for f in listed.split("\0") if f and (root / f).is_file())
    except (OSError, subprocess.CalledProcessError):
        files = _walk_sources(root)
    missing = [name for name in ("pyproject.toml", "train.py") if name not in files]
    if missing:
        raise ConfigError(f"--sync: {root} has no {' and no '.join(missing)}; is it a tpustream checkout?")
    return files


def _walk_sources(root: Path) -> list[str]:
    files = []
    for folder, dirs, names in os.walk(root):
        top = Path(folder) == root
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in _SKIP_ANYWHERE and not d.endswith(".egg-info") and not (top and d in _SKIP_TOP_LEVEL)
        )
        files += [
            (Path(folder) / name).relative_to(root).as_posix() for name in names if not name.endswith(".pyc")
        ]
    return sorted(files)


def build_tarball(root: Path, files: Iterable[str], dest: Path) -> None:
    def anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(dest, "w:gz") as tar:
        for name in files:
            tar.add(root / name, arcname=name, recursive=False, filter=anonymous)


def sync(spec: LaunchSpec, console: Console) -> None:
    """Copy the code to every host and install it into workdir/.venv there."""
    root = spec.source or find_source_root()
    files = source_files(root)
    with tempfile.TemporaryDirectory(prefix="tpustream-sync-") as tmp:
        tarball = Path(tmp) / "tpustream-src.tar.gz"
        build_tarball(root, files, tarball)
        console.say(
            f"--sync: {len(files)} files of {root} ({tarball.stat().st_size // 1024} KiB) to {spec.workdir} "
            "on every worker, then pip install -e '.[tpu]' there (the first time: torch_xla, minutes)"
        )
        for argv in sync_commands(spec, str(tarball), new_remote_tarball()):
            code = run_streamed(argv, console, "[sync] ")
            if code != 0:
                raise TpustreamError(f"--sync failed: gcloud tpu-vm {argv[4]} exited with {code} (see above)")
