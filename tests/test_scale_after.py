"""Scale-after steps: counts given with each loss, gradients rescaled once by end()."""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lossweight import Accumulator, token_cross_entropy
from lossweight.testing import InProcessCollective, InProcessGroup


def test_provisional_scales_assume_the_previous_step_weight() -> None:
    x = torch.zeros((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction="mean", weight_estimate=10.0)
    grads = []
    for counts in ([3, 1], [2, 2, 4]):
        x.grad = None
        acc.begin(parameters=[x])
        provisional = []
        for count in counts:
            scaled = acc.scale_loss(x * 0.0 + 1.0, num_tokens=count)  # a loss of 1: its factor
            provisional.append(scaled.item())
            scaled.backward()
        acc.end()
        grads.append(provisional)
    # Step 1 assumes W = 10 (weight_estimate); step 2 assumes step 1's W = 4.
    assert grads == [[0.3, 0.1], [0.5, 0.5, 1.0]]


@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_gradients_are_rescaled_to_the_global_mean(loss_reduction: str) -> None:
    # Microbatch losses k * x (summed over k items of loss x) or x (their mean): the step's
    # mean loss is x, so d/dx is 1 whatever the counts and the estimate.
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction=loss_reduction, weight_estimate=3.0)  # type: ignore[arg-type]
    for counts in ([5, 0, 2], [1], [0, 0]):
        x.grad = None
        acc.begin(parameters=[x])
        for count in counts:
            loss = x * count if loss_reduction == "sum" else x * 1.0
            acc.scale_loss(loss, num_tokens=count).backward()
        result = acc.end()
        empty = sum(counts) == 0
        assert x.grad.item() == pytest.approx(0.0 if empty else 1.0, rel=1e-15)
        assert result.loss.item() == (0.0 if empty else 1.0)
        assert result.is_empty.item() is empty


def test_one_collective_per_step_with_the_loss_included() -> None:
    def rank_steps(rank: int, collective: InProcessCollective) -> list[tuple[int, float, int]]:
        acc = Accumulator(loss_reduction="mean", collective=collective)  # type: ignore[arg-type]
        x = torch.ones((), requires_grad=True)
        seen = []
        for step in range(3):
            x.grad = None
            before = collective.calls
            acc.begin(parameters=[x])
            for count in range(rank + step):  # rank 0 has no microbatch in step 0
                acc.scale_loss(x * float(count), num_tokens=count).backward()
            result = acc.end()
            loss, tokens = result.loss.item(), int(result.num_tokens)
            seen.append((collective.calls - before, loss, tokens))
        return seen

    results = InProcessGroup(2).run(rank_steps)
    assert results[0] == results[1]
    assert [calls for calls, _, _ in results[0]] == [1, 1, 1]
    assert [tokens for _, _, tokens in results[0]] == [0, 1, 4]
    # Step 2: rank 0 has counts 0, 1 and rank 1 has 0, 1, 2, each a mean loss equal to its
    # count: the token mean is (1 * 1 + 1 * 1 + 2 * 2) / 4.
    assert results[0][2][1] == pytest.approx(6 / 4)


def test_a_previous_loss_travels_with_a_scale_after_reduction() -> None:
    def rank_steps(rank: int, collective: InProcessCollective) -> tuple[float, int]:
        acc = Accumulator(loss_reduction="mean", collective=collective, loss_logging="next_step")  # type: ignore[arg-type]
        acc.begin(num_tokens=[1])
        acc.scale_loss(torch.tensor(float(rank)))
        first = acc.end()
        before = collective.calls
        x = torch.ones((), requires_grad=True)
        acc.begin(parameters=[x])
        acc.scale_loss(x * 1.0, num_tokens=1).backward()
        acc.end()
        first_loss = first.loss.item()
        return first_loss, collective.calls - before

    assert InProcessGroup(2).run(rank_steps) == [(0.5, 1), (0.5, 1)]


