"""Precision of the in-place activated batch norm (issue 21): what recovering x-hat from the output costs.

For random data, weights and biases, in float32, float16 and bfloat16 input (a float32 layer), it
compares against the truth, a float64 ``nn.BatchNorm`` (weight ``|w| + eps``) + activation on the
very same input values:

* ``xhat``: the normalised input recovered from the output in backward
  (:func:`syncbn.families.inplace_abn.recover`) against the float64 ``xhat``, in units of the input dtype's
  epsilon (over all elements; ELU also without its saturated region ``y < -0.99 alpha``);
* the layer's output, input gradient and weight/bias gradients, as a ratio of its error to the
  error of the standard pair (``nn.BatchNorm2d`` + the activation, in the same dtypes): the
  precision property of the other layers asks ``<= 1.5`` (plus a floor of a few ulps).

Weights are drawn from ``|w| in [0.5, 2]`` (well conditioned) and ``|w| in [1e-3, 1e-2]`` (small:
the recovery divides by ``|w| + eps``), data offsets ``|mean|/std`` of 0, 10 and 100.

    python benchmarks/precision/abn_precision.py [--trials 4] [--json benchmarks/results/abn_precision.json]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.nn.functional as F

from syncbn.compat.inplace_abn import InPlaceABN
from syncbn.families import inplace_abn as _abn_math

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ACTS = {"leaky_relu": 0.01, "elu": 1.0}
WEIGHTS = {"well": (0.5, 2.0), "small": (1e-3, 1e-2)}


def _act(t: torch.Tensor, name: str, p: float) -> torch.Tensor:
    return F.leaky_relu(t, p) if name == "leaky_relu" else F.elu(t, p)


def _err(a: torch.Tensor, truth: torch.Tensor) -> float:
    scale = max(1e-30, truth.abs().max().item())
    return (a.double() - truth).abs().max().item() / scale


def one_case(
    dtype: torch.dtype, act: str, weights: tuple[float, float], offset: float, seed: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    channels, eps, p = 8, 1e-5, ACTS[act]
    lo, hi = weights
    w = torch.exp(
        torch.empty(channels).uniform_(
            torch.log(torch.tensor(lo)).item(), torch.log(torch.tensor(hi)).item(), generator=gen
        )
    )
    w = w * torch.where(torch.rand(channels, generator=gen) < 0.5, -1.0, 1.0)
    b = torch.randn(channels, generator=gen) * 1.5
    std = torch.rand(channels, generator=gen) * 2 + 0.1
    x = (
        torch.randn(8, channels, 16, 16, generator=gen) * std.view(1, -1, 1, 1)
        + offset * std.view(1, -1, 1, 1)
    ).to(dtype)
    g = torch.randn(x.shape, generator=gen).to(dtype)

    # The truth, on the same input values.
    x64 = x.double().requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    y64 = _act(F.batch_norm(x64, None, None, w64.abs() + eps, b64, True, 0.0, eps), act, p)
    y64.backward(g.double())
    var64, mean64 = torch.var_mean(x64.detach(), (0, 2, 3), correction=0)
    xhat64 = (x64.detach() - mean64.view(1, -1, 1, 1)) / (var64 + eps).sqrt().view(1, -1, 1, 1)

    # The standard pair in the same dtypes (float32 parameters).
    bn = torch.nn.BatchNorm2d(channels, eps=eps, track_running_stats=False)
    with torch.no_grad():
        bn.weight.copy_(w.abs() + eps)
        bn.bias.copy_(b)
    xs = x.clone().requires_grad_()
    ys = _act(bn(xs), act, p)
    ys.backward(g)

    # The in-place layer.
    layer = InPlaceABN(channels, eps=eps, track_running_stats=False, activation=act, activation_param=p)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    xo = x.clone().requires_grad_()
    yo = layer(xo * 1)
    yo.backward(g)
    z, _, _ = _abn_math.recover(yo.detach(), g, act, p)
    s_ = (w.abs() + eps).view(1, -1, 1, 1)
    xhat = (z.double() - b.double().view(1, -1, 1, 1)) / s_.double()

    unit = torch.finfo(dtype).eps
    diff = (xhat.double() - xhat64).abs()
    keep = yo.detach().double() > -0.99 * p if act == "elu" else torch.ones_like(diff, dtype=torch.bool)
    out: dict[str, Any] = {
        "xhat_ulps": diff.max().item() / unit,
        "xhat_ulps_unsaturated": diff[keep].max().item() / unit if keep.any() else 0.0,
    }
    dw_sign = torch.where(w < 0, -1.0, 1.0)
    pairs = {
        "y": (yo.detach(), ys.detach(), y64.detach()),
        "dx": (xo.grad, xs.grad, x64.grad),
        "dw": (layer.weight.grad, bn.weight.grad * dw_sign, w64.grad),
        "db": (layer.bias.grad, bn.bias.grad, b64.grad),
    }
    # The precision property's floor (tests/test_property.py): 16 ulps of the layer's float32, times kappa.
    kappa = 1.0 + (mean64.abs() / (var64 + eps).sqrt()).max().item()
    floor = 16 * torch.finfo(torch.float32).eps * kappa
    within = True
    for name, (ours, std_, truth) in pairs.items():
        e_ours, e_std = _err(ours, truth), _err(std_, truth)
        out[f"{name}_err"] = e_ours
        out[f"{name}_std_err"] = e_std
        out[f"{name}_ratio"] = e_ours / max(e_std, floor)
        out[f"{name}_within"] = float(e_ours <= 1.5 * e_std + floor)
        within = within and e_ours <= 1.5 * e_std + floor
    out["within"] = float(within)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--json", default=os.path.join("benchmarks", "results", "abn_precision.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("dtype act |w| offset | xhat ulps (unsaturated) | to BN+act: y dx dw db | dx err, dw err | within")
    names = ("y", "dx", "dw", "db")
    for dname, dtype in DTYPES.items():
        for act in ACTS:
            for wname, weights in WEIGHTS.items():
                for offset in (0.0, 10.0, 100.0):
                    cases = [one_case(dtype, act, weights, offset, seed) for seed in range(args.trials)]
                    worst = {k: max(c[k] for c in cases) for k in cases[0]}
                    for k in [k for k in worst if k.endswith("within")]:
                        worst[k] = min(c[k] for c in cases)
                    rows.append(
                        {"dtype": dname, "activation": act, "weights": wname, "offset": offset, **worst}
                    )
                    ratios = " ".join(f"{worst[n + '_ratio']:.2f}" for n in names)
                    within = " ".join(n for n in names if worst[f"{n}_within"])
                    missed = " ".join(n for n in names if not worst[f"{n}_within"])
                    print(
                        f"{dname} {act} {wname} {offset:.0f} | {worst['xhat_ulps']:.3g} "
                        f"({worst['xhat_ulps_unsaturated']:.3g}) | {ratios} | "
                        f"{worst['dx_err']:.2e}, {worst['dw_err']:.2e} | {within}"
                        + (f" (not: {missed})" if missed else "")
                    )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
