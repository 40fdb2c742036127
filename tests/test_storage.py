"""tpustream.storage on a local folder and on a gs:// bucket (the emulator)."""

from __future__ import annotations

import errno
import os
import uuid

import numpy as np
import pytest

from tpustream import storage
from tpustream.errors import StorageError


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


def test_list_names_direct_children_sorted(root):
    for name in ("b.tar", "sub/c.tar", "a.json", "sub/deeper/d.tar", "a.tar"):
        storage.write_bytes(storage.join(root, name), name.encode())
    if storage.is_gcs(root):
        # Folder placeholder objects, as the Cloud Console's "Create folder" makes them.
        bucket, name = storage.split_gcs_url(root)
        for placeholder in (f"{name}/", f"{name}/sub/"):
            storage.gcs_client().bucket(bucket).blob(placeholder).upload_from_string(b"")
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
    # Small GCS chunks: the reader must stitch several range requests together.
    monkeypatch.setattr(storage, "GCS_READ_CHUNK_BYTES", 64 * 1024)
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
    assert not storage.bucket_exists(missing_bucket)
    assert not storage.exists(url)
    assert not storage.has_same_content(url, b"data")


def test_split_gcs_url():
    assert storage.split_gcs_url("gs://abc/x/y.tar") == ("abc", "x/y.tar")
    assert storage.split_gcs_url("gs://abc") == ("abc", "")
    for bad in ("gs://ab/x", "gs://a", "gs://", "gs:///x"):
        with pytest.raises(StorageError, match="too short"):
            storage.split_gcs_url(bad)
    with pytest.raises(StorageError, match="not a gs:// URL"):
        storage.split_gcs_url("/local/path")


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
    monkeypatch.setattr(storage.os, failing, _raise_eio)
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
