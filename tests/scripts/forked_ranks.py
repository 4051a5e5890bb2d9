"""Runs a Lightning script's ranks as an external launcher would (``torchrun``-style: each rank gets ``LOCAL_RANK``,
``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, so Lightning starts no process of its own), every rank forked from
one warm process that imported the libraries once (the zygote of ``lightning-dlrover launch``,
``lightning_dlrover/fault/inplace/zygote.py``, which also says why that fork is safe).

    python tests/scripts/forked_ranks.py --nproc 2 tests/scripts/train.py --steps 12

For the test suite: a 2-rank job under the strategy's default ``popen`` launcher imports torch, TorchRec and Lightning
in rank 0, then again in rank 1 (about 8 CPU seconds each, one after the other); here the imports are paid once and
the ranks start together. The ranks run the strategy's externally-launched path (the one ``torchrun`` gives), not
Lightning's launcher: tests whose promise is the default launch path (its up-front checks included) keep ``popen``.

It exits with the first non-zero exit status of a rank (a rank killed by signal ``N``: ``128 + N``), once the other
ranks have ended or ``--grace`` seconds later (then they are killed); 0 when every rank exits 0. Where the zygote
cannot fork (see its module), the ranks are started as fresh interpreters instead, with a line on stderr saying so.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from lightning_dlrover.fault.inplace import zygote

# What tests/scripts/train.py and user_model.py import (the zygote's own default adds the `fit` command line's modules)
PRELOAD = ("torch", "torch.distributed", "torchrec", "lightning.pytorch", "lightning_dlrover.strategy.dlrover",
           "lightning_dlrover.models", "lightning_dlrover.data", "lightning_dlrover.monitor")
DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "NODE_RANK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(nproc: int, program: list[str]) -> list:
    """The ranks' processes, forked from a zygote (fresh interpreters where it cannot fork)."""
    env = {k: v for k, v in os.environ.items() if k not in DROPPED}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(os.environ.get("MASTER_PORT") or free_port()), NODE_RANK="0")
    envs = [{**env, "LOCAL_RANK": str(rank)} for rank in range(nproc)]
    try:
        warm = zygote.Zygote.start({**env, zygote.PRELOAD_ENV: ",".join(PRELOAD)})
    except zygote.ZygoteError as err:
        print(f"forked_ranks: no zygote ({err}); starting fresh interpreters", file=sys.stderr, flush=True)
        return [subprocess.Popen([sys.executable, *program], env=e) for e in envs]
    ranks: list = []
    try:
        for rank_env in envs:
            ranks.append(warm.fork(program, rank_env, idle=False, ready_timeout=600))
    except zygote.ZygoteError as err:
        print(f"forked_ranks: the zygote did not fork rank {len(ranks)} ({err}); starting it and the rest fresh",
              file=sys.stderr, flush=True)
        ranks += [subprocess.Popen([sys.executable, *program], env=e) for e in envs[len(ranks):]]
    finally:
        warm.close()  # the forked ranks are this process's children, not the zygote's
    return ranks


def wait(ranks: list, grace: float) -> int:
    """The job's exit status (see the module), every rank ended."""
    failed_at, status = None, 0
    while True:
        codes = [rank.poll() for rank in ranks]
        if status == 0:
            bad = [code for code in codes if code not in (None, 0)]
            if bad:
                status, failed_at = (128 - bad[0] if bad[0] < 0 else bad[0]), time.monotonic()
        if all(code is not None for code in codes):
            return status
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for rank, code in zip(ranks, codes):
                if code is None:
                    rank.kill()
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True, help="ranks (the script's Trainer(devices=...))")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds the others get once a rank failed")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="script.py [args]")
    args = parser.parse_args()
    ranks = start_ranks(args.nproc, args.program)

    def stop(signum: int, _frame: object) -> None:
        for rank in ranks:
            rank.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    sys.exit(wait(ranks, args.grace))


if __name__ == "__main__":
    main()
