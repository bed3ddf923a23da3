"""optree glue: spec prefix broadcasting, key paths and structure errors."""

from __future__ import annotations

import collections
import dataclasses
import operator
import re
from typing import Any

import optree
import torch

from . import _torch_private as torch_private
from ._errors import SpecError
from ._spec import PartitionSpec, specialize


def is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


_ADDRESS = re.compile(r"(?<= at )0x[0-9a-fA-F]+(?=>)")  # a default repr's address


def without_addresses(text: str) -> str:
    """``text`` (a tree's, its specs') with the addresses of default ``repr``s (a custom node's
    metadata) left out: they differ between processes, so ranks compare what remains."""
    return _ADDRESS.sub("0x", text)


def path_text(path: tuple) -> str:
    """optree path (0, 'w') as ``[0]['w']``."""
    return "".join(f"[{k!r}]" for k in path)


_broadcast_cache: dict[tuple, list[PartitionSpec]] = {}


def broadcast_specs(specs: Any, tree: Any, what: str, where: str) -> list[PartitionSpec]:
    """One PartitionSpec per leaf of ``tree`` (None in specs means P()); mismatch raises.

    Results are cached per (specs structure and leaves, tree structure): every call of a mapped
    function broadcasts the same specs over the same structure. (The structures are part of the
    key because a tuple of one P('b', 'a') equals P(('b', 'a')) as a tuple.)"""
    if torch_private.memo_would_be_guarded():  # (and Dynamo cannot hash a treespec)
        plain = _plain_prefix(specs, tree) if _plain(tree) else None
        return plain if plain is not None else _broadcast_specs(specs, tree, what, where)
    key: tuple | None
    try:
        spec_leaves, spec_tree = optree.tree_flatten(specs, is_leaf=is_spec_leaf, none_is_leaf=True)
        key = (spec_tree, tuple(spec_leaves), optree.tree_structure(tree, none_is_leaf=True))
        hit = _broadcast_cache.get(key)
    except (TypeError, ValueError):  # unhashable leaves: no caching (the check below explains)
        key = hit = None
    if hit is not None:
        return list(hit)
    result = _broadcast_specs(specs, tree, what, where)
    if key is not None:
        if len(_broadcast_cache) > 1024:
            _broadcast_cache.clear()
        _broadcast_cache[key] = result
    return list(result)


def _plain_prefix(specs: Any, tree: Any) -> list[PartitionSpec] | None:
    """``specs`` broadcast over a tree of tuples, lists and dicts in optree's leaf order, as
    :func:`_broadcast_specs` would, without optree (:func:`flatten_with_paths` says why); None
    where ``specs`` is no prefix of ``tree`` (optree's broadcast then names the mismatch)."""
    out: list[PartitionSpec] = []
    return out if _prefix(specs, tree, out) else None


def _prefix(specs: Any, tree: Any, out: list[PartitionSpec]) -> bool:
    if is_spec_leaf(specs):
        leaves: list[Any] = []
        _walk(tree, (), [], leaves)
        out.extend([PartitionSpec() if specs is None else specs] * len(leaves))
        return True
    kind = type(tree)
    if type(specs) is not kind:
        return False
    if kind is dict:
        keys = optree.utils.total_order_sorted(tree)
        return specs.keys() == tree.keys() and all(_prefix(specs[k], tree[k], out) for k in keys)
    return len(specs) == len(tree) and all(_prefix(s, t, out) for s, t in zip(specs, tree))


def _broadcast_specs(specs: Any, tree: Any, what: str, where: str) -> list[PartitionSpec]:
    try:
        full = optree.tree_broadcast_prefix(
            _in_key_order(specs, tree), tree, is_leaf=is_spec_leaf, none_is_leaf=True
        )
    except (ValueError, TypeError):
        got = optree.tree_structure(specs, is_leaf=is_spec_leaf, none_is_leaf=True)
        want = optree.tree_structure(tree, none_is_leaf=True)
        value = "arguments" if what == "in_specs" else "output"
        # optree's own message prints whole tensors: name the first mismatching node instead
        found = _first_mismatch(specs, tree, ())
        at = (
            f"  at {what}{path_text(found[0])}: {what} has {found[1]} where the {value} "
            f"{'have' if value == 'arguments' else 'has'} {found[2]}\n"
            if found
            else ""
        )
        structures = f"  {what} structure: {got}\n  {value} structure: {want}\n"
        if found and len(structures) > 400:  # large trees: the named mismatch says enough
            structures = ""
        raise SpecError(
            f"{where}: {what} is not a pytree prefix of the {value}.\n{at}{structures}"
            f"Fix: give one P(...) per {'argument' if what == 'in_specs' else 'output'} (a single "
            "P applies to every tensor below it), e.g. "
            + (
                "in_specs=(P('dp'), P()) for f(x, w)."
                if what == "in_specs"
                else "out_specs=(P('dp'), P()) for `return y, loss`."
            )
        ) from None
    return spec_leaves(full)


