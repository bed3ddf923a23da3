"""torch.func transforms inside the per-device function: programs run on every backend.

Each program maps ``x`` [8] (split over "x") and ``w`` [4] (replicated) on a mesh of two instances and
applies a transform inside; their types must survive the transform (a varying value typed
invariant would be returned silently wrong under ``P()``). ``python tests/transforms_inside.py``
under a 2-process job prints one ``OUTCOME {json}`` line per program (tests/test_distributed.py
compares them with the simulated mesh).
"""

from __future__ import annotations

import torch

import named_spmd as ns
from named_spmd import P


def vjp_claimed_replicated(x, w):  # the value varies: out_specs P() must be refused
    return torch.func.vjp(lambda v: v * 2, x)[0]


def vmap_mixing_invariant(x, w):  # w meets the varying rows inside vmap: an implicit pvary
    return torch.func.vmap(lambda r, u: r * u)(x.reshape(2, 2), w.reshape(2, 2)).reshape(-1)


def vmap_moved_batch_dim_then_psum(x, w):  # the vmapped result is a new view: still varying
    return ns.psum(torch.func.vmap(lambda r: r.sin(), out_dims=1)(x.reshape(2, -1)), "x")


def vmap_over_collectives(x, w):
    rows = x.reshape(2, -1)
    total = torch.func.vmap(lambda r: ns.psum(r, "x"))(rows)
    gathered = torch.func.vmap(lambda r: ns.all_gather(r, "x", tiled=True))(rows)
    return total.reshape(-1) + gathered.sum(1).repeat_interleave(2)


def jacrev_inside(x, w):
    return torch.func.jacrev(lambda v: (v * w).sin())(x).sum(0)


def grad_and_value_inside(x, w):
    g, loss = torch.func.grad_and_value(lambda v: ns.psum((v * v).sum(), "x"))(x)
    return g * loss


def grads_through_collectives(x, w):  # torch.autograd.grad itself is not an op to type
    a = torch.func.grad(lambda v: ns.psum(v * w, "x").sum())(x)
    b = torch.func.grad(lambda v: (ns.all_gather(v, "x", tiled=True) * 1.5).sum())(x)
    c = torch.func.vjp(lambda v: ns.pmean(v, "x"), x)[1](w)[0]
    return torch.cat([a, b, c])


def jvp_inside(x, w):
    return torch.func.jvp(lambda v: v.exp() * w, (x,), (torch.ones_like(x),))[1]


# An invariant value meeting a varying one inside a grad: the implicit pvary's transpose sums the
# gradient over the instances, as jax.grad inside shard_map does (values in DENSE).
def grad_of_pmean_mixed(x, w):
    return torch.func.grad(lambda v: (ns.pmean(v, "x") * x).sum())(x)


def grad_of_invariant_input(x, w):
    return torch.func.grad(lambda u: (torch.sin(u) * x).sum())(w)


def hessian_of_invariant_input(x, w):
    return torch.func.hessian(lambda u: (torch.sin(u) * x).sum())(w).sum(0)


# A gradient has its input's type (JAX: a cotangent has its primal's), varying too where the
# cotangent given varies; the psum of each result below needs it typed varying (a psum of an
# invariant value is refused), so a type lost on either backend is an error (values in DENSE).
def grad_through_psum_is_varying(x, w):  # the transpose of a psum: the same on every instance
    return ns.psum(torch.func.grad(lambda v: ns.psum((v * w).sum(), "x"))(x), "x")


def identity_transpose_of_invariant_cotangent(x, w):
    return ns.psum(torch.func.vjp(lambda v: v, x)[1](w)[0], "x")


def vjp_varying_cotangent_of_invariant(x, w):  # postprocessed outputs' cotangents, as custom_vjp
    out, pull = torch.func.vjp(lambda u: (u * 1.5, u.sin()), w)
    return ns.psum(pull((x * out[0], x.cos()))[0], "x")


def vmap_unbatched_collective(x, w):  # vmap expands a result it did not batch: a view of it
    moved = torch.func.vmap(lambda r: ns.all_to_all(w * 1.0, "x", 0, 0, tiled=True))(x)
    return ns.psum(moved, "x").reshape(-1)[:4]


# A partial sum (unreduced over "x": each instance's block a part of the sum) keeps its type
# through a vmap inside the function: its linear ops pass, a nonlinear one is refused, inside the
# vmap or on the result the vmap hands back (typed varying, it would be summed silently wrong).
def _parts(x):
    return ns.pcast(x * 1.0, "x", to="unreduced").reshape(2, 2)


def vmap_of_a_partial_sum(x, w):
    return ns.psum(torch.func.vmap(lambda r: r * 2 - r.flip(0))(_parts(x)), "x").reshape(-1)


def vmap_relu_of_a_partial_sum(x, w):
    return ns.psum(torch.func.vmap(torch.relu)(_parts(x)), "x").reshape(-1)


def relu_of_a_partial_sum_from_vmap(x, w):
    return ns.psum(torch.relu(torch.func.vmap(lambda r: r * 2)(_parts(x))), "x").reshape(-1)


