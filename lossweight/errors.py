"""Every error lossweight raises: its exception types and one table of coded messages.

This module imports nothing. :func:`error` makes a host error from a code and the values its
message names; a check on a device or in a compiled graph takes its fixed text from
:func:`device_message`, so both say the same words. docs/errors.md lists an input for each code
that one line in one process raises; tests/test_error_table.py names the test of each other one.
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
    "mesh_unnamed": (ValueError, "group={mesh!r} is a DeviceMesh of several dimensions without names; name them (init_device_mesh(..., mesh_dim_names=('dp', 'cp'))), so that its ranks can be flattened into one group"),
    "mesh_model_parallel": (ValueError, "group={mesh!r} has the mesh dimension {name!r}, whose ranks hold the same data (tensor or pipeline parallel): counting over it would count each item once per rank of it; pass the data-parallel dimensions only, such as group=mesh['dp', 'cp'], or for pipeline stages, name their dimension: group=mesh['pp', 'dp'], pipeline='pp'"),
    "mesh_partial": (ValueError, "group={mesh!r} holds part of a dimension of its root mesh {root!r} (as a mesh made with DeviceMesh._unflatten does), so lossweight cannot see which of the root's ranks hold the same data as which; make the mesh with init_device_mesh(..., mesh_dim_names=...) and pass group= a slice of it by name, such as group=mesh['dp']"),
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
    "no_parameters": (ValueError, "parameters holds no parameter (an empty list, or an iterator such as model.parameters() that was used up already); pass model.parameters() afresh"),
    "stale_gradients": (RuntimeError, "parameters given to begin() of a scale-after step already hold nonzero gradients, which end() would rescale as if they came from this step; call optimizer.zero_grad() before begin(), and pass every loss of the step through scale_loss()"),
    "unscaled_gradients": (RuntimeError, "end() of a scale-after step found nonzero gradients that no scale_loss() produced: a backward reached the parameters on a rank that passed no loss through scale_loss(), or no rank passed one; pass every loss of the step through scale_loss(loss, num_tokens=...) before its backward, a zero loss run only to take part in the wrapper's reduction too (a rank with no microbatch may hold the gradients of its peers' scaled losses, summed by the loop before end()) (on a pipeline stage before the last, which computes no loss, tell the Accumulator of the pipeline: group=mesh['pp', 'dp'], pipeline='pp')"),
    "bad_max_grad_norm": (ValueError, "end(max_grad_norm={value!r}): max_grad_norm must be a positive finite number, the total norm to clip the step's gradients to; pass None not to clip"),
    "clip_count_first": (ValueError, "end(max_grad_norm={value!r}) clips what a scale-after step rescales, but this step counts first, and its gradients are final after its last backward; clip them as usual after end(): torch.nn.utils.clip_grad_norm_(model.parameters(), {value!r})"),
    "clip_pipeline": (ValueError, "end(max_grad_norm={value!r}) would clip by this rank's norm, but under pipeline= each stage holds a part of the model, whose norm is over every stage; end() without max_grad_norm, then clip by the norm over the stages (each stage's squared norm all-reduced over the pipeline group)"),
    "pipeline_unset": (RuntimeError, "scale_loss() was called by torch.distributed.pipelining to infer a stage's shapes, which is no microbatch of the step, but the Accumulator was not told of the pipeline; pass group= the mesh of the pipeline and data dimensions and pipeline= its pipeline dimension (group=mesh['pp', 'dp'], pipeline='pp'), or build every PipelineStage with input_args= and output_args="),
    "clip_sparse": (ValueError, "end(max_grad_norm={value!r}) cannot clip a sparse gradient (torch's clip_grad_norm_ does not take one); end() without max_grad_norm, then clip the dense gradients yourself"),
    "no_gradients": (ValueError, "none of the {parameters} parameters given to begin() has a gradient after {scaled} microbatches of step {step} went through scale_loss(); pass the parameters of the model those losses came from"),
    "not_given": (ValueError, "the losses of step {step} that went through scale_loss() reach {count} parameters that begin(parameters=...) was not given (shapes {shapes}), whose gradients end() would leave unscaled; pass every parameter the losses reach: the model, or every param group, begin(parameters=optimizer)"),
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
    "total_too_large": (ValueError, "lossweight: the step's total {name} over all ranks is 2**62 or more, beyond what lossweight reduces exactly; count the items of one optimizer step only"),
    "peers_differ": (DisagreementError, "lossweight: ranks that differ only along the mesh dimensions {dimensions} of the group's root mesh, which group= does not span, gave different counts in one reduction of a step. The ranks along a dimension outside group= must hold the same data, as tensor-parallel ranks do: the reduction spans them and counts each item once. If the ranks along {dimensions} hold different data (data or context parallel, a dimension of HSDP), count over it: group=mesh{suggested}; if they are tensor-parallel ranks, give each the counts of the whole batch, not of its own shard (of a vocabulary-parallel loss's labels, say); if they are pipeline stages, name their dimension in group= and pipeline= (group=mesh['pp', 'dp'], pipeline='pp')"),
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
    "differ_divisor": (DisagreementError, "the ranks differ in grad_reduction (or framework_divides_loss_by): this rank's factors undo a division of the gradients by {divisor:g}, another rank's by another number"),
    "traced_too_many": (RuntimeError, "lossweight: a compiled scale_loss() was called for more microbatches than begin() declared; declare one count per microbatch in begin()"),
    "traced_too_few": (RuntimeError, "lossweight: end() was called before every microbatch that begin() declared went through scale_loss(); pass every declared microbatch's loss through scale_loss(), or declare fewer"),
    "graph_asserts": (RuntimeError, "lossweight: scale_loss() inside torch.compile needs torch 2.9 or newer on CPU or CUDA (this is torch {version}), whose compiled graphs keep the asserts of the ranks' agreement check; upgrade torch, or call scale_loss() outside the compiled function"),
    # Counting helpers: lossweight.counting. The checks of tensor values run on their device.
    "logits_shape": (ValueError, "logits has shape {logits} and labels {labels}; logits must have the labels' shape plus a last dimension for the vocabulary"),
    "labels_dtype": (TypeError, "labels has dtype {dtype}, but labels are class indices; pass an integer tensor (token ids, with ignore_index where there is no target)"),
    "zero_dim": (ValueError, "{name} is a 0-dim tensor; pass {what} of shape (..., sequence)"),
    "ignore_index_type": (TypeError, "ignore_index={value!r} is not an int; pass the label of the positions without a target (-100, the default of PyTorch and Hugging Face)"),
    "mask_shape": (ValueError, "mask has shape {shape} but labels {labels}; pass a mask of the labels' shape (1 where a token counts, 0 where it does not)"),
    "mask_values": (RuntimeError, "mask holds values other than 0 and 1; pass 1 where a token counts, 0 where it does not"),
    "packing_both": (ValueError, "position_ids and cu_seqlens were both given; pass one of them to say where the sequences of a packed row begin"),
    "packing_type": (TypeError, "{name}={value!r} is not a tensor; pass an integer tensor"),
    "position_ids_shape": (ValueError, "position_ids has shape {shape} but {name} {labels}; pass the position ids of the {name}' tokens (0 where a sequence begins)"),
    "cu_seqlens_shape": (ValueError, "cu_seqlens has shape {shape} and dtype {dtype}; pass the cumulative sequence lengths of the flattened {name} as a 1-D integer tensor: 0, then the end of each sequence"),
    "cu_seqlens_ends": (RuntimeError, "cu_seqlens must start at 0 and end at the {name}' {tokens} tokens, increasing; pass the cumulative sequence lengths of the flattened {name}"),
    "cu_seqlens_rows": (RuntimeError, "cu_seqlens must begin a sequence at the first token of every row of the {name} (a multiple of {length}): a sequence may not cross rows; flatten the {name} to one row, or give each row its own sequences"),
    "max_length_mode": (ValueError, "max_length={value!r} with mode={mode!r}: pass max_length (the constant each sequence's token sum is divided by) with 'seq-mean-token-sum-norm' only"),
    "bad_max_length": (ValueError, "max_length={value!r}; pass a positive int"),
    "token_losses_shape": (ValueError, "token_losses has shape {shape} but mask {mask}{at}; pass one loss per token of the mask (at the positions given)"),
    "positions_type": (TypeError, "positions={value!r} is not a slice or a tensor; pass the positions of the last dimension this rank's losses are of, as a slice or a 1-D integer tensor"),
    "positions_mask": (TypeError, "positions is a mask ({dtype}); pass the indices it selects, positions.nonzero().squeeze(-1), in the order of this rank's losses"),
    "positions_dtype": (TypeError, "positions has dtype {dtype} and {dimensions} dimensions; pass a 1-D integer tensor of indices of the mask's last dimension"),
    "positions_twice": (RuntimeError, "positions holds a position twice; pass each position this rank holds once"),
    "sequence_split": (RuntimeError, "a row of mask begins inside a sequence (its first counted tokens come before any position_ids of 0): a per-sequence mean would count that sequence once per piece; keep each sequence in one microbatch, or pass the whole sequence's mask and position_ids with the positions= this piece holds, which counts its share"),
    # The split checker: lossweight.testing.assert_split_invariant and its splits.
    "context_shard": (ValueError, "ContextShard(rank={rank!r}, size={size!r}): pass a size of 1 or more and a rank from 0 to size - 1"),
    "simulated_world_size": (ValueError, "world_size={value!r}; pass a positive int, or None"),
    "too_few_counts": (ValueError, "counts has {count} entries; the default splits of {worlds} need at least {needed} examples, one count each"),
    "counts_per_example": (ValueError, "counts has {counts} entries but examples has {examples}; give one count per example"),
    "example_count_negative": (ValueError, "counts[{index}]={value!r} is negative; give each example's number of items its loss covers (0 or more)"),
    "too_few_examples": (ValueError, "len(examples) is {count}; the default splits of {worlds} need at least {needed} examples: give {needed} or more (a smaller batch leaves some splits unbuilt, and with 1 example no split differs from another)"),
    "one_example": (ValueError, "len(examples) is {count}; splits of fewer than 2 examples cannot weigh one example against another, so nothing could differ: give at least 2 examples"),
    "no_splits": (ValueError, "splits is empty, so the check would compare nothing: give at least one Split, or leave splits out for the default ones"),
    "only_the_reference": (ValueError, "every split in splits is the whole batch in one microbatch on one rank, as the reference is, so the check would compare nothing: give a split of several microbatches or ranks"),
    "not_a_split": (ValueError, "splits[{index}] is a {kind}, not a Split; make one with Split.of(name, ranks)"),
    "split_examples": (ValueError, "splits[{index}] ({name!r}) must hold each of examples 0 to {last} once: it {wrong}"),
    "split_ranks": (ValueError, "splits[{index}] ({name!r}) has {worlds}, but torch.distributed runs {world_size} processes, which are the ranks of every split: give splits of {world_size} ranks, or leave splits out for default_splits(counts, world_size={world_size})"),
    "bad_rtol": (ValueError, "rtol={value!r}; pass a finite number of 0 or more (1e-5 suits float32, 1e-10 float64)"),
    "batch_norm": (ValueError, "model has batch norm in train mode, in {modules}: it normalizes each microbatch by that microbatch's statistics, so the gradient depends on the split whatever the weighting; call .eval() on those modules for the check"),
    "nothing_trainable": (ValueError, "model has no parameter that requires a gradient, so the check would compare nothing: pass the model the step trains"),
    "context_parallel_type": (ValueError, "context_parallel={value!r}; pass the number of context-parallel ranks to simulate per data-parallel rank, an int of 1 or more, or None"),
    "context_parallel_size": (ValueError, "context_parallel={value}; pass an int of 1 or more (1: each rank holds whole sequences, and the step still gets its shard), or None"),
    "context_parallel_processes": (ValueError, "context_parallel={value} simulates ranks in one process, but torch.distributed runs {world_size} processes: run the check in one process"),
    "checks_differ": (ValueError, "rank {rank} called assert_split_invariant with other {differ} than rank {own} (as many examples, with the same counts and splits, must run on every process): every process passes the same arguments"),
    "reference_not_finite": (AssertionError, "the step's gradient of the whole batch in one microbatch holds NaN or inf, so no split can be compared to it: fix the loss of the whole batch first"),
    "reference_no_gradient": (AssertionError, "the step left no gradient on the model it was given (the .grad of every parameter that requires one is None or 0 after the whole batch), so the check would compare nothing: it trains another model than its first argument (a module-level one, say), or its loss does not reach the parameters (detached, or computed under torch.no_grad())"),
    "not_deterministic": (AssertionError, "the step is not deterministic: two runs of the whole batch in one microbatch, from the same weights, differ: {difference}. Randomness drawn in train mode (dropout called as a function, noise, sampling) differs with the microbatch's shape, so every split would differ whatever its weighting; turn it off for the check, or put the modules that draw it in eval mode{known}"),
    "model_changed": (AssertionError, "the step changed the model passed to assert_split_invariant ({what} differs after a run), though every run gets a copy of it: it trains that model directly (a module-level one, or one its closure holds), so each run would start from the weights the previous one left; train the model the step is given as its first argument"),
    "split_dependent": (AssertionError, "the step depends on how its {examples} examples are split: {differing} of {splits} splits differ from one microbatch on one rank{loss}:\n{problems}{random}"),
    # Ranks simulated in one process: lossweight.testing.InProcessGroup.
    "bad_rank": (ValueError, "rank={value!r}; pass a rank from 0 to {last}"),
    "run_reentered": (RuntimeError, "InProcessGroup.run() is already running: it is not reentrant; call it from outside the work it runs, or use another InProcessGroup"),
    "unlike_contributions": (RuntimeError, "all-reduce {index}: rank {rank} contributes a {dtype} tensor of shape {shape}, rank {other} a {other_dtype} tensor of shape {other_shape}; every rank must reduce tensors of the same shape and dtype in the same order, as a real process group requires"),
    "reduce_abandoned": (RuntimeError, "all-reduce {index} of rank {rank} was abandoned when a run of this group failed before every rank started it; its result will never come"),
    "waited_before_started": (RuntimeError, "rank {rank} waited for all-reduce {index} before rank(s) {missing} started it: driven from one thread, every rank must start an all-reduce before any rank waits for it (run a call that waits for its own all-reduce on every rank at once with InProcessGroup.run())"),
    "rank_failed": (RuntimeError, "all-reduce {index} of rank {rank} abandoned: another rank failed"),
    "reduce_deadlocked": (RuntimeError, "all-reduce {index} of rank {rank} can never complete: every rank still running waits, and rank(s) {missing} did not start it (the ranks issued their collectives in different numbers or orders, where a real process group would hang; issued so far: {issued})"),
    "reduce_timed_out": (RuntimeError, "all-reduce {index} of rank {rank} never completed: rank(s) {missing} did not start it within {timeout:g} s (the ranks issued their collectives in different numbers or orders, where a real process group would hang; issued so far: {issued})"),
    # Integrations: lossweight.integrations.accelerate and lossweight.integrations.lightning.
    "accelerate_deepspeed": (RuntimeError, "under DeepSpeed, accelerator.backward() steps the optimizer at the step's last microbatch, before end() could rescale the gradients; count first: give the step's counts to begin() before its first microbatch"),
    "accelerate_backward_missing": (RuntimeError, "end_if_sync() was called in step {step} when only {backpropagated} of the {scaled} losses that scale_loss() returned had gone through accelerator.backward(): ending the step now rescales the gradients without the later ones, which keep their provisional factors; call end_if_sync() after accelerator.backward(lw.scale_loss(...)), before clipping and optimizer.step()"),
    "accelerate_no_model": (ValueError, "AcceleratorAccumulator needs the prepared model, to skip its gradient synchronization and to rescale its gradients: pass it to the constructor (AcceleratorAccumulator(accelerator, model, ...)) or to accumulate(model)"),
    "accelerate_window_changed": (RuntimeError, "accelerator.gradient_accumulation_steps changed from {before} to {now}; build a new AcceleratorAccumulator after changing it"),
    "accelerate_world": (RuntimeError, "the default process group has {world} ranks but the Accelerator {processes} processes; lossweight reduces over the default group, which must be the Accelerator's data-parallel world"),
    "accelerate_unended": (RuntimeError, "the gradients of step {step} are still provisional: accelerate synchronized them at its last microbatch, and end_if_sync() was not called to rescale them; call lw.end_if_sync() after accelerator.backward() in every microbatch, before clipping and optimizer.step()"),
    "lightning_outside_batch": (RuntimeError, "LossweightCallback.scale_loss() was called outside a training batch; add the callback to the Trainer (or return it from configure_callbacks()) so that it begins each step in on_train_batch_start"),
    "lightning_no_step": (RuntimeError, "LossweightCallback.end() was called with no step open; call it in a training batch, after the backward of its last microbatch and before optimizer.step()"),
    "lightning_not_backpropagated": (RuntimeError, "step {step} ends, but only {backpropagated} of the {scaled} losses that LossweightCallback.scale_loss() returned in it went through backward(): a loss scaled and not back-propagated counts in the step's weights and logged loss without adding its gradient. Call scale_loss() once per microbatch and return its value from training_step (or pass it to manual_backward())"),
    "lightning_unweighted_backward": (RuntimeError, "a backward() during training went through no loss that LossweightCallback.scale_loss() returned, so the end of the step would rescale a gradient that no factor weighted; return the callback's scale_loss(loss, {name}=...) from training_step (automatic optimization) or pass it to manual_backward() (manual optimization)"),
}
# fmt: on


def error(code: str, **fields: object) -> Exception:
    """The exception of ``code``, its message filled with ``fields``."""
    kind, template = MESSAGES[code]
    return kind(template.format(**fields))


def device_message(code: str, **fields: object) -> str:
    """The fixed text of a check that runs on a device: the words :func:`error` would raise."""
    return MESSAGES[code][1].format(**fields)
