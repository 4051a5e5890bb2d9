"""Makes methods of the package raise, on every rank of a job (Lightning's launcher re-runs the script that calls
:func:`inject`), to test that an add-on's failure never ends a fit.

A spec is ``module:name`` (a function of ``module``, patched there) or ``module:Class.method``, then optionally
``@N`` (the first ``N`` calls run as usual), ``!`` (the call runs, then raises: a change half made) and ``#R`` (only
on global rank ``R``). As a script it runs the command line: ``python inject.py SPEC... -- fit --config x.yaml``.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

SPEC = re.compile(r"^(?P<module>[\w.]+):(?P<path>[\w.]+)(?:@(?P<after>\d+))?(?P<late>!)?(?:#(?P<rank>\d+))?$")


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def inject(specs: list[str]) -> None:
    for spec in specs:
        m = SPEC.match(spec)
        if m is None:
            raise SystemExit(f"bad failure spec {spec!r}")
        owner = importlib.import_module(m["module"])
        *parents, name = m["path"].split(".")
        for part in parents:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        after, late, rank = int(m["after"] or 0), bool(m["late"]), m["rank"]
        calls = [0]

        def failing(*args, _original=original, _calls=calls, _after=after, _late=late, _rank_only=rank, _spec=spec,
                    **kwargs):
            _calls[0] += 1
            if _calls[0] <= _after or (_rank_only is not None and _rank() != int(_rank_only)):
                return _original(*args, **kwargs)
            if _late:
                _original(*args, **kwargs)
            raise RuntimeError(f"injected failure ({_spec})")

        setattr(owner, name, failing)


if __name__ == "__main__":
    sep = sys.argv.index("--")
    inject(sys.argv[1:sep])
    from lightning_dlrover.cli import main

    main(sys.argv[sep + 1:])
