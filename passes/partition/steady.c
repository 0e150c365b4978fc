/* `steady.steady_time` in C, one plan or (rp_steady_times) a batch of the even family; see shape.h. */
#include <math.h>
#include <stdlib.h>

#include "shape.h"

#define TOLERANCE 1e-12 /* steady.TOLERANCE */

/* steady.window_floor */
static double window_floor(const double *ends, int t, int q, double lo_q, double lo_1, int iters, int window) {
    int first = iters - 1 - window;
    double known = t > first ? ends[t] - ends[first] : 0.0;
    int m = iters - 1 - (first > t ? first : t);
    return (known + (double)(m / q) * lo_q + (double)(m % q) * lo_1) / window;
}

/* steady.periodic_window (ends has room for iters values) */
static double periodic_window(double *ends, int t, int q, double inc, int iters, int window) {
    int k;
    for (k = t + 1; k < iters; k++) ends[k] = ends[k - q] + inc;
    return (ends[iters - 1] - ends[iters - 1 - window]) / window;
}

/* steady.steady_time of one shape; cutoff < 0: none. Work space `ws` as sized by rp_steady_times. */
double steady_one(const Shape *sh, int n, int microbatches, int rr, int staleness, int iters, int window,
                         double cutoff, double *ws) {
    int ns = sh->ns, nseg = sh->nseg, rounds = microbatches / rr, per = ns * rounds;
    int width = 2 * n + ns + 1 + 2 * nseg, t, i, g, q;
    double *free_ = ws, *first = free_ + n, *uploaded = first + n, *ready = uploaded + ns, *gend = ready + ns;
    double *f0 = gend + ns, *fr = f0 + ns, *ends = fr + ns, *steps = ends + iters;
    double *copies = steps + (size_t)iters * nseg, *states = copies + (size_t)iters * nseg;
    double last_step = 0.0, lo1 = 0.0;
    for (i = 0; i < n; i++) free_[i] = first[i] = 0.0;
    for (i = 0; i < ns; i++) uploaded[i] = 0.0;
    for (t = 0; t < iters; t++) {
        long k = (long)t * per;
        int src = t - 1 - staleness;
        double t_end = 0.0, *step = steps + (size_t)t * nseg, *prev, *state;
        begin_iteration(sh, src >= 0 ? copies + (size_t)src * nseg : NULL, ready, gend);
        for (int r = 0; r < rounds; r++) {
            double d0 = -INFINITY, dr = -INFINITY;
            for (i = 0; i < ns; i++) {
                int w = (int)(k % n), kind = sh->kind[i], prod = sh->prod[i];
                double pre = sh->pre[i], post = sh->post[i], up = ready[i], c, qq, g0, gr, s0, a, z, x;
                if (k >= n && first[w] > up) up = first[w];
                if (up > uploaded[i]) uploaded[i] = up;
                c = free_[w] >= up ? free_[w] : up;
                if (kind == 2) {
                    qq = pre + post;
                    g0 = d0 - pre;
                    gr = dr - pre;
                    if (prod >= 0) {
                        s0 = c >= f0[prod] ? c : f0[prod];
                        g0 = g0 >= f0[prod] ? g0 : f0[prod];
                        gr = gr >= fr[prod] ? gr : fr[prod];
                    } else {
                        s0 = c;
                    }
                } else {
                    qq = post;
                    g0 = d0;
                    gr = dr;
                    s0 = c >= d0 ? c : d0;
                }
                a = (c >= g0 ? c : g0) + qq;
                z = c + (double)rr * qq;
                x = gr + qq;
                if (x > z) z = x;
                x = g0 + (double)rr * qq;
                if (x > z) z = x;
                free_[w] = z;
                first[w] = s0;
                if (kind == 0) {
                    f0[i] = a; /* F stages come first in slot order: index i is their F index */
                    fr[i] = z;
                } else {
                    gend[i] = z;
                }
                d0 = a;
                dr = z;
                if (z > t_end) t_end = z;
                k++;
            }
        }
        ends[t] = t_end;
        if (staleness == 1 && t >= 1) copies_of(sh, steps + (size_t)(t - 1) * nseg, uploaded, copies + (size_t)(t - 1) * nseg);
        prev = t >= 1 ? copies + (size_t)(t - 1) * nseg : NULL;
        last_step = take_steps(sh, gend, prev, last_step, step);
        if (staleness == 0) {
            copies_of(sh, step, uploaded, copies + (size_t)t * nseg);
            continue;
        }
        {   /* the normalized state: workers rotated to the next iteration's first slot */
            int shift = (int)(((long)(t + 1) * per) % n), o = 0;
            state = states + (size_t)t * width;
            for (i = shift; i < n; i++) state[o++] = free_[i];
            for (i = 0; i < shift; i++) state[o++] = free_[i];
            for (i = shift; i < n; i++) state[o++] = first[i];
            for (i = 0; i < shift; i++) state[o++] = first[i];
            for (i = 0; i < ns; i++) state[o++] = uploaded[i];
            state[o++] = last_step;
            for (g = 0; g < nseg; g++) state[o++] = t >= 1 ? prev[g] : 0.0;
            for (g = 0; g < nseg; g++) state[o++] = step[g];
        }
        for (q = 1; q <= t; q++) {
            const double *old = states + (size_t)(t - q) * width;
            double lo = INFINITY, hi = -INFINITY, scale;
            if ((long)(t - q + 1) * per < n) break;
            for (i = 0; i < width; i++) {
                double inc = state[i] - old[i];
                if (inc < lo) lo = inc;
                if (inc > hi) hi = inc;
            }
            if (q == 1) lo1 = lo;
            if (cutoff >= 0 && window_floor(ends, t, q, lo, lo1, iters, window) > cutoff) return INFINITY;
            scale = t_end > 1e-300 ? t_end : 1e-300;
            if (hi - lo <= TOLERANCE * scale) {
                double out = periodic_window(ends, t, q, (lo + hi) / 2, iters, window);
                return cutoff < 0 || out <= cutoff ? out : INFINITY;
            }
        }
    }
    if (staleness == 0) return cutoff < 0 || ends[0] <= cutoff ? ends[0] : INFINITY;
    {
        double out = (ends[iters - 1] - ends[iters - 1 - window]) / window;
        return cutoff < 0 || out <= cutoff ? out : INFINITY;
    }
}

