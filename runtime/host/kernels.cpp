// The host optimizer's memory-speed kernels (runtime/host/kernels.py builds and loads this file): their Python
// bindings and the dispatch on dtypes here, the loops in the headers it includes, one idea each (kernels_common.h,
// kernels_land.h, kernels_update.h with kernels_avx512.h, kernels_cast.h), compiled as one translation unit.
//
// A plain CPython module (no torch headers: it builds in seconds) whose functions take raw
// pointers of contiguous CPU tensors that the Python side has checked, release the GIL and run
// OpenMP loops over fixed blocks. Every value is computed with the float operations of torch's
// eager CPU kernels, in their order (FMA where ATen's vectorised kernels use `vec::fmadd`: lerp,
// addcmul and `add(alpha=)`); the build passes -ffp-contract=off so the compiler adds no other FMA.
//
//   land(dst, src, src_kind, n, add, threads, divisor) -> (sum of squares, non-finite)
//       dst[i] = ((add ? dst[i] : 0) + float(src[i])) / divisor (no division when divisor is 1);
//       statistics of the result, in the same pass. dst == src: in place (data parallel: the average). A first
//       landing (no sum, no division) of 1 MiB or more with non-temporal stores (the squares in that loop's order).
//   land_bf16(dst, src, src_kind, n, add, threads, divisor, key, offset) -> (sum of squares, non-finite)
//       the same into a bf16 dst (`grad_dtype=torch.bfloat16`): the sum and division in float32, stored rounded
//       stochastically with the low 16 bits of hash32((offset + i) mod 2^32 ^ key) (a bf16 src written alone is
//       copied: exact, the bits rounding would give, NaNs as they are; 1 MiB or more with non-temporal stores);
//       statistics of the stored values.
//   adamw(p, g, m, v, out, out_kind, n, threads, factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt)
//       torch.optim.AdamW's single-tensor update of p, m, v with g * factor; out = cast(new p) (a bf16 out of
//       1 MiB or more with non-temporal stores, as cast's).
//   adamw_lean(p, g, m, v, out, out_kind, n, threads, factor, ..., bc2_sqrt, key, offset, lean, src)
//       the same update with bf16 m, v (lean bit 1), a bf16 master p (bit 2) and/or a bf16 gradient g (bit 4;
//       read and widened) (runtime/host/lean.py); the master is read from src (0: p itself) and written to p (a
//       bf16 master out of place: the alternating copies of runtime/host/layout.py): read and widened, the
//       update in float32, stored rounded stochastically with the bits of r = hash32((offset + i) mod 2^32 ^ key):
//       low 16 for m, high 16 for v, and master_bits(r) = (low 16 ^ high 16 ^ 0x8000) for p (pairwise independent
//       of each, so one hash serves all three); out = cast(the stored p). A bf16 out of 1 MiB or more, else (no
//       out) a bf16 p written out of place, with non-temporal stores. Lean bit 8: a split master instead (an exact
//       fp32 one in two 16-bit halves: hi in p and src, lo in `low`, kernels_update.h's split_value), stored
//       whole, not rounded; a bf16 out is hi itself.
//   sgd(p, g, buf, out, out_kind, n, threads, factor, wd, momentum, damp, nesterov, first, neg_lr, key, offset,
//       p_kind, g_kind, src)
//       torch.optim.SGD's update (buf = 0 for no momentum) of an fp32 or a bf16 master p (rounded as above) with
//       an fp32 or bf16 gradient g, the master read from src (0: p itself);
//       out = cast(the stored p).
//   cast(src, out, out_kind, n, threads, bf16_src=0)
//       out = cast(src): fp32 -> fp32, bf16 or fp16, round to nearest even (as Tensor.to), or bf16 -> bf16 (a copy);
//       a bf16 out of 1 MiB or more with non-temporal stores (written around the cache: not read first).
//
// Kinds: 0 none (no output), 1 float32, 2 bfloat16, 3 float16.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

// one idea a file, in the order each needs the ones before (one translation unit)
#include "kernels_common.h"
#include "kernels_land.h"
#include "kernels_update.h"
#include "kernels_cast.h"

