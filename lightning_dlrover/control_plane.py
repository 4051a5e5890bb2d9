"""The control plane: the process group that carries every collective of CPU tensors and Python objects.

lightning-dlrover's own collectives (the commit's vote, rank states, parity deltas while they live on the host,
spill and recovery metadata, digests, the advisor's and scaler's agreements) carry CPU tensors. The default
process group is the *data plane*: TorchRec's embedding exchange and DDP's gradients. On GPUs it is NCCL, which
carries CUDA tensors only, so the control plane is a gloo group created beside it, spanning the same ranks in the
same order (a rank of one is the same rank of the other)::

    control_plane.init()                                  # every rank, right after init_process_group
    dist.all_gather(ballots, ballot, group=control_plane.group())

- default group ``gloo`` (CPU training): the default group carries both planes and :func:`group` is ``None``
  (the default group), unless ``LIGHTNING_DLROVER_CONTROL_GROUP=separate`` asks for a gloo group of its own (the
  test suite sets it, so every multi-process test runs with the two planes apart);
- under ``lightning-dlrover launch`` the world group is a reconfigurable gloo group (``dlrover_gloo``): it is the
  control plane too, since a second group would not be rebuilt when a lost rank is replaced;
- any other default backend (``nccl``): always a gloo group of its own.

:func:`group` creates the group on first use when :func:`init` was not called for the current default group (a
collective: every rank reaches its first control-plane collective alike, as every such collective is called by
every rank). A default group rebuilt (node renumbering) gets a new control group.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

#: Environment variable: ``separate`` gives the control plane a gloo group of its own even when the default group
#: is gloo (``shared``, the default: the default gloo group carries both planes).
CONTROL_GROUP_ENV = "LIGHTNING_DLROVER_CONTROL_GROUP"
_CHOICES = ("shared", "separate")

_group: dist.ProcessGroup | None = None
_made_for: object | None = None  # the default group the control group was made for


def _separate(backend: str) -> bool:
    choice = os.environ.get(CONTROL_GROUP_ENV, "shared") or "shared"
    if choice not in _CHOICES:
        raise ValueError(f"{CONTROL_GROUP_ENV}={choice!r}: use one of {_CHOICES}.")
    if backend == "gloo":
        return choice == "separate"
    return "gloo" not in backend  # a reconfigurable gloo world group is its own control plane


def init() -> None:
    """Creates the control group for the current default group (collective on every rank; a no-op without one)."""
    global _group, _made_for
    if not dist.is_initialized():
        return
    world = dist.group.WORLD
    if _made_for is world:
        return
    _group = dist.new_group(backend="gloo") if _separate(dist.get_backend()) else None
    _made_for = world


def group() -> dist.ProcessGroup | None:
    """The group for collectives of CPU tensors and objects (``None``: the default group). See the module docs."""
    if dist.is_initialized() and _made_for is not dist.group.WORLD:
        init()
    return _group


def all_true(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank: one all-reduce on the control plane (collective), or ``ok`` itself without
    a process group of more than one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group())
    return bool(flag.item())
