"""The framework integrations on real gloo ranks: Hugging Face Trainer, accelerate, Lightning.

Each framework runs once on 2 processes (tests/gloo.py), every configuration of it in the same
launch (tests/integration_workers.py): rank 1 holds few tokens and a microbatch without any
target, and the padding is uneven. The gradient just before each optimizer step must equal the
single-process fp64 full-batch gradient, and the logged loss the full-batch loss, on every
rank; the framework's own weighting on the same data is checked to be visibly off, so that the
data do tell right from wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from . import integration_workers as workers
from .gloo import run_ranks, values
from .torch_range import COMPILED_CHECKS, COMPILED_CHECKS_REASON, needs_compiled_checks

WORLD_SIZE = 2
EXACT = 1e-10  # fp64 end to end
# transformers' ForCausalLMLoss upcasts the logits to float32 (`logits.float()`), which turns an
# fp64 model's loss fp32: its gradient is then only as exact as float32 (about 1e-7).
FP32 = 1e-6
VISIBLY_OFF = 0.05


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def hf() -> list[dict]:
    # About 9 s on 2 cores (10 Trainer runs per rank); the deadline only stops a hang.
    with tempfile.TemporaryDirectory() as tmp:
        return values(run_ranks(WORLD_SIZE, workers.hf_run, tmp, deadline=150))


@pytest.fixture(scope="module")
def accelerate() -> list[dict]:
    return values(run_ranks(WORLD_SIZE, workers.accelerate_run, deadline=90))


@pytest.fixture(scope="module")
def lightning() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return values(run_ranks(WORLD_SIZE, workers.lightning_run, tmp, deadline=150))


# ------------------------------------------------------------------------------------------
# Hugging Face Trainer
# ------------------------------------------------------------------------------------------

HF_EXACT = [
    "llama/lossweight",
    "llama/lossweight-no-average",  # average_tokens_across_devices=False: HF alone is off
    "no-loss-kwargs/lossweight",  # forward takes no loss kwargs: HF alone is off
    "classifier/lossweight",  # weight_by="samples", uneven rows per microbatch
    "llama/lossweight-clipped",  # max_grad_norm: the Trainer clips the exact gradient
    # A causal LM whose class name is not one of transformers' loss types, and one held by a
    # wrapper: the shift is read from the loss function (counted unshifted, both were 0.67
    # off with a NaN logged loss).
    "subclass/lossweight",
    "wrapper/lossweight",
]
HF_ALONE_OFF = ["llama/plain-no-average", "no-loss-kwargs/plain", "classifier/plain"]


def test_hf_data_are_dealt_as_designed(hf: list[dict]) -> None:
    # Trainer's sequential sampler, sharded by accelerate, gives each rank the rows laid out
    # for it, so the conditions below hold on the ranks that ran.
    for rank, outcome in enumerate(hf):
        for name in workers.HF_CONFIGS:
            assert [where[1] for where, _ in outcome[name]["microbatches"]] == [rank] * 4
    shifted = [
        [[sum(max(n - 1, 0) for n in mb) for mb in rank] for rank in step]
        for step in workers.HF_LENGTHS
    ]
    assert shifted[0][1][1] == 0  # a microbatch without any target (2 tokens unshifted)
    assert sum(shifted[0][1]) * 5 < sum(shifted[0][0])  # a rank with few tokens
    # Uneven microbatches of samples: rows dropped by the collator.
    for rank, outcome in enumerate(hf):
        rows = [n for _, n in outcome["classifier/plain"]["microbatches"]]
        dropped = [
            sum((step, rank, mb, row) in workers.HF_DROPPED for row in range(workers.HF_ROWS))
            for step in range(workers.HF_STEPS)
            for mb in range(workers.HF_MICROBATCHES)
        ]
        assert rows == [workers.HF_ROWS - n for n in dropped] and 1 in rows


@pytest.mark.parametrize("name", HF_EXACT)
def test_hf_lossweight_gradient_and_loss_equal_the_full_batch(hf: list[dict], name: str) -> None:
    for outcome in hf:
        seen = outcome[name]
        assert max(seen["relative_errors"]) < EXACT, seen["relative_errors"]
        for logged, expected in zip(seen["logged_losses"], seen["expected_losses"], strict=True):
            assert relative(logged, expected) < 1e-12
        assert seen["logged_tokens"] == seen["expected_tokens"]
        assert seen["logged_samples"] == seen["expected_samples"]
        # Trainer's own running loss, which it keeps in float32, is the weighted mean too.
        mean = sum(seen["expected_losses"]) / len(seen["expected_losses"])
        assert relative(seen["train_loss"], mean) < FP32
    assert len({json.dumps(outcome[name]["logged_losses"]) for outcome in hf}) == 1


def test_hf_genuine_causal_lm_loss_at_float32_precision(hf: list[dict]) -> None:
    for outcome in hf:
        seen = outcome["llama-fp32-loss/lossweight"]
        assert max(seen["relative_errors"]) < FP32, seen["relative_errors"]
        for logged, expected in zip(seen["logged_losses"], seen["expected_losses"], strict=True):
            assert relative(logged, expected) < FP32
        assert seen["logged_tokens"] == seen["expected_tokens"]


@pytest.mark.parametrize("name", HF_ALONE_OFF)
def test_hf_alone_is_visibly_off_there(hf: list[dict], name: str) -> None:
    for outcome in hf:
        seen = outcome[name]
        assert max(seen["relative_errors"]) > VISIBLY_OFF, seen["relative_errors"]
        worst = max(map(relative, seen["logged_losses"], seen["expected_losses"]))
        assert worst > 1e-3


def test_hf_models_compute_in_float64_throughout(hf: list[dict]) -> None:
    # The premise of EXACT: float32 rounds differently with the tensor's shape and the CPU's
    # vector width, so a float32 step anywhere would make exactness depend on the machine.
    for outcome in hf:
        seen = outcome["float32_functions"]
        assert {name: seen[name] for name in ("llama", "no-loss-kwargs", "classifier")} == {
            "llama": [],
            "no-loss-kwargs": [],
            "classifier": [],
        }
        assert "float" in seen["llama-fp32-loss"]  # ForCausalLMLoss's upcast, seen


def test_hf_alone_is_exact_with_its_defaults(hf: list[dict]) -> None:
    # Trainer's own fix (a loss-kwargs model, average_tokens_across_devices=True) holds on the
    # same data: the reference is the notion Hugging Face itself aims at.
    for outcome in hf:
        assert max(outcome["llama/plain"]["relative_errors"]) < EXACT


def test_hf_evaluation_is_unchanged(hf: list[dict]) -> None:
    for outcome in hf:
        losses = outcome["eval_losses"]
        assert set(losses) == {"plain", "lossweight"}
        assert losses["lossweight"] == losses["plain"]


def test_hf_resumes_with_other_accumulation_steps() -> None:
    # Saved after a step of 2 microbatches, resumed with 4: the resumed Trainer's Accumulator
    # undoes the new number of accumulation steps, and every step is the full batch's.
    with tempfile.TemporaryDirectory() as tmp:
        (outcome,) = values(run_ranks(1, workers.hf_resume_run, tmp, deadline=120))
    saved, resumed = outcome["saved"], outcome["resumed"]
    assert [len(w) for w in saved["windows"]] == [2], outcome
    assert [len(w) for w in resumed["windows"]] == [4], outcome
    assert resumed["steps"][-1] == 2, outcome
    for phase in (saved, resumed):
        assert max(phase["relative_errors"]) < EXACT, outcome
        assert phase["logged_losses"] == pytest.approx(phase["expected_losses"], rel=1e-4)


def test_hf_refuses_what_it_cannot_count_or_weight_over() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (refused,) = values(run_ranks(1, workers.hf_refusals_run, tmp, init_group=False))
    assert refused["not_a_dict"] == (
        "TypeError: LossweightTrainer counts the rows and labels of dict batches, but the data "
        "collator returned a tuple; return a dict with 'labels' (and 'input_ids')"
    )
    assert refused["no_labels"] == (
        "ValueError: LossweightTrainer(weight_by='tokens') counts each batch from a 'labels' "
        "tensor, and a batch of this step has none; let the data collator return it"
    )
    assert refused["tensor_parallel"].startswith(
        "NotImplementedError: LossweightTrainer weights over the whole world, which is the "
        "data-parallel group only without tensor, context or sequence parallelism (here "
        "{'tp': 2, 'cp': 1, 'sp': 1}); use lossweight.Accumulator(group="
    )
    assert refused["data_parallel"].startswith(
        "ValueError: LossweightTrainer does not support nn.DataParallel (n_gpu=2): launch one "
        "process per device"
    )
    assert refused["outside_step"] == (
        "RuntimeError: Unscaled.training_step() ran outside a step: its steps begin before the "
        "first loss of each optimizer step, from Trainer.train()"
    )


def test_hf_refuses_a_trainer_that_would_divide_the_weighted_loss_again() -> None:
    code = (
        "import transformers\n"
        "del transformers.Trainer.loss_is_scaled_for_ga\n"
        "import lossweight.integrations.hf\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert (
        "ImportError: lossweight.integrations.hf needs a transformers whose Trainer has the "
        "loss_is_scaled_for_ga attribute (5.24 and later); upgrade transformers"
    ) in done.stderr, done.stderr


# ------------------------------------------------------------------------------------------
# accelerate and Lightning (tests/problem.py's fp64 model)
# ------------------------------------------------------------------------------------------


def test_loop_data_are_uneven_with_an_empty_microbatch() -> None:
    for step, window in enumerate(workers.LOOP_WINDOWS):
        tokens = [
            [int(mb.num_tokens) for mb in workers.loop_step(step, rank)[1]]
            for rank in range(WORLD_SIZE)
        ]
        assert [len(t) for t in tokens] == [window, window]
        assert window < workers.LOOP_MICROBATCHES or tokens[1][workers.LOOP_EMPTY[1]] == 0
        assert sum(tokens[1]) * 3 < sum(tokens[0])


def check_exact(steps: list[dict], count: int = workers.LOOP_STEPS) -> None:
    assert len(steps) == count
    for step in steps:
        assert step["relative_error"] < EXACT
        assert relative(step["loss"], step["expected_loss"]) < 1e-12
        assert step["tokens"] == step["expected_tokens"]


def check_visibly_off(steps: list[dict], count: int = workers.LOOP_STEPS) -> None:
    assert len(steps) == count
    assert max(step["relative_error"] for step in steps) > VISIBLY_OFF
    assert max(relative(step["loss"], step["expected_loss"]) for step in steps) > 1e-3


@pytest.mark.parametrize("mode", ["count_first", "scale_after"])
def test_accelerate_helper_is_exact(accelerate: list[dict], mode: str) -> None:
    # Every step, the short last one included: streaming, accelerate ends it at the end of
    # its prepared dataloader.
    for outcome in accelerate:
        check_exact(outcome[mode], workers.LOOP_STEPS)
        check_visibly_off(outcome["plain"], workers.LOOP_STEPS)  # accelerator.backward alone


def test_accelerate_helper_flushes_a_next_step_loss(accelerate: list[dict]) -> None:
    for outcome in accelerate:
        check_exact(outcome["next_step"], 1)


@pytest.mark.parametrize("optimization", ["automatic", "manual"])
def test_lightning_callback_is_exact(lightning: list[dict], optimization: str) -> None:
    for outcome in lightning:
        seen = outcome[f"{optimization}/lossweight"]
        check_exact(seen["steps"])
        # What every rank's logger got at each optimizer step.
        for logged, step in zip(seen["logged_at_steps"], seen["steps"], strict=True):
            assert relative(logged["train_loss"], step["expected_loss"]) < 1e-12
            assert logged["train_tokens"] == step["expected_tokens"]
        # Manual optimization logs after every batch, repeating the last step's values.
        assert set(seen["every_logged_loss"]) == {s["loss"] for s in seen["steps"]}

        plain = outcome[f"{optimization}/plain"]
        for step, logged in zip(plain["steps"], plain["logged_at_steps"], strict=True):
            step["loss"] = logged["train_loss"]  # the mean loss it logged, over ranks
        check_visibly_off(plain["steps"])


# ------------------------------------------------------------------------------------------


def test_import_lossweight_imports_no_framework() -> None:
    code = (
        "import sys, lossweight, lossweight.integrations; "
        "print([m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'trl') "
        "if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_lightning_follows_a_gradient_accumulation_scheduler() -> None:
    # In this process: one device, no process group. Epoch 0 accumulates 4 batches (then the
    # epoch's last 2), epoch 1 accumulates 2; Lightning divides by 4, then by 2.
    steps = workers.lightning_scheduled_run()
    assert [(epoch, size) for epoch, size, _ in steps] == [(0, 4), (0, 2), (1, 2), (1, 2), (1, 2)]
    assert max(error for _, _, error in steps) < EXACT


# ------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    # About 20 s on 2 cores, most of it inductor compiling two graphs on each rank.
    if not COMPILED_CHECKS:
        pytest.skip(COMPILED_CHECKS_REASON)
    return values(run_ranks(WORLD_SIZE, workers.compile_run, deadline=180))


def test_a_compiled_microbatch_function_has_no_graph_break(compiled: list[dict]) -> None:
    for outcome in compiled:
        first, *later = outcome["explained"]
        for explained in outcome["explained"]:
            assert (explained["graphs"], explained["breaks"]) == (1, 0), explained["reasons"]
            assert "all_reduce" not in explained["code"]  # begin() started it, eagerly
        # The first microbatch waits for the count reduction inside the graph; the others
        # use its factors.
        assert "wait_tensor" in first["code"]
        assert all("wait_tensor" not in explained["code"] for explained in later)


def test_a_compiled_microbatch_function_gives_the_full_batch_gradient(
    compiled: list[dict],
) -> None:
    for outcome in compiled:
        for steps in outcome["passes"]:
            check_exact(steps)
        # Per step, one all-reduce from begin() and one from end() for the loss.
        per_step = {"begin": {"all_reduce": 1}, "end": {"all_reduce": 1}}
        assert outcome["collectives"] == [per_step] * (2 * workers.LOOP_STEPS)


def test_a_compiled_microbatch_function_compiles_a_bounded_number_of_graphs(
    compiled: list[dict],
) -> None:
    # Two graphs: a step's first microbatch (which waits for the counts) and every later one,
    # whatever its index and counts; the short last step (2 microbatches, not 4) makes dynamo
    # compile both once more with the number of microbatches symbolic. Running the same steps
    # again (18 microbatch calls in all) compiles nothing.
    for outcome in compiled:
        assert outcome["compiled_graphs"] == [4, 4]


def test_ranks_that_disagree_fail_inside_the_compiled_graph(compiled: list[dict]) -> None:
    for outcome in compiled:
        assert outcome["disagreement"] is not None
        assert "the data-parallel ranks disagree on grad_reduction" in outcome["disagreement"]


ACCELERATE_COMPILED = """
import torch
from accelerate import Accelerator