namespace {

template <template <typename> class F, typename... Args>
bool by_kind(int kind, void* out, Args... args) {  // dispatch on the output kind; false if unknown
    switch (kind) {
        case 0: F<NoOut>::run(static_cast<NoOut*>(out), args...); return true;
        case 1: F<float>::run(static_cast<float*>(out), args...); return true;
        case 2: F<bf16>::run(static_cast<bf16*>(out), args...); return true;
        case 3: F<f16>::run(static_cast<f16*>(out), args...); return true;
        default: return false;
    }
}

template <typename O> struct AdamF {
    static void run(O* out, float* p, const float* g, float* m, float* v, int64_t n, int t, AdamArgs a) {
        if (RP_AVX512 && std::is_same<O, bf16>::value && n * 2 >= STREAM_MIN_BYTES) {  // the lean loop with fp32
            // values (the same operations, so the same bits), for its streamed copy
            a.factor != 1.0f ? adamw_lean_t<O, true, float, float, float>(p, p, g, m, v, out, n, t, a, 0, 0)
                             : adamw_lean_t<O, false, float, float, float>(p, p, g, m, v, out, n, t, a, 0, 0);
            return;
        }
        a.factor != 1.0f ? adamw_t<O, true>(p, g, m, v, out, n, t, a) : adamw_t<O, false>(p, g, m, v, out, n, t, a);
    }
};
template <typename O, typename S, typename P, typename G, bool SPLIT>
void adamw_lean_s(O* out, const void* src, void* p, const void* g, void* m, void* v, int64_t n, int t, AdamArgs a,
                  uint32_t key, uint64_t off, uint16_t* low) {
    auto ps = static_cast<const P*>(src);
    auto pp = static_cast<P*>(p);
    auto gg = static_cast<const G*>(g);
    auto mm = static_cast<S*>(m), vv = static_cast<S*>(v);
    a.factor != 1.0f ? adamw_lean_t<O, true, S, P, G, SPLIT>(ps, pp, gg, mm, vv, out, n, t, a, key, off, low)
                     : adamw_lean_t<O, false, S, P, G, SPLIT>(ps, pp, gg, mm, vv, out, n, t, a, key, off, low);
}
template <typename O, typename S, typename P, bool SPLIT = false>
void adamw_lean_g(O* out, const void* src, void* p, const void* g, void* m, void* v, int64_t n, int t, AdamArgs a,
                  uint32_t key, uint64_t off, bool bf16_grad, uint16_t* low = nullptr) {
    bf16_grad ? adamw_lean_s<O, S, P, bf16, SPLIT>(out, src, p, g, m, v, n, t, a, key, off, low)
              : adamw_lean_s<O, S, P, float, SPLIT>(out, src, p, g, m, v, n, t, a, key, off, low);
}
// lean: bits 1 bf16 moments, 2 a bf16 master, 4 a bf16 gradient, 8 a split master (hi in p, lo in `low`; not with 2)
template <typename O> struct AdamLeanF {
    static void run(O* out, const void* src, void* p, const void* g, void* m, void* v, int64_t n, int t, AdamArgs a,
                    uint32_t key, uint64_t off, int lean, uint16_t* low) {
        const bool bg = lean & 4;
        if (lean & 8) {
            lean & 1 ? adamw_lean_g<O, bf16, bf16, true>(out, src, p, g, m, v, n, t, a, key, off, bg, low)
                     : adamw_lean_g<O, float, bf16, true>(out, src, p, g, m, v, n, t, a, key, off, bg, low);
            return;
        }
        switch (lean & 3) {
            case 0: adamw_lean_g<O, float, float>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
            case 1: adamw_lean_g<O, bf16, float>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
            case 2: adamw_lean_g<O, float, bf16>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
            default: adamw_lean_g<O, bf16, bf16>(out, src, p, g, m, v, n, t, a, key, off, bg); break;
        }
    }
};
template <typename O, typename P>
void sgd_g(O* out, const void* src, void* p, const void* g, float* buf, int64_t n, int t, SgdArgs a, uint32_t key,
           uint64_t off, bool bf16_grad) {
    auto ps = static_cast<const P*>(src);
    bf16_grad ? sgd_t<O, P, bf16>(ps, static_cast<P*>(p), static_cast<const bf16*>(g), buf, out, n, t, a, key, off)
              : sgd_t<O, P, float>(ps, static_cast<P*>(p), static_cast<const float*>(g), buf, out, n, t, a, key, off);
}
template <typename O> struct SgdF {
    static void run(O* out, const void* src, void* p, const void* g, float* buf, int64_t n, int t, SgdArgs a,
                    uint32_t key, uint64_t off, bool bf16_master, bool bf16_grad) {
        bf16_master ? sgd_g<O, bf16>(out, src, p, g, buf, n, t, a, key, off, bf16_grad)
                    : sgd_g<O, float>(out, src, p, g, buf, n, t, a, key, off, bf16_grad);
    }
};
template <typename O> struct CastF {
    static void run(O* out, const float* src, int64_t n, int t) { cast_t<O>(src, out, n, t); }
};
template <> struct CastF<NoOut> {
    static void run(NoOut*, const float*, int64_t, int) {}
};

PyObject* bad_kind(int kind) {
    PyErr_Format(PyExc_ValueError, "unknown dtype kind %d", kind);
    return nullptr;
}

template <template <typename> class F, typename... Args>
PyObject* released(int kind, unsigned long long out, Args... args) {  // by_kind without the GIL; None or an error
    bool ok;
    Py_BEGIN_ALLOW_THREADS
    ok = by_kind<F>(kind, reinterpret_cast<void*>(out), args...);
    Py_END_ALLOW_THREADS
    if (!ok) return bad_kind(kind);
    Py_RETURN_NONE;
}

PyObject* land(PyObject*, PyObject* args) {
    unsigned long long dst, src;
    int kind, add, threads;
    long long n;
    double divisor;
    if (!PyArg_ParseTuple(args, "KKiLpid", &dst, &src, &kind, &n, &add, &threads, &divisor)) return nullptr;
    double s = 0.0;
    int f = 0;
    auto d = reinterpret_cast<float*>(dst);
    auto in = reinterpret_cast<const void*>(src);
    if (kind < 1 || kind > 3) return bad_kind(kind);
    Py_BEGIN_ALLOW_THREADS
    const float div = float(divisor);
    if (kind == 1) land_s<float>(d, in, n, add, threads, div, &s, &f);
    else if (kind == 2) land_s<bf16>(d, in, n, add, threads, div, &s, &f);
    else land_s<f16>(d, in, n, add, threads, div, &s, &f);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dO)", s, f ? Py_True : Py_False);
}

