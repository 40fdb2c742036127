"""The streaming tar reader against WebDataset's own: formats, grouping, windows, counting, gzip, damage."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest
import webdataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from webdataset.tariterators import tarfile_to_samples

from tpustream.data.format.tar import (
    READ_CHUNK,
    GunzipStream,
    ShardFormatError,
    count_shard_samples,
    iter_shard_samples,
    open_tar_stream,
    split_member_name,
    write_tar,
)

REGULAR, DIRECTORY, SYMLINK, HARDLINK, FIFO, CONTIGUOUS = "0", "5", "2", "1", "6", "7"


def tar_with(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT, **options) -> bytes:
    """A tar of (name, data) regular members, or (name, kind) with kind one of the constants above."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, **options) as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if isinstance(content, str):  # a member type, without data
                info.type = content.encode()
                info.linkname = "target.png" if content in (SYMLINK, HARDLINK) else ""
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def webdataset_samples(data: bytes, tmp_path: Path, suffix: str = ".tar") -> tuple[list[dict], str | None]:
    """WebDataset's samples for a tar (file) and the error that stopped it, if any."""
    path = tmp_path / f"shard{suffix}"
    path.write_bytes(data)
    samples: list[dict] = []
    try:
        for sample in tarfile_to_samples()([{"url": str(path)}]):
            assert sample.pop("__url__") == str(path)
            samples.append(sample)
    except ValueError as exc:  # group_by_keys: a sample with two members of one field
        return samples, str(exc)
    return samples, None


def read_all(data: bytes, start: int = 0, stop: int | None = None, url: str = "mem://t.tar") -> list[dict]:
    out = list(iter_shard_samples(io.BytesIO(data), url, start, stop))
    for position, sample in enumerate(out, start):
        assert sample.pop("__url__") == url
        assert sample.pop("__index__") == position  # the sample's index in its shard
    return out


def read_until_error(data: bytes) -> tuple[list[dict], str | None]:
    samples: list[dict] = []
    try:
        for sample in iter_shard_samples(io.BytesIO(data), "mem://t.tar"):
            del sample["__url__"], sample["__index__"]
            samples.append(sample)
    except ShardFormatError as exc:
        return samples, str(exc)
    return samples, None


def is_resource_fork(name: str) -> bool:
    return name.rpartition("/")[2].startswith("._")


def assert_matches_webdataset(members: list[tuple[str, bytes | str]], tmp_path: Path, fmt: int) -> None:
    data = tar_with(members, fmt)
    ours, our_error = read_until_error(data)
    # The one intended difference: macOS resource forks (._*) are skipped here;
    # WebDataset reads dir/._a.jpg as sample "dir/". Without them the two agree.
    # (By the names tarfile reads: it strips trailing slashes from pax paths.)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        read_names = [member.name for member in tar.getmembers()]
    kept = [member for member, name in zip(members, read_names, strict=True) if not is_resource_fork(name)]
    theirs, their_error = webdataset_samples(tar_with(kept, fmt), tmp_path)
    assert ours == theirs
    assert (our_error is None) == (their_error is None), (our_error, their_error)
    if our_error is None:
        assert count_shard_samples(io.BytesIO(data), "mem://t.tar") == len(ours)
    else:
        assert "has two" in our_error
        with pytest.raises(ShardFormatError, match="has two"):
            count_shard_samples(io.BytesIO(data), "mem://t.tar")


