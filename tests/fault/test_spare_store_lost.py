"""A hot spare whose launcher's store dies (machine 0 is gone) retries slowly and then gives up, instead of spinning
on the dead store forever. The store is a real ``TCPStore`` served by a separate process that is SIGKILLed."""

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning_dlrover.fault.inplace import membership

SERVE = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
print("ready", flush=True)
time.sleep(600)
"""


class CountingStore:
    """The real client store, counting how often the spare asks it."""

    def __init__(self, store: TCPStore) -> None:
        self.store, self.waits = store, 0

    def wait(self, keys, timeout):
        self.waits += 1
        return self.store.wait(keys, timeout)

    def add(self, key, amount):
        return self.store.add(key, amount)

    def get(self, key):
        return self.store.get(key)


def test_a_spare_gives_up_slowly_when_the_launchers_store_dies():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
        store = CountingStore(client)
        threading.Timer(1.0, server.kill).start()  # while the spare waits
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="store has failed"):
            membership.wait_for_assignment(store, 0, 0, wait_s=30.0, give_up_s=3.0)
        # Every failed ask is followed by a pause (>= 0.5 s): a few asks over the 3 s, not a busy loop's thousands.
        assert 2 <= store.waits <= 2 + (time.monotonic() - started) / 0.5
    finally:
        server.kill()
