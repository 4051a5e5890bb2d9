"""The few places where lightning-dlrover reaches into TorchRec internals, each because no public API exists,
and the one walk over a model's embedding tables (:func:`embedding_tables`, :func:`embedding_parameters`; public
API only) that the job signature, the sharding checks and the re-plan advice share.

- :func:`fused_embedding_kernels`: a sharded module keeps its lookups, and a lookup its embedding kernels, in
  private lists (``_lookups``, ``_emb_modules``) that are not submodules; TorchRec lists a rank's kernels nowhere.
- :func:`set_fused_learning_rate`: TorchRec's fused embedding optimizer hands its ``lr`` to its FBGEMM kernel
  (``_emb_module``) only when it steps; a changed rate must reach the kernel before the next backward.
- :func:`in_backward_optimizer_classes` / :func:`has_in_backward_optimizer`: ``apply_optimizer_in_backward``
  records a parameter's optimizer only on the parameter itself (``_optimizer_classes``,
  ``_in_backward_optimizers``), with no getter.
- :func:`dmp_wrapped_module`: ``DistributedModelParallel`` keeps the module it wraps the dense part in (TorchRec's
  ``DistributedDataParallel``) in ``_dmp_wrapped_module``; its public ``module`` unwraps that DDP.
- :func:`ordered_enumerator`: TorchRec's planner enumerator orders sharding types and compute kernels in its
  private ``_filter_sharding_types`` / ``_filter_compute_kernels``, which a subclass overrides to sort them.
- :func:`skip_collective_validation_broadcast`: ``DistributedModelParallel``'s constructor broadcasts TorchRec's
  collective-validation flag once per process; only ``collective_utils._INITIALIZED`` says it happened.
- :func:`unsharded_twins`: ``apply_optimizer_in_backward`` keeps a table's optimizer class and arguments only on
  the parameter (``_optimizer_classes``, ``_optimizer_kwargs``), which sharding replaces; a collection sharded again
  for another world (a shrink in process) needs them.
- :func:`uninitialised_tables`: TorchRec initialises a sharded table twice as it builds it (its batched kernel's
  ``init_parameters``, then the sharded collection's ``reset_parameters`` with the table's ``init_fn``) and has no
  option to skip either; a replacement whose tables the decode overwrites sets both aside while it shards.

This module sits at the bottom of the package, at its root beside :mod:`lightning_dlrover.worker_env` and
:mod:`lightning_dlrover.lightning_glue`, and imports nothing from the package: imports only point down, and
``fault/``, ``elastic/`` and ``advisor/`` (middle layers, which must not import ``strategy/``) call it as well as
``strategy/`` does. A root module rather than an ``adapters/`` package: each adapter is one module, and a
``*_glue`` name is not mistaken for the framework it wraps (``adapters/torchrec.py`` would be imported as
``torchrec``). TorchRec is imported inside the functions that need it, so the command lines (``advise``,
``simulate``), which import ``advisor/`` and ``elastic/``, still load no TorchRec.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor, nn


#: The TorchRec collections whose tables :func:`embedding_tables` lists (``TableInfo.kind``).
COLLECTION_KINDS = ("EmbeddingBagCollection", "EmbeddingCollection")


@dataclass(frozen=True)
class TableInfo:
    """One embedding table, as its collection's config gives it.

    Attributes:
        name: the table's name.
        rows: ``num_embeddings``.
        dim: ``embedding_dim``.
        features: the input features the table serves.
        pooling: ``"SUM"``, ``"MEAN"``, ... for an ``EmbeddingBagCollection``'s table, ``None`` (unpooled) for an
            ``EmbeddingCollection``'s.
        kind: the collection's kind, one of :data:`COLLECTION_KINDS`.
        path: the collection's path in the module walked (``""``: the module itself).
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    pooling: str | None
    kind: str
    path: str


@dataclass(frozen=True)
class EmbeddingParameter:
    """One parameter of an embedding collection and the in-backward optimizers ``apply_optimizer_in_backward``
    gave it.

    Attributes:
        name: ``"{collection path}.{parameter name in the collection}"``.
        in_backward: whether it has an in-backward optimizer (see :func:`has_in_backward_optimizer`).
        optimizer_classes: their classes (see :func:`in_backward_optimizer_classes`).
    """

    name: str
    in_backward: bool
    optimizer_classes: tuple[type, ...]