def test_every_gradient_is_rescaled_whatever_its_dtype_and_unused_ones_are_skipped() -> None:
    layers = torch.nn.ModuleList(
        [torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3).bfloat16()]
    )
    unused = torch.nn.Parameter(torch.ones(2))
    # A gradient on another device is accepted and stays there ("meta" holds no values, so only
    # a GPU run can check the value of a second device's gradients).
    elsewhere = torch.nn.Parameter(torch.ones(2, device="meta"))
    elsewhere.grad = torch.ones(2, device="meta")
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss_of(scale_loss) -> None:
        for layer in layers:
            out = layer(x.to(layer.weight.dtype)).float().sum()
            scale_loss(out).backward()

    acc = Accumulator(loss_reduction="sum")
    acc.begin(num_tokens=[4, 4, 4])
    loss_of(acc.scale_loss)
    acc.end()
    reference = [p.grad.double().clone() for p in layers.parameters()]
    layers.zero_grad(set_to_none=True)

    acc.begin(parameters=[*layers.parameters(), unused, elsewhere])
    loss_of(lambda loss: acc.scale_loss(loss, num_tokens=4))
    acc.end()
    assert unused.grad is None
    assert elsewhere.grad.device.type == "meta"
    for p, expected in zip(layers.parameters(), reference, strict=True):
        tolerance = 1e-2 if p.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(p.grad.double(), expected, rtol=tolerance, atol=tolerance)


def large_step(dtype: torch.dtype, weight_estimate: float, scale_after: bool):
    """A step of 10**6 tokens in two microbatches; every label is class 0, so the gradient of
    the bias sums to about -0.9 per token before it is divided by the token count."""
    torch.manual_seed(0)
    reference_model = torch.nn.Linear(8, 8).double()
    model = torch.nn.Linear(8, 8).to(dtype)
    model.load_state_dict(reference_model.state_dict())
    features = torch.randn(2, 500_000, 8, dtype=torch.float64)
    labels = torch.zeros(2, 500_000, dtype=torch.int64)
    acc = Accumulator(loss_reduction="sum", weight_estimate=weight_estimate)
    if scale_after:
        acc.begin(parameters=model.parameters())
    else:
        acc.begin(num_tokens=[500_000, 500_000])
    for x, y in zip(features, labels, strict=True):
        loss_sum, count = token_cross_entropy(model(x.to(dtype)), y)
        acc.scale_loss(loss_sum, **({"num_tokens": count} if scale_after else {})).backward()
    acc.end()
    F.cross_entropy(reference_model(features.flatten(0, 1)), labels.flatten()).backward()
    return [p.grad for p in model.parameters()], [p.grad for p in reference_model.parameters()]


@pytest.mark.parametrize("scale_after", [True, False], ids=["scale-after", "count-first"])
def test_bf16_gradients_of_a_million_token_step(scale_after: bool) -> None:
    grads, expected = large_step(torch.bfloat16, weight_estimate=1.0, scale_after=scale_after)
    for grad, reference in zip(grads, expected, strict=True):
        assert torch.isfinite(grad).all()
        # bf16 keeps 8 significant bits: 2**-8 relative for each rounding, a few roundings here.
        torch.testing.assert_close(grad.double(), reference, rtol=0.02, atol=0.02 * 0.9)


def test_fp16_needs_the_estimate_of_the_first_step() -> None:
    # Raw counts (an estimate of 1) put the bias gradient near -9e5 before the correction,
    # beyond fp16's 65504; an estimate of the step's weight keeps it near -0.9.
    raw, _ = large_step(torch.float16, weight_estimate=1.0, scale_after=True)
    assert not torch.isfinite(raw[1]).all()
    grads, expected = large_step(torch.float16, weight_estimate=1e6, scale_after=True)
    for grad, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad.double(), reference, rtol=0.01, atol=0.01 * 0.9)