PyObject* land_bf16(PyObject*, PyObject* args) {
    unsigned long long dst, src, offset;
    unsigned int key;
    int kind, add, threads;
    long long n;
    double divisor;
    if (!PyArg_ParseTuple(args, "KKiLpidIK", &dst, &src, &kind, &n, &add, &threads, &divisor, &key, &offset))
        return nullptr;
    double s = 0.0;
    int f = 0;
    auto d = reinterpret_cast<bf16*>(dst);
    auto in = reinterpret_cast<const void*>(src);
    if (kind < 1 || kind > 3) return bad_kind(kind);
    Py_BEGIN_ALLOW_THREADS
    const float div = float(divisor);
    const uint32_t k = key;
    const uint64_t off = offset;
    if (kind == 1) land_bf16_s<float>(d, in, n, add, threads, div, k, off, &s, &f);
    else if (kind == 2) land_bf16_s<bf16>(d, in, n, add, threads, div, k, off, &s, &f);
    else land_bf16_s<f16>(d, in, n, add, threads, div, k, off, &s, &f);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dO)", s, f ? Py_True : Py_False);
}

PyObject* adamw(PyObject*, PyObject* args) {
    unsigned long long p, g, m, v, out;
    int kind, threads;
    long long n;
    double factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt;
    if (!PyArg_ParseTuple(args, "KKKKKiLidddddddd", &p, &g, &m, &v, &out, &kind, &n, &threads, &factor, &decay,
                          &w1, &beta2, &w2, &eps, &neg_step, &bc2_sqrt))
        return nullptr;
    // each double becomes a float, as torch turns a Python scalar into the tensor's dtype
    AdamArgs a{float(factor), float(decay), float(w1), float(beta2), float(w2), float(eps), float(neg_step),
               float(bc2_sqrt)};
    return released<AdamF>(kind, out, reinterpret_cast<float*>(p), reinterpret_cast<const float*>(g),
                           reinterpret_cast<float*>(m), reinterpret_cast<float*>(v), int64_t(n), threads, a);
}

PyObject* adamw_lean(PyObject*, PyObject* args) {
    unsigned long long p, g, m, v, out, offset, src = 0, low = 0;
    unsigned int key;
    int kind, threads, lean;
    long long n;
    double factor, decay, w1, beta2, w2, eps, neg_step, bc2_sqrt;
    if (!PyArg_ParseTuple(args, "KKKKKiLiddddddddIKi|KK", &p, &g, &m, &v, &out, &kind, &n, &threads, &factor, &decay,
                          &w1, &beta2, &w2, &eps, &neg_step, &bc2_sqrt, &key, &offset, &lean, &src, &low))
        return nullptr;
    if (lean < 0 || lean > 15 || (lean == 0 && src == 0) || ((lean & 8) != 0) != (low != 0) || (lean & 10) == 10) {
        PyErr_Format(PyExc_ValueError, "adamw_lean: unknown lean mode %d (or a split master's lo halves missing)",
                     lean);
        return nullptr;
    }
    AdamArgs a{float(factor), float(decay), float(w1), float(beta2), float(w2), float(eps), float(neg_step),
               float(bc2_sqrt)};
    return released<AdamLeanF>(kind, out, reinterpret_cast<const void*>(src ? src : p), reinterpret_cast<void*>(p),
                               reinterpret_cast<const void*>(g),
                               reinterpret_cast<void*>(m), reinterpret_cast<void*>(v), int64_t(n), threads, a,
                               uint32_t(key), uint64_t(offset), lean, reinterpret_cast<uint16_t*>(low));
}

