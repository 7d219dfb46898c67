"""The Accumulator: a thin front that checks each call's inputs at the boundary, applies a
transition of the pure step machine (:mod:`lossweight.machine`), then runs its effects on the
tensors of the mode (:mod:`lossweight.steps`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _torch, machine, terms
from .collectives import Collective, CollectiveResolver
from .errors import device_message, error
from .ledger import Ledger
from .result import StepResult
from .steps import CountFirst, ScaleAfter, accelerator_of, not_into_another_step
from .terms import ARGUMENTS, Layout, Options, Term, terms_of
from .weighting import GradReduction, LossReduction

WeightBy = Literal["samples", "tokens", "weight_sum"]
LossLogging = Literal["end", "next_step"]
Count = int | float | torch.Tensor
Counts = torch.Tensor | Sequence[Count]
Losses = torch.Tensor | Mapping[str, torch.Tensor]
Factors = torch.Tensor | dict[str, torch.Tensor]
Tensors = CountFirst | ScaleAfter | None  # the open step's, if any
_STATE_FORMAT = 1
F = TypeVar("F", bound=Callable[..., Any])


def _exclusive(method: F) -> F:
    """Refuse a call while another thread is inside one: two threads that drive a step at
    once would each overwrite what the other changed."""

    @functools.wraps(method)
    def exclusive(self: Accumulator, /, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced once, run as a graph: no lock to take
            return method(self, *args, **kwargs)
        if not self._busy.acquire(blocking=False):
            raise error("other_thread", caller=method.__name__)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy.release()

    return cast(F, exclusive)


class Accumulator:
    """Weights each microbatch's loss so that an optimizer step optimises the global mean.

    Count first, or scale after (``begin(parameters=...)``, counts given to ``scale_loss()``)::

        acc.begin(num_tokens=[...])         # this rank's count per microbatch
        for batch in microbatches:
            acc.scale_loss(loss_of(batch)).backward()
        result = acc.end()                  # result.loss, .num_tokens, .is_empty

    The step's gradient is that of ``sum(w * l) / W`` (mean losses) or ``sum(l) / W`` (sums)
    over every microbatch of every rank, however the step is split. Every rank makes the same
    calls of ``begin()``, ``end()``, ``abandon()`` and ``flush()``; ranks that disagree get a
    :class:`DisagreementError`. Not thread-safe, like an optimizer.

    Args:
        loss_reduction: whether each loss is the ``"mean"`` or the ``"sum"`` of its items'.
        weight_by: what normalises the loss: ``"tokens"`` (the default), ``"samples"``,
            ``"weight_sum"`` (a sum of float weights), or a constant (a positive number).
        terms: instead of those two, several loss terms, a list of :class:`Term` (then
            ``scale_loss({"lm": lm, "aux": aux})``; ``result.losses``, each term's loss).
        grad_reduction: how the data-parallel wrapper combines the ranks' gradients:
            ``"mean"`` (DDP, FSDP), ``"sum"``, or the number it divides their sum by.
        group: the ranks holding different data (default: the default group, at each begin()):
            a process group, or a ``DeviceMesh`` of them, ``mesh["dp"]``, ``mesh["dp", "cp"]``.
        pipeline: the dimension of a ``group`` mesh (then of the stages too) whose ranks are
            pipeline stages, the last computing the loss: ``mesh["pp", "dp"]``, ``"pp"``.
        collective: a :class:`Collective` to reduce with instead of a process group.
        loss_logging: ``"end"`` (``end()`` reduces a count-first step's loss: one more
            all-reduce) or ``"next_step"`` (it travels with the next reduction, or ``flush()``).
        weight_estimate: the ``W`` the first scale-after step's provisional factors assume.
        framework_divides_loss_by: what a framework divides each loss by before its backward
            (Accelerate, Lightning: the accumulation steps); the factors undo it.

    Attributes:
        state: the step machine's :class:`lossweight.machine.State`, a frozen value.
        options: the options, with the terms, as a frozen value.
    """

    def __init__(
        self,
        *,
        loss_reduction: LossReduction | None = None,
        weight_by: WeightBy | float | None = None,
        terms: Sequence[Term] | None = None,
        grad_reduction: GradReduction | float = "mean",
        group: dist.ProcessGroup | DeviceMesh | None = None,
        pipeline: str | None = None,
        collective: Collective | None = None,
        loss_logging: LossLogging = "end",
        weight_estimate: float = 1.0,
        framework_divides_loss_by: float = 1,
    ) -> None:
        self.options = Options(
            terms_of(loss_reduction, weight_by, terms), grad_reduction, loss_logging,
            weight_estimate, framework_divides_loss_by,
        )  # fmt: skip
        self.layout = Layout(self.options.terms)
        self.state = machine.State(self.options.weight_by, loss_logging)
        self._resolver = CollectiveResolver(group, collective, pipeline)
        self._tensors: Tensors = None
        self._ledger = Ledger(self.options, self.layout)
        self._busy = threading.Lock()

    @property
    def step_open(self) -> bool:
        """Whether ``begin()`` opened a step that neither ``end()`` nor ``abandon()`` closed."""
        return self.state.step is not None

    @property
    def steps(self) -> int:
        """How many steps have begun (the index of the last one)."""
        return self.state.steps

    @_exclusive
    def begin(
        self,
        *,
        num_samples: Counts | None = None,
        num_tokens: Counts | None = None,
        weight_sum: Counts | None = None,
        parameters: Iterable[Any] | None = None,
        step: int | None = None,
    ) -> StepContext:
        """Open a step on every rank. Count first: this rank's counts, one per microbatch (a
        1-D tensor, or a sequence of numbers or 0-dim tensors; integers, but floats for
        ``weight_sum``; those that normalise a term are required); its all-reduce starts here.
        Scale after: the ``parameters`` whose gradients ``end()`` rescales (None or zero now):
        modules, an optimizer, or tensors. ``step``: the loop's own step number (an int, or a
        numpy integer), the same on every rank (default: ``steps + 1``), so that a rank that
        skips an iteration is caught at once. ``with acc.begin(...):`` abandons on an error."""
        given = {"samples": num_samples, "tokens": num_tokens, "weight_sum": weight_sum}
        counts = {n: c if c is None else _counts(n, c, 1) for n, c in given.items()}
        lengths = {n: None if c is None else len(c) for n, c in counts.items()}
        loss = self._resolver.stages[1]
        state = machine.begin(self.state, self.options, lengths, parameters is not None, step, loss)
        params = [] if parameters is None else _parameter_list(parameters)
        collective = self._resolver.resolve()
        divisor = self._ledger.adopt(collective)
        if parameters is None:  # counts given: the machine opened a count-first step
            if not loss:  # every count given, so that no reported count looks lacking here
                size = next(len(c) for c in counts.values() if c is not None)
                counts = {name: [0] * size for name in counts}
            self._tensors = CountFirst(collective, self._ledger, state.steps, counts, divisor)
        else:
            self._tensors = ScaleAfter(collective, self._ledger, params, divisor, loss)
        self.state = state
        return StepContext(self, state.steps)

    @_exclusive
    def scale_loss(
        self,
        loss: Losses,
        *,
        num_samples: Count | None = None,
        num_tokens: Count | None = None,
        weight_sum: Count | None = None,
    ) -> torch.Tensor:
        """``loss`` (a 0-dim tensor, its items' mean or sum; a dict of one per term) times the
        next microbatch's factor (summed over the terms), for ``backward()``; with its counts
        (counting first, checked against begin()'s). A microbatch of weight 0 adds nothing to a
        term: its loss value (a NaN of 0/0 included) reaches no gradient and no log, unlike a
        NaN made in the loss's own backward (of ``(l * m).sum() / m.sum()`` over no item)."""
        losses = _losses(loss, self.options.terms, "scale_loss")
        if (inferred := _shape_inference(losses, self._resolver.pipelined)) is not None:
            return inferred  # torch's shape inference, not a microbatch
        given = (num_samples is not None, num_tokens is not None, weight_sum is not None)
        counts = {"samples": num_samples, "tokens": num_tokens, "weight_sum": weight_sum}
        if any(given):  # validated; a count-first step checks them against begin()'s
            counts = {n: c if c is None else _counts(n, c, 0) for n, c in counts.items()}
        tensors = self._tensors
        not_into_another_step(losses, tensors)
        if torch.compiler.is_compiling() and isinstance(tensors, CountFirst) and not any(given):
            _torch.needs_compiled()
            return _torch.compiled.scale(tensors, losses, machine.trace(self.state))
        state, index = machine.scale(self.state, given, _traced(tensors))
        assert tensors is not None  # the machine refuses a call without a step
        scaled = tensors.scale(losses, index, state.steps, counts if any(given) else None)
        self.state = state
        return scaled

    @_exclusive
    def backward_scale(self, microbatch: int | None = None) -> Factors:
        """A count-first factor, ``w * D / W`` (mean losses) or ``D / W`` (sums), float64; with
        several terms, a dict of them by name, which no other term's loss can take. Microbatch
        ``i``'s with ``backward_scale(i)``, for a loop that multiplies the loss itself (then
        :meth:`record_loss`); ``()``, the next one's."""
        self.state, index = machine.factor(self.state, microbatch, _traced(self._tensors))
        assert isinstance(self._tensors, CountFirst)
        if index is None:  # the next microbatch of a compiled step, whose position is a tensor
            index = self._tensors.at_cursor("no_next", self.state.steps)
        return self._tensors.factor(index)

    @_exclusive
    def record_loss(self, microbatch: int, loss: Losses) -> None:
        """Hand over the loss that ``backward_scale(microbatch)`` multiplied (a dict of one per
        term, as for :meth:`scale_loss`), for the logged loss (a detached copy is kept)."""
        losses = _losses(loss, self.options.terms, "record_loss")
        self.state, index = machine.record(self.state, microbatch)
        assert isinstance(self._tensors, CountFirst)
        self._tensors.record(index, losses)

    @_exclusive
    def end(self, *, max_grad_norm: float | None = None) -> StepResult:
        """Close the step on every rank, after its last backward and before clipping and
        ``optimizer.step()``; scaling after, it reduces the counts and rescales the gradients
        once. Returns what the step reports; if it raises, calling it again reduces no more.

        ``max_grad_norm`` (scale-after steps): then clip the rescaled gradients to that total
        norm, as ``torch.nn.utils.clip_grad_norm_`` over the parameters given to ``begin()``
        does, each gradient once; ``result.grad_norm`` is their norm before clipping."""
        if max_grad_norm is not None:
            _check_max_grad_norm(max_grad_norm, self._tensors, self._resolver.stages[0])
        step, tensors = self.state.step, self._tensors
        state, refusal = machine.end(self.state, _traced(tensors))
        assert step is not None and tensors is not None
        clip = None if max_grad_norm is None else float(max_grad_norm)
        result = tensors.end(self._ledger, step, refusal, clip)
        self.state, self._tensors = state, None
        tensors.close(abandoned=False)
        if isinstance(tensors, ScaleAfter) and clip is not None:
            result.grad_norm = _torch.clip_norm(tensors.parameters, clip)
        return result

    @_exclusive
    def abandon(self) -> None:
        """Drop the open step, if any, on every rank (its gradients stay: zero them), waiting
        for a count-first step's reduction so that none is left in flight."""
        tensors, self._tensors = self._tensors, None
        self.state = machine.abandon(self.state)
        if tensors is not None:
            tensors.close(abandoned=True)

    @_exclusive
    def flush(self) -> None:
        """Reduce a loss ``loss_logging="next_step"`` left waiting, on every rank after the last
        step: one all-reduce when a loss may wait (on some rank), waited for and checked before
        it returns."""
        state, waits = machine.flush(self.state)
        self._ledger.settle(verdicts=True)  # the run may end here: wait for an accelerator's
        if waits:
            collective = self._resolver.resolve()
            self._ledger.adopt(collective)
            codes = self._ledger.codes(state.steps, terms.FLUSH)
            reduction = self._ledger.reduce_loss(collective, codes, collective.device)
            self.state = state
            reduction.wait()  # once recorded: a wait that fails is retried, never re-reduced
            self._ledger.settle()  # checked here, on every rank: the run may end with it
            self._ledger.settle(verdicts=True)

    def state_dict(self) -> dict[str, Any]:
        """The step counter, the estimate of ``W`` and the options, as plain values that load
        at any world size. Call :meth:`flush` first to log a waiting loss."""
        machine.idle(self.state, "state_dict")
        estimate = float(self._ledger.estimated())
        estimate = estimate if math.isfinite(estimate) else self.options.weight_estimate
        state = {"format": _STATE_FORMAT, "steps": self.state.steps, "weight_estimate": estimate}
        return {**state, "options": _saved(self.options)}

    @_exclusive
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s value, saved with the same options."""
        machine.idle(self.state, "load_state_dict")
        steps, estimate = _checked_state(state_dict, self.options)
        self.state = machine.load(self.state, steps)
        self._ledger.drop("the step was replaced by load_state_dict() before its loss was reduced")
        self._ledger.assume(estimate)

    def __getstate__(self) -> dict[str, Any]:
        if self._resolver.explicit:
            raise error("not_picklable")
        fields = dataclasses.fields(self.options)
        options = {f.name: getattr(self.options, f.name) for f in fields if f.init}
        return {"options": options, "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["options"])  # type: ignore[misc]
        self.load_state_dict(state["state"])


class StepContext:
    """What ``begin()`` returns: ``with acc.begin(...):`` abandons the step if an exception
    leaves the block while it is open. Without ``with``, it can be ignored."""

    def __init__(self, accumulator: Accumulator, index: int) -> None:
        self._accumulator, self.index = accumulator, index

    def __enter__(self) -> StepContext:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        step = self._accumulator.state.step
        if kind is not None and step is not None and step.number == self.index:
            self._accumulator.abandon()


# What users pass, checked at the boundary: each check raises the coded error that names the
# argument, its value and the fix, and returns the input copied where the caller could change
# it later (inputs are taken by value).

COUNT_LIMIT = 2**62  # every count and every step's total: reduced exactly as two 31-bit limbs
_COUNT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_SHAPES = (  # what a count tensor with the wrong number of dims is told, by the number it needs
    "each count must be a 0-dim tensor or an int",
    "pass one count per microbatch, as a 1-D tensor",
)


def _host_count(name: str, value: object) -> int | float:
    if name.startswith("weight_sum"):  # a sum of float weights: any finite number, 0 or more
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise error("not_a_weight", name=name, value=value)
        if not (terms.finite(value) and value >= 0):  # type: ignore[operator]
            raise error("bad_weight", name=name, value=value)
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error("not_integer", name=name, value=value)
    if (count := int(value)) < 0:
        raise error("negative", name=name, value=count)
    if count >= COUNT_LIMIT:
        raise error("too_large", name=name, value=count)
    return count


def _tensor_counts(name: str, counts: torch.Tensor, dim: int) -> torch.Tensor:
    """An int64 copy on the counts' device (for a weight sum, a float one, at the precision
    it was given in, which its check against begin()'s fits), checked there without a host
    read (on the CPU a bad count raises at once; on an accelerator at the next sync)."""
    if counts.dim() != dim:
        raise error("count_shape", name=name, shape=tuple(counts.shape), rule=_SHAPES[dim])
    if name.startswith("weight_sum"):
        if counts.is_complex() or counts.dtype == torch.bool:
            raise error("not_a_weight", name=name, value=counts)
        precision = counts.dtype if counts.is_floating_point() else torch.float64
        weights = counts.detach().to(precision, copy=True)
        valid = (weights >= 0) & weights.isfinite()
        flag = valid if valid.dim() == 0 else valid.all()
        _torch.assert_true(flag, device_message("weight_range", name=name))
        return weights
    if counts.dtype in (torch.uint16, torch.uint32, torch.uint64):
        raise error("wide_unsigned", name=name, dtype=counts.dtype)
    if counts.dtype not in _COUNT_DTYPES:
        raise error("count_dtype", name=name, dtype=counts.dtype)
    copied = counts.detach().to(torch.int64, copy=True)
    in_range = (copied >> 62) == 0  # a count in [0, 2**62) shifts to 0, a negative one to -1
    flag = in_range if copied.dim() == 0 else in_range.all()
    _torch.assert_true(flag, device_message("count_range", name=name))
    return copied


def _counts(count: str, value: object, dim: int) -> Any:
    """A microbatch's count (``dim`` 0), or a step's, one per microbatch (``dim`` 1): Python
    numbers stay on the host, anything with a tensor in it becomes a tensor (a copy)."""
    name = ARGUMENTS[count]
    if isinstance(value, torch.Tensor):
        return _tensor_counts(name, value, dim)
    if dim == 0:
        return _host_count(name, value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise error("not_a_sequence", name=name, value=value)
    if not any(isinstance(item, torch.Tensor) for item in value):
        return [_host_count(f"{name}[{index}]", item) for index, item in enumerate(value)]
    tensors = []
    for index, item in enumerate(value):
        if not isinstance(item, torch.Tensor):
            weight = None if count in terms.INTEGER else torch.float64  # as the host holds it
            item = torch.tensor(_host_count(f"{name}[{index}]", item), dtype=weight)
        elif item.dim() != 0 or (count in terms.INTEGER and item.dtype not in _COUNT_DTYPES):
            _tensor_counts(f"{name}[{index}]", item, 0)  # raises what is wrong
        tensors.append(item)
    device = accelerator_of(f"the tensors in {name}", (t.device for t in tensors))
    # An integer weight among float ones is exact as float64, not in their precision.
    integer, f64 = count in terms.INTEGER, torch.float64

    def kind(t: torch.Tensor) -> torch.dtype | None:
        return torch.int64 if integer else None if t.is_floating_point() else f64

    stacked = torch.stack([t.to(device, kind(t), non_blocking=True) for t in tensors])
    return _tensor_counts(name, stacked, 1)


def _traced(tensors: Tensors) -> bool:
    """Whether the open step's scale_loss() runs compiled, counting on the device."""
    return tensors is not None and tensors.cursor is not None


def _losses(loss: object, terms_: tuple[Term, ...], caller: str) -> tuple[torch.Tensor, ...]:
    """The losses of a microbatch, one per term, in the terms' order, each checked."""
    if len(terms_) == 1 and not isinstance(loss, dict):  # a one-term dict is taken too
        _check_loss(loss, caller)
        return (loss,)  # type: ignore[return-value]
    names = [term.name for term in terms_]
    if not isinstance(loss, Mapping) or set(loss) != set(names):
        given = f"losses for {sorted(loss)}" if isinstance(loss, Mapping) else "one loss"
        example = "{" + ", ".join(f"{name!r}: {name}_loss" for name in names) + "}"
        raise error("loss_names", caller=caller, given=given, names=names, example=example)
    losses = tuple(loss[name] for name in names)
    for value in losses:
        _check_loss(value, caller)
    return losses


def _shape_inference(losses: tuple[torch.Tensor, ...], pipelined: bool) -> torch.Tensor | None:
    """Where torch.distributed.pipelining calls the loss function to infer a stage's shapes
    (never inside a compiled graph, which cannot walk the stack): the losses, unscaled, since
    no microbatch of the step is taken; an error if the Accumulator was not told of the
    pipeline, whose step would otherwise count a microbatch twice."""
    if "torch.distributed.pipelining" not in sys.modules or torch.compiler.is_compiling():
        return None
    if (inferring := _torch.inferring_pipeline_shapes()) and not pipelined:
        raise error("pipeline_unset")
    return sum(losses[1:], losses[0]) if inferring else None


def _check_max_grad_norm(value: object, tensors: Tensors, stages: int) -> None:
    """Before the step closes: a clip that would fail must leave the step open."""
    if not terms.finite(value) or not value > 0:  # type: ignore[operator]
        raise error("bad_max_grad_norm", value=value)
    if stages > 1:
        raise error("clip_pipeline", value=value)
    if isinstance(tensors, CountFirst):
        raise error("clip_count_first", value=value)
    if tensors is not None and any(
        p.grad is not None and p.grad.is_sparse for p in tensors.parameters
    ):
        raise error("clip_sparse", value=value)


def _check_loss(loss: object, caller: str) -> None:
    if not isinstance(loss, torch.Tensor):
        raise error("loss_type", caller=caller, value=loss)
    if loss.dim() != 0:
        raise error("loss_shape", caller=caller, shape=tuple(loss.shape))
    if not loss.is_floating_point():
        raise error("loss_dtype", caller=caller, dtype=loss.dtype)


def _parameter_list(parameters: object) -> list[torch.Tensor]:
    """Scale-after parameters, each once (a tied weight listed twice would be rescaled twice):
    tensors, (name, tensor) pairs, a module's, or an optimizer's (all its groups)."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.optim.Optimizer):
        parameters = [p for group in parameters.param_groups for p in group["params"]]
    if isinstance(parameters, torch.Tensor) or not isinstance(parameters, Iterable):
        shown = repr(parameters)
        if isinstance(parameters, torch.Tensor):
            shown = f"a tensor of shape {tuple(parameters.shape)}"
        raise error("parameters_type", shown=shown)
    found: dict[int, torch.Tensor] = {}
    for index, item in enumerate(parameters):
        if isinstance(item, torch.nn.Module):  # several modules: a rank's pipeline stages
            found.update((id(p), p) for p in item.parameters())
            continue
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
        if not isinstance(tensor, torch.Tensor):
            raise error("parameter_type", index=index, value=item)
        if torch.nn.parameter.is_lazy(tensor):
            raise error("parameter_uninitialized", index=index)
        found.setdefault(id(tensor), tensor)
    if not found:
        raise error("no_parameters")
    return list(found.values())


def _saved(options: Options) -> dict[str, Any]:
    """The options a state is saved with, as plain values."""
    saved = {name: getattr(options, name) for name in terms.OPTIONS}
    saved["terms"] = [[term.name, term.loss_reduction, term.weight_by] for term in options.terms]
    return saved


def _checked_state(state_dict: object, options: Options) -> tuple[int, float]:
    expected = {"format", "steps", "weight_estimate", "options"}
    if not isinstance(state_dict, dict) or set(state_dict) != expected:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else state_dict
        raise error("state_keys", keys=keys, expected=sorted(expected))
    if state_dict["format"] != _STATE_FORMAT:
        raise error("state_format", value=state_dict["format"], format=_STATE_FORMAT)
    if not isinstance(saved := state_dict["options"], dict):
        raise error("state_options", value=saved)
    # The saved estimate of W counts the items of weight_by; the rest is configuration, which
    # a resumed run may change.
    if (weight_by := saved.get("weight_by")) != options.weight_by:
        raise error("state_option", name="weight_by", saved=weight_by, value=options.weight_by)
    if (steps := terms.natural(state_dict["steps"])) is None:
        raise error("state_steps", value=state_dict["steps"])
    if not terms.finite(estimate := state_dict["weight_estimate"]) or estimate < 0:
        raise error("state_estimate", value=estimate)
    return steps, float(estimate)
