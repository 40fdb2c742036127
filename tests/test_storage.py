"""tpustream.storage on a local folder, a gs:// bucket (the emulator), http:// on 127.0.0.1 and pipe:."""

from __future__ import annotations

import errno
import functools
import http.server
import os
import shlex
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tpustream import storage
from tpustream.errors import StorageError
from tpustream.storage import gcs, gcs_streams


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path) -> str:
    """A not-yet-existing local folder, or a prefix in a fresh emulator bucket."""
    if request.param == "local":
        return str(tmp_path / "root")
    return request.getfixturevalue("bucket") + "/root"


@pytest.fixture
def missing_bucket(gcs_emulator) -> str:
    return f"no-such-bucket-{uuid.uuid4().hex[:8]}"


def test_write_read_round_trip(root):
    url = storage.join(root, "sub", "data.bin")
    data = bytes(range(256)) * 40
    storage.write_bytes(url, data)
    assert storage.read_bytes(url) == data
    # Overwriting with shorter content leaves no tail of the old bytes.
    storage.write_bytes(url, b"second")
    assert storage.read_bytes(url) == b"second"
    storage.write_bytes(url, b"")
    assert storage.read_bytes(url) == b""


def test_exists(root):
    url = storage.join(root, "a.txt")
    assert not storage.exists(url)
    storage.write_bytes(url, b"x")
    assert storage.exists(url)
    assert not storage.exists(storage.join(root, "b.txt"))


def test_interrupted_writes_are_the_temporary_objects_a_killed_write_leaves(root):
    """Only the names a write of this scheme makes for itself, not files that merely look alike."""
    assert storage.interrupted_writes(root) == []  # nothing written there yet
    storage.write_bytes_verified(storage.join(root, "last.pt"), b"whole")  # leaves nothing
    storage.write_bytes(storage.join(root, "notes.tmp"), b"the user's")
    storage.write_bytes(storage.join(root, ".hidden"), b"the user's")
    left = ".last.pt.0123456789ab.tmp" if not storage.is_gcs(root) else "last.pt.tmp-0123456789ab"
    if storage.is_gcs(root):
        bucket, name = gcs.split_gcs_url(root)
        gcs.gcs_client().bucket(bucket).blob(f"{name}/{left}").upload_from_string(b"half")
    else:
        Path(root, left).write_bytes(b"half")
    assert storage.interrupted_writes(root) == [storage.join(root, left)]


def test_list_names_direct_children_sorted(root):
    for name in ("b.tar", "sub/c.tar", "a.json", "sub/deeper/d.tar", "a.tar"):
        storage.write_bytes(storage.join(root, name), name.encode())
    if storage.is_gcs(root):
        # Folder placeholder objects, as the Cloud Console's "Create folder" makes them.
        bucket, name = gcs.split_gcs_url(root)
        for placeholder in (f"{name}/", f"{name}/sub/"):
            gcs.gcs_client().bucket(bucket).blob(placeholder).upload_from_string(b"")
    assert storage.list_names(root) == ["a.json", "a.tar", "b.tar"]
    assert storage.list_names(root + "/") == ["a.json", "a.tar", "b.tar"]
    assert storage.list_names(storage.join(root, "sub")) == ["c.tar"]
    assert storage.list_names(storage.join(root, "sub", "deeper")) == ["d.tar"]


def test_has_same_content(root):
    url = storage.join(root, "shard.tar")
    data = b"0123456789" * 100
    assert not storage.has_same_content(url, data)  # missing
    storage.write_bytes(url, data)
    assert storage.has_same_content(url, data)
    assert not storage.has_same_content(url, data[:-1] + b"X")  # same size, other bytes
    assert not storage.has_same_content(url, data + b"0")
    assert not storage.has_same_content(url, b"")


def test_open_read_streams(root, monkeypatch):
    # Small read-ahead pieces: the reader must stitch many of them together.
    monkeypatch.setattr(gcs_streams, "READ_AHEAD_PIECE_BYTES", 64 * 1024)
    data = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    url = storage.join(root, "big.bin")
    storage.write_bytes(url, data)
    parts = []
    with storage.open_read(url) as f:
        while chunk := f.read(10_000):
            assert len(chunk) <= 10_000
            parts.append(chunk)
        assert f.read(10) == b""
    assert b"".join(parts) == data
    assert len(parts) > 1


def test_delete(root):
    url = storage.join(root, "gone.bin")
    storage.write_bytes(url, b"x")
    assert storage.delete(url) is True
    assert not storage.exists(url)
    assert storage.delete(url) is False


