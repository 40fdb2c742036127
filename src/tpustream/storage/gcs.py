"""gs:// objects: the GCS client, its retry policy, streaming reads and verified writes."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import queue
import random
import threading
import time
import uuid
from typing import BinaryIO
from urllib.parse import quote

import google_crc32c

from tpustream.config import positive_seconds
from tpustream.errors import StorageError
from tpustream.storage.scheme import ObjectStat

GCS_SCHEME = "gs://"
# Read-ahead of a gs:// stream: a thread keeps up to READ_AHEAD_PIECES pieces
# of READ_AHEAD_PIECE_BYTES downloaded ahead of the reader, so the network
# transfer overlaps decoding. Memory per open stream: 8 MiB.
READ_AHEAD_PIECE_BYTES = 2 * 1024 * 1024
READ_AHEAD_PIECES = 4

# google-cloud-storage clients hold a requests session, which must not be
# shared across a fork (DataLoader workers) and is not documented as thread
# safe (replicas can be threads). One client per (process, thread).
_clients = threading.local()


def retry_seconds() -> float:
    """TPUSTREAM_GCS_RETRY_SECONDS (default 120); ConfigError naming the variable if it is not seconds."""
    return positive_seconds("TPUSTREAM_GCS_RETRY_SECONDS", 120.0)


def gcs_retry():
    """The retry policy of every GCS call: the client's default (exponential backoff on
    429, 5xx and dropped connections), for at most TPUSTREAM_GCS_RETRY_SECONDS (120)."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(retry_seconds())


def gcs_failures() -> tuple[type[Exception], ...]:
    """What a GCS call raises once its retries are spent: API errors (RetryError
    included, which is not a GoogleAPICallError), and transport errors that
    surface unwrapped (a connection refused or reset on the last attempt)."""
    import google.auth.exceptions
    import requests
    from google.api_core import exceptions as gexc

    transport = (requests.RequestException, google.auth.exceptions.TransportError, ConnectionError)
    return (gexc.GoogleAPIError, *transport)


def is_gcs(url: str) -> bool:
    return url.startswith(GCS_SCHEME)


def split_gcs_url(url: str) -> tuple[str, str]:
    """Return (bucket, object name) of a gs:// URL."""
    if not is_gcs(url):
        raise StorageError(f"not a gs:// URL: {url!r}")
    rest = url[len(GCS_SCHEME) :]
    bucket, _, name = rest.partition("/")
    if len(bucket) < 3:
        raise StorageError(f"{url}: bucket name {bucket!r} is too short (GCS needs 3+ characters)")
    return bucket, name


