"""``lightning-dlrover fit`` on Criteo TSV files with malformed lines: ``on_error: skip`` trains and reports what it
dropped (events, warnings), ``on_error: raise`` ends with the one-line message naming the file and line."""

import pytest

from lightning_dlrover.data.generate import GeneratorConfig, generate_days
from lightning_dlrover.monitor.events import read_events
from tests.conftest import REPO, run


def _data(tmp_path):
    [path] = generate_days(tmp_path / "data", 1, 6000, GeneratorConfig(max_vocab=1000, seed=4))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[499] = lines[499].replace(b"\t", b"\tzz", 1)  # line 500: a non-numeric I1
    lines[2500] = lines[2500].replace(b"\t", b"", 1)  # line 2501: 39 fields
    path.write_bytes(b"".join(lines))
    return path


def _fit(tmp_path, path, on_error, steps, check):
    return run(["-m", "lightning_dlrover", "fit", "--config", REPO / "configs" / "tsv.yaml", "--trainer.devices=1",
                f"--trainer.max_steps={steps}", "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]",
                f"--trainer.default_root_dir={tmp_path / on_error}", f"--data.criteo_paths=[{path}]",
                "--data.global_batch_size=512",
                f"--data.pipeline={{read: 1, parse: 1, transform: 1, assemble: 1, prefetch: 2, on_error: {on_error}}}"],
               tmp_path, check=check)


@pytest.mark.slow
def test_skip_reports_the_dropped_lines_and_raise_ends_with_one_line(tmp_path):
    path = _data(tmp_path)
    # skip: 11 batches of 512 per epoch; 14 steps = the first epoch (lines 500 and 2501 dropped), then 3 steps of
    # the second (line 500 again), reported at the end of fit. Before: reported nowhere.
    out = _fit(tmp_path, path, "skip", 14, check=True).stdout
    skipped = [e for e in read_events([tmp_path / "skip" / "dlrover_events.jsonl"]) if e.kind == "data_skipped"]
    assert [(e["file"], e["line"], e["count"]) for e in skipped] == [(str(path), 500, 2), (str(path), 500, 1)]
    assert skipped[0]["reason"] == "non-numeric dense value in I1"
    assert f"{path}:500: skipped a malformed Criteo line (non-numeric dense value in I1)" in out
    assert f"skipped 2 malformed lines of {path} in this epoch" in out
    assert "this fit skipped 3 malformed lines in all" in out
    # raise: the message, not the trainer's traceback. The CLI catches MalformedLine by its type, so Trainer.fit
    # raised that type: from Python it stays catchable.
    failed = _fit(tmp_path, path, "raise", 3, check=False)
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert f"lightning-dlrover fit: error: {path}:500: malformed Criteo line (non-numeric dense value in I1)" in failed.stdout
    assert "Traceback" not in failed.stdout, failed.stdout[-3000:]