/* batch.busiest_worker: a lower bound on the plan's time, its busiest worker's compute (slot k runs on worker
 * k mod N for R microbatches; with staleness 1 the rotation gives each worker one class k mod g of slots, g =
 * gcd(N, slots per iteration), over N / g iterations). load: room for gpus doubles. */
static double busiest_worker(const Shape *sh, int gpus, int rounds, int rr, int staleness, double *load) {
    int per = sh->ns * rounds, classes = gpus, r, i, c;
    double top = 0.0;
    if (staleness) {
        int a = per, b = gpus;
        while (b != 0) {
            int t = a % b;
            a = b;
            b = t;
        }
        classes = a;
    }
    for (c = 0; c < classes; c++) load[c] = 0.0;
    for (r = 0; r < rounds; r++)
        for (i = 0; i < sh->ns; i++) load[(r * sh->ns + i) % classes] += (sh->pre[i] + sh->post[i]) * rr;
    for (c = 0; c < classes; c++)
        if (load[c] > top) top = load[c];
    return top * classes / gpus;
}

/* timing.steady_state_window: (iterations to run, iterations averaged); (1, 1) for staleness 0. */
static void window_of(int gpus, int ns, int rounds, int staleness, int *iters, int *window) {
    int a = gpus, b = (int)(((long)ns * rounds) % gpus);
    while (b != 0) { /* gcd(gpus, S * rounds mod gpus) */
        int t = a % b;
        a = b;
        b = t;
    }
    *window = staleness ? gpus / a : 1;
    *iters = staleness ? (3 * *window > 4 ? 3 * *window : 4) : 1;
}

