"""lossweight: loss weighting that does not depend on how a step is split.

Gradient accumulation and data parallelism split an optimizer step's examples into
microbatches and ranks. Dividing each microbatch's loss by the number of microbatches weights
every microbatch equally, however many samples or tokens it holds. :class:`Accumulator` weights
each one by its count instead, against the step's global count, so that the gradient and the
logged loss are those of the whole batch, whatever the split.

The dependency-free math is in :mod:`lossweight.weighting`.
"""

from .accumulator import Accumulator, StepContext
from .collectives import Collective, Waitable
from .counting import (
    aggregate,
    count_sequences,
    count_tokens,
    count_tokens_per_row,
    token_cross_entropy,
)
from .errors import DisagreementError
from .result import StepResult
from .terms import Term

__all__ = [
    "Accumulator",
    "Collective",
    "DisagreementError",
    "StepContext",
    "StepResult",
    "Term",
    "Waitable",
    "aggregate",
    "count_sequences",
    "count_tokens",
    "count_tokens_per_row",
    "token_cross_entropy",
]
__version__ = "0.1.0"
