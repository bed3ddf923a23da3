"""optree glue: spec prefix broadcasting, key paths and structure errors."""

from __future__ import annotations

from typing import Any

import optree

from ._errors import SpecError
from ._spec import PartitionSpec


def is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def path_text(path: tuple) -> str:
    """optree path (0, 'w') as ``[0]['w']``."""
    return "".join(f"[{k!r}]" for k in path)


def broadcast_specs(specs: Any, tree: Any, what: str, where: str) -> list[PartitionSpec]:
    """One PartitionSpec per leaf of ``tree`` (None in specs means P()); mismatch raises."""
    try:
        full = optree.tree_broadcast_prefix(specs, tree, is_leaf=is_spec_leaf, none_is_leaf=True)
    except (ValueError, TypeError) as e:
        got = optree.tree_structure(specs, is_leaf=is_spec_leaf, none_is_leaf=True)
        want = optree.tree_structure(tree, none_is_leaf=True)
        raise SpecError(
            f"{where}: {what} is not a pytree prefix of the {'arguments' if what == 'in_specs' else 'output'}.\n"
            f"  {what} structure: {got}\n  value structure: {want}\n  ({e})\n"
            f"Fix: give one P(...) per {'argument' if what == 'in_specs' else 'output'} (a single "
            "P applies to every tensor below it), e.g. in_specs=(P('dp'), P()) for f(x, w)."
        ) from None
    leaves = optree.tree_leaves(full, is_leaf=is_spec_leaf, none_is_leaf=True)
    return [PartitionSpec() if s is None else s for s in leaves]


def check_spec_types(specs: Any, what: str, where: str) -> None:
    bad = [
        path_text(p) + f" = {leaf!r}"
        for p, leaf in zip(
            *optree.tree_flatten_with_path(specs, is_leaf=is_spec_leaf, none_is_leaf=True)[:2]
        )
        if not is_spec_leaf(leaf)
    ]
    if bad:
        raise SpecError(
            f"{where}: {what} must contain PartitionSpecs; found {', '.join(bad)}. "
            "Fix: wrap axis names in P(...), e.g. P('dp') instead of 'dp'."
        )


def flatten_with_paths(tree: Any) -> tuple[list[tuple], list[Any], Any]:
    return optree.tree_flatten_with_path(tree, none_is_leaf=True)
