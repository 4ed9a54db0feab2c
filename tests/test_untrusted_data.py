"""A dataset is input nobody vouched for: decompression bombs, other formats under any name,
symlinks (dangling, looping), train/val class mismatches, and JPEGs whose corruption the
decoder only mentions on stderr."""

from __future__ import annotations

import io
import logging
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from PIL import Image

import data.dataset
import data.decode
from data import synthetic
from data.decode import BadImageError, decode, jpeg_dimensions
from data.cache import NodeCache
from data.errors import DatasetError
from data.index import DatasetIndex, list_split, load_or_build
from data.loader import VolumeLoader
from data.pipeline import check_same_classes, open_dataset
from data.volume import Volume
from support.launch import run_train
from support.runs import REPO, tiny_overrides
from support.logs import our_records

BOMB_SIDE = 30000


def a_jpeg(index: int = 3) -> bytes:
    return synthetic.render(0, "train", index, 96)[1]


def pixels(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def sof_offset(jpeg: bytes) -> int:
    return jpeg.index(b"\xff\xc0")  # PIL writes baseline JPEGs


def jpeg_declaring(width: int, height: int) -> bytes:
    """A real small JPEG whose frame header claims another size."""
    data = bytearray(a_jpeg())
    at = sof_offset(bytes(data))
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def png_declaring(width: int, height: int) -> bytes:
    """A real small PNG whose IHDR (with a valid CRC) claims another size."""
    data = bytearray(pixels(Image.new("RGB", (8, 8), (9, 99, 199)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def bmp_declaring(width: int, height: int) -> bytes:
    data = bytearray(pixels(Image.new("RGB", (8, 8)), "BMP"))
    data[18:26] = struct.pack("<ii", width, height)
    return bytes(data)


# --- item 5: decompression bombs -------------------------------------------------------------

@pytest.mark.parametrize("make", [jpeg_declaring, png_declaring, bmp_declaring])
def test_a_small_file_declaring_a_huge_image_is_refused_before_any_decode(make, monkeypatch):
    bomb, wide = make(BOMB_SIDE, BOMB_SIDE), make(BOMB_SIDE, 1000)
    assert len(bomb) < 5000

    def no_decoding(*args, **kwargs):
        raise AssertionError("the decoder ran on a decompression bomb")

    monkeypatch.setattr(data.decode, "decode_jpeg", no_decoding)
    monkeypatch.setattr(Image.Image, "load", no_decoding)
    # Our limit, or PIL's own (twice Image.MAX_IMAGE_PIXELS) where PIL reads the header.
    with pytest.raises(BadImageError, match=f"declares ({BOMB_SIDE}x{BOMB_SIDE} pixels, more "
                                            f"than data.max_image_pixels=|more pixels than "
                                            f"PIL's decompression-bomb limit)"):
        decode(bomb)
    with pytest.raises(BadImageError, match=f"declares {BOMB_SIDE}x1000 pixels"):
        decode(wide, max_pixels=BOMB_SIDE * 1000 - 1)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "TIFF"])
def test_the_pixel_limit_is_inclusive(fmt):
    data = pixels(Image.new("RGB", (40, 30), (200, 10, 10)), fmt)
    assert decode(data, max_pixels=40 * 30).shape == (3, 30, 40)
    with pytest.raises(BadImageError, match="declares 40x30 pixels"):
        decode(data, max_pixels=40 * 30 - 1)


def test_a_decompression_bomb_in_a_dataset_is_a_counted_bad_file_and_memory_stays_small(
        tmp_path):
    root = tmp_path / "bomb"
    (root / "train" / "a").mkdir(parents=True)
    (root / "train" / "a" / "bomb.jpg").write_bytes(jpeg_declaring(BOMB_SIDE, BOMB_SIDE))
    (root / "train" / "a" / "fine.jpg").write_bytes(a_jpeg())
    # A fresh interpreter, so its peak RSS is the decode's and not this test process's.
    script = f"""
import resource, sys
sys.path.insert(0, {str(REPO)!r})
from data.pipeline import open_dataset
from data.volume import Volume
from data.loader import VolumeLoader
ds = open_dataset(Volume({str(root)!r}), "train", None, 32, train=True, seed=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
batch = next(iter(VolumeLoader(ds, [[(0, 0), (0, 1)]], 0)))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(batch.stats.tolist()[3], len(batch.indices), grown // 1024)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    bad, good, grown_mb = map(int, out.stdout.split())
    assert (bad, good) == (1, 1)
    assert grown_mb < 200, f"peak RSS grew {grown_mb} MB decoding a 2 KB file"
    assert f"declares {BOMB_SIDE}x{BOMB_SIDE}" in out.stderr


def jpeg_with_scans(progressive: bool, extra: int) -> bytes:
    """A real JPEG with its last scan repeated `extra` more times before the end marker."""
    jpeg = pixels(Image.new("RGB", (64, 48), (10, 200, 30)), "JPEG", progressive=progressive)
    scan = jpeg[jpeg.rindex(b"\xff\xda"):-2]
    return jpeg[:-2] + scan * extra + b"\xff\xd9"


@pytest.mark.parametrize("progressive", [True, False])
def test_a_jpeg_with_more_scans_than_any_real_one_is_a_bad_file_never_decoded(
        progressive, monkeypatch, tmp_path):
    """Each scan costs a pass over the whole image, however few bytes it takes."""
    assert decode(jpeg_with_scans(progressive, 0)).shape == (3, 48, 64)

    def no_decoding(*args, **kwargs):
        raise AssertionError("the decoder ran on a JPEG with too many scans")

    monkeypatch.setattr(data.decode, "decode_jpeg", no_decoding)
    for extra in (data.decode.MAX_JPEG_SCANS, 3000):
        with pytest.raises(BadImageError, match=r"a JPEG of \d+ scans, more than "):
            decode(jpeg_with_scans(progressive, extra))
    root = image_tree(tmp_path / "r", {"val/a/scans.jpg": jpeg_with_scans(progressive, 3000)})
    ds = open_dataset(Volume(str(root)), "val", None, 16, train=False, seed=0)
    assert ds[(0, 0)].image is None


ELONGATED = [(1, 300_000), (300_000, 1), (2, 300_000), (300_000, 3), (1, 65)]  # (width, height)


def test_elongated_images_are_counted_bad_files_in_train_and_val_and_memory_stays_small(
        tmp_path):
    """A few KB of PNG, far under the pixel limit, whose short side resized to the model's
    input would make billions of pixels (eval), or whose crop is a sliver (train)."""
    files = {"fine.jpg": a_jpeg()}
    for width, height in ELONGATED:
        files[f"{width}x{height}.png"] = pixels(Image.new("L", (width, height), 7), "PNG",
                                                optimize=True)
    assert max(len(payload) for payload in files.values()) < 5000
    root = image_tree(tmp_path / "r", {f"{split}/a/{name}": payload for name, payload
                                       in files.items() for split in ("train", "val")})
    script = f"""
import resource, sys
sys.path.insert(0, {str(REPO)!r})
from data.pipeline import open_dataset
from data.volume import Volume
from data.loader import VolumeLoader
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for split in ("train", "val"):
    ds = open_dataset(Volume({str(root)!r}), split, None, 32, train=split == "train", seed=0)
    batch = next(iter(VolumeLoader(ds, [[(0, i) for i in range(len(ds))]], 0)))
    print(batch.stats.tolist()[3], len(batch.indices))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    *counts, grown_mb = out.stdout.split("\n")[:-1]
    assert counts == [f"{len(ELONGATED)} 1"] * 2, out.stderr[-3000:]
    assert int(grown_mb) < 200, f"peak RSS grew {grown_mb} MB"
    assert "one side more than" in out.stderr


def test_the_eval_resize_is_refused_before_it_allocates_past_the_pixel_limit(
        tmp_path, monkeypatch):
    """Within the aspect ratio limit, a large data.image_size can still make the resized
    image outgrow data.max_image_pixels: that is checked before resizing."""
    root = image_tree(tmp_path / "r", {"val/a/wide.png": pixels(Image.new("L", (64, 8)), "PNG"),
                                       "val/a/square.png": pixels(Image.new("L", (8, 8)), "PNG")})
    ds = open_dataset(Volume(str(root)), "val", None, 64, train=False, seed=0,
                      max_pixels=10_000)
    assert ds[(0, 0)].image.shape == (3, 64, 64)  # square: 73x73 after the resize
    monkeypatch.setattr(data.dataset.F, "resize", lambda *a, **k: pytest.fail("resized"))
    assert ds[(0, 1)].image is None  # wide: would be 584x73


def test_hostile_jpeg_headers_end_in_a_bad_file_quickly():
    real = a_jpeg()
    sos = real.index(b"\xff\xda")
    cases = [b"\xff\xd8", b"\xff\xd8\xff", b"\xff\xd8" + b"\xff" * 5_000_000 + b"\xff\xd9",
             b"\xff\xd8" + b"\xff\xe0\x00\x02" * 1_000_000 + b"\xff\xd9",  # a million segments
             b"\xff\xd8\xff\xe0\x00\x00" + real[2:],  # a length shorter than itself
             b"\xff\xd8\xff\xe0\xff\xff" + real[2:],  # a length past the end
             real[:sof_offset(real) + 6] + b"\xff\xd9",  # cut inside the frame header
             jpeg_declaring(0, 10), jpeg_declaring(10, 0)]  # height 0 = a DNL marker
    rng = np.random.default_rng(5)
    for _ in range(300):  # and random damage anywhere in the header
        damaged = bytearray(real)
        for at in rng.integers(2, sos + 4, size=int(rng.integers(1, 4))):
            damaged[at] = int(rng.integers(0, 256))
        cases.append(bytes(damaged))
    outcomes = {"decoded": 0, "bad": 0}
    for case in cases:
        try:
            image = decode(case)
            assert image.dtype == torch.uint8 and image.shape[0] == 3
            outcomes["decoded"] += 1
        except BadImageError as err:
            assert "\n" not in str(err)
            outcomes["bad"] += 1
    assert outcomes["bad"] >= 9, outcomes
    with pytest.raises(BadImageError, match="no frame header"):
        jpeg_dimensions(b"\xff\xd8" + b"\xff" * 5_000_000)


# --- item 6: every format ImageFolder reads, told by content ---------------------------------

def image_tree(root: Path, files: Dict[str, bytes]) -> Path:
    for name, payload in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
    return root


def test_every_imagefolder_format_is_indexed_and_decoded_by_content(tmp_path):
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (12, 16, 3), np.uint8))
    palette = rgb.convert("P")
    exact = {  # file -> (bytes, the RGB image it holds, bit for bit)
        "png.png": (pixels(rgb, "PNG"), rgb), "PNG-NAMED.JPEG": (pixels(rgb, "PNG"), rgb),
        "bmp.BMP": (pixels(rgb, "BMP"), rgb), "ppm.ppm": (pixels(rgb, "PPM"), rgb),
        "tif.tif": (pixels(rgb, "TIFF"), rgb), "tiff.TIFF": (pixels(rgb, "TIFF"), rgb),
        "webp.webp": (pixels(rgb, "WEBP", lossless=True), rgb),
        "rgba.png": (pixels(rgb.convert("RGBA"), "PNG"), rgb),
        "pal.png": (pixels(palette, "PNG"), palette.convert("RGB")),
        "pgm.pgm": (pixels(rgb.convert("L"), "PPM"), rgb.convert("L").convert("RGB")),
        "la.png": (pixels(rgb.convert("LA"), "PNG"), rgb.convert("L").convert("RGB")),
    }
    lossy = {"jpg.jpg": a_jpeg(), "cmyk.jpeg": pixels(rgb.convert("CMYK"), "JPEG"),
             "JPEG-NAMED.png": a_jpeg(4)}
    files = {**{k: v for k, (v, _) in exact.items()}, **lossy}
    root = image_tree(tmp_path / "r", {f"train/a/{k}": v for k, v in files.items()})
    ds = open_dataset(Volume(str(root)), "train", None, 8, train=False, seed=0)
    assert len(ds) == len(files)
    for i in range(len(ds)):
        name = ds.index.name(i).split("/")[-1]
        image = decode(ds.read_bytes(i)[0])
        assert image.dtype == torch.uint8 and image.shape[0] == 3, name
        if name in exact:
            expected = torch.from_numpy(np.array(exact[name][1])).permute(2, 0, 1)
            assert torch.equal(image, expected), name
        assert ds[(0, i)].image is not None, name


