"""The embedded default dataset: seeded, learnable JPEGs of ten geometric shapes.

There is no internet to download a dataset from, and a first run must work anywhere, so we
draw one. Each image is a shape (the label) of random colour, size, position and rotation on
a textured background (a colour gradient, low-frequency blotches, stray lines and pixel
noise), saved as a real JPEG in ImageFolder layout:

    OUT/train/<class>/<index>.jpg     OUT/val/<class>/<index>.jpg     OUT/shapes.json

Every image is a pure function of (seed, split, index), so the bytes are the same whatever
the number of worker processes. `--size S` gives S x 3S/4 images (S=500 is ImageNet-like).

    python -m data.synthetic --out DIR --num-train N --num-val M --size S
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from common.progress import task_progress

log = logging.getLogger(__name__)

CLASSES = [
    "circle", "ring", "square", "triangle", "star",
    "cross", "hexagon", "rhombus", "crescent", "arrow",
]
MANIFEST = "shapes.json"
JPEG_QUALITY = 90
_SPLIT_CODE = {"train": 0, "val": 1}
_SUPERSAMPLE = 4  # shapes are drawn at 4x and downsampled, for anti-aliased edges


def image_height(size: int) -> int:
    return round(size * 3 / 4)


def _polygon(n: int, radius: float, angle: float, inner: Optional[float] = None
             ) -> List[Tuple[float, float]]:
    """Vertices of a regular polygon (or a star, when `inner` radius is given)."""
    points = []
    steps = 2 * n if inner else n
    for k in range(steps):
        r = inner if inner and k % 2 else radius
        a = angle + 2 * math.pi * k / steps
        points.append((r * math.cos(a), r * math.sin(a)))
    return points


def _rotated(points: List[Tuple[float, float]], angle: float) -> List[Tuple[float, float]]:
    c, s = math.cos(angle), math.sin(angle)
    return [(x * c - y * s, x * s + y * c) for x, y in points]


def _draw_shape_mask(label: int, w: int, h: int, cx: float, cy: float, r: float,
                     angle: float) -> Image.Image:
    """A greyscale mask (255 = shape) of the class `label`, anti-aliased."""
    k = _SUPERSAMPLE
    mask = Image.new("L", (w * k, h * k), 0)
    draw = ImageDraw.Draw(mask)
    cx, cy, r = cx * k, cy * k, r * k

    def poly(points: List[Tuple[float, float]], fill: int = 255) -> None:
        draw.polygon([(cx + x, cy + y) for x, y in points], fill=fill)

    def disc(x: float, y: float, radius: float, fill: int = 255) -> None:
        draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=fill)

    name = CLASSES[label]
    if name == "circle":
        disc(cx, cy, r)
    elif name == "ring":
        disc(cx, cy, r)
        disc(cx, cy, r * 0.55, fill=0)
    elif name == "square":
        poly(_polygon(4, r, angle))
    elif name == "triangle":
        poly(_polygon(3, r, angle))
    elif name == "star":
        poly(_polygon(5, r, angle, inner=r * 0.42))
    elif name == "cross":
        arm = r * 0.3
        poly(_rotated([(-r, -arm), (r, -arm), (r, arm), (-r, arm)], angle))
        poly(_rotated([(-arm, -r), (arm, -r), (arm, r), (-arm, r)], angle))
    elif name == "hexagon":
        poly(_polygon(6, r, angle))
    elif name == "rhombus":
        poly(_rotated([(r, 0), (0, r * 0.5), (-r, 0), (0, -r * 0.5)], angle))
    elif name == "crescent":
        disc(cx, cy, r)
        dx, dy = 0.45 * r * math.cos(angle), 0.45 * r * math.sin(angle)
        disc(cx + dx, cy + dy, r * 0.85, fill=0)
    elif name == "arrow":
        poly(_rotated([(-r, -0.22 * r), (0.15 * r, -0.22 * r), (0.15 * r, -0.6 * r), (r, 0),
                       (0.15 * r, 0.6 * r), (0.15 * r, 0.22 * r), (-r, 0.22 * r)], angle))
    return mask.resize((w, h), Image.LANCZOS)


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Gradient + low-frequency blotches: a texture the model must learn to ignore."""
    c0, c1 = rng.uniform(0, 255, size=(2, 3))
    theta = rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = (xx * math.cos(theta) + yy * math.sin(theta)) / max(w, h)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    img = c0[None, None, :] * (1 - t[..., None]) + c1[None, None, :] * t[..., None]
    blotches = rng.normal(0, 28, size=(4, 4, 3)).astype(np.float32)
    blotches = np.asarray(Image.fromarray(np.uint8(np.clip(blotches + 128, 0, 255)))
                          .resize((w, h), Image.BICUBIC), dtype=np.float32) - 128
    return img + blotches


