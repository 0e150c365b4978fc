/* The simulator's event loop (`events.run_python`) in C.
 *
 * The same decisions in the same order: events are popped by (time, kind, sequence number) exactly as the
 * Python heap pops its tuples, and times are only compared, maxed and added, so the starts and ends are the
 * Python's floats bit for bit. Jobs come as columns; their dependencies as CSR (dep_ptr[j] .. dep_ptr[j + 1]
 * of dep_idx). Lanes are numbered 0 .. n_lanes - 1 in the order that breaks ties (the lower goes first),
 * channels 0 .. n_chans - 1 in any order.
 */
#include <stdlib.h>

enum { END = 0, TRY = 1 };

typedef struct {
    double t;
    int kind;
    long seq;
    int x;
} Event;

static int before(const Event *a, const Event *b) {
    if (a->t != b->t) return a->t < b->t;
    if (a->kind != b->kind) return a->kind < b->kind;
    return a->seq < b->seq;
}

typedef struct {
    Event *e;
    long n, cap;
} Heap;

static int push(Heap *h, double t, int kind, long seq, int x) {
    long i;
    if (h->n == h->cap) {
        long cap = h->cap ? 2 * h->cap : 64;
        Event *e = realloc(h->e, (size_t)cap * sizeof(Event));
        if (!e) return -1;
        h->e = e;
        h->cap = cap;
    }
    i = h->n++;
    h->e[i].t = t;
    h->e[i].kind = kind;
    h->e[i].seq = seq;
    h->e[i].x = x;
    while (i > 0) {
        long up = (i - 1) / 2;
        Event tmp;
        if (!before(&h->e[i], &h->e[up])) break;
        tmp = h->e[i];
        h->e[i] = h->e[up];
        h->e[up] = tmp;
        i = up;
    }
    return 0;
}

static Event pop(Heap *h) {
    Event top = h->e[0];
    long i = 0;
    h->e[0] = h->e[--h->n];
    for (;;) {
        long l = 2 * i + 1, r = l + 1, m = i;
        Event tmp;
        if (l < h->n && before(&h->e[l], &h->e[m])) m = l;
        if (r < h->n && before(&h->e[r], &h->e[m])) m = r;
        if (m == i) break;
        tmp = h->e[i];
        h->e[i] = h->e[m];
        h->e[m] = tmp;
        i = m;
    }
    return top;
}

/* Schedule the jobs: starts, ends and done (0/1) per job. Returns the number of jobs that ran, -1 when out of
 * memory, or -2 - j when job j's lane already holds a job of another channel. */
