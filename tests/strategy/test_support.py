"""What the strategy refuses to run on a device, before any rank starts (README "What runs where", docs/gpu.md).

No GPU is needed: the checks take the device type and the backend as strings, on real strategies and real models.
"""

import pytest

from lightning_dlrover import DLRoverStrategy
from lightning_dlrover.fault import ParityConfig
from lightning_dlrover.fault.inplace import membership
from lightning_dlrover.fault.inplace.process_group import BACKEND
from lightning_dlrover.fault.inplace.protocol import process_group_backend
from lightning_dlrover.models import DLRMModule
from lightning_dlrover.strategy import support

SIZES = [10] * 26


def model(embedding_optimizer: str = "row_wise_adagrad") -> DLRMModule:
    return DLRMModule(SIZES, embedding_dim=8, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1],
                      embedding_optimizer=embedding_optimizer)


@pytest.fixture
def under_launch(monkeypatch):
    """This process is a worker of `lightning-dlrover launch` (no store is contacted by these checks)."""
    monkeypatch.setenv(membership.STORE_ENV, "127.0.0.1:1")
    monkeypatch.delenv(membership.SPARE_ENV, raising=False)


@pytest.mark.parametrize("backend", ["nccl", "mpi", "cpu:gloo,cuda:nccl"])
def test_launch_refuses_a_backend_other_than_gloo_instead_of_turning_recovery_off(under_launch, backend):
    with pytest.raises(ValueError) as err:
        DLRoverStrategy(process_group_backend=backend)
    message = str(err.value)
    assert f"process_group_backend={backend!r} under `lightning-dlrover launch`: in-process recovery runs on gloo" in message
    assert "docs/gpu.md" in message and "torchrun" in message
    with pytest.raises(ValueError):
        process_group_backend(backend)


def test_launch_still_picks_the_reconfigurable_group_for_gloo(under_launch):
    assert process_group_backend(None) == BACKEND
    assert process_group_backend("gloo") == BACKEND
    assert DLRoverStrategy()._process_group_backend == BACKEND


def test_outside_launch_any_backend_is_passed_through(monkeypatch):
    monkeypatch.delenv(membership.STORE_ENV, raising=False)
    assert process_group_backend("nccl") == "nccl"
    assert process_group_backend(None) is None


def test_launch_refuses_a_cuda_job_before_its_ranks_start(under_launch):
    strategy = DLRoverStrategy()  # the reconfigurable gloo group under launch
    with pytest.raises(ValueError) as err:
        strategy.check_model(model(), device_type="cuda")
    message = str(err.value)
    assert "In-process recovery (`lightning-dlrover launch`) runs on CPU with gloo only; this job's ranks are on " \
           "'cuda' with backend 'gloo'" in message
    assert "Run a GPU job under `torchrun`" in message and "docs/gpu.md" in message
    with pytest.raises(ValueError, match="runs on CPU with gloo only"):
        strategy.check_model(model(), backend="nccl", device_type="cpu")
    assert strategy.check_model(model(), device_type="cpu")  # a CPU job under launch is unchanged


@pytest.mark.parametrize(("device_type", "backend"), [("cuda", "nccl"), ("cpu", "gloo")])
def test_parity_refuses_embedding_optimizers_with_uncoded_state_on_every_device(device_type, backend):
    strategy = DLRoverStrategy(parity=ParityConfig(k=1, r=1))
    with pytest.raises(ValueError) as err:
        strategy.check_model(model("adam"), backend=backend, device_type=device_type)
    message = str(err.value)
    if device_type == "cpu":  # FBGEMM's CPU build has no Adam at all: that refusal comes first
        assert "are not supported by FBGEMM on CPU; choose one of ['SGD', 'Adagrad', 'RowWiseAdagrad']" in message
    else:
        assert "strategy.parity codes embedding rows and their per-row optimizer state only: in-backward " \
               "optimizer(s) ['Adam']" in message
        assert "With parity use one of ['SGD', 'Adagrad', 'RowWiseAdagrad']" in message
    with pytest.raises(ValueError, match="per-row optimizer state only"):
        support.check_parity_optimizers(model("adam"), parity=True)
    support.check_parity_optimizers(model("adam"), parity=False)
    for coded in ("sgd", "adagrad", "row_wise_adagrad"):
        support.check_parity_optimizers(model(coded), parity=True)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_parity_on_cuda_is_refused_unless_asked_for_untested(backend, monkeypatch):
    monkeypatch.delenv(support.UNTESTED_GPU_PARITY_ENV, raising=False)
    strategy = DLRoverStrategy(parity=ParityConfig(k=1, r=1))
    with pytest.raises(ValueError) as err:
        strategy.check_model(model(), backend=backend, device_type="cuda")
    message = str(err.value)
    assert "strategy.parity on 'cuda' is not supported yet: the per-step commit is wired to the device" in message
    assert "docs/gpu.md" in message and "leave parity out on the GPU" in message
    monkeypatch.setenv(support.UNTESTED_GPU_PARITY_ENV, "1")
    assert strategy.check_model(model(), backend=backend, device_type="cuda")


def test_a_cuda_job_on_an_nccl_group_passes_the_checks():
    """Its CPU-tensor collectives go through the gloo control plane (lightning_dlrover.control_plane)."""
    assert DLRoverStrategy().check_model(model(), backend="nccl", device_type="cuda")


def test_a_cuda_job_without_parity_on_gloo_and_nccl_passes_the_checks():
    """Nothing refuses it, and nothing has tested it either (README "What runs where")."""
    constraints = DLRoverStrategy().check_model(model("adam"), backend="cpu:gloo,cuda:nccl", device_type="cuda")
    assert "row_wise" in constraints["t_cat_0"].sharding_types  # every sharding type where NCCL carries the model
