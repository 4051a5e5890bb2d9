"""UndoLog against a straightforward reference (a dict of first-touch values), with the C kernels and without."""

import pytest
import torch

from lightning_dlrover.fault.coding.undo_log import SCAN_RATIO, UndoLog
from lightning_dlrover.parity import cpu as gf_cpu

KERNELS = ["native", "portable"]


@pytest.fixture(params=KERNELS)
def kernels(request):
    if request.param == "native" and not gf_cpu.has_undo_kernels():
        pytest.skip("the C extension is not built with the undo-log kernels")
    previous = gf_cpu.set_isa(gf_cpu.PORTABLE) if request.param == "portable" else None
    yield request.param
    if previous is not None:
        gf_cpu.set_isa(previous)


def power_law_ids(gen: torch.Generator, rows: int, m: int) -> torch.Tensor:
    u = torch.rand(m, generator=gen, dtype=torch.float64)
    return (rows * u.pow(2.0)).long().clamp_max_(rows - 1)


@pytest.mark.parametrize("rows,batch", [(3000, 400), (20000, 40)])  # the scan and the sort of the logged rows
@pytest.mark.parametrize("every", [1, 4])
def test_log_matches_reference_over_windows(kernels, rows, batch, every):
    gen = torch.Generator().manual_seed(rows + every)
    weight, state = torch.randn(rows, 5, generator=gen), torch.rand(rows, generator=gen)
    log = UndoLog([weight, state])
    for window in range(6):
        start = weight.clone(), state.clone()
        reference: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for _ in range(every):  # steps of the window: touch, then the optimizer changes the rows
            ids = power_law_ids(gen, rows, batch).to(torch.int32 if window % 2 else torch.int64)
            log.capture(ids)
            for row in ids.tolist():
                reference.setdefault(row, (weight[row].clone(), state[row].clone()))
            weight[ids.long()] += torch.randn(len(ids), 5, generator=gen)
            state[ids.long()] += 1.0
        log.capture(ids[:0])  # an empty batch logs nothing
        expected = sorted(reference)
        assert len(log) == len(expected)
        got_rows, at = log.sorted()
        assert got_rows.tolist() == expected  # increasing, each row once
        assert (rows <= SCAN_RATIO * len(log)) == (rows == 3000)  # the case the parameters meant to cover
        assert torch.equal(log.committed(0), torch.stack([reference[r][0] for r in expected]))
        assert torch.equal(log.committed(1), torch.stack([reference[r][1] for r in expected]))
        assert torch.equal(log.values[0].index_select(0, at), log.committed(0))
        if window % 3 == 2:
            log.rollback()  # back to the window's start exactly
            assert torch.equal(weight, start[0]) and torch.equal(state, start[1])
        else:
            log.clear()
        assert len(log) == 0 and bool((log.pos == -1).all())


def test_out_of_range_id_raises_and_logs_nothing(kernels):
    weight = torch.randn(100, 3)
    log = UndoLog([weight])
    log.capture(torch.tensor([5, 7]))
    for bad in ([1, 100], [-1, 2]):
        with pytest.raises(ValueError, match="out of range"):
            log.capture(torch.tensor(bad))
        assert len(log) == 2 and log.sorted()[0].tolist() == [5, 7]
        assert sorted(torch.nonzero(log.pos >= 0).flatten().tolist()) == [5, 7]


def test_buffers_are_kept_across_commits(kernels):
    weight = torch.randn(10000, 4)
    log = UndoLog([weight])
    log.capture(torch.arange(0, 3000))
    buffers = log.rows.data_ptr(), log.values[0].data_ptr()
    log.clear()
    log.capture(torch.arange(5000, 7000))
    assert (log.rows.data_ptr(), log.values[0].data_ptr()) == buffers
    assert torch.equal(log.committed(0), weight[5000:7000])


def test_gather_xor_at_matches_torch():
    if not gf_cpu.has_undo_kernels():
        pytest.skip("the C extension is not built with the undo-log kernels")
    gen = torch.Generator().manual_seed(1)
    table = torch.randint(0, 256, (50, 12), dtype=torch.uint8, generator=gen)
    old = torch.randint(0, 256, (30, 12), dtype=torch.uint8, generator=gen)
    rows, at = torch.randperm(50, generator=gen)[:20], torch.randperm(30, generator=gen)[:20]
    out = torch.empty(20, 12, dtype=torch.uint8)
    gf_cpu.gather_xor_at_raw(out.data_ptr(), table.data_ptr(), 50, rows.data_ptr(), 20, old.data_ptr(), 30,
                             at.data_ptr(), 12)
    assert torch.equal(out, table[rows] ^ old[at])
    bad = at.clone()
    bad[3] = 30
    with pytest.raises(ValueError, match="out of range"):
        gf_cpu.gather_xor_at_raw(out.data_ptr(), table.data_ptr(), 50, rows.data_ptr(), 20, old.data_ptr(), 30,
                                 bad.data_ptr(), 12)


def test_kernels_and_fallback_keep_the_same_log():
    """The C kernels and the torch fallback log the same rows in the same places (each capture's increasing)."""
    if not gf_cpu.has_undo_kernels():
        pytest.skip("the C extension is not built with the undo-log kernels")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(5000, 3, generator=gen)
    native, fallback = UndoLog([weight]), UndoLog([weight])
    fallback._raw = False
    for _ in range(5):
        ids = power_law_ids(gen, 5000, 700)
        native.capture(ids)
        fallback.capture(ids)
        n = len(native)
        assert n == len(fallback) and torch.equal(native.rows[:n], fallback.rows[:n])
        assert torch.equal(native.pos, fallback.pos) and torch.equal(native.values[0][:n], fallback.values[0][:n])
