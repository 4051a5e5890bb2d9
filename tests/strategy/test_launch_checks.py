"""The add-ons' up-front checks run from the Python API too: ``Trainer(strategy=DLRoverStrategy(...),
callbacks=[...]).fit(...)`` refuses a config no rank could run with one ``ValueError`` before other ranks start
(Lightning's launcher), and under ``torchrun`` on every rank before any collective (no rank hangs)."""

from __future__ import annotations

import socket
import sys

import pytest

from lightning_dlrover.elastic.scaler import ElasticBatchScaler
from lightning_dlrover.strategy.launcher import validate_addons
from tests.conftest import run

pytestmark = pytest.mark.slow

# A plain script: Lightning's launcher re-runs it for rank 1 (which would print its STARTED line).
SCRIPT = """
import os
print(f"STARTED local_rank={os.environ.get('LOCAL_RANK', '-')}", flush=True)
import lightning.pytorch as pl
from lightning_dlrover import DLRoverStrategy, ElasticBatchScaler
from lightning_dlrover.data import DLRMDataModule
from lightning_dlrover.models import DLRMModule

sizes = [50] * 26
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DLRoverStrategy(sharding_types=["table_wise"]),
                     callbacks=[ElasticBatchScaler(min_batch=7, max_batch=7)], max_steps=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
try:
    trainer.fit(DLRMModule(sizes, embedding_dim=8, dense_arch_layer_sizes=[16, 8]),
                DLRMDataModule(num_embeddings_per_feature=sizes, global_batch_size=8))
except ValueError as err:
    rank = os.environ.get('LOCAL_RANK', '-')
    print(f"REFUSED local_rank={rank}: {err}", flush=True)
    if rank != '-':  # under torchrun: wait (no collective) until every rank refused, or torchrun would
        import pathlib, time  # SIGTERM a slower rank as soon as the first one exits, before it could say so
        pathlib.Path(f"refused_{rank}").touch()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(pathlib.Path(f"refused_{r}").exists() for r in "01"):
            time.sleep(0.05)
    raise SystemExit(3)
print("TRAINED", flush=True)
"""

MESSAGE = ("ElasticBatchScaler(min_batch=7, max_batch=7, per_rank_max=None): no global batch in [7, 7] is divisible by "
           "world size 2; widen the range to include a multiple of 2 (e.g. max >= 8) or raise the per-rank limit.")


def test_validate_addons_names_every_refusal_and_ignores_other_callbacks():
    class Foreign:  # not one of the package's add-ons: its validate is not ours to call
        def validate(self, world_size: int) -> None:
            raise AssertionError("called")

    validate_addons([Foreign(), ElasticBatchScaler(min_batch=8, max_batch=8)], world_size=2)
    with pytest.raises(ValueError) as err:
        validate_addons([ElasticBatchScaler(7, 7), Foreign(), ElasticBatchScaler(3, 3)], world_size=2)
    assert str(err.value).splitlines()[0] == MESSAGE
    assert str(err.value).splitlines()[1].startswith("ElasticBatchScaler(min_batch=3, max_batch=3")


def test_python_api_refuses_before_the_other_rank_starts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = run([str(script)], tmp_path, timeout=120, check=False).stdout
    assert f"REFUSED local_rank=-: {MESSAGE}" in out, out[-3000:]
    assert "STARTED local_rank=1" not in out and "TRAINED" not in out, out[-3000:]  # no second process
    assert "Traceback" not in out, out[-3000:]


def test_torchrun_refuses_on_every_rank_without_hanging(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run(["-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0",
                "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(script)],
               tmp_path, timeout=120, check=False, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    for rank in (0, 1):
        assert f"REFUSED local_rank={rank}: {MESSAGE}" in out, out[-3000:]
    assert "TRAINED" not in out, out[-3000:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
