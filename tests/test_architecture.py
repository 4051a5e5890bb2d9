"""The package's shape, as docs/architecture.md states it: imports point down, framework privates live in one
adapter each, no module grows past ~400 lines. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dlrover"

#: Each room of the package and its layer: a room imports only rooms of a lower layer, or those of its own layer
#: that :data:`SIDEWAYS` allows.
LAYERS = {
    # bottom: knows nothing of Lightning's trainer loop or of fault tolerance
    "_lazy": 0, "worker_env": 0, "machine": 0, "control_plane": 0, "log": 0, "torchrec_glue": 0, "lightning_glue": 0,
    "parity": 0, "checkpoint": 0, "data": 0, "models": 0, "monitor": 0,
    # middle: fault tolerance and the tuning add-ons
    "fault": 1, "elastic": 1, "pipeline_tuner": 1, "advisor": 1, "export": 1, "planner": 1,
    # top: the Lightning strategy and the command lines
    "strategy": 2, "cli": 2, "_registration": 2, "__init__": 2, "__main__": 2,
}
SIDEWAYS = {
    ("monitor", "checkpoint"),  # the state digest hashes what a checkpoint holds
    ("models", "data"),  # the DLRM's batch type
    ("data", "monitor"),  # the staged loader records the malformed lines it skipped as events
    ("elastic", "data"),  # the scaler resizes the data module's batches
    ("pipeline_tuner", "data"),  # the tuner drives the staged loader
    ("advisor", "pipeline_tuner"),  # the advisor hands the tuner its CPU budget
    ("advisor", "elastic"),  # ... and the scaler its batch
    ("fault", "planner"),  # ParityConfig.auto: the planner's pick
    ("planner", "advisor"),  # the planner reads observed failures and measured costs from the job history
    ("cli", "strategy"),
    ("__init__", "strategy"), ("__init__", "cli"), ("__init__", "_registration"), ("_registration", "strategy"),
    ("__main__", "cli"),
    ("lightning_glue", "torchrec_glue"),  # the DDP inside TorchRec's DistributedModelParallel
}
SIDEWAYS |= {(a, b) for a in LAYERS for b in LAYERS if LAYERS[a] == 0 and LAYERS[b] == 0 and b in ("_lazy", "log", "worker_env", "machine", "control_plane")}

#: Framework internals and the one module allowed to name them.
PRIVATES = {
    "torchrec_glue.py": ("_lookups", "_emb_modules", "_emb_module", "_optimizer_classes", "_in_backward_optimizers",
                         "_INITIALIZED", "_dmp_wrapped_module", "_filter_sharding_types", "_filter_compute_kernels"),
    "lightning_glue.py": ("_checkpoint_connector", "_combined_loader", "_DDPForwardRedirection", "_loaded_checkpoint",
                          "_data_connector", "_results", "_last_global_step_saved", "_every_n_train_steps",
                          "_train_time_interval", "_every_n_epochs"),
}
MAX_LINES = 410


def _room(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "lightning_dlrover":
                if len(parts) > 1:
                    found.add(parts[1])
                else:  # from lightning_dlrover import worker_env
                    found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "lightning_dlrover" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_every_room_has_a_layer():
    rooms = {_room(path) for path in _modules()}
    assert rooms <= set(LAYERS), f"rooms without a layer in LAYERS (and docs/architecture.md): {rooms - set(LAYERS)}"


def test_imports_point_down():
    wrong: dict[str, set[str]] = defaultdict(set)
    for path in _modules():
        room = _room(path)
        for target in _imports(path) - {room}:
            if target not in LAYERS:
                continue
            if LAYERS[target] < LAYERS[room] or (room, target) in SIDEWAYS:
                continue
            wrong[str(path.relative_to(PACKAGE))].add(target)
    assert not wrong, f"imports that do not point down (see docs/architecture.md): {dict(wrong)}"


@pytest.mark.parametrize("owner", sorted(PRIVATES))
def test_framework_privates_live_in_their_adapter(owner):
    names = set(PRIVATES[owner])
    elsewhere: dict[str, set[str]] = defaultdict(set)
    for path in _modules():
        if path.name == owner and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                elsewhere[str(path.relative_to(PACKAGE))].add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                elsewhere[str(path.relative_to(PACKAGE))].add(node.value)
    assert not elsewhere, f"framework internals outside lightning_dlrover/{owner}: {dict(elsewhere)}"


def test_no_module_is_over_the_size_a_reader_takes_in():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split by concern): {long}"


COLLECTIVES = {"all_gather", "all_gather_object", "all_reduce", "broadcast", "broadcast_object_list", "all_to_all",
               "all_to_all_single", "barrier", "gather", "gather_object", "scatter", "scatter_object_list", "send",
               "recv", "isend", "irecv", "P2POp", "reduce", "reduce_scatter", "all_gather_into_tensor",
               "reduce_scatter_tensor", "monitored_barrier"}


def test_every_collective_names_its_plane():
    """A collective of ours names its group: ``control_plane.group()`` for CPU tensors and objects (gloo), or the
    default group by name (``dist.group.WORLD``) for the data plane. On GPUs the default group is NCCL, which fails on
    CPU tensors: a collective left to the default group by omission is a crash there."""
    unnamed: dict[str, list[int]] = defaultdict(list)
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                    and not any(k.arg == "group" for k in node.keywords)):
                unnamed[str(path.relative_to(PACKAGE))].append(node.lineno)
    assert not unnamed, f"collectives without group= (see lightning_dlrover/control_plane.py): {dict(unnamed)}"


def test_the_strategy_reaches_fault_tolerance_through_the_fault_manager():
    """``strategy/`` imports ``lightning_dlrover.fault`` (FaultManager, ParityConfig, FaultInjector, Host) only, apart
    from types under ``TYPE_CHECKING``: the rooms inside ``fault/`` can move without touching the strategy."""
    reaches: dict[str, set[str]] = defaultdict(set)
    for path in sorted((PACKAGE / "strategy").glob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_dlrover.fault.")
                    and id(node) not in typing_only):
                reaches[path.name].add(node.module)
    assert not reaches, f"the strategy imports fault/ internals (go through FaultManager): {dict(reaches)}"


def test_test_files_have_unique_basenames():
    """pytest imports test modules by basename (rootdir, no packages): two ``test_x.py`` in different folders stop the
    whole suite at collection."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        seen[path.name].append(str(path.relative_to(PACKAGE.parent)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