def test_files_left_out_of_the_index_are_reported_once_per_split_with_reasons(tmp_path,
                                                                             caplog):
    root = image_tree(tmp_path / "r", {
        "train/a/1.jpg": a_jpeg(), "train/a/notes.txt": b"x", "train/a/more.TXT": b"x",
        "train/a/.DS_Store": b"x", "train/a/anim.gif": b"GIF89a", "train/a/sub/2.jpg": a_jpeg(),
        "train/b/1.png": pixels(Image.new("RGB", (4, 4)), "PNG"), "train/README": b"x",
        "val/a/1.jpg": a_jpeg(), "val/b/1.jpg": a_jpeg()})
    os.symlink(root / "nowhere.jpg", root / "train" / "b" / "dead.jpg")
    with caplog.at_level(logging.WARNING, logger="data.index"):
        index = load_or_build(Volume(str(root)), "train", tmp_path / "store")
        assert len(index) == 2
        again = load_or_build(Volume(str(root)), "train", tmp_path / "store")  # stored
        assert again.names.tobytes() == index.names.tobytes()
        load_or_build(Volume(str(root)), "val", tmp_path / "store")
    lines = [r.getMessage() for r in our_records(caplog)]
    assert len(lines) == 2, lines  # train, built then reused; val has nothing to report
    for line in lines:
        assert "left out 7 entries that are not images" in line, line
        for reason in (".txt: 2", ".DS_Store: 1", ".gif: 1", "subfolders: 1",
                       "broken links: 1", "files outside class folders: 1"):
            assert reason in line, line


