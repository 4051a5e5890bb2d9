"""The tuner's reading of its worker processes' memory (``observe.WorkerMemory``), on a real forked process.

A full USS reading walks the page tables (~10 ms per worker forked from a large trainer, on the trainer's thread;
read every 0.5 s for four workers it cost a 1-rank job ~8% of its steps), so it is read once per worker and then
followed by the growth of the resident size, with one full re-reading every ``refresh_s``. What must hold: the first
reading is the worker's USS, fresh memory a worker touches is counted at once, pages shared at the fork that it
writes to (copy-on-write) are counted at the next refresh, and a worker that exits is forgotten.
"""

from __future__ import annotations

import multiprocessing as mp

import psutil

from lightning_dlrover.pipeline_tuner.observe import WorkerMemory

MIB = 1 << 20
INHERITED = bytearray(96 * MIB)  # pages the child shares with this process at the fork


def _worker(conn) -> None:
    held = []
    while True:
        command = conn.recv()
        if command == "grow":  # fresh memory: its resident size grows with its USS
            block = bytearray(64 * MIB)
            block[:: 4096] = b"x" * len(block[:: 4096])
            held.append(block)
        elif command == "write inherited":  # copy-on-write: USS grows, resident size does not
            INHERITED[:: 4096] = b"y" * len(INHERITED[:: 4096])
        elif command == "stop":
            return
        conn.send("done")


def _start():
    INHERITED[:: 4096] = b"z" * len(INHERITED[:: 4096])  # resident in the parent before the fork
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_worker, args=(child,), daemon=True)
    proc.start()
    return proc, parent


def _ask(conn, command: str) -> None:
    conn.send(command)
    assert conn.recv() == "done"


def test_fresh_memory_counts_at_once_and_copy_on_write_at_the_next_refresh():
    proc, conn = _start()
    try:
        memory = WorkerMemory(refresh_s=3600.0)
        (first,) = memory.sample([proc.pid])
        full = psutil.Process(proc.pid).memory_full_info().uss
        assert abs(first - full) < 8 * MIB, (first, full)
        _ask(conn, "grow")
        (grown,) = memory.sample([proc.pid])
        assert grown - first >= 60 * MIB, (first, grown)
        _ask(conn, "write inherited")
        (unrefreshed,) = memory.sample([proc.pid])
        assert unrefreshed - grown < 32 * MIB  # not seen without a full reading (the documented lag)
        memory.refresh_s = 0.0
        (refreshed,) = memory.sample([proc.pid])
        assert refreshed - grown >= 80 * MIB, (grown, refreshed)
        true = psutil.Process(proc.pid).memory_full_info().uss
        assert abs(refreshed - true) < 8 * MIB, (refreshed, true)
    finally:
        conn.send("stop")
        proc.join(10)
    assert memory.sample([proc.pid]) == []  # an exited worker is skipped and forgotten
    assert memory._base == {}
