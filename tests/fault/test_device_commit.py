"""The commit path off the C kernels: encode -> deltas -> undo (rollback) -> decode, bit-exact against the C path.

Two levels, each run in every *mode* and compared byte for byte with the C path (``native``) on the same bytes:

- one process: :class:`ReedSolomonCode` and :class:`UndoLog` (parity of a few tables, row deltas from the undo log,
  a rollback, a decode of lost shards);
- real gloo processes: :class:`CodedEmbeddings` over plain tensors (:meth:`CodedState.of_segments`, no TorchRec),
  committed steps, an uncommitted step rolled back, a lost rank recovered in place.

Modes: ``native`` (CPU, C kernels on buffer addresses), ``torch`` (CPU tensors through the device branch: torch
operations and the kernels :func:`lightning_dlrover.parity.dispatch.kernels` picks, forced with the private
switches ``CodedEmbeddings._native`` and ``UndoLog._raw``), ``portable`` (the device branch with the torch GF(2^8)
kernels too: nothing of the C extension runs) and ``cuda`` (the shards on a GPU: CuPy kernels, messages staged
through pinned memory; marked ``gpu``, skipped without CUDA).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_dlrover.fault.coding.coded_embeddings import CodedEmbeddings
from lightning_dlrover.fault.coding.coded_state import CodedState, Segment, SegmentSpec
from lightning_dlrover.fault.coding.placement import ParityPlacement
from lightning_dlrover.fault.coding.staging import Staging, host_copy, land, landing
from lightning_dlrover.fault.coding.undo_log import UndoLog
from lightning_dlrover.parity import ReedSolomonCode, as_bytes, cuda
from lightning_dlrover.parity import cpu as gf_cpu
from tests.conftest import exit_rank
from tests.gpu import requires_gpu

CPU_MODES = ["native", "torch", "portable"]


class Mode:
    """Puts the process in ``mode`` (see the module docstring) for a ``with`` block."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.device = torch.device("cuda", 0) if mode == "cuda" else torch.device("cpu")
        self._previous: str | None = None

    def __enter__(self) -> Mode:
        if self.mode == "native" and not (gf_cpu.has_raw_kernels() and gf_cpu.has_undo_kernels()):
            pytest.skip("the C extension is not built with the raw and undo-log kernels")
        if self.mode == "portable":
            self._previous = gf_cpu.set_isa(gf_cpu.PORTABLE)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            gf_cpu.set_isa(self._previous)

    def log(self, tables: list[torch.Tensor]) -> UndoLog:
        log = UndoLog(tables)
        if self.mode != "native":
            log._raw = False  # the torch branch (the only one off the CPU)
        return log


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(as_bytes(t.detach().contiguous()).cpu().numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------- one process


def _single_process_cycle(mode: str) -> dict[str, str]:
    """Encode -> touch rows (undo log) -> optimizer -> row deltas folded into parity -> rollback -> decode."""
    with Mode(mode) as m:
        k, r, rows = 3, 2, 500
        gen = torch.Generator().manual_seed(7)
        # k "ranks", each one table: float32 weights [rows, 6] and a row-wise state [rows]
        weights = [torch.randn(rows, 6, generator=gen).to(m.device) for _ in range(k)]
        states = [torch.rand(rows, generator=gen).to(m.device) for _ in range(k)]
        code = ReedSolomonCode(k, r)
        shard = [torch.cat([as_bytes(w), as_bytes(s).view(rows, 4)], dim=1) for w, s in zip(weights, states)]
        parity = code.encode([s.contiguous() for s in shard])  # [r, rows, 28]
        logs = [m.log([w, s]) for w, s in zip(weights, states)]
        out = {"encode": _digest(parity)}
        committed = [(w.clone(), s.clone()) for w, s in zip(weights, states)]
        for step in range(4):
            for i, (w, s, log) in enumerate(zip(weights, states, logs)):
                ids = (rows * torch.rand(80, generator=gen).pow(2)).long()
                log.capture(ids.to(m.device))
                touched = torch.unique(ids).to(m.device)
                w[touched] = w[touched] * 0.5 + 1.0  # the "optimizer": deterministic on any device
                s[touched] += 0.25
            if step == 3:  # the last step is undone, not committed
                break
            for i, (w, s, log) in enumerate(zip(weights, states, logs)):
                touched, at = log.sorted()
                new = torch.cat([as_bytes(w[touched]), as_bytes(s[touched]).view(-1, 4)], dim=1)
                old = torch.cat([as_bytes(log.values[0][at]), as_bytes(log.values[1][at]).view(-1, 4)], dim=1)
                code.update_rows(parity, i, touched, new ^ old)
                log.clear()
            out[f"step{step}"] = _digest(parity, *weights, *states)
            committed = [(w.clone(), s.clone()) for w, s in zip(weights, states)]
        for log in logs:
            log.rollback()
        assert all(torch.equal(w, cw) and torch.equal(s, cs) for (w, s), (cw, cs) in zip(zip(weights, states), committed))
        out["rollback"] = _digest(*weights, *states)
        shard = [torch.cat([as_bytes(w), as_bytes(s).view(rows, 4)], dim=1).contiguous() for w, s in zip(weights, states)]
        lost = [0, 2]
        available = {i: shard[i] for i in range(k) if i not in lost} | {k + j: parity[j] for j in range(r)}
        decoded = code.reconstruct(available, lost)
        assert all(torch.equal(decoded[p], shard[i]) for p, i in enumerate(lost))
        out["decode"] = _digest(decoded)
        return out


@pytest.mark.parametrize("mode", CPU_MODES[1:])
def test_single_process_cycle_off_the_c_path_is_bit_exact(mode):
    assert _single_process_cycle(mode) == _single_process_cycle("native")


@pytest.mark.gpu
@requires_gpu
def test_single_process_cycle_on_cuda_is_bit_exact():
    assert _single_process_cycle("cuda") == _single_process_cycle("native")


# ----------------------------------------------------------------------------------- gloo processes


def _segments(rank: int, device: torch.device) -> tuple[list[Segment], list[SegmentSpec]]:
    """Two tables of different rows and row sizes per rank (one with a row-wise state), from the rank's seed."""
    gen = torch.Generator().manual_seed(100 + rank)
    rows = 150 + 20 * rank
    tensors = [(0, torch.randn(rows, 8, generator=gen)), (0, torch.rand(rows, generator=gen)),
               (1, torch.randn(90, 6, generator=gen).half())]
    segments, specs = [], []
    for j, (table, t) in enumerate(tensors):
        name = f"t{table}/{j}"
        segments.append(Segment(name, table, t.to(device)))
        specs.append(SegmentSpec(name, (0,) * t.dim(), tuple(t.shape), tuple(t.shape), segments[-1].row_bytes))
    return segments, specs


def _step(state: CodedState, gen: torch.Generator, device: torch.device) -> None:
    """A training step's effect: rows touched (logged), then changed in place."""
    for table, indices in state._segments_of_table.items():
        rows = state.segments[indices[0]].rows
        ids = (rows * torch.rand(40, generator=gen).pow(2)).long()
        state._touch(table, ids.to(device))
        touched = torch.unique(ids).to(device)
        for index in indices:
            t = state.segments[index].tensor
            t[touched] = t[touched] * 0.5 + 1.0


def _snapshot(coded: CodedEmbeddings) -> list[torch.Tensor]:
    return [coded.parity.clone()] + [s.tensor.clone() for s in coded.state.segments]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _run_mode(rank: int, world: int, k: int, r: int, mode: str) -> dict[str, str]:
    with Mode(mode) as m:
        segments, specs = _segments(rank, m.device)
        state = CodedState.of_segments(segments, specs, k)
        coded = CodedEmbeddings(state, ParityPlacement(world, k, r), encode=False)
        if mode != "native":
            coded._native = False  # the device branch (the only one off the CPU)
            for log in state._logs.values():
                log._raw = False
        assert coded.parity.device == m.device
        coded.encode()
        out = {"encode": _digest(*_snapshot(coded))}
        gen = torch.Generator().manual_seed(rank)
        ballot = torch.zeros(8, dtype=torch.uint8)
        for step in range(3):
            _step(state, gen, m.device)
            coded.post_deltas()
            coded.finish_deltas()
            coded.vote(ballot)
            coded.decide(step)
            out[f"step{step}"] = _digest(*_snapshot(coded))
        assert coded.verify(), "the parity kept by deltas equals a fresh encode"
        committed = _snapshot(coded)
        _step(state, gen, m.device)  # a step whose commit never completes: deltas applied, then undone
        coded.post_deltas()
        coded.finish_deltas()
        out["uncommitted"] = _digest(*_snapshot(coded))
        coded.rollback()
        assert _same(_snapshot(coded), committed), "rollback restores the committed rows and parity"
        lost = 1
        if rank == lost:  # the lost rank's tables and parity share are gone
            for seg in state.segments:
                seg.tensor.zero_()
            coded.parity.zero_()
        coded.recover([lost])
        assert _same(_snapshot(coded), committed), "recovery rebuilds the lost rank's rows and parity exactly"
        out["recover"] = _digest(*_snapshot(coded))
        state.close()
        return out


def _worker(rank: int, world: int, k: int, r: int, modes: list[str], path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    results = {mode: _run_mode(rank, world, k, r, mode) for mode in modes}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    exit_rank()


def _run_job(tmp_path, k: int, r: int, modes: list[str]) -> None:
    world = k + r
    mp.spawn(_worker, args=(world, k, r, modes, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for mode in modes[1:]:
            assert results[mode] == results[modes[0]], f"rank {rank}: {mode} differs from {modes[0]}"


@pytest.mark.parametrize("k, r", [(2, 1), (2, 2)])
def test_commit_cycle_off_the_c_path_is_bit_exact(tmp_path, k, r):
    if not (gf_cpu.has_raw_kernels() and gf_cpu.has_undo_kernels()):
        pytest.skip("the C extension is not built with the raw and undo-log kernels")
    _run_job(tmp_path, k, r, CPU_MODES)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("k, r", [(2, 1), (2, 2)])
def test_commit_cycle_on_cuda_is_bit_exact(tmp_path, k, r):
    """The ranks share one GPU (gloo moves host memory: the messages are staged, no NCCL)."""
    if not (gf_cpu.has_raw_kernels() and gf_cpu.has_undo_kernels()):
        pytest.skip("the C extension is not built with the raw and undo-log kernels")
    _run_job(tmp_path, k, r, ["native", "cuda"])


# ----------------------------------------------------------------------------------- guards and staging


def test_c_kernels_refuse_a_tensor_not_on_the_cpu():
    """A device tensor handed to the C kernels raises (it would crash them); ``meta`` tensors stand in for CUDA."""
    meta = torch.empty(4, 8, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="parity is on meta; the CPU kernels need CPU tensors"):
        gf_cpu.host_ptr(meta, "parity")
    cpu_tensor = torch.zeros(4, 8, dtype=torch.uint8)
    assert gf_cpu.host_ptr(cpu_tensor, "parity") == cpu_tensor.data_ptr()
    if gf_cpu.isa() == gf_cpu.PORTABLE:
        pytest.skip("the C extension is not in use")
    with pytest.raises(ValueError, match="src is on meta; the CPU kernels need CPU tensors"):
        gf_cpu.matmul([cpu_tensor], [meta], np.ones((1, 1), dtype=np.uint8), True)
    with pytest.raises(ValueError, match="delta is on meta"):
        gf_cpu.update_rows(cpu_tensor.view(1, 4, 8), np.ones(1, dtype=np.uint8), torch.tensor([0]),
                           torch.empty(1, 8, dtype=torch.uint8, device="meta"), True)
    assert not cpu_tensor.any()


def test_undo_log_of_device_tables_takes_the_torch_branch():
    """An undo log of tables off the CPU never reaches the C kernels (``meta``: shapes only)."""
    log = UndoLog([torch.empty(10, 3, device="meta")])
    assert not log._raw and log.pos.device.type == "meta" and log.rows.device.type == "meta"


def test_staging_leaves_host_memory_alone():
    staging = Staging(torch.device("cpu"))
    message = torch.arange(16, dtype=torch.uint8)
    assert staging.on_host
    assert staging.to_host({3: message})[3] is message and staging.to_device(message) is message
    assert host_copy(message) is message and landing(message) is message
    land(message, message)  # nothing to copy


def test_one_dispatch_per_device(monkeypatch):
    from lightning_dlrover.parity import dispatch, portable

    monkeypatch.setattr(dispatch, "_warned_portable", set())  # the warning is given once per process
    assert dispatch.kernels(torch.device("cpu")) is gf_cpu
    with pytest.warns(RuntimeWarning, match="no native kernels for meta tensors; using slow portable torch kernels"):
        assert dispatch.kernels(torch.device("meta")) is portable
    if torch.cuda.is_available():
        assert dispatch.kernels(torch.device("cuda", 0)) is (cuda if cuda.available() else portable)
