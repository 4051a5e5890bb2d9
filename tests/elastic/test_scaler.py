"""ElasticBatchScaler: arguments; the batch, LRs and samples across a grow, a node loss (real multi-process jobs),
an epoch boundary and the resource advisor's batch control."""

import json
import math
from collections import Counter

import lightning.pytorch as pl
import pytest

from lightning_dlrover import ElasticBatchScaler
from lightning_dlrover.advisor.control import BatchSizeControl, find_control
from tests.conftest import REPO, forked, run

SCRIPT = REPO / "tests" / "elastic" / "elastic_job.py"


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="min > max"):
        ElasticBatchScaler(512, 256)
    with pytest.raises(ValueError, match="policy='biggest'"):
        ElasticBatchScaler(64, 256, policy="biggest")
    with pytest.raises(ValueError, match="lr_rule='cubic'"):
        ElasticBatchScaler(64, 256, lr_rule="cubic")
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        ElasticBatchScaler(64, 256, warmup_steps=-1)


def _job(tmp_path, *args):
    proc = run(forked(SCRIPT, "--log", tmp_path / "samples", *args), tmp_path, timeout=400)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("scaler: "))
    return json.loads(line[len("scaler: "):])


@pytest.mark.slow
def test_grow_keep_per_rank_rescales_batch_and_lr_and_loses_no_sample(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _job(tmp_path, "--devices", "2", "--steps", "4", "--batch", "64", "--ckpt-dir", ckpt, "--ckpt-every", "4")
    assert first["world_size"] == 2 and first["global_batch"] == 64
    grown = _job(tmp_path, "--devices", "3", "--steps", "8", "--resume", ckpt / "epoch=0-step=4.ckpt")
    assert grown["world_size"] == 3 and grown["global_batch"] == 96  # 32 per rank kept
    factor = math.sqrt(96 / 64)
    assert grown["lrs"] == pytest.approx(sorted({round(0.05 * factor, 8)}))  # dense and fused embedding rates
    assert grown["history"][0]["reason"] == "world_size_changed"
    seen = Counter()
    for rank in range(3):
        path = tmp_path / f"samples.rank{rank}"
        for line in path.read_text().splitlines():
            seen.update(json.loads(line)["samples"])
    assert sum(seen.values()) == 4 * 64 + 4 * 96  # every step trained the global batch of its world size
    assert max(seen.values()) == 1  # no sample repeated across the batch change


def _chaos_config(tmp_path, samples, max_steps: int = 6, extra: list | None = None) -> tuple[str, dict]:
    """The packaged chaos job (4 ranks, batch 480, parity k=1 r=1) with the scaler, per-step digests and a sample log."""
    import yaml

    from lightning_dlrover.cli.chaos import DEFAULT_CONFIG

    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["trainer"]["max_steps"] = max_steps
    config["trainer"]["callbacks"] += [
        {"class_path": "lightning_dlrover.StateDigest", "init_args": {"at_start": True, "every_n_steps": 1}},
        {"class_path": "lightning_dlrover.ElasticBatchScaler",
         "init_args": {"min_batch": 120, "max_batch": 960, "policy": "keep_per_rank", "lr_rule": "sqrt"}},
        {"class_path": "tests.elastic.elastic_job.SampleLog", "init_args": {"path": str(samples)}}, *(extra or []),
    ]
    path = tmp_path / "scaled_chaos.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path), config


def _trained_samples(samples, ranks: int) -> list[tuple[int, int, list[str]]]:
    """``(step, world size, sample hashes)`` of every step the job kept: of a step tried more than once (the step
    in flight when a node died), only the last attempt's batches."""
    by_step: dict[int, dict[int, list[dict]]] = {}
    for rank in range(ranks):
        for line in (samples.parent / f"{samples.name}.rank{rank}").read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).setdefault(record["attempt"], []).append(record)
    kept = []
    for step, attempts in sorted(by_step.items()):
        records = attempts[max(attempts)]
        kept.append((step, records[0]["world_size"], [h for r in records for h in r["samples"]]))
    return kept


