"""Criteo-format TSV day files with realistic value distributions, for trying the pipeline without the real data.

Each line is ``label \\t I1..I13 \\t C1..C26``, as in the Criteo Kaggle/Terabyte day files:

- ``label``: 0/1 with a click-through rate near Criteo's (~25%), drawn from a logistic function of the
  features, so a model can learn it;
- ``I1..I13``: integer counts, heavy-tailed (``floor(lognormal)``), with Criteo's per-column share of
  missing (empty) fields and the occasional negative value of column I2;
- ``C1..C26``: 8-hex-digit categorical ids; each column has a vocabulary (Criteo Kaggle cardinalities,
  capped at ``max_vocab``) whose popularity follows a power law (``rank = floor(V * u ** alpha)``), and
  Criteo's per-column share of missing fields.

Lines are produced by vectorised numpy formatting (no per-field Python), so a few hundred MB take seconds.
Output is a function of ``(seed, file index, row)`` only. The command line is :mod:`lightning_dlrover.cli.gen_criteo`:

    python -m lightning_dlrover gen-criteo --out data/criteo --files 2 --size-mb 200
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

NUM_DENSE, NUM_SPARSE = 13, 26
#: Criteo Kaggle categorical cardinalities.
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
#: Share of empty fields per dense column (Criteo Kaggle, rounded).
DENSE_MISSING = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0005, 0.04, 0.45, 0.04, 0.77, 0.22)
#: ``floor(lognormal(mu, sigma))`` parameters per dense column (medians near Criteo's).
DENSE_MU = (0.7, 1.3, 2.0, 1.6, 7.9, 3.0, 1.2, 2.3, 3.5, -0.5, 0.7, -0.5, 1.6)
DENSE_SIGMA = (1.3, 1.8, 1.4, 0.9, 1.6, 1.7, 1.4, 1.0, 1.3, 0.8, 1.0, 1.2, 1.0)
#: Share of empty fields per categorical column (Criteo Kaggle, rounded).
SPARSE_MISSING = (0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0,
                  0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_ROWS_PER_CHUNK = 65536
_SIZE_SAMPLE_ROWS = 16384  # rows generated to measure the mean line length (rows_for_size)


@dataclass(frozen=True)
class GeneratorConfig:
    """What the generated files look like.

    Args:
        max_vocab: cap on each categorical column's vocabulary (Criteo's largest is ~10M).
        alpha: power-law exponent of id popularity (1.0 = uniform; larger = hotter head).
        ctr: target share of positive labels.
        seed: seed of every file.
    """

    max_vocab: int = 1_000_000
    alpha: float = 2.0
    ctr: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_vocab < 1:
            raise ValueError(f"max_vocab={self.max_vocab} must be >= 1.")
        if self.alpha < 1.0:
            raise ValueError(f"alpha={self.alpha} must be >= 1.0 (1.0 gives uniform popularity).")
        if not 0.0 < self.ctr < 1.0:
            raise ValueError(f"ctr={self.ctr} must be in (0, 1).")

    @property
    def vocab(self) -> np.ndarray:
        return np.minimum(np.array(KAGGLE_CARDINALITIES, dtype=np.int64), self.max_vocab)


def _decimal(values: np.ndarray, width: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Right-aligned ASCII digits ``[n, width]`` and lengths ``[n]`` of int64 ``|values| < 10**(width-1)`` (a '-' for negatives)."""
    negative = values < 0
    mag = np.abs(values)
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)[None, :]  # last column = units
    digits = (mag[:, None] // powers) % 10
    ndig = np.where(mag == 0, 1, width - np.argmax(digits != 0, axis=1))
    chars = (digits + ord("0")).astype(np.uint8)
    lengths = ndig + negative
    rows = np.flatnonzero(negative)
    chars[rows, width - 1 - ndig[rows]] = ord("-")
    return chars, lengths


def _hex8(values: np.ndarray) -> np.ndarray:
    """8 lower-case hex digits ``[n, 8]`` of uint32 ``values``."""
    shifts = np.arange(28, -4, -4, dtype=np.uint64)[None, :]
    return _HEX[((values.astype(np.uint64)[:, None] >> shifts) & 0xF).astype(np.intp)]


def _scatter(out: np.ndarray, starts: np.ndarray, chars: np.ndarray, lengths: np.ndarray) -> None:
    """Writes the last ``lengths[i]`` chars of ``chars[i]`` at ``out[starts[i]:]``."""
    width = chars.shape[1]
    col = np.arange(width)[None, :]
    first = (width - lengths)[:, None]
    mask = col >= first
    dest = starts[:, None] + (col - first)
    out[dest[mask]] = chars[mask]


def generate_rows(config: GeneratorConfig, file_index: int, chunk: int, rows: int) -> bytes:
    """TSV bytes of ``rows`` lines, a deterministic function of ``(config, file_index, chunk)``."""
    rng = np.random.default_rng([config.seed, file_index, chunk])
    vocab = config.vocab
    # Dense counts.
    dense = np.floor(rng.lognormal(np.array(DENSE_MU), np.array(DENSE_SIGMA), size=(rows, NUM_DENSE))).astype(np.int64)
    np.minimum(dense, 10**10, out=dense)
    dense[:, 1] -= (rng.random(rows) < 0.1) * 3  # I2 is sometimes negative in Criteo
    dense_missing = rng.random((rows, NUM_DENSE)) < np.array(DENSE_MISSING)
    # Categorical popularity ranks and their hex ids (a fixed per-column bijection of rank to a 32-bit id).
    u = rng.random((rows, NUM_SPARSE))
    ranks = np.minimum((vocab * u ** config.alpha).astype(np.int64), vocab - 1)
    salts = np.random.default_rng([config.seed, 0xC0FFEE]).integers(1, 2**32, size=NUM_SPARSE, dtype=np.uint64)
    ids = ((ranks.astype(np.uint64) * np.uint64(2654435761) + salts) & np.uint64(0xFFFFFFFF))
    sparse_missing = rng.random((rows, NUM_SPARSE)) < np.array(SPARSE_MISSING)
    # Labels: a logistic function of a few dense counts and a fixed effect per (column, rank).
    effect = (((ranks * 7919 + np.arange(NUM_SPARSE) * 104729) % 1000) / 1000.0 - 0.5) * ~sparse_missing
    logit = effect[:, :8].sum(axis=1) * 1.2 + 0.3 * np.log1p(np.maximum(dense[:, [0, 3, 6]], 0)).sum(axis=1) * ~dense_missing[:, [0, 3, 6]].any(axis=1)
    logit += np.log(config.ctr / (1 - config.ctr)) - 0.5
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)

    # Field widths, then every field scattered into one byte buffer.
    columns: list[tuple[np.ndarray, np.ndarray]] = [(np.full((rows, 1), ord("0"), np.uint8) + labels[:, None].astype(np.uint8),
                                                     np.ones(rows, np.int64))]
    for j in range(NUM_DENSE):
        chars, lengths = _decimal(dense[:, j])
        columns.append((chars, np.where(dense_missing[:, j], 0, lengths)))
    for j in range(NUM_SPARSE):
        columns.append((_hex8(ids[:, j]), np.where(sparse_missing[:, j], 0, 8)))
    widths = np.stack([lengths for _, lengths in columns], axis=1)  # [rows, 40]
    line_len = widths.sum(axis=1) + len(columns)  # 39 tabs + newline
    line_start = np.concatenate([[0], np.cumsum(line_len)[:-1]])
    out = np.full(int(line_len.sum()), ord("\t"), dtype=np.uint8)
    out[line_start + line_len - 1] = ord("\n")
    field_start = line_start + np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(widths + 1, axis=1)[:, :-1]], axis=1).T
    for j, (chars, lengths) in enumerate(columns):
        _scatter(out, field_start[j], chars, lengths)
    return out.tobytes()