def test_a_class_folder_without_images_says_what_it_holds(tmp_path):
    root = image_tree(tmp_path / "r", {"train/a/1.jpg": a_jpeg(), "train/b/x.gif": b"G",
                                       "train/b/y.gif": b"G"})
    with pytest.raises(DatasetError, match=r"b holds no images \(left out 2 entries that are "
                                           r"not images \(.gif: 2\); images are .jpg"):
        list_split(Volume(str(root)), "train")


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_png_is_a_bad_file(damage):
    png = pixels(Image.fromarray(np.random.default_rng(1).integers(
        0, 256, (60, 80, 3), np.uint8)), "PNG")
    rng = np.random.default_rng(2)
    caught = 0
    for _ in range(50):
        if damage == "truncated":
            bad = png[:int(rng.integers(40, len(png) - 20))]
        else:  # torchvision's decode_png segfaulted on this one
            bad = bytearray(png)
            bad[int(rng.integers(60, len(png) - 20))] ^= int(rng.integers(1, 256))
            bad = bytes(bad)
        try:
            decode(bad)
        except BadImageError as err:
            assert "\n" not in str(err)
            caught += 1
    assert caught == 50


# --- item 7: symlinks --------------------------------------------------------------------------

def test_symlinked_class_folders_and_files_are_followed_and_broken_links_left_out(tmp_path):
    elsewhere = image_tree(tmp_path / "elsewhere", {"cats/1.jpg": a_jpeg(1),
                                                    "cats/2.jpg": a_jpeg(2),
                                                    "loose/3.jpg": a_jpeg(3)})
    root = image_tree(tmp_path / "r", {"train/a/1.jpg": a_jpeg()})
    split = root / "train"
    os.symlink(elsewhere / "cats", split / "cat")  # a linked class folder
    (split / "linked").mkdir()  # a folder of linked files
    os.symlink(elsewhere / "loose" / "3.jpg", split / "linked" / "3.jpg")
    os.symlink("3.jpg", split / "linked" / "relative.jpg")
    os.symlink(elsewhere / "gone.jpg", split / "linked" / "dangling.jpg")
    os.symlink(split / "linked" / "loop.jpg", split / "linked" / "loop.jpg")  # ELOOP
    os.symlink(elsewhere / "gone", split / "dead")  # a class folder behind a dead link
    os.symlink(split, split / "a" / "up")  # a loop through the tree: never descended
    index = list_split(Volume(str(root)), "train")
    assert index.classes == ["a", "cat", "linked"]
    assert sorted(index.name(i) for i in range(len(index))) == [
        "train/a/1.jpg", "train/cat/1.jpg", "train/cat/2.jpg", "train/linked/3.jpg",
        "train/linked/relative.jpg"]
    assert "broken links: 3" in index.left_out and "subfolders: 1" in index.left_out
    assert list(index.sizes) == [os.stat(root / index.name(i)).st_size
                                 for i in range(len(index))]  # the target's size


