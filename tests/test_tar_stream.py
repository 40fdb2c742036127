"""The streaming tar reader against Python's tarfile: formats, grouping, windows, damage."""

from __future__ import annotations

import io
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpustream.data.tar_stream import ShardFormatError, iter_shard_samples, write_tar


def tar_with(members: list[tuple[str, bytes]], fmt: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def samples_via_tarfile(data: bytes) -> list[dict]:
    """Reference grouping: WebDataset's rule on tarfile's member list."""
    samples: list[dict] = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            slash = member.name.rfind("/")
            dot = member.name.find(".", slash + 1)
            if dot <= slash + 1:
                continue
            key, ext = member.name[:dot], member.name[dot + 1 :].lower()
            if not samples or samples[-1]["__key__"] != key:
                samples.append({"__key__": key})
            samples[-1][ext] = tar.extractfile(member).read()
    return samples


def read_all(data: bytes, start: int = 0, stop: int | None = None) -> list[dict]:
    out = list(iter_shard_samples(io.BytesIO(data), "mem://t.tar", start, stop))
    for position, sample in enumerate(out, start):
        assert sample.pop("__url__") == "mem://t.tar"
        assert sample.pop("__index__") == position  # the sample's index in its shard
    return out


member_names = st.text(alphabet="abcxyz01_", min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
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
)
def test_grouping_matches_tarfile_for_every_format(samples, fmt, long_prefix):
    members = []
    for index, (parts, exts, payload) in enumerate(samples):
        folder = "/".join(parts)
        if fmt != tarfile.USTAR_FORMAT:
            folder = "d" * long_prefix + folder  # names beyond 100 bytes need pax or GNU records
        for ext in exts:
            members.append((f"{folder}/s{index:04d}.{ext}", payload + ext.encode()))
    data = tar_with(members, fmt)
    assert read_all(data) == samples_via_tarfile(data)


def test_long_names_use_pax_and_gnu_records():
    name = "x" * 150 + "/sample.png"
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        assert read_all(tar_with([(name, b"abc")], fmt)) == [
            {"__key__": "x" * 150 + "/sample", "png": b"abc"}
        ]


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


def test_directories_links_and_names_without_extension_are_ignored():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        link = tarfile.TarInfo("folder/l.png")
        link.type = tarfile.SYMTYPE
        link.linkname = "x"
        tar.addfile(link)
        for name, payload in [("folder/README", b"no ext"), ("folder/k.png", b"img")]:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    assert read_all(out.getvalue()) == [{"__key__": "folder/k", "png": b"img"}]


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


def test_garbage_is_rejected_with_the_url():
    with pytest.raises(ShardFormatError, match="mem://junk.tar"):
        list(iter_shard_samples(io.BytesIO(b"\x89PNG" + bytes(2000)), "mem://junk.tar"))
    data = bytearray(write_tar([("a.png", b"x" * 10), ("b.png", b"y" * 10)]))
    data[1024 + 124 : 1024 + 136] = b"77777777777\0"  # corrupt the size of the second member
    with pytest.raises(ShardFormatError):
        list(iter_shard_samples(io.BytesIO(bytes(data) + bytes(10**6)), "mem://bad.tar"))


def test_write_tar_is_deterministic_and_readable_by_tarfile():
    members = [("k1.png", b"one"), ("k1.cls", b"1"), ("k2.png", b"two"), ("k2.cls", b"2")]
    assert write_tar(members) == write_tar(members)
    assert samples_via_tarfile(write_tar(members)) == [
        {"__key__": "k1", "png": b"one", "cls": b"1"},
        {"__key__": "k2", "png": b"two", "cls": b"2"},
    ]
