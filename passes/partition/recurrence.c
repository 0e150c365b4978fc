/* The planner's recurrences in C (see native.py): `timing.shape_time` (exact_one) and `steady.steady_time`
 * (steady_one), line for line: the same operations on doubles in the same order (built with
 * -ffp-contract=off, so no fused multiply-add), hence the same floats as the Python functions. A plan arrives
 * as its stages (rp_time) or, for a batch, as (forward layout, fused stage, backward layout) with the
 * layouts' stages shared by every plan that uses them (rp_steady_times); its `timing.shape` is built here.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOLERANCE 1e-12 /* steady.TOLERANCE */

typedef struct {
    int ns, nseg;
    int *kind, *prod, *seg_lo, *seg_hi; /* per stage */
    double *pre, *post;
    int *grad_stage;                    /* per segment */
} Shape;

/* `timing.shape` of stages given in slot order as (kind code, first layer, end layer, fwd sum, bwd sum);
 * nl: the end layer of the model. seg_of: room for nl + 1 ints. */
static void build_shape(Shape *sh, int ns, const int *code, const int *lo, const int *hi, const double *f,
                        const double *b, int nl, int *seg_of) {
    int i, c, nf = 0;
    sh->ns = ns;
    for (c = 0; c <= nl; c++) seg_of[c] = 0;
    seg_of[0] = seg_of[nl] = 1;
    for (i = 0; i < ns; i++) {
        sh->kind[i] = code[i];
        sh->seg_lo[i] = lo[i]; /* layers for now: segments below */
        sh->seg_hi[i] = hi[i];
        seg_of[lo[i]] = seg_of[hi[i]] = 1;
        if (code[i] == 0) { sh->pre[i] = 0.0; sh->post[i] = f[i]; nf = i + 1; }
        else if (code[i] == 1) { sh->pre[i] = 0.0; sh->post[i] = f[i] + b[i]; }
        else { sh->pre[i] = f[i]; sh->post[i] = b[i]; }
        sh->prod[i] = -1;
        if (code[i] == 2 && lo[i] > 0) { /* bisect_right(f_starts, lo - 1) - 1: the last F stage starting <= lo - 1 */
            int j;
            for (j = 0; j < nf && lo[j] <= lo[i] - 1; j++) {}
            sh->prod[i] = j - 1;
        }
    }
    {   /* cut -> segment index: the cuts sorted are the marked layers */
        int g = 0;
        for (c = 0; c <= nl; c++) {
            if (seg_of[c]) seg_of[c] = g++;
            else seg_of[c] = -1;
        }
        sh->nseg = g - 1;
    }
    for (i = 0; i < ns; i++) {
        sh->seg_lo[i] = seg_of[sh->seg_lo[i]];
        sh->seg_hi[i] = seg_of[sh->seg_hi[i]];
    }
    for (c = 0; c < sh->nseg; c++) sh->grad_stage[c] = 0;
    for (i = 0; i < ns; i++)
        if (sh->kind[i] != 0)
            for (c = sh->seg_lo[i]; c < sh->seg_hi[i]; c++) sh->grad_stage[c] = i;
}

/* copy(u, l) per segment: after its step and every upload of l (steady.py via timing._copies). */
static void copies_of(const Shape *sh, const double *step, const double *uploaded, double *out) {
    int i, g;
    for (g = 0; g < sh->nseg; g++) out[g] = -INFINITY;
    for (i = 0; i < sh->ns; i++)
        for (g = sh->seg_lo[i]; g < sh->seg_hi[i]; g++)
            if (uploaded[i] > out[g]) out[g] = uploaded[i];
    for (g = 0; g < sh->nseg; g++)
        if (!(out[g] > step[g])) out[g] = step[g];
}

/* Before an iteration: each stage's parameter version ready (the latest copy of its segments, `copies` the
 * ones this iteration reads, NULL: none, all 0) and its gradient end reset. */