def render(seed: int, split: str, index: int, size: int) -> Tuple[int, bytes]:
    """(label, JPEG bytes) of one image: a pure function of its arguments."""
    rng = np.random.default_rng([seed, _SPLIT_CODE[split], index])
    label = index % len(CLASSES)
    w, h = size, image_height(size)
    img = _background(rng, w, h)

    # Stray lines in random colours: clutter that is not the shape.
    clutter = Image.new("RGB", (w, h))
    draw = ImageDraw.Draw(clutter)
    clutter_mask = Image.new("L", (w, h), 0)
    mdraw = ImageDraw.Draw(clutter_mask)
    for _ in range(rng.integers(0, 4)):
        xy = [float(v) for v in rng.uniform(0, 1, 4) * [w, h, w, h]]
        width = max(1, int(rng.integers(1, max(2, size // 40))))
        draw.line(xy, fill=tuple(int(c) for c in rng.integers(0, 256, 3)), width=width)
        mdraw.line(xy, fill=255, width=width)
    m = np.asarray(clutter_mask, dtype=np.float32)[..., None] / 255
    img = img * (1 - m) + np.asarray(clutter, dtype=np.float32) * m

    # The shape: its colour is pushed away from the local background so it stays visible.
    short = min(w, h)
    r = rng.uniform(0.2, 0.38) * short
    cx = rng.uniform(r + 0.05 * short, w - r - 0.05 * short)
    cy = rng.uniform(r + 0.05 * short, h - r - 0.05 * short)
    mean_bg = img[int(cy), int(cx)]
    colour = rng.uniform(0, 255, 3)
    if np.abs(colour - mean_bg).sum() < 180:
        colour = np.where(mean_bg > 127, rng.uniform(0, 70, 3), rng.uniform(185, 255, 3))
    mask = _draw_shape_mask(label, w, h, cx, cy, r, rng.uniform(0, 2 * math.pi))
    alpha = np.asarray(mask, dtype=np.float32)[..., None] / 255
    shaded = colour[None, None, :] + rng.normal(0, 10, size=(1, 1, 3))
    img = img * (1 - alpha) + shaded * alpha

    img += rng.normal(0, 8, size=img.shape)
    pil = Image.fromarray(np.uint8(np.clip(img, 0, 255)))
    if rng.uniform() < 0.3:
        pil = pil.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.3, 1.0))))
    buf = io.BytesIO()
    pil.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return label, buf.getvalue()


def _write_one(args: Tuple[Path, int, str, int, int]) -> int:
    out, seed, split, index, size = args
    label, jpeg = render(seed, split, index, size)
    (out / split / CLASSES[label] / f"{index:07d}.jpg").write_bytes(jpeg)
    return len(jpeg)


def manifest(seed: int, num_train: int, num_val: int, size: int) -> dict:
    return {"generator": "shapes-v1", "seed": seed, "num_train": num_train,
            "num_val": num_val, "size": size, "classes": CLASSES}


def is_complete(out: Path, expected: dict) -> bool:
    try:
        return json.loads((out / MANIFEST).read_text()) == expected
    except (OSError, ValueError):
        return False


def generate(out: Path, num_train: int, num_val: int, size: int, seed: int = 0,
             workers: Optional[int] = None,
             progress: Optional[Callable[[int, int], None]] = None) -> Path:
    """Write the dataset to `out` atomically: into a temporary sibling, then one rename.

    An existing complete dataset with the same parameters is reused. `progress(done, total)`
    is called as files are written.
    """
    out = Path(out)
    expected = manifest(seed, num_train, num_val, size)
    if is_complete(out, expected):
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} exists and is not a shapes dataset with these parameters: "
            f"choose another --out or remove it")
    if min(num_train, num_val) < len(CLASSES) or size < 16:
        raise ValueError(f"need at least {len(CLASSES)} images per split and size >= 16")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for split in _SPLIT_CODE:
        for name in CLASSES:
            (tmp / split / name).mkdir(parents=True)
    jobs = [(tmp, seed, split, i, size)
            for split, n in (("train", num_train), ("val", num_val)) for i in range(n)]
    workers = workers or min(len(os.sched_getaffinity(0)), 8)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for done, _ in enumerate(pool.imap_unordered(_write_one, jobs, chunksize=64), 1):
            if progress and (done % 256 == 0 or done == len(jobs)):
                progress(done, len(jobs))
    (tmp / MANIFEST).write_text(json.dumps(expected, indent=1))
    try:
        if out.exists():
            out.rmdir()  # an empty directory we may replace
        os.rename(tmp, out)
    except OSError:
        # Another process finished the same dataset first: keep theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_complete(out, expected):
            raise
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--num-train", type=int, default=10000)
    parser.add_argument("--num-val", type=int, default=2000)
    parser.add_argument("--size", type=int, default=96, help="width in pixels (height 3/4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    try:
        with task_progress("generating shapes", args.num_train + args.num_val,
                           log) as update:
            generate(args.out, args.num_train, args.num_val, args.size, args.seed,
                     args.workers, progress=update)
    except (FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.num_train}+{args.num_val} images to {args.out} "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