def test_join_dirname_absolute(root):
    url = storage.join(root, "a", "b.tar")
    assert url == root + "/a/b.tar"
    assert storage.dirname(url) == storage.join(root, "a")
    assert storage.dirname(storage.dirname(url)) == root
    assert storage.absolute(url) == url
    assert storage.is_gcs(url) == root.startswith("gs://")


def test_gcs_join_and_absolute():
    assert storage.join("gs://bkt/x/", "/y/", "z.tar") == "gs://bkt/x/y/z.tar"
    assert storage.join("gs://bkt", "train") == "gs://bkt/train"
    assert storage.dirname("gs://bkt/x/y/") == "gs://bkt/x"
    assert storage.absolute("gs://bkt/rel") == "gs://bkt/rel"


def test_local_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.absolute("rel/x.tar") == str(tmp_path / "rel" / "x.tar")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert storage.absolute("~/d") == str(tmp_path / "home" / "d")


def test_missing_object_errors_name_the_url(root):
    url = storage.join(root, "missing.bin")
    with pytest.raises(StorageError, match="missing.bin") as read_error:
        storage.read_bytes(url)
    assert url in str(read_error.value)
    with pytest.raises(StorageError) as open_error:
        storage.open_read(url)
    assert url in str(open_error.value)
    if storage.is_gcs(url):
        assert "no such object" in str(read_error.value)
        assert "does not exist" not in str(read_error.value)


def test_missing_bucket_errors(missing_bucket):
    url = f"gs://{missing_bucket}/x/y.tar"
    message = f"bucket gs://{missing_bucket} does not exist"
    for call in (
        lambda: storage.read_bytes(url),
        lambda: storage.open_read(url),
        lambda: storage.list_names(f"gs://{missing_bucket}/x"),
        lambda: storage.write_bytes(url, b"data"),
    ):
        with pytest.raises(StorageError, match=message):
            call()
    assert not gcs.bucket_exists(missing_bucket)
    assert not storage.exists(url)
    assert not storage.has_same_content(url, b"data")


def test_make_container_creates_a_bucket_or_a_folder_once(missing_bucket, tmp_path):
    for container in (f"gs://{missing_bucket}", str(tmp_path / "a" / "b")):
        storage.make_container(container)
        storage.make_container(container)  # already there: nothing to do
        storage.write_bytes(storage.join(container, "x"), b"data")
        assert storage.read_bytes(storage.join(container, "x")) == b"data"
    with pytest.raises(StorageError, match="read-only"):
        storage.make_container("http://127.0.0.1:9/data")


def test_split_gcs_url():
    assert gcs.split_gcs_url("gs://abc/x/y.tar") == ("abc", "x/y.tar")
    assert gcs.split_gcs_url("gs://abc") == ("abc", "")
    for bad in ("gs://ab/x", "gs://a", "gs://", "gs:///x"):
        with pytest.raises(StorageError, match="too short"):
            gcs.split_gcs_url(bad)
    with pytest.raises(StorageError, match="not a gs:// URL"):
        gcs.split_gcs_url("/local/path")


def test_local_missing_folder_and_bad_parent(tmp_path):
    with pytest.raises(StorageError, match="nope"):
        storage.list_names(str(tmp_path / "nope"))
    (tmp_path / "file").write_bytes(b"x")
    url = str(tmp_path / "file" / "child.bin")
    with pytest.raises(StorageError) as exc:
        storage.write_bytes(url, b"data")
    assert url in str(exc.value)


def _raise_eio(*args, **kwargs):
    raise OSError(errno.EIO, "injected I/O error")


@pytest.mark.parametrize("failing", ["fsync", "replace"])
@pytest.mark.parametrize("had_old", [True, False])
def test_local_failed_write_keeps_old_content(tmp_path, monkeypatch, failing, had_old):
    url = str(tmp_path / "shard.tar")
    if had_old:
        storage.write_bytes(url, b"old content")
    monkeypatch.setattr(storage.local.os, failing, _raise_eio)
    with pytest.raises(StorageError, match="injected I/O error") as exc:
        storage.write_bytes(url, b"new content that never lands")
    monkeypatch.undo()
    assert url in str(exc.value)
    if had_old:
        assert storage.read_bytes(url) == b"old content"
        assert os.listdir(tmp_path) == ["shard.tar"]
    else:
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_local_write_mode_follows_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        url = str(tmp_path / "new" / "file.bin")
        storage.write_bytes(url, b"data")
    finally:
        os.umask(previous)
    assert os.stat(url).st_mode & 0o777 == mode
    assert storage.read_bytes(url) == b"data"


