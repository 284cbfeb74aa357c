"""How the tests compare two training runs, with bounds that hold on any CPU.

- float64: two runs of one computation summed in another order (TP / EP / DDP ranks against one process) differ by
  float64 rounding carried over the steps: measured <= 4e-14 relative here. A float64 recipe computes in float64
  everywhere, also where transformers casts to float32 (RMSNorm, MoE routers: bdlora_train/models/float64.py);
  without that, a 1e-16 difference now and then flips one float32 rounding and the runs differ at float32 level.
  EXACT_BOUND = 1e-10 leaves over three orders of magnitude for that rounding to grow on another CPU and is nine
  below what a wrong block, slice or missed reduction does (O(1): tests/tp_runtime/test_tp_training.py plants such
  bugs).
- float32: the difference of two runs is not bounded by a constant: Adam divides each gradient by its own running
  size, so a few ulps grow with the steps at a rate that depends on the CPU's kernels (a 1e-5 bound went red on
  another CPU). So a float32 run steps with SGD and is compared with the float64 run of the same computation
  (`exact`; the tiny models and the adapters are drawn in float32 whatever the dtype, so it is the float32 run's
  exact twin), its distance measured against a float32 yardstick run of that computation on this machine:
  `assert_float32_rounding_only`.
"""

import torch

EXACT = {"torch_dtype": "float64"}  # the recipe key of every run the float64 comparisons read
EXACT_BOUND = 1e-10
FP32_FACTOR = 2.0  # `assert_float32_rounding_only` says why


def worst_rel_err(got: dict, ref: dict) -> float:
    """The largest error over the tensors, each relative to its reference's largest entry."""
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert got[key].shape == value.shape, key
    return max(((got[k].double() - v.double()).abs().max() / v.double().abs().max().clamp_min(1e-300)).item()
               for k, v in ref.items())  # fmt: skip


def assert_exact(got: dict, ref: dict) -> None:
    """Two float64 runs' tensors agree to EXACT_BOUND."""
    assert {v.dtype for v in [*got.values(), *ref.values()]} == {torch.float64}
    err = worst_rel_err(got, ref)
    assert err <= EXACT_BOUND, f"rel. err {err:.2e} > {EXACT_BOUND:g}"


def distance(got: dict, exact: dict) -> float:
    """||got - exact|| / ||exact||, the Frobenius norms over every tensor."""
    diff = sum(((got[k].double() - v.double()) ** 2).sum() for k, v in exact.items())
    return (diff / sum((v.double() ** 2).sum() for v in exact.values())).sqrt().item()


def assert_float32_rounding_only(got: dict, yardstick: dict, exact: dict) -> None:
    """`got` and `yardstick` are float32 runs of the computation `exact` ran in float64 (same init, same data, same
    SGD steps), so each differs from it by its own float32 rounding carried over the steps: their distances to `exact`
    are of one size. With SGD every step is proportional to its gradient, so each entry's error is a sum of many
    small rounding terms and the Frobenius norm over the adapter concentrates: measured 0.999-1.011 of each other (TP /
    EP against one process, dense, fused and MoE families). (With Adam a rounding difference on a near-zero gradient
    becomes a step of about the learning rate, a few entries dominate, and the ratio spread 0.70-1.57.)
    FP32_FACTOR = 2 lets `got` carry other rounding of that size (another summation order, one more rounding per
    all-reduce). A float32-only defect (a cast to bf16, a buffer kept in another dtype, a block off) moves the adapter
    by 1e-3 or more: thousands of times the ~1e-7 the rounding is here."""
    rounding = distance(yardstick, exact)
    assert 0 < rounding < 1e-4, rounding  # float32 rounding, not another computation
    assert distance(got, exact) <= FP32_FACTOR * rounding, (distance(got, exact), rounding)
