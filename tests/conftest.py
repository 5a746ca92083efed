"""One pytest process with 8 simulated CPU devices covers N = 1, 2, 4, 8 through
device subsets. This must run before anything creates the JAX backend."""

import dpax

dpax.simulate_devices(8)
