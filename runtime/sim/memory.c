/* The simulator's memory model in C (`simulator._peaks`): each worker's peak bytes over the simulated jobs,
   the same integer sums over the same float times as the Python loop, so the same peaks.

   A job's buffer lives from its start until its last same-worker consumer ends (frees[used * nops + made]:
   an op `used` frees the buffers of an op `made` it depends on); a job's workspace while it runs; a
   gradient slot (iteration, worker, stage, round) of a stage not resident on the worker from the start
   of its first job to the latest end of one. The peak of a worker is that of its summed bytes over
   time, frees at a time before allocations at it (the Python sorts (time, kind, bytes) tuples; within one
   time and kind all deltas have one sign, so their order does not change the peak). */
#include <stdlib.h>

typedef struct { double t; int kind; long long delta; } event;

static int by_time(const void *a, const void *b)
{
    const event *x = a, *y = b;
    if (x->t != y->t)
        return x->t < y->t ? -1 : 1;
    return x->kind - y->kind;
}

static void add(event *ev, long long *count, int w, double a, double b, long long bytes)
{
    long long k = count[w];
    ev[k].t = a; ev[k].kind = 1; ev[k].delta = bytes;
    ev[k + 1].t = b; ev[k + 1].kind = 0; ev[k + 1].delta = -bytes;
    count[w] = k + 2;
}

/* Returns 0, or -1 when it cannot allocate its work space. out[w]: worker w's peak (without its resident state). */
int rp_peaks(int n, int total, int nw, int nops, const int *op, const unsigned char *frees, const int *wk,
             const double *starts, const double *ends, const int *ptr, const int *idx, const long long *size,
             const long long *work, const unsigned char *counted, const int *slot_stage, const int *slot_round,
             int nstages, int nrounds, const unsigned char *home, const long long *grad_bytes, long long *out)
{
    int iterations = n ? total / n : 0;
    long long nslots = (long long)iterations * nw * nstages * nrounds;
    double *free_at = malloc(sizeof(double) * (total ? total : 1));
    double *span_a = malloc(sizeof(double) * (nslots ? nslots : 1));
    double *span_b = malloc(sizeof(double) * (nslots ? nslots : 1));
    unsigned char *seen = calloc(nslots ? nslots : 1, 1);
    long long *count = calloc(nw ? nw : 1, sizeof(long long)), *cap = calloc(nw ? nw : 1, sizeof(long long));
    event **ev = calloc(nw ? nw : 1, sizeof(event *));
    int rc = -1;
    if (!free_at || !span_a || !span_b || !seen || !count || !cap || !ev)
        goto done;
    for (int j = 0; j < total; j++)
        free_at[j] = ends[j];
    for (int j = 0; j < total; j++) {
        const unsigned char *f = frees + (long)op[j % n] * nops;
        for (int e = ptr[j]; e < ptr[j + 1]; e++) {
            int d = idx[e];
            if (wk[d] == wk[j] && f[op[d % n]] && ends[j] > free_at[d])
                free_at[d] = ends[j];
        }
    }
    /* room: two events per interval, at most two intervals per job plus one per slot */
    for (int j = 0; j < total; j++) {
        int k = j % n, w = wk[j];
        if (w >= 0 && counted[k])
            cap[w] += 4;
    }
    for (long long s = 0; s < nslots; s++)
        cap[(s / ((long long)nstages * nrounds)) % nw] += 2;
    for (int w = 0; w < nw; w++)
        if (!(ev[w] = malloc(sizeof(event) * (cap[w] ? cap[w] : 1))))
            goto done;
    for (int j = 0; j < total; j++) {
        int k = j % n, w = wk[j];
        if (w < 0 || !counted[k])
            continue;
        if (work[k])
            add(ev[w], count, w, starts[j], ends[j], work[k]);
        if (size[k])
            add(ev[w], count, w, starts[j], free_at[j], size[k]);
        int s = slot_stage[k];
        if (s >= 0 && !home[(long)w * nstages + s]) {
            long long key = (((long long)(j / n) * nw + w) * nstages + s) * nrounds + slot_round[k];
            if (!seen[key]) {
                seen[key] = 1;
                span_a[key] = starts[j];
                span_b[key] = ends[j];
            } else if (ends[j] > span_b[key]) {
                span_b[key] = ends[j];
            }
        }
    }
    for (long long key = 0; key < nslots; key++)
        if (seen[key]) {
            int s = (int)((key / nrounds) % nstages), w = (int)((key / nrounds / nstages) % nw);
            add(ev[w], count, w, span_a[key], span_b[key], grad_bytes[s]);
        }
    for (int w = 0; w < nw; w++) {
        qsort(ev[w], count[w], sizeof(event), by_time);
        long long cur = 0, peak = 0;
        for (long long k = 0; k < count[w]; k++) {
            cur += ev[w][k].delta;
            if (cur > peak)
                peak = cur;
        }
        out[w] = peak;
    }
    rc = 0;
done:
    if (ev)
        for (int w = 0; w < nw; w++)
            free(ev[w]);
    free(ev);
    free(cap);
    free(count);
    free(seen);
    free(span_b);
    free(span_a);
    free(free_at);
    return rc;
}
