"""Validation of what users pass to the Accumulator: options, counts, losses, parameters.

Every function raises at the API boundary with a message that names the argument, its value
and the fix, and returns the input in the form the rest of the package uses, copied where the
caller could change it later (inputs are taken by value).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

import torch

Count = int | torch.Tensor
Counts = torch.Tensor | Sequence[Count]

# Every count, and every total of a step over all ranks, must be below this: the totals are
# reduced exactly as two limbs of 31 bits each (see _payload.py).
COUNT_LIMIT = 2**62
_COUNT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_WIDER_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        options = " or ".join(repr(choice) for choice in choices)
        raise ValueError(f"{name}={value!r} is not supported; pass {options}")


def check_positive(name: str, value: object, expected: str, allowed: tuple[str, ...] = ()) -> None:
    if isinstance(value, str) and value in allowed:
        return
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if is_number and 0 < float(value) < math.inf:  # type: ignore[arg-type]
        return
    raise ValueError(f"{name}={value!r} is not supported; pass {expected}")


def host_count(name: str, value: object) -> int:
    """Check one count given as a Python integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name}={value!r} is not an integer count; counts are numbers of samples or "
            "tokens: pass ints, or an integer tensor"
        )
    count = int(value)
    if count < 0:
        raise ValueError(
            f"{name}={count} is negative; counts are numbers of samples or tokens, 0 or more"
        )
    if count >= COUNT_LIMIT:
        raise ValueError(
            f"{name}={count} is not below 2**62, the largest count lossweight reduces "
            "exactly; pass the count of the items the loss covers (a step's total over all "
            "ranks must stay below 2**62 too)"
        )
    return count


def tensor_counts(name: str, counts: torch.Tensor, dim: int, shape_rule: str) -> torch.Tensor:
    """Check counts given as a tensor; return an int64 copy on their device."""
    _check_count_tensor(name, counts, dim, shape_rule)
    return _in_range(name, counts.detach().to(torch.int64, copy=True))


def _check_count_tensor(name: str, counts: torch.Tensor, dim: int, shape_rule: str) -> None:
    """The checks of a count tensor that need no value: its shape and dtype."""
    if counts.dim() != dim:
        raise ValueError(f"{name} is a tensor of shape {tuple(counts.shape)}; {shape_rule}")
    if counts.dtype in _WIDER_UNSIGNED:
        raise TypeError(
            f"{name} has dtype {counts.dtype}, which torch cannot compare on every device; "
            f"pass {name}.to(torch.int64)"
        )
    if counts.dtype not in _COUNT_DTYPES:
        raise TypeError(
            f"{name} has dtype {counts.dtype}, but counts must be integers; pass an integer "
            "tensor (e.g. mask.sum(-1), which is int64) or Python ints"
        )


def _in_range(name: str, counts: torch.Tensor) -> torch.Tensor:
    """Check int64 counts where they live, without reading them back: on the CPU a bad count
    raises RuntimeError at once; on an accelerator the check fails at the next sync."""
    # One shift tells both bounds: a count in [0, 2**62) shifts to 0, a negative one to -1.
    in_range = (counts >> 62) == 0
    torch._assert_async(
        in_range if counts.dim() == 0 else in_range.all(),
        f"{name} holds a count that is negative or not below 2**62; counts are numbers of "
        "samples or tokens, 0 or more",
    )
    return counts


def step_counts(name: str, value: object) -> list[int] | torch.Tensor:
    """Check the counts of a step (one per microbatch): Python ints stay on the host as a list,
    anything with a tensor in it becomes a 1-D int64 tensor (a copy)."""
    if isinstance(value, torch.Tensor):
        return tensor_counts(name, value, 1, "pass one count per microbatch, as a 1-D tensor")
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name}={value!r} is not a sequence of counts; pass one count per microbatch, as "
            "a 1-D integer tensor or a list of ints"
        )
    if not any(isinstance(count, torch.Tensor) for count in value):
        return [host_count(f"{name}[{index}]", count) for index, count in enumerate(value)]
    tensors = []
    for index, count in enumerate(value):
        if isinstance(count, torch.Tensor):
            if count.dim() != 0 or count.dtype not in _COUNT_DTYPES:
                _check_count_tensor(
                    f"{name}[{index}]", count, 0, "each count must be a 0-dim tensor or an int"
                )
            tensors.append(count)
        else:
            tensors.append(torch.tensor(host_count(f"{name}[{index}]", count)))
    devices = {count.device for count in tensors}
    if len(devices) == 1 and all(count.dtype == torch.int64 for count in tensors):
        stacked = torch.stack(tensors)  # a copy, on their device
    else:
        device = accelerator_of(f"the tensors in {name}", devices)
        stacked = torch.stack([c.to(device, torch.int64, non_blocking=True) for c in tensors])
    return _in_range(name, stacked.detach())


def microbatch_count(name: str, value: object) -> int | torch.Tensor:
    """Check one microbatch's count: an int, or a 0-dim integer tensor (copied)."""
    if isinstance(value, torch.Tensor):
        return tensor_counts(name, value, 0, "each count must be a 0-dim tensor or an int")
    return host_count(name, value)


def accelerator_of(what: str, devices: Iterable[torch.device]) -> torch.device:
    """The one non-CPU device among ``devices``, or the CPU if there is none."""
    accelerators = {device for device in devices if device.type != "cpu"}
    if len(accelerators) > 1:
        raise ValueError(
            f"{what} are on different devices ({sorted(map(str, accelerators))}); put the "
            "counts on one device, or on the CPU"
        )
    return accelerators.pop() if accelerators else torch.device("cpu")


def check_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss={loss!r} is not a tensor; pass the microbatch's loss tensor")
    if loss.dim() != 0:
        raise ValueError(
            f"loss has shape {tuple(loss.shape)}, but it must be a scalar (0-dim) tensor; "
            "reduce it to the mean or the sum of its items first"
        )
    if not loss.is_floating_point():
        raise TypeError(f"loss has dtype {loss.dtype}; pass a floating-point loss")
    return loss


def parameter_list(parameters: object) -> list[torch.Tensor]:
    """The parameters of a scale-after step, as a list: an iterable of tensors, or of
    (name, tensor) pairs as ``named_parameters()`` gives."""
    if isinstance(parameters, torch.Tensor) or not isinstance(parameters, Iterable):
        shown = (
            f"a tensor of shape {tuple(parameters.shape)}"
            if isinstance(parameters, torch.Tensor)
            else repr(parameters)
        )
        raise TypeError(
            f"parameters is {shown}, not an iterable of parameters; pass "
            "model.parameters() or model.named_parameters() (or [tensor] for one tensor)"
        )
    found = []
    for index, item in enumerate(parameters):
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"parameters[{index}] is {item!r}, not a tensor; pass model.parameters() or "
                "model.named_parameters()"
            )
        found.append(tensor)
    if not found:
        raise ValueError(
            "parameters holds no parameter (an empty list, or an iterator such as "
            "model.parameters() that was used up already); pass model.parameters() afresh"
        )
    return found