TRICKY_MEMBERS = [
    ("__key__", b"top-level meta"),
    ("__meta__.json", b"a key that looks like meta, but has an extension"),
    ("__index__/a.jpg", b"in a meta folder"),
    ("top.jpg", b"t"),
    ("top.CLS", b"1"),
    ("._top.jpg", b"resource fork, top level"),
    ("dir/._a.jpg", b"resource fork in a folder"),
    ("dir/", DIRECTORY),
    ("dir/a.jpg", b"a"),
    ("dir/a.seg.PNG", b"multi-dot, upper case"),
    ("dir/a..b", b"empty extension part"),
    ("dir/link.jpg", SYMLINK),
    ("dir/hard.jpg", HARDLINK),
    ("dir/fifo.jpg", FIFO),
    ("dir/a.txt", b"still sample dir/a"),
    ("dir/README", b"no extension"),
    ("dir/.hidden", b"hidden, no key"),
    ("d.x/b.jpg", b"dot in the folder"),
    ("d.x/b", b"no dot in the base name"),
    ("dir/contiguous.jpg", CONTIGUOUS),
    ("x" * 120 + "/long.jpg", b"pax or GNU long name"),
    ("x" * 120 + "/long.cls", b"7"),
    ("y/" + "z" * 99 + ".png", b"long base name"),
    ("dir/a.jpg", b"dir/a again, later: a new sample"),
    ("ünïcode/É.JPG", b"non-ASCII, lower-cased"),
]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_tricky_names_group_as_webdataset_groups_them(fmt, tmp_path):
    assert_matches_webdataset(TRICKY_MEMBERS, tmp_path, fmt)
    samples = read_all(tar_with(TRICKY_MEMBERS, fmt))
    assert [sample["__key__"] for sample in samples] == [
        "__meta__",
        "top",
        "dir/a",  # links, a FIFO, a folder and a resource fork in between do not split it
        "dir/",  # dir/.hidden, as WebDataset reads it
        "d.x/b",
        "dir/contiguous",
        "x" * 120 + "/long",
        "y/" + "z" * 99,
        "dir/a",  # again, later: a new sample
        "ünïcode/É",
    ]
    assert samples[2] == {
        "__key__": "dir/a",
        "jpg": b"a",
        "seg.png": b"multi-dot, upper case",
        ".b": b"empty extension part",
        "txt": b"still sample dir/a",
    }
    assert samples[1] == {"__key__": "top", "jpg": b"t", "cls": b"1"}
    assert samples[-1] == {"__key__": "ünïcode/É", "jpg": b"non-ASCII, lower-cased"}


def test_resource_forks_are_the_one_difference_from_webdataset(tmp_path):
    members = [("dir/._a.jpg", b"fork"), ("dir/a.jpg", b"image")]
    theirs, _ = webdataset_samples(tar_with(members), tmp_path)
    assert theirs == [{"__key__": "dir/", "_a.jpg": b"fork"}, {"__key__": "dir/a", "jpg": b"image"}]
    assert read_all(tar_with(members)) == [{"__key__": "dir/a", "jpg": b"image"}]


def test_member_names_split_as_webdataset_splits_them():
    assert split_member_name("dir/a.seg.PNG") == ("dir/a", "seg.png")
    assert split_member_name("dir/.DS_Store") == ("dir/", "ds_store")  # WebDataset's quirk, kept
    for skipped in ("__key__", "__a__/b.jpg", "._a.jpg", "dir/._a.jpg", "README", "a.b/c", "a.b\n/c.jpg"):
        assert split_member_name(skipped) is None, skipped
    assert split_member_name("a.jpg\n") == ("a", "jpg\n")  # "$" matches before a final newline


names = st.lists(
    st.one_of(
        st.text(alphabet="ab_./É\n", min_size=1, max_size=10),
        st.sampled_from(["__key__", "__a__/b.jpg", "._b.jpg", "d/._b.jpg", "s.JPG", "s.jpg", "s.cls"]),
    ),
    min_size=1,
    max_size=3,
).map("/".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    members=st.lists(
        st.tuples(
            names,
            st.one_of(st.binary(max_size=600), st.sampled_from([DIRECTORY, SYMLINK, HARDLINK, FIFO])),
        ),
        max_size=14,
    ),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    long_prefix=st.sampled_from([0, 0, 95, 160]),
)
def test_random_members_group_as_webdataset_groups_them(members, fmt, long_prefix, tmp_path):
    members = [("p" * long_prefix + "/" + name if long_prefix else name, c) for name, c in members]
    assert_matches_webdataset(members, tmp_path, fmt)