@pytest.mark.slow
def test_node_loss_with_the_scaler_shrinks_the_batch_exactly(tmp_path):
    """Node 1 of a 2 x 2-rank job dies at step 4; the survivors restore the committed state from their spills onto
    2 ranks, the scaler halves the global batch (keep_per_rank) and scales the LRs by sqrt(1/2): the restored state
    is the one committed before the kill, and the data stream goes on at the next sample, none lost or repeated."""
    from lightning_dlrover.data.sources import SyntheticCriteo, make_batch
    from lightning_dlrover.monitor.events import read_events
    from tests.elastic.elastic_job import sample_hashes

    samples = tmp_path / "samples"
    workdir = tmp_path / "chaos"
    config_path, config = _chaos_config(tmp_path, samples)
    proc = run(["-m", "lightning_dlrover", "chaos", "--config", config_path, "--workdir", workdir,
                "--kill-node", "1", "--at-step", "4", "--no-reference", "--last-call", "1", "--timeout", "300"], REPO, timeout=400)
    summary = proc.stdout.split("\nchaos summary\n")[-1]
    assert "recovered step 4 of a 4-rank job onto 2 ranks: decoded lost ranks [2, 3]" in summary, proc.stdout[-4000:]
    assert "steps lost: 0" in summary and "job finished: yes" in summary, summary

    events = read_events([workdir / "faulted" / "events.jsonl"])
    # before/after the kill by process, not by clock: torchrun restarted rank 0 in a new process after the loss
    digests = [e for e in events if e.kind == "digest" and not e["final"] and e.rank == 0]
    before = {e.step: e["digest"] for e in digests if e.pid == digests[0].pid}
    after = [e for e in digests if e.pid != digests[0].pid]
    assert after[0].step == 4 and after[0]["digest"] == before[4]  # restored = committed before the kill
    rescaled = [e for e in events if e.kind == "batch_rescaled"]
    assert [(e["reason"], e["old_global_batch"], e["global_batch"], e["world_size"]) for e in rescaled] == [
        ("world_size_changed", 480, 240, 2)]
    assert rescaled[0]["lr_factor"] == pytest.approx(math.sqrt(0.5))
    line = next(l for log in sorted(workdir.glob("faulted/node*.log")) for l in log.read_text().splitlines()
                if "scaler: " in l)
    final = json.loads(line.split("scaler: ", 1)[1])
    assert final["world_size"] == 2 and final["global_batch"] == 240
    assert final["lrs"] == pytest.approx([round(0.05 * math.sqrt(0.5), 8)])  # dense and fused embedding rates

    kept = _trained_samples(samples, ranks=4)
    assert [(step, world, len(h)) for step, world, h in kept] == (
        [(s, 4, 480) for s in range(4)] + [(s, 2, 240) for s in range(4, 6)])
    trained = [h for _, _, hashes in kept for h in hashes]
    data = config["data"]
    source = SyntheticCriteo(config["model"]["num_embeddings_per_feature"], data["global_batch_size"] *
                             data["train_batches"], seed=data["seed"], alpha=1.5, label_seed=data["seed"])
    expected = sample_hashes(make_batch(*source.rows(0, len(trained))).dense_features)
    assert sorted(trained) == sorted(expected)  # samples [0, 4*480 + 2*240) exactly once each


def _kept_in_process(samples, ranks: int) -> list[tuple[int, int, list[str]]]:
    """``(step, world size, sample hashes)`` of every step a job resized in process kept: each rank's last record of a
    step (a step tried again after a recovery is logged again, by the rank's new number), from the ranks of the world
    that trained it (a lost or renumbered rank's older record of it is left out)."""
    last: dict[tuple[int, int], dict] = {}
    for rank in range(ranks):
        path = samples.parent / f"{samples.name}.rank{rank}"
        for line in path.read_text().splitlines():
            record = json.loads(line)
            last[(record["step"], rank)] = record
    kept = []
    for step in sorted({s for s, _ in last}):
        world = last[(step, 0)]["world_size"]
        records = [last[(step, r)] for r in range(world)]
        assert all(r["world_size"] == world for r in records), (step, records)
        kept.append((step, world, [h for r in records for h in r["samples"]]))
    return kept


