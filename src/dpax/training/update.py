"""The update: from a step's sums over the global batch to the new state and
the step's metrics. The same math wherever it runs: per device on a replica
of the state, or under jit on the logical state of a sharded layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from dpax.errors import DpaxError
from dpax.training.metrics import Last, Total
from dpax.training.state import TrainState, ema_update
from dpax.training.sums import example_metrics


@struct.dataclass
class Reduced:
    """One step's sums over the global batch, as the update takes them."""

    loss_sum: jax.Array
    count: jax.Array  # examples, or the loss's weights, summed
    sums: dict  # {metric: sum}
    grads: Any  # gradient sums, laid out as the layout's update takes them
    model_state: Any  # the model's new non-param state (e.g. running averages)
    # The same sums as the norm reads them, where not as `grads` (a narrow
    # head's untransposed: `ReduceBeforeTranspose.for_norm`).
    for_norm: Any = None


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    """What the update does besides the optimizer's step; each is part of the result."""

    # A NaN/inf loss or gradient (or a batch of no weight) leaves the state
    # unchanged. Opt-in: the update then waits for the whole gradient and its
    # norm, where a hand loop updates each leaf while the next gradient is
    # made (its cost: docs/speed.md). Off, the step does a hand loop's work
    # and a non-finite step is counted.
    skip_nonfinite: bool = False
    clip_norm: float | None = None  # clip the mean gradient to this global norm
    ema_decay: float | None = None  # keep an EMA of the params with this decay
    # The update sees whole leaves (a per-device update on a replica), so the
    # gradient's small leaves can be summed as one vector (`sum_of_squares`);
    # split ones would be gathered for it.
    whole_leaves: bool = False


# Leaves of at most this many elements are summed as one vector (see below).
SMALL_LEAF = 1 << 16


def sum_of_squares(tree, group_small: bool = False) -> jax.Array:
    """Sum of every squared element in f32: non-finite if any element is (or if
    the norm overflows f32, a gradient no step should apply either).

    With `group_small` the small leaves (biases, norms' scales, small
    kernels) are one reduction over their concatenation, which XLA fuses into
    it: one kernel, not one per leaf, which matters where every kernel is
    launched by each simulated device on the same cores. Only for whole
    leaves: in a sharded layout the concatenation would gather the split
    ones. A large leaf is reduced on its own: a concatenation with it is
    copied first, a temporary the size of that leaf.
    """
    leaves = [g.astype(jnp.float32) for g in jax.tree.leaves(tree)]
    cut = SMALL_LEAF if group_small else 0
    small = [jnp.ravel(g) for g in leaves if g.size <= cut]
    parts = [jnp.sum(jnp.square(g)) for g in leaves if g.size > cut]
    if small:
        parts.append(jnp.sum(jnp.square(jnp.concatenate(small))))
    return sum(parts, jnp.float32(0))


def tx_update(tx, grads, opt_state, params, loss):
    """`tx.update` with the global batch's mean loss as `value` for the
    transformations that take extra arguments (e.g. reduce_on_plateau)."""
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        return tx.update(grads, opt_state, params, value=loss)
    return tx.update(grads, opt_state, params)


def check_optimizer(tx: optax.GradientTransformation,
                    state: TrainState) -> optax.GradientTransformation:
    """The transformation the step calls, after refusing before training
    one it cannot call: one that wants more than the gradients, params and
    the loss (a line search's `value_fn` evaluates the loss at trial
    params), or whose update fails on them. One that declares extra
    arguments but takes none (`optax.contrib.sam`) is called without them."""
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32),
                         state.params)

    def traced(tx):
        jax.eval_shape(lambda g, s, p: tx_update(tx, g, s, p, jnp.float32(0)),
                       grads, state.opt_state, state.params)

    try:
        traced(tx)
        return tx
    except TypeError as e:
        wanted = _missing_keyword(e)
        if wanted is not None:
            raise DpaxError(
                f"the optimizer's update needs {wanted}: dpax gives an optax update the "
                "gradients, params and the batch's mean loss (`value`), not a loss function "
                "(e.g. a line search: optax.scale_by_backtracking_linesearch, optax.lbfgs); "
                "use an optimizer without one") from None
        if "unexpected keyword argument 'value'" not in str(e):
            _refuse_failing(e)
    except Exception as e:  # noqa: BLE001 - any failure of the user's optimizer, in one line
        _refuse_failing(e)
    plain = optax.GradientTransformation(tx.init, lambda u, s, p=None: tx.update(u, s, p))
    try:
        traced(plain)
    except Exception as e:  # noqa: BLE001
        _refuse_failing(e)
    return plain


def _refuse_failing(e: Exception) -> None:
    lines = str(e).strip().splitlines()
    raise DpaxError(
        f"the optimizer's update fails on the model's params and gradients "
        f"({type(e).__name__}: {lines[0][:200] if lines else ''}): dpax calls it with the "
        "params as the model holds them (not wrapped, as optax.lookahead's LookaheadParams "
        "are), float32 gradients of their shapes and the batch's mean loss as `value`") from e