PyObject* sgd(PyObject*, PyObject* args) {
    unsigned long long p, g, buf, out, offset, src = 0;
    unsigned int key;
    int kind, threads, nesterov, first, has_momentum, bf16_master, bf16_grad;
    long long n;
    double factor, wd, momentum, damp, neg_lr;
    if (!PyArg_ParseTuple(args, "KKKKiLidddddpppIKpp|K", &p, &g, &buf, &out, &kind, &n, &threads, &factor, &wd,
                          &momentum, &damp, &neg_lr, &nesterov, &first, &has_momentum, &key, &offset, &bf16_master,
                          &bf16_grad, &src))
        return nullptr;
    SgdArgs a{float(factor), float(wd), float(momentum), float(damp), float(neg_lr), bool(nesterov), bool(first),
              bool(has_momentum)};
    return released<SgdF>(kind, out, reinterpret_cast<const void*>(src ? src : p), reinterpret_cast<void*>(p),
                          reinterpret_cast<const void*>(g),
                          reinterpret_cast<float*>(buf), int64_t(n), threads, a, uint32_t(key), uint64_t(offset),
                          bool(bf16_master), bool(bf16_grad));
}

PyObject* cast(PyObject*, PyObject* args) {
    unsigned long long src, out;
    int kind, threads;
    long long n;
    int bf16_src = 0;
    if (!PyArg_ParseTuple(args, "KKiLi|i", &src, &out, &kind, &n, &threads, &bf16_src)) return nullptr;
    if (bf16_src) {  // a bf16 master into its bf16 copy
        if (kind != 2) return bad_kind(kind);
        Py_BEGIN_ALLOW_THREADS
        copy_t(reinterpret_cast<const bf16*>(src), reinterpret_cast<bf16*>(out), int64_t(n), threads);
        Py_END_ALLOW_THREADS
        Py_RETURN_NONE;
    }
    return released<CastF>(kind, out, reinterpret_cast<const float*>(src), int64_t(n), threads);
}

PyMethodDef methods[] = {
    {"land", land, METH_VARARGS, "land(dst, src, kind, n, add, threads, divisor) -> (sum of squares, non-finite)"},
    {"land_bf16", land_bf16, METH_VARARGS, "land_bf16(dst, src, kind, n, add, threads, divisor, key, offset) -> "
                                           "(sum of squares, non-finite)"},
    {"adamw", adamw, METH_VARARGS, "adamw(p, g, m, v, out, kind, n, threads, factor, decay, w1, beta2, w2, eps, "
                                   "neg_step, bc2_sqrt)"},
    {"adamw_lean", adamw_lean, METH_VARARGS, "adamw_lean(p, g, m, v, out, kind, n, threads, factor, decay, w1, "
                                             "beta2, w2, eps, neg_step, bc2_sqrt, key, offset, lean, src=0, low=0)"},
    {"sgd", sgd, METH_VARARGS, "sgd(p, g, buf, out, kind, n, threads, factor, wd, momentum, damp, neg_lr, "
                               "nesterov, first, has_momentum, key, offset, bf16_master, bf16_grad)"},
    {"cast", cast, METH_VARARGS, "cast(src, out, kind, n, threads, bf16_src=0)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

#ifndef TORCH_EXTENSION_NAME  // torch.utils.cpp_extension defines it: the module's name
#define TORCH_EXTENSION_NAME rpcompile_host_kernels
#endif
#define RP_MODULE TORCH_EXTENSION_NAME
#define RP_CAT(a, b) a##b
#define RP_INIT(name) RP_CAT(PyInit_, name)
#define RP_STR2(x) #x
#define RP_STR(x) RP_STR2(x)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, RP_STR(RP_MODULE), "rpcompile host optimizer kernels", -1,
                                 methods};

PyMODINIT_FUNC RP_INIT(RP_MODULE)(void) { return PyModule_Create(&module_def); }
