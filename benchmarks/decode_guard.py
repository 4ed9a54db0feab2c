"""What the untrusted-data guards cost on the JPEG hot path: `data.decode.decode` (header
size check + libjpeg's corrupt-data warnings read back from stderr) against a bare
`decode_jpeg`, on the synthetic shapes images, one core. Prints img/s and the ratio.

    python benchmarks/decode_guard.py [--size 96 --images 400 --repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data import synthetic  # noqa: E402
from data.decode import decode  # noqa: E402


def bare(data: bytes) -> torch.Tensor:
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                       mode=ImageReadMode.RGB)


def rate(fn: Callable[[bytes], torch.Tensor], images: List[bytes], repeats: int) -> float:
    best = 0.0
    for _ in range(repeats):  # best of: the machine is shared
        start = time.perf_counter()
        for data in images:
            fn(data)
        best = max(best, len(images) / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = [synthetic.render(0, "train", i, args.size)[1] for i in range(args.images)]
    for fn in (bare, decode):  # warm up both
        rate(fn, images[:20], 1)
    before, after = rate(bare, images, args.repeats), rate(decode, images, args.repeats)
    print(f"{args.size}px JPEGs: decode_jpeg {before:.0f} img/s, guarded decode {after:.0f} "
          f"img/s, ratio {after / before:.3f}")


if __name__ == "__main__":
    main()
