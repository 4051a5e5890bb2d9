"""Restarted nodes take back the node ranks their spills were written under (``fault.renumber``)."""

from lightning_dlrover.fault.restart.renumber import old_node_ranks
from lightning_dlrover.fault.restart.spill import spilled_ranks, write_spill
from tests.fault.test_spill import spill


def test_a_surviving_node_takes_back_its_number_and_the_replacement_the_one_left():
    # 2 nodes x 2 ranks: old node 0 was lost; the survivor (old node 1) came back first, as node 0.
    assert old_node_ranks([[2, 3], []], 2) == [1, 0]
    assert old_node_ranks([[], [2, 3]], 2) is None  # the survivor kept its number
    # 3 nodes: the survivors of old nodes 2 and 0 came back as nodes 0 and 1; the replacement takes 1.
    assert old_node_ranks([[4, 5], [0, 1], []], 2) == [2, 0, 1]
    assert old_node_ranks([[5], [0], []], 2) == [2, 0, 1]  # a node with one spill (its other rank died) claims too


def test_nothing_is_renumbered_when_the_spills_cannot_say_how():
    assert old_node_ranks([[0, 1], [2, 3]], 2) is None  # already the old numbering
    assert old_node_ranks([[0, 1], []], 2) is None
    assert old_node_ranks([[], []], 2) is None  # nothing spilled (a fresh start)
    assert old_node_ranks([[2, 3]], 2) is None  # shrunk: old node 1 does not exist in this world
    assert old_node_ranks([[1, 2], []], 2) is None  # spills of two old nodes (another ranks-per-node)
    assert old_node_ranks([[2], [3]], 2) is None  # two nodes claim old node 1 (stale files)


def test_spilled_ranks_reads_the_names_of_committed_and_tentative_spills(tmp_path):
    directory = tmp_path / "spills"
    assert spilled_ranks(None) == [] and spilled_ranks(directory) == []
    for rank in (3, 1):
        write_spill(directory, spill(rank))
    ahead = spill(5)
    ahead.step, ahead.meta, ahead.rank_states, ahead.tentative = 4, None, None, True
    write_spill(directory, ahead)
    assert spilled_ranks(directory) == [1, 3, 5]
