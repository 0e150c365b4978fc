/* The plan's shape (`timing.shape`) and the steps both recurrences share; see shape.h. */
#include <math.h>

#include "shape.h"

/* `timing.shape` of stages given in slot order as (kind code, first layer, end layer, fwd sum, bwd sum);
 * nl: the end layer of the model. seg_of: room for nl + 1 ints. */
void build_shape(Shape *sh, int ns, const int *code, const int *lo, const int *hi, const double *f,
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
void copies_of(const Shape *sh, const double *step, const double *uploaded, double *out) {
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
void begin_iteration(const Shape *sh, const double *copies, double *ready, double *gend) {
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
double take_steps(const Shape *sh, const double *gend, const double *prev, double last_step, double *step) {
    int g;
    for (g = sh->nseg - 1; g >= 0; g--) { /* max(gend, prev, last_step): the value of Python's max() */
        double x = gend[sh->grad_stage[g]];
        if (prev != NULL && prev[g] > x) x = prev[g];
        if (x > last_step) last_step = x;
        step[g] = last_step;
    }
    return last_step;
}

/* Doubles of work space for a plan of ns stages and nseg <= nl segments, iterations iters (either recurrence). */
size_t work_words(int gpus, int ns, int nl, int iters, int microbatches, int rr) {
    size_t width = 2 * (size_t)gpus + ns + 1 + 2 * (size_t)nl;
    size_t steady = 2 * (size_t)gpus + 5 * (size_t)ns + iters + 2 * (size_t)iters * nl + (size_t)iters * width;
    size_t exact = 2 * (size_t)gpus + 3 * (size_t)ns + (size_t)ns * (microbatches / rr) + iters
                   + 2 * (size_t)iters * nl + (size_t)ns * rr + 2 * (size_t)rr;
    return (steady > exact ? steady : exact) + 2 * (size_t)ns; /* + the shape's pre and post */
}