def test_gcs_read_ahead_stream_reads_everything_and_closes_early(bucket, monkeypatch):
    monkeypatch.setattr(gcs_streams, "READ_AHEAD_PIECE_BYTES", 1000)
    monkeypatch.setattr(gcs_streams, "READ_AHEAD_PIECES", 2)
    data = os.urandom(10_000)
    url = storage.join(bucket, "stream.bin")
    storage.write_bytes(url, data)
    with storage.open_read(url) as stream:
        assert isinstance(stream, gcs.ReadAheadStream)
        parts = []
        while piece := stream.read(777):
            assert len(piece) <= 777
            parts.append(piece)
    assert b"".join(parts) == data
    with storage.open_read(url) as stream:
        assert stream.read(10) == data[:10]  # closing with unread pieces queued must not hang
    assert stream._thread.is_alive() is False


def test_read_ahead_errors_are_raised_by_read_naming_the_url():
    class Failing:
        def __init__(self):
            self.calls = 0

        def read(self, n):
            self.calls += 1
            if self.calls > 1:
                raise ConnectionResetError("peer went away")
            return b"x" * n

        def close(self):
            pass

    stream = gcs.ReadAheadStream(Failing(), "gs://bkt/shard.tar", piece_bytes=4, pieces=1)
    assert stream.read(4) == b"xxxx"
    with pytest.raises(
        StorageError, match=r"gs://bkt/shard.tar: read failed \(ConnectionResetError: peer went away\)"
    ):
        stream.read(4)
    stream.close()


class FakeResponse:
    def __init__(self, status: int, body: bytes = b"", break_after: int | None = None):
        self.status_code = status
        self._body = body
        self._pos = 0
        self._break_after = break_after
        self.raw = self

    def read(self, n, decode_content=False):
        if self._break_after is not None and self._pos >= self._break_after:
            raise ConnectionResetError("connection reset by peer")
        end = self._pos + n if self._break_after is None else min(self._pos + n, self._break_after)
        data = self._body[self._pos : end]
        self._pos += len(data)
        return data

    def close(self):
        pass


