"""tpustream-make-shards: sources, formats, manifests, reruns, gs:// output and CLI errors."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import subprocess
import sys
import tarfile
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tpustream import storage
from tpustream.data.format.manifest import MANIFEST_FORMAT, MANIFEST_NAME, ShardManifest
from tpustream.data.format.tar import iter_shard_samples
from tpustream.data.resolve.split import load_manifest
from tpustream.data.write.command import main as make_shards_main

REPO = Path(__file__).resolve().parent.parent

# Rotated out of alphabetical order: the meta order is what labels index, and it must be kept.
CIFAR10_CLASSES = [
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
    "airplane",
    "automobile",
    "bird",
    "cat",
]
CIFAR100_CLASSES = [f"fine{(37 * i) % 100:02d}" for i in range(100)]


def run(*args: str) -> int:
    """The CLI in this process, single worker and no progress bar."""
    return make_shards_main([*args, "--no-progress", "--workers", "1"])


def read_split(folder: str) -> tuple[dict, list[dict]]:
    """A split's manifest (as JSON) and all its samples, read back shard by shard."""
    manifest = json.loads(storage.read_bytes(storage.join(folder, MANIFEST_NAME)))
    samples = []
    for shard in manifest["shards"]:
        url = storage.join(folder, shard["name"])
        with storage.open_read(url) as f:
            got = list(iter_shard_samples(f, url))
        assert len(got) == shard["samples"], url
        samples.extend(got)
    return manifest, samples


def decode_chw(data: bytes, fmt: str = "PNG") -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == fmt
        assert im.mode == "RGB"
        return np.asarray(im).transpose(2, 0, 1)


def labels_of(samples: list[dict]) -> list[int]:
    return [int(s["cls"]) for s in samples]