from lossweight.integrations.accelerate import AcceleratorAccumulator

torch.manual_seed(0)
accelerator = Accelerator(gradient_accumulation_steps=3, cpu=True)
model, optimizer = accelerator.prepare(
    torch.nn.Linear(4, 1).double(), torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.0)
)
lw = AcceleratorAccumulator(accelerator, model, loss_reduction="sum")
microbatch = torch.compile(lambda x: lw.scale_loss(model(x).sum()), fullgraph=True)
data = [torch.randn(2, 4, dtype=torch.float64) for _ in range(5)]  # the last step is short
ends, grads = [], []
for window in lw.windows(data):
    lw.begin(num_tokens=[2] * len(window))
    for x in window:
        with lw.accumulate():
            accelerator.backward(microbatch(x))
            ends.append(lw.end_if_sync() is not None)
    grads.append(model.weight.grad.clone())
    expected = sum(torch.autograd.grad(model(x).sum(), model.weight)[0] for x in window)
    torch.testing.assert_close(grads[-1], expected / (2 * len(window)), rtol=1e-12, atol=0)
    model.zero_grad()
assert ends == [False, False, True, False, True], ends
print("ok")
"""


@needs_compiled_checks
def test_accelerate_ends_each_step_when_scale_loss_is_compiled(tmp_path: Path) -> None:
    # A compiled scale_loss() counts its microbatches on the device, so the step machine's
    # count of scaled microbatches stays 0: the helper finds each step's last microbatch by
    # its own accumulate() blocks. Before, no step ever ended.
    script = tmp_path / "accelerate_compiled.py"
    script.write_text(ACCELERATE_COMPILED)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, timeout=300, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
