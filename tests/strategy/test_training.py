"""Multi-process training through the Trainer with real TorchRec sharding over gloo."""

import re

import pytest

from tests.conftest import digests, together, train, train_forked

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def table_wise_run(tmp_path_factory) -> str:
    """Output of a 2-rank table-wise job of 12 steps (seed 7) that also prints its digest at step 10."""
    return train(tmp_path_factory.mktemp("table_wise"), "--devices", "2", "--steps", "12", "--sharding-types",
                 "table_wise", "--digest-every", "10").stdout


@pytest.mark.parametrize(
    ("sharding", "devices", "extra"),
    [("table_wise", 2, []), ("column_wise", 3, ["--min-partition", "8"])],
)
def test_trains_with_sharding_type(tmp_path, request, sharding, devices, extra):
    if sharding == "table_wise":
        out = request.getfixturevalue("table_wise_run")
    else:
        out = train(tmp_path, "--devices", str(devices), "--steps", "12", "--sharding-types", sharding, *extra).stdout
    plan = re.search(r"DLRoverStrategy: (.*)", out).group(1)
    assert plan.startswith(f"{sharding}:"), plan
    placements = re.findall(r"t_cat_\d+@([\d,]+)", plan)
    assert len(placements) == 26
    used_ranks = {int(r) for p in placements for r in p.split(",")}
    assert used_ranks == set(range(devices)), "every rank holds some shard"
    if sharding == "column_wise":
        assert all("," in p for p in placements), "min_partition=8 of dim 16 gives two column shards per table"
    found = digests(out)
    assert found["end"] == found["12"] and found["0"] != found["end"], "training changed the state"


def test_digest_is_reproducible_and_seed_dependent(tmp_path, table_wise_run):
    """Two runs with seed 3 print the same digests, one under the strategy's default launcher and one with its ranks
    forked from one zygote (``tests/conftest.py:forked``, which most multi-process tests use): the same training
    either way. The same job with seed 7 (the table-wise run above, also 2 ranks, table-wise, batch 96) has another
    state at step 10."""
    (tmp_path / "popen").mkdir()
    (tmp_path / "forked").mkdir()
    args = ["--steps", "10", "--seed", "3"]
    first, second = (digests(job.stdout) for job in together(lambda: train(tmp_path / "popen", *args),
                                                             lambda: train_forked(tmp_path / "forked", *args)))
    other = digests(table_wise_run)
    assert first == second
    assert other["10"] != first["end"]