class FakeSession:
    """Serves `data`, breaking or failing requests as scripted: one entry per GET."""

    def __init__(self, data: bytes, script: list):
        self.data = data
        self.script = list(script)
        self.ranges: list[str | None] = []

    def get(self, url, headers, stream, timeout):
        self.ranges.append(headers.get("Range"))
        start = int(headers["Range"][6:-1]) if "Range" in headers else 0
        action = self.script.pop(0) if self.script else "ok"
        if isinstance(action, int):
            return FakeResponse(action)
        if action == "ignore-range":
            return FakeResponse(200, self.data)
        body = self.data[start:]
        status = 206 if start else 200
        if action == "break":
            return FakeResponse(status, body, break_after=len(body) // 3)
        return FakeResponse(status, body)


def read_all(stream, piece=4096):
    out = []
    while chunk := stream.read(piece):
        out.append(chunk)
    return b"".join(out)


def test_gcs_stream_resumes_at_the_byte_reached(monkeypatch):
    monkeypatch.setattr(gcs_streams.time, "sleep", lambda s: None)
    data = os.urandom(100_000)
    session = FakeSession(data, ["break", 503, "break", 429, "ok"])
    stream = gcs.GcsObjectStream(session, "https://gcs/o", len(data), "gs://bkt/shard.tar")
    assert read_all(stream) == data
    assert session.ranges[0] is None
    offsets = [int(r[6:-1]) for r in session.ranges[1:]]
    assert offsets == sorted(offsets) and offsets[0] > 0  # resumed, never rewound


def test_gcs_stream_gives_up_and_refuses_a_server_that_ignores_ranges(monkeypatch):
    monkeypatch.setattr(gcs_streams.time, "sleep", lambda s: None)
    data = os.urandom(10_000)
    stream = gcs.GcsObjectStream(FakeSession(data, [503] * 20), "u", len(data), "gs://bkt/a.tar")
    with pytest.raises(StorageError, match=r"gs://bkt/a.tar: download failed 8 times at byte 0 \(HTTP 503\)"):
        stream.read(100)
    stream = gcs.GcsObjectStream(
        FakeSession(data, ["break", "ignore-range"]), "u", len(data), "gs://bkt/b.tar"
    )
    with pytest.raises(StorageError, match="ignored a ranged read"):
        read_all(stream)
    stream = gcs.GcsObjectStream(FakeSession(data, [404]), "u", len(data), "gs://bkt/c.tar")
    with pytest.raises(StorageError, match=r"gs://bkt/c.tar: no such object \(404\)"):
        stream.read(1)


@pytest.fixture
def http_folder(tmp_path) -> Iterator[tuple[Path, str]]:
    """A folder served over http://127.0.0.1 for the test; yields (folder, its URL)."""
    folder = tmp_path / "served"
    folder.mkdir()

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_scheme_table_picks_one_module_per_scheme():
    assert storage.find_scheme("/data/x.tar") is storage.local
    assert storage.find_scheme("rel/odd://name.tar") is storage.local  # not a scheme: has a '/'
    assert storage.find_scheme("file:///data/x.tar") is storage.local
    assert storage.find_scheme("gs://bkt/x.tar") is storage.gcs
    for url in ("http://host/x.tar", "https://host/x.tar", "pipe:cat /data/x.tar"):
        assert storage.find_scheme(url) is storage.remote
    with pytest.raises(StorageError, match=r"^s3://bkt/x.tar: unsupported URL scheme s3://"):
        storage.read_bytes("s3://bkt/x.tar")


def test_urls_of_every_scheme_join_with_slashes_and_stay_as_they_are():
    for base in ("file:///data", "http://host/data/", "https://host/data", "gs://bkt/data"):
        assert storage.join(base, "a", "/b.tar") == base.rstrip("/") + "/a/b.tar"
        assert storage.dirname(storage.join(base, "a", "b.tar")) == base.rstrip("/") + "/a"
        assert storage.absolute(base) == base
    assert storage.absolute("pipe:cat x.tar") == "pipe:cat x.tar"


def test_file_urls_reach_local_files(tmp_path):
    path = tmp_path / "dir" / "x.bin"
    url = (tmp_path / "dir").as_uri() + "/x.bin"
    storage.write_bytes(url, b"through file://")
    assert path.read_bytes() == b"through file://"
    assert storage.read_bytes(url) == b"through file://"
    with storage.open_read(url) as f:
        assert f.read() == b"through file://"
    assert storage.exists(url)
    assert storage.list_names((tmp_path / "dir").as_uri()) == ["x.bin"]
    assert storage.stat(url) == storage.stat(str(path))
    assert storage.has_same_content(url, b"through file://")
    assert storage.delete(url) and not path.exists()
    with pytest.raises(StorageError, match="file:// URLs must name this machine"):
        storage.read_bytes("file://otherhost/x.bin")


def test_http_urls_read_through_gopen(http_folder):
    folder, base = http_folder
    data = os.urandom(300_000)
    (folder / "shard.tar").write_bytes(data)
    url = f"{base}/shard.tar"
    assert storage.read_bytes(url) == data
    parts = []
    with storage.open_read(url) as f:
        while chunk := f.read(10_000):
            parts.append(chunk)
    assert b"".join(parts) == data
    assert storage.exists(url)
    assert not storage.exists(f"{base}/missing.tar")
    assert storage.has_same_content(url, data)
    info = storage.stat(url)
    assert info.size == len(data) and info.version  # SimpleHTTPRequestHandler sends Last-Modified
    with pytest.raises(StorageError, match=r"missing.tar: no such object \(HTTP 404\)"):
        storage.stat(f"{base}/missing.tar")
    with pytest.raises(StorageError, match=r"missing.tar: read failed \(the server answered with an HTTP"):
        storage.read_bytes(f"{base}/missing.tar")
    with pytest.raises(StorageError) as listing:
        storage.list_names(base)
    assert str(listing.value) == (
        f"{base}: cannot list http:// URLs; give a brace pattern or a list of shard URLs"
    )


def test_pipe_urls_read_a_command_output(tmp_path):
    data = os.urandom(4_000_000)  # more than the pipe and read buffers: the command is still writing
    path = tmp_path / "shard.tar"
    path.write_bytes(data)
    url = f"pipe:cat {shlex.quote(str(path))}"
    assert storage.read_bytes(url) == data
    with storage.open_read(url) as f:
        assert f.read(10) == data[:10]  # closing early (the command gets SIGPIPE) is not an error
    assert storage.exists(url)
    missing = f"pipe:cat {shlex.quote(str(tmp_path / 'missing.tar'))} 2>/dev/null"
    assert not storage.exists(missing)
    with pytest.raises(
        StorageError, match=r"missing.tar 2>/dev/null: read failed \(the command exited with status 1\)"
    ):
        storage.read_bytes(missing)
    with pytest.raises(StorageError, match="pipe: URLs have no size or version"):
        storage.stat(url)
    with pytest.raises(StorageError, match="cannot list pipe: URLs"):
        storage.list_names("pipe:ls")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9/out/x.tar", "https://example.invalid/x.tar", "pipe:cat > /tmp/x.tar"]
)
@pytest.mark.parametrize("operation", ["write_bytes", "write_bytes_verified", "delete", "probe_writable"])
def test_read_only_schemes_refuse_writes_in_one_line(url, operation):
    call = getattr(storage, operation)
    with pytest.raises(StorageError) as refused:
        call(url, b"data") if operation.startswith("write") else call(url)
    message = str(refused.value)
    assert message.startswith(url) and "read-only" in message and "\n" not in message


