"""Skip marks shared by the test files: what this machine or this torch lacks, said once."""

from __future__ import annotations

import pytest
import torch

import syncbn.modules
from syncbn import _shm

needs_shm = pytest.mark.skipif(not _shm.supported(), reason="shared-memory path is x86-64 Linux only")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices")
# torch without ordered effectful custom operators (older than 2.4 or so) has no compiled form.
HAS_COMPILED_OPS = syncbn.modules._ops is not None

needs_compiled_ops = pytest.mark.skipif(
    not HAS_COMPILED_OPS,
    reason=f"torch {torch.__version__} has no custom operators with ordered effects (syncbn.engine._ops)",
)
