"""Enumerate the ways to hand mesh axes to slots (tensor dims, dot dim groups)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence


def assign_axes(slots: Sequence[Hashable], axes: Sequence[int],
                require_all: bool = False) -> Iterator[dict[Hashable, tuple[int, ...]]]:
    """Every map slot -> axes where each mesh axis goes to one slot or to none.

    Axes given to the same slot are kept in ascending order (axis 0 major). With
    `require_all`, every axis must go to some slot.
    """
    choices = list(slots) if require_all else [None, *slots]
    for picks in itertools.product(choices, repeat=len(axes)):
        result: dict[Hashable, tuple[int, ...]] = {}
        for axis, slot in zip(axes, picks, strict=True):
            if slot is not None:
                result[slot] = result.get(slot, ()) + (axis,)
        yield result
