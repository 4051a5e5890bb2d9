"""``PredictionWriter``: the predictions of ``trainer.predict`` as one CSV or Parquet file, one row per input sample,
in input order, exactly once, at any world size.

Every rank streams its rows (``index``, ``probability``, ``label``) to a part file next to the output as its batches
end; at the end of ``predict`` rank 0 merges the parts in rank order into the output (a shared filesystem, as for
checkpoints). Rows are ordered and deduplicated by ``index``: with :class:`~lightning_dlrover.data.EvalLoader` the
rank slices are contiguous and the merge is a concatenation; with another loader (e.g. a ``DistributedSampler``,
which interleaves ranks and repeats samples to even them out) the merge sorts by index and keeps the first row of
each index.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

RECORD = np.dtype([("index", "<i8"), ("probability", "<f4"), ("label", "<f4")])
FORMATS = ("csv", "parquet")
_CHUNK = 1 << 20  # records per read while merging


def require_pyarrow() -> None:
    """Raises ``ImportError`` naming the fix when pyarrow (needed for Parquet) is not installed."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError(
            "PredictionWriter(format='parquet') needs pyarrow, which is not installed: `pip install pyarrow` "
            "(or `pip install lightning-dlrover[parquet]`), or write CSV (format: csv)."
        ) from None


class PredictionWriter(BasePredictionWriter):
    """Writes the predictions of ``trainer.predict`` to ``out``: columns ``index, probability[, label]``, one row per
    sample, in index order.

    ``predict_step`` returns ``{"probability": [B], "index": [B] (optional), "label": [B] (optional)}`` or the
    probabilities alone; without ``index`` the dataloader's sample indices (Lightning's ``batch_indices``) are used.
    Rows with a negative index (padding) are dropped.

    Args:
        out: the output file; default ``<trainer.default_root_dir>/predictions.<format>``.
        format: ``csv`` or ``parquet`` (needs pyarrow); default from ``out``'s suffix, else ``csv``.
    """

    def __init__(self, out: str | None = None, format: Literal["csv", "parquet"] | None = None) -> None:
        super().__init__(write_interval="batch")
        if format is None:
            format = "parquet" if out is not None and str(out).endswith(".parquet") else "csv"
        if format not in FORMATS:
            raise ValueError(f"PredictionWriter: format={format!r} is not one of {list(FORMATS)}.")
        if format == "parquet":
            require_pyarrow()
        self.out, self.format = out, format
        self.path: Path | None = None
        self._part: BinaryIO | None = None
        self._has_label: bool | None = None

    def _part_path(self, rank: int) -> Path:
        assert self.path is not None
        return self.path.with_name(f".{self.path.name}.rank{rank}.part")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.path = Path(self.out) if self.out is not None else Path(trainer.default_root_dir) / f"predictions.{self.format}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._part = open(self._part_path(trainer.global_rank), "wb")

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Sequence[int] | None, batch: Any, batch_idx: int,
                           dataloader_idx: int) -> None:
        assert self._part is not None
        rows = _as_dict(prediction)
        probability = rows["probability"].detach().float().reshape(-1).cpu()
        index = rows.get("index")
        if index is None:
            if batch_indices is None:
                raise ValueError(
                    "PredictionWriter needs each sample's index: return {'index': ..., 'probability': ...} from "
                    "predict_step, or predict with a torch DataLoader (Lightning then records the sample indices)."
                )
            index = torch.as_tensor(list(batch_indices), dtype=torch.int64)
        label = rows.get("label")
        self._has_label = label is not None
        records = np.empty(len(probability), dtype=RECORD)
        records["index"] = index.reshape(-1).cpu().numpy()
        records["probability"] = probability.numpy()
        records["label"] = label.detach().float().reshape(-1).cpu().numpy() if label is not None else np.nan
        records[records["index"] >= 0].tofile(self._part)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Closes this rank's part; rank 0 merges every rank's into the output once all are written."""
        assert self._part is not None and self.path is not None
        self._part.close()
        self._part = None
        trainer.strategy.barrier("prediction_writer_parts")
        if trainer.is_global_zero:
            parts = [self._part_path(rank) for rank in range(trainer.world_size)]
            merge(parts, self.path, self.format, self._has_label is not False)
            for part in parts:
                part.unlink()
        trainer.strategy.barrier("prediction_writer_merged")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._part is not None:
            self._part.close()
            self._part = None
            self._part_path(trainer.global_rank).unlink(missing_ok=True)


def _as_dict(prediction: Any) -> dict[str, torch.Tensor]:
    if isinstance(prediction, torch.Tensor):
        return {"probability": prediction}
    if isinstance(prediction, dict) and "probability" in prediction:
        return prediction
    raise TypeError(
        "PredictionWriter: predict_step must return the probabilities (a tensor) or a dict with 'probability' "
        f"(and optionally 'index' and 'label'), got {type(prediction).__name__}."
    )


def _chunks(part: Path) -> Iterator[np.ndarray]:
    with open(part, "rb") as f:
        while len(records := np.fromfile(f, dtype=RECORD, count=_CHUNK)):
            yield records


def _in_order(parts: list[Path]) -> bool:
    """Whether the parts, read one after the other, hold strictly increasing indices."""
    last = -1
    for part in parts:
        for records in _chunks(part):
            index = records["index"]
            if index[0] <= last or (len(index) > 1 and not (np.diff(index) > 0).all()):
                return False
            last = int(index[-1])
    return True


def _ordered(parts: list[Path]) -> Iterator[np.ndarray]:
    """The parts' records in index order, each index once (the first row of an index wins)."""
    if _in_order(parts):
        for part in parts:
            yield from _chunks(part)
        return
    records = np.concatenate([np.fromfile(part, dtype=RECORD) for part in parts] or [np.empty(0, RECORD)])
    records = records[np.argsort(records["index"], kind="stable")]
    _, first = np.unique(records["index"], return_index=True)
    yield records[first]


def merge(parts: list[Path], out: Path, format: str, with_label: bool) -> int:
    """Writes the records of ``parts`` to ``out`` (``csv`` or ``parquet``) in index order, each index once; returns
    the number of rows. The file appears complete or not at all."""
    columns = ["index", "probability"] + (["label"] if with_label else [])
    staging = out.with_name(f".{out.name}.partial")
    rows = 0
    if format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("index", pa.int64()), ("probability", pa.float32())]
                           + ([("label", pa.float32())] if with_label else []))
        with pq.ParquetWriter(staging, schema) as writer:
            for records in _ordered(parts):
                writer.write_table(pa.table({c: records[c] for c in columns}, schema=schema))
                rows += len(records)
    else:
        # %.9g: nine significant digits read back as the same float32
        fmt = ",".join(["%d", "%.9g"] + (["%.9g"] if with_label else []))
        with open(staging, "w") as f:
            f.write(",".join(columns) + "\n")
            for records in _ordered(parts):
                table = np.column_stack([records[c].astype(np.float64) for c in columns])
                np.savetxt(f, table, fmt=fmt)
                rows += len(records)
    os.replace(staging, out)
    return rows
