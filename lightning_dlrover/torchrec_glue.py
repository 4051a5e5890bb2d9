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
- :func:`shard_metadata_from_plan`: ``ShardedEmbeddingCollection`` builds its tables' ``ShardedTensor`` by
  all-gathering every rank's shard metadata (``ShardedTensor._init_from_local_shards``), which a replacement that
  builds its model alone cannot run; ``ShardedEmbeddingBagCollection`` already builds it from the plan.
- :func:`pooled_key_order`: a sharded embedding-bag collection's output keys follow the plan, and only its private
  ``_embedding_names`` says their order before a forward.

At the package's root, importing nothing from it: ``fault/``, ``elastic/`` and ``advisor/`` call it as ``strategy/``
does. One module, not an ``adapters/`` package, whose ``torchrec.py`` would shadow the framework. TorchRec is imported
inside the functions, so the command lines (``advise``, ``simulate``) load no TorchRec.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
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


#: FBGEMM's host buffers that hold coded state (a table's weights and optimizer states; see
#: ``lightning_dlrover.fault.coding.coded_state``): what a replacement's decode overwrites, row by row.
CODED_HOST_BUFFERS = ("weights", "momentum1", "momentum2")


@contextlib.contextmanager
def uninitialised_tables(host_buffer: Callable[[int, Any], Tensor | None] | None = None) -> Iterator[None]:
    """Within it, the ``DistributedModelParallel`` this process builds leaves its sharded tables' storage as allocated
    (not initialised): for a process whose tables are about to be overwritten (a replacement decoding a lost rank's
    shards), initialising them is time spent in proportion to the state for nothing. The tables' ``init_fn`` and the
    kernels' uniform initialisation are not called, and FBGEMM's host buffers of :data:`CODED_HOST_BUFFERS` are not
    zeroed: each is ``host_buffer(numel, dtype)`` (e.g. memory a hot spare touched while it waited), or fresh
    ``torch.empty`` memory where that is ``None`` or returns ``None``. Anything else is built as usual.

    Private reach: TorchRec calls the batched kernels' ``init_parameters`` (``BaseBatchedEmbedding``,
    ``BaseBatchedEmbeddingBag``) from their constructors and the sharded collections' ``reset_parameters``
    (``ShardedEmbeddingCollection``, ``ShardedEmbeddingBagCollection``) from theirs, with no option to skip them; they
    are replaced by no-ops on the classes while the context is open. FBGEMM's TBE allocates its host buffers zeroed in
    its module's ``apply_split_helper``, which takes a ``preallocated_host_buffer``; TorchRec passes none (its option,
    ``preallocated_host_buffers``, is one dict for every kernel built from the same fused parameters), so the helper is
    wrapped to pass one (one process, one thread builds the model).
    """
    import torch
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as tbe
    from torchrec.distributed import batched_embedding_kernel as kernels
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    def nothing(self: Any) -> None:
        return None

    split_helper = tbe.apply_split_helper
    signature = inspect.signature(split_helper)

    def uninitialised_split(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        given = call.arguments
        split, device = given["split"], given["current_device"]
        if (given["prefix"] in CODED_HOST_BUFFERS and split.host_size > 0 and device.type == "cpu"
                and given.get("preallocated_host_buffer") is None):
            buffer = host_buffer(split.host_size, given["dtype"]) if host_buffer is not None else None
            given["preallocated_host_buffer"] = (
                buffer if buffer is not None else torch.empty(split.host_size, dtype=given["dtype"], device=device)
            )
        return split_helper(*call.args, **call.kwargs)

    classes = [(kernels.BaseBatchedEmbedding, "init_parameters"), (kernels.BaseBatchedEmbeddingBag, "init_parameters"),
               (ShardedEmbeddingCollection, "reset_parameters"), (ShardedEmbeddingBagCollection, "reset_parameters")]
    saved = [(cls, name, cls.__dict__[name]) for cls, name in classes]
    for cls, name, _ in saved:
        setattr(cls, name, nothing)
    tbe.apply_split_helper = uninitialised_split
    try:
        yield
    finally:
        tbe.apply_split_helper = split_helper
        for cls, name, original in saved:
            setattr(cls, name, original)


@contextlib.contextmanager
def shard_metadata_from_plan() -> Iterator[None]:
    """Within it, the ``ShardedEmbeddingCollection`` modules this process builds take each table's global shard
    metadata from their sharding plan instead of gathering it from every rank: the build runs no collective, as a
    replacement building its model while the survivors train needs (its world group answers collectives locally,
    which would leave a table it does not hold with no shards anywhere: "ShardedTensor have no local shards on all
    ranks!"). The metadata is the gather's: the plan's shards, in rank order, with the local shards' tensor properties.

    Private reach: ``ShardedEmbeddingCollection._initialize_torch_state`` calls torch's
    ``ShardedTensor._init_from_local_shards`` (a collective) once per table with the list it keeps in
    ``_model_parallel_name_to_local_shards``; while it runs, that classmethod is replaced by one that builds the
    metadata from the table's ``sharding_spec`` (as ``ShardedEmbeddingBagCollection`` does, with no gather). One
    process, one thread builds the model.
    """
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor, TensorProperties
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.modules.embedding_configs import data_type_to_dtype

    gather = ShardedTensor.__dict__["_init_from_local_shards"]
    build = ShardedEmbeddingCollection.__dict__["_initialize_torch_state"]

    def from_plan(module: Any, cls: type, local_shards: list[Any], *global_size: Any, process_group: Any = None,
                  init_rrefs: bool = False) -> Any:
        table = next((name for name, shards in module._model_parallel_name_to_local_shards.items()
                      if shards is local_shards), None)
        spec = getattr(module.module_sharding_plan.get(table), "sharding_spec", None) if table is not None else None
        sizes = global_size[0] if len(global_size) == 1 and not isinstance(global_size[0], int) else global_size
        if spec is None or None in tuple(sizes) or module._table_name_to_config[table].use_virtual_table:
            return gather.__func__(cls, local_shards, *global_size, process_group=process_group, init_rrefs=init_rrefs)
        if local_shards:  # the gather takes them from the first local shard of the lowest rank holding any
            t = local_shards[0].tensor
            properties = TensorProperties(t.dtype, t.layout, t.requires_grad, torch.contiguous_format, t.is_pinned())
        else:  # the other ranks' shards, built by the same kernels: the table's dtype, no gradient
            properties = TensorProperties(dtype=data_type_to_dtype(module._table_name_to_config[table].data_type))
        metadata = spec.build_metadata(torch.Size(sizes), properties)
        # the gather's order, by rank (stable); a new list: the plan's spec keeps its own
        metadata.shards_metadata = sorted(metadata.shards_metadata, key=lambda m: m.placement.rank())
        rank = torch.distributed.get_rank()  # global, as torch's own check
        planned = [(m.shard_offsets, m.shard_sizes) for m in metadata.shards_metadata if m.placement.rank() == rank]
        built = [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in local_shards]
        if planned != built:
            raise RuntimeError(
                f"table {table}: the shards this rank built ({built}) are not the plan's ({planned}); this TorchRec "
                "version's ShardedEmbeddingCollection builds its shards unlike its plan, and "
                "lightning_dlrover.torchrec_glue.shard_metadata_from_plan needs updating for it."
            )
        return cls._init_from_local_shards_and_global_metadata(local_shards, metadata, process_group=process_group,
                                                               init_rrefs=init_rrefs)

    def initialize_torch_state(self: Any, *args: Any, **kwargs: Any) -> None:
        ShardedTensor._init_from_local_shards = classmethod(functools.partial(from_plan, self))
        try:
            return build(self, *args, **kwargs)
        finally:
            ShardedTensor._init_from_local_shards = gather

    ShardedEmbeddingCollection._initialize_torch_state = initialize_torch_state
    try:
        yield
    finally:
        ShardedEmbeddingCollection._initialize_torch_state = build


def pooled_key_order(model: nn.Module) -> dict[str, list[str]]:
    """``{path: keys}``: the order of the keys in each sharded embedding-bag collection's output ``KeyedTensor``. It
    follows the sharding plan (by sharding type, then rank): a model reading the output's ``values()`` sees its
    columns move when the plan changes, one reading it by key (``to_dict()``, as TorchRec's DLRM does) does not."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return {path: list(m._embedding_names) for path, m in model.named_modules()
            if isinstance(m, ShardedEmbeddingBagCollection)}