@pytest.mark.slow
def test_a_shrink_and_a_grow_in_process_follow_the_scalers_rule_exactly(tmp_path):
    """``chaos --in-process --shrink --regrow`` on the packaged job with the scaler (keep_per_rank, sqrt): rank 0 of 3
    is killed before step 4, the survivors shrink to 2 ranks in their processes and a new process joins later. The
    scaler's rule applies at each resize as at a restart (the fit loop runs again from the committed state, its
    state included): 480 -> 320 samples at the shrink, 320 -> 480 at the grow, the learning rates by sqrt, and the
    data stream goes on at the next sample, none lost or repeated."""
    from lightning_dlrover.data.sources import SyntheticCriteo, make_batch
    from lightning_dlrover.monitor.events import read_events
    from tests.elastic.elastic_job import sample_hashes

    samples, workdir = tmp_path / "samples", tmp_path / "chaos"
    slow = {"class_path": "tests.elastic.elastic_job.SlowWhileShort", "init_args": {"seconds": 1.0, "world_size": 3}}
    config_path, config = _chaos_config(tmp_path, samples, max_steps=80, extra=[slow])
    proc = run(["-m", "lightning_dlrover", "chaos", "--in-process", "--shrink", "--regrow", "--config", config_path,
                "--workdir", workdir, "--nodes", "1", "--nproc-per-node", "3", "--kill-rank", "0", "--at-step", "4",
                "--no-reference", "--timeout", "300"], REPO, timeout=400)
    summary = proc.stdout.split("\nchaos summary\n")[-1]
    assert "shrunk in process from 3 to 2 ranks" in summary and "grown in process: from 2 to 3" in summary, summary
    assert "steps lost: 0" in summary and "job finished: yes" in summary, summary
    events = read_events([workdir / "faulted" / "events.jsonl"])
    grown = next(e for e in events if e.kind == "grown_in_process")
    rescaled = [e for e in events if e.kind == "batch_rescaled"]
    assert [(e.step, e["reason"], e["old_global_batch"], e["global_batch"], e["world_size"]) for e in rescaled] == [
        (4, "world_size_changed", 480, 320, 2), (grown.step, "world_size_changed", 320, 480, 3)]
    assert [e["lr_factor"] for e in rescaled] == pytest.approx([math.sqrt(2 / 3), math.sqrt(3 / 2)])

    kept = _kept_in_process(samples, ranks=3)
    assert [(step, world, len(h)) for step, world, h in kept] == (
        [(s, 3, 480) for s in range(4)] + [(s, 2, 320) for s in range(4, grown.step)]
        + [(s, 3, 480) for s in range(grown.step, 80)])
    trained = [h for _, _, hashes in kept for h in hashes]
    data = config["data"]
    source = SyntheticCriteo(config["model"]["num_embeddings_per_feature"], data["global_batch_size"] *
                             data["train_batches"], seed=data["seed"], alpha=1.5, label_seed=data["seed"])
    expected = sample_hashes(make_batch(*source.rows(0, len(trained))).dense_features)
    assert sorted(trained) == sorted(expected)  # the first samples of the stream, exactly once each


class _AdvisorAsks(pl.Callback):
    """Asks for ``batch`` samples per rank at ``step`` as the resource advisor does (through its BatchSizeControl)."""

    def __init__(self, step: int, batch: int) -> None:
        self.step, self.batch = step, batch

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            find_control(trainer.callbacks, BatchSizeControl).set_batch_per_rank(self.batch)


def _fit_one_rank(tmp_path, batch_range, samples, warmup_steps=0, extra=(), **trainer_args):
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dlrover import DLRoverStrategy
    from lightning_dlrover.data import DLRMDataModule
    from lightning_dlrover.models import DLRMModule
    from tests.elastic.elastic_job import SIZES, SampleLog

    pl.seed_everything(7)
    resume = trainer_args.pop("resume", None)
    callbacks = [ElasticBatchScaler(*batch_range, policy="keep_global", lr_rule="sqrt", warmup_steps=warmup_steps),
                 SampleLog(str(samples)), *extra]
    if resume is not None:
        callbacks.append(_AdvisorAsks(step=4, batch=16))
    else:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DLRoverStrategy(), limit_val_batches=0, logger=False,
                         enable_checkpointing=resume is None, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, **trainer_args)
    data = DLRMDataModule(SIZES, global_batch_size=64, train_batches=6, val_batches=0, seed=7)
    try:
        trainer.fit(DLRMModule(SIZES, embedding_dim=8, dense_arch_layer_sizes=[16, 8]), data, ckpt_path=resume)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return trainer, data


