"""The Criteo-format day-file generator: format, determinism, distributions, CLI."""

import numpy as np

from lightning_dlrover.cli.gen_criteo import main
from lightning_dlrover.data.generate import GeneratorConfig, generate_rows
from lightning_dlrover.data.tsv_parse import parse_block


def test_lines_have_criteo_format_and_realistic_values():
    data = generate_rows(GeneratorConfig(max_vocab=5000, seed=3), 0, 0, 20000)
    lines = data.splitlines()
    assert len(lines) == 20000
    fields = [line.split(b"\t") for line in lines[:2000]]
    assert all(len(f) == 40 for f in fields)
    hexes = [h for f in fields for h in f[14:] if h]
    assert all(len(h) == 8 and int(h, 16) >= 0 for h in hexes)
    raw = parse_block(data)
    assert 0.15 < raw.labels.mean() < 0.4  # Criteo-like click-through rate
    empty_i12 = np.mean([f[12] == b"" for f in fields])
    assert 0.7 < empty_i12 < 0.85  # I12 is mostly missing in Criteo
    assert (raw.dense[:, 1] < 0).any()  # I2 has negative values
    # Power-law popularity: the most frequent id of C3 covers far more than a uniform share.
    _, counts = np.unique(raw.hex_ids[:, 2], return_counts=True)
    assert counts.max() / len(raw) > 50 / 5000


def test_output_depends_only_on_seed_file_and_chunk():
    config = GeneratorConfig(max_vocab=1000, seed=1)
    assert generate_rows(config, 0, 0, 500) == generate_rows(config, 0, 0, 500)
    assert generate_rows(config, 0, 0, 500) != generate_rows(config, 1, 0, 500)
    assert generate_rows(config, 0, 0, 500) != generate_rows(GeneratorConfig(max_vocab=1000, seed=2), 0, 0, 500)


def test_cli_writes_day_files(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--files", "2", "--rows", "1234", "--max-vocab", "100"]) == 0
    files = sorted(tmp_path.glob("day_*.tsv"))
    assert [f.name for f in files] == ["day_0.tsv", "day_1.tsv"]
    assert all(f.read_bytes().count(b"\n") == 1234 for f in files)
    assert "wrote 2 file(s)" in capsys.readouterr().out


def test_cli_size_mb_is_the_size_written(tmp_path, capsys):
    # Before: a fixed 190 bytes per line was assumed; the lines average ~243, so --size-mb 80 wrote 102 MB.
    for size_mb, vocab in ((3, "1000000"), (1.5, "50")):
        out = tmp_path / str(size_mb)
        assert main(["--out", str(out), "--size-mb", str(size_mb), "--max-vocab", vocab]) == 0
        [day] = out.glob("day_*.tsv")
        assert abs(day.stat().st_size / (size_mb * 1e6) - 1) < 0.02
