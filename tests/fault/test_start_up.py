"""Start-up under ``lightning-dlrover launch`` on a loaded machine: the ranks of a launch wait for each other to
start their process group for ``$LIGHTNING_DLROVER_START_TIMEOUT`` seconds, not for the collective timeout (a rank
whose imports a loaded machine slowed down used to fail the others' start with a store timeout)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.supervisor import serve_store
from tests.conftest import start

# A rank of the reconfigurable world group with a 2 s collective timeout; rank 1 starts ``argv[1]`` seconds late.
RANK = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from lightning_dlrover.fault.inplace.process_group import BACKEND, register
    if os.environ["RANK"] == "1":
        time.sleep(float(sys.argv[1]))
    register()
    dist.init_process_group(BACKEND, init_method="env://", timeout=timedelta(seconds=2))
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sum {int(total)}", flush=True)
    os._exit(0)  # a C++ static destructor sometimes aborts a finished torch process (strategy/process_exit.py)
    """
)


def start_ranks(tmp_path, ranks: list[int], late: float, env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    store, sock = serve_store("127.0.0.1:0")
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": address.rpartition(":")[2], "WORLD_SIZE": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True", membership.STORE_ENV: address, **(env or {})}
    procs = [start([sys.executable, "-c", RANK, str(late)], tmp_path, {**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in ranks]
    procs[0].keep = (store, sock)  # the store lives as long as the ranks
    return procs


def test_a_rank_that_starts_late_is_waited_for(tmp_path):
    """Rank 1 starts its process group 8 s after rank 0, four times the collective timeout: both start."""
    procs = start_ranks(tmp_path, [0, 1], late=8)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 0 sum 2" in outs[0] and "rank 1 sum 2" in outs[1]


def test_a_rank_that_never_starts_is_named(tmp_path):
    procs = start_ranks(tmp_path, [0], late=0, env={membership.START_TIMEOUT_ENV: "3"})
    out = procs[0].communicate(timeout=120)[0]
    assert procs[0].returncode != 0
    # the measured wait: the 3 s timeout plus what a loaded machine adds to the store's round trips
    waited = re.findall(r"rank 0: ranks \[1\] of 2 did not start their process group within (\d+) s", out)
    assert waited and 3 <= int(waited[0]) <= 30, out[-3000:]
    assert f"raise ${membership.START_TIMEOUT_ENV} (now 3 s)" in out