member_names = st.text(alphabet="abcxyz01_", min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(
    samples=st.lists(
        st.tuples(
            st.lists(member_names, min_size=1, max_size=3),  # folder parts (long paths -> pax/GNU)
            st.lists(
                st.sampled_from(["png", "cls", "JPG", "json", "seg.png"]), min_size=1, max_size=3, unique=True
            ),
            st.binary(max_size=1500),
        ),
        max_size=12,
    ),
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    long_prefix=st.integers(0, 160),
    window=st.tuples(st.integers(0, 13), st.integers(0, 13)),
)
def test_windows_and_counts_agree_with_a_full_read(samples, fmt, long_prefix, window):
    members = []
    for index, (parts, exts, payload) in enumerate(samples):
        folder = "/".join(parts)
        if fmt != tarfile.USTAR_FORMAT:
            folder = "d" * long_prefix + folder  # names beyond 100 bytes need pax or GNU records
        for ext in exts:
            members.append((f"{folder}/s{index:04d}.{ext}", payload + ext.encode()))
    data = tar_with(members, fmt)
    everything = read_all(data)
    assert [s["__key__"] for s in everything] == [
        f"{'d' * long_prefix if fmt != tarfile.USTAR_FORMAT else ''}{'/'.join(p)}/s{i:04d}"
        for i, (p, _, _) in enumerate(samples)
    ]
    assert count_shard_samples(io.BytesIO(data), "mem://t.tar") == len(samples)
    start, stop = window
    assert read_all(data, start, stop) == everything[start:stop]


def test_long_names_use_pax_and_gnu_records():
    name = "x" * 150 + "/sample.png"
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        assert read_all(tar_with([(name, b"abc")], fmt)) == [
            {"__key__": "x" * 150 + "/sample", "png": b"abc"}
        ]


def test_global_pax_headers_are_not_members(tmp_path):
    members = [("a.png", b"1"), ("a.cls", b"2")]
    data = tar_with(members, tarfile.PAX_FORMAT, pax_headers={"comment": "made by a test"})
    assert read_all(data) == [{"__key__": "a", "png": b"1", "cls": b"2"}]
    assert read_all(data) == webdataset_samples(data, tmp_path)[0]


def test_a_key_that_comes_back_starts_a_new_sample():
    data = write_tar([("a.png", b"1"), ("b.png", b"2"), ("a.cls", b"3")])
    assert [s["__key__"] for s in read_all(data)] == ["a", "b", "a"]
    assert count_shard_samples(io.BytesIO(data), "mem://t.tar") == 3


@pytest.mark.parametrize("start", [0, 1])
def test_two_members_of_one_field_are_an_error(start, tmp_path):
    data = write_tar([("a.png", b"1"), ("b.jpg", b"2"), ("b.JPG", b"3"), ("c.png", b"4")])
    theirs, their_error = webdataset_samples(data, tmp_path)
    assert [s["__key__"] for s in theirs] == ["a"] and "duplicate file name" in their_error
    reader = iter_shard_samples(io.BytesIO(data), "mem://dup.tar", start)
    if start == 0:
        assert next(reader)["__key__"] == "a"
    with pytest.raises(ShardFormatError, match="mem://dup.tar: sample b has two jpg members"):
        next(reader)
    with pytest.raises(ShardFormatError, match="has two jpg members"):
        count_shard_samples(io.BytesIO(data), "mem://dup.tar")


def test_window_skips_and_stops_at_sample_boundaries():
    members = [(f"{i:03d}.{ext}", f"{i}{ext}".encode()) for i in range(10) for ext in ("png", "cls")]
    data = write_tar(members)
    window = read_all(data, 3, 6)
    assert [s["__key__"] for s in window] == ["003", "004", "005"]
    assert window[0] == {"__key__": "003", "png": b"3png", "cls": b"3cls"}
    assert read_all(data, 8) == read_all(data)[8:]
    assert read_all(data, 0, 0) == []


def test_large_members_cross_read_chunks():
    big = bytes(range(256)) * 9000  # > 2 MiB: spans several 1 MiB reads
    data = write_tar([("a.bin", big), ("a.cls", b"1"), ("b.bin", big[::-1])])
    assert read_all(data) == [{"__key__": "a", "bin": big, "cls": b"1"}, {"__key__": "b", "bin": big[::-1]}]
    assert read_all(data, 1) == [{"__key__": "b", "bin": big[::-1]}]
    assert count_shard_samples(io.BytesIO(data), "mem://t.tar") == 2


def patch_header(data: bytes, offset: int, **fields: bytes) -> bytes:
    """data with fields of the header at offset replaced and its checksum recomputed."""
    layout = {"name": (0, 100), "size": (124, 136), "type": (156, 157), "magic": (257, 263)}
    header = bytearray(data[offset : offset + 512])
    for field, value in fields.items():
        begin, end = layout[field]
        header[begin:end] = value.ljust(end - begin, b"\0")
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return data[:offset] + bytes(header) + data[offset + 512 :]


def test_crafted_headers_read_as_tarfile_reads_them(tmp_path):
    data = tar_with([("a.png", b"1" * 10), ("l.png", HARDLINK), ("b.png", b"2")], tarfile.GNU_FORMAT)
    # A hard link's size field is ignored (no data follows it), as tarfile ignores it.
    data = patch_header(data, 1024, size=b"00000001000")
    # A v7 header (no magic) for b.png; a v7 regular member whose name ends in "/" is a folder.
    data = patch_header(data, 1536, magic=b"", type=b"\0")
    expected = [{"__key__": "a", "png": b"1" * 10}, {"__key__": "b", "png": b"2"}]
    assert read_all(data) == webdataset_samples(data, tmp_path)[0] == expected
    folder = patch_header(data, 1536, magic=b"", type=b"\0", name=b"b.png/")
    assert read_all(folder) == webdataset_samples(folder, tmp_path)[0] == expected[:1]


def test_sparse_members_are_refused():
    data = patch_header(write_tar([("a.png", b"1")]), 0, type=b"S")
    with pytest.raises(ShardFormatError, match="mem://t.tar: sparse member at byte 0 is not supported"):
        read_all(data)


def test_truncated_shard_yields_complete_samples_then_raises():
    data = write_tar([(f"{i:03d}.png", bytes(700)) for i in range(6)])
    cut = data[: 512 + 1024 + 512 + 1024 + 512 + 300]  # 2 whole members, then half of the third
    reader = iter_shard_samples(io.BytesIO(cut), "mem://cut.tar")
    assert [next(reader)["__key__"], next(reader)["__key__"]] == ["000", "001"]
    with pytest.raises(ShardFormatError, match="mem://cut.tar: truncated"):
        next(reader)
    boundary = iter_shard_samples(io.BytesIO(data[: 3 * 1536]), "mem://edge.tar")
    assert [s["__key__"] for s in (next(boundary), next(boundary))] == ["000", "001"]
    with pytest.raises(ShardFormatError, match="no end-of-archive marker"):
        next(boundary)  # "002" may be incomplete: it is not yielded
    with pytest.raises(ShardFormatError, match="truncated tar header"):
        list(iter_shard_samples(io.BytesIO(data[:300]), "mem://hdr.tar"))
    for shard in (cut, data[: 3 * 1536], data[:300]):
        with pytest.raises(ShardFormatError, match="mem://c.tar: truncated"):
            count_shard_samples(io.BytesIO(shard), "mem://c.tar")


def test_garbage_is_rejected_with_the_url():
    with pytest.raises(ShardFormatError, match="mem://junk.tar"):
        list(iter_shard_samples(io.BytesIO(b"\x89PNG" + bytes(2000)), "mem://junk.tar"))
    with pytest.raises(ShardFormatError, match="mem://junk.tar"):
        count_shard_samples(io.BytesIO(b"\x89PNG" + bytes(2000)), "mem://junk.tar")
    data = bytearray(write_tar([("a.png", b"x" * 10), ("b.png", b"y" * 10)]))
    data[1024 + 124 : 1024 + 136] = b"77777777777\0"  # corrupt the size of the second member
    with pytest.raises(ShardFormatError):
        list(iter_shard_samples(io.BytesIO(bytes(data) + bytes(10**6)), "mem://bad.tar"))


def test_write_tar_is_deterministic_and_readable_by_webdataset(tmp_path):
    members = [("k1.png", b"one"), ("k1.cls", b"1"), ("k2.png", b"two"), ("k2.cls", b"2")]
    assert write_tar(members) == write_tar(members)
    assert webdataset_samples(write_tar(members), tmp_path)[0] == [
        {"__key__": "k1", "png": b"one", "cls": b"1"},
        {"__key__": "k2", "png": b"two", "cls": b"2"},
    ]


class ForwardOnly(io.RawIOBase):
    """A stream that can only be read forward, recording its reads and whether it was closed."""

    def __init__(self, data: bytes):
        super().__init__()
        self._source = io.BytesIO(data)
        self.reads: list[int] = []

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self.reads.append(size)
        return self._source.read(size)

    def seekable(self) -> bool:
        return False

    def seek(self, *args) -> int:
        raise AssertionError("seek on a forward-only stream")

    def tell(self) -> int:
        raise AssertionError("tell on a forward-only stream")


SHARD_MEMBERS = [(f"s{i:04d}.{ext}", f"{i}{ext}".encode() * 50) for i in range(300) for ext in ("png", "cls")]


def test_plain_tars_are_returned_as_they_are():
    stream = io.BytesIO(write_tar(SHARD_MEMBERS))
    assert open_tar_stream(stream, "gs://b/s.tar") is stream


@pytest.mark.parametrize("url", ["gs://b/s.tar.gz", "gs://b/s.tgz", "/data/S.TAR.GZ"])
def test_gzipped_tars_stream_without_seeking(url):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, payload in SHARD_MEMBERS:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    raw = ForwardOnly(out.getvalue())
    with open_tar_stream(raw, url) as stream:
        assert read_all(stream.read(), url="x") == read_all(write_tar(SHARD_MEMBERS), url="x")
    assert raw.closed  # closing the gunzip stream closes the stream under it
    assert set(raw.reads) == {READ_CHUNK}  # large reads only
    stream = open_tar_stream(ForwardOnly(out.getvalue()), url)
    assert count_shard_samples(stream, url) == 300


def test_webdataset_shardwriter_gz_shards_read_as_webdataset_reads_them(tmp_path):
    pattern = str(tmp_path / "shard-%02d.tar.gz")
    with webdataset.ShardWriter(pattern, maxcount=40) as sink:
        for i in range(50):
            sink.write({"__key__": f"k{i:03d}", "png": bytes([i]) * 300, "cls": str(i % 7)})
    paths = sorted(tmp_path.glob("shard-*.tar.gz"))
    assert len(paths) == 2
    for path in paths:
        url = str(path)
        with open(path, "rb") as raw, open_tar_stream(raw, url) as stream:
            ours = list(iter_shard_samples(stream, url))
        for sample in ours:
            del sample["__index__"]
        assert ours == list(tarfile_to_samples()([{"url": url}]))
        with open(path, "rb") as raw:
            assert count_shard_samples(open_tar_stream(raw, url), url) == len(ours)


def test_multi_member_gzip_and_zero_padding_read_through():
    data = write_tar([("a.png", b"1")])
    halves = gzip.compress(data[:700]) + gzip.compress(data[700:]) + bytes(100)
    assert GunzipStream(io.BytesIO(halves), "m.gz").read() == data
    assert GunzipStream(io.BytesIO(halves), "m.gz").read(10) == data[:10]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda z: z[: len(z) // 2], "truncated gzip stream"),
        (lambda z: z[:30] + bytes(b ^ 0xFF for b in z[30:60]) + z[60:], "corrupt gzip stream"),
        (lambda z: b"not gzip at all" + z, "corrupt gzip stream"),
        (lambda z: z + b"trailing junk", "corrupt gzip stream"),
        (lambda z: b"", "empty gzip stream"),
    ],
)
def test_damaged_gzip_raises_shard_format_error_with_the_url(damage, reason):
    compressed = gzip.compress(write_tar([(f"{i}.png", bytes(range(256)) * 40) for i in range(50)]))
    with pytest.raises(ShardFormatError, match=f"gs://b/bad.tar.gz: {reason}"):
        GunzipStream(io.BytesIO(damage(compressed)), "gs://b/bad.tar.gz").read()
