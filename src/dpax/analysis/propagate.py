"""One walk over a jaxpr that carries a fact per value, for every analysis.

An analysis (`dpax.analysis.varying`, `dpax.analysis.rows`) is a `Domain`:
the fact a value starts with, how facts join, and what each kind of
equation makes of its operands' facts. The walk is shared: the one table of
collectives, calls into a sub-jaxpr argument for argument (pjit, remat,
custom_jvp/vjp), a cond's branches joined, and a scan's carry iterated until
its facts settle.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from dpax.analysis.live import live

# Collectives whose result combines every device's values: the same everywhere.
COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather",
                         "all_gather_invariant"})
# Primitives whose result differs per device whatever their operands.
PER_DEVICE = frozenset({"axis_index", "ppermute", "all_to_all", "reduce_scatter",
                        "psum_scatter"})


class Domain:
    """What an analysis knows of values; the defaults pass facts through.

    `axis`: the devices' axis name (or names, with hybrid sharding's
    groups), where the analysis reads collectives by it: one over all of
    them combines every device. `scan_rounds`: how many passes over a scan's body may settle its
    carry before every output is `opaque` (None: until they settle)."""

    bottom: Any = None  # the fact of a literal, a constant, a value from no operand
    axis: str | tuple[str, ...] | None = None
    scan_rounds: int | None = None

    def literal(self, atom) -> Any:
        """A literal's fact (the default: `bottom`)."""
        return self.bottom

    def constant(self, value) -> Any:
        """A constant's fact (a closed jaxpr's; the default: `bottom`)."""
        return self.bottom

    def first(self, eqn, facts: list) -> list | None:
        """A verdict before the equation is read (None: read it)."""
        return None

    def join(self, facts: list):
        """One fact for a value that may be any of `facts` (branches, loop rounds)."""
        raise NotImplementedError

    def primitive(self, eqn, facts: list) -> list:
        """The outputs' facts of an equation the walk does not open."""
        raise NotImplementedError

    def per_device(self, eqn, facts: list) -> list:
        return self.primitive(eqn, facts)

    def collective(self, eqn, facts: list, over_axis: bool) -> list:
        return self.primitive(eqn, facts)

    def control(self, eqn, facts: list) -> list | None:
        """A verdict on a cond or scan before the walk opens it (None: open it)."""
        return None

    def call(self, eqn, outs: list) -> list:
        """A call's outputs, from its body's."""
        return outs

    def sliced(self, fact, eqn):  # a scan's xs (`eqn`'s), as one iteration sees them
        return fact

    def stacked(self, fact, eqn):  # a scan's ys (`eqn`'s), stacked along a new leading axis
        return fact

    def around(self, fact, eqn):
        """A scan's (`eqn`'s) carry out of one round as the next round sees it."""
        return fact

    def carried(self, settled, out, eqn):
        """A scan's carry out, from the settled carry in and the body's out."""
        return out

    def opaque(self, eqn) -> list:
        """A scan whose carry did not settle within `scan_rounds`."""
        raise NotImplementedError


Observer = Callable[[Any, list], None]


def propagate(jaxpr: jcore.Jaxpr, ins: Sequence, domain: Domain,
              observe: Observer | None = None, consts: Sequence = ()) -> list:
    """The facts of `jaxpr`'s outputs from its inputs'. `observe(eqn, facts)`
    sees every equation the walk reaches with its operands' facts, in
    program order (a scan's body once, with the carry's settled facts).
    `consts`: the values of `jaxpr.constvars`, where the caller has them."""
    env = {v: domain.constant(c) for v, c in zip(jaxpr.constvars, consts)}
    env.update(zip(jaxpr.invars, ins))

    def fact(atom):
        return domain.literal(atom) if isinstance(atom, jcore.Literal) \
            else env.get(atom, domain.bottom)

    for eqn in jaxpr.eqns:
        facts = [fact(a) for a in eqn.invars]
        if observe is not None:
            observe(eqn, facts)
        env.update(zip(eqn.outvars, _eqn(eqn, facts, domain, observe)))
    return [fact(v) for v in jaxpr.outvars]


def _eqn(eqn, facts: list, domain: Domain, observe: Observer | None) -> list:
    outs = domain.first(eqn, facts)
    if outs is not None:
        return outs
    name = eqn.primitive.name
    if name in PER_DEVICE:
        return domain.per_device(eqn, facts)
    if name in COLLECTIVES:
        over = domain.axis is not None and set(names(domain.axis)) <= set(axes(eqn.params))
        return domain.collective(eqn, facts, over)
    body = call_body(eqn)
    if body is not None:
        return domain.call(eqn, propagate(body, facts, domain, observe, _consts(eqn)))
    if name in ("cond", "scan"):
        outs = domain.control(eqn, facts)
        if outs is not None:
            return outs
        return (_cond if name == "cond" else scan)(eqn, facts, domain, observe)
    return domain.primitive(eqn, facts)


def _cond(eqn, facts: list, domain: Domain, observe: Observer | None) -> list:
    """The branch index, then the operands of every branch."""
    index, *ops = facts
    branches = [propagate(b.jaxpr, ops, domain, observe) for b in eqn.params["branches"]]
    return [domain.join([index] + [b[i] for b in branches]) for i in range(len(eqn.outvars))]