def test_local_stat_gives_size_and_a_new_version_per_rewrite(tmp_path):
    url = str(tmp_path / "shard.tar")
    storage.write_bytes(url, b"first")
    first = storage.stat(url)
    info = os.stat(url)
    assert first == storage.ObjectStat(size=5, version=f"{info.st_ino}-{info.st_mtime_ns}")
    # File times come from the kernel's coarse clock (a few ms per tick).
    time.sleep(0.05)
    storage.write_bytes(url, b"other")
    second = storage.stat(url)
    assert second.size == 5 and second.version != first.version
    with pytest.raises(StorageError, match="missing.tar"):
        storage.stat(str(tmp_path / "missing.tar"))
    with pytest.raises(StorageError, match="not a regular file"):
        storage.stat(str(tmp_path))


def test_gcs_stat_gives_size_and_generation(bucket, missing_bucket):
    url = f"{bucket}/shard.tar"
    storage.write_bytes(url, b"first")
    first = storage.stat(url)
    bucket_name, name = gcs.split_gcs_url(url)
    blob = gcs.gcs_client().bucket(bucket_name).get_blob(name)
    assert first == storage.ObjectStat(size=5, version=str(blob.generation))
    storage.write_bytes(url, b"other")
    second = storage.stat(url)
    assert second.size == 5 and second.version != first.version
    with pytest.raises(StorageError, match=r"missing.tar: no such object \(404\)"):
        storage.stat(f"{bucket}/missing.tar")
    with pytest.raises(StorageError, match=f"bucket gs://{missing_bucket} does not exist"):
        storage.stat(f"gs://{missing_bucket}/shard.tar")


def test_probe_writable_leaves_nothing_behind(root):
    storage.probe_writable(root)
    assert storage.list_names(root) == []


def test_probe_writable_names_an_unwritable_local_folder(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a 0o500 folder is still writable")
        with pytest.raises(StorageError, match=r"read-only: cannot write here \(Permission denied\)"):
            storage.probe_writable(str(folder))
    finally:
        folder.chmod(0o700)


def test_probe_writable_names_a_missing_bucket(missing_bucket):
    folder = f"gs://{missing_bucket}/run"
    with pytest.raises(StorageError) as refused:
        storage.probe_writable(folder)
    assert str(refused.value) == f"{folder}: cannot write here (bucket gs://{missing_bucket} does not exist)"


def test_copy_replaces_the_target_whole_without_rewriting_the_bytes(root, tmp_path):
    """best.pt as a copy of last.pt: a hard link locally, a server-side copy on GCS."""
    source, target = f"{root}/last.pt", f"{root}/best.pt"
    storage.write_bytes_verified(source, b"epoch 3")
    storage.write_bytes_verified(target, b"an older best")
    storage.copy(source, target)
    assert storage.read_bytes(target) == b"epoch 3" and storage.read_bytes(source) == b"epoch 3"
    if not root.startswith("gs://"):  # the same bytes on disk, and no temporary file left behind
        assert os.stat(target).st_ino == os.stat(source).st_ino
        assert sorted(os.listdir(root)) == ["best.pt", "last.pt"]
    storage.write_bytes_verified(source, b"epoch 4")  # a later last.pt leaves the copy as it was
    assert storage.read_bytes(target) == b"epoch 3"
    with pytest.raises(StorageError):
        storage.copy(f"{root}/missing.pt", target)
    assert storage.read_bytes(target) == b"epoch 3"
    # Across schemes the bytes are read and written.
    local = str(tmp_path / "copied.pt")
    storage.copy(source, local)
    assert storage.read_bytes(local) == b"epoch 4"
