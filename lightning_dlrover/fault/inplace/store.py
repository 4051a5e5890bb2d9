"""The job's store, hosted by ``lightning-dlrover launch`` on machine 0 (it outlives every worker)."""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import TCPStore


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
