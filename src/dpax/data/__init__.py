"""The data path, host side: examples -> the padded, masked batch of each step.

  datasets   the datasets the CLI names, users' .npz files, the train/eval split,
             `DataConfig`
  sources    examples on disk read by index: ArrayRecord, Parquet, saved HF datasets
  prepare    `dpax prepare`: examples to ArrayRecord shards
  checks     what examples must be before a step: every array's rule, a loss's own
  text       byte-token windows of text files
  augment    crop and flip keyed by (seed, step, global position)
  batches    a global batch padded to a size the devices split, with its mask
  pipeline   the batches of each step on Grain, checkpointable
"""

from dpax._submodules import lazy

_DATASETS = ("DATASETS", "DataConfig", "Dataset", "digits", "is_text", "load",
             "random_images", "read_inputs", "regression", "true_regression_params")
__getattr__ = lazy(__name__, dict.fromkeys(_DATASETS, "dpax.data.datasets"))
