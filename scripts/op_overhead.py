"""Host cost of a no-op torch operator per registration style (why ubnext.ops uses
torch.library.Library define + impl, with autograd in Python entry points): run
`.venv/bin/python scripts/op_overhead.py`. Figures in docs/PERF.md."""

import time

import torch

lib = torch.library.Library("ovh", "DEF")
lib.define("noop(Tensor x, str k) -> Tensor")
lib.define("noop_ag(Tensor x, str k) -> Tensor")
lib.impl("noop", lambda x, k: x, "CompositeExplicitAutograd")
lib.impl("noop_ag", lambda x, k: x, "CompositeExplicitAutograd")
torch.library.register_autograd("ovh::noop_ag", lambda ctx, g: (g, None), lib=lib)


@torch.library.custom_op("ovh::noop_co", mutates_args=())
def noop_co(x: torch.Tensor, k: str) -> torch.Tensor:
    return x.clone()


x = torch.ones(8)


def bench(f, n=20000):
    for _ in range(1000):
        f(x, "g")
    t = time.perf_counter()
    for _ in range(n):
        f(x, "g")
    return (time.perf_counter() - t) / n * 1e6


for name, f in [
    ("Library define+impl", torch.ops.ovh.noop),
    ("Library + register_autograd", torch.ops.ovh.noop_ag),
    ("custom_op decorator", torch.ops.ovh.noop_co),
    ("python call (baseline)", lambda x, k: x),
]:
    print(f"{name:30} {min(bench(f) for _ in range(3)):.2f} us/call")
lib.define("noop_man(Tensor x, str k) -> Tensor")
lib.impl("noop_man", lambda x, k: x.clone(), "CompositeExplicitAutograd")


class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.ovh.noop_man(x, k)

    @staticmethod
    def backward(ctx, g):
        return g, None


_below = torch._C._AutoDispatchBelowAutograd


def man_autograd(x, k):
    if x.requires_grad and torch.is_grad_enabled():
        return Fn.apply(x, k)
    with _below():
        return torch.ops.ovh.noop_man(x, k)


lib.impl("noop_man", man_autograd, "Autograd")
print(f"{'manual Autograd kernel':30} {min(bench(torch.ops.ovh.noop_man) for _ in range(3)):.2f} us/call")
xr = torch.ones(8, requires_grad=True)
y = torch.ops.ovh.noop_man(xr, "g")
y.sum().backward()
print("grad", xr.grad)
