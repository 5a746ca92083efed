"""`dpax bench`: dpax against the hand-written loops users would write,
measured in one process on the same devices.

  run         `BenchConfig` and `run_bench`: every method of every workload
  workloads   the models, data and optimizers timed
  baselines   the pmap loop, jit on one device, jit + NamedSharding (also with masked
              rows, a reference), and dpax
  timing      methods timed in turns
  report      results.md, results.json and PNG plots
"""

from dpax._submodules import lazy

__getattr__ = lazy(__name__, {"BenchConfig": "dpax.bench.run", "run_bench": "dpax.bench.run",
                              "OPTIMIZERS": "dpax.bench.workloads",
                              "WORKLOADS": "dpax.bench.workloads"})