def gcs_client():
    """The storage client of this process and thread.

    With STORAGE_EMULATOR_HOST set (tests, the local demo) the client talks to
    the emulator with anonymous credentials; otherwise it uses Application
    Default Credentials, which on a TPU VM are the VM's service account.
    """
    key = (os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST"))
    cached = getattr(_clients, "entry", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        client = storage.Client(project="tpustream-local", credentials=AnonymousCredentials())
    else:
        try:
            client = storage.Client()
        except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and kin
            raise StorageError(
                f"cannot create a GCS client ({exc.__class__.__name__}: {exc}); "
                "run `gcloud auth application-default login` or use a VM service account"
            ) from exc
    _clients.entry = (key, client)
    return client


def _gcs_error(url: str, exc: Exception) -> StorageError:
    from google.api_core import exceptions as gexc

    if isinstance(exc, gexc.NotFound):
        bucket, _ = split_gcs_url(url)
        with contextlib.suppress(*gcs_failures()):
            if not bucket_exists(bucket):
                return StorageError(f"{url}: bucket gs://{bucket} does not exist")
        return StorageError(f"{url}: no such object (404)")
    if isinstance(exc, gexc.Forbidden):
        return StorageError(f"{url}: permission denied (403); check the credentials' IAM roles")
    return StorageError(f"{url}: {exc.__class__.__name__}: {exc}")


def bucket_exists(bucket: str) -> bool:
    from google.api_core import exceptions as gexc

    try:
        return gcs_client().bucket(bucket).exists(retry=gcs_retry())
    except gexc.Forbidden:
        # Object access without bucket metadata access is a normal IAM setup;
        # assume the bucket is there and let object calls report the details.
        return True


def make_container(url: str) -> None:
    """Create the bucket of gs://bucket/... if it does not exist (the demo, tests and benchmarks)."""
    bucket, _ = split_gcs_url(url)
    if not bucket_exists(bucket):
        gcs_client().create_bucket(bucket)


def check_container(url: str) -> None:
    bucket, _ = split_gcs_url(url)
    if not bucket_exists(bucket):
        raise StorageError(f"{url}: bucket gs://{bucket} does not exist; create it first")


def open_read(url: str) -> BinaryIO:
    """Open a gs:// object for streaming binary reads, read ahead by a thread."""
    bucket, name = split_gcs_url(url)
    # Fetching metadata first turns a missing object into a clear error here
    # (after the client's retries) instead of on the first read, and pins the
    # generation so a concurrent rewrite cannot mix two versions.
    blob = _reloaded_blob(url)
    # The JSON API's media download of exactly this generation, on the
    # client's own endpoint (blob.media_link would bypass a configured
    # endpoint: the emulator names itself there).
    client = gcs_client()
    media_url = (
        f"{client.api_endpoint}/download/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
        f"?alt=media&generation={blob.generation}"
    )
    return ReadAheadStream(GcsObjectStream(client._http, media_url, blob.size, url), url)


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
    ):
        self._raw = raw
        self._url = url
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
                from google.api_core import exceptions as gexc

                if isinstance(item, gexc.NotFound | gexc.Forbidden):
                    raise _gcs_error(self._url, item) from item
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


def read_bytes(url: str) -> bytes:
    bucket, name = split_gcs_url(url)
    try:
        return gcs_client().bucket(bucket).blob(name).download_as_bytes(retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def exists(url: str) -> bool:
    bucket, name = split_gcs_url(url)
    try:
        return gcs_client().bucket(bucket).blob(name).exists(retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def list_names(prefix: str) -> list[str]:
    """Names (not URLs) of the objects directly inside a gs:// prefix."""
    bucket, name = split_gcs_url(prefix)
    folder = name.rstrip("/") + "/" if name else ""
    try:
        blobs = gcs_client().list_blobs(bucket, prefix=folder, delimiter="/", retry=gcs_retry())
        # Skip the folder's own placeholder object ("prefix/"), which consoles create.
        return sorted(b.name[len(folder) :] for b in blobs if b.name != folder)
    except gcs_failures() as exc:
        raise _gcs_error(prefix, exc) from exc


def stat(url: str) -> ObjectStat:
    """Size and generation: GCS gives every write of an object a new generation."""
    blob = _reloaded_blob(url)
    return ObjectStat(size=blob.size, version=str(blob.generation))


def _reloaded_blob(url: str):
    """The object's blob with its metadata fetched (size, generation); StorageError naming url if it fails."""
    bucket, name = split_gcs_url(url)
    blob = gcs_client().bucket(bucket).blob(name)
    try:
        # reload() raises NotFound for a missing object (get_blob would
        # return None), so _gcs_error can tell a missing bucket apart.
        blob.reload(retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc
    return blob


def write_bytes(url: str, data: bytes) -> None:
    """Upload data; a GCS object only becomes visible when its upload completes."""
    bucket, name = split_gcs_url(url)
    try:
        blob = gcs_client().bucket(bucket).blob(name)
        # The client retries uploads only under a generation precondition.
        # Ours are whole-object writes of the same bytes, so repeating one
        # is harmless: retry transient errors (429, 5xx, resets) always.
        blob.upload_from_file(io.BytesIO(data), size=len(data), rewind=True, retry=gcs_retry())
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def write_bytes_verified(url: str, data: bytes) -> None:
    """write_bytes for data that must never be seen half-written or corrupted (checkpoints).

    Upload under a temporary name with a crc32c the service checks, then a
    server-side copy to the final name under a generation precondition (the
    final object is still the one we looked at, or absent), then delete the
    temporary object. Readers see the previous complete object or the new one.
    """
    from google.api_core import exceptions as gexc

    bucket_name, name = split_gcs_url(url)
    bucket = gcs_client().bucket(bucket_name)
    temp = bucket.blob(f"{name}.tmp-{uuid.uuid4().hex[:12]}")
    expected = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    try:
        temp.upload_from_file(
            io.BytesIO(data), size=len(data), rewind=True, checksum="crc32c", retry=gcs_retry()
        )
        if temp.crc32c != expected:
            raise StorageError(f"{url}: uploaded crc32c {temp.crc32c} differs from the data's {expected}")
        current = bucket.get_blob(name, retry=gcs_retry())
        bucket.copy_blob(
            temp, bucket, name, if_generation_match=current.generation if current else 0, retry=gcs_retry()
        )
    except gexc.PreconditionFailed as exc:
        # A retried copy whose first attempt went through (its answer was lost
        # on the way back) fails its own precondition: the object is then ours.
        if not _holds(bucket, name, expected, len(data)):
            raise StorageError(
                f"{url}: changed by another writer while we were saving; not overwritten"
            ) from exc
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc
    finally:
        with contextlib.suppress(Exception):
            temp.delete(retry=gcs_retry())


def _holds(bucket, name: str, crc32c: str, size: int) -> bool:
    """Whether the object bucket/name has exactly this crc32c and size."""
    try:
        blob = bucket.get_blob(name, retry=gcs_retry())
    except gcs_failures():
        return False
    return blob is not None and blob.crc32c == crc32c and blob.size == size


def delete(url: str) -> bool:
    """Remove an object; False if it was not there."""
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        gcs_client().bucket(bucket).blob(name).delete(retry=gcs_retry())
        return True
    except gexc.NotFound:
        return False
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc


def has_same_content(url: str, data: bytes) -> bool:
    """Compare size and the service's crc32c, without downloading the object."""
    from google.api_core import exceptions as gexc

    bucket, name = split_gcs_url(url)
    try:
        blob = gcs_client().bucket(bucket).get_blob(name, retry=gcs_retry())
    except gexc.NotFound:
        return False
    except gcs_failures() as exc:
        raise _gcs_error(url, exc) from exc
    if blob is None or blob.size != len(data) or not blob.crc32c:
        return False
    local = base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    return local == blob.crc32c