@pytest.mark.parametrize("empty", ["scale-after", "count-first", "loaded"])
def test_a_step_after_an_empty_one_assumes_the_option_s_estimate(empty: str) -> None:
    # After a step whose W was 0, the next one assumed E = 0 (taken as 1: raw counts), not the
    # weight_estimate fp16 needs: 3e4 tokens of gradient 3 overflowed fp16 to inf, unrefused.
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    acc = Accumulator(loss_reduction="sum", weight_estimate=30000.0)
    if empty == "scale-after":
        acc.begin(parameters=[p])
        acc.scale_loss((p.float() * 3).sum() * 0, num_tokens=0).backward()
        assert acc.end().is_empty.item()
    elif empty == "count-first":
        acc.begin(num_tokens=[0])
        acc.scale_loss((p.float() * 3).sum() * 0).backward()
        acc.end()
    else:
        acc.load_state_dict({**acc.state_dict(), "weight_estimate": 0.0})  # saved so before
    assert acc.state_dict()["weight_estimate"] == 30000.0
    p.grad = None
    acc.begin(parameters=[p])
    for count in (15000, 15000):
        acc.scale_loss((p.float() * 3).sum() * count, num_tokens=count).backward()
    assert acc.end().num_tokens.item() == 30000
    assert p.grad is not None and p.grad.tolist() == [3.0] * 4


X = torch.nn.Parameter(torch.ones(()))


@pytest.mark.parametrize(
    ("steps", "error", "message"),
    [
        (
            lambda acc: (
                acc.begin(num_tokens=[1]),
                acc.scale_loss(torch.tensor(1.0), num_tokens=2),
            ),
            ValueError,
            r"scale_loss\(\) got num_tokens=2 for microbatch 0 of step 1, but begin\(\) declared 1 for it",
        ),
        (
            lambda acc: (acc.begin(parameters=[X]), acc.scale_loss(torch.tensor(1.0))),
            ValueError,
            r"scale_loss\(\) got num_tokens=None in a scale-after step \(begin\(\) had no counts\); pass num_tokens=",
        ),
        (
            lambda acc: (acc.begin(parameters=[X]), acc.backward_scale()),
            RuntimeError,
            r"backward_scale\(\) was called in step 1, which scales after: its factors are provisional",
        ),
        (
            lambda acc: (
                acc.begin(parameters=[X]),
                acc.scale_loss(torch.tensor(1.0), num_tokens=-1),
            ),
            ValueError,
            r"num_tokens=-1 is negative",
        ),
        (
            lambda acc: (
                acc.begin(parameters=[X]),
                acc.scale_loss(torch.tensor(1.0), num_tokens=1.5),
            ),
            TypeError,
            r"num_tokens=1.5 is not an integer count",
        ),
        (
            lambda acc: (
                acc.begin(parameters=[X]),
                acc.scale_loss(torch.tensor(1.0), num_tokens=torch.tensor([1, 2])),
            ),
            ValueError,
            r"num_tokens is a tensor of shape \(2,\); each count must be a 0-dim tensor or an int",
        ),
        (
            lambda acc: (
                acc.begin(parameters=[X]),
                acc.scale_loss(torch.tensor(1.0), num_tokens=1),
                acc.scale_loss(torch.tensor(1.0), num_tokens=1, num_samples=1),
            ),
            ValueError,
            r"scale_loss\(\) got num_samples and num_tokens for microbatch 2 but num_tokens for the ones before; give the same counts",
        ),
        (
            lambda acc: acc.begin(),
            ValueError,
            r"begin\(\) got neither counts nor parameters; pass this rank's counts to count first \(begin\(num_tokens=\[one count per microbatch\]\)\), or the parameters",
        ),
        (
            lambda acc: acc.begin(num_tokens=[1], parameters=[X]),
            ValueError,
            r"begin\(\) got counts and parameters; pass counts to count first",
        ),
        (
            lambda acc: acc.begin(parameters=[]),
            ValueError,
            r"parameters holds no parameter \(an empty list, or an iterator such as model.parameters\(\) that was used up already\)",
        ),
        (
            lambda acc: acc.begin(parameters=iter([])),
            ValueError,
            r"parameters holds no parameter",
        ),
        (
            lambda acc: acc.begin(parameters=X),
            TypeError,
            r"parameters is a tensor of shape \(\), not an iterable of parameters; pass model.parameters\(\)",
        ),
        (
            lambda acc: acc.begin(parameters=[X, 3]),
            TypeError,
            r"parameters\[1\] is 3, not a tensor",
        ),
        (
            lambda acc: (
                acc.begin(parameters=[torch.nn.Parameter(torch.ones(()))]),
                acc.scale_loss(X * 1.0, num_tokens=1),
                acc.end(),
            ),
            ValueError,
            r"none of the 1 parameters given to begin\(\) has a gradient after 1 microbatches of step 1 went through scale_loss\(\); pass the parameters of the model those losses came from",
        ),
        (
            lambda acc: (acc.begin(parameters=[X]), acc.end(), acc.end()),
            RuntimeError,
            r"end\(\) was called after step 1 was closed",
        ),
        (
            lambda acc: (
                acc.begin(parameters=[X]),
                acc.end(),
                acc.scale_loss(torch.tensor(1.0), num_tokens=1),
            ),
            RuntimeError,
            r"scale_loss\(\) was called after step 1 was closed",
        ),
    ],
)
def test_errors(steps, error: type, message: str) -> None:
    X.grad = None
    with pytest.raises(error, match=message):
        steps(Accumulator(loss_reduction="mean"))