def _in_key_order(specs: Any, tree: Any) -> Any:
    """``specs`` with each mapping whose keys are those of ``tree``'s mapping there rebuilt in the
    kind and key order ``tree`` flattens in. optree matches a dict of specs to an OrderedDict by
    key but keeps the specs' own order, so the flattened specs would pair with the wrong leaves."""
    if is_spec_leaf(specs):
        return specs
    if isinstance(specs, dict) and isinstance(tree, dict) and specs.keys() == tree.keys():
        ordered = isinstance(tree, collections.OrderedDict)  # (dict, defaultdict: sorted keys)
        keys = tree if ordered else optree.utils.total_order_sorted(tree)
        kind = collections.OrderedDict if ordered else dict
        return kind((k, _in_key_order(specs[k], tree[k])) for k in keys)
    if type(specs) is not type(tree):
        return specs  # (a mismatch: the broadcast names it)
    try:  # a tuple, list, namedtuple or registered node: its children, aligned in turn
        ours = optree.tree_flatten_one_level(specs, none_is_leaf=True)
        theirs = optree.tree_flatten_one_level(tree, none_is_leaf=True)
    except ValueError:
        return specs
    if ours.entries != theirs.entries:
        return specs
    children = [_in_key_order(s, t) for s, t in zip(ours.children, theirs.children)]
    return ours.unflatten_func(ours.metadata, children)


def _describe(x: Any) -> str:
    if isinstance(x, _Described):  # a leaf of a traced call's skeleton, already described
        return str(x)
    if isinstance(x, dict):
        return f"a dict with keys {sorted(x, key=repr)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    if hasattr(x, "shape"):
        return f"a {type(x).__name__} of shape {list(x.shape)}"
    return f"a {type(x).__name__}"


def _key_difference(specs: dict, tree: dict) -> str:
    """The keys two dicts disagree on, named (their full key lists can be long)."""

    def keys(ks: set) -> str:
        return ", ".join(repr(k) for k in sorted(ks, key=repr))

    missing, extra = tree.keys() - specs.keys(), specs.keys() - tree.keys()
    parts = [f"no entry for {keys(missing)}"] if missing else []
    parts += [f"an extra entry for {keys(extra)}"] if extra else []
    return "a dict with " + " and ".join(parts)


def _first_mismatch(specs: Any, tree: Any, path: tuple) -> tuple[tuple, str, str] | None:
    """(key path, specs node, value node) of the first place ``specs`` is not a prefix."""
    if is_spec_leaf(specs):
        return None
    if isinstance(specs, dict) and isinstance(tree, dict) and specs.keys() != tree.keys():
        return path, _key_difference(specs, tree), f"a dict of {len(tree)} keys"
    s = optree.tree_flatten_one_level(specs, is_leaf=is_spec_leaf, none_is_leaf=True)
    try:
        t = optree.tree_flatten_one_level(tree, none_is_leaf=True)
    except ValueError:  # a leaf where the specs have a container
        return path, _describe(specs), _describe(tree)
    if type(specs) is not type(tree) or tuple(s.entries) != tuple(t.entries):
        return path, _describe(specs), _describe(tree)
    for entry, sc, tc in zip(s.entries, s.children, t.children):
        found = _first_mismatch(sc, tc, (*path, entry))
        if found:
            return found
    return None


