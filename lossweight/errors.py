"""Every error lossweight raises: its exception types and one table of coded messages.

This module imports nothing. :func:`error` makes a host error from a code and the values its
message names; a check on a device or in a compiled graph takes its fixed text from
:func:`device_message`, so both say the same words. ``MESSAGES`` holds the rows of the core's
errors; each optional module (the counting helpers, the parallel layouts, ``lossweight.testing``
and each integration) defines its rows beside its code and adds them with :func:`add_messages`
when it is imported, before it can raise, so that one table holds every row at run time.
docs/errors.md lists an input for each code that one line in one process raises;
tests/test_error_table.py names the test of each other one.
"""

from __future__ import annotations


class DisagreementError(RuntimeError):
    """The data-parallel ranks disagree on a step: its index, the call that reduces it, or an
    option of their Accumulators. Raised on every rank, by the collective call that paired
    them."""


# code: (exception type, message). A message's {fields} are filled by error(); one line a row.
# fmt: off
MESSAGES: dict[str, tuple[type[Exception], str]] = {
    # Options and the world.
    "no_loss_reduction": (TypeError, "Accumulator() needs loss_reduction: 'sum' if each loss you pass is the sum of its items' losses (lossweight.token_cross_entropy returns a sum), 'mean' if it is their mean (F.cross_entropy's default reduction); or terms=[lossweight.Term(...), ...] for several loss terms"),
    "bad_option": (ValueError, "{name}={value!r} is not supported; pass {expected}"),
    "bad_term_name": (ValueError, "Term(name={value!r}): a term's name must be a non-empty string, its key in the dict of losses scale_loss() takes and in StepResult.losses"),
    "bad_weight_by": (ValueError, "weight_by={value!r} is not supported; pass 'tokens', 'samples', 'weight_sum' (each microbatch gives the sum of its items' float weights), or a positive number, a constant that the sum of the losses is divided by"),
    "constant_mean": (ValueError, "Term({name!r}) divides by a constant (weight_by={value!r}) but has loss_reduction='mean'; a constant divides the sum of the term's losses: pass each microbatch's loss as the sum of its items' (loss_reduction='sum'), or weight a mean by a count"),
    "bad_terms": (TypeError, "terms={value!r} is not a non-empty list of lossweight.Term; pass terms=[Term('lm', loss_reduction='sum', weight_by='tokens'), ...]"),
    "terms_named_twice": (ValueError, "the terms are named {names}; give each term its own name"),
    "too_many_terms": (ValueError, "{count} loss terms; an Accumulator takes at most {most}: add up the losses of terms that share a loss_reduction and a normaliser, which weigh the same as one term"),
    "terms_and_options": (ValueError, "Accumulator() got terms= and {names}; pass loss_reduction and weight_by for one loss, or terms=[...] with them set in each Term"),
    "not_a_collective": (TypeError, "collective={value!r} is not a Collective; implement world_size, device, can_reduce_on() and all_reduce_sum() (see lossweight.Collective)"),
    "collective_class": (TypeError, "collective={value!r} is a class, not a Collective; pass an instance: collective={name}(...)"),
    "pipeline_dimension": (ValueError, "pipeline={value!r} is not a dimension of group={group!r} (its dimensions: {names}); pass group= the DeviceMesh of the data-parallel and pipeline dimensions, such as group=mesh['pp', 'dp'], and pipeline= the name of its pipeline dimension, pipeline='pp'"),
    "not_the_loss_stage": (RuntimeError, "{caller}() was called in step {step} on a rank whose pipeline stage is not the last one (pipeline= names the dimension of the stages): the last stage, on the last rank of that dimension, computes the loss; call scale_loss() in the loss function of the schedule, which torch runs on the last stage, and begin() and end() only on the other stages (schedules that put the last stage on the first rank, V-shaped ones such as ScheduleZBVZeroBubble and ScheduleDualPipeV, are not supported)"),
    "group_and_collective": (ValueError, "group={group!r} and collective={collective!r} were both given; pass one: group for a torch.distributed process group, collective for anything else"),
    "no_process_group": (RuntimeError, "group={group!r} was given but torch.distributed is not initialized; call torch.distributed.init_process_group() before the first begin(), or pass group=None for a single process"),
    "group_destroyed": (RuntimeError, "group={group!r} was destroyed (torch.distributed.destroy_process_group()) after this Accumulator was given it; pass a live group: make a new Accumulator with group= the new group (its state carries over with state_dict())"),
    "bad_world_size": (ValueError, "collective {collective!r} has world_size={value!r}; a Collective's world_size must be a positive int, the number of data-parallel ranks"),
    "bad_handle": (TypeError, "{collective}.all_reduce_sum() returned {value!r}; it must return None (the sum is complete) or an object whose wait() completes it"),
    "cannot_reduce_on": (ValueError, "{name} is on {device}, where the collective cannot reduce (it reduces on {reduces}); pass {name} on the CPU (Python ints or a CPU tensor), or reduce over a group whose backend handles {device.type} tensors"),
    "devices_differ": (ValueError, "{what} are on different devices ({devices}); put the counts on one device, or on the CPU"),
    # The order of calls: the step machine's rules.
    "step_open": (RuntimeError, "{caller}() was called while step {step} is {still}open; {fix}"),
    "no_step": (RuntimeError, "{caller}() was called {when}; call begin({argument}=[...]) or begin(parameters=...) to open a step first"),
    "counts_and_parameters": (ValueError, "begin() got counts and parameters; pass counts to count first (begin(num_tokens=[...])), or parameters to scale after (begin(parameters=model.parameters())), not both"),
    "neither": (ValueError, "begin() got neither counts nor parameters; pass this rank's counts to count first (begin({argument}=[one count per microbatch])), or the parameters whose gradients end() rescales to scale after (begin(parameters=model.parameters()))"),
    "too_many": (RuntimeError, "scale_loss() was called for microbatch {number} of step {step}, but begin() declared {declared} microbatches; declare one count per microbatch in begin()"),
    "count_mismatch": (ValueError, "scale_loss() got {name}={value!r} for microbatch {microbatch} of step {step}, but begin() declared {declared!r} for it: the loss and its count cover different items; count what the loss covers (count_tokens with the loss's shift, or the count token_cross_entropy returns) in both places"),
    "count_undeclared": (ValueError, "scale_loss() got {name} for microbatch {microbatch} of step {step}, but begin() was given no {name}; give it to begin() as well, or leave it out here"),
    "count_differs": (RuntimeError, "scale_loss() got a {name} that is not the one begin() declared for its microbatch: the loss and its count cover different items; count what the loss covers in both places"),
    "too_few": (RuntimeError, "end() was called after {scaled} of the {declared} microbatches that begin() declared for step {step} went through scale_loss(), and microbatches {missing} were not taken by backward_scale(i) either (in a step that uses scale_loss(), a microbatch scaled by hand must also hand its loss over with record_loss(i, loss)); pass every declared microbatch's loss through scale_loss(), or declare fewer (on a pipeline stage before the last, which computes no loss, tell the Accumulator of the pipeline: group=mesh['pp', 'dp'], pipeline='pp')"),
    "scale_after_factor": (RuntimeError, "{caller}() was called in step {step}, which scales after: its factors are provisional until end() learns the global count; pass each loss to scale_loss(), or give every count to begin() to count first"),
    "no_next": (RuntimeError, "backward_scale() has no next microbatch: all {declared} microbatches that begin() declared for step {step} went through scale_loss(); pass backward_scale(index) to read the factor of one of them"),
    "bad_microbatch": (ValueError, "{caller}({microbatch!r}): step {step} declared {declared} microbatches in begin(); pass an index from 0 to {last}"),
    "loss_twice": (RuntimeError, "{caller} was called for microbatch {microbatch} of step {step}, whose loss it holds already (from scale_loss() or record_loss()); hand over each microbatch's loss once"),
    "loss_unfactored": (RuntimeError, "record_loss({microbatch}) was called before backward_scale({microbatch}) gave that microbatch of step {step} its factor; read its factor first, or pass the loss through scale_loss()"),
    "other_thread": (RuntimeError, "{caller}() was called while another thread was inside a call of the same Accumulator; an Accumulator, like an optimizer, is not thread-safe: make one thread at a time drive it, or give each thread its own Accumulator"),
    "into_another_step": (RuntimeError, "scale_loss() got a loss whose backward reaches parameters of another Accumulator's open scale-after step, whose end() would rescale this loss's gradients too (a wrong gradient); weight every loss over those parameters with one Accumulator, count first in each Accumulator (begin(num_tokens=[...]) rescales nothing), or end() that step before this one scales a loss"),
    "bad_step": (ValueError, "begin(step={value!r}): step is the loop's own step number, an int 0 or more, the same on every rank; pass your optimizer step counter, or leave it out to count begin() calls"),
    "scale_after_terms": (ValueError, "begin(parameters=...) opens a scale-after step, whose end() rescales the sum of the terms' gradients by one factor E / W, but the terms {terms} are normalised by different counts or by a constant, which no one factor makes exact; count first (begin({arguments}=[one count per microbatch])), or normalise every term by the same count"),
    "loss_names": (ValueError, "{caller}() got {given}, but the Accumulator's terms are {names}; pass one 0-dim loss per term, as a dict: {example}"),
    "counts_differ": (ValueError, "scale_loss() got {now} for microbatch {number} but {before} for the ones before; give the same counts for every microbatch of a step"),
    # Counts, losses and parameters.
    "weight_missing": (ValueError, "{name}=None, but weight_by={weight_by!r} weights each microbatch of term {term!r} by it; pass {name}=[one count per microbatch], or parameters instead of counts to give them with each loss"),
    "weight_missing_here": (ValueError, "scale_loss() got {name}=None in a scale-after step (begin() had no counts); pass {name}=<this microbatch's count>, or declare all counts in begin()"),
    "lengths_differ": (ValueError, "begin() got counts of different lengths ({lengths}); give each one count per microbatch"),
    "not_integer": (TypeError, "{name}={value!r} is not an integer count; counts are numbers of samples or tokens: pass ints, or an integer tensor"),
    "negative": (ValueError, "{name}={value} is negative; counts are numbers of samples or tokens, 0 or more"),
    "too_large": (ValueError, "{name}={value} is not below 2**62, the largest count lossweight reduces exactly; pass the count of the items the loss covers (a step's total over all ranks must stay below 2**62 too)"),
    "not_a_sequence": (TypeError, "{name}={value!r} is not a sequence of counts; pass one count per microbatch, as a 1-D integer tensor or a list of ints"),
    "not_a_weight": (TypeError, "{name}={value!r} is not a number; a weight_sum is the sum of the float weights of the items a loss covers: pass floats, or a floating-point tensor"),
    "bad_weight": (ValueError, "{name}={value!r} is negative or not finite; a weight_sum is a sum of weights, each 0 or more"),
    "weight_range": (RuntimeError, "{name} holds a weight sum that is negative or not finite; a weight_sum is a sum of weights, each 0 or more"),
    "count_shape": (ValueError, "{name} is a tensor of shape {shape}; {rule}"),
    "wide_unsigned": (TypeError, "{name} has dtype {dtype}, which torch cannot compare on every device; pass {name}.to(torch.int64)"),
    "count_dtype": (TypeError, "{name} has dtype {dtype}, but counts must be integers; pass an integer tensor (e.g. mask.sum(-1), which is int64) or Python ints"),
    "count_range": (RuntimeError, "{name} holds a count that is negative or not below 2**62; counts are numbers of samples or tokens, 0 or more"),
    "loss_type": (TypeError, "{caller}() got loss={value!r}, which is not a tensor; pass the microbatch's loss tensor"),
    "loss_shape": (ValueError, "{caller}() got a loss of shape {shape}, but it must be a scalar (0-dim) tensor; reduce it to the mean or the sum of its items first"),
    "loss_dtype": (TypeError, "{caller}() got a loss of dtype {dtype}; pass a floating-point loss"),
    "parameters_type": (TypeError, "parameters is {shown}, not an iterable of parameters; pass model.parameters() or model.named_parameters() (or [tensor] for one tensor)"),
    "parameter_type": (TypeError, "parameters[{index}] is {value!r}, not a tensor; pass model.parameters() or model.named_parameters()"),
    "parameter_uninitialized": (ValueError, "parameters[{index}] is not initialized yet (a parameter of a lazy module, such as nn.LazyLinear, before its first forward), so neither its shape nor its gradient exists; run one forward before begin(), on a batch of the right shape (under torch.no_grad())"),
    "no_parameters": (ValueError, "parameters holds no parameter (an empty list, or an iterator such as model.parameters() that was used up already); pass model.parameters() afresh"),
    "stale_gradients": (RuntimeError, "parameters given to begin() of a scale-after step already hold nonzero gradients, which end() would rescale as if they came from this step; call optimizer.zero_grad() before begin(), and pass every loss of the step through scale_loss()"),
    "fsdp_held": (RuntimeError, "FSDP2 (fully_shard) holds gradients for parameters given to begin() of a scale-after step, left by backward passes with set_requires_gradient_sync(False) (of an abandoned step, say), which optimizer.zero_grad() does not clear: its next reduce-scatter would add them to this step's gradients; before begin(), back-propagate a zero loss with gradient sync on, then call optimizer.zero_grad() (lossweight's docs/resume.md)"),
    "unscaled_gradients": (RuntimeError, "end() of a scale-after step found nonzero gradients that no scale_loss() produced: a backward reached the parameters on a rank that passed no loss through scale_loss(), or no rank passed one; pass every loss of the step through scale_loss(loss, num_tokens=...) before its backward, a zero loss run only to take part in the wrapper's reduction too (a rank with no microbatch may hold the gradients of its peers' scaled losses, summed by the loop before end()) (on a pipeline stage before the last, which computes no loss, tell the Accumulator of the pipeline: group=mesh['pp', 'dp'], pipeline='pp')"),
    "bad_max_grad_norm": (ValueError, "end(max_grad_norm={value!r}): max_grad_norm must be a positive finite number, the total norm to clip the step's gradients to; pass None not to clip"),
    "clip_count_first": (ValueError, "end(max_grad_norm={value!r}) clips what a scale-after step rescales, but this step counts first, and its gradients are final after its last backward; clip them as usual after end(): torch.nn.utils.clip_grad_norm_(model.parameters(), {value!r})"),
    "clip_pipeline": (ValueError, "end(max_grad_norm={value!r}) would clip by this rank's norm, but under pipeline= each stage holds a part of the model, whose norm is over every stage; end() without max_grad_norm, then clip by the norm over the stages (each stage's squared norm all-reduced over the pipeline group)"),
    "pipeline_unset": (RuntimeError, "scale_loss() was called by torch.distributed.pipelining to infer a stage's shapes, which is no microbatch of the step, but the Accumulator was not told of the pipeline; pass group= the mesh of the pipeline and data dimensions and pipeline= its pipeline dimension (group=mesh['pp', 'dp'], pipeline='pp'), or build every PipelineStage with input_args= and output_args="),
    "clip_sparse": (ValueError, "end(max_grad_norm={value!r}) cannot clip a sparse gradient (torch's clip_grad_norm_ does not take one); end() without max_grad_norm, then clip the dense gradients yourself"),
    "no_gradients": (ValueError, "none of the {parameters} parameters given to begin() has a gradient after {scaled} microbatches of step {step} went through scale_loss(); pass the parameters of the model those losses came from"),
    "backward_after_end": (RuntimeError, "a loss that scale_loss() returned in scale-after step {step} was back-propagated after that step's end(), which had already rescaled the step's gradients: this backward would add a gradient that keeps its provisional factor; call backward() on every scaled loss before end()"),
    "unscaled_backward": (ValueError, "{backwards} backward passes of step {step} reached the parameters given to begin(), but only {scaled} losses went through scale_loss(): a backward of a loss that skipped it (a regulariser back-propagated on its own, or one loss back-propagated twice) left a gradient that end() would rescale as if weighted; pass every loss of the step through scale_loss() before its backward (several terms: Accumulator(terms=...)), and back-propagate a term added once per step after end()"),
    "not_given": (ValueError, "the losses of step {step} that went through scale_loss() reach {count} parameters that begin(parameters=...) was not given (shapes {shapes}), whose gradients end() would leave unscaled; pass every parameter the losses reach: the model, or every param group, begin(parameters=optimizer)"),
    "fsdp_unsharded": (ValueError, "begin(parameters=...) of step {step} got {count} parameters of an FSDP2 module (fully_shard) while it was unsharded (shapes {shapes}): the unsharded tensors that FSDP2 swaps into the module for its forward and backward, not the sharded parameters (DTensors) that it reduces their gradients into, which end() would leave unscaled; pass the sharded parameters, begin(parameters=optimizer), or call begin() while the module is resharded: model.reshard() first (set_reshard_after_backward(False) leaves it unsharded after a backward)"),
    "peer_refused": (RuntimeError, "lossweight: {count} of the {ranks} ranks of the reduction refused to end this step; the error raised on those ranks says why and how to fix it. The step's gradients are not to be applied (scaling after, on the CPU no rank rescaled them, and on an accelerator they are NaN; counting first, a rank learns of the refusal when it reads the step's loss or at its next call, so read result.loss before optimizer.step() to stop before the update): zero them, and call abandon() on every rank to go on"),
    # Results and saved state.
    "loss_pending": (RuntimeError, "the loss of step {step} is not reduced yet: with loss_logging='next_step' it travels with the Accumulator's next reduction (the next begin() of a count-first step, end() of a scale-after step, or flush(), called on every rank); read it after that, or construct the Accumulator with loss_logging='end'"),
    "loss_not_recorded": (RuntimeError, "the loss of step {step} is not known on this rank: microbatches {missing} took their factor from backward_scale() and their loss was not handed over; call acc.record_loss(i, loss) for each of them, or pass the losses through scale_loss()"),
    "loss_dropped": (RuntimeError, "the loss of step {step} will never be reduced: {why}; call flush() on every rank before that, to log it"),
    "pending_elsewhere": (RuntimeError, "the loss of step {step} waited (loss_logging='next_step') to be reduced over the process group of its step, but this call reduces over another one, of {ranks} ranks (it was destroyed or re-initialised); its loss is dropped and this call goes no further: call flush() on every rank before tearing a process group down, then call this again"),
    "state_keys": (ValueError, "state_dict has {keys!r}, not the keys {expected} of Accumulator.state_dict(); pass the value it returned"),
    "state_format": (ValueError, "state_dict has format {value!r}, but this version of lossweight reads format {format}"),
    "state_options": (ValueError, "state_dict has options={value!r}, not a dict of the Accumulator's options; pass the value state_dict() returned"),
    "state_option": (ValueError, "state_dict was saved with {name}={saved!r}, but this Accumulator has {name}={value!r}: the saved estimate of W counts other items; construct it with the {name} of the run it continues"),
    "state_steps": (ValueError, "state_dict has steps={value!r}; it must be an int, 0 or more"),
    "state_estimate": (ValueError, "state_dict has weight_estimate={value!r}; it must be a finite number, 0 or more"),
    "not_picklable": (TypeError, "an Accumulator given a group or a collective cannot be pickled, since a process group cannot; save acc.state_dict() and load it into a new Accumulator with load_state_dict()"),
    "disagree": (DisagreementError, "lossweight: the data-parallel ranks disagree on {field} in one reduction of a step; every rank must make the same calls (begin(), end(), flush(), abandon()) for the same steps, with Accumulators of the same options"),
    "total_too_large": (ValueError, "lossweight: the step's total {name} over all ranks is 2**62 or more, beyond what lossweight reduces exactly; {fix}"),
    "not_summed": (RuntimeError, "collective {collective} did not sum the payload over its {ranks} ranks: all_reduce_sum(tensor) must replace the tensor, in place, by its elementwise sum over every rank (or return a handle whose wait() does)"),
    # Checks of the reduced numbers: on the host, on a device or in a compiled graph.
    "cannot_be_reduced": (DisagreementError, "lossweight step {step} (mod 2**16) cannot be reduced over {ranks} ranks: {problems}. Every rank must make the same calls (begin(), end(), flush(), abandon()) for the same steps, with Accumulators of the same options."),
    "differ_step": (DisagreementError, "this rank is at step {own} but the ranks' mean step is {mean:g}: a rank skipped, abandoned or added a step alone"),
    "differ_call": (DisagreementError, "this rank reduces for {call}, but the ranks' mean call code is {mean:g} (codes {codes})"),
    "differ_mode": (DisagreementError, ": some ranks count first and others scale after. On a rank with no microbatch in a scale-after step, call begin(parameters=...) and end() as the other ranks do"),
    "differ_choice": (DisagreementError, "the ranks differ in {field}: this rank has {own!r}; {share}% of the ranks have {second!r} and the others {first!r}"),
    "differ_terms": (DisagreementError, "the ranks differ in their loss terms (the name, loss_reduction and weight_by of each, in order): this rank's are {own}; construct every rank's Accumulator with the same terms"),
    "differ_carried": (DisagreementError, "{share}% of the ranks' reductions carry the loss of the step before (loss_logging='next_step'), and this rank's {own}: a rank abandoned a step that another ended, or ended one that another abandoned"),
    "differ_estimate": (DisagreementError, "the ranks differ in the estimate of W that a scale-after step's provisional factors assume, so their gradients were averaged at different scales: this rank's is {own}; give every rank the same weight_estimate, and load the same saved state on every rank"),
    "differ_clip": (DisagreementError, "the ranks differ in end(max_grad_norm=...): this rank's is {own}, so their replicas would clip differently (or some would not clip) and diverge; pass every rank the same max_grad_norm"),
    "differ_divisor": (DisagreementError, "the ranks differ in grad_reduction (or framework_divides_loss_by): this rank's factors undo a division of the gradients by {divisor:g}, another rank's by another number"),
    "not_copied": (RuntimeError, "{use} needs lossweight's {file}, which this copy of lossweight leaves out; copy {file} into the folder of accumulator.py (lossweight's docs/vendoring.md lists the files of each use)"),
    # The table itself.
    "code_taken": (ValueError, "the codes {codes} have other rows in lossweight.errors.MESSAGES already; give each row a code of its own"),
}
# fmt: on


def error(code: str, **fields: object) -> Exception:
    """The exception of ``code``, its message filled with ``fields``."""
    kind, template = MESSAGES[code]
    return kind(template.format(**fields))


def device_message(code: str, **fields: object) -> str:
    """The fixed text of a check that runs on a device: the words :func:`error` would raise."""
    return MESSAGES[code][1].format(**fields)


def add_messages(rows: dict[str, tuple[type[Exception], str]]) -> None:
    """Add an optional module's rows to the table, on its import; a code keeps its one row."""
    if taken := sorted(code for code, row in rows.items() if MESSAGES.get(code, row) != row):
        raise error("code_taken", codes=taken)
    MESSAGES.update(rows)
