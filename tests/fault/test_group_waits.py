"""How long the ranks of an in-process recovery wait for each other (``fault/inplace/process_group.py``).

gloo waits for its peers only the job's collective timeout (20 s in the chaos job). Under load that was too short for
a peer still on its way, and one kill became two restarts and a checkpoint fallback (bench/README.md, the planner's
drills of session 14):

- a rank of a job that had not started yet (after a restart, before its first step) was lost before it reached its
  process group: its replacement joined a newer generation of the world group, which the other rank, still waiting
  for the lost one in its own start, never connects; it gave up after 20 s (``DistStoreError: wait timeout``). The
  launcher now starts such a rank again as itself (``rank_started_again``);
- the ranks of a new generation wait for each other with ``launch``'s start timeout before gloo connects them.

Real processes: the launcher, its store and a user model's 2-rank job; two processes over a real store.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from lightning_dlrover.fault.inplace.store import serve_store
from lightning_dlrover.monitor.events import read_events
from tests.conftest import REPO, run
from tests.fault.test_in_process import SCRIPT, free_port

LOST_BEFORE_ITS_GROUP = """
import os, runpy, sys
from pathlib import Path
marker = Path(sys.argv[1])
if os.environ.get("RANK") == "1" and not marker.exists():  # rank 1's first process dies before its process group
    marker.write_text(str(os.getpid()))
    sys.exit(3)
sys.argv = [{script!r}, *sys.argv[2:]]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_rank_lost_before_its_process_group_is_started_again_without_a_restart(tmp_path):
    """Rank 1 dies before its process group while rank 0 waits for it in its start: the launcher starts rank 1 again
    and the job trains to the end. Before, a replacement joined generation 1, waited 20 s for rank 0, and the launcher
    restarted every worker."""
    program = tmp_path / "lost_early.py"
    program.write_text(LOST_BEFORE_ITS_GROUP.format(script=SCRIPT))
    marker = tmp_path / "rank1-lost"
    events_file = tmp_path / "events.jsonl"
    out = run(["-m", "lightning_dlrover", "launch", "--nproc-per-node", "2", "--spares", "1",
               "--master", f"127.0.0.1:{free_port()}", "--", program, marker, "--steps", "12", "--root", tmp_path],
              tmp_path, timeout=400, env={"LIGHTNING_DLROVER_EVENTS": str(events_file)}).stdout
    events = read_events([events_file])
    kinds = [e.kind for e in events]
    assert marker.exists() and "restarting_all" not in kinds and "replacement_planned" not in kinds, kinds
    (again,) = [e for e in events if e.kind == "rank_started_again"]
    assert again.fields["ranks"] == [1]
    assert re.search(r"state digest: [0-9a-f]{64}", out), out[-4000:]  # the job trained to its end


CONNECT = """
import sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from lightning_dlrover.fault.inplace.process_group import ReconfigurableGroup, await_members
from tests.conftest import exit_rank
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
await_members(store, 0, 0, rank, 2)  # (what the launcher's ranks do before generation 0, in ``register``)
group = ReconfigurableGroup(store, rank, 2, timedelta(seconds=2))  # a 2 s collective timeout
if rank == 1:
    time.sleep(6)  # a replacement still setting up, or a survivor that has not yet seen its collective fail
group.reconfigure(1)
value = torch.tensor([float(rank + 1)])
group.allreduce([value]).wait()
print("sum", value.item(), flush=True)
exit_rank()  # (as the strategy's ranks end: a finished gloo process sometimes aborts in interpreter shutdown)
"""


def test_a_new_generation_waits_for_a_slow_peer_beyond_the_collective_timeout(tmp_path):
    """Rank 1 connects generation 1 six seconds after rank 0, whose collective timeout is 2 s: rank 0 waits for it
    (before, gloo gave up after 2 s with ``DistStoreError: wait timeout``) and their all-reduce of generation 1 runs."""
    _store, sock = serve_store("127.0.0.1:0")  # (the store serves as long as it is referenced)
    port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(CONNECT), str(r), str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=180)[0] for p in ranks]
    finally:
        sock.close()
    assert [p.returncode for p in ranks] == [0, 0], outs
    assert all("sum 3.0" in out for out in outs), outs
