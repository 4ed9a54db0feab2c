"""The per-round key space: a restarted round must never take a dead round's leftovers in
torchrun's store for its own (docs/architecture.md#pitfalls-seen-on-this-stack)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from support.launch import free_port
from train.cluster.world import agree_round_key


def test_ranks_agree_on_a_fresh_key_despite_a_dead_rounds_leftovers():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, is_master=True,
                           timeout=timedelta(seconds=20), wait_for_workers=False)

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, None, is_master=False,
                             timeout=timedelta(seconds=20))

    # A dead round: rank 1 had been served an old key, rank 2 had posted but died unserved.
    server.set("goodput/hello/1", "n1")
    server.set("goodput/ack/n1", "old-key")
    server.set("goodput/got/n1", "1")
    server.set("goodput/hello/2", "n2")
    keys = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)  # the new round's ranks start late, after rank 0 read the leftovers
        keys[r] = agree_round_key(client(), r, 3, timeout_s=20)

    threads = [threading.Thread(target=rank, args=(r, d)) for r, d in [(0, 0), (1, .5), (2, 1)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys.values())) == 1 and keys[0] != "old-key", keys
    # ... and the next round gets yet another key, over this round's leftovers.
    threads = [threading.Thread(target=rank, args=(r, d)) for r, d in [(0, 0), (1, .3), (2, 0)]]
    first = keys[0]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys.values())) == 1 and keys[0] != first
