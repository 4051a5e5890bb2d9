"""Stops staged loaders with worker processes on a malformed line, then exits (tests/data/test_robustness.py).

First with the transform worker busy (a slow user transform) when the loader stops, so a 655 KB item waits in the
main process's queue to it; then the default layout, ``runs`` times. Prints ``exiting`` last."""

import sys
import time
from pathlib import Path

from lightning_dlrover.data import CriteoTSV
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import PipelineConfig, PipelinedLoader
from lightning_dlrover.data.tsv_parse import MalformedLine


_calls = [0]


def slow(dense, ids, labels):
    """Fast on a worker's first chunk, then longer than the loader's shutdown waits for a worker."""
    _calls[0] += 1
    if _calls[0] > 1:
        time.sleep(30)
    return dense, ids, labels


def corrupt(path: Path, line: int) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[line - 1] = lines[line - 1].replace(b"\t", b"\tzz", 1)
    path.write_bytes(b"".join(lines))


def stop(loader: PipelinedLoader, line: int, pause_s: float = 0.0) -> None:
    try:
        for _ in loader:
            time.sleep(pause_s)  # a slow trainer: the stages fill their queues meanwhile
    except MalformedLine as err:
        assert err.line == line, err
        print(f"stopped at line {err.line}", flush=True)
    else:
        raise AssertionError("the loader did not stop on the malformed line")


def main(out: Path, runs: int) -> None:
    early, late = generate_days(out, 2, 12_000, GeneratorConfig(max_vocab=1000))
    corrupt(early, 2048 + 7)  # in the second batch
    corrupt(late, 6000)
    stop(PipelinedLoader(CriteoTSV([early], [1000] * 26), 0, 1, 2048, PipelineConfig(1, 1, 1, 1, 2),
                         user_transforms=[slow]), 2048 + 7, pause_s=2.0)
    source = CriteoTSV([late], [1000] * 26)
    for _ in range(runs):
        stop(PipelinedLoader(source, 0, 1, 4096, PipelineConfig(1, 2, 2, 1, 2)), 6000)
    print("exiting", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