def check_spec_types(specs: Any, what: str, where: str) -> None:
    bad = [
        what + path_text(p) + f" = {leaf!r}"
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


def spec_leaves(specs: Any) -> list[PartitionSpec]:
    """The PartitionSpecs of a specs tree, P() for each None."""
    leaves = optree.tree_leaves(specs, is_leaf=is_spec_leaf, none_is_leaf=True)
    return [PartitionSpec() if s is None else s for s in leaves]


def leaf_skeleton(tree: Any) -> Any:
    """``tree`` with each leaf replaced by its description in error messages (a string: a
    constant to a trace), for :func:`in_spec_index`; None where ``tree`` holds a container
    other than a tuple, list or dict, or a leaf other than a tensor or a scalar."""
    return _skeleton(tree) if _plain(tree) else None


def _plain(tree: Any) -> bool:
    kind = type(tree)
    if kind is tuple or kind is list:
        return all(_plain(x) for x in tree)
    if kind is dict:
        return all(_plain(x) for x in tree.values())
    return tree is None or isinstance(tree, (torch.Tensor, int, float, str))


def _skeleton(tree: Any) -> Any:
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind(_skeleton(x) for x in tree)
    if kind is dict:
        return {k: _skeleton(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) and torch_private.has_data_dependent_size(tree):
        # a size known only when the program runs: Dynamo can neither specialize nor format it
        unknown = ", ".join("?" * tree.dim())
        return f"a {type(tree).__name__} of shape [{unknown}]"
    if isinstance(tree, torch.Tensor):
        specialize(tree.shape)  # symbolic dims would make the description no constant
        return _describe(tree)
    # a scalar by its type alone: an int that Dynamo made symbolic (a step counter) has no
    # `shape` for _describe to ask about, and its value would be specialized
    return f"a {type(tree).__name__}"


class _Described(str):
    """A leaf's description standing for the leaf (:func:`in_spec_index`)."""


@torch_private.trace_constant  # Dynamo would guard the in_specs tree spec by spec
def in_spec_index(fn: Any, skeleton: Any) -> tuple[int, ...] | str:
    """For each leaf of ``skeleton`` (:func:`leaf_skeleton` of a mapped function's arguments),
    where its spec is in ``fn._in_spec_table``; the error's message where the arguments do not
    fit in_specs (the eager call's message: the skeleton describes the leaves)."""
    tree = optree.tree_map(_Described, skeleton, none_is_leaf=True)
    try:
        specs = broadcast_specs(fn.in_specs, tree, "in_specs", fn.where)
    except SpecError as e:
        return str(e)
    return tuple(fn._in_spec_table.index(s) for s in specs)


def flatten_with_paths(tree: Any) -> tuple[list[tuple], list[Any], Any]:
    """Paths, leaves and a treedef for :func:`unflatten` (``None`` a leaf), in optree's order.

    While Dynamo traces, a tree of tuples, lists and dicts is walked here instead of by optree:
    torch's stand-in for optree's dict flatten is written for an older optree, and where a dict
    holds no tensor (``{"step": 3}``) Dynamo runs optree's own function instead, whose result
    (an ``optree.registry.DictMetaData``) it cannot hold, and refuses the call."""
    if torch.compiler.is_compiling() and _plain(tree):
        paths: list[tuple] = []
        leaves: list[Any] = []
        _walk(tree, (), paths, leaves)
        return paths, leaves, PlainTree(tree)
    return optree.tree_flatten_with_path(tree, none_is_leaf=True)


class PlainTree:
    """The treedef of a traced tree of tuples, lists and dicts: the tree itself, whose leaves
    :func:`unflatten` replaces in :func:`_walk`'s order."""

    def __init__(self, template: Any):
        self.template = template


def _walk(tree: Any, path: tuple, paths: list[tuple], leaves: list[Any]) -> None:
    """optree's order: a dict's values by its sorted keys (``total_order_sorted``)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        for i, x in enumerate(tree):
            _walk(x, (*path, i), paths, leaves)
    elif kind is dict:
        for k in optree.utils.total_order_sorted(tree):
            _walk(tree[k], (*path, k), paths, leaves)
    else:
        paths.append(path)
        leaves.append(tree)


def _rebuild(template: Any, leaves: Any) -> Any:
    kind = type(template)
    if kind is tuple or kind is list:
        return kind(_rebuild(x, leaves) for x in template)
    if kind is dict:  # filled in sorted order, keyed in the template's own order
        values = {
            k: _rebuild(template[k], leaves) for k in optree.utils.total_order_sorted(template)
        }
        return {k: values[k] for k in template}
    return next(leaves)


def unflatten(treedef: Any, leaves: list[Any]) -> Any:
    """The tree of :func:`flatten_with_paths`' ``treedef`` with ``leaves``."""
    if isinstance(treedef, PlainTree):
        return _rebuild(treedef.template, iter(leaves))
    return optree.tree_unflatten(treedef, leaves)


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves and treespec (``None`` a leaf); the paths only where needed (:func:`paths_of`)."""
    return optree.tree_flatten(tree, none_is_leaf=True)


def flatten_known(tree: Any, known: dict) -> tuple[list[Any], Any]:
    """:func:`flatten`, for a tree of tuples, lists and dicts with string keys over tensors and
    plain values (a model's arguments) walked here, its treedef looked up in ``known`` (a
    mapped function's, by the walk's key of the structure): optree sorts each dict's keys on
    every flatten, the walk once per key order. Any other tree, and a structure not yet in
    ``known``, is optree's; a walk whose leaves optree's flatten does not give leaves nothing
    in ``known``, so the next call is optree's again."""
    leaves: list[Any] = []
    try:
        key = _plain_structure(tree, leaves)
    except RecursionError:  # (a tree nested deeper than the walk's frames allow: optree's)
        key = None
    treedef = None if key is None else known.get(key)
    if treedef is not None:
        return leaves, treedef
    flat, treedef = flatten(tree)
    if key is not None and len(flat) == len(leaves) and all(map(operator.is_, flat, leaves)):
        if len(known) >= 256:
            known.clear()
        known[key] = treedef
    return flat, treedef


#: a dict's keys in their order -> in optree's (sorted: string keys only)
_SORTED_KEYS: dict[tuple, tuple] = {}
#: types whose values are leaves of a plain tree (a tensor subclass is added when first seen)
_LEAF_TYPES = {torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, complex, str}
_STR = frozenset((str,))


def _plain_structure(tree: Any, leaves: list[Any]) -> Any:
    """``tree``'s leaves appended to ``leaves`` in optree's order, and a key of its structure
    (the container types, a dict's keys in its own order, which places hold leaves); None
    where it is no plain tree (:func:`flatten_known`)."""
    kind = type(tree)
    if kind is dict:
        keys = tuple(tree)
        # (every call: a str subclass's key, an enum's, equals and hashes as its str, and
        # would find the plain keys' entries, whose treedef hands the function plain str)
        if not set(map(type, keys)) <= _STR:  # (a loop in C: a model's dict has many keys)
            return None
        order = _SORTED_KEYS.get(keys)
        if order is None:
            if len(_SORTED_KEYS) >= 256:
                _SORTED_KEYS.clear()
            order = _SORTED_KEYS[keys] = tuple(sorted(keys))
        values = [tree[k] for k in order]
        if _all_leaves(values):  # the common case: a dict of parameters
            leaves += values
            return (dict, keys)
        parts = tuple(_part(x, leaves) for x in values)
        return None if None in parts else (dict, keys, parts)
    if kind is tuple or kind is list:
        parts = tuple(_part(x, leaves) for x in tree)
        return None if None in parts else (kind, parts)
    return None


_LEAF = 0  # a leaf's place in a structure's key


def _part(x: Any, leaves: list[Any]) -> Any:
    if _leaf_type(type(x)):
        leaves.append(x)
        return _LEAF
    return _plain_structure(x, leaves)


def _leaf_type(kind: type) -> bool:
    if kind in _LEAF_TYPES:
        return True
    if issubclass(kind, torch.Tensor):  # checked against optree's leaves (``flatten_known``)
        _LEAF_TYPES.add(kind)
        return True
    return False


def _all_leaves(values: list[Any]) -> bool:
    return set(map(type, values)) <= _LEAF_TYPES


def paths_of(tree: Any) -> list[tuple]:
    return optree.tree_paths(tree, none_is_leaf=True)


_SCALARS = (type(None), bool, int, float, complex, str)


def opaque_tensor_holder(leaf: Any) -> bool:
    """Whether a non-tensor leaf holds tensors that optree cannot see (a dataclass or a plain
    object with tensor attributes): its tensors would escape the type check and the assembly."""
    # a scalar first: an int that Dynamo made symbolic (a step counter) has no __dict__ to ask
    if isinstance(leaf, (torch.Tensor, type, *_SCALARS)) or not (
        dataclasses.is_dataclass(leaf) or hasattr(leaf, "__dict__")
    ):
        return False
    if dataclasses.is_dataclass(leaf):
        values: Any = [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    else:
        values = list(vars(leaf).values())
    return any(isinstance(v, torch.Tensor) for v in optree.tree_leaves(values, none_is_leaf=True))


def opaque_leaf_problem(where: str, leaf: Any) -> str:
    name = type(leaf).__name__
    return (
        f"{where} is a {name} holding tensors, which optree treats as one opaque leaf, so its "
        "tensors would not be split, checked or assembled. Fix: pass and return tensors in "
        "tuples, lists, dicts or namedtuples"
        + (" (e.g. dataclasses.asdict(value))." if dataclasses.is_dataclass(leaf) else ".")
    )
