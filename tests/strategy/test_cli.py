"""The ``lightning-dlrover`` CLI: the demo config trains, its saved config reproduces it, bad configs fail early."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_dlrover import DLRoverStrategy
from tests.conftest import REPO, digests, run

FAST = [
    "--trainer.max_steps=6",
    "--trainer.val_check_interval=3",
    "--trainer.enable_progress_bar=false",
    "--data.val_batches=1",
]


def fit(cwd, *args, check=True):
    return run(["-m", "lightning_dlrover", "fit", "--config", str(REPO / "configs" / "demo.yaml"), *FAST, *args], cwd,
               check=check)


@pytest.mark.slow
def test_demo_config_trains_and_saved_config_round_trips(tmp_path):
    first = fit(tmp_path, f"--trainer.default_root_dir={tmp_path / 'a'}")
    saved = tmp_path / "a" / "lightning_logs" / "version_0" / "config.yaml"
    config = yaml.safe_load(saved.read_text())
    assert config["trainer"]["strategy"]["class_path"] == "lightning_dlrover.DLRoverStrategy"
    assert config["trainer"]["max_steps"] == 6
    assert (tmp_path / "a" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
    console_script = str(Path(sys.executable).parent / "lightning-dlrover")
    second = run(["fit", "--config", saved, f"--trainer.default_root_dir={tmp_path / 'b'}"], tmp_path,
                 program=[console_script])
    assert digests(first.stdout)["end"] == digests(second.stdout)["end"]
    # a checkpoint of the command line exports (LightningCLI adds `_instantiator` to the saved hparams)
    exported = run(["-m", "lightning_dlrover", "export", "--ckpt_path",
                    tmp_path / "a" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt",
                    "--out", tmp_path / "exported", "--no-program"], tmp_path)
    assert "exported" in exported.stdout and (tmp_path / "exported" / "model.pt").is_file(), exported.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.strategy.init_args.constraints={t_nope: {min_partition: 8}}"],
         "strategy.constraints names table(s) ['t_nope']"),
        (["--data.global_batch_size=100"], "data.global_batch_size=100 is not divisible by the world size 3"),
        (["--trainer.strategy.init_args.sharding_types=[row_wise]"], "need reduce-scatter; the gloo backend"),
        (["--model.embedding_optimizer=adam"], "are not supported by FBGEMM on CPU; choose one of ['SGD', 'Adagrad', "
         "'RowWiseAdagrad'] (DLRMModule: model.embedding_optimizer"),
    ],
)
def test_bad_config_fails_before_training_naming_the_field(tmp_path, args, message):
    proc = fit(tmp_path, f"--trainer.default_root_dir={tmp_path}", *args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("lightning-dlrover fit: error: ")]
    assert message in line
    assert "Epoch 0" not in proc.stdout and "state digest" not in proc.stdout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_types": ["row_wize"]}, "strategy.sharding_types: 'row_wize' is not one of"),
        ({"compute_kernel": "fast"}, "strategy.compute_kernel: 'fast' is not one of"),
        ({"constraints": {"t_cat_0": {"sharding_types": ["diagonal"]}}}, "strategy.constraints.t_cat_0.sharding_types"),
        ({"checkpoint_backend": "zip"}, "strategy.checkpoint_backend='zip' is not one of ['dcp', 'torchsnapshot']"),
        ({"sharding_types": []}, "strategy.sharding_types is empty"),
    ],
)
def test_bad_strategy_arguments(kwargs, message):
    with pytest.raises(ValueError) as err:
        DLRoverStrategy(**kwargs)
    assert message in str(err.value)


def test_strategy_is_registered():
    from lightning.pytorch import Trainer

    trainer = Trainer(strategy="dlrover", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, DLRoverStrategy)


# What the demo printed on stderr before its first step (issue #20), by the message's own words.
DEMO_NOISE = [
    "TopologyFactory",  # TorchRec's planner: the topology now comes from its factory
    "HeuristicalStorageReservation",  # ... and a fixed-percentage reservation
    "dense tensor size calculation",
    "deprecating ShardedTensor",  # our own call of a deprecated ShardedTensor method
    "`broadcast_buffers` is deprecated",  # filtered: lightning_dlrover/log.py, KNOWN_WARNINGS
    "isinstance(treespec, LeafSpec)",
    "tensorboardX",
    "is_fx_tracing will return true",  # filtered: KNOWN_LOG_LINES
    "Tip: For seamless cloud logging",
    "LightningCLI's args parameter",  # the console entry no longer passes its own command line as `args`
]


@pytest.mark.slow
def test_a_demo_like_fit_prints_none_of_the_third_party_warnings(tmp_path):
    """The demo config on 2 ranks (parity k=1, r=1) for 4 steps with a checkpoint and a validation: its stderr has
    none of the warnings the demo printed, and it trained."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(devices=2, max_steps=4, val_check_interval=2, enable_progress_bar=False,
                   default_root_dir=str(tmp_path))
    trainer["strategy"]["init_args"]["parity"] = {"k": 1, "r": 1}
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = 2
    config["data"]["val_batches"] = 1
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env = {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "lightning_dlrover", "fit", "--config", "demo.yaml"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "end" in digests(done.stdout), done.stdout[-2000:]
    assert not [noise for noise in DEMO_NOISE if noise in done.stderr], done.stderr