def test_named_parameters_are_accepted() -> None:
    model = torch.nn.Linear(2, 1, bias=False).double()
    acc = Accumulator(loss_reduction="sum")
    acc.begin(parameters=model.named_parameters())
    for rows in (1, 3):
        loss = model(torch.ones(rows, 2, dtype=torch.float64)).sum()
        acc.scale_loss(loss, num_tokens=rows).backward()
    acc.end()
    # The mean over 4 rows of x . w has gradient (1, 1).
    assert model.weight.grad.tolist() == [[1.0, 1.0]]


def test_gradients_left_from_before_the_step_are_refused() -> None:
    model = torch.nn.Linear(2, 1).double()
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()  # an unscaled gradient
    acc = Accumulator(loss_reduction="sum")
    with pytest.raises(
        RuntimeError, match=r"already hold nonzero gradients, which end\(\) would rescale"
    ):
        acc.begin(parameters=model.parameters())
    assert not acc.step_open
    model.zero_grad(set_to_none=False)  # zeros are fine
    acc.begin(parameters=model.parameters())
    assert acc.step_open


@pytest.mark.parametrize("estimate", [0, -1.0, float("inf"), float("nan"), "big"])
def test_bad_weight_estimate(estimate: object) -> None:
    with pytest.raises(
        ValueError, match=rf"weight_estimate={estimate!r} is not supported; pass a positive number"
    ):
        Accumulator(loss_reduction="mean", weight_estimate=estimate)  # type: ignore[arg-type]


class Tied(torch.nn.Module):
    """An encoder and a decoder that share one embedding, as tied language models do."""

    def __init__(self) -> None:
        super().__init__()
        shared = torch.nn.Embedding(4, 1, dtype=torch.float64)
        torch.nn.init.ones_(shared.weight)
        self.encoder = torch.nn.Sequential(shared)
        self.decoder = torch.nn.Sequential(shared)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens).sum() + self.encoder(tokens).sum()


@pytest.mark.parametrize(
    "listing",
    ["chain", "twice", "module", "modules", "optimizer"],
)
def test_every_gradient_is_rescaled_once_however_the_parameters_are_listed(listing: str) -> None:
    # Each microbatch's summed loss is 2 * count * w (each of count tokens looks the shared
    # weight up twice): the step's token mean has gradient 2 for the looked-up row. Listed
    # twice, the shared weight was rescaled twice before (0.25 for 1, and 0.1 for the same
    # tensor twice): now every gradient is rescaled once.
    model = Tied()
    optimizer = torch.optim.SGD(
        [{"params": model.encoder.parameters()}, {"params": [torch.nn.Parameter(torch.ones(1))]}],
        lr=0.1,
    )
    parameters = {
        "chain": lambda: itertools.chain(model.encoder.parameters(), model.decoder.parameters()),
        "twice": lambda: [model.encoder[0].weight, model.encoder[0].weight],
        "module": lambda: model,
        "modules": lambda: [model.encoder, model.decoder],  # a rank's pipeline stages, say
        "optimizer": lambda: optimizer,
    }[listing]()
    acc = Accumulator(loss_reduction="sum", weight_estimate=10.0)
    acc.begin(parameters=parameters)
    for count in (3, 1):
        tokens = torch.zeros(count, dtype=torch.int64)
        acc.scale_loss(model(tokens), num_tokens=count).backward()
    acc.end()
    assert model.encoder[0].weight.grad[0].item() == pytest.approx(2.0, rel=1e-15)


