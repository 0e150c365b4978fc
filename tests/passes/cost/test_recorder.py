"""The predict recorder on hand-counted ops: GEMM FLOPs with out= arguments, a fused region's bytes."""
from __future__ import annotations

import torch

from torch.utils._pytree import tree_flatten

from rpcompile.passes.cost import recorder
from rpcompile.passes.cost.recorder import Recorder, tensors_in
from rpcompile.passes.meta.regions import fused_region


def test_a_gemm_writing_into_out_counts_its_flops():
    """addmm(acc, a, b, out=acc), as the fused head accumulates its weight gradient: 2 * M * K * N FLOPs."""
    acc, a, b = (torch.empty(s, device="meta") for s in ((8, 16), (8, 32), (32, 16)))
    with Recorder() as rec:
        torch.addmm(acc, a, b, out=acc)
        torch.mm(a, b)
    assert [(o.name, o.flops) for o in rec.ops] == [("addmm", 2 * 8 * 32 * 16), ("mm", 2 * 8 * 32 * 16)]
    assert rec.ops[0].bytes == 4 * (8 * 16 + 8 * 32 + 32 * 16 + 8 * 16)  # acc, a, b read, acc written


def test_a_mixed_dtype_gemm_into_an_fp32_acc_is_priced_at_its_operands_rate():
    """addmm(acc fp32, a bf16, b bf16, out_dtype=fp32, out=acc): the bf16 rate, the GEMM's FLOPs."""
    acc = torch.empty(8, 16, device="meta")
    a, b = torch.empty(8, 32, device="meta", dtype=torch.bfloat16), torch.empty(32, 16, device="meta",
                                                                                  dtype=torch.bfloat16)
    with Recorder() as rec:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    (op,) = rec.ops
    assert (op.name, op.flops, op.dtype) == ("addmm", 2 * 8 * 32 * 16, "bfloat16")
    assert op.bytes == 4 * 8 * 16 * 2 + 2 * (8 * 32 + 32 * 16)


def test_a_fused_region_costs_what_it_reads_from_outside_and_leaves_alive():
    """x (outside, 512 B) -> y = 2x -> z = y + 1: the kernel reads x and writes z (1,024 B); y, made and
    dropped inside, is never written to memory. Kept alive, y counts too."""
    x = torch.empty(16, 8, device="meta")
    for keep in (False, True):
        with Recorder() as rec:
            with fused_region():
                y = x * 2
                z = y + 1
                if not keep:
                    del y
        eager, fused = rec.ops[:-1], rec.ops[-1]
        assert [(o.name, o.form) for o in eager] == [("mul", "eager"), ("add", "eager")]
        assert (fused.name, fused.form, fused.flops) == ("fused_elementwise", "fused", 0)
        assert fused.bytes == 512 + 512 + (512 if keep else 0), keep
        assert z.shape == x.shape


def test_the_tensors_of_an_ops_arguments_are_pytrees_tensors_in_its_order():
    t = [torch.zeros(k) for k in range(7)]
    ret = torch.return_types.max((t[5], t[6]))  # a tuple subclass, as ops return
    value = ((t[0], 2, [t[1], None, (t[2],)]), {"b": t[3], "a": [1.5, t[4]]}, ret, "x")
    want = [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]
    assert [id(x) for x in tensors_in(value)] == [id(x) for x in want] and len(want) == 7


