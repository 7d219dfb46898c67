"""Every private or version-dependent torch call of the core, behind one small interface: when
torch changes one of these, this is the file to change (the parallel layouts' own are in
:mod:`lossweight.parallel`)."""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from math import inf
from typing import Any

import torch

from .errors import error

Groups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]

try:  # torch.compile support, which a vendored copy may leave out (docs/vendoring.md)
    from . import compiled as compiled
except ImportError as missing:
    if missing.name != __package__:  # an import inside it that failed: not a file left out
        raise
    compiled = None  # type: ignore[assignment]


def needs_compiled() -> None:
    """Before a call traced by torch.compile uses :mod:`lossweight.compiled`: an error naming
    the file where a vendored copy left it out."""
    if compiled is None:
        raise error("not_copied", file="compiled.py", use="scale_loss() inside torch.compile")


def inferring_pipeline_shapes() -> bool:
    """Whether torch.distributed.pipelining runs the loss function to infer a stage's shapes
    (torch 2.13 does, at the first step of a stage built without ``output_args``): a loss it
    takes only the inputs' gradient shapes of, which is no microbatch of the step."""
    frame = sys._getframe(1)
    while frame is not None:
        code, module = frame.f_code.co_name, str(frame.f_globals.get("__name__"))
        if code == "_backward_metadata_inference" and module.startswith("torch.distributed"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def float64s(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """Host numbers as a float64 tensor on ``device``, without waiting for it: read from an
    array's buffer, faster than from a list (frombuffer refuses an empty one)."""
    if not (host := array("d", values)):
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.frombuffer(host, dtype=torch.float64).to(device, non_blocking=True)


def assert_true(flag: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where ``flag`` is False, without a host read: at once on the CPU
    (RuntimeError), at the next sync on an accelerator, when run in a compiled graph."""
    torch._assert_async(flag, message)


def gradient_version(parameter: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """A parameter's gradient, and the version of what this rank holds of it (FSDP2 adds to a
    DTensor gradient's local shard in place, which leaves the DTensor's own version as it was):
    a gradient that differs in either since was written meanwhile."""
    grad = parameter.grad
    return grad, -1 if grad is None else _local(grad)._version


def _local(grad: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a gradient: a DTensor's (FSDP2's) local shard."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _memory(grad: torch.Tensor) -> object:
    """A key of a gradient's memory; a sparse gradient has no one address, meta memory none."""
    local = _local(grad)
    if local.is_sparse or local.device.type == "meta":
        return id(local)
    return (local.data_ptr(), local.shape, local.stride(), local.device, local.dtype)


def _once(parameters: list[torch.Tensor]) -> dict[object, torch.Tensor]:
    """The parameters with a gradient, by gradient memory: two parameters whose gradient is the
    same memory are rescaled, and clipped, once."""
    found: dict[object, torch.Tensor] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            found.setdefault(_memory(parameter.grad), parameter)
    return found


def unscaled(reached: list[torch.Tensor], parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``reached`` whose gradient exists and is not the memory of a gradient of
    ``parameters`` (which rescaling those rescales too)."""
    given = _once(parameters)
    return [p for p in reached if p.grad is not None and _memory(p.grad) not in given]


def gradient_groups(parameters: list[torch.Tensor]) -> Groups:
    """The gradients that exist, each once, by device and dtype for the foreach calls."""
    return _grouped(_local(p.grad) for p in _once(parameters).values())  # type: ignore[arg-type]


def _grouped(tensors: Iterable[torch.Tensor]) -> Groups:
    """``tensors`` by device and dtype, as the foreach calls take them."""
    groups: Groups = defaultdict(list)
    for tensor in tensors:
        groups[(tensor.device, tensor.dtype)].append(tensor)
    return groups


def nonzero_gradients(groups: Groups) -> torch.Tensor:
    """Whether a gradient (a sparse one's values) is nonzero, by its largest magnitude (exact,
    where a norm of tiny values underflows to 0): a bool tensor, on an accelerator that holds
    gradients if one does, computed without a host read (meta gradients hold no values: they
    count as zero)."""
    flags = []
    for (device, _), grads in groups.items():
        dense = [g._values() if g.is_sparse else g for g in grads]
        dense = [g for g in dense if g.numel()]  # empty: holds nothing, and the norm refuses it
        if device.type != "meta" and dense:
            flags.append(torch.stack(torch._foreach_norm(dense, inf)) != 0)
    device = next((f.device for f in flags if f.device.type != "cpu"), torch.device("cpu"))
    none = torch.zeros(0, dtype=torch.bool, device=device)
    return torch.cat([none, *[flag.to(device, non_blocking=True) for flag in flags]]).any()


def leaves(tensors: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The leaves that a backward from ``tensors`` accumulates gradients into: their autograd
    graph's ``AccumulateGrad`` nodes, each node walked once however many of them reach it (a
    trunk that several loss terms share), on the host, as far as the caller reads; and the
    parameters that a reentrant checkpoint's backward recomputes (:func:`_recomputed`)."""
    seen, nodes = set(), [tensor.grad_fn for tensor in tensors]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if (variable := getattr(node, "variable", None)) is not None:
            yield variable
        elif (run := getattr(node, "run_function", None)) is not None:
            yield from _recomputed(run)
        nodes.extend(following for following, _ in node.next_functions)


def _recomputed(run: object) -> Iterator[torch.Tensor]:
    """The parameters of the modules that ``torch.utils.checkpoint(run, use_reentrant=True)``
    runs again in its backward, whose graph exists only then: ``run`` itself, or the modules
    bound to it (a bound method's, a partial's arguments, a closure's cells). A function that
    reaches its modules otherwise (as globals) shows none."""
    held = [run]
    while isinstance(run, functools.partial):
        held, run = [*held, *run.args, run.func], run.func
    held.append(getattr(run, "__self__", None))
    for cell in getattr(run, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # a variable not yet assigned
            held.append(cell.cell_contents)
    for module in held:
        if isinstance(module, torch.nn.Module):
            yield from module.parameters()


def _fsdp_params() -> list[Any] | None:
    """FSDP2's parameters (its ``FSDPParam`` records) of every ``fully_shard``-ed module, from
    each one's state in torch's registry of module states: none where FSDP2 is not imported,
    None where it is but they are not where torch 2.13 keeps them."""
    fsdp = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_state")
    if fsdp is None:  # FSDP2 is not imported: there is none
        return []
    try:
        from torch.distributed._composable_state import _module_state_mapping

        states: list[Any] = [reference() for reference in list(_module_state_mapping.values())]
        states = [state for state in states if isinstance(state, fsdp.FSDPState)]
        # torch 2.13 has a list of groups per state; torch before it, one group or None.
        groups = [getattr(s, "_fsdp_param_groups", None) or [s._fsdp_param_group] for s in states]
        params = [p for listed in groups for group in listed if group for p in group.fsdp_params]
        return [p for p in params if isinstance(p.sharded_param, torch.Tensor)]
    except (ImportError, AttributeError, TypeError, RuntimeError):  # Runtime: changed meanwhile
        return None


def fsdp_shards() -> dict[int, torch.Tensor] | None:
    """FSDP2's sharded parameters (DTensors: a module's parameters between steps, which get the
    reduced gradients), by the id of the unsharded parameter that FSDP2 swaps into the module
    for its forward and backward (one tensor from the first all-gather on), which a graph
    reaches; None where FSDP2 is imported but they are not found."""
    if (params := _fsdp_params()) is None:
        return None
    unsharded = [(getattr(p, "_unsharded_param", None), p.sharded_param) for p in params]
    return {id(tensor): shard for tensor, shard in unsharded if tensor is not None}


def fsdp_held(given: list[torch.Tensor]) -> Groups:
    """What FSDP2 holds for the next reduce-scatter into the shards among ``given``: gradients
    that backward passes with gradient sync off left on its unsharded parameters (or their
    copies at its reduce dtype), which ``zero_grad()`` does not reach; by device and dtype."""
    ids, held = {id(p) for p in given}, []
    for param in _fsdp_params() or []:
        if id(param.sharded_param) in ids:
            unsharded = getattr(param, "_unsharded_param", None)  # made at its first all-gather
            accumulated = getattr(param, "unsharded_accumulated_grad", None)  # at reduce dtype
            held += [getattr(unsharded, "grad", None), accumulated]
    return _grouped(grad for grad in held if isinstance(grad, torch.Tensor))


def unsharded_given(sharded: list[torch.Tensor], given: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``sharded`` (FSDP2's sharded parameters) whose unsharded parameter ``given``
    holds: a list taken from a module while FSDP2 had it unsharded."""
    shards = fsdp_shards() or {}
    held = {id(shards[id(p)]) for p in given if id(p) in shards}
    return [p for p in sharded if id(p) in held]


class Backwards:
    """How many backward passes have reached each of ``parameters`` that autograd accumulates
    into (a leaf that requires grad) since this was made: a hook on each, until ``close()``
    (or this object's collection) removes them. On DTensors, the first one's alone: FSDP2 makes
    the copy of a gradient it offloads to the CPU blocking where the parameter has a hook."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        leaves = [p for p in parameters if p.is_leaf and p.requires_grad]
        leaves = leaves[:1] if any(hasattr(p, "to_local") for p in leaves) else leaves
        counted = self._counted = [0] * len(leaves)  # the hooks hold this list, not this object
        hooks = [
            leaf.register_post_accumulate_grad_hook(functools.partial(_count, counted, index))  # type: ignore[no-untyped-call]
            for index, leaf in enumerate(leaves)
        ]
        self.close = weakref.finalize(self, _remove, hooks)  # a call removes them, once

    @property
    def count(self) -> int:
        """The most backward passes that reached one of the parameters."""
        return max(self._counted, default=0)


def _count(counted: list[int], index: int, _: torch.Tensor) -> None:
    counted[index] += 1


def _remove(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()


def reaches(losses: Sequence[torch.Tensor], parameters: list[torch.Tensor]) -> bool:
    """Whether the backward of ``losses`` reaches a gradient of ``parameters``, one of those
    tensors or a leaf whose gradient is the same memory: a walk of their graph."""
    wanted = {id(p) for p in parameters} | set(_once(parameters))
    return any(
        id(leaf) in wanted or (leaf.grad is not None and _memory(leaf.grad) in wanted)
        for leaf in leaves(losses)
    )


def register_hook(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """``tensor.register_hook(hook)``, run eagerly where torch.compile traces the caller: dynamo
    would drop a hook registered on a tensor of its graph."""
    if torch.compiler.is_compiling():
        torch.compiler.disable(register_hook)(tensor, hook)  # type: ignore[no-untyped-call]
    else:
        tensor.register_hook(hook)  # type: ignore[no-untyped-call]


def clip_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients, each once, to the total norm ``max_norm`` with torch's clipping;
    their norm before (a DTensor's reduced over its mesh: the whole gradient's)."""
    norm = torch.nn.utils.clip_grad_norm_(list(_once(parameters).values()), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def multiply(groups: Groups, factor: torch.Tensor) -> None:
    """Multiply every gradient in place by the 0-dim ``factor``, one pass per group."""
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, factor.to(device, non_blocking=True))


class Verdict:
    """Which checks failed on an accelerator, copied to the host without waiting for it:
    ``ready()`` polls, so that lossweight reports the failure itself at a later call, with no
    host sync on the way."""

    def __init__(self, failed: torch.Tensor) -> None:
        self.failed = torch.empty(failed.shape, dtype=torch.bool, pin_memory=failed.is_cuda)
        self.failed.copy_(failed, non_blocking=True)
        self._event = torch.Event(failed.device) if failed.device.type != "cpu" else None
        if self._event is not None:
            self._event.record()

    def ready(self, wait: bool = False) -> bool:
        if self._event is not None and wait:
            self._event.synchronize()
        return self._event is None or self._event.query()
