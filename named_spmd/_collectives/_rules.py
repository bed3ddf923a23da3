"""The rule for primitives inside a transpose or a jvp (README.md, "Primitives inside a rule").

When a rule's result is differentiated again (a second derivative, forward mode over the
backward), torch differentiates the rule's own ops on each instance. A record applied with
``ctx.apply`` is differentiated by its declared rules (the autograd bridge). A backend primitive
called directly is not: the communicating ones (and ``pvary``, whose transpose is a psum) are
plain communication there, so the derivative would be wrong or missing. The local ``own_block``
is right only after the pvary that :meth:`Collective.backward` puts before the transpose of a
result invariant over the axes: torch's derivative of the block on one instance (the block in its
place, zeros elsewhere) is the transpose once the pvary's psum adds the members' blocks up.
``axis_index`` and ``mesh`` read no operand and are always allowed.

:func:`checked` hands such a rule a view of the context that raises a
:class:`~.._errors.CollectiveError` for the record's author instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import CollectiveError

if TYPE_CHECKING:
    from .._context import SpmdContext

#: each primitive a rule may not call on a value differentiated again, and the record to apply
_RECORD_FOR = {
    "pvary": "pvary",
    "all_reduce": "psum",  # or pmax / pmin
    "psum_in_backward": "psum",
    "all_gather": "all_gather",
    "reduce_scatter": "psum_scatter",
    "all_to_all": "all_to_all",
    "permute": "ppermute",
    "broadcast": "pbroadcast",
}


class _RuleContext:
    """``ctx`` as a rule of ``name`` sees it when the rule's result is differentiated again."""

    __slots__ = ("_ctx", "_name", "_rule", "_pvaried")

    def __init__(self, ctx: SpmdContext, name: str, rule: str, pvaried: bool) -> None:
        self._ctx, self._name, self._rule, self._pvaried = ctx, name, rule, pvaried

    def __getattr__(self, attr: str) -> Any:
        record = _RECORD_FOR.get(attr)
        if record is not None:
            raise CollectiveError(
                f"the {self._rule} of collective {self._name!r} calls the backend primitive "
                f"ctx.{attr} on a value that is differentiated again (a second derivative, or "
                "forward mode over the backward): torch would differentiate it as plain "
                "communication on each instance, not by its transpose. Fix (for the record's "
                f"author): apply the record instead, ctx.apply(RECORDS[{record!r}], value, axes, "
                "params), whose own rules the autograd bridge applies "
                "(named_spmd/_collectives/README.md, 'Primitives inside a rule')."
            )
        if attr in ("own_block", "own_block_tiled") and not self._pvaried:
            raise CollectiveError(
                f"the {self._rule} of collective {self._name!r} calls ctx.own_block on a value "
                "that is differentiated again, and that value is no pvary'd cotangent "
                "(Collective.backward pvary's the cotangent of a result invariant over the axes, "
                "as the record's vma rule says, and only that): torch's derivative of the block "
                "on one instance would not be summed over the group. Fix (for the record's "
                "author): apply a record that moves the blocks instead, e.g. "
                "ctx.apply(RECORDS['psum_scatter'], value, axes, (dim, tiled)) "
                "(named_spmd/_collectives/README.md, 'Primitives inside a rule')."
            )
        return getattr(self._ctx, attr)


def checked(ctx: SpmdContext, name: str, rule: str, pvaried: bool) -> Any:
    """``ctx`` for the ``rule`` ("transpose" or "jvp") of record ``name`` whose result is
    differentiated again; ``pvaried``: its operand went through a pvary over the axes."""
    return _RuleContext(ctx, name, rule, pvaried)
