"""The single-device reference every equivalence test compares against: a
textbook `jax.jit` loop on the mean loss of each unpadded batch, no dpax."""

import jax
import optax
from flax import nnx


def plain_jit_params(model: nnx.Module, tx: optax.GradientTransformation, batches) -> list:
    """Params (as leaves) after one optimizer step per (x, y) batch."""
    graphdef, params = nnx.split(model)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss(p):
            logits = nnx.merge(graphdef, p)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for x, y in batches:
        params, opt_state = step(params, opt_state, x, y)
    return jax.tree.leaves(params)
