"""functorch: entering vmap levels ourselves, reading a tensor's batch levels, and the hooks the
simulated backend installs in torch's printing and in torch.func's grad levels and gradients."""

from __future__ import annotations

import contextlib
import copy
import copyreg
from collections.abc import Callable
from typing import Any

import torch

# --- functorch: entering vmap levels ourselves and reading a tensor's batch levels --------------
# The simulated backend enters one vmap level per mesh axis directly (torch.func.vmap's own
# wrappers cost more than a small collective) and reads a tensor's vma off its levels.
functorch = torch._C._functorch
maybe_get_level = functorch.maybe_get_level
maybe_get_bdim = functorch.maybe_get_bdim
get_unwrapped = functorch.get_unwrapped
is_batchedtensor = functorch.is_batchedtensor
is_transform_wrapped = functorch.is_functorch_wrapped_tensor
maybe_current_level = functorch.maybe_current_level
get_interpreter_stack = functorch.get_interpreter_stack
add_batch_dim = functorch._add_batch_dim
remove_batch_dim = functorch._remove_batch_dim
unwrap_if_dead = functorch.unwrap_if_dead
vmap_increment_nesting = functorch._vmap_increment_nesting
vmap_decrement_nesting = functorch._vmap_decrement_nesting
unwrap_for_grad = functorch._unwrap_for_grad
wrap_for_grad = functorch._wrap_for_grad
TransformType = functorch.TransformType
#: The transforms that differentiate (torch.func.grad / vjp, and jvp).
GRAD_LIKE = (TransformType.Grad, TransformType.Jvp)
transforms_active = torch._C._are_functorch_transforms_active
# Plain tensors even under functionalize & co (cached tokens and permutation tables).
DisableFuncTorch = torch._C._DisableFuncTorch


def innermost(x: torch.Tensor) -> torch.Tensor:
    """The tensor every torch.func transform's wrapper around ``x`` holds (a vmap's: with its
    batch dims as data)."""
    while is_transform_wrapped(x):
        x = get_unwrapped(x)
    return x


def lazy_load_decompositions() -> None:
    """torch.func.vmap registers some batching rules on first use; we enter levels ourselves."""
    from torch._functorch.vmap import lazy_load_decompositions as load

    load()


def current_interpreter() -> Any:
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    return retrieve_current_functorch_interpreter()


def single_level_functions() -> Any:
    """Context manager that lets a ``SingleLevelFunction`` be applied at a grad level."""
    from torch._functorch.utils import enable_single_level_autograd_function

    return enable_single_level_autograd_function()


def functional_unwrap(x: torch.Tensor, reapply_views: bool) -> torch.Tensor:
    from torch._functorch.eager_transforms import _maybe_unwrap_functional_tensor

    return _maybe_unwrap_functional_tensor(x, reapply_views=reapply_views)


def functional_wrap(x: torch.Tensor, level: int) -> torch.Tensor:
    from torch._functorch.eager_transforms import _maybe_wrap_functional_tensor

    return _maybe_wrap_functional_tensor(x, level)


def set_fwd_grad_enabled(enabled: bool) -> Any:
    from torch.autograd.forward_ad import _set_fwd_grad_enabled

    return _set_fwd_grad_enabled(enabled)


# A Function applied at one functorch level (what generate_single_level_function builds).
SingleLevelFunction = torch.autograd.function._SingleLevelFunction

# --- printing a transform's tensors --------------------------------------------------------------
# torch prints a functorch-wrapped tensor as its wrappers ("BatchedTensor(lvl=2, bdim=0, value=..."),
# through one module function that ``repr`` looks up at each call, and formats a 0-d tensor with
# ``.item()``, which vmap refuses. The simulated backend shows its values per mesh coordinate
# instead: these hooks let it answer first for a wrapped tensor; torch's own code runs whenever
# a hook returns None (every tensor that is not the backend's, and plain tensors never reach them).
is_gradtrackingtensor = functorch.is_gradtrackingtensor
_PRINT_HOOKS: dict[str, Any] = {}


