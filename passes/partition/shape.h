/* The plan's shape and what both recurrences share (shape.c), and the two recurrences (steady.c, exact.c): the
 * planner's C kernel, see native.py. Every function here does the same double operations in the same order as
 * the Python it names (built with -ffp-contract=off), so it gives the same floats.
 */
#ifndef RP_SHAPE_H
#define RP_SHAPE_H

#include <stddef.h>

/* `timing.Shape`: per stage its kind code (0 F, 1 FB, 2 B), saved-input producer (an F stage's index, -1: none),
 * segments [seg_lo, seg_hi), pre and post times; per segment the stage whose backward completes its gradient. */
typedef struct {
    int ns, nseg;
    int *kind, *prod, *seg_lo, *seg_hi; /* per stage */
    double *pre, *post;
    int *grad_stage;                    /* per segment */
} Shape;

void build_shape(Shape *sh, int ns, const int *code, const int *lo, const int *hi, const double *f,
                 const double *b, int nl, int *seg_of);
void copies_of(const Shape *sh, const double *step, const double *uploaded, double *out);
void begin_iteration(const Shape *sh, const double *copies, double *ready, double *gend);
double take_steps(const Shape *sh, const double *gend, const double *prev, double last_step, double *step);
size_t work_words(int gpus, int ns, int nl, int iters, int microbatches, int rr);
double steady_one(const Shape *sh, int n, int microbatches, int rr, int staleness, int iters, int window,
                  double cutoff, double *ws);
double exact_one(const Shape *sh, int n, int microbatches, int rr, int staleness, int iterations, int window,
                 double cutoff, double *ws);

#endif