SECRET_FILES = {  # what a hostile dataset's link may point at: none starts like an image
    "passwd": b"root:x:0:0:root:/root:/bin/bash\nSECRET-PASSWD-LINE\n",
    "id_rsa": b"-----BEGIN OPENSSH PRIVATE KEY-----\nSECRET-KEY-BODY\n",
    "binary": bytes(range(256)) + b"SECRET-BINARY",
    "near-miss": b"P9 SECRET-NEAR-MISS",  # "P" then a digit no PPM has
}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_link_to_a_non_image_secret_is_a_bad_file_and_never_cached(tmp_path, workers):
    """Prefetch threads and decoding workers both fill the cache: neither may store the
    bytes of a file that is no image (here: links to files outside the dataset)."""
    root = image_tree(tmp_path / "r", {"train/a/1.jpg": a_jpeg(1), "train/a/2.jpg": a_jpeg(2)})
    outside = image_tree(tmp_path / "home", SECRET_FILES)
    for name in SECRET_FILES:
        os.symlink(outside / name, root / "train" / "a" / f"{name}.jpg")
    (root / "train" / "a" / "plain.jpg").write_bytes(b"SECRET-PLAIN-TEXT, not a link")
    cache = NodeCache(tmp_path / "cache", 10 ** 8)
    ds = open_dataset(Volume(str(root)), "train", cache, 16, train=True, seed=0)
    assert len(ds) == 7
    keys = [[(0, i) for i in range(len(ds))]] * 2
    batches = list(VolumeLoader(ds, keys, workers, prefetch_threads=4, prefetch_batches=2))
    assert [int(b.stats[3]) for b in batches] == [5, 5]
    assert [len(b.indices) for b in batches] == [2, 2]
    stored = b"".join(p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert a_jpeg(1) in stored  # the images were cached: the check below can see a copy
    for payload in [*SECRET_FILES.values(), b"SECRET-PLAIN-TEXT"]:
        assert payload not in stored


# --- item 8: train and val classes ---------------------------------------------------------------

def classes_index(tmp_path: Path, split: str, classes: List[str]) -> DatasetIndex:
    root = image_tree(tmp_path / split, {f"{split}/{c}/1.jpg": a_jpeg() for c in classes})
    return list_split(Volume(str(root)), split)


def test_train_and_val_must_have_the_same_classes(tmp_path):
    train = classes_index(tmp_path, "train", ["ant", "bee", "cat", "dog"])
    check_same_classes(train, classes_index(tmp_path, "val", ["ant", "bee", "cat", "dog"]))
    with pytest.raises(DatasetError, match=r"1 classes with no val folder \(bee\): give "):
        check_same_classes(train, classes_index(tmp_path, "val2", ["ant", "cat", "dog"]))
    with pytest.raises(DatasetError, match=r"1 val classes not in train \(emu\)"):
        check_same_classes(train, classes_index(tmp_path, "val3",
                                                ["ant", "bee", "cat", "dog", "emu"]))
    many = classes_index(tmp_path, "val4", [f"x{i}" for i in range(8)])
    with pytest.raises(DatasetError, match=r"4 classes with no val folder \(ant, bee, cat, "
                                           r"dog\); 8 val classes not in train \(x0, x1, x2, "
                                           r"x3, x4 and 3 more\)"):
        check_same_classes(train, many)


def test_a_val_split_missing_a_class_stops_the_run_with_one_line(tiny_root, tmp_path):
    root = tmp_path / "shapes"
    shutil.copytree(tiny_root, root)
    shutil.rmtree(root / "val" / synthetic.CLASSES[2])
    out = run_train(tiny_overrides(root) + ["logger=none", "trainer.device=cpu",
                                            "model=tiny_cnn", f"run.root={tmp_path / 'runs'}"],
                    cwd=tmp_path, timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"no val folder ({synthetic.CLASSES[2]})" in errors[0], errors


# --- item 9: corruption libjpeg reports only on stderr -----------------------------------------

def corrupt_variants(jpeg: bytes, kind: str, n: int, seed: int):
    rng = np.random.default_rng(seed)
    scan = jpeg.index(b"\xff\xda") + 20  # past the scan header, into the entropy-coded data
    for _ in range(n):
        data = bytearray(jpeg)
        if kind == "truncated+EOI":
            data = data[:int(rng.integers(scan, len(jpeg) - 2))] + b"\xff\xd9"
        elif kind == "zeroed":
            size = int(rng.integers(16, 200))
            at = int(rng.integers(scan, len(jpeg) - 2 - size))
            data[at:at + size] = bytes(size)
        else:
            for at in rng.integers(scan, len(jpeg) - 2, size=int(rng.integers(1, 4))):
                data[at] ^= int(rng.integers(1, 256))
        yield bytes(data)


@pytest.mark.parametrize("kind, least_caught", [("truncated+EOI", 1.0), ("zeroed", 0.35),
                                                ("flipped", 0.35)])
def test_jpeg_corruption_the_decoder_only_warns_about_is_a_bad_file(kind, least_caught,
                                                                    capfd):
    jpeg = a_jpeg()
    good = decode(jpeg)
    caught = silent_changed = 0
    n = 100
    for variant in corrupt_variants(jpeg, kind, n, seed=3):
        try:
            image = decode(variant)
        except BadImageError as err:
            assert "\n" not in str(err)
            caught += 1
            continue
        silent_changed += int((image.int() - good.int()).abs().float().mean() > 2)
    print(f"{kind}: {caught} of {n} caught, {silent_changed} decoded visibly changed")
    assert caught >= least_caught * n, (caught, silent_changed)
    # The decoder's own lines are consumed, not printed once per file and epoch.
    assert "Corrupt JPEG data" not in capfd.readouterr().err


def test_other_output_during_a_decode_still_reaches_stderr(capfd):
    def decode_and_talk():
        os.write(2, b"Corrupt JPEG data: premature end of data segment\nsomeone else\n")
        return 1

    result, messages = data.decode._with_stderr_captured(decode_and_talk)
    assert result == 1 and messages.startswith(b"Corrupt JPEG data")
    err = capfd.readouterr().err
    assert err == "someone else\n"
    os.write(2, b"after\n")  # fd 2 is the real stderr again
    assert capfd.readouterr().err == "after\n"


def test_worker_processes_catch_the_same_corrupt_files(tmp_path):
    jpeg = a_jpeg()
    files = {f"train/a/{k}.jpg": a_jpeg(k) for k in range(4)}
    files["train/a/9-cut.jpg"] = next(corrupt_variants(jpeg, "truncated+EOI", 1, seed=0))
    root = image_tree(tmp_path / "r", files)
    ds = open_dataset(Volume(str(root)), "train", None, 16, train=True, seed=0)
    keys = [[(0, i) for i in range(len(ds))]] * 3
    for workers in (0, 2):
        batches = list(VolumeLoader(ds, keys, workers, prefetch_threads=0))
        assert [b.indices.tolist() for b in batches] == [[0, 1, 2, 3]] * 3, workers
        assert [int(b.stats[3]) for b in batches] == [1, 1, 1], workers
