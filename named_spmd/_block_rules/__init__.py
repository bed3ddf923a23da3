"""The rules of ``_blocks``: how each torch op moves the blocks its operands' dims hold
(docs/design.md section 2.3, "Inference from the specs").

A rule takes the op's ``args``, ``kwargs``, a function giving an operand's layout and the op's
result, and returns the result's layout (a list, one per output, for ops returning several) and
the axes over which the op's contraction makes the result unreduced, or None where it does not
follow the op (the result then gets no record: opaque over what it varies over). One rule per
family of ops, looked up by the op's name in :data:`RULES` (this module): ``layout`` holds the
layout type and the helpers the rules share, ``shapes`` the rules of ops that keep or move dims,
``products`` those of ops that reduce or contract them.
"""

from __future__ import annotations

from .layout import NONE, PLAIN, Layout, Rule, _broadcast, _broadcast_shape, _Shaped, is_plain
from .products import (
    WITH_BIAS,
    _addmm,
    _along_dim,
    _attention,
    _dot,
    _einsum,
    _linear,
    _matmul,
    _matmul_layout,
    _reduction,
    _rmatmul,
    bias,
)
from .shapes import (
    _elementwise,
    _expand,
    _getitem,
    _last_two,
    _movedim,
    _permute,
    _pieces,
    _repeat,
    _reshaped,
    _reverse,
    _same,
    _select,
    _squeeze,
    _t,
    _transpose,
    _unsqueeze,
)

__all__ = [
    "NONE",
    "PLAIN",
    "RULES",
    "WITH_BIAS",
    "Layout",
    "Rule",
    "bias",
    "is_plain",
    "_broadcast",
    "_broadcast_shape",
    "_matmul_layout",
    "_Shaped",
]


_ELEMENTWISE = (
    "add sub mul div true_divide divide multiply subtract rsub pow neg negative positive exp "
    "exp2 expm1 log log1p log2 log10 sin cos tan tanh sinh cosh asin acos atan atan2 sigmoid "
    "logsigmoid relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish "
    "hardsigmoid softplus abs sqrt rsqrt square reciprocal sign where clamp clip clamp_min "
    "clamp_max maximum minimum fmax fmin lerp addcmul addcdiv erf erfc masked_fill dropout "
    "nan_to_num floor ceil round trunc frac hypot copysign remainder fmod floor_divide "
    "logical_not logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor "
    "bitwise_not eq ne lt le gt ge isnan isinf isfinite zeros_like ones_like full_like "
    "empty_like sinc logit xlogy __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ "
    "__rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__ __pow__ __rpow__ __ipow__ __neg__ "
    "__pos__ __abs__ __and__ __or__ __xor__ __invert__ __eq__ __ne__ __lt__ __le__ __gt__ "
    "__ge__ __mod__ __floordiv__ __rfloordiv__"
).split()


_SAME = (
    "clone contiguous detach to type float double half bfloat16 cpu cuda requires_grad real "
    "imag conj"
).split()


RULES: dict[str, Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(_SAME, _same),
    **dict.fromkeys(("transpose", "swapaxes", "swapdims"), _transpose),
    "t": _t,
    "T": _reverse,
    "H": _reverse,
    "mT": _last_two,
    "mH": _last_two,
    "permute": _permute,
    **dict.fromkeys(("movedim", "moveaxis"), _movedim),
    **dict.fromkeys(
        ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten"), _reshaped
    ),
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    **dict.fromkeys(("expand", "expand_as", "broadcast_to"), _expand),
    "repeat": _repeat,
    "__getitem__": _getitem,
    **dict.fromkeys(("select", "unbind"), _select),
    "narrow": _pieces(1),
    **dict.fromkeys(("chunk", "split", "tensor_split"), _pieces(2)),
    **dict.fromkeys(
        "sum nansum mean nanmean amax amin max min prod logsumexp all any".split(), _reduction
    ),
    **dict.fromkeys(("softmax", "log_softmax", "cumsum", "cumprod"), _along_dim),
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm", "mv"), _matmul),
    "__rmatmul__": _rmatmul,
    "linear": _linear,
    **dict.fromkeys(("addmm", "baddbmm", "addmv", "addbmm"), _addmm),
    **dict.fromkeys(("dot", "vdot", "inner"), _dot),
    "einsum": _einsum,
    "scaled_dot_product_attention": _attention,
}