def test_a_step_whose_losses_skipped_scale_loss_is_refused() -> None:
    # Back-propagating the loss itself after a step whose W was 100 used to multiply the
    # gradient by 100, with a logged loss of 0.
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction="sum")
    acc.begin(parameters=[x])
    acc.scale_loss(x * 100, num_tokens=100).backward()
    acc.end()
    x.grad = None
    acc.begin(parameters=[x])
    (x * 3).backward()  # scale_loss() forgotten
    with pytest.raises(RuntimeError, match=r"found nonzero gradients that no scale_loss\(\)"):
        acc.end()
    acc.abandon()
    # A rank with no microbatch and no gradient ends its step as before.
    x.grad = None
    acc.begin(parameters=[x])
    assert acc.end().num_tokens.item() == 0 and x.grad is None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_scaled_loss_back_propagated_after_end_is_refused(compiled: bool) -> None:
    # The last loss's backward after end() kept its provisional factor 1 / E: the gradient was
    # 5.375, not 1, with no error (E = 1, W = 8). A count-first factor is final: the same loop
    # gives 1 there.
    x = torch.zeros((), dtype=torch.float64, requires_grad=True)
    for scale_after in (False, True):
        x.grad = None
        acc = Accumulator(loss_reduction="sum")
        scale = torch.compile(acc.scale_loss) if compiled and scale_after else acc.scale_loss
        acc.begin(parameters=[x]) if scale_after else acc.begin(num_tokens=[3, 5])
        scale((x + 1) * 3, **({"num_tokens": 3} if scale_after else {})).backward()
        last = scale((x + 1) * 5, **({"num_tokens": 5} if scale_after else {}))
        acc.end()
        if not scale_after:
            last.backward()
            assert x.grad.item() == 1.0  # type: ignore[union-attr]
            continue
        with pytest.raises(RuntimeError, match=r"step 1 was back-propagated after that step's"):
            last.backward()
        assert x.grad.item() == 3 / 8  # type: ignore[union-attr]  # the first loss's, rescaled
    # An unscaled term back-propagated after end() is added as it is (docs/scale-after.md),
    # and the next step's scaled losses are its own.
    x.grad = None
    acc.begin(parameters=[x])
    acc.scale_loss((x + 1) * 2, num_tokens=2).backward()
    acc.end()
    (x * 0.5).backward()
    x.grad = None
    acc.begin(parameters=[x])
    acc.scale_loss((x + 1) * 2, num_tokens=2).backward()
    assert acc.end().num_tokens.item() == 2 and x.grad.item() == 1.0  # type: ignore[union-attr]