def test_pointwise_ops_on_meta_are_recorded_as_their_own_meta_kernels_give_them_without_running_those(monkeypatch):
    """Contiguous floating operands (broadcast, promoted, with numbers): the same result tensors and ops as
    the ops themselves give, made without their Python reference (which took most of a count's time);
    a transposed operand still runs the op."""
    import torch._prims_common as prims_common
    m = lambda *s, dtype=torch.float32: torch.empty(s, device="meta", dtype=dtype)  # noqa: E731
    x, h, s = m(4, 8, dtype=torch.bfloat16), m(8), m(dtype=torch.float32)
    cases = [lambda: x * h, lambda: x + s, lambda: x - 2, lambda: h / 3, lambda: x * 0.5, lambda: -x,
             lambda: torch.rsqrt(h), lambda: x ** 2, lambda: torch.add(x, x, alpha=2), lambda: m(3, 1, 8) * h]
    want = [(tuple(t.shape), t.stride(), t.dtype) for t in (f() for f in cases)]
    with monkeypatch.context() as patch:
        patch.setattr(recorder, "_pointwise_on_meta", lambda *args: None)  # every op runs itself
        with Recorder() as plain:
            for f in cases:
                f()
    ran = []
    original = prims_common.compute_elementwise_output_logical_to_physical_perm
    monkeypatch.setattr(prims_common, "compute_elementwise_output_logical_to_physical_perm",
                        lambda *a, **k: ran.append(1) or original(*a, **k))
    with Recorder() as rec:
        got = [(tuple(t.shape), t.stride(), t.dtype) for t in (f() for f in cases)]
    assert got == want and rec.ops == plain.ops and not ran
    with Recorder():
        y = x.t() * x.t()  # a transposed operand: its layout decides the result's, so the op itself runs
    assert ran and y.stride() == (x.t() * x.t()).stride()


def test_a_pointwise_result_made_on_meta_is_the_ops_own_for_operands_of_any_layout():
    """Random shapes, dtypes and layouts (transposed, sliced, expanded, broadcast, odd strides on size-1
    dimensions, numbers): where the recorder makes the result itself, it has the op's own shape, strides
    and dtype; most are made (the others run the op)."""
    import random
    aten, rng = torch.ops.aten, random.Random(0)

    def operand(shape: list[int]) -> torch.Tensor:
        dt = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        kind, d = rng.choice(["plain", "permuted", "sliced", "expanded"]), rng.randrange(max(len(shape), 1))
        if kind == "permuted" and len(shape) > 1:
            p = rng.sample(range(len(shape)), len(shape))
            t = torch.empty([shape[i] for i in p], device="meta", dtype=dt).permute([p.index(i) for i in range(len(shape))])
        elif kind == "sliced" and shape:
            wide = [*shape[:d], 2 * shape[d], *shape[d + 1:]]
            t = torch.empty(wide, device="meta", dtype=dt).narrow(d, rng.choice([0, shape[d]]), shape[d])
        elif kind == "expanded" and shape:
            t = torch.empty([*shape[:d], 1, *shape[d + 1:]], device="meta", dtype=dt).expand(shape)
        else:
            t = torch.empty(shape, device="meta", dtype=dt)
        if 1 in shape and rng.random() < 0.3:  # a size-1 dimension at an odd stride
            strides = list(t.stride())
            strides[shape.index(1)] = rng.choice([1, 2, 7])
            t = torch.empty_strided(shape, strides, device="meta", dtype=dt)
        return t

    binary = [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor]
    made = 0
    for _ in range(1500):
        shape = [rng.choice([1, 1, 2, 3, 5]) for _ in range(rng.randint(0, 4))]
        op = rng.choice([*binary, aten.neg.default, aten.rsqrt.default, aten.pow.Tensor_Scalar, aten.mul.Scalar])
        a = operand(shape)
        if op in binary:
            tail = [1 if rng.random() < 0.3 else n for n in shape[rng.randint(0, len(shape)):]]
            b = rng.choice([2, 0.5, operand(tail), operand(tail)])
            args = (a, b) if rng.random() < 0.7 or not isinstance(b, torch.Tensor) else (b, a)
        else:
            args = (a, 2) if op in (aten.pow.Tensor_Scalar, aten.mul.Scalar) else (a,)
        got = recorder._pointwise_on_meta(op, args, {})
        if got is not None:
            made += 1
            want = op(*args)
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), (op, args)
    assert made > 1000