def rows_for_size(size_bytes: float, config: GeneratorConfig = GeneratorConfig()) -> int:
    """Lines per file for files of about ``size_bytes`` under ``config`` (its mean line length, measured on a sample
    of its own lines: it depends on the vocabulary, the missing shares and the counts' tails)."""
    if size_bytes <= 0:
        raise ValueError(f"size_bytes={size_bytes} must be positive.")
    sample = len(generate_rows(config, 0, 0, _SIZE_SAMPLE_ROWS)) / _SIZE_SAMPLE_ROWS
    return max(1, round(size_bytes / sample))


def write_day_file(path: str | Path, rows: int, config: GeneratorConfig = GeneratorConfig(), file_index: int = 0) -> int:
    """Writes ``rows`` Criteo-format lines to ``path``; returns the bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "wb") as f:
        for chunk, start in enumerate(range(0, rows, _ROWS_PER_CHUNK)):
            data = generate_rows(config, file_index, chunk, min(_ROWS_PER_CHUNK, rows - start))
            f.write(data)
            written += len(data)
    return written


def generate_days(out_dir: str | Path, files: int, rows_per_file: int, config: GeneratorConfig = GeneratorConfig(),
                  prefix: str = "day_") -> list[Path]:
    """Writes ``files`` day files ``<out_dir>/<prefix><i>.tsv`` of ``rows_per_file`` lines each; returns their paths."""
    if files < 1 or rows_per_file < 1:
        raise ValueError(f"files={files} and rows_per_file={rows_per_file} must both be >= 1.")
    paths = [Path(out_dir) / f"{prefix}{i}.tsv" for i in range(files)]
    for i, path in enumerate(paths):
        write_day_file(path, rows_per_file, config, file_index=i)
    return paths
