"""The step machine alone, without torch: hypothesis drives every transition against an exact
model of the rules, as tests/test_state_machine.py drives the Accumulator.

The pure modules (machine.py, and the terms.py, weighting.py and errors.py it imports) are
loaded as a package of their own, without lossweight's ``__init__``, and a subprocess shows
that they import with torch made unimportable. Every call is drawn in every state, so most
draws are misuses: the model says which coded error each must raise, and a call that raises
must leave the state as it was (states are frozen values, so the old one is still at hand).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from .pure import load_pure

PURE_MODULES = load_pure()
machine = PURE_MODULES["machine"]
errors = PURE_MODULES["errors"]
terms = PURE_MODULES["terms"]
COUNTS = ("samples", "tokens", "weight_sum")


def test_the_pure_modules_import_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any import of torch now fails\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from pure import load_pure\n"
        "m = load_pure()['machine']\n"
        "t = load_pure()['terms']\n"
        "options = t.Options((t.Term('loss', 'mean'),))\n"
        "s = m.begin(m.State(), options, {'tokens': 1}, parameters=False)\n"
        "s, index = m.scale(s, (False, False), traced=False)\n"
        "assert index == 0 and m.end(s, traced=False)[0].step is None\n"
        "assert not any(name.startswith('torch') for name in sys.modules if sys.modules[name])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def matches(code: str, exception: BaseException) -> bool:
    """Whether ``exception`` is the coded error ``code``: its type, and its message the code's
    template with any values in the fields."""
    kind, template = errors.MESSAGES[code]
    pieces = re.split(r"\{[^}]*\}", template)
    pattern = ".*?".join(re.escape(piece) for piece in pieces)
    return type(exception) is kind and re.fullmatch(pattern, str(exception), re.S) is not None


@dataclass
class OpenStep:
    """The model of an open step."""

    index: int
    count_first: bool
    declared: int
    scaled: int = 0  # eager scale_loss() calls
    factored: set[int] = field(default_factory=set)
    recorded: set[int] = field(default_factory=set)
    given: tuple[bool, ...] | None = None
    traced: bool = False
    loss: bool = True  # False: a pipeline stage before the last, which computes no loss


GIVEN = st.tuples(st.booleans(), st.booleans(), st.booleans())  # samples, tokens, weight_sum
# begin()'s counts: how many microbatches each count given has, None where one is not given.
LENGTHS = st.fixed_dictionaries({c: st.one_of(st.none(), st.integers(0, 4)) for c in COUNTS})
INDICES = st.one_of(st.integers(-1, 5), st.sampled_from([None, True, 2.0, "1"]))


class MachineModel(RuleBasedStateMachine):
    @initialize(
        weight_by=st.sampled_from(["tokens", "samples", "weight_sum"]), logging=st.booleans()
    )
    def setup(self, weight_by: str, logging: bool) -> None:
        self.weight, self.weight_by = COUNTS.index(weight_by), weight_by
        self.logging = "next_step" if logging else "end"
        self.term_sets = [  # one term; terms of one count; of several counts or a constant
            (terms.Term("loss", "mean", weight_by),),
            (terms.Term("lm", "sum", weight_by), terms.Term("aux", "mean", weight_by)),
            (terms.Term("lm", "mean", weight_by), terms.Term("aux", "mean", "samples")),
            (terms.Term("lm", "sum", weight_by), terms.Term("kl", "sum", 4096)),
        ]
        self.state = machine.State(weight_by, self.logging)
        self.steps = 0
        self.step: OpenStep | None = None
        self.pending = False

    def apply(self, expected: str | None, call: object) -> object:
        """Run ``call``; it raises the error ``expected``, leaving the state alone, or it
        succeeds (``expected`` None) and returns its outcome."""
        before = self.state
        if expected is None:
            return call()  # type: ignore[operator]
        with pytest.raises(Exception) as raised:
            call()  # type: ignore[operator]
        assert matches(expected, raised.value), (expected, raised.value)
        assert self.state is before
        return None

    def closed_error(self) -> str | None:
        return "no_step" if self.step is None else None

    @rule(data=st.data(), lengths=LENGTHS, parameters=st.booleans(), loss=st.booleans())
    def begin(
        self, data: st.DataObject, lengths: dict[str, int | None], parameters: bool, loss: bool
    ) -> None:
        options = terms.Options(data.draw(st.sampled_from(self.term_sets)), "mean", self.logging)
        needed = {t.count for t in options.terms} - {None}
        given = {name: size for name, size in lengths.items() if size is not None}
        count_first, declared = bool(given), next(iter(given.values()), 0)
        error = "step_open" if self.step is not None else None
        if error is None and not given:
            rescalable = all(term.count == self.weight_by for term in options.terms)
            error = None if not parameters else None if rescalable else "scale_after_terms"
            error = "neither" if not parameters else error
        elif error is None:
            error = "counts_and_parameters" if parameters else None
            error = error or ("weight_missing" if needed - set(given) else None)
            error = error or ("lengths_differ" if len(set(given.values())) > 1 else None)
        state = self.apply(
            error, lambda: machine.begin(self.state, options, lengths, parameters, None, loss)
        )
        if error is None:
            self.state, self.steps = state, self.steps + 1
            declared = declared if count_first else 0
            self.step = OpenStep(self.steps, count_first, declared, loss=loss)
            self.pending = self.pending and not count_first

    @rule(given=GIVEN, traced=st.booleans())
    def scale(self, given: tuple[bool, ...], traced: bool) -> None:
        step = self.step
        traced = (
            traced and step is not None and step.count_first and (step.traced or not step.scaled)
        )
        if step is None:
            error: str | None = "no_step"
        elif not step.loss:
            error = "not_the_loss_stage"
        elif not step.count_first:
            error = "weight_missing_here" if not given[self.weight] else None
            if error is None and step.given is not None and given != step.given:
                error = "counts_differ"
        elif traced:  # counts given are checked by the Accumulator against begin()'s
            error = None
        elif step.scaled >= step.declared:
            error = "too_many"
        elif step.scaled in step.recorded:
            error = "loss_twice"
        else:
            error = None
        outcome = self.apply(error, lambda: machine.scale(self.state, given, traced))
        if error is None:
            assert step is not None
            self.state, index = outcome  # type: ignore[misc]
            if not step.count_first:
                step.scaled, step.given = step.scaled + 1, given
                assert index is None
            elif traced:
                step.traced = True
                assert index is None
            else:
                assert index == step.scaled
                step.scaled += 1

    @rule()
    def trace(self) -> None:
        step = self.step
        error = "not_the_loss_stage" if step is not None and not step.loss else self.closed_error()
        start = self.apply(error, lambda: machine.trace(self.state))
        assert start == (None if error is not None or step is None else step.scaled)

    @rule(microbatch=INDICES)
    def factor(self, microbatch: object) -> None:
        step, traced = self.step, self.step is not None and self.step.traced
        error = self._count_first_error("backward_scale")
        if error is None and step is not None:
            if microbatch is None:
                error = "no_next" if not traced and step.scaled >= step.declared else None
            elif not self._valid(microbatch, step):
                error = "bad_microbatch"
        outcome = self.apply(error, lambda: machine.factor(self.state, microbatch, traced))
        if error is None:
            assert step is not None
            self.state, index = outcome  # type: ignore[misc]
            if microbatch is None:
                assert index == (None if traced else step.scaled)
            else:
                assert index == microbatch
                step.factored.add(index)

    @rule(microbatch=INDICES)
    def record(self, microbatch: object) -> None:
        step = self.step
        error = self._count_first_error("record_loss")
        if error is None and step is not None:
            if not self._valid(microbatch, step):
                error = "bad_microbatch"
            elif microbatch not in step.factored:
                error = "loss_unfactored"
            elif microbatch < step.scaled or microbatch in step.recorded:  # type: ignore[operator]
                error = "loss_twice"
        outcome = self.apply(error, lambda: machine.record(self.state, microbatch))
        if error is None:
            assert step is not None
            self.state, index = outcome  # type: ignore[misc]
            assert index == microbatch
            step.recorded.add(index)

    @rule()
    def end(self) -> None:
        # end() closes the step and returns what it refuses (a declared microbatch that no
        # loss took), which the Accumulator carries to every rank or raises.
        step, refused = self.step, None
        if step is not None and step.count_first and step.loss and not step.traced:
            taken = set(range(step.scaled)) | (step.recorded if step.scaled else step.factored)
            refused = "too_few" if not taken >= set(range(step.declared)) else None
        traced = step is not None and step.traced
        outcome = self.apply(self.closed_error(), lambda: machine.end(self.state, traced))
        if step is not None:
            self.state, refusal = outcome  # type: ignore[misc]
            assert (refusal is None) if refused is None else matches(refused, refusal)
            self.step = None
            self.pending = step.count_first and self.logging == "next_step"

    @rule()
    def abandon(self) -> None:
        # A count-first step abandoned under next_step: a rank that ended it holds its loss, so
        # flush() makes a reduction on every rank.
        step = self.step
        self.pending |= step is not None and step.count_first and self.logging == "next_step"
        self.state, self.step = machine.abandon(self.state), None

    @rule()
    def flush(self) -> None:
        error = "step_open" if self.step is not None else None
        outcome = self.apply(error, lambda: machine.flush(self.state))
        if error is None:
            self.state, waited = outcome  # type: ignore[misc]
            assert waited == self.pending
            self.pending = False

    @rule(steps=st.integers(0, 10))
    def load(self, steps: int) -> None:
        error = "step_open" if self.step is not None else None
        state = self.apply(error, lambda: machine.load(self.state, steps))
        if error is None:
            self.state, self.steps, self.pending = state, steps, False

    @rule(caller=st.sampled_from(["state_dict", "load_state_dict", "flush", "begin"]))
    def idle(self, caller: str) -> None:
        error = "step_open" if self.step is not None else None
        self.apply(error, lambda: machine.idle(self.state, caller))

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "state"):
            return
        state, model = self.state, self.step
        assert (state.steps, state.pending) == (self.steps, self.pending)
        if model is None:
            assert state.step is None
            return
        step = state.step
        assert step is not None and step.number == model.index
        assert step.mode == (machine.COUNT_FIRST if model.count_first else machine.SCALE_AFTER)
        assert (step.declared, step.scaled, step.given) == (
            model.declared,
            model.scaled,
            model.given,
        )
        assert (set(step.factored), set(step.recorded)) == (model.factored, model.recorded)
        unknown = sorted(i for i in model.factored - model.recorded if i >= model.scaled)
        assert step.unrecorded == unknown
        with pytest.raises(AttributeError):  # a frozen value
            step.scaled = 99  # type: ignore[misc]

    def _count_first_error(self, caller: str) -> str | None:
        if self.step is None:
            return "no_step"
        if not self.step.loss:
            return "not_the_loss_stage"
        return None if self.step.count_first else "scale_after_factor"

    @staticmethod
    def _valid(microbatch: object, step: OpenStep) -> bool:
        return type(microbatch) is int and 0 <= microbatch < step.declared


TestMachine = MachineModel.TestCase
TestMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