def one_line_error(err: str) -> str:
    """The stderr of a failed run: exactly one 'error: ...' line, no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def all_files(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            path = os.path.join(dirpath, n)
            out[os.path.relpath(path, root)] = Path(path).read_bytes()
    return out


def temp_files(root: str) -> list[str]:
    return [
        os.path.join(d, n)
        for d, _, names in os.walk(root)
        for n in names
        if n.startswith(".") and n.endswith(".tmp")
    ]


# --- a tiny fake CIFAR in the official "python version" layout ---------------------------


def gradient_image(i: int) -> np.ndarray:
    """A distinct uint8 (3, 32, 32) image per i < 90; x, y and channel all change the pixels."""
    y = np.arange(32)[:, None]
    x = np.arange(32)[None, :]
    bases = [(17 * i) % 90, (17 * i + 30) % 90, (17 * i + 60) % 90]
    return np.stack([b + 2 * x + 3 * y for b in bases]).astype(np.uint8)


@dataclass
class FakeCifar:
    variant: str
    folder: str  # the parent of cifar-10-batches-py/ or cifar-100-python/
    tarball: str
    classes: list[str]
    train_images: np.ndarray  # (N, 3, 32, 32)
    train_labels: list[int]
    test_images: np.ndarray
    test_labels: list[int]


def _dump(path: Path, doc: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(doc, f, protocol=2)


def write_fake_cifar(root: Path, variant: str) -> FakeCifar:
    if variant == "cifar10":
        top, classes = "cifar-10-batches-py", CIFAR10_CLASSES
        n_train, n_test = 10, 4
        train_labels = [(3 * i + 1) % 10 for i in range(n_train)]
        test_labels = [9, 0, 5, 5]
    else:
        top, classes = "cifar-100-python", CIFAR100_CLASSES
        n_train, n_test = 8, 4
        train_labels = [0, 99, 42, 7, 99, 13, 56, 0]
        test_labels = [77, 1, 99, 42]
    train = np.stack([gradient_image(i) for i in range(n_train)])
    test = np.stack([gradient_image(n_train + i) for i in range(n_test)])
    folder = root / variant / "extracted"
    data_dir = folder / top
    data_dir.mkdir(parents=True)
    rows = lambda images: images.reshape(len(images), 3072)  # noqa: E731 (row-major CHW, as CIFAR)
    if variant == "cifar10":
        for b in range(5):
            part = slice(2 * b, 2 * b + 2)
            _dump(
                data_dir / f"data_batch_{b + 1}",
                {
                    b"batch_label": f"training batch {b + 1} of 5".encode(),
                    b"labels": train_labels[part],
                    b"data": rows(train[part]),
                    b"filenames": [f"img{i}.png".encode() for i in range(2)],
                },
            )
        _dump(data_dir / "test_batch", {b"labels": test_labels, b"data": rows(test)})
        _dump(
            data_dir / "batches.meta",
            {b"label_names": [c.encode() for c in classes], b"num_cases_per_batch": 2, b"num_vis": 3072},
        )
    else:
        # coarse_labels differ from fine_labels: the fine ones must be used.
        _dump(
            data_dir / "train",
            {b"fine_labels": train_labels, b"coarse_labels": [19] * n_train, b"data": rows(train)},
        )
        _dump(
            data_dir / "test",
            {b"fine_labels": test_labels, b"coarse_labels": [19] * n_test, b"data": rows(test)},
        )
        _dump(
            data_dir / "meta",
            {
                b"fine_label_names": [c.encode() for c in classes],
                b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
            },
        )
    (data_dir / "readme.html").write_text("<html></html>")
    tarball = root / variant / f"{variant}-python.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(data_dir, arcname=top)
    return FakeCifar(variant, str(folder), str(tarball), classes, train, train_labels, test, test_labels)


@pytest.fixture(scope="module")
def fake_cifar(tmp_path_factory) -> dict[str, FakeCifar]:
    root = tmp_path_factory.mktemp("cifar")
    return {v: write_fake_cifar(root, v) for v in ("cifar10", "cifar100")}


# --- digits ---------------------------------------------------------------------------------


def test_digits_counts_manifest_and_labels(digits_root):
    from sklearn.datasets import load_digits

    expected_counts = {"train": 1438, "test": 359}
    all_samples = []
    for split, count in expected_counts.items():
        folder = os.path.join(digits_root, split)
        manifest, samples = read_split(folder)
        assert manifest["format"] == MANIFEST_FORMAT
        assert manifest["split"] == split
        assert manifest["num_samples"] == count
        assert manifest["classes"] == [str(c) for c in range(10)]
        assert manifest["image_size"] == [32, 32]
        assert manifest["channels"] == 3
        assert manifest["image_format"] == "png"
        n_shards = -(-count // 256)
        assert [s["name"] for s in manifest["shards"]] == [f"{split}-{i:06d}.tar" for i in range(n_shards)]
        assert [s["samples"] for s in manifest["shards"]] == [256] * (n_shards - 1) + [
            count - 256 * (n_shards - 1)
        ]
        assert sum(s["samples"] for s in manifest["shards"]) == count
        assert sorted(os.listdir(folder)) == sorted([MANIFEST_NAME] + [s["name"] for s in manifest["shards"]])
        # The consumer side reads the same manifest.
        assert load_manifest(folder).num_samples == count
        # Keys are the write positions: unique across the shards of a split.
        assert [s["__key__"] for s in samples] == [f"{i:08d}" for i in range(count)]
        assert all(set(s) == {"__key__", "__url__", "__index__", "png", "cls"} for s in samples)
        all_samples += samples

    digits = load_digits()
    assert Counter(labels_of(all_samples)) == Counter(digits.target.tolist())
    # Every digit appears exactly once across train+test, with its own label:
    # the 8x8 0..16 image scaled to 0..255 and resized to 32x32, grey in all 3 channels.
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    expected = Counter(
        (int(label), np.asarray(Image.fromarray(p).resize((32, 32), Image.BILINEAR)).tobytes())
        for p, label in zip(pixels, digits.target, strict=True)
    )
    got = Counter()
    for s in all_samples:
        chw = decode_chw(s["png"])
        assert chw.shape == (3, 32, 32)
        assert (chw[0] == chw[1]).all() and (chw[0] == chw[2]).all()
        got[(int(s["cls"]), chw[0].tobytes())] += 1
    assert got == expected


def test_digits_test_split_is_stratified(digits_root):
    _, train = read_split(os.path.join(digits_root, "train"))
    _, test = read_split(os.path.join(digits_root, "test"))
    train_counts, test_counts = Counter(labels_of(train)), Counter(labels_of(test))
    for cls in range(10):
        total = train_counts[cls] + test_counts[cls]
        assert abs(test_counts[cls] - 0.2 * total) <= 1, (cls, test_counts[cls], total)


def test_raw_format_matches_png_of_same_seed(tmp_path, digits_root):
    out = str(tmp_path / "raw")
    assert run("digits", out, "--image-format", "raw") == 0
    for split in ("train", "test"):
        raw_manifest, raw = read_split(os.path.join(out, split))
        png_manifest, png = read_split(os.path.join(digits_root, split))
        assert raw_manifest["image_format"] == "raw"
        assert raw_manifest["shards"] == png_manifest["shards"]
        assert [s["__key__"] for s in raw] == [s["__key__"] for s in png]
        assert labels_of(raw) == labels_of(png)
        for r, p in zip(raw, png, strict=True):
            assert set(r) == {"__key__", "__url__", "__index__", "raw", "cls"}
            assert len(r["raw"]) == 3 * 32 * 32
            chw = np.frombuffer(r["raw"], np.uint8).reshape(3, 32, 32)
            np.testing.assert_array_equal(chw, decode_chw(p["png"]))


def test_process_pool_to_gcs_writes_the_same_bytes(bucket, digits_root, capsys):
    out = f"{bucket}/digits"
    assert make_shards_main(["digits", out, "--no-progress", "--workers", "2"]) == 0
    assert (
        "train: 1438 samples, 10 classes, 6 shard(s) (6 written, 0 already in place)"
        in capsys.readouterr().out
    )
    for split in ("train", "test"):
        names = sorted(os.listdir(os.path.join(digits_root, split)))
        assert storage.list_names(storage.join(out, split)) == names
        for name in names:
            local = Path(digits_root, split, name).read_bytes()
            assert storage.read_bytes(storage.join(out, split, name)) == local, name


def test_script_runs_as_subprocess(tmp_path, fake_cifar):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "scripts/make_shards.py",
        "cifar100",
        str(out),
        "--source",
        fake_cifar["cifar100"].tarball,
    ]
    done = subprocess.run(
        [*cmd, "--no-progress", "--workers", "1"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "train: 8 samples, 100 classes, 1 shard(s) (1 written" in done.stdout
    assert "test: 4 samples, 100 classes, 1 shard(s) (1 written" in done.stdout
    assert (out / "train" / MANIFEST_NAME).is_file() and (out / "test" / "test-000000.tar").is_file()

    failed = subprocess.run(
        [sys.executable, "scripts/make_shards.py", "cifar10", str(tmp_path / "x"), "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 2
    assert "--source" in one_line_error(failed.stderr)


# --- CIFAR ----------------------------------------------------------------------------------


@pytest.mark.parametrize("packaging", ["tarball", "folder"])
@pytest.mark.parametrize("variant", ["cifar10", "cifar100"])
def test_cifar_round_trip(tmp_path, fake_cifar, variant, packaging):
    src = fake_cifar[variant]
    out = str(tmp_path / "out")
    assert run(variant, out, "--source", src.tarball if packaging == "tarball" else src.folder) == 0

    train_manifest, train = read_split(os.path.join(out, "train"))
    test_manifest, test = read_split(os.path.join(out, "test"))
    for manifest, split, n in (
        (train_manifest, "train", len(src.train_labels)),
        (test_manifest, "test", len(src.test_labels)),
    ):
        assert manifest["split"] == split
        assert manifest["classes"] == src.classes
        assert manifest["num_samples"] == n
        assert manifest["image_size"] == [32, 32] and manifest["channels"] == 3

    # Test split: written in source order, pixels exact through png.
    assert labels_of(test) == src.test_labels
    for sample, image in zip(test, src.test_images, strict=True):
        np.testing.assert_array_equal(decode_chw(sample["png"]), image)

    # Train split: shuffled, but each image exactly once and with its own label.
    label_of = {img.tobytes(): label for img, label in zip(src.train_images, src.train_labels, strict=True)}
    got = Counter()
    for sample in train:
        pixels = decode_chw(sample["png"]).tobytes()
        assert label_of[pixels] == int(sample["cls"])
        got[pixels] += 1
    assert got == dict.fromkeys(label_of, 1)


def test_upsample_repeats_train_only(tmp_path, fake_cifar):
    src = fake_cifar["cifar10"]
    out = str(tmp_path / "out")
    assert run("cifar10", out, "--source", src.folder, "--upsample", "3", "--samples-per-shard", "7") == 0
    train_manifest, train = read_split(os.path.join(out, "train"))
    assert train_manifest["num_samples"] == 30
    assert [s["samples"] for s in train_manifest["shards"]] == [7, 7, 7, 7, 2]
    label_of = {img.tobytes(): label for img, label in zip(src.train_images, src.train_labels, strict=True)}
    written = [decode_chw(s["png"]).tobytes() for s in train]
    assert Counter(written) == {pixels: 3 for pixels in label_of}
    assert [label_of[p] for p in written] == labels_of(train)
    # The copies are mixed, not written as three passes in source order.
    assert written != [img.tobytes() for img in src.train_images] * 3

    test_manifest, test = read_split(os.path.join(out, "test"))
    assert test_manifest["num_samples"] == 4
    assert [decode_chw(s["png"]).tobytes() for s in test] == [img.tobytes() for img in src.test_images]


def test_seed_changes_train_order_only(tmp_path, fake_cifar):
    src = fake_cifar["cifar10"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert run("cifar10", a, "--source", src.folder, "--seed", "0") == 0
    assert run("cifar10", b, "--source", src.folder, "--seed", "1") == 0
    _, train_a = read_split(os.path.join(a, "train"))
    _, train_b = read_split(os.path.join(b, "train"))
    assert [s["png"] for s in train_a] != [s["png"] for s in train_b]
    assert Counter(s["png"] for s in train_a) == Counter(s["png"] for s in train_b)
    assert Path(a, "test", "test-000000.tar").read_bytes() == Path(b, "test", "test-000000.tar").read_bytes()


def test_jpg_format(tmp_path, fake_cifar):
    src = fake_cifar["cifar10"]
    out = str(tmp_path / "out")
    assert run("cifar10", out, "--source", src.folder, "--image-format", "jpg") == 0
    train_manifest, train = read_split(os.path.join(out, "train"))
    test_manifest, test = read_split(os.path.join(out, "test"))
    assert train_manifest["image_format"] == test_manifest["image_format"] == "jpg"
    for sample in train + test:
        assert set(sample) == {"__key__", "__url__", "__index__", "jpg", "cls"}
        assert decode_chw(sample["jpg"], "JPEG").shape == (3, 32, 32)
    for sample, image in zip(test, src.test_images, strict=True):
        error = np.abs(decode_chw(sample["jpg"], "JPEG").astype(int) - image.astype(int))
        assert error.mean() < 3, error.mean()


def test_cifar_source_errors(tmp_path, fake_cifar, capsys):
    assert run("cifar10", str(tmp_path / "o1"), "--source", str(tmp_path / "nope.tar.gz")) == 2
    assert "neither a CIFAR folder nor a CIFAR tarball" in one_line_error(capsys.readouterr().err)

    # A folder of CIFAR-10 with one training batch missing names the missing file.
    broken = tmp_path / "broken"
    src_dir = Path(fake_cifar["cifar10"].folder, "cifar-10-batches-py")
    broken.mkdir()
    for f in src_dir.iterdir():
        if f.name != "data_batch_3":
            (broken / f.name).write_bytes(f.read_bytes())
    assert run("cifar10", str(tmp_path / "o2"), "--source", str(broken)) == 2
    assert "data_batch_3" in one_line_error(capsys.readouterr().err)

    # An interrupted download: the gzip stream ends early.
    whole = Path(fake_cifar["cifar10"].tarball).read_bytes()
    truncated = tmp_path / "cifar-10-python.tar.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    assert run("cifar10", str(tmp_path / "o3"), "--source", str(truncated)) == 2
    assert "is the download complete?" in one_line_error(capsys.readouterr().err)
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


# --- reruns ---------------------------------------------------------------------------------


def test_rerun_skips_identical_shards(tmp_path, fake_cifar, capsys):
    src = fake_cifar["cifar10"]
    out = str(tmp_path / "out")
    args = ("cifar10", out, "--source", src.folder, "--samples-per-shard", "3")
    assert run(*args) == 0
    first_out = capsys.readouterr().out
    assert "train: 10 samples, 10 classes, 4 shard(s) (4 written, 0 already in place)" in first_out
    assert "test: 4 samples, 10 classes, 2 shard(s) (2 written, 0 already in place)" in first_out
    before = all_files(out)
    inodes = {name: os.stat(os.path.join(out, name)).st_ino for name in before}

    assert run(*args) == 0
    second_out = capsys.readouterr().out
    assert "train: 10 samples, 10 classes, 4 shard(s) (0 written, 4 already in place)" in second_out
    assert "test: 4 samples, 10 classes, 2 shard(s) (0 written, 2 already in place)" in second_out
    assert all_files(out) == before
    for name, inode in inodes.items():
        if name.endswith(".tar"):  # skipped shards are not even rewritten
            assert os.stat(os.path.join(out, name)).st_ino == inode, name
    assert temp_files(out) == []

    # An interrupted run (a shard missing, another truncated) is completed by a rerun.
    train = os.path.join(out, "train")
    os.remove(os.path.join(train, "train-000001.tar"))
    with open(os.path.join(train, "train-000002.tar"), "r+b") as f:
        f.truncate(1000)
    assert run(*args) == 0
    assert "(2 written, 2 already in place)" in capsys.readouterr().out
    assert all_files(out) == before
    assert temp_files(out) == []


def test_fewer_shards_leave_stale_ones_in_place(tmp_path, fake_cifar, caplog):
    src = fake_cifar["cifar10"]
    out = str(tmp_path / "out")
    train = os.path.join(out, "train")
    assert run("cifar10", out, "--source", src.folder, "--samples-per-shard", "3") == 0
    old = all_files(train)
    assert sorted(n for n in old if n.endswith(".tar")) == [f"train-{i:06d}.tar" for i in range(4)]

    with caplog.at_level(logging.WARNING):
        assert run("cifar10", out, "--source", src.folder, "--samples-per-shard", "8") == 0
    manifest, samples = read_split(train)
    assert [(s["name"], s["samples"]) for s in manifest["shards"]] == [
        ("train-000000.tar", 8),
        ("train-000001.tar", 2),
    ]
    assert manifest["num_samples"] == 10 and len(samples) == 10
    assert load_manifest(train).num_samples == 10
    now = all_files(train)
    for stale in ("train-000002.tar", "train-000003.tar"):
        assert now[stale] == old[stale]
    assert any(
        "2 shard file(s)" in r.getMessage() and "train-000002.tar" in r.getMessage() for r in caplog.records
    )
    assert temp_files(out) == []


# --- image folders --------------------------------------------------------------------------

CLASS_COLORS = {"ant": (200, 30, 30), "bee": (30, 200, 30), "cat": (30, 30, 200)}


def save_image(path: Path, size: tuple[int, int], color) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def test_imagefolder_train_val(tmp_path):
    src = tmp_path / "src"
    for split, cls, name, size in [
        ("train", "cat", "a.png", (40, 30)),
        ("train", "cat", "b.png", (50, 64)),
        ("train", "ant", "x.png", (40, 30)),
        ("train", "bee", "y.png", (50, 64)),
        ("train", "bee", "nested/z.png", (40, 30)),
        ("val", "cat", "w.png", (40, 30)),
        ("val", "ant", "v.png", (50, 64)),
    ]:
        save_image(src / split / cls / name, size, CLASS_COLORS[cls])
    (src / "train" / "bee" / "notes.txt").write_text("not an image")
    save_image(src / "train" / ".cache" / "hidden.png", (40, 30), (0, 0, 0))  # not a class

    out = str(tmp_path / "out")
    assert run("imagefolder", out, "--source", str(src), "--image-size", "16") == 0
    assert sorted(os.listdir(out)) == ["train", "val"]
    colors = list(CLASS_COLORS.values())
    for split, expected_labels in (("train", [0, 1, 1, 2, 2]), ("val", [0, 2])):
        manifest, samples = read_split(os.path.join(out, split))
        assert manifest["classes"] == ["ant", "bee", "cat"]
        assert manifest["image_size"] == [16, 16]
        assert manifest["num_samples"] == len(expected_labels)
        assert sorted(labels_of(samples)) == expected_labels
        for sample in samples:
            chw = decode_chw(sample["png"])
            assert chw.shape == (3, 16, 16)
            color = np.array(colors[int(sample["cls"])], np.int64)[:, None, None]
            assert np.abs(chw.astype(np.int64) - color).max() <= 1
    _, val = read_split(os.path.join(out, "val"))
    assert labels_of(val) == [0, 2]  # val is not shuffled: class order


def test_imagefolder_flat_layout_center_crops(tmp_path):
    """A folder of class folders is one 'train' split; images are center-cropped after resizing."""
    src = tmp_path / "src"
    wide = Image.new("RGB", (48, 16), (255, 0, 0))
    wide.paste((0, 255, 0), (16, 0, 32, 16))
    wide.paste((0, 0, 255), (32, 0, 48, 16))
    (src / "wide").mkdir(parents=True)
    wide.save(src / "wide" / "w.png")
    tall = wide.transpose(Image.Transpose.ROTATE_90)  # 16x48, thirds stacked vertically
    tall.paste((10, 20, 30), (0, 16, 16, 32))
    (src / "tall").mkdir()
    tall.save(src / "tall" / "t.png")
    big = Image.new("RGB", (64, 64), (90, 90, 90))  # downscaled 64 -> 16
    big.save(src / "tall" / "u.png")

    out = str(tmp_path / "out")
    assert run("imagefolder", out, "--source", str(src), "--image-size", "16") == 0
    assert os.listdir(out) == ["train"]
    manifest, samples = read_split(os.path.join(out, "train"))
    assert manifest["classes"] == ["tall", "wide"]
    got = sorted((int(s["cls"]), decode_chw(s["png"]).reshape(3, -1).max(1).tolist()) for s in samples)
    assert got == [(0, [10, 20, 30]), (0, [90, 90, 90]), (1, [0, 255, 0])]
    for s in samples:
        chw = decode_chw(s["png"])
        assert chw.shape == (3, 16, 16)
        assert (chw == chw[:, :1, :1]).all()  # one solid color: only the middle survives


def _val_class_missing_in_train(src: Path) -> None:
    save_image(src / "train" / "ant" / "a.png", (20, 20), (1, 2, 3))
    save_image(src / "val" / "ant" / "b.png", (20, 20), (1, 2, 3))
    save_image(src / "val" / "dog" / "c.png", (20, 20), (1, 2, 3))


def _corrupt_image(src: Path) -> None:
    save_image(src / "train" / "ant" / "a.png", (20, 20), (1, 2, 3))
    (src / "train" / "ant" / "b.png").write_bytes(b"not a png")


def _no_class_folders(src: Path) -> None:
    save_image(src / "a.png", (20, 20), (1, 2, 3))
    save_image(src / "b.png", (20, 20), (1, 2, 3))


def _empty_train_class(src: Path) -> None:
    save_image(src / "train" / "ant" / "a.png", (20, 20), (1, 2, 3))
    (src / "train" / "bee").mkdir(parents=True)
    (src / "train" / "bee" / "notes.txt").write_text("not an image")


def _every_image_unreadable(src: Path) -> None:
    (src / "ant").mkdir(parents=True)
    (src / "ant" / "a.png").write_bytes(b"not a png")
    (src / "ant" / "b.jpg").write_bytes(b"")


@pytest.mark.parametrize(
    ("build", "extra", "message"),
    [
        (_val_class_missing_in_train, ["--image-size", "16"], "dog: class not present in the train split"),
        (_val_class_missing_in_train, [], "dog: class not present in the train split"),
        (_no_class_folders, ["--image-size", "16"], "no class folders"),
        (_corrupt_image, ["--image-size", "16", "--on-error", "raise"], "b.png: cannot decode the image"),
        (_corrupt_image, ["--on-error", "raise"], "b.png: cannot decode the image"),
        (_empty_train_class, ["--image-size", "16"], "train/bee: class folder has no images (.jpg, "),
        (_every_image_unreadable, ["--image-size", "16"], "every image of the train split is unreadable"),
        (_every_image_unreadable, ["--max-side", "8"], "every image of the train split is unreadable"),
    ],
)
def test_imagefolder_errors(tmp_path, capsys, build, extra, message):
    src = tmp_path / "src"
    build(src)
    out = tmp_path / "out"
    assert run("imagefolder", str(out), "--source", str(src), *extra) == 2
    assert message in one_line_error(capsys.readouterr().err)
    assert not (out / "train" / MANIFEST_NAME).exists()


def test_imagefolder_empty_class_outside_train_is_fine(tmp_path):
    src = tmp_path / "src"
    for split, cls in [("train", "ant"), ("train", "bee"), ("val", "ant")]:
        save_image(src / split / cls / "a.png", (20, 20), CLASS_COLORS[cls])
    (src / "val" / "bee").mkdir()  # no validation images for this class
    out = str(tmp_path / "out")
    assert run("imagefolder", out, "--source", str(src), "--image-size", "8") == 0
    manifest, samples = read_split(os.path.join(out, "val"))
    assert manifest["classes"] == ["ant", "bee"]
    assert labels_of(samples) == [0]


def test_imagefolder_converts_16_bit_cmyk_and_palette_images(tmp_path):
    """16-bit grey is scaled as (v + 128) // 257 (PIL's convert would clip it to white)."""
    src = tmp_path / "src"
    values = np.array([0, 128, 129, 32768, 65535, 40000, 1000, 257], np.uint16)
    grey16 = np.tile(values, (8, 1))
    (src / "grey").mkdir(parents=True)
    Image.fromarray(grey16).save(src / "grey" / "g.png")
    with Image.open(src / "grey" / "g.png") as im:
        assert im.mode.startswith("I")  # really 16 bits per pixel on disk
    (src / "cmyk").mkdir()
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(src / "cmyk" / "c.jpg")
    (src / "palette").mkdir()
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    palette.save(src / "palette" / "p.png", transparency=0)

    out = str(tmp_path / "out")
    assert run("imagefolder", out, "--source", str(src), "--image-size", "8") == 0
    manifest, samples = read_split(os.path.join(out, "train"))
    assert manifest["classes"] == ["cmyk", "grey", "palette"]
    stored = {int(s["cls"]): decode_chw(s["png"]) for s in samples}
    expected_grey = ((grey16.astype(np.int64) + 128) // 257).astype(np.uint8)
    assert expected_grey[0, 3] == 128
    for channel in stored[1]:
        np.testing.assert_array_equal(channel, expected_grey)
    red = stored[0].reshape(3, -1).mean(1)
    assert red[0] > 240 and red[1] < 15 and red[2] < 15, red
    assert (stored[2] == np.array([10, 20, 30], np.uint8)[:, None, None]).all()


# One image per class, so a sample's label names its file: (width, height) as PIL gives them.
ORIGINALS = {
    "a_rgb": ("a.jpg", (40, 30)),
    "b_grey": ("b.JPEG", (20, 50)),
    "c_cmyk": ("c.jpeg", (64, 16)),
    "d_png_named_jpeg": ("d.JPEG", (30, 30)),
    "e_grey16": ("e.png", (48, 24)),
}


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> Path:
    """An image folder of ORIGINALS: JPEGs in RGB, grey and CMYK, a PNG named .JPEG, a 16-bit PNG."""
    src = tmp_path_factory.mktemp("originals")
    for cls, (name, size) in ORIGINALS.items():
        (src / cls).mkdir()
        path = src / cls / name
        if cls == "a_rgb":
            Image.new("RGB", size, (200, 30, 30)).save(path, format="JPEG")
        elif cls == "b_grey":
            Image.new("L", size, 90).save(path, format="JPEG")
        elif cls == "c_cmyk":
            Image.new("CMYK", size, (0, 255, 255, 0)).save(path, format="JPEG")
        elif cls == "d_png_named_jpeg":
            Image.new("RGB", size, (30, 200, 30)).save(path, format="PNG")
        else:
            Image.fromarray(np.full(size[::-1], 32768, np.uint16)).save(path, format="PNG")
    return src


def test_imagefolder_keeps_original_bytes_and_records_sizes(tmp_path, originals):
    out = str(tmp_path / "out")
    assert run("imagefolder", out, "--source", str(originals), "--samples-per-shard", "2") == 0
    manifest, samples = read_split(os.path.join(out, "train"))
    classes = list(ORIGINALS)
    assert manifest["classes"] == classes and manifest["num_samples"] == 5
    assert manifest["image_size"] is None
    assert manifest["image_format"] == "mixed"  # e.png is not JPEG-named
    assert manifest["image_sizes"] == {"count": 5, "min": [16, 20], "max": [50, 64], "mean": [30.0, 40.4]}
    for sample in samples:
        cls = classes[int(sample["cls"])]
        name = ORIGINALS[cls][0]
        field = "png" if name.endswith(".png") else "jpg"  # d.JPEG holds a PNG: still jpg
        assert set(sample) == {"__key__", "__url__", "__index__", field, "cls"}
        assert sample[field] == (originals / cls / name).read_bytes()
    text = storage.read_bytes(storage.join(out, "train", MANIFEST_NAME)).decode()
    parsed = ShardManifest.from_json(text, os.path.join(out, "train"), "test")
    assert parsed.image_size is None and parsed.size_stats == manifest["image_sizes"]
    assert parsed.to_json(os.path.join(out, "train")) == text

    # A rerun finds everything in place and keeps the manifest as it is.
    before = all_files(out)
    assert run("imagefolder", out, "--source", str(originals), "--samples-per-shard", "2") == 0
    assert all_files(out) == before


def test_imagefolder_max_side_shrinks_only_large_images(tmp_path, originals):
    out = str(tmp_path / "out")
    assert run("imagefolder", out, "--source", str(originals), "--max-side", "32", "--quality", "90") == 0
    manifest, samples = read_split(os.path.join(out, "train"))
    classes = list(ORIGINALS)
    assert manifest["image_size"] is None and manifest["image_format"] == "mixed"
    stored = {}
    for sample in samples:
        cls = classes[int(sample["cls"])]
        assert set(sample) == {"__key__", "__url__", "__index__", "jpg", "cls"}  # re-encoded: jpg
        stored[cls] = sample["jpg"]
    # Only d (30x30) fits in 32: its bytes (a PNG named .JPEG) are kept.
    assert stored["d_png_named_jpeg"] == (originals / "d_png_named_jpeg" / "d.JPEG").read_bytes()
    # CMYK and 16-bit grey (32768) converted as training decodes them.
    colors = {"a_rgb": (200, 30, 30), "b_grey": (90,) * 3, "c_cmyk": (255, 0, 0), "e_grey16": (128,) * 3}
    sizes = {"d_png_named_jpeg": (30, 30)}
    for cls, color in colors.items():
        width, height = ORIGINALS[cls][1]
        pixels = decode_chw(stored[cls], "JPEG")  # RGB, whatever the source's mode
        _, new_height, new_width = pixels.shape
        assert max(new_height, new_width) == 32, cls
        assert abs(new_width * height / width - new_height) <= 1, cls  # aspect kept
        sizes[cls] = (new_height, new_width)
        assert np.abs(pixels.reshape(3, -1).mean(1) - color).max() < 8, cls
    assert sizes == {
        "a_rgb": (24, 32),
        "b_grey": (32, 13),
        "c_cmyk": (8, 32),
        "d_png_named_jpeg": (30, 30),
        "e_grey16": (16, 32),
    }
    assert manifest["image_sizes"] == {"count": 5, "min": [8, 13], "max": [32, 32], "mean": [22.0, 27.8]}


def test_imagefolder_copy_skips_unreadable_files(tmp_path, capsys):
    src = tmp_path / "src"
    save_image(src / "ant" / "a.jpg", (20, 10), CLASS_COLORS["ant"])
    noise = np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    Image.fromarray(noise).save(src / "ant" / "b.jpg")
    whole = (src / "ant" / "b.jpg").read_bytes()
    (src / "ant" / "b.jpg").write_bytes(whole[: len(whole) // 2])  # the header reads, the pixels do not
    (src / "ant" / "c.jpg").write_bytes(b"not a jpeg")
    out = str(tmp_path / "out")
    assert run("imagefolder", out, "--source", str(src)) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("2 unreadable images skipped (first: ")
    manifest, samples = read_split(os.path.join(out, "train"))
    assert manifest["num_samples"] == 1 and manifest["image_format"] == "jpg"
    assert manifest["image_sizes"] == {"count": 1, "min": [10, 20], "max": [10, 20], "mean": [10.0, 20.0]}
    assert samples[0]["jpg"] == (src / "ant" / "a.jpg").read_bytes()


def test_unreadable_images_are_skipped_in_worker_processes(tmp_path, capsys, caplog):
    src = tmp_path / "src"
    for cls, name in [("ant", "a.png"), ("ant", "c.png"), ("bee", "d.png"), ("bee", "f.png")]:
        save_image(src / cls / name, (20, 20), CLASS_COLORS[cls])
    (src / "ant" / "b.png").write_bytes(b"not a png")
    good = (src / "bee" / "d.png").read_bytes()
    (src / "bee" / "e.png").write_bytes(good[: len(good) // 2])  # truncated
    bad = [str(src / "ant" / "b.png"), str(src / "bee" / "e.png")]

    def convert(out: str, *extra: str, workers: str = "1") -> int:
        args = ["--source", str(src), "--image-size", "8", "--samples-per-shard", "2", *extra]
        return make_shards_main(["imagefolder", out, *args, "--no-progress", "--workers", workers])

    pooled, single = str(tmp_path / "pooled"), str(tmp_path / "single")
    with caplog.at_level(logging.WARNING):
        assert convert(pooled, workers="2") == 0
    captured = capsys.readouterr()
    assert "train: 4 samples, 2 classes, 3 shard(s) (3 written" in captured.out
    summary = captured.err.strip().splitlines()[-1]
    assert summary.startswith("2 unreadable images skipped (first: ")
    assert any(f"(first: {path}: " in summary for path in bad)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping unreadable")]
    assert len(logged) == 2 and all(any(path in m for m in logged) for path in bad)

    manifest, samples = read_split(os.path.join(pooled, "train"))  # checks each shard's count
    assert manifest["num_samples"] == 4
    assert sorted(labels_of(samples)) == [0, 0, 1, 1]
    # Skipped images leave gaps in the keys (write positions 0..5); no renumbering.
    keys = {s["__key__"] for s in samples}
    assert len(keys) == 4 and keys < {f"{i:08d}" for i in range(6)}

    # One process writes the same bytes, and a rerun finds every shard in place.
    assert convert(single) == 0
    assert all_files(single) == all_files(pooled)
    assert convert(pooled) == 0
    assert "(0 written, 3 already in place)" in capsys.readouterr().out

    # raise: the worker's error comes back as one line naming the file, and no manifest.
    assert convert(pooled, "--on-error", "raise", workers="2") == 2
    line = one_line_error(capsys.readouterr().err)
    assert "cannot decode the image" in line and any(path in line for path in bad)
    assert not os.path.exists(os.path.join(pooled, "train", MANIFEST_NAME))


def test_ctrl_c_keeps_written_shards_and_writes_no_manifest(tmp_path, monkeypatch, capsys):
    from tpustream.data.write import writer as shard_writer

    calls = []
    original = shard_writer.ShardTask.run

    def interrupt_second_shard(self):
        calls.append(self.url)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(shard_writer.ShardTask, "run", interrupt_second_shard)
    out = tmp_path / "out"
    assert run("digits", str(out)) == 130
    assert capsys.readouterr().err.strip() == (
        "interrupted: the shards written so far are kept; rerun the same command to finish "
        "(identical shards are skipped)"
    )
    assert sorted(os.listdir(out / "train")) == ["train-000000.tar"]


# --- gs:// output and CLI errors ------------------------------------------------------------


def test_gcs_output_and_rerun(bucket, fake_cifar, capsys):
    src = fake_cifar["cifar10"]
    out = f"{bucket}/sets/cifar10"
    args = ("cifar10", out, "--source", src.tarball, "--samples-per-shard", "4")
    assert run(*args) == 0
    assert "(3 written, 0 already in place)" in capsys.readouterr().out
    assert storage.list_names(storage.join(out, "train")) == [
        MANIFEST_NAME,
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
    ]
    assert storage.list_names(storage.join(out, "test")) == [MANIFEST_NAME, "test-000000.tar"]
    manifest, samples = read_split(storage.join(out, "train"))
    assert manifest["num_samples"] == 10
    assert sorted(labels_of(samples)) == sorted(src.train_labels)
    assert load_manifest(storage.join(out, "test")).shards[0].url == f"{out}/test/test-000000.tar"

    assert run(*args) == 0
    rerun = capsys.readouterr().out
    assert "train: 10 samples, 10 classes, 3 shard(s) (0 written, 3 already in place)" in rerun
    assert "test: 4 samples, 10 classes, 1 shard(s) (0 written, 1 already in place)" in rerun


def test_gcs_output_missing_bucket(gcs_emulator, fake_cifar, tmp_path, capsys):
    name = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    assert run("cifar10", f"gs://{name}/cifar10", "--source", fake_cifar["cifar10"].folder) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"gs://{name}" in line and "does not exist" in line
    # The bucket is checked before the (possibly long) source load.
    assert run("cifar10", f"gs://{name}/cifar10", "--source", str(tmp_path / "not-downloaded.tar.gz")) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"gs://{name}" in line and "does not exist" in line


def test_cifar_without_source_is_an_error(tmp_path, capsys):
    out = tmp_path / "out"
    assert run("cifar10", str(out)) == 2
    assert "cifar10 needs --source" in one_line_error(capsys.readouterr().err)
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--image-size", "--max-side"])
@pytest.mark.parametrize("source", ["digits", "cifar100"])
def test_image_size_applies_to_imagefolder_only(tmp_path, capsys, source, flag):
    with pytest.raises(SystemExit) as exc:
        run(source, str(tmp_path / "out"), flag, "64")
    assert exc.value.code == 2
    assert f"{flag} applies to imagefolder only; {source} images are 32x32" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_source_is_not_for_digits(tmp_path, capsys):
    """As its help says: refused before anything is written."""
    with pytest.raises(SystemExit) as exc:
        run("digits", str(tmp_path / "out"), "--source", str(tmp_path))
    assert exc.value.code == 2
    assert "--source is not for digits" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--upsample", "--samples-per-shard", "--image-size", "--max-side"])
def test_non_positive_numbers_are_usage_errors(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exc:
        run("digits", str(tmp_path / "out"), flag, "0")
    assert exc.value.code == 2
    assert f"{flag} must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--image-size", "16", "--max-side", "32"], "--image-size and --max-side exclude each other"),
        (["--image-format", "jpg"], "--image-format applies to imagefolder only with --image-size"),
        (["--quality", "0"], "--quality: must be an integer from 1 to 100, got '0'"),
        (["--quality", "high"], "--quality: must be an integer from 1 to 100, got 'high'"),
    ],
)
def test_imagefolder_option_conflicts_are_usage_errors(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        run("imagefolder", str(tmp_path / "out"), "--source", str(tmp_path), *extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_interrupted_rerun_with_other_settings_leaves_no_stale_manifest(tmp_path, monkeypatch):
    out = str(tmp_path / "digits")
    assert run("digits", out, "--samples-per-shard", "500") == 0
    manifest_url = storage.join(out, "train", MANIFEST_NAME)
    assert storage.exists(manifest_url)

    from tpustream.data.write import writer as shard_writer

    calls = []
    original = shard_writer.ShardTask.run

    def fail_on_second_shard(self):
        calls.append(self.url)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user stops the rerun half-way
        return original(self)

    monkeypatch.setattr(shard_writer.ShardTask, "run", fail_on_second_shard)
    assert run("digits", out, "--samples-per-shard", "300") == 130
    # The old manifest (500 per shard) would now lie about the rewritten shards.
    assert not storage.exists(manifest_url)
    monkeypatch.setattr(shard_writer.ShardTask, "run", original)
    assert run("digits", out, "--samples-per-shard", "300") == 0
    assert [s.samples for s in load_manifest(storage.join(out, "train")).shards] == [300, 300, 300, 300, 238]