def hook_wrapper_printing(text: Any, formatted: Any) -> None:
    """``text(t) -> str | None`` prints a wrapped tensor ``t`` (``repr``, ``str``, ``print``);
    ``formatted(t, spec) -> str | None`` formats one (``format``, f-strings). Installed once."""
    if not _PRINT_HOOKS:
        import torch._tensor_str as tensor_str

        torch_text = tensor_str._functorch_wrapper_str_intern
        torch_format = torch.Tensor.__format__

        def wrapper_text(tensor: torch.Tensor, *, tensor_contents: Any = None) -> str:
            shown = _PRINT_HOOKS["text"](tensor)
            return torch_text(tensor, tensor_contents=tensor_contents) if shown is None else shown

        def wrapper_format(self: torch.Tensor, format_spec: str) -> str:
            if is_transform_wrapped(self):
                shown = _PRINT_HOOKS["formatted"](self, format_spec)
                if shown is not None:
                    return shown
            return torch_format(self, format_spec)

        tensor_str._functorch_wrapper_str_intern = wrapper_text
        torch.Tensor.__format__ = wrapper_format  # type: ignore[method-assign]
    _PRINT_HOOKS.update(text=text, formatted=formatted)


def copy_wrapped_deeply() -> None:
    """``copy.deepcopy`` of a tensor a torch.func transform wrapped (vmap's batched tensors have
    no storage for ``Tensor.__deepcopy__`` to copy): a copy of its values, as a plain tensor's
    deep copy is; torch's own refusal (a tensor, not a leaf, that requires grad) as torch raises
    it; a plain leaf that requires grad (or its ``leaf_stand_in``) copied as outside any
    transform; a wrapped Parameter (``Parameter.__deepcopy__`` reads ``.data``, which vmap
    refuses) a Parameter of a copy of its values. Installed once."""
    if _DEEPCOPY:
        return
    torch_deepcopy = torch.Tensor.__deepcopy__

    def deepcopy(self: torch.Tensor, memo: dict) -> torch.Tensor:
        if not is_transform_wrapped(self) or id(self) in memo:
            self = _STAND_INS.get(self, self)
            if self.requires_grad and self.is_leaf and transforms_active():
                # a leaf that no transform wraps (an instance's replicated input): torch's copy
                # is a new leaf that requires grad, as a real mesh's rank makes it; the
                # transform refuses that ``requires_grad_`` only to guard its own wrappers
                with _requires_grad_allowed():
                    return torch_deepcopy(self, memo)
            return torch_deepcopy(self, memo)
        inner = innermost(self)
        if not inner.is_leaf:  # (requires grad: torch's error, as a real mesh's rank raises it)
            return torch_deepcopy(inner, memo)
        with torch.no_grad():
            copied = self.clone()
        memo[id(self)] = copied
        return copied

    torch.Tensor.__deepcopy__ = deepcopy  # type: ignore[method-assign]
    _DEEPCOPY["torch"] = torch_deepcopy
    torch_parameter_deepcopy = torch.nn.Parameter.__deepcopy__

    def deepcopy_parameter(self: torch.nn.Parameter, memo: dict) -> torch.nn.Parameter:
        # torch's reads ``self.data``, which vmap refuses: a Parameter of a copy of its values
        if not is_transform_wrapped(self) or id(self) in memo:
            return torch_parameter_deepcopy(self, memo)
        with torch.no_grad():
            copied = type(self)(self.clone(), self.requires_grad)
        memo[id(self)] = copied
        return copied

    torch.nn.Parameter.__deepcopy__ = deepcopy_parameter  # type: ignore[method-assign, assignment]


_DEEPCOPY: dict[str, Any] = {}


