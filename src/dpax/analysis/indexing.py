"""The rows analysis's rules for ops that read or write by an index array
(`gather`, `scatter`): which rows each picks, from what its indices are
(`dpax.analysis.known`): the rows in order keep them apart, rows put where
others were or picked at random mix them.
"""

from __future__ import annotations

import numpy as np

from dpax.analysis.kinds import CONST, SUMMARY, UNKNOWN, Row, combine, is_part, moved, shape_of
from dpax.analysis.known import DRAWN, Known


def gather(eqn, kinds, known_indices=None):
    operand, indices = kinds[0], kinds[1]
    dn = eqn.params["dimension_numbers"]
    out_rank = len(shape_of(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]  # indices' dims

    def from_indices(k):  # a row axis of the indices (not the index vector)
        if k.axis == len(shape_of(eqn.invars[1])) - 1:
            return UNKNOWN
        return moved(k, batch_out[k.axis])

    if operand == SUMMARY or indices == SUMMARY:
        other = indices if operand == SUMMARY else operand
        return "mix" if isinstance(other, Row) else SUMMARY
    if operand == CONST:  # an embedding table looked up by each row's ids
        return from_indices(indices)
    if is_part(operand):
        return UNKNOWN
    # The operand holds rows: kept only where each row gathers from itself.
    if operand.axis in dn.operand_batching_dims:
        j = dn.operand_batching_dims.index(operand.axis)
        paired = dn.start_indices_batching_dims[j]
        if indices != CONST and indices != Row(paired, operand.group):
            return UNKNOWN
        return from_indices(Row(paired, operand.group))
    by_index = operand.axis in dn.start_index_map and (
        operand.axis in dn.collapsed_slice_dims  # x[idx]; vmap's x[i] keeps a size-1 axis
        or eqn.params["slice_sizes"][operand.axis] == 1)
    if by_index and indices == CONST:
        return picked(eqn, operand, known_indices, batch_out)
    if by_index and isinstance(indices, Row) and isinstance(known_indices, Known):
        # Indices from the rows and constants (`logp[jnp.arange(n), y]`): where
        # the rows' part picks each row in place, the rest picks within it.
        own = picked(eqn, operand, known_indices, batch_out)
        return own if own == from_indices(indices) or own == "mix" else UNKNOWN
    if indices != CONST or operand.axis in dn.start_index_map \
            or operand.axis in dn.collapsed_slice_dims \
            or eqn.params["slice_sizes"][operand.axis] != shape_of(eqn.invars[0])[operand.axis]:
        return UNKNOWN
    kept = [d for d in range(len(shape_of(eqn.invars[0])))
            if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    return Row(dn.offset_dims[kept.index(operand.axis)], operand.group)


def picked(eqn, operand: Row, indices, batch_out: list):
    """Rows picked one by one, by indices that depend on no row. Each back
    at its place (`x[jnp.arange(n)]`), a run of them in order, each repeated
    in place, or one entry of each row in order (a row's last token) keep
    them apart; rows picked at random (mixup's permutation), or by known
    indices that put rows where others were along an axis as long as the
    rows, mix them. Other picks (a subset, rows twice over) are not read."""
    if indices == DRAWN:
        return "mix"
    if not isinstance(indices, Known):
        return UNKNOWN  # alike on every device, but what they pick is not read
    entries = indices.entries()
    if entries is None:  # too large, or an op not evaluated on the way
        return UNKNOWN
    column = list(eqn.params["dimension_numbers"].start_index_map).index(operand.axis)
    value, known, drawn = (a[..., column] for a in entries)
    if not known.all():
        return "mix" if drawn.any() else UNKNOWN
    size = shape_of(eqn.invars[0])[operand.axis]
    if getattr(eqn.params.get("mode"), "name", "") in ("CLIP", "PROMISE_IN_BOUNDS"):
        value = np.clip(value, 0, size - 1)  # XLA clamps the start into the operand
    if value.ndim == 0 or value.size == 0 or value.min() < 0 or value.max() >= size:
        return UNKNOWN  # one row, its axis dropped; or a row filled in (`mode="fill"`)
    rows = size // operand.group
    of_row = value // operand.group  # the row each picked entry is of
    for i in range(value.ndim):  # the axis the rows land on, alike along the others
        lines = np.moveaxis(of_row, i, 0).reshape(value.shape[i], -1)
        if not (lines == lines[:, :1]).all():
            continue
        line = lines[:, 0]
        if operand.group == 1 and len(line) < rows and (np.diff(line) == 1).all():
            return Row(batch_out[i], span=(int(line[0]), int(line[0]) + len(line), rows))
        if len(line) % rows == 0 and np.array_equal(
                line, np.repeat(np.arange(rows), len(line) // rows)):
            return Row(batch_out[i], len(line) // rows)
    if any(n == rows for n in value.shape):
        return "mix"  # along it, some place holds another row than its own
    return UNKNOWN


def scatter(eqn, kinds, indices=None):
    """`x.at[idx].set(u)` and its kin. Where the rows are written whole
    (`x.at[:, 0].set(u)`: the rows' axis a window of the write), rows stay
    rows. Rows written at places picked at random along the rows
    (`zeros.at[perm].set(x)`) mix; other writes along the rows (a row's
    place written, a fixed order) are not read."""
    operand, _, updates = kinds[:3]
    dn = eqn.params["dimension_numbers"]
    placed = set(dn.scatter_dims_to_operand_dims) | set(dn.inserted_window_dims)
    if isinstance(updates, Row) and updates.axis not in dn.update_window_dims:
        # The updates' rows go where the indices say: at random places they mix.
        return "mix" if _rows_drawn(eqn, updates, indices) else UNKNOWN
    if kinds[1] != CONST or is_part(operand) or is_part(updates):
        return UNKNOWN
    # The operand's window axes, in order, are the updates' `update_window_dims`.
    window = [d for d in range(len(shape_of(eqn.invars[0])))
              if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    rows = set()
    if isinstance(operand, Row):
        if operand.axis not in window or operand.axis in placed:
            return UNKNOWN
        rows.add((operand.axis, operand.group))
    if isinstance(updates, Row):
        rows.add((window[list(dn.update_window_dims).index(updates.axis)], updates.group))
        axis = next(iter(rows))[0]
        if shape_of(eqn.invars[2])[updates.axis] != shape_of(eqn.invars[0])[axis]:
            return UNKNOWN  # some rows written, not all
    if len(rows) != 1:
        return UNKNOWN if rows else combine([operand, updates])
    (axis, group), = rows
    return combine([Row(axis, group) if isinstance(k, Row) else k for k in (operand, updates)])


def _rows_drawn(eqn, updates: Row, indices) -> bool:
    """Are the updates' rows written at places drawn at random: does a draw
    reach the index entries along the updates' rows?"""
    if indices == DRAWN:
        return True
    entries = indices.entries() if isinstance(indices, Known) else None
    if entries is None:
        return False
    # The updates' scatter axes are the indices' batch axes, in order.
    dn = eqn.params["dimension_numbers"]
    scattered = [d for d in range(len(shape_of(eqn.invars[2])))
                 if d not in dn.update_window_dims]
    along = scattered.index(updates.axis)
    if along in dn.scatter_indices_batching_dims:
        return False  # each row writes into its own (`vmap` of a write)
    drawn = entries[2]
    if drawn.size == 0:
        return False
    # A column whose entries follow the rows in order (a row's `group`
    # entries in turn) places them; the others (a token's place, drawn or
    # not) place within them.
    value, known = entries[0], entries[1]
    for c in range(value.shape[-1]):
        column, sure = np.moveaxis(value[..., c], along, 0), np.moveaxis(known[..., c], along, 0)
        line = (np.arange(column.shape[0]) // updates.group).reshape(
            (-1,) + (1,) * (column.ndim - 1))
        if sure.all() and (column == line).all():
            return False
    return bool(drawn.any())