static void begin_iteration(const Shape *sh, const double *copies, double *ready, double *gend) {
    int i, g;
    for (i = 0; i < sh->ns; i++) {
        double x = 0.0;
        if (copies != NULL) {
            x = copies[sh->seg_lo[i]];
            for (g = sh->seg_lo[i] + 1; g < sh->seg_hi[i]; g++)
                if (copies[g] > x) x = copies[g];
        }
        ready[i] = x;
        gend[i] = 0.0;
    }
}

/* The optimizer's steps, one segment at a time from the last layer down: each after its gradient, the copy
 * before it (prev, NULL: none) and the step before; returns the last step's end. */
static double take_steps(const Shape *sh, const double *gend, const double *prev, double last_step, double *step) {
    int g;
    for (g = sh->nseg - 1; g >= 0; g--) { /* max(gend, prev, last_step): the value of Python's max() */
        double x = gend[sh->grad_stage[g]];
        if (prev != NULL && prev[g] > x) x = prev[g];
        if (x > last_step) last_step = x;
        step[g] = last_step;
    }
    return last_step;
}

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
static double steady_one(const Shape *sh, int n, int microbatches, int rr, int staleness, int iters, int window,
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

/* timing.shape_time (timing.run with its cutoff rules): iteration_time's float, or inf once it is proven above
 * cutoff (< 0: none). */
static double exact_one(const Shape *sh, int n, int microbatches, int rr, int staleness, int iterations, int window,
                        double cutoff, double *ws) {
    int ns = sh->ns, nseg = sh->nseg, rounds = microbatches / rr, per = ns * rounds, t, i, m;
    int first_window = iterations - 1 - window, has_cut = cutoff >= 0;
    double *free_ = ws, *first = free_ + n, *uploaded = first + n, *ready = uploaded + ns, *gend = ready + ns;
    double *rem = gend + ns, *ends = rem + per, *steps = ends + iterations, *copies = steps + (size_t)iterations * nseg;
    double *fwd_end = copies + (size_t)iterations * nseg, *done = fwd_end + (size_t)ns * rr, *next = done + rr;
    double last_step = 0.0, limit = !has_cut || staleness == 1 ? INFINITY : cutoff, owed;
    for (i = 0; i < n; i++) free_[i] = first[i] = 0.0;
    for (i = 0; i < ns; i++) uploaded[i] = 0.0;
    if (has_cut) { /* timing._remaining_load */
        for (i = 0; i < per; i++) rem[i] = 0.0;
        for (i = per - 1 - n; i >= 0; i--) {
            const int j = (i + n) % ns;
            rem[i] = (double)rr * (sh->pre[j] + sh->post[j]) + rem[i + n];
        }
    }
    owed = limit * (1 + 1e-9);
    for (t = 0; t < iterations; t++) {
        int src = t - 1 - staleness;
        long k0 = (long)t * per;
        double t_end = 0.0, *step = steps + (size_t)t * nseg, *prev;
        if (has_cut && staleness == 1 && (t == iterations - 1 || (t > first_window && first_window >= 0 && per >= n))) {
            limit = first_window >= 0 ? ends[first_window] + (double)window * cutoff : INFINITY;
            owed = limit + fabs(limit) * 1e-9;
        }
        begin_iteration(sh, src >= 0 ? copies + (size_t)src * nseg : NULL, ready, gend);
        for (int r = 0; r < rounds; r++) {
            long k = ((long)t * rounds + r) * ns;
            for (m = 0; m < rr; m++) done[m] = 0.0;
            for (i = 0; i < ns; i++) {
                int w = (int)(k % n), kind = sh->kind[i];
                double pre = sh->pre[i], post = sh->post[i], up = ready[i], clock, start0, *tmp;
                if (k >= n && first[w] > up) up = first[w];
                if (up > uploaded[i]) uploaded[i] = up;
                clock = free_[w];
                if (up > clock) clock = up;
                if (kind == 2) { /* B: recompute from the saved input, then backward */
                    if (sh->prod[i] >= 0) {
                        const double *saved = fwd_end + (size_t)sh->prod[i] * rr;
                        start0 = clock >= saved[0] ? clock : saved[0];
                        for (m = 0; m < rr; m++) {
                            double a = clock >= saved[m] ? clock : saved[m], x = a + pre;
                            clock = (x >= done[m] ? x : done[m]) + post;
                            next[m] = clock;
                        }
                    } else {
                        start0 = clock;
                        for (m = 0; m < rr; m++) {
                            double x = clock + pre;
                            clock = (x >= done[m] ? x : done[m]) + post;
                            next[m] = clock;
                        }
                    }
                } else if (i > 0) { /* F or FB after the first slot: wait for m's input */
                    start0 = clock >= done[0] ? clock : done[0];
                    for (m = 0; m < rr; m++) {
                        clock = (clock >= done[m] ? clock : done[m]) + post;
                        next[m] = clock;
                    }
                } else {
                    start0 = clock;
                    for (m = 0; m < rr; m++) {
                        clock = clock + post;
                        next[m] = clock;
                    }
                }
                free_[w] = clock;
                first[w] = start0;
                if (kind == 0) memcpy(fwd_end + (size_t)i * rr, next, sizeof(double) * rr);
                else gend[i] = clock;
                tmp = done; /* done = new_done */
                done = next;
                next = tmp;
                if (clock > t_end) {
                    t_end = clock;
                    if (clock > limit) return INFINITY;
                }
                if (has_cut && clock + rem[k - k0] > owed) return INFINITY;
                k++;
            }
        }
        ends[t] = t_end;
        if (staleness == 1 && t >= 1) copies_of(sh, steps + (size_t)(t - 1) * nseg, uploaded, copies + (size_t)(t - 1) * nseg);
        prev = t >= 1 ? copies + (size_t)(t - 1) * nseg : NULL;
        last_step = take_steps(sh, gend, prev, last_step, step);
        if (staleness == 0) copies_of(sh, step, uploaded, copies + (size_t)t * nseg);
    }
    if (staleness == 0) return ends[0];
    {
        double out = (ends[iterations - 1] - ends[iterations - 1 - window]) / window;
        return has_cut && out > cutoff ? INFINITY : out;
    }
}

/* Doubles of work space for a plan of ns stages and nseg <= nl segments, iterations iters (either recurrence). */
static size_t work_words(int gpus, int ns, int nl, int iters, int microbatches, int rr) {
    size_t width = 2 * (size_t)gpus + ns + 1 + 2 * (size_t)nl;
    size_t steady = 2 * (size_t)gpus + 5 * (size_t)ns + iters + 2 * (size_t)iters * nl + (size_t)iters * width;
    size_t exact = 2 * (size_t)gpus + 3 * (size_t)ns + (size_t)ns * (microbatches / rr) + iters
                   + 2 * (size_t)iters * nl + (size_t)ns * rr + 2 * (size_t)rr;
    return (steady > exact ? steady : exact) + 2 * (size_t)ns; /* + the shape's pre and post */
}

/* One plan, its stages in slot order as (code, first layer, end layer, fwd sum, bwd sum): steady.steady_time
 * (exact = 0) or timing.shape_time (exact = 1); iters and window from timing.steady_state_window ((1, 1) for
 * staleness 0). Returns the seconds, inf once proven above cutoff (< 0: none), or NaN when out of memory. */
double rp_time(int ns, const int *code, const int *lo, const int *hi, const double *f, const double *b, int nl,
               int gpus, int microbatches, int round_size, int staleness, int iters, int window, double cutoff,
               int exact) {
    size_t words = work_words(gpus, ns, nl, iters, microbatches, round_size);
    double *ws = malloc(words * sizeof(double)), out = NAN;
    int *iw = malloc((4 * (size_t)ns + 2 * (size_t)nl + 2) * sizeof(int));
    if (ws != NULL && iw != NULL) {
        Shape sh = {0, 0, iw, iw + ns, iw + 2 * ns, iw + 3 * ns, ws + words - 2 * ns, ws + words - ns, iw + 4 * ns};
        build_shape(&sh, ns, code, lo, hi, f, b, nl, iw + 4 * ns + nl);
        out = (exact ? exact_one : steady_one)(&sh, gpus, microbatches, round_size, staleness, iters, window, cutoff, ws);
    }
    free(ws);
    free(iw);
    return out;
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
