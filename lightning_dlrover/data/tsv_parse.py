"""Vectorised parsing of blocks of Criteo TSV lines, and the transform that makes them model inputs.

A block (bytes of whole lines) is parsed with a handful of numpy operations over all its fields at once
(separator positions, a gather of each column's characters, Horner's rule column by column), not a Python
loop per field. The result is bit-for-bit what the per-line reference parse gives: the same raw integers,
``log1p(max(x, 0))`` computed in float64 then rounded to float32, ``int(hex, 16) % table_size``.

Malformed lines (wrong field count, a non-hex categorical or one of more than 15 digits, a non-numeric dense value
or label, or one of more than 18 digits) raise :class:`MalformedLine` naming the file and the line, or, with
``on_error="skip"``, are dropped and counted. This is the one parsing rule of the package: the in-process loader
(:class:`~lightning_dlrover.data.CriteoTSV`) and the staged one both parse with :func:`parse_block`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

NUM_DENSE, NUM_SPARSE = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
#: Longest categorical field parsed (15 hex digits fit in int64).
MAX_HEX_DIGITS = 15
#: Longest dense field parsed (18 digits fit in int64), sign excluded.
MAX_DEC_DIGITS = 18
OnError = Literal["raise", "skip"]

_DEC = np.full(256, 255, dtype=np.uint8)
_DEC[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEXV = np.full(256, 255, dtype=np.uint8)
_HEXV[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)
_HEXV[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


class MalformedLine(ValueError):
    """A Criteo TSV line that cannot be parsed; ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: str, line: int, reason: str, text: bytes = b"") -> None:
        self.path, self.line, self.reason, self.text = path, line, reason, text
        snippet = f": {text[:80]!r}" if text else ""
        super().__init__(f"{path}:{line}: malformed Criteo line ({reason}){snippet}. Fix or remove the line, or "
                         f"set on_error='skip' to drop malformed lines and count them.")


@dataclass
class RawRows:
    """Parsed, untransformed fields of a block: ``labels`` [n] int64, ``dense`` [n, 13] int64 (0 where
    missing), ``hex_ids`` [n, 26] int64 (0 where missing), ``skipped``: line numbers dropped by ``on_error="skip"``,
    ``skip_reasons``: why each was dropped."""

    labels: np.ndarray
    dense: np.ndarray
    hex_ids: np.ndarray
    skipped: list[int] = field(default_factory=list)
    skip_reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.labels)


