"""``import lightning_dlrover`` and the command lines' modules (``launch``, ``chaos``, ``advise``, ``simulate``,
``gen-criteo``, the profile measurement) load neither Lightning nor TorchRec, while ``Trainer(strategy="dlrover")``
works after a bare ``import lightning_dlrover`` (Lightning imported after it or before it) and every export of the
package resolves."""

import subprocess
import sys

from tests.conftest import REPO

LOADED = "loaded = lambda: sorted(m for m in ('lightning', 'torchrec') if m in sys.modules)\n"
TRAINER = ("from lightning.pytorch import Trainer\n"
           "trainer = Trainer(strategy='dlrover', accelerator='cpu', devices=1, logger=False, enable_checkpointing=False)\n"
           "print(type(trainer.strategy).__module__, type(trainer.strategy).__name__)\n")


def python(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.splitlines()


def test_launchers_load_neither_lightning_nor_torchrec_and_the_strategy_name_works_after_a_bare_import():
    code = ("import sys\n" + LOADED +
            "import lightning_dlrover\n"
            "import lightning_dlrover.cli.launch, lightning_dlrover.cli.chaos, lightning_dlrover.cli.chaos_report\n"
            "import lightning_dlrover.cli.advise, lightning_dlrover.cli.simulate, lightning_dlrover.data.generate\n"
            "import lightning_dlrover.cli.gen_criteo, lightning_dlrover.cli.profile\n"
            "from lightning_dlrover.fault.inplace import membership\n"
            "from lightning_dlrover.cli.launch import parse\n"
            "parse(['--nproc-per-node', '2', '--', 'train.py'])\n"
            "print(loaded())\n" + TRAINER +
            "import lightning_dlrover as ld\n"
            "from lightning_dlrover import DLRoverStrategy, ParityConfig\n"
            "from lightning_dlrover.fault import FAULT_ENV, FaultInjector, FaultManager\n"
            "from lightning_dlrover.fault.injector import FAULT_ENV as INJECTOR_ENV, PHASES\n"
            "from lightning_dlrover.cli.chaos import FAULT_ENV as CHAOS_ENV\n"
            "print(type(trainer.strategy) is DLRoverStrategy, FAULT_ENV == INJECTOR_ENV == CHAOS_ENV, 'during_vote' in PHASES)\n"
            "print(sorted(n for n in ld.__all__ if getattr(ld, n, None) is None), set(ld.__all__) <= set(dir(ld)))\n"
            "print(ld.fault.inplace.membership is membership)\n")
    assert python(code)[-5:] == [
        "[]",  # the command lines' modules, the package and its lazy sub-packages: no Lightning, no TorchRec
        "lightning_dlrover.strategy.dlrover DLRoverStrategy",  # registered when Lightning's strategies loaded
        "True True True",
        "[] True",  # every export resolves
        "True",
    ]


def test_strategy_name_works_when_lightning_is_imported_first():
    code = "import sys\nimport lightning.pytorch\nimport lightning_dlrover\n" + TRAINER
    assert python(code)[-1] == "lightning_dlrover.strategy.dlrover DLRoverStrategy"


def test_the_console_script_runs_the_launcher_without_lightning():
    code = ("import runpy, sys\n" + LOADED +
            "sys.argv = ['lightning-dlrover', 'launch', '--help']\n"
            "try:\n"
            "    runpy.run_module('lightning_dlrover', run_name='__main__')\n"
            "except SystemExit as stop:\n"
            "    print('exit', stop.code)\n"
            "print(loaded())\n")
    out = python(code)
    assert out[0].startswith("usage: lightning-dlrover launch") and out[-2:] == ["exit 0", "[]"]
