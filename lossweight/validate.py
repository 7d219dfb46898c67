"""What users pass the Accumulator, checked at the boundary: counts, losses, parameters.

Every function raises the coded error of :mod:`lossweight.errors` that names the argument, its
value and the fix, and returns the input in the form the rest of the package uses, copied
where the caller could change it later (inputs are taken by value).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence

import torch

from . import _torch
from .collectives import Collective
from .errors import device_message, error

Count = int | torch.Tensor
Counts = torch.Tensor | Sequence[Count]

# Every count, and every total of a step over all ranks, must be below this: the totals are
# reduced exactly as two limbs of 31 bits each (see payload.py).
COUNT_LIMIT = 2**62
_COUNT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_WIDER_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
_ONE_D = "pass one count per microbatch, as a 1-D tensor"
_ZERO_D = "each count must be a 0-dim tensor or an int"


def host_count(name: str, value: object) -> int:
    """One count given as a Python integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error("not_integer", name=name, value=value)
    count = int(value)
    if count < 0:
        raise error("negative", name=name, value=count)
    if count >= COUNT_LIMIT:
        raise error("too_large", name=name, value=count)
    return count


def tensor_counts(name: str, counts: torch.Tensor, dim: int, rule: str) -> torch.Tensor:
    """Counts given as a tensor: an int64 copy on their device, checked there without a host
    read (on the CPU a bad count raises at once; on an accelerator at the next sync)."""
    if counts.dim() != dim:
        raise error("count_shape", name=name, shape=tuple(counts.shape), rule=rule)
    if counts.dtype in _WIDER_UNSIGNED:
        raise error("wide_unsigned", name=name, dtype=counts.dtype)
    if counts.dtype not in _COUNT_DTYPES:
        raise error("count_dtype", name=name, dtype=counts.dtype)
    copied = counts.detach().to(torch.int64, copy=True)
    # One shift tells both bounds: a count in [0, 2**62) shifts to 0, a negative one to -1.
    in_range = (copied >> 62) == 0
    flag = in_range if copied.dim() == 0 else in_range.all()
    _torch.assert_true(flag, device_message("count_range", name=name))
    return copied


def step_counts(name: str, value: object) -> list[int] | torch.Tensor:
    """The counts of a step, one per microbatch: Python ints stay a list on the host, anything
    with a tensor in it becomes a 1-D int64 tensor (a copy)."""
    if isinstance(value, torch.Tensor):
        return tensor_counts(name, value, 1, _ONE_D)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise error("not_a_sequence", name=name, value=value)
    if not any(isinstance(count, torch.Tensor) for count in value):
        return [host_count(f"{name}[{index}]", count) for index, count in enumerate(value)]
    tensors = [
        _zero_dim(f"{name}[{index}]", count)
        if isinstance(count, torch.Tensor)
        else torch.tensor(host_count(f"{name}[{index}]", count))
        for index, count in enumerate(value)
    ]
    device = accelerator_of(f"the tensors in {name}", (count.device for count in tensors))
    stacked = torch.stack([count.to(device, torch.int64, non_blocking=True) for count in tensors])
    return tensor_counts(name, stacked, 1, _ONE_D)


def microbatch_count(name: str, value: object) -> Count:
    """One microbatch's count: an int, or a 0-dim integer tensor (copied)."""
    if not isinstance(value, torch.Tensor):
        return host_count(name, value)
    return tensor_counts(name, value, 0, _ZERO_D)


def _zero_dim(name: str, value: torch.Tensor) -> torch.Tensor:
    """A 0-dim count tensor of a list, unchecked in value: the stacked list is checked."""
    if value.dim() == 0 and value.dtype in _COUNT_DTYPES:
        return value
    return tensor_counts(name, value, 0, _ZERO_D)


def accelerator_of(what: str, devices: Iterable[torch.device]) -> torch.device:
    """The one non-CPU device among ``devices``, or the CPU if there is none."""
    accelerators = {device for device in devices if device.type != "cpu"}
    if len(accelerators) > 1:
        raise error("devices_differ", what=what, devices=sorted(map(str, accelerators)))
    return accelerators.pop() if accelerators else torch.device("cpu")


def reduction_device(collective: Collective, counts: Mapping[str, object]) -> torch.device:
    """Where a step's counts are reduced: on the accelerator that holds count tensors (moving
    them would wait for it), else on the collective's device."""
    tensors = {name: c for name, c in counts.items() if isinstance(c, torch.Tensor)}
    device = accelerator_of("num_samples and num_tokens", (c.device for c in tensors.values()))
    if device.type == "cpu":
        return collective.device
    if not collective.can_reduce_on(device):
        name = next(f"num_{n}" for n, c in tensors.items() if c.device == device)
        raise error("cannot_reduce_on", name=name, device=device, reduces=collective.device.type)
    return device


def loss(value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise error("loss_type", value=value)
    if value.dim() != 0:
        raise error("loss_shape", shape=tuple(value.shape))
    if not value.is_floating_point():
        raise error("loss_dtype", dtype=value.dtype)
    return value


def parameter_list(parameters: object) -> list[torch.Tensor]:
    """The parameters of a scale-after step, as a list: an iterable of tensors, or of
    (name, tensor) pairs as ``named_parameters()`` gives."""
    if isinstance(parameters, torch.Tensor) or not isinstance(parameters, Iterable):
        shown = (
            f"a tensor of shape {tuple(parameters.shape)}"
            if isinstance(parameters, torch.Tensor)
            else repr(parameters)
        )
        raise error("parameters_type", shown=shown)
    found = []
    for index, item in enumerate(parameters):
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        if not isinstance(tensor, torch.Tensor):
            raise error("parameter_type", index=index, value=item)
        found.append(tensor)
    if not found:
        raise error("no_parameters")
    return found
