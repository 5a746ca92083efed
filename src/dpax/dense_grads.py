"""A dense layer's weight gradient as JAX's differentiation leaves it in a
jaxpr: `transpose(dot_general(dy, x))`.

Two rewrites look for that pair: the step's gradient function, which sums
such a gradient over the devices before its transpose
(`dpax.training.untransposed`), and the XLA:CPU backward pass, which keeps
the two apart (`dpax.xla_cpu.backward`). Both find it here, so they agree on
what the pair is, and the XLA:CPU tuning imports nothing from the training
package (`tests/test_structure.py`).
"""

from __future__ import annotations

from jax.extend.core import Var


def transposed_dot(eqn, made_by: dict):
    """The dot whose result `eqn` transposes, or None. `made_by`: the
    equation that produced each value."""
    if eqn.primitive.name != "transpose":
        return None
    dot = producer(eqn.invars[0], made_by)
    return dot if dot is not None and dot.primitive.name == "dot_general" else None


def producer(var, made_by: dict):
    """The equation that produced `var` (None for inputs and literals)."""
    return made_by.get(var) if isinstance(var, Var) else None
