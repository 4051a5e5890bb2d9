"""Rotated parity placement: distinct group members, equal shares, any r losses recoverable."""

import itertools

import pytest

from lightning_dlrover.fault.coding.placement import ParityPlacement


@pytest.mark.parametrize(("world_size", "k", "r", "local"),
                         [(3, 2, 1, 1), (4, 2, 2, 1), (5, 3, 2, 1), (8, 4, 2, 1), (2, 1, 1, 1), (4, 1, 1, 2),
                          (8, 2, 1, 2), (12, 3, 1, 4), (6, 2, 2, 3)])
def test_placement_is_balanced_and_tolerates_r_losses(world_size, k, r, local):
    placement = ParityPlacement(world_size, k, r, local)
    for group in range(world_size):
        assert len(set(placement.members(group))) == k + r
    for rank in range(world_size):
        held = placement.parity_held(rank)
        assert len(held) == r
        assert all(placement.parity_rank(g, p) == rank for g, p in held)
        assert all(placement.data_rank(placement.group_of_chunk(rank, c), c) == rank for c in range(k))
    for lost in itertools.combinations(range(world_size), r):
        for group in range(world_size):
            assert sum(m not in lost for m in placement.members(group)) >= k


@pytest.mark.parametrize(("world_size", "k", "r", "local", "covered"), [
    (4, 1, 1, 2, True), (4, 2, 2, 2, True), (4, 3, 1, 2, False), (8, 2, 1, 2, True), (8, 3, 1, 4, False),
    (6, 2, 2, 3, True), (4, 2, 1, 4, False), (4, 2, 1, 1, True),
])
def test_node_loss_is_covered_when_no_node_holds_more_than_r_members_of_a_group(world_size, k, r, local, covered):
    placement = ParityPlacement(world_size, k, r, local)
    assert placement.tolerates_node_loss == covered
    nodes = [range(n * local, (n + 1) * local) for n in range(world_size // local)]
    worst = max(sum(m in node for m in placement.members(g)) for g in range(world_size) for node in nodes)
    assert (worst <= r and len(nodes) > 1) == covered


@pytest.mark.parametrize(("world_size", "k", "r", "message"), [
    (3, 3, 1, "needs k + r = 4 distinct ranks per parity group, but the world size is 3"),
    (4, 2, 0, "parity needs k >= 1 and r >= 1"),
    (4, 0, 1, "parity needs k >= 1 and r >= 1"),
])
def test_impossible_settings_are_rejected(world_size, k, r, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        ParityPlacement(world_size, k, r)


def test_parity_config_rejects_nonpositive_values():
    from lightning_dlrover import ParityConfig

    with pytest.raises(ValueError, match=r"got ParityConfig\(k=2, r=0\)"):
        ParityConfig(k=2, r=0)
    with pytest.raises(ValueError, match="parity.overlap='yes' must be true or false"):
        ParityConfig(overlap="yes")


def test_parity_config_parses_its_command_line_form():
    from lightning_dlrover import ParityConfig

    assert ParityConfig.parse("2,1") == ParityConfig(2, 1)
    assert ParityConfig.parse("2,2,16") == ParityConfig(2, 2, commit_every_n_steps=16)
    assert ParityConfig.parse("1,1,1,0") == ParityConfig(1, 1, overlap=False)
    for bad in ("2", "2,x", "2,1,1,2", "2,1,1,1,1"):
        with pytest.raises(ValueError, match="is not k,r\\[,commit_every_n_steps"):
            ParityConfig.parse(bad)
