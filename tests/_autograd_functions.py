"""Custom autograd Functions that tests build around a backward of their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def identity_function(
    backward: Callable[[torch.Tensor], Any], base: type = torch.autograd.Function
) -> type:
    """An autograd Function (a subclass of ``base``): a view of its input forward
    (``x.view_as(x)``), ``backward(g)`` backward."""

    class Identity(base):  # type: ignore[valid-type,misc]
        @staticmethod
        def forward(x):
            return x.view_as(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return backward(g)

    return Identity
