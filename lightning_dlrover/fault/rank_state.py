"""What differs from rank to rank outside the sharded tables, as one uint8 tensor: the random number generators
(torch CPU and CUDA, NumPy, Python ``random``) and the dense module's buffers (TorchRec wraps the dense part in
DDP with ``broadcast_buffers=False``, so e.g. each rank's BatchNorm statistics are its own).

As a tensor the state travels in collectives (the commit vote gathers every rank's), in spills loaded without
unpickling, and in checkpoints. Generators' layout: an int64 header, two float64 Gaussian caches, then the torch
CPU state, NumPy's MT19937 keys (uint32), Python's MT state (uint32) and each CUDA device's state. A rank state
is ``int64 len(generators)``, the generators, then every buffer's bytes in order.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dlrover import control_plane

_HEADER = 8  # int64 words: len(torch cpu), np pos, np has_gauss, py version, py has_gauss, n cuda, len(cuda), np keys


def capture() -> Tensor:
    """The calling process's generator states (uint8 ``[n]``; ``n`` is the same for processes that see the same
    number of CUDA devices)."""
    cpu = torch.get_rng_state()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    header = np.array(
        [cpu.numel(), np_pos, np_has_gauss, py_version, py_gauss is not None, len(cuda),
         cuda[0].numel() if cuda else 0, len(np_keys)], dtype=np.int64,
    )  # fmt: skip
    parts = [
        header.view(np.uint8),
        np.array([np_gauss, py_gauss or 0.0], dtype=np.float64).view(np.uint8),
        cpu.numpy(),
        np.asarray(np_keys, dtype=np.uint32).view(np.uint8),
        np.asarray(py_internal, dtype=np.uint32).view(np.uint8),
        *(state.numpy() for state in cuda),
    ]
    return torch.from_numpy(np.concatenate(parts))


def restore(state: Tensor) -> None:
    """Sets the calling process's generators to ``state`` (from :func:`capture`; trailing zero padding is ignored).
    CUDA states are restored when this process sees as many devices as the capturing one did."""
    data = state.numpy()
    header = data[: 8 * _HEADER].view(np.int64)
    cpu_len, np_pos, np_has_gauss, py_version, py_has_gauss, n_cuda, cuda_len, np_len = (int(x) for x in header)
    at = 8 * _HEADER
    np_gauss, py_gauss = data[at : at + 16].view(np.float64)
    at += 16
    torch.set_rng_state(torch.from_numpy(data[at : at + cpu_len].copy()))
    at += cpu_len
    np_keys = data[at : at + 4 * np_len].view(np.uint32).copy()
    at += 4 * np_len
    np.random.set_state(("MT19937", np_keys, np_pos, np_has_gauss, float(np_gauss)))
    py_internal = tuple(int(x) for x in data[at : at + 4 * 625].view(np.uint32))
    at += 4 * 625
    random.setstate((py_version, py_internal, float(py_gauss) if py_has_gauss else None))
    if n_cuda and torch.cuda.is_available() and torch.cuda.device_count() == n_cuda:
        torch.cuda.set_rng_state_all(
            [torch.from_numpy(data[at + i * cuda_len : at + (i + 1) * cuda_len].copy()) for i in range(n_cuda)]
        )


def pad(state: Tensor, length: int) -> Tensor:
    """``state`` zero-padded to ``length`` bytes (the vote gathers equal sizes)."""
    return torch.nn.functional.pad(state, (0, length - state.numel())) if state.numel() < length else state



def capture_rank(buffers: list[Tensor]) -> Tensor:
    """This rank's generators and ``buffers`` (uint8 ``[n]``)."""
    generators = capture()
    parts = [torch.tensor([generators.numel()], dtype=torch.int64).view(torch.uint8), generators]
    parts += [b.detach().reshape(-1).view(torch.uint8).cpu() for b in buffers]
    return torch.cat(parts)


def restore_rank(state: Tensor, buffers: list[Tensor], generators: bool = True) -> None:
    """Sets this rank's ``buffers`` (and generators, unless ``generators=False``) from :func:`capture_rank`'s tensor."""
    length = int(state[:8].view(torch.int64))
    if generators:
        restore(state[8 : 8 + length])
    at = 8 + length
    for b in buffers:
        n = b.numel() * b.element_size()
        b.detach().reshape(-1).view(torch.uint8).copy_(state[at : at + n])
        at += n


def gather_ranks(buffers: list[Tensor]) -> Tensor:
    """Every rank's :func:`capture_rank`, ``[world, n]`` (a collective: two all-gathers)."""
    state, world = capture_rank(buffers), dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([state.numel()]), group=control_plane.group())
    states = [torch.empty(int(max(lengths)), dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(states, pad(state, states[0].numel()), group=control_plane.group())
    return torch.stack(states)
