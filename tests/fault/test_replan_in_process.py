"""The tables planned and sharded anew in process (``DLRoverStrategy.replan_in_process``, what
``ResourceAdvisor(apply=True)`` calls with measured pooling factors) under ``lightning-dlrover launch``.

A user's own model (tests/scripts/user_model.py: Dropout, BatchNorm, exact Adagrad tables, Adam, its own
StatefulDataLoader) on 2 ranks, its tables placed ``t0@0 t1@1 t2@0 t3@1``; after step 8 every rank asks for a
re-plan with t0 and t2 20x hotter, which puts them on different ranks. The re-shard runs at the next commit (step 8's), keeps
the state (its digest across the re-shard), and training goes on exactly as without it: a model that reads the
pooled embeddings by key ends with the digest of the same job never re-planned. The key order of the pooled
embeddings moved, which the job says (``feature_order_changed``): a model that reads them by position
(``KeyedTensor.values()``) would see its features permuted."""

import pytest

from tests.fault.test_in_process import fault_free, launch

pytestmark = pytest.mark.slow


def test_a_replan_in_process_moves_the_tables_and_trains_on_exactly(tmp_path):
    digest, events, output = launch(tmp_path, "replan", "--spares", "0", steps=12,
                                    script_args=("--by-key", "--replan-at", "8"),
                                    env={"LIGHTNING_DLROVER_VERIFY_RESIZE": "1"})
    kinds = [e.kind for e in events]
    assert not {"restarting_all", "reshard_failed"} & set(kinds), output[-4000:]
    resharded = [e for e in events if e.kind == "resharded_in_process"]
    assert sorted(e.rank for e in resharded) == [0, 1] and {e.step for e in resharded} == {8}, resharded
    assert resharded[0].fields["sharding"] == "table_wise: t0@0 t1@0 t2@1 t3@1"
    verified = next(e for e in events if e.kind == "resize_verified")
    assert verified.fields["equal"] and verified.step == 8
    moved = next(e for e in events if e.kind == "feature_order_changed")
    assert (moved.fields["before"], moved.fields["after"]) == ({"ebc": ["f0", "f2", "f1", "f3"]},
                                                               {"ebc": ["f0", "f1", "f2", "f3"]})
    assert digest == fault_free(tmp_path / "reference", script_args=("--by-key",))
