"""The vectorised TSV parse: identical to the per-field reference, and clear about malformed lines."""

import pytest
import torch

from lightning_dlrover.data.generate import GeneratorConfig, generate_rows
from lightning_dlrover.data.tsv_parse import MalformedLine, parse_block, parse_lines_reference, transform

SIZES = [997 + 13 * i for i in range(26)]
GOOD = b"1\t5\t-2\t\t0\t123456789\t\t7\t8\t9\t10\t11\t12\t13\t" + b"\t".join(
    [b"68fd1e64", b"", b"ABCDEF01", b"0", b"fffffffffffffff"] + [b"1a2b3c4d"] * 21) + b"\n"


def parsed(data, **kw):
    return transform(parse_block(data, **kw), SIZES)


def test_identical_to_reference_on_generated_and_edge_case_lines():
    data = generate_rows(GeneratorConfig(max_vocab=100_000, seed=7), 0, 0, 3000) + GOOD
    lines = data.splitlines(keepends=True)
    for got, want in zip(parsed(data), parse_lines_reference(lines, SIZES)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # CRLF line ends and a missing final newline parse the same.
    crlf = GOOD.replace(b"\n", b"\r\n") + GOOD.rstrip(b"\n")
    for got, want in zip(parsed(crlf), parse_lines_reference([GOOD, GOOD], SIZES)):
        assert torch.equal(got, want)


def test_user_transforms_run_in_order():
    cross = lambda d, i, l: (d, torch.cat([i, (i[:, :1] * 31 + i[:, 1:2]) % 1000], dim=1), l)  # noqa: E731
    dense, ids, labels = transform(parse_block(GOOD * 3), SIZES, [cross])
    assert ids.shape == (3, 27) and torch.equal(ids[:, 26], (ids[:, 0] * 31 + ids[:, 1]) % 1000)


@pytest.mark.parametrize("bad, reason", [
    (GOOD.replace(b"\t", b"", 1), "39 fields"),
    (GOOD.replace(b"68fd1e64", b"68fz1e64"), "C1 is not hex"),
    (GOOD.replace(b"\t123456789\t", b"\t12x\t"), "non-numeric dense value in I5"),
    (b"yes" + GOOD[1:], "label"),
])
def test_malformed_line_names_file_and_line(bad, reason):
    data = GOOD * 4 + bad + GOOD
    with pytest.raises(MalformedLine, match=rf"day_3\.tsv:105: malformed Criteo line \(.*{reason}") as err:
        parse_block(data, path="day_3.tsv", first_line=101)
    assert err.value.line == 105 and err.value.path == "day_3.tsv"
    raw = parse_block(data, path="day_3.tsv", first_line=101, on_error="skip")
    assert len(raw) == 5 and raw.skipped == [105]
    assert torch.equal(transform(raw, SIZES)[1], parsed(GOOD * 5)[1])
