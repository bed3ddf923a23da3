"""A mapped call's input tree, walked by ``_tree.flatten_known`` where it is plain (tuples, lists,
dicts with string keys over tensors and plain values): the leaves and treedef optree gives, on
every call, and a call whose tree or leaves changed is told apart as with optree alone."""

from __future__ import annotations

import collections

import optree
import pytest
import torch

import named_spmd as ns
from named_spmd import P
from named_spmd._replay import checked_signatures
from named_spmd._tree import flatten_known

Pair = collections.namedtuple("Pair", "a b")
W = torch.nn.Parameter(torch.ones(2))

TREES = [
    (torch.ones(1), {"b": torch.ones(2), "a": W}),
    (torch.ones(1), {"a": W, "b": torch.ones(2)}),  # the same keys in another order
    ([None, 3, "s", 2.5], {"x": {"z": torch.ones(1), "y": [torch.ones(2), None]}}),
    (collections.OrderedDict(b=1, a=torch.ones(1)),),  # not plain: optree's
    ({1: torch.ones(1), 0: torch.ones(2)},),  # keys that are no strings: optree's
    (torch.ones(1), Pair(1, torch.ones(1))),
    ((), {}, []),
]


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_the_walk_gives_optrees_leaves_and_treedef(tree):
    known: dict = {}
    want_leaves, want_def = optree.tree_flatten(tree, none_is_leaf=True)
    for _ in range(3):  # optree's, then looked up
        leaves, treedef = flatten_known(tree, known)
        assert treedef == want_def
        assert len(leaves) == len(want_leaves)
        assert all(a is b for a, b in zip(leaves, want_leaves))
        assert optree.tree_unflatten(treedef, leaves) == tree


def test_a_changed_tree_is_a_new_signature_with_the_right_values():
    mesh = ns.make_mesh((1,), ("i",))

    def fn(x, p):
        return ns.psum(x * p["w"] + p["b"], "i")

    f = ns.spmd_map(fn, mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    x = torch.arange(4.0)
    calls = [
        {"w": torch.full((4,), 2.0), "b": torch.ones(4)},
        {"b": torch.ones(4), "w": torch.full((4,), 2.0)},  # other key order: optree's same tree
        {"w": torch.full((4,), 3.0), "b": torch.ones(4)},  # new values, the first signature
        {"w": torch.full((4,), 2.0), "b": torch.ones(4, dtype=torch.float64)},  # a new dtype
        {"w": torch.full((4,), 2.0), "b": 1.5},  # a plain value in place of a tensor
        {"w": torch.full((4,), 2.0), "b": 2.5},  # another value: a new signature
    ]
    for p in calls:
        torch.testing.assert_close(f(x, p), x * p["w"] + p["b"])
    assert len(checked_signatures(f)) == 4
    with pytest.raises(ns.SpmdError, match=r"size of tensor a \(3\) must match"):  # a new shape
        f(x[:3], calls[0])


class Key(str):  # a str subclass key (as a str enum's): equal to, and hashed as, its str
    pass


def test_keys_of_a_str_subclass_reach_the_function_as_themselves():
    mesh = ns.make_mesh((1,), ("i",))

    def fn(p):
        return sum(v * (10 if isinstance(k, Key) else 1) for k, v in p.items())

    f = ns.spmd_map(fn, mesh=mesh, in_specs=P(), out_specs=P())
    plain = {"a": torch.ones(2), "b": torch.ones(2)}
    sub = {Key("a"): torch.ones(2), Key("b"): torch.ones(2)}
    for p, want in ((plain, 2.0), (sub, 20.0), (plain, 2.0), (sub, 20.0)):
        torch.testing.assert_close(f(p), torch.full((2,), want))


def test_a_tree_nested_deeper_than_the_walk_is_optrees():
    tree: list = [torch.ones(1)]
    for _ in range(800):  # (deeper than the walk takes, not than optree)
        tree = [tree]
    want_leaves, want_def = optree.tree_flatten(tree, none_is_leaf=True)
    leaves, treedef = flatten_known(tree, {})
    assert treedef == want_def and len(leaves) == 1 and leaves[0] is want_leaves[0]
