"""torch-only repros (no named_spmd) of what stops ``torch.compile`` of a piece *inside* a
per-device function on a real mesh (torch 2.13 CPU), where named_spmd's ``VmaMode`` (a
``TorchFunctionMode``) is active around the compiled function.

    python docs/repros/outer_mode_and_compiled_piece.py

1. Dynamo traces the outer mode into the graph, and the compiled code then runs under the same
   mode again. With the ``eager`` backend the mode's effect applies twice (2.0 instead of 1.0);
   with ``aot_eager`` the graph's aten ops (``aten.tanh.default``, not ``torch.tanh``) and, with
   Inductor, its wrapper's extern calls (``torch.addmm(..., out=buf)``) reach the mode at run
   time: a type-tracking mode would type the graph's internal buffers a second time.
2. Attributes written on tensors by the mode while Dynamo traces are replayed on the compiled
   function's outputs, and a per-call token compared with ``is`` does not recompile (only the
   stamped value does): the tracing half of the design works.
"""

import torch
from torch._dynamo.testing import CompileCounter
from torch.overrides import TorchFunctionMode


class AddOne(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1 if func is torch.tanh else out


class Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not torch.compiler.is_compiling():  # run time only
            self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class Token:
    pass


class Stamp(TorchFunctionMode):
    def __init__(self, token):
        super().__init__()
        self.token = token

    def __torch_function__(self, func, types, args=(), kwargs=None):
        v = 0
        for a in args:
            s = getattr(a, "_stamp", None) if isinstance(a, torch.Tensor) else None
            if s is not None and s[0] is self.token:
                v = max(v, s[1])
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and v:
            out._stamp = (self.token, v)
        return out


def main() -> None:
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        f = torch.compile(torch.tanh, backend=backend, fullgraph=True)
        with AddOne():
            print(f"1. {backend}: tanh(0) + 1 under an outer mode = {f(torch.zeros(1)).item()}")
        torch._dynamo.reset()
        g = torch.compile(lambda x, w: torch.tanh(x @ w), backend=backend, fullgraph=True)
        x, w = torch.randn(4, 3), torch.randn(3, 2)
        g(x, w)
        seen = Seen()
        with seen:
            g(x, w)
        print(f"   {backend}: the outer mode saw at run time {seen.names}")
    counter = CompileCounter()
    h = torch.compile(lambda x: torch.tanh(x) * 2, backend=counter, fullgraph=True)
    for step, value in enumerate((1, 2, 1)):
        token, x = Token(), torch.randn(3)
        x._stamp = (token, value)
        with Stamp(token):
            y = h(x)
        got = getattr(y, "_stamp", None)
        print(
            f"2. call {step}: output stamped {got is not None and got[0] is token and got[1]}, "
            f"{counter.frame_count} frame(s) compiled"
        )


if __name__ == "__main__":
    main()
