/* `timing.shape_time` in C (the exact recurrence, every microbatch), and rp_time: one plan by either
 * recurrence; see shape.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "shape.h"

/* timing.shape_time (timing.run with its cutoff rules): iteration_time's float, or inf once it is proven above
 * cutoff (< 0: none). */
double exact_one(const Shape *sh, int n, int microbatches, int rr, int staleness, int iterations, int window,
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
