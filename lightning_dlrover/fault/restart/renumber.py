"""Restarted nodes take back the node ranks their spills were written under.

``torchrun``'s rendezvous numbers the nodes of a restarted job afresh: a surviving node that held ranks 2 and 3
may come back as ranks 0 and 1, and its replacement neighbour as 2 and 3. The spills on each node name the old
ranks. If every node takes back its old node rank (the replacement taking the one left over), then with the same
world and sharding plan each survivor finds its own shards in its own spill and keeps its parity share: the
restore moves only the lost ranks' bytes and encodes only their parity
(:func:`~lightning_dlrover.fault.restart.reshard.restore`, :meth:`~lightning_dlrover.fault.CodedEmbeddings.adopt`).

Whole nodes are renumbered (local ranks never change), so which ranks share a machine stays true for the parity
placement. Nothing is renumbered when the world changed, when a node holds spills of several old nodes, or when
the new numbering is already the old one; the restore is correct in every case, only slower.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed import PrefixStore

from lightning_dlrover import control_plane
from lightning_dlrover.fault.restart.spill import spilled_ranks

#: Environment variable: ``0`` keeps ``torchrun``'s numbering (every restore then re-encodes all parity).
RENUMBER_ENV = "LIGHTNING_DLROVER_RENUMBER_NODES"
_stores: list[dist.Store] = []  # the world's store outlives the group it was built for (its server may be here)


def old_node_ranks(held: list[list[int]], local_world_size: int) -> list[int] | None:
    """The node rank each node takes, given the old ranks whose spills each holds (``held[node]``); ``None`` when
    the numbering stays. A node holding the spills of one old node that exists in this world takes its number; the
    others take the numbers left over, in order."""
    nodes = len(held)
    claims = [{rank // local_world_size for rank in ranks} for ranks in held]
    if any(len(claim) > 1 or any(old >= nodes for old in claim) for claim in claims):
        return None  # the world changed (or a node's spills span nodes): nothing to keep by renumbering
    taken = [next(iter(claim)) if claim else None for claim in claims]
    if len({t for t in taken if t is not None}) != sum(t is not None for t in taken):
        return None  # two nodes claim the same old node (stale files): leave it to the restore
    free = iter(sorted(set(range(nodes)) - {t for t in taken if t is not None}))
    numbering = [t if t is not None else next(free) for t in taken]
    return None if numbering == list(range(nodes)) else numbering


def renumber_nodes(directory: Path | None, node_rank: int, local_rank: int, local_world_size: int,
                   timeout: timedelta) -> int | None:
    """Collective on the default group, right after it is created: when the nodes must be renumbered (see
    :func:`old_node_ranks`), rebuilds the group with every rank at ``old node * local_world_size + local_rank``,
    updates ``RANK``, ``GROUP_RANK`` and ``ROLE_RANK`` to match and returns this node's new rank; else ``None``."""
    if os.environ.get(RENUMBER_ENV, "1") == "0":
        return None
    world = dist.get_world_size()
    facts: list[tuple[int, list[int], str]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(facts, (node_rank, spilled_ranks(directory) if local_rank == 0 else [], uuid.uuid4().hex), group=control_plane.group())
    held: list[list[int]] = [[] for _ in range(world // local_world_size)]
    for node, ranks, _ in facts:
        held[node] += ranks
    numbering = old_node_ranks(held, local_world_size)
    if numbering is None:
        return None
    new_node = numbering[node_rank]
    rank = new_node * local_world_size + local_rank
    store = dist.distributed_c10d._get_default_store()
    _stores.append(store)
    backend = dist.get_backend()
    dist.destroy_process_group()
    dist.init_process_group(backend, store=PrefixStore(f"lightning_dlrover/renumbered/{facts[0][2]}", store),
                            rank=rank, world_size=world, timeout=timeout)
    os.environ.update(RANK=str(rank), GROUP_RANK=str(new_node), ROLE_RANK=str(rank))
    return new_node


def survivor_ranks(world_size: int, lost: list[int]) -> dict[int, int]:
    """``{old rank: new rank}`` of the ranks left when ``lost`` leave a world of ``world_size``: the survivors keep
    their order and close the gaps (what a restarted job at the smaller size numbers them, node by node, when each
    node keeps its order)."""
    gone = set(lost)
    if not gone <= set(range(world_size)):
        raise ValueError(f"lost ranks {sorted(gone)} are not all ranks of a world of {world_size}.")
    return {old: new for new, old in enumerate(r for r in range(world_size) if r not in gone)}