def relu_of_its_parts_from_vmap(x, w):  # cast to varying: each instance's part, on its storage
    parts = ns.pcast(torch.func.vmap(lambda r: r * 2)(_parts(x)), "x", to="varying")
    return ns.psum(torch.relu(parts), "x").reshape(-1)


def relu_of_an_input_a_vmap_cast(x, w):  # the cast aliases x's memory: x itself stays varying
    torch.func.vmap(lambda r: ns.pcast(r, "x", to="unreduced"))(x.reshape(2, 2))
    return ns.psum(torch.relu(x), "x")


def empty_of_an_empty_partial_sum(x, w):  # an unrelated empty tensor is not the partial sum
    torch.func.vmap(lambda r: ns.pcast(r[:0] * 2.0, "x", to="unreduced"))(x.reshape(2, 2))
    return ns.psum(torch.relu(x), "x") + torch.zeros(0, dtype=x.dtype).exp().sum()


PROGRAMS = {
    "vjp_claimed_replicated": (vjp_claimed_replicated, P()),
    "vmap_mixing_invariant": (vmap_mixing_invariant, P("x")),
    "vmap_moved_batch_dim_then_psum": (vmap_moved_batch_dim_then_psum, P()),
    "vmap_over_collectives": (vmap_over_collectives, P("x")),
    "jacrev_inside": (jacrev_inside, P("x")),
    "grad_and_value_inside": (grad_and_value_inside, P("x")),
    "grads_through_collectives": (grads_through_collectives, P("x")),
    "jvp_inside": (jvp_inside, P("x")),
    "grad_of_pmean_mixed": (grad_of_pmean_mixed, P("x")),
    "grad_of_invariant_input": (grad_of_invariant_input, P()),
    "hessian_of_invariant_input": (hessian_of_invariant_input, P()),
    "grad_through_psum_is_varying": (grad_through_psum_is_varying, P()),
    "identity_transpose_of_invariant_cotangent": (identity_transpose_of_invariant_cotangent, P()),
    "vjp_varying_cotangent_of_invariant": (vjp_varying_cotangent_of_invariant, P()),
    "vmap_unbatched_collective": (vmap_unbatched_collective, P()),
    "vmap_of_a_partial_sum": (vmap_of_a_partial_sum, P()),
    "vmap_relu_of_a_partial_sum": (vmap_relu_of_a_partial_sum, P()),
    "relu_of_a_partial_sum_from_vmap": (relu_of_a_partial_sum_from_vmap, P()),
    "relu_of_its_parts_from_vmap": (relu_of_its_parts_from_vmap, P()),
    "relu_of_an_input_a_vmap_cast": (relu_of_an_input_a_vmap_cast, P()),
    "empty_of_an_empty_partial_sum": (empty_of_an_empty_partial_sum, P()),
}


def _blocks(x):  # the two instances' blocks of x
    return x[:4], x[4:]


#: the global output of a program, computed on one device from the definitions (JAX's semantics)
DENSE = {
    "grad_of_pmean_mixed": lambda x, w: (sum(_blocks(x)) / 2).repeat(2),
    "grad_of_invariant_input": lambda x, w: torch.cos(w) * sum(_blocks(x)),
    "hessian_of_invariant_input": lambda x, w: -torch.sin(w) * sum(_blocks(x)),
    "grad_through_psum_is_varying": lambda x, w: 2 * w,
    "identity_transpose_of_invariant_cotangent": lambda x, w: 2 * w,
    "vjp_varying_cotangent_of_invariant": lambda x, w: sum(
        b * 1.5 * w * 1.5 + b.cos() * w.cos() for b in _blocks(x)
    ),
    "vmap_unbatched_collective": lambda x, w: torch.cat([w[:2] + w[2:]] * 2),
    "vmap_of_a_partial_sum": lambda x, w: (
        2 * sum(_blocks(x)).reshape(2, 2) - sum(_blocks(x)).reshape(2, 2).flip(1)
    ).reshape(-1),
    "relu_of_its_parts_from_vmap": lambda x, w: sum(torch.relu(2 * b) for b in _blocks(x)),
    "relu_of_an_input_a_vmap_cast": lambda x, w: sum(torch.relu(b) for b in _blocks(x)),
    "empty_of_an_empty_partial_sum": lambda x, w: sum(torch.relu(b) for b in _blocks(x)),
}


def arguments() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, generator=gen, dtype=torch.float64)
    return x, torch.randn(4, generator=gen, dtype=torch.float64)


def run(name: str, mesh) -> dict:
    """``{"value": [...]}`` (the global output) or ``{"error": class, "message": text}``."""
    fn, out_spec = PROGRAMS[name]
    f = ns.spmd_map(fn, mesh=mesh, in_specs=(P("x"), P()), out_specs=out_spec)
    try:
        out = f(*arguments())
    except ns.SpmdError as e:
        return {"error": type(e).__name__, "message": str(e)}
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    return {"value": out.tolist()}


if __name__ == "__main__":
    from _dist_launch import report_outcomes

    report_outcomes(PROGRAMS, run)
