"""``lightning-dlrover fit`` of our DLRM whose tables' ``init_fn`` appends the calling process's id to the file
``$INIT_LOG`` (tests/fault/test_uninitialised_replacement.py: which processes initialised tables)."""

import functools
import os

import torch

from lightning_dlrover.cli import main
from lightning_dlrover.models import DLRMModule


def logged_init(path: str, weight: torch.Tensor) -> torch.Tensor:
    with open(path, "a") as log:
        log.write(f"{os.getpid()}\n")
    return torch.nn.init.uniform_(weight, -0.05, 0.05)


def logging_tables(init):
    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for config in self.dlrm.sparse_arch.embedding_bag_collection.embedding_bag_configs():
            config.init_fn = functools.partial(logged_init, os.environ["INIT_LOG"])

    return wrapped


if __name__ == "__main__":
    DLRMModule.__init__ = logging_tables(DLRMModule.__init__)
    main()