/* steady.steady_time of many plans. Plan p: forward layout fwd[p] and backward layout bwd[p] (rows lay_off[l] ..
 * lay_off[l + 1] of the stage table: first layer, end layer, fwd sum, bwd sum, the backward ones in execution
 * order) and fused[p] fused layers: the stage from layer nl - fused[p] to nl, its sums fused_f[fused[p]] and
 * fused_b[fused[p]]. out[p]: seconds, or inf once proven above cutoff (< 0: none). Returns 0, or -1 when out
 * of memory. */
int rp_steady_times(int nplans, const int *fwd, const int *bwd, const int *fused, const double *fused_f,
                    const double *fused_b, const int *lay_off, const int *st_lo, const int *st_hi, const double *st_f,
                    const double *st_b, int nl, int gpus, int microbatches, int round_size, int staleness,
                    double cutoff, double *out) {
    int max_ns = 1, max_iters = 1, p, i, rc = 0, rounds = microbatches / round_size, iters, window;
    size_t words;
    for (p = 0; p < nplans; p++) {
        int ns = (lay_off[fwd[p] + 1] - lay_off[fwd[p]]) + 1 + (lay_off[bwd[p] + 1] - lay_off[bwd[p]]);
        if (ns > max_ns) max_ns = ns;
    }
    for (i = 1; i <= max_ns; i++) {
        window_of(gpus, i, rounds, staleness, &iters, &window);
        if (iters > max_iters) max_iters = iters;
    }
    words = work_words(gpus, max_ns, nl, max_iters, microbatches, round_size);
    double *ws = malloc((words + 2 * (size_t)max_ns) * sizeof(double));
    int *iw = malloc((7 * (size_t)max_ns + 2 * (size_t)nl + 2) * sizeof(int));
    if (ws == NULL || iw == NULL) {
        rc = -1;
        goto done;
    }
    {
        int *code = iw + 4 * max_ns + 2 * nl + 2, *lo = code + max_ns, *hi = lo + max_ns;
        double *f = ws + words, *b = f + max_ns;
        Shape sh = {0, 0, iw, iw + max_ns, iw + 2 * max_ns, iw + 3 * max_ns, ws + words - 2 * max_ns,
                    ws + words - max_ns, iw + 4 * max_ns};
        for (p = 0; p < nplans; p++) {
            int a0 = lay_off[fwd[p]], nf = lay_off[fwd[p] + 1] - a0;
            int b0 = lay_off[bwd[p]], nb = lay_off[bwd[p] + 1] - b0, ns = nf + 1 + nb;
            for (i = 0; i < ns; i++) {
                int row = i < nf ? a0 + i : b0 + i - nf - 1;
                code[i] = i < nf ? 0 : i == nf ? 1 : 2;
                lo[i] = i == nf ? nl - fused[p] : st_lo[row];
                hi[i] = i == nf ? nl : st_hi[row];
                f[i] = i == nf ? fused_f[fused[p]] : st_f[row];
                b[i] = i == nf ? fused_b[fused[p]] : st_b[row];
            }
            build_shape(&sh, ns, code, lo, hi, f, b, nl, iw + 4 * max_ns + nl);
            if (cutoff >= 0 && busiest_worker(&sh, gpus, rounds, round_size, staleness, ws) > cutoff * (1 + 1e-9)) {
                out[p] = INFINITY; /* slower than the cutoff by its busiest worker alone (batch.busiest_worker) */
                continue;
            }
            window_of(gpus, ns, rounds, staleness, &iters, &window);
            out[p] = steady_one(&sh, gpus, microbatches, round_size, staleness, iters, window, cutoff, ws);
        }
    }
done:
    free(ws);
    free(iw);
    return rc;
}
