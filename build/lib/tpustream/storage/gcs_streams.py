"""The download streams of gs:// objects: one streaming GET per object, read ahead by a thread."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

from tpustream.errors import StorageError

# Read-ahead of a gs:// stream: a thread keeps up to READ_AHEAD_PIECES pieces
# of READ_AHEAD_PIECE_BYTES downloaded ahead of the reader, so the network
# transfer overlaps decoding. Memory per open stream: 8 MiB.
READ_AHEAD_PIECE_BYTES = 2 * 1024 * 1024
READ_AHEAD_PIECES = 4

# Statuses worth retrying, as the client library's own retry policy does.
RETRYABLE_STATUS = (408, 429, 500, 502, 503, 504)
GCS_READ_ATTEMPTS = 8
GCS_READ_TIMEOUT = (20, 60)  # connect, read seconds


class GcsObjectStream:
    """One GCS object as a binary stream over a single streaming HTTP GET.

    google-cloud-storage's BlobReader downloads each chunk through
    google-resumable-media in 8 KiB pieces and cost 2.35 ms of CPU per MiB
    here; reading the response body directly costs 0.26 ms/MiB (and the
    socket reads release the GIL). If the connection breaks or the service
    answers 429/5xx, the download resumes with a Range request at the byte
    reached, pinned to the object's generation, so no byte is read twice or
    lost; after GCS_READ_ATTEMPTS failures in a row it gives up naming the URL.
    """

    def __init__(self, session, media_url: str, size: int, url: str):
        self._session = session
        self._media_url = media_url
        self._size = size
        self._url = url
        self._offset = 0
        self._response = None
        self._failures = 0

    def _fail(self, reason: str) -> None:
        self._close_response()
        self._failures += 1
        if self._failures >= GCS_READ_ATTEMPTS:
            raise StorageError(
                f"{self._url}: download failed {self._failures} times at byte {self._offset} ({reason})"
            )
        time.sleep(min(0.1 * 2 ** (self._failures - 1), 5.0) * (0.5 + random.random()))

    def _open(self) -> None:
        import requests

        headers = {"Range": f"bytes={self._offset}-"} if self._offset else {}
        try:
            response = self._session.get(
                self._media_url, headers=headers, stream=True, timeout=GCS_READ_TIMEOUT
            )
        except requests.RequestException as exc:
            self._fail(f"{exc.__class__.__name__}: {exc}")
            return
        if response.status_code in (200, 206):
            if self._offset and response.status_code == 200:
                response.close()  # a server that ignores Range: never hand out bytes twice
                raise StorageError(f"{self._url}: the server ignored a ranged read at byte {self._offset}")
            self._response = response
            return
        status = response.status_code
        response.close()
        if status in RETRYABLE_STATUS:
            self._fail(f"HTTP {status}")
            return
        if status == 404:
            raise StorageError(f"{self._url}: no such object (404), or it was replaced while reading")
        if status in (401, 403):
            raise StorageError(f"{self._url}: permission denied ({status}); check the credentials' IAM roles")
        raise StorageError(f"{self._url}: HTTP {status} while reading")

    def _close_response(self) -> None:
        if self._response is not None:
            self._response.close()
            self._response = None

    def read(self, size: int = -1) -> bytes:
        import requests
        import urllib3

        while self._offset < self._size:
            if self._response is None:
                self._open()
                continue
            want = (
                self._size - self._offset
                if size is None or size < 0
                else min(size, self._size - self._offset)
            )
            try:
                data = self._response.raw.read(want, decode_content=False)
            except (urllib3.exceptions.HTTPError, requests.RequestException, OSError) as exc:
                self._fail(f"{exc.__class__.__name__}: {exc}")
                continue
            if not data:
                self._fail("connection closed early")
                continue
            self._offset += len(data)
            self._failures = 0
            return data
        self._close_response()
        return b""

    def close(self) -> None:
        self._close_response()


class ReadAheadStream:
    """A binary stream read by a background thread, a bounded number of pieces ahead.

    Downloads release the GIL, so on a GCS stream the transfer of the next
    pieces overlaps the caller's parsing and decoding. read(n) may return
    fewer than n bytes (b"" only at the end), like a raw stream. Errors of
    the underlying stream are raised by read(), naming the URL.
    """

    _END = object()

    def __init__(
        self,
        raw: BinaryIO,
        url: str,
        piece_bytes: int | None = None,
        pieces: int | None = None,
        describe_error: Callable[[str, Exception], StorageError] | None = None,
    ):
        self._raw = raw
        self._url = url
        # The storage client's errors as one line naming the URL (gcs: a missing bucket, 403).
        self._describe_error = describe_error
        self._piece_bytes = piece_bytes or READ_AHEAD_PIECE_BYTES
        self._queue: queue.Queue = queue.Queue(maxsize=pieces or READ_AHEAD_PIECES)
        self._closed = threading.Event()
        self._current = b""
        self._offset = 0
        self._done = False
        self._thread = threading.Thread(target=self._pump, name=f"read-ahead {url}", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self) -> None:
        try:
            while not self._closed.is_set():
                piece = self._raw.read(self._piece_bytes)
                if not piece:
                    break
                if not self._put(piece):
                    return
        except Exception as exc:  # delivered to the reader, which raises it
            self._put(exc)
            return
        self._put(self._END)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return b"".join(iter(lambda: self.read(1 << 30), b""))
        while self._offset >= len(self._current):
            if self._done:
                return b""
            item = self._queue.get()
            if item is self._END:
                self._done = True
                return b""
            if isinstance(item, Exception):
                self._done = True
                if isinstance(item, StorageError):
                    raise item
                if self._describe_error is not None:
                    raise self._describe_error(self._url, item) from item
                raise StorageError(f"{self._url}: read failed ({item.__class__.__name__}: {item})") from item
            self._current, self._offset = item, 0
        piece = self._current[self._offset : self._offset + size]
        self._offset += len(piece)
        return piece

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=10)
        self._raw.close()

    def __enter__(self) -> ReadAheadStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