def scan(eqn, facts: list, domain: Domain, observe: Observer | None = None) -> list:
    """consts, carry, xs -> carry, ys: the body again until the carry's facts settle."""
    p = eqn.params
    body, n_consts, n_carry = p["jaxpr"].jaxpr, p["num_consts"], p["num_carry"]
    consts, carry = facts[:n_consts], facts[n_consts:n_consts + n_carry]
    xs = [domain.sliced(f, eqn) for f in facts[n_consts + n_carry:]]
    rounds = 0
    while domain.scan_rounds is None or rounds < domain.scan_rounds:
        rounds += 1
        outs = propagate(body, consts + carry + xs, domain)
        joined = [domain.join([a, domain.around(b, eqn)]) for a, b in zip(carry, outs[:n_carry])]
        if joined == carry:
            if observe is not None:  # once more, seen: the body as the settled carry runs it
                outs = propagate(body, consts + carry + xs, domain, observe)
            return ([domain.carried(a, b, eqn) for a, b in zip(carry, outs[:n_carry])]
                    + [domain.stacked(f, eqn) for f in outs[n_carry:]])
        carry = joined
    return domain.opaque(eqn)


def call_body(eqn) -> jcore.Jaxpr | None:
    """The body of a call (pjit, remat, custom_jvp/vjp), argument for argument."""
    inner = [p for p in eqn.params.values() if isinstance(p, (jcore.Jaxpr, jcore.ClosedJaxpr))]
    if eqn.primitive.name in ("while", "scan", "cond") or len(inner) != 1:
        return None
    body = inner[0].jaxpr if isinstance(inner[0], jcore.ClosedJaxpr) else inner[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    return body


def _consts(eqn) -> list:
    """The constants of a call's closed body, if it has them."""
    inner = [p for p in eqn.params.values() if isinstance(p, jcore.ClosedJaxpr)]
    return list(inner[0].consts) if len(inner) == 1 else []


def axes(params: dict) -> tuple:
    """The axis names a collective runs over."""
    found = params.get("axes", params.get("axis_name", ()))
    return found if isinstance(found, tuple) else (found,)


def names(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    """A mesh axis name, or several, as a tuple."""
    return axis if isinstance(axis, tuple) else (axis,)


def shapes(args: Sequence[Any]) -> list:
    return [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arg) for arg in args]


def trace(fn: Callable, args: Sequence[Any], axis: str | tuple[str, ...],
          size: int | tuple[int, ...]) -> jcore.ClosedJaxpr:
    """`fn`'s jaxpr on the shapes of `args`, inside `size` devices of `axis`
    (or, for several axes, `size[i]` along `axis[i]`), with its constants:
    the equations its outputs need (`dpax.analysis.live`)."""
    env = list(zip(names(axis), size if isinstance(size, tuple) else (size,)))
    return live(jax.make_jaxpr(fn, axis_env=env)(*shapes(args)))


def line(eqn) -> str:
    """The user's line that made `eqn`, or "" where JAX does not say: the
    innermost frame outside JAX, installed libraries (optax's loss that
    `jnp.arange(B)` labels reach) and dpax itself, else JAX's own pick."""
    try:  # a private module: the line is a courtesy, the verdict does not need it
        from jax._src import source_info_util
        frames = list(source_info_util.user_frames(eqn.source_info.traceback))
        own = [f for f in frames if not f.file_name.startswith(LIBRARIES)]
        if not own:
            return source_info_util.summarize(eqn.source_info)
        f = own[0]
        return f"{f.file_name}:{f.start_line}:{f.start_column} ({f.function_name})"
    except Exception:
        return ""


# dpax's own package, and where libraries live (site-packages, dist-packages, dpax).
DPAX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
LIBRARIES = tuple(os.path.join(path, "") for path in (
    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])) + (DPAX,)


def user_line(error: BaseException) -> str | None:
    """The user's line that `error` came from: the innermost frame of its
    traceback outside installed libraries, where no frame of dpax's own is
    more inward (dpax's own failure is no error of the user's). None where
    there is none."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith(DPAX):
            return None
        if not frame.filename.startswith(LIBRARIES):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return None


def where(eqn) -> str:
    """`eqn`'s primitive, and its line: "mul at model.py:12 (loss)"."""
    at = line(eqn)
    return f"{eqn.primitive.name} at {at}" if at else eqn.primitive.name


def at_call(found: str, eqn) -> str:
    """`found` ("op" or "op at line") at the line of `eqn`, the call it was
    found in, where it has none: inside a jit of jnp's own (`jnp.where`),
    traced once and cached, an equation has no line of the user's."""
    if " at " in found:
        return found
    at = line(eqn)
    return f"{found} at {at}" if at else found


def leaf_flags(args: Sequence[Any], flags: Sequence[bool]) -> list[bool]:
    """Each argument's flag, once per leaf: the jaxpr's inputs."""
    return [flag for arg, flag in zip(args, flags) for _ in jax.tree.leaves(arg)]
