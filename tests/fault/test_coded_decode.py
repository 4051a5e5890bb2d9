"""The copy-free decode and the commit mailbox: span arithmetic, and ``combine`` across real gloo processes against a direct computation
(sources with padding gaps, coefficients other than 1, outputs streamed through a scratch ring smaller than them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dlrover.fault.coding.decode import Combination, Term, combine, cut, intersect, subtract
from lightning_dlrover.fault.coding.messages import Mailbox
from lightning_dlrover.parity import gf256
from tests.conftest import exit_rank


def test_span_arithmetic():
    a, b = [(0, 10), (20, 30), (40, 50)], [(5, 25), (45, 60)]
    assert intersect(a, b) == [(5, 10), (20, 25), (45, 50)]
    assert subtract(a, b) == [(0, 5), (25, 30), (40, 45)]
    assert subtract([(0, 100)], [(0, 100)]) == []
    # pieces never straddle an edge of either layout or a block boundary
    assert cut([(0, 30)], [(0, 7), (7, 30), (12, 30)], block=16) == [(0, 7), (7, 12), (12, 16), (16, 30)]
    assert cut([(3, 9)], [], block=4) == [(3, 4), (4, 8), (8, 9)]


CHUNK = 1000
LAYOUTS = {  # rank -> its pieces of the chunk (gaps are padding, zero)
    0: [(0, 96), (96, 400), (408, 1000)],
    1: [(0, 512), (600, 992)],
    2: [(8, 200), (200, 700), (704, 1000)],
}


def _chunk(rank: int) -> torch.Tensor:
    data = torch.zeros(CHUNK, dtype=torch.uint8)
    values = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))
    for lo, hi in LAYOUTS[rank]:
        data[lo:hi] = values[lo:hi]
    return data


def _worker(rank: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=3)
    for block in (64, 1 << 20):  # many blocks through the 4-slot ring, and one block per piece
        _check(rank, block)
    _check_mailbox(rank)
    dist.destroy_process_group()
    exit_rank()


def _message(src: int, dst: int, length: int) -> torch.Tensor:
    message = torch.full((length,), 16 * src + dst, dtype=torch.uint8)
    message[:8].view(torch.int64)[0] = length
    return message


def _check_mailbox(rank: int) -> None:
    """Messages shorter than, longer than (two parts, the buffer grows) and again within the receive buffer; an
    exchange posted, a collective, then collected."""
    sources = [(rank - 1) % 3, (rank + 1) % 3]
    mailbox = Mailbox(sources, capacity=64)
    for length in (40, 200, 150, 1000, 16):
        sends = {dst: _message(rank, dst, length + dst) for dst in sources}
        got = mailbox.exchange(sends)
        assert sorted(got) == sorted(sources)
        for src, message in got.items():
            assert torch.equal(message, _message(src, rank, length + rank)), (rank, src, length)
    # Split in two, as commits overlapping the next batch do: a collective runs while the messages travel.
    for length in (3000, 100):
        mailbox.post({dst: _message(rank, dst, length + dst) for dst in sources})
        assert mailbox.posted
        with pytest.raises(RuntimeError, match="the previous exchange was not collected"):
            mailbox.post({})
        total = torch.tensor([rank])
        dist.all_reduce(total)
        assert int(total) == 3
        got = mailbox.collect()
        assert not mailbox.posted
        for src, message in got.items():
            assert torch.equal(message, _message(src, rank, length + rank)), (rank, src, length)


def _check(rank: int, block: int) -> None:
    mine = _chunk(rank)
    regions = [(lo, mine[lo:hi]) for lo, hi in LAYOUTS[rank]]
    outputs = {0: torch.full((CHUNK,), 7, dtype=torch.uint8), 2: torch.full((CHUNK,), 9, dtype=torch.uint8)}
    combos = [
        # on rank 0, in its own layout: 1 * chunk 1 + 3 * chunk 2 (chunk 1 arrives in place, chunk 2 streamed)
        Combination(0, LAYOUTS[0], [Term(1, LAYOUTS[1], 1), Term(2, LAYOUTS[2], 3)], lambda: [(lo, outputs[0][lo:hi]) for lo, hi in LAYOUTS[0]]),
        # on rank 2, the whole chunk: 5 * chunk 0 + 7 * chunk 1 (no term is 1: zeroed, both streamed)
        Combination(2, [(0, CHUNK)], [Term(0, LAYOUTS[0], 5), Term(1, LAYOUTS[1], 7)], lambda: [(0, outputs[2])]),
        # on rank 1, with a term it holds itself: 1 * chunk 1 + 2 * chunk 0
        Combination(1, [(0, CHUNK)], [Term(1, LAYOUTS[1], 1), Term(0, LAYOUTS[0], 2)], lambda: [(0, outputs.setdefault(1, torch.empty(CHUNK, dtype=torch.uint8)))]),
    ]
    for combo in combos:
        for term in combo.terms:
            if term.holder == rank:
                term.regions = lambda regions=regions: regions
    combine(combos, block=block)
    mul = lambda c, x: torch.from_numpy(gf256.MUL_TABLE[c][x.numpy()])  # noqa: E731
    expected = {0: _chunk(1) ^ mul(3, _chunk(2)), 2: mul(5, _chunk(0)) ^ mul(7, _chunk(1)), 1: _chunk(1) ^ mul(2, _chunk(0))}
    got = outputs[rank]
    if rank == 0:  # only the layout's bytes are written; padding keeps what it held
        keep = torch.full((CHUNK,), 7, dtype=torch.uint8)
        for lo, hi in LAYOUTS[0]:
            keep[lo:hi] = expected[0][lo:hi]
        expected[0] = keep
    assert torch.equal(got, expected[rank]), f"rank {rank}: {int((got != expected[rank]).sum())} bytes differ"
    dist.barrier()


def test_combine_matches_direct_computation(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=3, join=True)
