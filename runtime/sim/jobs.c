/* The simulator's two passes over every job besides the event loop, in C: `simulator._expand_deps_python`
 * (the dependencies of K back-to-back iterations from one iteration's template) and `events.exposed_waits_python`
 * (how long each compute job waited on transfers). A paper model's program runs K x thousands of jobs, and in
 * Python these two loops took about as long as the event loop itself.
 *
 * The same results as the Python: the same integers in the same order, and the exposed waits from the same
 * floats by the same comparisons and one subtraction each, so bit for bit (tests/runtime/sim/test_sim_kernel.py).
 */

/* The CSR (ptr, idx) of `iterations` copies of n templates: template k's dependencies (back, since, d) at
 * tptr[k] .. tptr[k + 1] become, in iteration t, job (t - back) * n + d, kept when t - back >= 0 and t >= since.
 * ptr has iterations * n + 1 entries, idx room for iterations * tptr[n]. Returns how many idx entries it wrote. */
long rp_expand_deps(int n, int iterations, const int *tptr, const int *back, const int *since, const int *dep,
                    int *ptr, int *idx) {
    long at = 0;
    int t, k, e;
    ptr[0] = 0;
    for (t = 0; t < iterations; t++) {
        for (k = 0; k < n; k++) {
            for (e = tptr[k]; e < tptr[k + 1]; e++) {
                if (t - back[e] >= 0 && t >= since[e])
                    idx[at++] = (t - back[e]) * n + dep[e];
            }
            ptr[t * n + k + 1] = (int)at;
        }
    }
    return at;
}

/* Per job: how long a compute job waited on transfers beyond its lane and non-transfer inputs (see
 * `events.exposed_waits_python`). Jobs are in a topological order; lanes are numbered 0 .. n_lanes - 1.
 * `avail` is work space of n doubles, `prev` of n_lanes. Returns 0, or -1 - j when job j's lane is not one of
 * those (nothing is read or written out of bounds). */
int rp_exposed_waits(int n, const int *ptr, const int *idx, const unsigned char *transfer,
                     const unsigned char *compute, const int *lane, const double *starts, const double *ends,
                     double *avail, double *prev, int n_lanes, double *out) {
    int j, k, q;
    for (j = 0; j < n; j++)
        if (lane[j] < 0 || lane[j] >= n_lanes) return -1 - j;
    for (j = 0; j < n; j++) {
        if (transfer[j]) {
            double a = 0.0;
            for (k = ptr[j]; k < ptr[j + 1]; k++)
                if (avail[idx[k]] > a) a = avail[idx[k]];
            avail[j] = a;
        } else {
            avail[j] = ends[j];
        }
    }
    for (q = 0; q < n_lanes; q++) prev[q] = 0.0;
    for (j = 0; j < n; j++) {
        out[j] = 0.0;
        if (compute[j]) {
            double bound = prev[lane[j]], w;
            for (k = ptr[j]; k < ptr[j + 1]; k++)
                if (avail[idx[k]] > bound) bound = avail[idx[k]];
            w = starts[j] - bound;
            out[j] = w > 0.0 ? w : 0.0; /* Python's max(0.0, w): w only when larger */
        }
        prev[lane[j]] = ends[j];
    }
    return 0;
}

/* The compute jobs' totals (see `simulator._totals_python`), summed in job order as the Python sums them: per
 * worker the busy time (end - start) and the exposed wait, per iteration the latest end. */
void rp_totals(int total, int n, const unsigned char *compute, const int *wk, const double *starts,
               const double *ends, const double *waits, double *busy, double *exposed, double *ends_t) {
    int j;
    for (j = 0; j < total; j++) {
        if (!compute[j % n]) continue;
        busy[wk[j]] += ends[j] - starts[j];
        if (ends[j] > ends_t[j / n]) ends_t[j / n] = ends[j];
        exposed[wk[j]] += waits[j];
    }
}