def copy_wrapped_shallowly() -> None:
    """``copy.copy`` of a tensor a torch.func transform wrapped (``Tensor.__reduce_ex__``, what
    ``copy.copy`` of a tensor runs, refuses vmap's batched tensors): its ``detach()``, a new
    tensor of the same values and storage (a write through it reaches the original) through
    which no gradient flows, as torch's shallow copy of a plain tensor is. Any other tensor is
    copied as ``copy.copy`` copies it without this hook (its ``__reduce_ex__``). Installed once
    (``Tensor.__copy__``, which torch does not define)."""
    if "__copy__" in vars(torch.Tensor):
        return

    def shallow_copy(self: torch.Tensor) -> torch.Tensor:
        if is_transform_wrapped(self):
            return self.detach()
        reductor = copyreg.dispatch_table.get(type(self))
        reduced = reductor(self) if reductor is not None else self.__reduce_ex__(4)
        return copy._reconstruct(self, None, *reduced)  # type: ignore[attr-defined]

    torch.Tensor.__copy__ = shallow_copy  # type: ignore[attr-defined]


def parameters_made_wrapped(leaf_below: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """``torch.nn.Parameter(data)`` of a tensor a torch.func transform wraps: torch's (the
    wrapper reads ``requires_grad``, but autograd tracks no op on it: the ops run on the value
    it wraps, which ``_make_subclass`` detached), then the value ``leaf_below(p)`` names, if
    any, made a leaf that requires grad, so the ops on ``p`` are tracked beneath the wrapper.
    Any other Parameter is torch's. Installed once (``Parameter.__new__``)."""
    if "torch" in _PARAMETER_NEW:
        return
    torch_new = torch.nn.Parameter.__new__

    def new(cls: type, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        made: torch.Tensor = torch_new(cls, data, requires_grad)
        if requires_grad and transforms_active() and is_transform_wrapped(made):
            leaf = leaf_below(made)
            if leaf is not None and leaf.is_leaf and not leaf.requires_grad:
                with _requires_grad_allowed():
                    leaf.requires_grad_()
        return made

    torch.nn.Parameter.__new__ = staticmethod(new)  # type: ignore[method-assign]
    _PARAMETER_NEW["torch"] = torch_new


_PARAMETER_NEW: dict[str, Any] = {}


# stand-in -> the leaf it stands for (``leaf_stand_in``)
_STAND_INS: Any = torch.utils.weak.WeakIdKeyDictionary()


def leaf_stand_in(x: torch.Tensor) -> torch.Tensor:
    """``x.view_as(x)``: a tensor object of its own for one instance, which ``copy.deepcopy``
    copies as ``x`` itself where ``x`` is a leaf that requires grad (a new leaf, as a real mesh's
    rank copies its replicated input; a view is no leaf, and torch refuses to copy it)."""
    stand_in = x.view_as(x)
    if x.is_leaf and x.requires_grad:
        _STAND_INS[stand_in] = x
    return stand_in


def _requires_grad_allowed() -> Any:
    """Context manager under which ``requires_grad_`` runs inside a torch.func transform."""
    from torch._functorch.eager_transforms import enable_inplace_requires_grad

    return enable_inplace_requires_grad(True)


def export_clones_allowed() -> Any:
    """Context manager for the vmap levels a Dynamo trace enters (the simulated compile path's
    ``torch.func.vmap``). While strict ``torch.export`` traces, Dynamo keeps a clone of each
    tensor it meets first (its real-value cache) and sets a leaf's clone's ``requires_grad`` in
    place, which functorch refuses inside a transform: a parameter that the mapped function
    reads without taking it as an argument (a mapped method's ``self.w``, a closed-over layer's
    weight) is met first inside the levels, where that refusal would fail the export. Under
    this manager functorch allows it (``enable_inplace_requires_grad``; Dynamo runs the toggle
    while tracing and leaves no trace of it in the program). Elsewhere (eager, non-strict
    export, torch.compile) it does nothing: no clone is made there, and a ``requires_grad_``
    of the user's inside the levels stays refused as eagerly."""
    if torch.compiler.is_exporting() and torch.compiler.is_dynamo_compiling():
        return _requires_grad_allowed()
    return contextlib.nullcontext()


def batch_neg_views() -> None:
    """A vmap batching rule for ``aten::_neg_view`` (what ``x.conj().imag`` of a complex ``x``
    makes), which torch lacks: the simulated mesh runs every instance under vmap, where a real
    mesh's rank runs the op plainly. The rule takes the view of the batched value itself, so a
    write through it reaches its base as on a rank. Installed once, unless torch has its own
    (among the rules vmap registers on first use: loaded first, so that none of them overrides
    this one later)."""
    lazy_load_decompositions()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_neg_view", "FuncTorchBatched"):
        torch.library.register_vmap("aten::_neg_view", _neg_view_batched)


def _neg_view_batched(info: Any, in_dims: tuple, x: torch.Tensor) -> tuple:
    return torch._neg_view(x), in_dims[0]


# --- entering a grad level ----------------------------------------------------------------------
# torch.func.grad, grad_and_value and vjp (so jacrev and hessian too) enter their grad level
# through one context manager, which looks up ``_grad_increment_nesting`` /
# ``_grad_decrement_nesting`` as globals of eager_transforms at each call. The simulated backend
# wraps those two names to learn when a grad level is entered inside its call (its implicit pvary
# then needs a real op: backends/simulated/_inner_grad.py), at no cost to any other code. Dynamo
# traces the context manager itself (by identity), never these globals, so compiled code is
# unaffected.
_GRAD_HOOKS: dict[str, Any] = {}


def hook_grad_levels(entered: Any, leaving: Any) -> None:
    """``entered(level)`` right after a grad level is entered, ``leaving(level)`` right before
    one is left (also when the transform raises). Installed once."""
    if not _GRAD_HOOKS:
        import torch._functorch.eager_transforms as eager

        increment, decrement = eager._grad_increment_nesting, eager._grad_decrement_nesting

        def grad_increment_nesting() -> int:
            level = increment()
            _GRAD_HOOKS["entered"](level)
            return level

        def grad_decrement_nesting() -> Any:
            _GRAD_HOOKS["leaving"](functorch.maybe_current_level())
            return decrement()

        eager._grad_increment_nesting = grad_increment_nesting
        eager._grad_decrement_nesting = grad_decrement_nesting
    _GRAD_HOOKS.update(entered=entered, leaving=leaving)


# --- the gradients of torch.func.grad and vjp -----------------------------------------------------
# torch.func.grad (and grad_and_value) and vjp's pullback (so jacrev and hessian too) compute their
# gradients through ``_autograd_grad``, looked up as a global of eager_transforms at each call. The
# simulated backend wraps it to give each gradient its input's type inside its call
# (backends/simulated/_inner_grad.py), at no cost to any other code.
_GRADIENT_HOOKS: dict[str, Any] = {}


def hook_transform_gradients(after: Any) -> None:
    """``after(inputs, grads)`` (returning the gradients) on every tuple of gradients that
    torch.func.grad or vjp computes. Installed once."""
    if not _GRADIENT_HOOKS:
        import torch._functorch.eager_transforms as eager

        compute = eager._autograd_grad

        def autograd_grad(
            outputs: Any,
            inputs: Any,
            grad_outputs: Any = None,
            retain_graph: bool = False,
            create_graph: bool = True,
        ) -> tuple:
            grads = compute(outputs, inputs, grad_outputs, retain_graph, create_graph)
            return _GRADIENT_HOOKS["after"](inputs, grads)

        eager._autograd_grad = autograd_grad
    _GRADIENT_HOOKS.update(after=after)


#: ``scaled_dot_product_attention``'s math decomposition, ``(q, k, v, attn_mask, dropout_p,
#: is_causal, *, scale) -> (out, weights)``: plain ops, which batch under vmap (the CPU flash
#: kernel sdpa picks has no batching rule: vmap runs it once per instance).
sdpa_math = torch.ops.aten._scaled_dot_product_attention_math
