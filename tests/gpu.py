"""Whether the CUDA tests can run here: one skip rule for every ``gpu``-marked test (``make gpu-check`` runs them)."""

import pytest
import torch

from lightning_dlrover.parity import cuda

if not torch.cuda.is_available():
    GPU_SKIP_REASON = "no CUDA device (torch.cuda.is_available() is False)"
elif not cuda.available():
    GPU_SKIP_REASON = "CuPy is not installed or sees no GPU (pip install cupy-cuda12x or cupy-cuda13x)"
else:
    GPU_SKIP_REASON = ""

requires_gpu = pytest.mark.skipif(bool(GPU_SKIP_REASON), reason=GPU_SKIP_REASON)
