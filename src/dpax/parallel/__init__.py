"""The parallel engine: devices, where the state lives, and how a per-device
function runs on all of them.

  mesh          the devices of a run (simulated CPU devices, subsets) and the mesh axis
  layout        where the training state lives (replicated, ZeRO-1, FSDP) and its update
  backends      `jit(shard_map)` and `pmap`: placement, wrapping, host copies
  distributed   joining `jax.distributed` for several processes
  spmd          `jax.pmap`'s idioms on current JAX
  arrays        device arrays on the host
"""

from dpax._submodules import lazy

__getattr__ = lazy(__name__)
