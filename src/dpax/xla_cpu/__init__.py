"""XLA:CPU-only tuning.

  backward          the backward pass rewritten for what XLA:CPU compiles well
  dots              a 2-D weight gradient's dot folded or kept apart: timed per shape
  compile_options   XLA:CPU's older fusion emitters for steps that pool
  hostenv           glibc malloc settings for steps with large temporaries
"""

from dpax._submodules import lazy

__getattr__ = lazy(__name__)
