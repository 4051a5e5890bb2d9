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


def test_the_advisor_applies_its_re_plan_in_process_and_keeps_a_position_reading_model_as_it_was(tmp_path):
    """``ResourceAdvisor(apply=True)`` on the model with multi-hot t0 and t2 (20 ids per sample), both on rank 0: at
    its first check (step 10) it measures rank 0 at 1.9x the mean load and hands the re-plan to the strategy. A model
    that reads the pooled embeddings by key (``pooled_embeddings_by_key = True``) is re-sharded in process; one that reads them
    by position is left as it was (the new plan would permute its features)."""
    for name, by_key in (("by-key", True), ("by-position", False)):
        _, events, output = launch(tmp_path, name, "--spares", "0", steps=16,
                                   script_args=("--multi-hot", "20", "--advisor", *(["--by-key"] if by_key else [])),
                                   env={"LIGHTNING_DLROVER_VERIFY_RESIZE": "1"})
        kinds = [e.kind for e in events]
        assert not {"restarting_all", "reshard_failed", "addon_failed"} & set(kinds), output[-4000:]
        applied = [e for e in events if e.kind == "advice_applied" and e.fields["knob"] == "sharding_plan"]
        assert sorted(e.rank for e in applied) == [0, 1] and all(e.step == 10 for e in applied), kinds
        assert applied[0].fields["new"] == {"t0": 20.0, "t1": 1.0, "t2": 20.0, "t3": 1.0}
        resharded = next(e for e in events if e.kind == "resharded_in_process")
        assert next(e for e in events if e.kind == "resize_verified").fields["equal"]
        if by_key:
            assert resharded.fields["sharding"] == "table_wise: t0@0 t1@0 t2@1 t3@1" and "replan_refused" not in kinds
        else:
            assert resharded.fields["sharding"] == "table_wise: t0@0 t1@1 t2@0 t3@1"  # where they were
            refused = next(e for e in events if e.kind == "replan_refused")
            assert refused.fields["after"] == {"ebc": ["f0", "f1", "f2", "f3"]} and "feature_order_changed" not in kinds
