"""Side by side, in one run: how fast JPEGs reach the model, and what a slow volume costs.

    python -m data.synthetic --out /tmp/imagenet500 --size 500 --num-train 2000 --num-val 100
    python benchmarks/data_pipeline.py --data /tmp/imagenet500

Images/s at 224 px RandomResizedCrop, all with the same number of DataLoader workers:
  (a) decode + augment limit: our dataset reading the bytes from memory
  (b) our loader, warm node cache
  (c) our loader, cold cache, over a slow volume (slow://: per-file latency + bandwidth cap)
  (d) a naive torchvision ImageFolder (PIL decode) reading the same slow volume
and a short training run from the slow volume with (c)'s loader and with (d)'s, timing the
wall-clock and the loop's wait for data (fetch_seconds); its step is a simulated accelerator
step (`--step-ms`, a sleep that leaves the CPUs to the loader) or, with `--step-ms 0`, a real
MobileNetV3-small step on this CPU.
The machine is shared and noisy, so what to read is the ratios, measured minutes apart.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.cache import Lookup, NodeCache  # noqa: E402
from data.dataset import JpegFolderDataset, normalize  # noqa: E402
from data.loader import VolumeLoader, default_num_workers  # noqa: E402
from data.pipeline import open_dataset  # noqa: E402
from data.sampler import BatchPlan, GlobalBatchSampler  # noqa: E402
from data.volume import Volume  # noqa: E402

IMAGE_SIZE = 224


class InMemoryDataset(JpegFolderDataset):
    """(a): the same decode and augmentation, the bytes already in RAM."""

    def __init__(self, base: JpegFolderDataset) -> None:
        super().__init__(base.index, base.volume, None, base.image_size, base.train,
                         base.seed, base.crop_scale[0])
        with ThreadPoolExecutor(16) as pool:  # the volume is slow: fetch concurrently
            self.blobs = list(pool.map(base.fetch, range(len(base))))

    def read_bytes(self, i: int) -> Tuple[bytes, Lookup]:
        return self.blobs[i], Lookup(True, 0)


def naive_loader(root: Path, workers: int, batch: int):
    """(d): what most scripts do: ImageFolder + PIL + torchvision transforms."""
    import fsspec
    from PIL import Image
    from torchvision import datasets, transforms

    fs = fsspec.filesystem("slow")

    def load(path: str) -> Image.Image:
        return Image.open(io.BytesIO(fs.cat_file(path))).convert("RGB")

    tf = transforms.Compose([transforms.RandomResizedCrop(IMAGE_SIZE, scale=(0.35, 1.0)),
                             transforms.RandomHorizontalFlip(), transforms.PILToTensor()])
    ds = datasets.ImageFolder(str(root / "train"), transform=tf, loader=load)
    return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                       persistent_workers=workers > 0, drop_last=True,
                                       prefetch_factor=4 if workers else None)


def our_loader(ds: JpegFolderDataset, workers: int, batch: int) -> VolumeLoader:
    return VolumeLoader(ds, GlobalBatchSampler(BatchPlan(len(ds), batch), seed=0), workers)


def images_per_second(loader: Iterable, images: int, batch: int) -> float:
    """Throughput after the first batch (which pays for starting the workers)."""
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    for _ in itertools.islice(it, images // batch):
        pass
    return (images // batch) * batch / (time.perf_counter() - t0)


def train_run(loader: Iterable, steps: int, step_ms: float) -> Dict[str, float]:
    """Wall-clock of `steps` training steps and the loop's waits for data (fetch_seconds).

    A step is an accelerator's: `step_ms` of waiting that leaves the CPUs to the loader
    (a GPU step does not compete with decoding); with step_ms=0, SGD steps of
    MobileNetV3-small on this CPU, which then competes with the workers.
    """
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    waits: List[float] = []
    start = time.perf_counter()
    it = iter(loader)
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - t0)
        if step_ms > 0:
            time.sleep(step_ms / 1000)
            continue
        loss = torch.nn.functional.cross_entropy(model(normalize(batch[0])), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
    wall = time.perf_counter() - start
    waits_t = torch.tensor(waits[1:], dtype=torch.float64)  # the first includes start-up
    steady = waits_t[len(waits_t) // 3:]  # once the prefetcher is ahead of the loop
    return {"wall": wall, "step": wall / steps, "fetch_mean": waits_t.mean().item(),
            "fetch_p99": torch.quantile(waits_t, 0.99).item(),
            "steady_p99": torch.quantile(steady, 0.99).item()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="ImageFolder root (local)")
    parser.add_argument("--workers", type=int, default=default_num_workers())
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--images", type=int, default=960,
                        help="images per throughput run")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--train-steps", type=int, default=45)
    parser.add_argument("--step-ms", type=float, default=100.0,
                        help="simulated accelerator step; 0 = a real CPU training step")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--mbps", type=float, default=50.0, help="MB/s per file read")
    args = parser.parse_args()
    os.environ["GOODPUT_SLOWFS_LATENCY_MS"] = str(args.latency_ms)
    os.environ["GOODPUT_SLOWFS_MBPS"] = str(args.mbps)
    torch.set_num_threads(1)  # decode runs in the workers; keep the main process out of them
    root = args.data.resolve()
    slow = f"slow://{root}"
    print(f"data {root}, {args.workers} workers, batch {args.batch}, {args.images} images per "
          f"run, slow volume: {args.latency_ms:g} ms per file + {args.mbps:g} MB/s per read, "
          f"{os.cpu_count()} CPUs")

    work = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        def dataset(cache_dir: str = "") -> JpegFolderDataset:
            cache = NodeCache(work / cache_dir, 10 ** 11) if cache_dir else None
            return open_dataset(Volume(slow), "train", cache, IMAGE_SIZE, train=True, seed=0)

        memory = InMemoryDataset(dataset())
        warm = dataset("warm")
        with ThreadPoolExecutor(16) as pool:  # fill it outside the measurements
            list(pool.map(warm.read_bytes, range(len(warm))))
        rates: Dict[str, List[float]] = {k: [] for k in "abcd"}
        for r in range(args.rounds):
            # Interleaved, and (b) right after (a), (c) right after... so that each round's
            # ratios compare runs seconds apart: the machine is shared and noisy.
            loaders = {"a": lambda: our_loader(memory, args.workers, args.batch),
                       "b": lambda: our_loader(warm, args.workers, args.batch),
                       "c": lambda: our_loader(dataset(f"cold{r}"), args.workers, args.batch),
                       "d": lambda: naive_loader(root, args.workers, args.batch)}
            for key, make in loaders.items():
                rates[key].append(images_per_second(make(), args.images, args.batch))
            print(f"round {r}: " + ", ".join(f"({k}) {v[-1]:.0f}" for k, v in rates.items())
                  + f" img/s; (b)/(a) {rates['b'][-1] / rates['a'][-1]:.2f}, "
                  f"(c)/(d) {rates['c'][-1] / rates['d'][-1]:.2f}")
        names = {"a": "decode+augment limit (bytes in memory)", "b": "ours, warm cache",
                 "c": "ours, cold cache, slow volume", "d": "naive ImageFolder, slow volume"}
        for key in "abcd":
            print(f"({key}) {names[key]:40s} median {statistics.median(rates[key]):7.1f} img/s")
        for num, den, target in (("b", "a", 0.9), ("c", "d", 3)):
            ratios = [x / y for x, y in zip(rates[num], rates[den])]
            print(f"({num})/({den}) median of rounds {statistics.median(ratios):.2f} "
                  f"(rounds: {' '.join(f'{x:.2f}' for x in ratios)})   target >= {target}")

        step = (f"{args.step_ms:g} ms simulated accelerator step" if args.step_ms > 0
                else "MobileNetV3-small SGD step on this CPU")
        print(f"training {args.train_steps} steps of {args.batch}, {step}, from the slow "
              f"volume:")
        ours = train_run(our_loader(dataset("train"), args.workers, args.batch),
                         args.train_steps, args.step_ms)
        naive = train_run(naive_loader(root, args.workers, args.batch), args.train_steps,
                          args.step_ms)
        for name, res in (("ours, cold cache", ours), ("naive ImageFolder", naive)):
            print(f"  {name:18s} wall {res['wall']:6.1f} s, step {res['step']:.3f} s, "
                  f"fetch_seconds mean {res['fetch_mean']:.4f} s, p99 {res['fetch_p99']:.4f} s"
                  f" ({100 * res['fetch_p99'] / res['step']:.1f}% of a step); after the "
                  f"first third: p99 {res['steady_p99']:.4f} s "
                  f"({100 * res['steady_p99'] / res['step']:.1f}%)")
        print(f"  wall-clock saved by ours: {100 * (1 - ours['wall'] / naive['wall']):.0f}%")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
