"""What it costs the training process to receive an assembled batch from a worker process (issue #24: the staged
pipeline's assemble stage in worker processes), per way of moving it:

- ``torch shared memory``: the TorchRec ``Batch`` itself on a ``torch.multiprocessing`` queue, as a
  ``DataLoader`` worker sends it: each tensor's storage moves to shared memory and its file descriptor is passed
  (``file_descriptor`` strategy: a connection to the sender's resource-sharer thread per storage);
- ``one shared buffer``: a single shared-memory storage per batch (one descriptor), the views rebuilt here;
- ``numpy through the pipe``: what the pipeline sends (``_Assembled``: numpy arrays pickled through the queue's
  pipe), turned into the ``Batch`` here without a tensor operation.

A worker process produces ``--batches`` batches of ``--rows`` Criteo rows into a queue of 8; the main process
receives them (and builds the ``Batch`` where the variant needs it). Columns: the main process's CPU and wall
time per batch (median of ``--rounds`` interleaved rounds).

    PYTHONPATH=. python bench/bench_batch_transfer.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from lightning_dlrover.data.sources import make_batch  # noqa: E402
from lightning_dlrover.data.staged.graph import _Chunk, _pack  # noqa: E402
from lightning_dlrover.pipeline_tuner.report import table  # noqa: E402

VARIANTS = ("torch shared memory", "one shared buffer", "numpy through the pipe")


def _arrays(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.random((rows, 13), dtype=np.float32), rng.integers(0, 1 << 40, (rows, 26), dtype=np.int64),
            rng.random(rows, dtype=np.float32))


def _produce(variant: str, q, rows: int, n: int, done) -> None:
    torch.set_num_threads(1)
    dense, ids, labels = _arrays(rows)
    for _ in range(n):
        if variant == VARIANTS[0]:
            q.put(make_batch(*(torch.from_numpy(a.copy()) for a in (dense, ids, labels))))
        elif variant == VARIANTS[1]:
            nbytes = dense.nbytes + ids.nbytes + labels.nbytes + ids.size * 4
            q.put(torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes)))
        else:
            q.put(_pack([_Chunk(0, rows, 0, 1, [], payload=(dense.copy(), ids.copy(), labels.copy()))]))
    q.put(None)
    done.wait(60)  # shared storages' descriptors are fetched from this process: stay until they are


def _receive(variant: str, rows: int, n: int) -> tuple[float, float]:
    torch.set_num_threads(1)
    q, done = mp.Queue(8), mp.Event()
    worker = mp.Process(target=_produce, args=(variant, q, rows, n, done), daemon=True)
    worker.start()
    for _ in range(10):
        q.get()
    cpu0, t0, k = time.process_time(), time.perf_counter(), 0
    while (item := q.get()) is not None:
        if variant == VARIANTS[2]:
            item.delivered()
        k += 1
    cpu, wall = (time.process_time() - cpu0) / k, (time.perf_counter() - t0) / k
    done.set()
    worker.join()
    return cpu, wall


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            got[variant].append(_receive(variant, args.rows, args.batches + 10))
    rows = [[v, f"{statistics.median(c for c, _ in got[v]) * 1e3:.3f}",
             f"{statistics.median(w for _, w in got[v]) * 1e3:.3f}"] for v in VARIANTS]
    print(f"receiving a batch of {args.rows} rows from a worker process (median of {args.rounds} rounds of "
          f"{args.batches})\n" + table(["variant", "main CPU ms/batch", "main wall ms/batch"], rows))


if __name__ == "__main__":
    main()