def _missing_keyword(e: TypeError) -> str | None:
    """The keyword-only arguments a call lacked, as Python names them, or None
    when `e` is another TypeError. The optax update that wants them is
    called deep inside a chain, so no signature read beforehand finds them;
    Python (3.10-3.13) says so only in the text: "f() missing 1 required
    keyword-only argument: 'value_fn'"."""
    text = str(e)
    if "required keyword-only argument" not in text:
        return None
    return text.rpartition("argument")[2].strip(": s")


def make_update(tx: optax.GradientTransformation, schedule: optax.Schedule | None = None,
                options: UpdateOptions = UpdateOptions()
                ) -> Callable[[TrainState, Reduced], tuple[TrainState, dict]]:
    """The update from a step's global sums: `(state, reduced) -> (state,
    metrics)`. The same math wherever it runs: per device on a replica of the
    state, or under jit on the logical state of a sharded layout (XLA then
    partitions it, collectives included)."""

    def update(state: TrainState, r: Reduced):
        finite, norm = _finite_and_norm(r, options)
        params, opt_state, model_state = _apply(tx, state, r, finite, norm, options)
        bad = jnp.where(finite, 0, state.bad_in_a_row + 1)
        ema = state.ema
        if options.ema_decay is not None:
            ema = ema_update(ema, params, state.step, options.ema_decay)
            if options.skip_nonfinite:
                ema = jax.tree.map(lambda a, b: jnp.where(finite, a, b), ema, state.ema)
        new = state.replace(step=state.step + 1, params=params, model_state=model_state,
                            opt_state=opt_state, bad_in_a_row=bad, ema=ema)
        metrics = _metrics(r, finite, norm, options)
        metrics["bad_in_a_row"] = Last(new.bad_in_a_row)
        if norm is not None:
            metrics["grad_norm"] = Last(norm)
        if schedule is not None:
            metrics["lr"] = Last(jnp.asarray(schedule(state.step), jnp.float32))
        return new, metrics

    return update


def _finite_and_norm(r: Reduced, options: UpdateOptions):
    """(whether the step is finite, the mean gradient's norm or None)."""
    # A batch of zero weight has no mean (0/0): skipped like a NaN one.
    finite = jnp.isfinite(r.loss_sum) & (r.count > 0)
    norm = None
    # One pass over the summed gradients gives the norm and the finiteness
    # test (a NaN or inf anywhere makes the sum of squares non-finite); the
    # division then fuses into the update instead of being stored and read
    # twice more. Without the guard or clipping nothing needs it: the step
    # then does a hand-written loop's work, no more (the pass reads every
    # gradient once more), and a non-finite gradient shows as the next
    # step's non-finite loss.
    if options.skip_nonfinite or options.clip_norm is not None:
        sq = sum_of_squares(r.grads if r.for_norm is None else r.for_norm,
                            options.whole_leaves)
        norm = jnp.sqrt(sq) / r.count
        finite &= jnp.isfinite(sq)
    return finite, norm


def _apply(tx, state: TrainState, r: Reduced, finite, norm, options: UpdateOptions):
    """(params, opt_state, model_state) after the optimizer's step; with
    `skip_nonfinite`, a non-finite step's are the state's as they were."""

    def apply():
        # A product by the reciprocal, not a division: XLA counts a divide
        # as expensive and stores g / count as a pass of its own, where a
        # multiply fuses into each optimizer loop that reads it. One more
        # rounding, the same on any device count.
        scale = 1.0 / r.count
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) * scale, r.grads)
        if options.clip_norm is not None:  # optax.clip_by_global_norm's formula
            small = norm < options.clip_norm
            grads = jax.tree.map(
                lambda g: jax.lax.select(small, g, g / norm * options.clip_norm), grads)
        updates, opt_state = tx_update(tx, grads, state.opt_state, state.params,
                                        r.loss_sum / r.count)
        # The state keeps its dtypes from step to step: bf16 params' Adam
        # moments, made in bf16, come back from the fp32 gradient in fp32.
        opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state,
                                 state.opt_state)
        return optax.apply_updates(state.params, updates), opt_state

    if not options.skip_nonfinite:  # applied as a hand-written loop applies it; still counted
        return (*apply(), r.model_state)
    # A branch, not a select of new against old: the good path writes the
    # update once, in place, where with a select XLA:CPU copies Adam's
    # moments first (scripts/guard_forms.py times both). A non-finite step
    # leaves the state as it was, the counters aside.
    params, opt_state = jax.lax.cond(finite, apply, lambda: (state.params, state.opt_state))
    model_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), r.model_state,
                               state.model_state)
    return params, opt_state, model_state


def _metrics(r: Reduced, finite, norm, options: UpdateOptions) -> dict:
    """The step's typed metrics. A skipped step adds nothing to the logged
    means; it is counted instead. An applied one shows in them (a NaN loss)."""
    loss_sum, count, sums = r.loss_sum, r.count, r.sums
    if options.skip_nonfinite:
        loss_sum, count, sums = jax.tree.map(lambda v: jnp.where(finite, v, 0.0),
                                             (loss_sum, count, sums))
    metrics = example_metrics(loss_sum, count, sums)
    skipped = (1.0 - finite.astype(jnp.float32)) if options.skip_nonfinite else 0.0
    metrics["skipped"] = Total(jnp.asarray(skipped, jnp.float32))
    return metrics
