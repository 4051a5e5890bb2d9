"""The job's store, hosted by ``lightning-dlrover launch`` on machine 0 (it outlives every worker), and how the
in-process recovery protocol keys it: every key under :data:`PREFIX`, values as text (JSON for anything that is not a
string already)."""

from __future__ import annotations

import json
import socket
from datetime import timedelta

from torch.distributed import Store, TCPStore

PREFIX = "lightning_dlrover/"


def serve_store(address: str) -> tuple[TCPStore, socket.socket]:
    """Hosts the job's store at ``host:port`` (binding that address only); the store serves on the returned
    socket's descriptor, which must stay open as long as the store."""
    host, _, port = address.rpartition(":")
    sock = socket.socket()
    sock.bind((host, int(port)))
    sock.listen(256)
    store = TCPStore(host, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                     master_listen_fd=sock.fileno(), timeout=timedelta(seconds=60))
    return store, sock


def get_key(store: Store, key: str) -> str:
    """The text at ``key`` (waits for it up to the store's timeout)."""
    return store.get(PREFIX + key).decode()


def set_key(store: Store, key: str, value: object) -> None:
    """Sets ``key`` to ``value`` (a string as is, anything else as JSON)."""
    store.set(PREFIX + key, value if isinstance(value, str) else json.dumps(value))


def has_key(store: Store, key: str) -> bool:
    """Whether ``key`` was set (does not wait)."""
    return store.check([PREFIX + key])
