"""The data pipeline at its edges: a process that stopped a loader on a malformed line exits, the in-process and
staged loaders parse by one rule, skipped lines are reported."""

from itertools import islice

import pytest
import torch

from lightning_dlrover.data import CriteoTSV, ResumableLoader
from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.data.staged import INLINE, PipelineConfig, PipelinedLoader
from lightning_dlrover.data.tsv_parse import MalformedLine
from lightning_dlrover.monitor.events import EVENTS_ENV, read_events
from tests.conftest import REPO, run

SIZES = [1000] * 26


@pytest.mark.slow
def test_a_process_exits_after_loaders_with_worker_processes_stop_on_a_malformed_line(tmp_path):
    # Before: multiprocessing's exit handler joined a queue's feeder thread that was writing a 655 KB block into a
    # pipe no worker read any more, and the process never exited. The timeout only detects that hang.
    script = REPO / "tests" / "scripts" / "stop_on_malformed.py"
    out = run([script, tmp_path / "data", 3], tmp_path, timeout=180).stdout
    assert out.count("stopped at line 2055") == 1 and out.count("stopped at line 6000") == 3 and "exiting" in out


def _first_error(loader):
    with pytest.raises(MalformedLine) as err:
        for _ in loader:
            pass
    return err.value.path, err.value.line, err.value.reason


def test_in_process_and_staged_loaders_parse_by_one_rule(tmp_path):
    # Before: a 1 MiB hex field was refused by the staged loader and taken (int(h, 16) % size) in process.
    [path] = generate_days(tmp_path, 1, 400, GeneratorConfig(max_vocab=1000, seed=5))
    lines = path.read_bytes().splitlines(keepends=True)
    fields = lines[250].split(b"\t")
    fields[20] = b"f" * 2**20  # C7
    lines[250] = b"\t".join(fields)
    path.write_bytes(b"".join(lines))
    source = CriteoTSV([path], SIZES)
    in_process = _first_error(ResumableLoader(source, 0, 1, 100))
    staged = _first_error(PipelinedLoader(source, 0, 1, 100, PipelineConfig(0, 1, 0, 0, 1), chunk_rows=64))
    assert in_process == staged == (str(path), 251, "categorical id C7 is not hex (at most 15 digits)")
    # Before the bad line, both deliver the same batches.
    staged_loader = PipelinedLoader(source, 0, 1, 100)
    for a, b in zip(islice(ResumableLoader(source, 0, 1, 100), 2), islice(staged_loader, 2)):
        assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    staged_loader.close()


def test_skipped_lines_are_reported_per_file_and_epoch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(EVENTS_ENV, str(tmp_path / "events.jsonl"))
    [path] = generate_days(tmp_path, 1, 500, GeneratorConfig(max_vocab=1000, seed=6))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[99] = lines[99].replace(b"\t", b"", 1)  # line 100: 39 fields
    lines[299] = lines[299].replace(b"\t", b"\tzz", 1)  # line 300: a non-numeric I1
    path.write_bytes(b"".join(lines))
    loader = PipelinedLoader(CriteoTSV([path], SIZES), 0, 1, 200, INLINE, on_error="skip")
    assert [len(b.labels) for b in loader] == [199, 199]  # the epoch's end reports lines 100 and 300
    next(iter(loader))  # line 100 again, in the second epoch: reported at the end of fit
    loader.report_skipped("fit")
    events = [e for e in read_events([tmp_path / "events.jsonl"]) if e.kind == "data_skipped"]
    assert [(e["file"], e["line"], e["reason"], e["count"]) for e in events] == [
        (str(path), 100, "39 fields, expected 40", 2), (str(path), 100, "39 fields, expected 40", 1)]
    err = capsys.readouterr().err
    assert err.count(f"{path}:100: skipped a malformed Criteo line") == 1  # once per file
    assert f"skipped 2 malformed lines of {path} in this epoch" in err
    assert f"skipped 1 malformed line of {path} in this fit" in err and "this fit skipped 3 malformed lines" in err
