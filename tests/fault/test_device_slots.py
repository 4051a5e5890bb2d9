"""Under ``lightning-dlrover launch`` a replacement takes the lost rank's device slot (``LOCAL_RANK``) only where it is
free on its machine; a GPU job refuses a replacement that would share a GPU and restarts every worker instead.

The supervisor runs for real (its store, its worker processes, machine 1's heartbeat going silent); the workers are
plain ``python -c`` sleeps, since what is tested is the launcher's decision, not training. A GPU job is one whose
ranks published ``device = cuda`` in the store, as :func:`lightning_dlrover.fault.inplace.protocol.announce_device`
does on a GPU rank.
"""

import os
import socket

import pytest

from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.supervisor import (
    Supervisor,
    SupervisorConfig,
    serve_store,
)
from lightning_dlrover.monitor.events import read_events

# Ranks and spares of the first launch outlive machine 1's detection (0.5 s of silence); after a full restart they
# finish at once.
SLEEP = "import os, time; time.sleep(4 if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' else 0.5)"


@pytest.fixture
def machine0(tmp_path, monkeypatch):
    """Machine 0's supervisor of a 2-machine x 2-rank job with one hot spare; machine 1 beat once and holds ranks
    2 and 3. Yields the supervisor; every worker is stopped at the end."""
    monkeypatch.setenv("LIGHTNING_DLROVER_EVENTS", str(tmp_path / "events.jsonl"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store, sock = serve_store(f"127.0.0.1:{port}")
    config = SupervisorConfig(program=["-c", SLEEP], nnodes=2, node_rank=0, nproc_per_node=2, spares=1,
                              master=f"127.0.0.1:{port}", max_restarts=1, stop_grace=0.0, node_timeout=0.5)
    supervisor = Supervisor(config, store, "test-slots")
    membership.heartbeat(store, 0, 1)
    membership.publish_node_ranks(store, 0, 1, [2, 3])
    membership.publish_committed(store, 0, 0, 1)  # as the ranks do after their first commit: the spare may start
    try:
        yield supervisor
    finally:
        supervisor.stop()
        sock.close()


def test_a_lost_machines_ranks_find_their_slots_taken_and_a_local_loss_finds_its_own_free(machine0):
    machine0.start()
    assert machine0.device_slots([2, 3]) == {2: None, 3: None}  # held by ranks 0 and 1 of this machine
    assert machine0.device_slots([1]) == {1: 1}  # the dead rank's own slot
    assert machine0.device_slots([1, 3]) == {1: 1, 3: None}  # two losses for one slot: the first takes it
    assert machine0.shared_devices([2, 3]) == {}  # a CPU job: sharing costs only speed
    membership.publish_device(machine0.store, 0, "cuda")
    assert machine0.shared_devices([2, 3]) == {2: 0, 3: 1}
    assert machine0.shared_devices([1]) == {}


def test_a_replacement_is_assigned_the_lost_ranks_slot(machine0):
    machine0.start()
    machine0.start_spares()
    membership.publish_device(machine0.store, 0, "cuda")
    (spare,) = [w for w in machine0.workers if w.rank is None]
    machine0.replace([1])
    assignment = membership.wait_for_assignment(machine0.store, 0, spare.spare)
    assert (assignment.rank, assignment.local_rank) == (1, 1)
    os.environ.update(LOCAL_WORLD_SIZE="2")
    try:
        membership.become(assignment)
        assert os.environ["LOCAL_RANK"] == "1"
    finally:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", membership.JOINING_ENV,
                    membership.GENERATION_ENV):
            os.environ.pop(key, None)


def test_on_cpu_a_lost_machine_is_still_replaced_in_process_as_before(machine0, tmp_path):
    assert machine0.run() == 0
    events = read_events([tmp_path / "events.jsonl"])
    kinds = [e.kind for e in events]
    assert "node_lost" in kinds and "in_process_refused" not in kinds and "restarting_all" not in kinds
    (planned,) = [e for e in events if e.kind == "replacement_planned"]
    assert planned.fields["lost_ranks"] == [2, 3]
    spare = planned.fields["replacements"]["2"]
    assignment = membership.wait_for_assignment(machine0.store, 0, spare)
    assert assignment.local_rank is None  # become() gives it rank % LOCAL_WORLD_SIZE, as before


def test_a_gpu_job_refuses_a_replacement_that_would_share_a_gpu_and_restarts_every_worker(machine0, tmp_path):
    membership.publish_device(machine0.store, 0, "cuda")
    assert machine0.run() == 0  # the restarted ranks finish (machine 1 stays lost)
    events = read_events([tmp_path / "events.jsonl"])
    kinds = [e.kind for e in events]
    assert "replacement_planned" not in kinds
    (refused,) = [e for e in events if e.kind == "in_process_refused"]
    assert refused.fields["why"] == "device_taken"
    (restart,) = [e for e in events if e.kind == "restarting_all"]
    assert restart.fields["reason"] == "device_taken" and restart.fields["failed_ranks"] == [2, 3]
    assert kinds.index("node_lost") < kinds.index("in_process_refused") < kinds.index("restarting_all")