def _columns(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray, table: np.ndarray, base: int,
             max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer values of fields ``a[starts:starts+lengths]`` (any shape) in ``base``; also a bad-field mask and
    a negative mask (a leading '-' is allowed for base 10)."""
    flat_s, flat_l = starts.reshape(-1), lengths.reshape(-1)
    negative = np.zeros(flat_s.shape, dtype=bool)
    if base == 10:
        negative = (flat_l > 1) & (a[np.minimum(flat_s, len(a) - 1)] == ord("-"))
        flat_s = flat_s + negative
        flat_l = flat_l - negative
    bad = flat_l > max_len
    width = int(min(flat_l.max(initial=0), max_len))
    # Right-aligned: character k of the window ending at the field's end has the fixed weight base**(width-1-k).
    k = np.arange(width, dtype=np.int64)[None, :]
    live = k >= (width - flat_l)[:, None]
    index = (flat_s + flat_l)[:, None] - width + k
    np.maximum(index, 0, out=index)  # only dead (left-of-field) characters can fall before the buffer
    digits = table[a[index]]
    invalid = digits == 255
    bad |= (live & invalid).any(axis=1)
    digits[~live | invalid] = 0
    value = digits.astype(np.int64) @ (base ** np.arange(width - 1, -1, -1, dtype=np.int64))
    value = np.where(negative, -value, value)
    shape = starts.shape
    return value.reshape(shape), bad.reshape(shape), negative.reshape(shape)


def parse_block(data: bytes, path: str = "<block>", first_line: int = 1, on_error: OnError = "raise") -> RawRows:
    """Parses whole Criteo TSV lines (``label``, 13 integers, 26 hex ids; empty = missing).

    Args:
        data: the bytes of one or more whole lines (the final newline may be absent).
        path: file the lines come from (for error messages).
        first_line: 1-based line number of the first line in ``path``.
        on_error: ``"raise"`` a :class:`MalformedLine`, or ``"skip"`` malformed lines (listed in ``skipped``).
    """
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    if data and not data.endswith(b"\n"):
        data += b"\n"
    a = np.frombuffer(data, dtype=np.uint8)
    newline = np.flatnonzero(a == 10)
    n = len(newline)
    empty = RawRows(np.zeros(0, np.int64), np.zeros((0, NUM_DENSE), np.int64), np.zeros((0, NUM_SPARSE), np.int64))
    if n == 0:
        return empty
    sep = np.flatnonzero((a == 9) | (a == 10))
    is_nl = a[sep] == 10
    line_of_sep = np.cumsum(is_nl) - is_nl  # line index of each separator
    fields_per_line = np.bincount(line_of_sep, minlength=n)
    line_start = np.concatenate([[0], newline[:-1] + 1])
    bad_lines: dict[int, str] = {}
    for i in np.flatnonzero(fields_per_line != NUM_FIELDS):
        bad_lines[int(i)] = f"{fields_per_line[i]} fields, expected {NUM_FIELDS}"
    good = fields_per_line == NUM_FIELDS
    if bad_lines:
        keep_sep = good[line_of_sep]
        sep = sep[keep_sep]
        line_start = line_start[good]
    ends = sep.reshape(-1, NUM_FIELDS)
    starts = np.concatenate([line_start[:, None], ends[:, :-1] + 1], axis=1)
    lengths = ends - starts
    line_idx = np.flatnonzero(good)

    labels, bad_label, neg_label = _columns(a, starts[:, 0], lengths[:, 0], _DEC, 10, MAX_DEC_DIGITS)
    bad_label |= (lengths[:, 0] == 0) | neg_label
    dense, bad_dense, _ = _columns(a, starts[:, 1:14], lengths[:, 1:14], _DEC, 10, MAX_DEC_DIGITS)
    hex_ids, bad_hex, _ = _columns(a, starts[:, 14:], lengths[:, 14:], _HEXV, 16, MAX_HEX_DIGITS)
    for mask, what in ((bad_label, "label is not 0/1 or a non-negative integer"),
                       (bad_dense.any(axis=1), "non-numeric dense value in I{col}"),
                       (bad_hex.any(axis=1), f"categorical id C{{col}} is not hex (at most {MAX_HEX_DIGITS} digits)")):
        for row in np.flatnonzero(mask):
            line = int(line_idx[row])
            if line in bad_lines:
                continue
            col = ""
            if "{col}" in what:
                matrix = bad_dense if "dense" in what else bad_hex
                col = str(int(np.argmax(matrix[row])) + 1)
            bad_lines[line] = what.format(col=col)
    if bad_lines:
        if on_error != "skip":
            line = min(bad_lines)
            start = 0 if line == 0 else int(newline[line - 1]) + 1
            raise MalformedLine(path, first_line + line, bad_lines[line], data[start:int(newline[line])])
        keep = np.isin(line_idx, list(bad_lines), invert=True)
        labels, dense, hex_ids = labels[keep], dense[keep], hex_ids[keep]
        order = sorted(bad_lines)
        return RawRows(labels, dense, hex_ids, [first_line + i for i in order], [bad_lines[i] for i in order])
    return RawRows(labels, dense, hex_ids)


#: A user transform: ``(dense f32 [n, 13], ids i64 [n, 26], labels f32 [n]) -> the same``, e.g. a feature cross.
UserTransform = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def transform(raw: RawRows, num_embeddings: Sequence[int],
              user_transforms: Sequence[UserTransform] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs of parsed rows: dense ``log1p(max(x, 0))`` float32 [n, 13], ids ``hex % table size`` int64
    [n, 26] (missing -> 0), labels float32 [n]; then each of ``user_transforms`` in order."""
    dense = torch.from_numpy(np.log1p(np.maximum(raw.dense, 0).astype(np.float64)).astype(np.float32))
    ids = torch.from_numpy(raw.hex_ids % np.asarray(num_embeddings, dtype=np.int64)[None, :])
    labels = torch.from_numpy(raw.labels.astype(np.float32))
    for fn in user_transforms:
        dense, ids, labels = fn(dense, ids, labels)
    return dense, ids, labels


def parse_lines_reference(lines: Sequence[bytes], num_embeddings: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-field Python parse (the slow reference the vectorised parse is tested and measured against). It is
    not a second rule: it checks nothing :func:`parse_block` refuses (e.g. it takes a 1 MiB hex field) and is meant
    only for lines :func:`parse_block` accepts."""
    n = len(lines)
    labels, dense = torch.empty(n), torch.empty(n, NUM_DENSE)
    ids = torch.empty(n, NUM_SPARSE, dtype=torch.int64)
    for row, line in enumerate(lines):
        fields = line.rstrip(b"\r\n").split(b"\t")
        if len(fields) != NUM_FIELDS:
            raise ValueError(f"malformed Criteo line with {len(fields)} fields (expected {NUM_FIELDS}): {line[:80]!r}")
        labels[row] = float(fields[0])
        dense[row] = torch.tensor([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + NUM_DENSE]],
                                  dtype=torch.float64)
        ids[row] = torch.tensor([int(h, 16) % m if h else 0 for h, m in zip(fields[1 + NUM_DENSE :], num_embeddings)])
    return dense, ids, labels
