"""Models: dpax's own (`simple`, `gpt`), by name for the CLI (`registry`);
other models brought in (`bridge`); losses and N-independent layers.

  registry   the models the CLI names, `ModelConfig`, `make_model`
  simple     linear, mlp, cnn, cnn-bn, deep-mlp: small models written for ONE device
  gpt        a GPT for byte-token text, with remat policies
  losses     per-example losses and predictions of each task
  layers     SyncBatchNorm, per-example dropout: what makes them N-independent
  bridge     Linen modules and plain functions as NNX modules
  generate   a language model's continuation of a prompt
"""

from dpax._submodules import lazy

__getattr__ = lazy(__name__, {
    "MODELS": "dpax.models.registry", "TEXT_MODELS": "dpax.models.registry",
    "ModelConfig": "dpax.models.registry", "make_model": "dpax.models.registry",
    "Linear": "dpax.models.simple", "MLP": "dpax.models.simple", "CNN": "dpax.models.simple",
    "CNNBN": "dpax.models.simple", "deep_mlp": "dpax.models.simple", "GPT": "dpax.models.gpt",
})
