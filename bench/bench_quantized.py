"""The int8 export against the fp32 one (``lightning-dlrover export --quantize int8``, issue #21): size, latency per
batch and the change of AUC, log loss and calibration on held-out data.

A trained checkpoint (``--ckpt``; by default this trains ``configs/demo.yaml``: 3 ranks, 200 steps, as ``make demo``)
is exported once with ``quantize="int8"``. In this process the fp32 module (``model.pt``) and the int8 one
(``load_quantized``: TorchRec's row-wise int8 tables, FBGEMM's CPU lookup) predict the same held-out samples (the
data module's synthetic test set, other samples than training's, labelled by the same function). Latency is the
median wall time of one forward of a ``--batch`` batch, the two modules interleaved, after a warm-up.

    PYTHONPATH=. python bench/bench_quantized.py                           # trains the demo first (minutes)
    PYTHONPATH=. python bench/bench_quantized.py --ckpt runs/demo/lightning_logs/version_0/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def train_demo(work: Path) -> Path:
    """Trains ``configs/demo.yaml`` under ``work``; returns its last checkpoint."""
    print("training configs/demo.yaml (3 ranks, 200 steps) ...", flush=True)
    subprocess.run([sys.executable, "-m", "lightning_dlrover", "fit", "--config", str(REPO / "configs" / "demo.yaml"),
                    f"--trainer.default_root_dir={work / 'run'}", "--trainer.enable_progress_bar=false"],
                   check=True, cwd=work, stdout=subprocess.DEVNULL)
    [ckpt] = sorted((work / "run").glob("lightning_logs/version_*/checkpoints/last.ckpt"))
    return ckpt


def table_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for k, v in state.items() if "embedding_bags" in k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, default=None, help="a checkpoint of DLRMModule (default: train the demo)")
    parser.add_argument("--test-batches", type=int, default=20, help="held-out global batches to score")
    parser.add_argument("--batch", type=int, default=2048, help="samples per batch (latency and scoring)")
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards per module")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args()

    from lightning_dlrover.checkpoint.plain import CONFIG_FILE, MODEL_FILE
    from lightning_dlrover.data import DLRMDataModule
    from lightning_dlrover.export import export_checkpoint, load_quantized
    from lightning_dlrover.export.artefact import build_module
    from lightning_dlrover.export.quantized import QUANTIZED_FILE
    from lightning_dlrover.log import quiet_known_warnings
    from lightning_dlrover.models.metrics import ctr_metrics

    quiet_known_warnings()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_quantized_"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt or train_demo(work)
    out = export_checkpoint(ckpt, work / "export", program=False, quantize="int8", overwrite=True)
    config = json.loads((out / CONFIG_FILE).read_text())
    fp32_state = torch.load(out / MODEL_FILE, weights_only=True)
    fp32 = build_module(config["module_class"], config["hparams"], out)
    fp32.load_state_dict(fp32_state, assign=True)
    modules = {"fp32": fp32.eval(), "int8": load_quantized(out)}
    sizes = {"fp32": table_bytes(fp32_state),
             "int8": table_bytes(torch.load(out / QUANTIZED_FILE, weights_only=True))}
    files = {"fp32": (out / MODEL_FILE).stat().st_size, "int8": (out / QUANTIZED_FILE).stat().st_size}

    data = DLRMDataModule(config["hparams"]["num_embeddings_per_feature"], global_batch_size=args.batch,
                          test_batches=args.test_batches, seed=0)
    batches = list(data.test_dataloader())
    metrics = {name: ctr_metrics("test/") for name in modules}
    times: dict[str, list[float]] = {name: [] for name in modules}
    with torch.inference_mode():
        for batch in batches:
            for name, module in modules.items():
                metrics[name].update(module(batch).squeeze(-1), batch.labels)
        for name, module in modules.items():  # warm-up
            module(batches[0])
        for i in range(args.repeats):
            for name, module in (modules.items() if i % 2 == 0 else reversed(modules.items())):
                started = time.perf_counter()
                module(batches[i % len(batches)])
                times[name].append(time.perf_counter() - started)
    scores = {name: {k.removeprefix("test/"): float(v) for k, v in m.compute().items()} for name, m in metrics.items()}

    print(f"\ncheckpoint {ckpt} (global step {config['source'].get('global_step')}); "
          f"{len(batches) * args.batch} held-out samples; batch {args.batch}; {torch.get_num_threads()} threads\n")
    print("| tables | table bytes | file MiB | latency per batch ms (median) | AUC | log loss | NE | calibration |")
    print("|---|---|---|---|---|---|---|---|")
    for name in modules:
        s = scores[name]
        latency = 1e3 * sorted(times[name])[len(times[name]) // 2]
        print(f"| {name} | {sizes[name]:,} | {files[name] / 2**20:.2f} | {latency:.2f} | {s['auc']:.5f} "
              f"| {s['loss']:.5f} | {s['ne']:.5f} | {s['calibration']:.4f} |")
    print(f"\nint8 / fp32: table bytes x{sizes['int8'] / sizes['fp32']:.3f}, latency "
          f"x{sorted(times['int8'])[len(times['int8']) // 2] / sorted(times['fp32'])[len(times['fp32']) // 2]:.2f}, "
          f"AUC change {scores['int8']['auc'] - scores['fp32']['auc']:+.2e}, log loss change "
          f"{scores['int8']['loss'] - scores['fp32']['loss']:+.2e}")


if __name__ == "__main__":
    main()
