"""The undo log of one embedding table: the rows touched since the last commit and their committed values.

A table's segments (its weights and each optimizer state, all ``[rows, ...]``) share one log. A row is logged
once per commit window, at its first touch, with the values it had then (the committed ones); later touches in the
window leave it alone. The log keeps its rows by the capture that first touched them (each capture's new rows in
increasing order) and the values beside them, in preallocated buffers that grow by doubling and are kept across
commits, so a step appends and a commit forgets without reordering or copying values. Readers get the rows in
increasing order and, for each, its place in the log (:meth:`UndoLog.sorted`): with one capture per window (a
commit every step) that is the log itself.

The log lives on its tables' device. On the CPU the C kernels keep the row -> place index; on any other device
(CUDA) the same log is kept with torch operations, which run there as they are (the C kernels read host memory
only). ``_raw`` is the one switch between the two (tests set it to ``False`` to run the torch branch on the CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dlrover.parity import cpu as gf_cpu

#: Below this many table rows per logged row, the increasing order comes from one scan of the row -> place index
#: (C kernel) instead of a sort of the logged rows.
SCAN_RATIO = 32


class UndoLog:
    """Rows of a table touched since :meth:`clear` and the committed values of ``tables`` at them.

    Args:
        tables: live ``[rows, ...]`` tensors of the table's segments (the same number of rows).
    """

    def __init__(self, tables: list[Tensor]) -> None:
        self.tables = tables
        self.num_rows = tables[0].shape[0] if tables else 0
        if any(t.shape[0] != self.num_rows for t in tables):
            raise ValueError(f"segments of one table must have the same rows; got {[t.shape[0] for t in tables]}")
        #: Where the tables, and so the log, live.
        self.device = tables[0].device if tables else torch.device("cpu")
        if any(t.device != self.device for t in tables):
            raise ValueError(f"segments of one table must be on one device; got {[str(t.device) for t in tables]}")
        # Untested on GPU: buffers on a CUDA device (the tests run them on the CPU and on "meta").
        #: ``pos[row]``: the row's place in the log, -1 if it is not logged.
        self.pos = torch.full((self.num_rows,), -1, dtype=torch.int32, device=self.device)
        #: Logged rows (``rows[:len(self)]``) by the capture that first touched them, each capture's increasing.
        self.rows = torch.empty(0, dtype=torch.int64, device=self.device)
        #: ``values[j][i]``: the committed value of ``tables[j]`` at ``rows[i]``.
        self.values = [torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in tables]
        self._n = 0
        self._ordered = True  # rows[:n] is increasing
        self._sorted: tuple[Tensor, Tensor] | None = None
        self._places = torch.arange(0, device=self.device)  # 0, 1, ... (the places of an increasing log)
        # The C kernels: host memory only, and their row -> place index is int32. Else the torch branch.
        self._raw = self.device.type == "cpu" and self.num_rows < 2**31

    def __len__(self) -> int:
        return self._n

    def _reserve(self, need: int) -> None:
        """Room for ``need`` logged rows (the buffers double, up to the table's rows)."""
        cap = self.rows.shape[0]
        if need <= cap:
            return
        cap = min(self.num_rows, max(need, 2 * cap, 1024))
        n = self._n
        rows = torch.empty(cap, dtype=torch.int64, device=self.device)
        rows[:n] = self.rows[:n]
        self.rows, self._places = rows, torch.arange(cap, device=self.device)
        self._places32 = self._places.to(torch.int32)
        for j, old in enumerate(self.values):
            values = torch.empty((cap, *old.shape[1:]), dtype=old.dtype, device=self.device)
            values[:n] = old[:n]
            self.values[j] = values

    def capture(self, ids: Tensor) -> None:
        """Logs the rows among ``ids`` (any integer tensor; repeats allowed) not logged yet, with their current
        values. An id outside the table raises and logs nothing."""
        ids = ids.reshape(-1).to(self.device, torch.int64)
        m, n0 = ids.numel(), self._n
        if not m:
            return
        self._reserve(min(self.num_rows, n0 + m))
        if self._raw and gf_cpu.has_undo_kernels():
            ids = ids.contiguous()
            n = gf_cpu.undo_mark_raw(gf_cpu.host_ptr(ids, "ids"), m, gf_cpu.host_ptr(self.pos, "the undo log"),
                                     self.num_rows, gf_cpu.host_ptr(self.rows, "the undo log"), n0, self.rows.shape[0])
        else:  # the same log with torch operations, on any device (function calls: cheaper than tensor indexing)
            # Untested on GPU: this branch runs on CPU tensors in the tests (``_raw = False``), never on CUDA ones.
            fresh = torch.unique(ids)  # increasing
            # Checked on the host before indexing: on CUDA an index out of range is a device-side assert that ends
            # the process's CUDA context, not an IndexError (one synchronisation; torch.unique made one already).
            low, high = fresh[[0, -1]].tolist()
            if low < 0 or high >= self.num_rows:
                raise ValueError(f"ids in [{low}, {high}] are out of range for a table of {self.num_rows} rows; "
                                 "the input's ids must index the table's shard")
            logged = self.pos.index_select(0, fresh)
            fresh = torch.masked_select(fresh, logged.lt(0))  # increasing, as the C kernel logs them
            n = n0 + fresh.numel()
            self.rows.narrow(0, n0, n - n0).copy_(fresh)
            self.pos.index_copy_(0, fresh, self._places32.narrow(0, n0, n - n0))
        if n == n0:
            return
        new = self.rows.narrow(0, n0, n - n0)
        for table, values in zip(self.tables, self.values):
            torch.index_select(table, 0, new, out=values.narrow(0, n0, n - n0))
        if self._ordered and n0:
            first, last = self.rows.narrow(0, n0 - 1, 2).tolist()
            self._ordered = first < last
        self._n, self._sorted = n, None

    def sorted(self) -> tuple[Tensor, Tensor]:
        """``(rows, at)``: the logged rows in increasing order (int64 ``[n]``) and their places in the log, so that
        ``values[j][at[i]]`` is the committed value of ``tables[j]`` at ``rows[i]``. Valid until the log changes
        (:meth:`capture`, :meth:`clear`): they may be views of its buffers."""
        if self._sorted is None:
            n = self._n
            if self._ordered:
                rows, at = self.rows[:n], self._places[:n]
            elif self._raw and gf_cpu.has_undo_kernels() and self.num_rows <= SCAN_RATIO * n:
                rows, at = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
                gf_cpu.undo_sorted_raw(gf_cpu.host_ptr(self.pos, "the undo log"), self.num_rows,
                                       gf_cpu.host_ptr(rows, "rows"), gf_cpu.host_ptr(at, "at"), n)
            else:  # the logged rows are distinct: the sort's order is unique
                rows, at = torch.sort(self.rows[:n])
            self._sorted = rows, at
        return self._sorted

    def committed(self, j: int) -> Tensor:
        """The committed values of ``tables[j]`` at the rows of :meth:`sorted`, in that order (a copy)."""
        return self.values[j].index_select(0, self.sorted()[1])

    def rollback(self) -> None:
        """Writes the committed values back into the tables and clears the log."""
        rows = self.rows[: self._n]
        for table, values in zip(self.tables, self.values):
            table.index_copy_(0, rows, values[: self._n])
        self.clear()

    def clear(self) -> None:
        """Forgets the logged rows (the current values become the committed ones); the buffers are kept."""
        if self._n:
            self.pos.index_fill_(0, self.rows[: self._n], -1)
        self._n, self._sorted, self._ordered = 0, None, True
