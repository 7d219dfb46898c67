"""What some tests need of torch beyond pyproject's lower bound (torch 2.6), and the skip marks
that name it. The default test command installs torch 2.13, which has all of it; .ci/torch-range
runs the suite on torch 2.6, where these tests are skipped for the reasons given here."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.torch_version import TorchVersion

from lossweight import compiled

TORCH = TorchVersion(torch.__version__)

# torch 2.6's FSDP2 records events on the current stream, which a CPU stream cannot do
# ("'Stream' object has no attribute 'record_event'"): it does not run on CPU at all there.
FSDP2_ON_CPU = TORCH >= "2.7"  # tested on 2.13; 2.7 to 2.12 not run here
# torch 2.6's pipeline schedules have no scale_grads (they always divide by the microbatches).
SCALE_GRADS = "scale_grads" in inspect.signature(PipelineScheduleSingle.__init__).parameters
# Without DeviceMesh._concatenate, lossweight does not join the ranks of a tensor-parallel
# group to a data-parallel mesh's reduction, and so does not check that they agree.
TENSOR_PARALLEL_CHECKED = hasattr(DeviceMesh, "_concatenate")

needs_fsdp2_on_cpu = pytest.mark.skipif(
    not FSDP2_ON_CPU, reason=f"FSDP2 does not run on CPU in torch {torch.__version__}"
)
needs_scale_grads = pytest.mark.skipif(
    not SCALE_GRADS,
    reason=f"torch {torch.__version__}'s pipeline schedules have no scale_grads argument",
)
needs_tensor_parallel_check = pytest.mark.skipif(
    not TENSOR_PARALLEL_CHECKED,
    reason=f"torch {torch.__version__} has no DeviceMesh._concatenate to check tensor-parallel "
    "ranks with",
)
COMPILED_CHECKS = compiled.GRAPH_ASSERTS
COMPILED_CHECKS_REASON = (
    f"scale_loss() inside torch.compile needs torch 2.9 (this is {torch.__version__})"
)
needs_compiled_checks = pytest.mark.skipif(not COMPILED_CHECKS, reason=COMPILED_CHECKS_REASON)
