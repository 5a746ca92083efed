"""Seed 000 on dpax: linear regression y = x w + b, data-parallel on 4 devices.

The seed shards the data by hand, replicates params with a pmap broadcast trick,
averages gradients with pmean and reads `loss[0]` every epoch. dpax does the
sharding, replication and reduction, and logs only every `log_every` steps.
Run: python examples/seed000_linear_regression.py
"""

import dpax

dpax.simulate_devices(4)  # before JAX starts; a no-op on a machine that has them

import numpy as np  # noqa: E402

from dpax import data  # noqa: E402
from dpax.cli.train import TrainConfig, train  # noqa: E402

config = TrainConfig.from_flags(
    model="linear", data="regression", devices=4, optimizer="sgd",
    lr=0.05, batch_size=64, epochs=30, log_every=100)
result = train(config)
params = result.trainer.params
w_true, b_true = data.true_regression_params()
print("learned w:", np.round(np.asarray(params["dense"]["kernel"][...])[:, 0], 3))
print("true w:   ", np.round(w_true, 3))
print("learned b:", round(float(np.asarray(params["dense"]["bias"][...])[0]), 3),
      " true b:", round(b_true, 3))
print("replicas in sync:", dpax.pmap.replicas_in_sync(result.trainer.state))