def _collections(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, list[Any]]]:
    """``(path, collection, kind, table configs)`` of every TorchRec ``EmbeddingBagCollection`` and
    ``EmbeddingCollection`` in ``module`` (``module.named_modules()`` order). Public API only."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    for path, child in module.named_modules():
        if isinstance(child, EmbeddingBagCollection):
            yield path, child, "EmbeddingBagCollection", child.embedding_bag_configs()
        elif isinstance(child, EmbeddingCollection):
            yield path, child, "EmbeddingCollection", child.embedding_configs()


def embedding_tables(module: nn.Module) -> list[TableInfo]:
    """Every table of the TorchRec ``EmbeddingBagCollection``/``EmbeddingCollection`` modules in ``module``, in
    module order (a name used by two collections is listed twice). Public API only (the collections' configs);
    read them before sharding: the sharded collections that replace them are not listed."""
    return [
        TableInfo(c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names),
                  c.pooling.name if kind == "EmbeddingBagCollection" else None, kind, path)
        for path, _, kind, configs in _collections(module)
        for c in configs
    ]


def embedding_parameters(module: nn.Module) -> list[EmbeddingParameter]:
    """Every parameter of the collections :func:`embedding_tables` walks, with its in-backward optimizers, in
    module order. Private reach: see :func:`in_backward_optimizer_classes`, :func:`has_in_backward_optimizer`."""
    return [
        EmbeddingParameter(f"{path}.{name}", has_in_backward_optimizer(param),
                           tuple(in_backward_optimizer_classes(param)))
        for path, child, _, _ in _collections(module)
        for name, param in child.named_parameters()
    ]


def unsharded_twins(module: nn.Module) -> dict[str, Any]:
    """``{path: make}`` for every embedding collection in ``module`` (read before sharding): ``make()`` returns a new
    unsharded collection on the meta device with the same tables and in-backward optimizers, to put at ``path`` and
    shard again for another world (see :mod:`lightning_dlrover.fault.inplace.shrink`). Private reach: the
    optimizers' classes and arguments (``_optimizer_classes``, ``_optimizer_kwargs``)."""
    import torch
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    twins: dict[str, Any] = {}
    for path, child, kind, configs in _collections(module):
        if kind == "EmbeddingBagCollection":
            build = functools.partial(EmbeddingBagCollection, tables=configs, is_weighted=child.is_weighted())
        else:
            build = functools.partial(EmbeddingCollection, tables=configs, need_indices=child.need_indices())
        optimizers = {name: (param._optimizer_classes[0], dict(param._optimizer_kwargs[0]))
                      for name, param in child.named_parameters() if getattr(param, "_optimizer_classes", None)}

        def make(build: Any = build, optimizers: dict[str, tuple[type, dict]] = optimizers) -> nn.Module:
            fresh = build(device=torch.device("meta"))
            for name, param in fresh.named_parameters():
                if name in optimizers:
                    _apply_optimizer_in_backward(optimizers[name][0], [param], dict(optimizers[name][1]))
            return fresh

        twins[path] = make
    return twins


def fused_embedding_kernels(module: nn.Module) -> list[nn.Module]:
    """TorchRec's fused embedding kernels (``BatchedFusedEmbeddingBag`` and alike) of every sharded module in
    ``module``: those whose FBGEMM module (the kernels' public ``emb_module``) keeps split optimizer states.

    Data-parallel tables use the dense kernel and are replicated on every rank: they are not listed.
    Private reach: ``_lookups`` / ``_emb_modules`` are plain lists, so the kernels are no submodules of ``module``.
    """
    return [
        kernel
        for m in module.modules()
        for lookup in getattr(m, "_lookups", None) or []
        for kernel in getattr(lookup, "_emb_modules", [])
        if hasattr(kernel, "split_embedding_weights") and hasattr(getattr(kernel, "emb_module", None), "split_optimizer_states")
    ]


def kernel_input_ids(kernel: nn.Module, features: Any) -> list[Tensor]:
    """The ids each table of fused ``kernel`` looks up in ``features`` (the ``KeyedJaggedTensor`` its forward takes),
    one tensor per table in ``kernel.config.embedding_tables`` order: the rows a training step will update.

    Reach: the kernel's ``config`` (a ``GroupedEmbeddingConfig``) is what orders the input's keys by table."""
    import torch

    values = features.values().split(features.length_per_key())  # keys follow the tables' features
    ids, position = [], 0
    for table in kernel.config.embedding_tables:
        count = len(table.feature_names)
        ids.append(values[position] if count == 1 else torch.cat(values[position : position + count]))
        position += count
    return ids


def set_fused_learning_rate(optimizer: Any) -> None:
    """Gives the FBGEMM kernel behind a TorchRec fused embedding optimizer (a leaf of ``fused_optimizer``) the
    ``lr`` of the optimizer's first param group at once; does nothing for other optimizers. Returns nothing.

    Private reach: the optimizer keeps its kernel in ``_emb_module`` and hands it the rate only in ``step``.
    """
    kernel = getattr(optimizer, "_emb_module", None)
    if kernel is not None and hasattr(kernel, "set_learning_rate"):
        kernel.set_learning_rate(optimizer.param_groups[0]["lr"])


def in_backward_optimizer_classes(param: Any) -> list[type]:
    """The optimizer classes ``apply_optimizer_in_backward`` gave ``param`` (``[]`` for none).

    Private reach: TorchRec records them only in the parameter's ``_optimizer_classes``.
    """
    return getattr(param, "_optimizer_classes", [])


def has_in_backward_optimizer(param: Any) -> bool:
    """Whether ``apply_optimizer_in_backward`` gave ``param`` an in-backward optimizer.

    Private reach: TorchRec records them only in the parameter's ``_in_backward_optimizers``.
    """
    return bool(getattr(param, "_in_backward_optimizers", None))


def in_backward_optimizers(param: Any) -> list[Any]:
    """The optimizers ``apply_optimizer_in_backward`` gave ``param`` (``[]`` for none), e.g. to change their rate.

    Private reach: TorchRec records them only in the parameter's ``_in_backward_optimizers``.
    """
    return list(getattr(param, "_in_backward_optimizers", None) or [])


def dmp_wrapped_module(model: nn.Module) -> nn.Module:
    """The module a TorchRec ``DistributedModelParallel`` wraps (after sharding, the ``DistributedDataParallel``
    around the dense part, if any); ``model`` itself when it is no ``DistributedModelParallel``.

    Private reach: DMP keeps it in ``_dmp_wrapped_module``; its public ``module`` unwraps the DDP.
    """
    return getattr(model, "_dmp_wrapped_module", model)


def ordered_enumerator(**kwargs: Any) -> Any:
    """TorchRec's planner enumerator ``EmbeddingEnumerator(**kwargs)`` with options kept in a fixed order.

    TorchRec intersects sharding types and kernels as Python sets, so when two options cost the same the
    plan depends on the process's string-hash seed; sorting makes the same job always get the same plan.
    Private reach: the order is set in the enumerator's ``_filter_sharding_types`` / ``_filter_compute_kernels``.
    """
    return _ordered_enumerator_class()(**kwargs)


@functools.cache
def _ordered_enumerator_class() -> type:
    """The ``EmbeddingEnumerator`` subclass :func:`ordered_enumerator` builds (defined once TorchRec is imported).

    Private reach: it overrides the enumerator's ``_filter_sharding_types`` / ``_filter_compute_kernels``.
    """
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    class OrderedEnumerator(EmbeddingEnumerator):
        """TorchRec's enumerator with options kept in a fixed order."""

        def _filter_sharding_types(self, name: str, allowed_sharding_types: list[str],
                                   sharder_key: str = "") -> list[str]:
            return sorted(super()._filter_sharding_types(name, allowed_sharding_types, sharder_key))

        def _filter_compute_kernels(self, name: str, allowed_compute_kernels: list[str],
                                    sharding_type: str) -> list[str]:
            return sorted(super()._filter_compute_kernels(name, allowed_compute_kernels, sharding_type))

    return OrderedEnumerator


def skip_collective_validation_broadcast() -> None:
    """Makes this process's next ``DistributedModelParallel`` skip broadcasting TorchRec's collective-validation
    flag from rank 0 (it keeps the default, off). Returns nothing.

    Private reach: the broadcast runs once per process, and only ``collective_utils._INITIALIZED`` records it.
    """
    from torchrec.distributed import collective_utils

    collective_utils._INITIALIZED = True


@contextlib.contextmanager
def uninitialised_tables() -> Iterator[None]:
    """Within it, the ``DistributedModelParallel`` this process builds leaves its sharded tables' storage as allocated
    (not initialised): for a process whose tables are about to be overwritten (a replacement decoding a lost rank's
    shards), initialising them is time spent in proportion to the state for nothing. The tables' ``init_fn`` and the
    kernels' uniform initialisation are not called; anything else is built as usual.

    Private reach: TorchRec calls the batched kernels' ``init_parameters`` (``BaseBatchedEmbedding``,
    ``BaseBatchedEmbeddingBag``) from their constructors and the sharded collections' ``reset_parameters``
    (``ShardedEmbeddingCollection``, ``ShardedEmbeddingBagCollection``) from theirs, with no option to skip them; they
    are replaced by no-ops on the classes while the context is open (one process, one thread builds the model).
    """
    from torchrec.distributed import batched_embedding_kernel as kernels
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    def nothing(self: Any) -> None:
        return None

    classes = [(kernels.BaseBatchedEmbedding, "init_parameters"), (kernels.BaseBatchedEmbeddingBag, "init_parameters"),
               (ShardedEmbeddingCollection, "reset_parameters"), (ShardedEmbeddingBagCollection, "reset_parameters")]
    saved = [(cls, name, cls.__dict__[name]) for cls, name in classes]
    for cls, name, _ in saved:
        setattr(cls, name, nothing)
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)