def _clipped_run(max_grad_norm: float, tied: bool) -> tuple[dict[str, torch.Tensor], ...]:
    """A linear model, its full-batch gradient clipped by torch, and three microbatches (one
    empty) of one scale-after step whose end() clips: the gradients and norms of both."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, dtype=torch.float64)
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    F.mse_loss(model(x), y, reduction="sum").div(9).backward()
    full_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    acc = Accumulator(loss_reduction="sum", weight_by="samples", weight_estimate=100.0)
    listed = itertools.chain(model.parameters(), [model.weight]) if tied else model.parameters()
    acc.begin(parameters=listed)
    for rows in (slice(0, 2), slice(2, 2), slice(2, 9)):
        loss = F.mse_loss(model(x[rows]), y[rows], reduction="sum")
        acc.scale_loss(loss, num_samples=rows.stop - rows.start).backward()
    result = acc.end(max_grad_norm=max_grad_norm)
    got = {name: p.grad for name, p in model.named_parameters()}
    assert result.grad_norm is not None
    return expected, got, {"full": full_norm, "step": result.grad_norm}  # type: ignore[return-value]


@pytest.mark.parametrize("tied", [False, True], ids=["listed-once", "listed-twice"])
@pytest.mark.parametrize("max_grad_norm", [0.05, 1e6], ids=["clips", "below-the-norm"])
def test_end_clips_the_rescaled_gradient(max_grad_norm: float, tied: bool) -> None:
    # end(max_grad_norm=...) clips after the rescale, each gradient once however it is listed:
    # the full batch's gradient clipped by clip_grad_norm_, and its norm before clipping. The
    # provisional gradient (W assumed 100, the step's is 9) is 11 times off.
    expected, got, norms = _clipped_run(max_grad_norm, tied)
    assert norms["step"].item() == pytest.approx(norms["full"].item(), rel=1e-12)
    clipping = max_grad_norm < norms["full"].item()
    assert clipping == (max_grad_norm == 0.05)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-12, atol=0)


def test_clipping_before_end_clips_the_wrong_gradient() -> None:
    # What end(max_grad_norm=...) saves a loop from: clip_grad_norm_ between the last backward
    # and end() clips the provisional gradient, and end() rescales the clipped one.
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction="sum", weight_estimate=1.0)
    acc.begin(parameters=[x])
    acc.scale_loss(x * 10, num_tokens=10).backward()  # exact: 1; provisional: 10
    torch.nn.utils.clip_grad_norm_([x], 0.5)
    acc.end()
    assert x.grad is not None and x.grad.item() == pytest.approx(0.05, rel=1e-5)  # not 0.5
    x.grad = None
    acc.begin(parameters=[x])
    acc.scale_loss(x * 10, num_tokens=10).backward()
    result = acc.end(max_grad_norm=0.5)
    assert x.grad.item() == pytest.approx(0.5, rel=1e-5)
    assert result.grad_norm is not None and result.grad_norm.item() == pytest.approx(1.0)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_a_bad_max_grad_norm_is_refused_and_the_step_stays_open(value: object) -> None:
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction="sum")
    acc.begin(parameters=[x])
    acc.scale_loss(x * 2, num_tokens=2).backward()
    with pytest.raises(ValueError, match=r"max_grad_norm must be a positive finite number"):
        acc.end(max_grad_norm=value)  # type: ignore[arg-type]
    assert acc.step_open
    assert acc.end().grad_norm is None
    assert x.grad is not None and x.grad.item() == 1.0


def test_count_first_steps_clip_after_end_themselves() -> None:
    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    acc = Accumulator(loss_reduction="sum")
    acc.begin(num_tokens=[2])
    acc.scale_loss(x * 2).backward()
    with pytest.raises(ValueError, match=r"clip them as usual after end\(\)"):
        acc.end(max_grad_norm=1.0)
    assert acc.step_open
    acc.end()


def test_a_sparse_gradient_is_not_clipped_and_the_step_stays_open() -> None:
    embedding = torch.nn.Embedding(5, 3, sparse=True, dtype=torch.float64)
    acc = Accumulator(weight_by="samples", loss_reduction="sum")
    acc.begin(parameters=embedding)
    acc.scale_loss(embedding(torch.tensor([1, 2, 2])).sum(), num_samples=3).backward()
    with pytest.raises(ValueError, match=r"cannot clip a sparse gradient"):
        acc.end(max_grad_norm=0.1)
    assert acc.step_open
    result = acc.end()  # the step's result is not lost
    assert result.num_samples.item() == 3
    assert embedding.weight.grad is not None
    torch.testing.assert_close(
        embedding.weight.grad.to_dense()[2], torch.full((3,), 2 / 3, dtype=torch.float64)
    )


def _two_groups() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)).double()
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}]
    return model, torch.optim.SGD(groups, lr=1.0)


def _step_over(parameters: object, model: torch.nn.Module) -> str:
    acc = Accumulator(loss_reduction="sum")
    model.zero_grad()
    acc.begin(parameters=parameters)
    loss = model(torch.ones(2, 3, dtype=torch.float64)).sum()
    acc.scale_loss(loss, num_tokens=2).backward()
    try:
        acc.end()
    except (ValueError, RuntimeError) as refused:
        acc.abandon()
        return str(refused)
    return "ended"


def test_a_loss_reaching_parameters_not_given_to_begin_is_refused_at_end() -> None:
    model, optimizer = _two_groups()
    refused = _step_over(optimizer.param_groups[0]["params"], model)  # one group of two
    assert refused.startswith("the losses of step 1 that went through scale_loss() reach 2 ")
    assert "parameters that begin(parameters=...) was not given (shapes (1, 4), (1,))" in refused
    assert "begin(parameters=optimizer)" in refused
    assert _step_over(optimizer, model) == "ended"  # every group: exact
    assert _step_over(model, model) == "ended"


def test_a_parameter_first_reached_by_a_later_microbatch_or_step_is_refused() -> None:
    # A branch taken later: the first microbatch, and the whole first step, reach only the
    # parameters given; the second microbatch of step 2 reaches one more.
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(3, 1).double(), torch.nn.Linear(3, 1).double()
    acc = Accumulator(loss_reduction="sum")
    x = torch.ones(2, 3, dtype=torch.float64)
    for step, reach_branch in ((1, False), (2, True)):
        acc.begin(parameters=trunk)
        acc.scale_loss(trunk(x).sum(), num_tokens=2).backward()
        loss = (trunk(x) + branch(x)).sum() if reach_branch else trunk(x).sum()
        acc.scale_loss(loss, num_tokens=2).backward()
        if not reach_branch:
            acc.end()
            trunk.zero_grad()
            continue
        with pytest.raises(
            ValueError, match=f"step {step} that went through scale_loss.. reach 2 "
        ):
            acc.end()
        acc.abandon()


@pytest.mark.parametrize("run", ["module", "partial", "closure"])
def test_a_parameter_inside_a_reentrant_checkpoint_is_looked_for(run: str) -> None:
    # A reentrant checkpoint's graph exists only in its backward: the walk finds the modules
    # it recomputes, run as a module, as Hugging Face's layers run them (a partial of the
    # class's forward and the layer), or through a closure. Before: no refusal, and the head's
    # gradient 8 times too large (W / E).
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 2).double(), torch.nn.Linear(2, 1).double()
    layer = torch.nn.Sequential(body, head)
    function = {
        "module": layer,
        "partial": functools.partial(torch.nn.Sequential.forward, layer),
        "closure": lambda z: head(body(z)),
    }[run]
    data = [torch.randn(rows, 4, dtype=torch.float64) for rows in (3, 1, 4)]

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        inputs = x.requires_grad_()
        return checkpoint(function, inputs, use_reentrant=True).pow(2).sum()

    for given in (body, layer):
        layer.zero_grad(set_to_none=True)
        acc = Accumulator(loss_reduction="sum")
        acc.begin(parameters=given)
        for x in data:
            acc.scale_loss(loss_of(x), num_tokens=len(x)).backward()
        if given is body:
            with pytest.raises(ValueError, match="reach 2 parameters that begin"):
                acc.end()
            acc.abandon()
            continue
        acc.end()
        got = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        (sum(loss_of(x) for x in data) / 8).backward()
        for mine, want in zip(got, [p.grad for p in layer.parameters()], strict=True):
            torch.testing.assert_close(mine, want, rtol=1e-12, atol=0)


def test_the_terms_of_a_microbatch_are_walked_as_one_graph() -> None:
    # Each node once, however many terms reach it: a trunk that 4 terms share is walked once,
    # not once per term, and each parameter it reaches is found once.
    from lossweight import _torch

    trunk = torch.nn.Linear(2, 2).double()
    branch = torch.nn.Linear(2, 1).double()
    hidden = trunk(torch.ones(1, 2, dtype=torch.float64))
    losses = [hidden.sum(), branch(hidden).sum(), hidden.pow(2).sum(), hidden.mean()]
    reached = list(_torch.leaves(losses))
    assert sorted(map(id, reached)) == sorted(map(id, [*trunk.parameters(), *branch.parameters()]))


@pytest.mark.parametrize("when", ["before", "after", "twice"])
def test_a_backward_that_skipped_scale_loss_is_refused(when: str) -> None:
    # A regulariser back-propagated on its own, before or after the scaled loss, into the last
    # parameter alone; or the scaled loss back-propagated twice. Before: rescaled with the
    # scaled gradients, silently (-0.015 for 2.48 in the first two).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    acc = Accumulator(weight_by="samples", loss_reduction="sum")
    acc.begin(parameters=model.parameters())
    if when == "before":
        (3 * model.bias.sum()).backward()
    loss = acc.scale_loss(model(x).pow(2).sum(), num_samples=6)
    loss.backward(retain_graph=True)
    if when == "after":
        (3 * model.bias.sum()).backward()
    if when == "twice":
        loss.backward()
    with pytest.raises(ValueError, match=r"^2 backward passes of step 1 reached the parameters"):
        acc.end()
    acc.abandon()


def test_a_gradient_left_from_before_the_step_is_not_taken_for_the_steps() -> None:
    # A generator's step after its discriminator's, whose gradients stay until zeroed: a
    # backward restricted to the generator leaves them untouched (exact); one that reaches them
    # adds to them in place (refused, though each had a gradient when the loss was scaled).
    torch.manual_seed(0)
    generator, critic = torch.nn.Linear(3, 4).double(), torch.nn.Linear(4, 1).double()
    z = [torch.randn(rows, 3, dtype=torch.float64) for rows in (2, 3)]
    for restricted in (True, False):
        generator.zero_grad(set_to_none=True)
        critic(torch.ones(1, 4, dtype=torch.float64)).sum().backward()  # the critic's step
        acc = Accumulator(weight_by="samples", loss_reduction="sum")
        acc.begin(parameters=generator)
        for x in z:
            loss = acc.scale_loss(-critic(generator(x)).sum(), num_samples=len(x))
            loss.backward(inputs=list(generator.parameters()) if restricted else None)
        if not restricted:
            with pytest.raises(ValueError, match="reach 2 parameters that begin"):
                acc.end()
            acc.abandon()
            continue
        acc.end()
        got = generator.weight.grad.clone()
        generator.zero_grad()
        (sum(-critic(generator(x)).sum() for x in z) / 5).backward(inputs=[generator.weight])
        torch.testing.assert_close(got, generator.weight.grad, rtol=1e-12, atol=0)


def test_parameters_not_given_are_refused_on_every_rank() -> None:
    # Rank 0 gives one param group, rank 1 both: both raise, from the step's one reduction.
    model, _ = _two_groups()

    def rank_step(rank: int, collective: InProcessCollective) -> str:
        acc = Accumulator(loss_reduction="sum", collective=collective)
        local = copy.deepcopy(model)
        groups = [list(local[0].parameters()), list(local.parameters())]
        acc.begin(parameters=groups[rank])
        acc.scale_loss(local(torch.ones(2, 3, dtype=torch.float64)).sum(), num_tokens=2).backward()
        with pytest.raises((ValueError, RuntimeError)) as refused:
            acc.end()
        return str(refused.value)

    first, second = InProcessGroup(2).run(rank_step)
    assert "parameters that begin(parameters=...) was not given" in first
    assert "1 of the 2 ranks of the reduction refused to end this step" in second


@pytest.mark.parametrize("weight", [0.1, 1 / 3, 2.5e-7])
def test_a_float_weight_is_logged_as_a_count_first_step_logs_it(weight: float) -> None:
    # A Python float weight enters the logged loss at float64, as it enters W and the factors,
    # not rounded to float32 on the way (0.1: 0.7000000104 logged for 0.7).
    logged = []
    for mode in ("count first", "scale after"):
        p = torch.ones((), dtype=torch.float64, requires_grad=True)
        acc = Accumulator(loss_reduction="mean", weight_by="weight_sum")
        if mode == "count first":
            acc.begin(weight_sum=[weight])
            acc.scale_loss(p * 0.7).backward()
        else:
            acc.begin(parameters=[p])
            acc.scale_loss(p * 0.7, weight_sum=weight).backward()
        logged.append(acc.end().loss.item())
    assert logged[1] == logged[0] == pytest.approx(0.7, rel=1e-15)
