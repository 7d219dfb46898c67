"""docs/errors.md, row by row: each input raises the listed error with the listed message."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

import lossweight
import lossweight.compiled
import lossweight.integrations.accelerate
import lossweight.integrations.deepspeed
import lossweight.integrations.hf
import lossweight.integrations.lightning
import lossweight.integrations.trl
import lossweight.parallel
import lossweight.testing

from .torch_range import COMPILED_CHECKS, COMPILED_CHECKS_REASON, needs_compiled_checks

# The modules that add their rows to the one table when imported, all imported above: the
# table read below holds every row.
try:  # Composer pins torch < 2.7.1: installed only in the second environment (.ci/torch-range)
    import lossweight.integrations.composer as composer_rows
except ImportError:
    composer_rows = None
ROW_MODULES = (
    *([composer_rows] if composer_rows is not None else []),
    lossweight.compiled,
    lossweight.counting,
    lossweight.parallel,
    lossweight.testing,
    lossweight.integrations.accelerate,
    lossweight.integrations.lightning,
    lossweight.integrations.deepspeed,
    lossweight.integrations.hf,
    lossweight.integrations.trl,
)
PAGE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"
SETUP = re.search(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.M | re.S)
ROW = re.compile(r"^\| `(?P<code>[^|]+)` \| `(?P<error>\w+)` `(?P<message>[^|]+)` \| [^|]+ \|$")
ROWS = [match.groupdict() for match in map(ROW.match, PAGE.read_text().splitlines()) if match]
ERRORS = {
    "TypeError": TypeError,
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
    "DisagreementError": lossweight.DisagreementError,
    "AssertionError": AssertionError,
}


def test_the_table_covers_the_errors() -> None:
    assert SETUP is not None
    assert len(ROWS) >= 40
    assert len({row["code"] for row in ROWS}) == len(ROWS)  # no row twice
    table_lines = [line for line in PAGE.read_text().splitlines() if line.startswith("| `")]
    assert len(table_lines) == len(ROWS)  # every row of the tables parses


@pytest.mark.parametrize("row", ROWS, ids=[row["code"] for row in ROWS])
def test_row(row: dict[str, str]) -> None:
    assert SETUP is not None
    if "torch.compile" in row["code"] and not COMPILED_CHECKS:
        pytest.skip(COMPILED_CHECKS_REASON)
    namespace: dict[str, object] = {"__name__": "errors_page"}
    exec(SETUP.group(1), namespace)
    with pytest.raises(ERRORS[row["error"]]) as raised:
        exec(row["code"], namespace)
    assert type(raised.value) is ERRORS[row["error"]]
    assert row["message"] in str(raised.value)


# Codes that no row of the page raises, each with the test that asserts its message: that test's
# file and a fragment of the message it asserts (test_every_code_without_a_row_has_a_test checks
# both). A row is one line in one process: these need ranks that disagree, a mesh of processes,
# two accelerators, a compiled graph, a torch without graph asserts, or a failure inside
# InProcessGroup.run(), which raises the first rank's error, not the one its peers then see.
ELSEWHERE: dict[str, tuple[str, str]] = {
    "cannot_be_reduced": ("test_faults.py", "lossweight step "),
    "differ_step": ("test_faults.py", "this rank is at step"),
    "differ_call": ("test_faults.py", "this rank reduces for"),
    "differ_mode": ("test_faults.py", "call begin(parameters=...) and end() as the other ranks do"),
    "differ_choice": ("test_faults.py", "% of the ranks have"),
    "differ_terms": ("test_declarations.py", "the ranks differ in their loss terms"),
    "differ_divisor": ("test_device_checks.py", "the ranks differ in grad_reduction"),
    "differ_carried": ("test_faults.py", "% of the ranks' reductions carry the loss"),
    "differ_estimate": ("test_faults.py", "the ranks differ in the estimate of W"),
    "differ_clip": ("test_faults.py", "the ranks differ in end(max_grad_norm=...)"),
    "other_thread": ("test_hardening.py", "another thread was inside a call"),
    "group_destroyed": (
        "test_faults.py",
        "was destroyed (torch.distributed.destroy_process_group())",
    ),
    "pending_elsewhere": (
        "test_faults.py",
        "call flush() on every rank before tearing a process group down",
    ),
    "disagree": ("test_integrations.py", "the data-parallel ranks disagree on"),
    "devices_differ": ("test_errors.py", "are on different devices"),
    "graph_asserts": ("test_compile.py", "inside torch.compile needs torch 2.9"),
    "mesh_unnamed": ("test_mesh.py", "of several dimensions without names"),
    "mesh_model_parallel": ("test_mesh.py", "whose ranks hold the same data"),
    "not_copied": ("test_vendoring.py", "which this copy of lossweight leaves out"),
    "mesh_partial": ("test_mesh.py", "holds part of a dimension of its root mesh"),
    "not_the_loss_stage": ("test_mesh.py", "whose pipeline stage is not the last one"),
    "clip_pipeline": ("test_mesh.py", "under pipeline= each stage holds a part of the model"),
    "pipeline_unset": ("test_mesh.py", "to infer a stage's shapes"),
    "peers_differ": ("test_mesh.py", "which group= does not span, gave different counts"),
    "peer_refused": ("test_device_checks.py", "ranks of the reduction refused to end this step"),
    "fsdp_unsharded": ("test_fsdp_given.py", "while it was unsharded"),
    "fsdp_held": ("test_fsdp_given.py", "FSDP2 (fully_shard) holds gradients"),
    "split_ranks": ("test_testing.py", "which are the ranks of every split"),
    "checks_differ": ("test_testing.py", "called assert_split_invariant with other"),
    "context_parallel_processes": ("test_testing.py", "simulates ranks in one process"),
    "reduce_abandoned": ("test_testing.py", "was abandoned when a run of this group failed"),
    "rank_failed": ("test_testing.py", "abandoned: another rank failed"),
    "reduce_timed_out": ("test_testing.py", "did not start it within"),
    "accelerate_deepspeed": (
        "test_integration_misuse.py",
        "under DeepSpeed, accelerator.backward() steps the optimizer",
    ),
    "accelerate_backward_missing": (
        "test_integration_misuse.py",
        "losses that scale_loss() returned",
    ),
    "accelerate_no_model": (
        "test_integration_misuse.py",
        "AcceleratorAccumulator needs the prepared model",
    ),
    "accelerate_window_changed": (
        "test_integration_misuse.py",
        "AcceleratorAccumulator after changing it",
    ),
    "accelerate_world": ("test_integration_misuse.py", "Accelerator's data-parallel world"),
    "accelerate_unended": (
        "test_integration_misuse.py",
        "end_if_sync() was not called to rescale them",
    ),
    "lightning_not_backpropagated": (
        "test_integration_misuse.py",
        "a loss scaled and not back-propagated counts in the step's weights",
    ),
    "lightning_unweighted_backward": (
        "test_integration_misuse.py",
        "return the callback's scale_loss(loss, ",
    ),
    "deepspeed_engine_decides": ("test_deepspeed.py", "which the engine decides"),
    "deepspeed_stranded": ("test_deepspeed.py", "keeps that step's partial gradients"),
    "deepspeed_window_changed": (
        "test_deepspeed.py",
        "the engine's gradient accumulation steps changed",
    ),
    "deepspeed_scale_after": ("test_deepspeed.py", "moves the gradients into its partitions"),
    "deepspeed_compiled": ("test_deepspeed.py", "runs eagerly"),
    "deepspeed_uneven": ("test_deepspeed.py", " ranks declared "),
    "deepspeed_updated_within": ("test_deepspeed.py", "DeepSpeed updated the parameters during"),
    "deepspeed_boundary_early": ("test_deepspeed.py", "makes microbatch "),
    "deepspeed_boundary_missed": ("test_deepspeed.py", "does not make the step's last microbatch"),
    "deepspeed_after_boundary": ("test_deepspeed.py", "was DeepSpeed's accumulation boundary"),
    "deepspeed_before_boundary": (
        "test_deepspeed.py",
        "came before DeepSpeed's gradient accumulation",
    ),
    "deepspeed_ended_after_step": ("test_deepspeed.py", "came after the engine.step() that"),
    "deepspeed_unscaled_backward": ("test_deepspeed.py", "scale_wrt_gas=False) in step "),
    "hf_transformers_too_old": (
        "test_integrations.py",
        "needs a transformers whose Trainer has the",
    ),
    "hf_outside_step": ("test_integrations.py", "training_step() ran outside a step"),
    "hf_not_scaled": (
        "test_integration_misuse.py",
        "call super().compute_loss(model, inputs, ...)",
    ),
    "hf_batch_type": ("test_integrations.py", "counts the rows and labels of dict batches"),
    "hf_shift_unknown": ("test_integration_misuse.py", "cannot tell whether the loss of "),
    "hf_batch_uncounted": ("test_integrations.py", "and a batch of this step has none"),
    "hf_data_parallel": (
        "test_integrations.py",
        "LossweightTrainer does not support nn.DataParallel",
    ),
    "hf_model_parallel": ("test_integrations.py", "LossweightTrainer weights over the whole world"),
    "trl_microbatches_left": ("test_trl.py", "stopped before its last microbatch"),
    "trl_loss_type_changed": ("test_trl.py", "loss_type is "),
    "trl_kl_added": ("test_trl.py", "beta is "),
    "trl_entropy_changed": ("test_trl.py", "entropy_coef is "),
    "trl_compute_loss": ("test_trl.py", "overrides _compute_loss"),
    "trl_bnpo": ("test_trl.py", "loss_type='dapo' is the same loss normalised by the whole step"),
    "trl_loss_type": ("test_trl.py", "does not support loss_type="),
    "trl_importance_sampling": ("test_trl.py", "pass 'token' or 'sequence'"),
    "trl_unsupported": ("test_trl.py", " in the GRPOConfig"),
    "trl_generation_steps": ("test_trl.py", "to be a multiple of gradient_accumulation_steps"),
    "code_taken": ("test_error_table.py", "have other rows in lossweight.errors.MESSAGES already"),
}

# Codes that only a platform the suite cannot run raises, with that platform.
ONLY_ON_A_PLATFORM = {"hf_sagemaker": "SageMaker's model parallelism (smdistributed)"}
if composer_rows is not None:  # the second environment: Composer's codes join the table
    ELSEWHERE["composer_unweighted_backward"] = ("test_composer.py", "from the model's loss()")
    ONLY_ON_A_PLATFORM["composer_amp_fp16"] = "a GPU: Composer refuses amp_fp16 on the CPU"
    ONLY_ON_A_PLATFORM["composer_changed"] = "a Composer other than the one the extra pins"
    # Not yet raised by a test: the callback's scale_loss() outside a batch, and a loss it
    # returned that no backward went through.
    ONLY_ON_A_PLATFORM["composer_outside_batch"] = "untested"
    ONLY_ON_A_PLATFORM["composer_not_backpropagated"] = "untested"


def code_of(exception: BaseException) -> set[str]:
    """The codes of the table whose template, its fields filled with anything, is the message."""
    found = set()
    for code, (kind, template) in lossweight.errors.MESSAGES.items():
        pattern = ".*?".join(map(re.escape, re.split(r"\{[^}]*\}", template)))
        if type(exception) is kind and re.fullmatch(pattern, str(exception), re.S):
            found.add(code)
    return found


@needs_compiled_checks  # some rows compile scale_loss()
def test_every_code_of_the_table_has_a_row() -> None:
    assert SETUP is not None
    raised: set[str] = set()
    for row in ROWS:
        namespace: dict[str, object] = {"__name__": "errors_page"}
        exec(SETUP.group(1), namespace)
        with pytest.raises(Exception) as info:
            exec(row["code"], namespace)
        codes = code_of(info.value)
        assert codes, f"{row['code']} raised {info.value!r}, which no code of the table makes"
        raised |= codes
    missing = set(lossweight.errors.MESSAGES) - raised - set(ELSEWHERE) - set(ONLY_ON_A_PLATFORM)
    assert not missing, f"codes without a row in docs/errors.md: {sorted(missing)}"
    assert not raised & set(ELSEWHERE), "a code with a row needs no other test"


@pytest.mark.parametrize("code", ELSEWHERE)
def test_every_code_without_a_row_has_a_test(code: str) -> None:
    test_file, fragment = ELSEWHERE[code]
    templates = {c: template for c, (_, template) in lossweight.errors.MESSAGES.items()}
    # A fragment of this message's fixed words, and of no other message's.
    assert any(fragment in words for words in re.split(r"\{[^}]*\}", templates[code]))
    assert [c for c, template in templates.items() if fragment in template] == [code]
    assert fragment in (PAGE.parent.parent / "tests" / test_file).read_text()


# Every exception the package raises takes its message from the table. Walking each raise:
# - `raise error(code, ...)` makes a new exception from the table;
# - a bare `raise`, and `raise name` (or `raise self.attribute`, `raise errors[0]`), raise again
#   an exception that was made before: caught from a call, or kept to raise at every later use;
#   the rule below checks where those were made;
# - `raise X(...)` or `raise X` with X an exception class words its own message: refused.
# `from` changes none of that: `raise ValueError("...") from e` is a new message too.
# Building an exception by hand anywhere (returned, stored, then raised) is refused as well, and
# the text of a check that runs on a device (the message given to assert_true, untraced or
# check_zero_gradients) must come from device_message(), directly or through a variable.
PACKAGE = PAGE.parent.parent / "lossweight"
EXCEPTIONS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
} | {"DisagreementError"}
# The message's place among the arguments of each call that checks on a device.
DEVICE_CHECKS = {"assert_true": 1, "_assert_async": 1, "untraced": 0, "check_zero_gradients": 1}
TABLE_CALLS = {"error", "device_message"}


def _called(node: ast.AST) -> str | None:
    """The name a call calls: f for f(...), and m.f(...) alike."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _worded_here(node: ast.AST, assigned: dict[str, list[ast.AST]], seen: set[str]) -> bool:
    """Whether ``node`` builds text of its own (a string literal or an f-string) outside
    device_message(); a name counts as every value assigned to it in the module."""
    if _called(node) == "device_message":
        return False
    if isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    ):
        return True
    if isinstance(node, ast.Name) and node.id not in seen:
        seen.add(node.id)
        return any(_worded_here(value, assigned, seen) for value in assigned.get(node.id, []))
    return any(_worded_here(child, assigned, seen) for child in ast.iter_child_nodes(node))


