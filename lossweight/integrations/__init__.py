"""Drop-in integrations of the Accumulator with training frameworks.

Each module imports its framework, and ``import lossweight`` imports none of them: import the
one you use.

- :mod:`lossweight.integrations.hf`: :class:`~lossweight.integrations.hf.LossweightTrainer`, a
  Hugging Face ``transformers.Trainer`` that weights every microbatch by its tokens or samples
  (``pip install "/path/to/lossweight[hf]"``).
- :mod:`lossweight.integrations.trl`:
  :class:`~lossweight.integrations.trl.LossweightGRPOTrainer`, TRL's ``GRPOTrainer`` with each
  ``loss_type`` defined over the whole step (``pip install "/path/to/lossweight[trl]"``).
- :mod:`lossweight.integrations.accelerate`:
  :class:`~lossweight.integrations.accelerate.AcceleratorAccumulator`, an Accumulator bound to
  an ``accelerate.Accelerator`` (``pip install "/path/to/lossweight[accelerate]"``).
- :mod:`lossweight.integrations.lightning`:
  :class:`~lossweight.integrations.lightning.LossweightCallback`, a Lightning callback for
  automatic optimization (with ``accumulate_grad_batches``) and manual optimization
  (``pip install "/path/to/lossweight[lightning]"``).
- :mod:`lossweight.integrations.composer`:
  :class:`~lossweight.integrations.composer.LossweightCallback`, a MosaicML Composer callback
  (``pip install "/path/to/lossweight[composer]"``, which needs torch < 2.7.1).
- :mod:`lossweight.integrations.deepspeed`:
  :class:`~lossweight.integrations.deepspeed.DeepSpeedAccumulator`, an Accumulator bound to a
  DeepSpeed engine, at every ZeRO stage (``pip install "/path/to/lossweight[deepspeed]"``).

docs/integrations.md has a complete example for each.
"""