long rp_run_jobs(int n, const int *lane, const int *chan, const int *prio, const double *dur, const int *dep_ptr,
                 const int *dep_idx, int n_lanes, int n_chans, double *starts, double *ends, unsigned char *done) {
    long result = -1, seq = 0, ran = 0;
    int j, q, c, k;
    /* per lane: its jobs in list order (CSR), its head and its channel; per channel: its lanes by number */
    int *lane_ptr = calloc((size_t)n_lanes + 1, sizeof(int)), *lane_jobs = malloc((size_t)n * sizeof(int) + 1);
    int *head = calloc((size_t)n_lanes + 1, sizeof(int)), *lane_chan = malloc((size_t)n_lanes * sizeof(int) + 1);
    int *chan_ptr = calloc((size_t)n_chans + 1, sizeof(int)), *chan_lanes = malloc((size_t)n_lanes * sizeof(int) + 1);
    int *chan_order = malloc((size_t)n_chans * sizeof(int) + 1), *busy = calloc((size_t)n_chans + 1, sizeof(int));
    int *pending = malloc((size_t)n * sizeof(int) + 1), *dnt_ptr = calloc((size_t)n + 1, sizeof(int));
    int *dnt = malloc((size_t)dep_ptr[n] * sizeof(int) + 1);
    double *ready = calloc((size_t)n + 1, sizeof(double)), *chan_free = calloc((size_t)n_chans + 1, sizeof(double));
    Heap h = {NULL, 0, 0};
    if (!lane_ptr || !lane_jobs || !head || !lane_chan || !chan_ptr || !chan_lanes || !chan_order || !busy ||
        !pending || !dnt_ptr || !dnt || !ready || !chan_free)
        goto out;
    for (q = 0; q < n_lanes; q++) lane_chan[q] = -1;
    for (j = 0; j < n; j++) {
        q = lane[j];
        if (lane_chan[q] < 0) {
            lane_chan[q] = chan[j];
        } else if (lane_chan[q] != chan[j]) {
            result = -2 - (long)j;
            goto out;
        }
        lane_ptr[q + 1]++;
        pending[j] = dep_ptr[j + 1] - dep_ptr[j];
        done[j] = 0;
        for (k = dep_ptr[j]; k < dep_ptr[j + 1]; k++) dnt_ptr[dep_idx[k] + 1]++;
    }
    for (q = 0; q < n_lanes; q++) lane_ptr[q + 1] += lane_ptr[q];
    for (j = 0; j < n; j++) dnt_ptr[j + 1] += dnt_ptr[j];
    {   /* fill the lanes' queues and each job's dependents, both in job order */
        int *fill = calloc((size_t)(n > n_lanes ? n : n_lanes) + 1, sizeof(int));
        if (!fill) goto out;
        for (j = 0; j < n; j++) lane_jobs[lane_ptr[lane[j]] + fill[lane[j]]++] = j;
        for (q = 0; q < n_lanes; q++) fill[q] = 0;
        for (j = 0; j < n; j++)
            for (k = dep_ptr[j]; k < dep_ptr[j + 1]; k++) {
                int d = dep_idx[k];
                dnt[dnt_ptr[d] + fill[d]++] = j;
            }
        free(fill);
    }
    /* channels in order of their first lane (the Python's dict order), each channel's lanes by number */
    {
        int m = 0;
        int *seen = busy; /* 0 until numbered: reset below */
        for (q = 0; q < n_lanes; q++) {
            c = lane_chan[q];
            if (c >= 0 && !seen[c]) {
                seen[c] = 1;
                chan_order[m++] = c;
            }
            if (c >= 0) chan_ptr[c + 1]++;
        }
        for (c = 0; c < n_chans; c++) chan_ptr[c + 1] += chan_ptr[c];
        for (c = 0; c < n_chans; c++) seen[c] = 0;
        for (q = 0; q < n_lanes; q++) {
            c = lane_chan[q];
            if (c >= 0) chan_lanes[chan_ptr[c] + seen[c]++] = q;
        }
        for (c = 0; c < n_chans; c++) busy[c] = 0;
        for (k = 0; k < m; k++)
            if (push(&h, 0.0, TRY, seq++, chan_order[k])) goto out;
    }
    while (h.n > 0) {
        Event ev = pop(&h);
        double now = ev.t, start, end;
        int best = -1;
        if (ev.kind == END) {
            int x = ev.x;
            done[x] = 1;
            ran++;
            busy[chan[x]] = 0;
            if (push(&h, now, TRY, seq++, chan[x])) goto out;
            end = ends[x];
            for (k = dnt_ptr[x]; k < dnt_ptr[x + 1]; k++) {
                int d = dnt[k];
                pending[d]--;
                if (end > ready[d]) ready[d] = end;
                if (pending[d] == 0 && push(&h, now, TRY, seq++, chan[d])) goto out;
            }
            continue;
        }
        c = ev.x;
        if (busy[c]) continue;
        for (k = chan_ptr[c]; k < chan_ptr[c + 1]; k++) { /* the ready lane head with the least key */
            q = chan_lanes[k];
            if (head[q] < lane_ptr[q + 1] - lane_ptr[q]) {
                j = lane_jobs[lane_ptr[q] + head[q]];
                if (pending[j] == 0 && (best < 0 || prio[j] < prio[best] ||
                                        (prio[j] == prio[best] && ready[j] < ready[best])))
                    best = j;
            }
        }
        if (best < 0) continue;
        start = now; /* Python's max(now, ready, free): the first of the largest */
        if (ready[best] > start) start = ready[best];
        if (chan_free[c] > start) start = chan_free[c];
        starts[best] = start;
        ends[best] = end = start + dur[best];
        head[lane[best]]++;
        busy[c] = 1;
        chan_free[c] = end;
        if (push(&h, end, END, seq++, best)) goto out;
    }
    result = ran;
out:
    free(lane_ptr); free(lane_jobs); free(head); free(lane_chan); free(chan_ptr); free(chan_lanes);
    free(chan_order); free(busy); free(pending); free(dnt_ptr); free(dnt); free(ready); free(chan_free); free(h.e);
    return result;
}