def test_a_smaller_batch_mid_epoch_trains_the_rest_of_the_epoch(tmp_path, monkeypatch):
    """Resumed mid-epoch with a range that halves the batch (64 -> 32), then halved again two steps later by the
    resource advisor's batch control (32 -> 16): the epoch goes on to the loader's last full batch (Lightning
    counted the epoch's batches at the old size), the next epoch starts at sample 0, and the LRs follow the rule."""
    from lightning_dlrover.elastic.batch import learning_rates
    from lightning_dlrover.data.sources import SyntheticCriteo, make_batch
    from tests.elastic.elastic_job import SIZES, sample_hashes

    monkeypatch.chdir(tmp_path)  # the job's events file
    samples = tmp_path / "samples"
    _fit_one_rank(tmp_path, (32, 256), samples, max_steps=2)
    trainer, _ = _fit_one_rank(tmp_path, (16, 32), samples, max_epochs=2, resume=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    log = [json.loads(line) for line in (tmp_path / "samples.rank0").read_text().splitlines()]
    assert [r["batch"] for r in log] == [64] * 2 + [32] * 2 + [16] * (12 + 24)
    assert trainer.current_epoch == 2 and trainer.global_step == 2 + 2 + 12 + 24
    scaler = next(c for c in trainer.callbacks if isinstance(c, ElasticBatchScaler))
    assert [(h["reason"], h["global_batch"]) for h in scaler.history] == [("out_of_range", 32), ("advisor", 16)]
    assert scaler.get_batch_per_rank() == 16
    rates = learning_rates([*trainer.optimizers, trainer.strategy.fused_optimizer])
    assert rates == pytest.approx([0.05 * math.sqrt(16 / 64)] * len(rates))  # dense and fused, sqrt rule twice
    source = SyntheticCriteo(SIZES, 64 * 6, seed=7)
    every = sample_hashes(make_batch(*source.rows(0, 384)).dense_features)
    trained = [h for r in log for h in r["samples"]]
    assert trained == every[:128] + every[128:] + every  # epoch 0 to its end at batch 32, then epoch 1 in full


class _RatesPerStep(pl.Callback):
    """Records, at every step, the rates it trains with: the dense optimizer's, the fused embedding optimizers' and
    their FBGEMM kernels' (read after the scaler's hook, before the forward)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[float], list[float], list[float]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_dlrover.elastic.batch import _leaf_optimizers, learning_rates

        fused = list(_leaf_optimizers(trainer.strategy.fused_optimizer))
        kernels = [leaf._emb_module.get_learning_rate() for leaf in fused if hasattr(leaf, "_emb_module")]
        assert kernels, "no fused embedding kernel found"
        self.steps.append((trainer.global_step, learning_rates(trainer.optimizers), learning_rates(fused), kernels))


def test_warmup_ramps_every_rate_after_each_batch_change(tmp_path, monkeypatch):
    """With warmup_steps=4, a fit resumed at a batch out of range (64 -> 32, the first step of the run at a new
    batch) and then halved by the advisor (32 -> 16 after step 4) trains each change's first 4 steps with rates going
    linearly from the old to the new: dense, fused-embedding and kernel rates alike, step by step."""
    monkeypatch.chdir(tmp_path)
    samples = tmp_path / "samples"
    _fit_one_rank(tmp_path, (32, 256), samples, max_steps=2)
    rates = _RatesPerStep()
    _fit_one_rank(tmp_path, (16, 32), samples, warmup_steps=4, extra=[rates], max_steps=12,
                  resume=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    base, first, second = 0.05, 0.05 * math.sqrt(32 / 64), 0.05 * math.sqrt(16 / 64)
    ramp1 = [base + (first - base) * k / 4 for k in (1, 2)]  # steps 2 and 3; the advisor asks as step 4 is reached
    ramp2 = [ramp1[-1] + (second - ramp1[-1]) * k / 4 for k in (1, 2, 3, 4)]  # from where the first ramp was
    expected = ramp1 + ramp2 + [second] * 4
    assert [step for step, *_ in rates.steps] == list(range(2, 12))
    for (step, dense, fused, kernels), lr in zip(rates.steps, expected):
        assert dense == pytest.approx([lr] * len(dense)), step
        assert fused == pytest.approx([lr] * len(fused)), step
        assert kernels == pytest.approx([lr] * len(kernels), rel=1e-5), step


def test_a_warmup_in_progress_goes_on_after_a_resume(tmp_path, monkeypatch):
    """A fit changes the batch at its start (64 -> 32, warmup_steps=4) and is checkpointed 2 steps into the warm-up;
    the resumed fit trains its next steps at the warm-up's steps 3 and 4, not at the old or the new rate at once."""
    monkeypatch.chdir(tmp_path)
    samples = tmp_path / "samples"
    _fit_one_rank(tmp_path, (16, 32), samples, warmup_steps=4, max_steps=2)
    rates = _RatesPerStep()
    _fit_one_rank(tmp_path, (16, 32), samples, warmup_steps=4, extra=[rates], max_steps=4,
                  resume=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    base, new = 0.05, 0.05 * math.sqrt(32 / 64)
    assert [step for step, *_ in rates.steps] == [2, 3]
    for (step, dense, fused, kernels), k in zip(rates.steps, (3, 4)):
        lr = base + (new - base) * k / 4
        assert dense + fused == pytest.approx([lr] * (len(dense) + len(fused))), step
        assert kernels == pytest.approx([lr] * len(kernels), rel=1e-5), step