def _inline_messages(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    assigned: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
    found = []
    raised = {id(node.exc) for node in ast.walk(tree) if isinstance(node, ast.Raise)}
    for node in ast.walk(tree):
        where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc
            if not (
                _called(exc) in TABLE_CALLS
                or (
                    isinstance(exc, ast.Name | ast.Attribute | ast.Subscript)
                    and getattr(exc, "id", getattr(exc, "attr", None)) not in EXCEPTIONS
                )
            ):
                found.append(f"{where}: raise {ast.unparse(exc)[:70]}")
        elif _called(node) in EXCEPTIONS and id(node) not in raised:
            found.append(f"{where}: {ast.unparse(node)[:70]}")
        elif isinstance(node, ast.Call) and _called(node) in DEVICE_CHECKS:
            place = DEVICE_CHECKS[_called(node) or ""]
            given = [*node.args[place : place + 1], *(k.value for k in node.keywords)]
            if any(_worded_here(message, assigned, set()) for message in given):
                found.append(f"{where}: {ast.unparse(node)[:70]}")
    return found


def _codes_used(path: Path) -> set[str]:
    return {
        node.args[0].value
        for node in ast.walk(ast.parse(path.read_text()))
        if _called(node) in TABLE_CALLS
        and isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


MODULES = sorted(PACKAGE.rglob("*.py"))
# A module whose framework is not installed adds no rows here: its raises are walked, not
# matched to the table.
UNIMPORTED = [] if composer_rows is not None else [PACKAGE / "integrations" / "composer.py"]


def test_every_raise_of_the_package_takes_its_message_from_the_table() -> None:
    assert len(MODULES) > 20
    inline = [found for path in MODULES for found in _inline_messages(path)]
    assert not inline, "messages worded outside lossweight.errors.MESSAGES:\n" + "\n".join(inline)


def test_every_code_of_the_table_is_raised_somewhere() -> None:
    used = set().union(*map(_codes_used, set(MODULES) - set(UNIMPORTED)))
    assert used <= set(lossweight.errors.MESSAGES), sorted(used - set(lossweight.errors.MESSAGES))
    unused = set(lossweight.errors.MESSAGES) - used
    assert not unused, f"codes of the table that nothing raises: {sorted(unused)}"


def _core_codes() -> set[str]:
    """The codes of the rows errors.py holds itself: the core's."""
    tree = ast.parse((PACKAGE / "errors.py").read_text())
    (table,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "MESSAGES"
    ]
    assert isinstance(table, ast.Dict)
    return {key.value for key in table.keys if isinstance(key, ast.Constant)}


def test_each_module_raises_the_core_s_codes_or_its_own() -> None:
    # An optional module's rows join the table when it is imported, so a code it raises is
    # the core's, its own, or its package's: no error can come before its row is there.
    adding = {
        path
        for path in set(MODULES) - set(UNIMPORTED)
        if any(_called(node) == "add_messages" for node in ast.walk(ast.parse(path.read_text())))
    }
    owned = {Path(str(module.__file__)): set(module._MESSAGES) for module in ROW_MODULES}
    assert set(owned) == adding, "a module that adds rows is missing from ROW_MODULES"
    core = _core_codes()
    assert sum(map(len, owned.values())) + len(core) == len(lossweight.errors.MESSAGES)
    for path in set(MODULES) - set(UNIMPORTED):
        own = set().union(*(owned.get(folder / "__init__.py", set()) for folder in path.parents))
        own |= owned.get(path, set())
        foreign = _codes_used(path) - core - own
        assert not foreign, f"{path.name} raises codes of another module's rows: {foreign}"


def test_a_module_cannot_take_a_code_of_the_table() -> None:
    before = dict(lossweight.errors.MESSAGES)
    lossweight.errors.add_messages({"bad_option": before["bad_option"]})  # imported again
    with pytest.raises(
        ValueError,
        match=r"the codes \['bad_option'\] have other rows in lossweight.errors.MESSAGES already",
    ):
        lossweight.errors.add_messages(
            {"bad_option": (ValueError, "{name}"), "a_new_code": (ValueError, "new")}
        )
    assert before == lossweight.errors.MESSAGES
