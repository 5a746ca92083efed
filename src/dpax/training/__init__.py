"""Training: the step, the loop around it, and the `Trainer` that holds both.

  state        TrainState: everything a step changes; its start and its EMA
  sums         a shard's masked sums of the loss, metrics and weights
  update       from the global sums to the new state (clipping, skipped steps, EMA)
  step         the training step (per-device gradients, the update), eval, predict
  compiled     the steps a Trainer compiles, over the state's flat leaves
  metrics      typed metrics: how each adds up over steps and devices
  loop         the training loop: prefetch, log cadence, `Hook`
  hooks        a run's periodic duties: evaluate, checkpoint, stop on a signal, profile
  trainer      `Trainer`: fit, evaluate, predict, state_dict
  checkpoint   Orbax checkpoints: save, restore, fall back
  optim        optimizers and schedules by name, learning-rate scaling
  check        `check_equivalence`: N devices against one, and the likely cause
"""

from dpax._submodules import lazy

__getattr__ = lazy(__name__)
