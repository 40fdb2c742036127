"""Read-only http://, https:// and pipe: URLs, opened by webdataset's gopen (curl or a command)."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from typing import BinaryIO

from tpustream.errors import StorageError
from tpustream.storage.scheme import ObjectStat

PIPE_SCHEME = "pipe:"
# gopen reads a curl or shell pipe through a buffer of this size; its 8 KiB
# default costs a system call per 8 KiB of shard.
REMOTE_READ_BUFFER_BYTES = 1024 * 1024
HEAD_TIMEOUT_SECONDS = 30
# gopen runs `curl -f` for http(s); its exit status is the only reason we get.
CURL_EXIT_REASONS = {
    6: "cannot resolve the host",
    7: "cannot connect to the server",
    22: "the server answered with an HTTP error (4xx or 5xx)",
    28: "timed out",
    35: "TLS handshake failed",
    56: "the connection broke while receiving",
}


def scheme_label(url: str) -> str:
    """'pipe:', 'http://' or 'https://': how messages name the URL's scheme."""
    return PIPE_SCHEME if url.startswith(PIPE_SCHEME) else url.split("://", 1)[0] + "://"


class CheckedStream:
    """A gopen stream whose failures (a command's or curl's non-zero exit) raise
    StorageError naming the URL.

    gopen's Pipe notices a failed process only when it polls (on a read) or
    waits for it (on close), so the error may come from either; a stream that
    is closed before its end is not checked, since the process then exits
    because we stopped reading (SIGPIPE), not because it failed.
    """

    def __init__(self, raw: BinaryIO, url: str):
        self._raw = raw
        self._url = url
        self._at_end = False
        self._failed = False
        self._closed = False

    def _error(self, exc: Exception) -> StorageError:
        status = getattr(self._raw, "status", None)
        if status is None:
            reason = f"{exc.__class__.__name__}: {exc}"
        elif self._url.startswith(PIPE_SCHEME):
            reason = f"the command exited with status {status}"
        else:
            reason = f"{CURL_EXIT_REASONS.get(status, 'curl failed')}; curl exit status {status}"
        return StorageError(f"{self._url}: read failed ({reason})")

    def read(self, size: int = -1) -> bytes:
        try:
            data = self._raw.read(size)
        except (OSError, ValueError) as exc:
            self._failed = True
            raise self._error(exc) from exc
        if not data or size is None or size < 0:
            self._at_end = True
        return data

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._raw.close()
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            if self._at_end and not self._failed:
                raise self._error(exc) from exc

    def __enter__(self) -> CheckedStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_read(url: str) -> BinaryIO:
    """Start curl or the pipe's command; its failures surface on read() or close()."""
    from webdataset.gopen import gopen

    try:
        raw = gopen(url, "rb", bufsize=REMOTE_READ_BUFFER_BYTES)
    except (OSError, ValueError) as exc:
        raise StorageError(f"{url}: cannot open ({exc.__class__.__name__}: {exc})") from exc
    return CheckedStream(raw, url)


def read_bytes(url: str) -> bytes:
    with open_read(url) as stream:
        return stream.read()


def _head(url: str):
    """The headers of a HEAD request; raises urllib's HTTPError for a 4xx/5xx answer."""
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=HEAD_TIMEOUT_SECONDS) as response:
            return response.headers
    except urllib.error.HTTPError:
        raise  # the server answered: the caller judges the status
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StorageError(f"{url}: HEAD request failed ({reason})") from exc


def _opens(url: str) -> bool:
    """Whether the URL can be opened and read from (its first byte, or its empty end)."""
    try:
        with open_read(url) as stream:
            stream.read(1)
        return True
    except StorageError:
        return False


def exists(url: str) -> bool:
    """http(s): a HEAD request (404/410: False); pipe: whether the command runs and can be read."""
    if url.startswith(PIPE_SCHEME):
        return _opens(url)
    try:
        _head(url)
        return True
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 410):
            return False
        if exc.code in (405, 501):  # a server without HEAD
            return _opens(url)
        raise StorageError(f"{url}: HTTP {exc.code} {exc.reason}") from exc


def list_names(prefix: str) -> list[str]:
    raise StorageError(
        f"{prefix}: cannot list {scheme_label(prefix)} URLs; give a brace pattern or a list of shard URLs"
    )


def stat(url: str) -> ObjectStat:
    """Content-Length, and the ETag (else Last-Modified) as the version, from a HEAD request."""
    if url.startswith(PIPE_SCHEME):
        raise StorageError(f"{url}: pipe: URLs have no size or version to stat")
    try:
        headers = _head(url)
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 410):
            raise StorageError(f"{url}: no such object (HTTP {exc.code})") from exc
        raise StorageError(f"{url}: HTTP {exc.code} {exc.reason} answering HEAD") from exc
    length = headers.get("Content-Length")
    version = headers.get("ETag") or headers.get("Last-Modified")
    if length is None or not length.isdigit() or not version:
        raise StorageError(
            f"{url}: the server's HEAD answer lacks Content-Length or ETag/Last-Modified; "
            "cannot tell whether the object changed"
        )
    return ObjectStat(size=int(length), version=version)


def _refuse_write(url: str) -> StorageError:
    return StorageError(f"{url}: {scheme_label(url)} URLs are read-only; write to a local path or gs://")


def write_bytes(url: str, data: bytes) -> None:
    raise _refuse_write(url)


def write_bytes_verified(url: str, data: bytes) -> None:
    raise _refuse_write(url)


def copy(source: str, url: str) -> None:
    raise _refuse_write(url)


def delete(url: str) -> bool:
    raise _refuse_write(url)


def has_same_content(url: str, data: bytes) -> bool:
    """Read the object and compare: these schemes have no checksum to ask for."""
    if not exists(url):
        return False
    return read_bytes(url) == data


def make_container(url: str) -> None:
    raise _refuse_write(url)


def check_container(url: str) -> None:
    raise _refuse_write(url)


def is_temporary(name: str) -> bool:
    return False  # nothing is written through these schemes
