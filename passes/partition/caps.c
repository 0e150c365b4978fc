/* The cap walk's caps in C (see native.py): per side of one fused size, cap_walk._Caps' heaps of contiguous sums
 * (one walk up, one down), the layouts found at each cap (layouts.c) and the set of those seen, so that only the
 * new ones that may fit the memory budget come back to Python; and rp_step (cap_walk._PyWalk.step), which picks
 * the next cap of both sides, pops it and finds those layouts. The same comparisons on the same doubles (built
 * with -ffp-contract=off) and the same integer bytes, so the same caps and layouts in the same order as the
 * Python.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EPS 1e-12 /* cap_walk._EPS */

int rp_fewest(const double *p, int n, double cap);
int rp_layouts(const double *p, const double *rp, int n, double cap, int extra, int *sizes, int *len, int *work);

/* A heap entry as cap_walk._Caps keeps it: (+-sum of layers [i, j), i, j), ordered as Python orders the tuple. */
typedef struct {
    double key;
    int i, j;
} Entry;

/* One walk: its heap (at most one entry per start, plus walking up the first cap) and its least cap `lo`. */
typedef struct {
    Entry *heap;
    int size, down;
    double lo;
} Walk;

/* The layouts seen so far: a hash set of stage-size sequences (open addressing, slots hold index + 1). */
typedef struct {
    int *arena;         /* the layouts' sizes back to back */
    size_t used, room;  /* ints in the arena, and its capacity */
    size_t *at;         /* per layout: where its sizes start */
    int *len;           /* per layout: its stage count */
    size_t count, held; /* layouts, and room in at/len */
    size_t *table;      /* slots: 0 empty, else layout index + 1 */
    size_t slots;       /* a power of 2, at least twice count */
} Seen;

/* One side of n layers: prefix sums p (n + 1 values) and their reversal rp; the candidates' buffers (rp_layouts':
 * sizes, len, work) and the indices of the new ones that may fit (fresh); the prefix sums of the bytes a stage of
 * this side holds in any plan (mem, NULL: no memory budget) and the budget. p, mem and the buffers are the
 * caller's (native.CapWalks); rp, the walks and the seen set are owned here. */
typedef struct {
    int n, extra, nfresh;
    const double *p;
    double *rp;
    int *sizes, *len, *work, *fresh;
    const long long *mem;
    long long budget;
    Walk walk[2]; /* walking up (0) and down (1) */
    Seen seen;
} Side;

/* (a.key, a.i, a.j) < (b.key, b.i, b.j) as Python compares the tuples */
static int before(const Entry *a, const Entry *b) {
    if (a->key != b->key) return a->key < b->key;
    if (a->i != b->i) return a->i < b->i;
    return a->j < b->j;
}

static void sift_down(Entry *h, int size, int at) {
    Entry x = h[at];
    for (;;) {
        int c = 2 * at + 1;
        if (c >= size) break;
        if (c + 1 < size && before(&h[c + 1], &h[c])) c++;
        if (!before(&h[c], &x)) break;
        h[at] = h[c];
        at = c;
    }
    h[at] = x;
}

/* heapq.heapreplace, or heapq.heappop when e is NULL: the same entry leaves first either way (a total order). */
static void replace_top(Walk *w, const Entry *e) {
    if (e != NULL) {
        w->heap[0] = *e;
    } else {
        w->heap[0] = w->heap[--w->size];
    }
    if (w->size > 0) sift_down(w->heap, w->size, 0);
}

void rp_side_free(Side *s) {
    if (s == NULL) return;
    free(s->rp), free(s->walk[0].heap), free(s->walk[1].heap);
    free(s->seen.arena), free(s->seen.at), free(s->seen.len), free(s->seen.table);
    free(s);
}

/* A side (see Side) of layers 0..n-1; NULL when out of memory. */
Side *rp_side_new(int n, int extra, const double *p, int *sizes, int *len, int *work, int *fresh,
                  const long long *mem, long long budget) {
    Side *s = calloc(1, sizeof(Side));
    int k;
    if (s == NULL) return NULL;
    s->n = n, s->extra = extra, s->p = p, s->mem = mem, s->budget = budget;
    s->sizes = sizes, s->len = len, s->work = work, s->fresh = fresh;
    s->rp = malloc((size_t)(n + 1) * sizeof(double));
    s->walk[0].heap = malloc((size_t)(n + 1) * sizeof(Entry));
    s->walk[1].heap = malloc((size_t)(n + 1) * sizeof(Entry));
    s->walk[1].down = 1;
    s->seen.slots = 64;
    s->seen.table = calloc(s->seen.slots, sizeof(size_t));
    if (s->rp == NULL || s->walk[0].heap == NULL || s->walk[1].heap == NULL || s->seen.table == NULL) {
        rp_side_free(s);
        return NULL;
    }
    for (k = 0; k <= n; k++) s->rp[k] = p[n] - p[n - k]; /* _Caps.rp: from the last layer */
    return s;
}

/* cap_walk._Caps.__init__: the first sum of each start in [lo, hi) walking down (down = 1), from lo up (0). */
void rp_walk_start(Side *s, int down, double lo, double hi) {
    const double *p = s->p;
    int n = s->n, k = 1, i;
    Walk *w = &s->walk[down];
    w->size = 0, w->lo = lo;
    if (down) {
        double reach = hi * (1 - EPS), floor = lo * (1 - EPS);
        for (i = 0; i < n; i++) {
            double x = p[i] + reach;
            int j;
            if (k <= i) k = i + 1;
            while (k <= n && p[k] < x) k++;
            j = k - 1;
            if (j > i && p[j] - p[i] >= floor) w->heap[w->size++] = (Entry){p[i] - p[j], i, j};
        }
    } else {
        double reach = lo * (1 + EPS);
        w->heap[w->size++] = (Entry){lo, -1, -1};
        for (i = 0; i < n; i++) {
            double x = p[i] + reach;
            if (k <= i) k = i + 1;
            while (k <= n && p[k] <= x) k++;
            if (k <= n) w->heap[w->size++] = (Entry){p[k] - p[i], i, k};
        }
    }
    for (i = w->size / 2 - 1; i >= 0; i--) sift_down(w->heap, w->size, i);
}

/* cap_walk._Caps.head: 1 and the next cap in *cap, or 0 when the walk is over. */
static int head(const Walk *w, double *cap) {
    if (w->size == 0) return 0;
    *cap = w->down ? -w->heap[0].key : w->heap[0].key;
    return 1;
}

/* cap_walk._Caps.pop: every entry equal to the head cap moves on to its start's next sum. */
static void pop(Walk *w, const double *p, int n) {
    double key = w->heap[0].key, tol = fabs(key) * EPS, floor = w->lo * (1 - EPS);
    while (w->size > 0) {
        int i = w->heap[0].i, j = w->heap[0].j;
        if (!(fabs(w->heap[0].key - key) <= tol)) break;
        if (w->down) {
            if (j - 1 > i && p[j - 1] - p[i] >= floor) {
                Entry e = {p[i] - p[j - 1], i, j - 1};
                replace_top(w, &e);
                continue;
            }
        } else if (0 <= j && j < n) {
            Entry e = {p[j + 1] - p[i], i, j + 1};
            replace_top(w, &e);
            continue;
        }
        replace_top(w, NULL);
    }
}

static uint64_t hash_of(const int *sizes, int k) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)k; /* FNV-1a */
    for (int a = 0; a < k; a++) {
        h ^= (uint32_t)sizes[a];
        h *= 1099511628211ULL;
    }
    return h;
}

/* Put layout index x (already in the arena) into a table of `slots` slots. */
static void place(size_t *table, size_t slots, const Seen *set, size_t x) {
    size_t at = hash_of(set->arena + set->at[x], set->len[x]) & (slots - 1);
    while (table[at]) at = (at + 1) & (slots - 1);
    table[at] = x + 1;
}

/* Add the layout (k sizes) to the set: 1 if it was not there, 0 if it was, -1 out of memory. */
static int seen_add(Seen *set, const int *sizes, int k) {
    size_t at = hash_of(sizes, k) & (set->slots - 1), x;
    for (; set->table[at]; at = (at + 1) & (set->slots - 1)) {
        x = set->table[at] - 1;
        if (set->len[x] == k && memcmp(set->arena + set->at[x], sizes, (size_t)k * sizeof(int)) == 0) return 0;
    }
    if (set->used + (size_t)k > set->room) {
        size_t room = 2 * (set->room + (size_t)k);
        int *arena = realloc(set->arena, room * sizeof(int));
        if (arena == NULL) return -1;
        set->arena = arena, set->room = room;
    }
    if (set->count == set->held) {
        size_t held = 2 * set->held + 16;
        size_t *pos = realloc(set->at, held * sizeof(size_t));
        int *len;
        if (pos == NULL) return -1;
        set->at = pos;
        len = realloc(set->len, held * sizeof(int));
        if (len == NULL) return -1;
        set->len = len, set->held = held;
    }
    x = set->count++;
    memcpy(set->arena + set->used, sizes, (size_t)k * sizeof(int));
    set->at[x] = set->used, set->len[x] = k, set->used += (size_t)k;
    set->table[at] = x + 1;
    if (2 * set->count > set->slots) { /* grow: every layout placed again */
        size_t slots = 2 * set->slots, *table = calloc(slots, sizeof(size_t)), y;
        if (table == NULL) return -1;
        for (y = 0; y < set->count; y++) place(table, slots, set, y);
        free(set->table);
        set->table = table, set->slots = slots;
    }
    return 1;
}

/* evaluator.Evaluator.side_fits: whether no stage of the layout holds more than the budget in every plan. */
static int side_fits(const Side *s, const int *sizes, int k) {
    int lo = 0;
    if (s->mem == NULL) return 1;
    for (int a = 0; a < k; a++) {
        if (s->mem[lo + sizes[a]] - s->mem[lo] > s->budget) return 0;
        lo += sizes[a];
    }
    return 1;
}

/* cap_walk._Caps.layouts at cap: the candidates (rp_layouts), every one seen from now on; the indices of those
 * not seen before that may fit (side_fits) go to s->fresh, in order. Returns k0 (the fewest stages), or -1 out
 * of memory. */
static int layouts(Side *s, double cap) {
    int n = s->n, k0 = rp_layouts(s->p, s->rp, n, cap, s->extra, s->sizes, s->len, s->work), c;
    int count = 3 * ((k0 + s->extra < n ? k0 + s->extra : n) - k0 + 1);
    s->nfresh = 0;
    for (c = 0; c < count; c++) {
        const int *sizes = s->sizes + (size_t)c * n;
        int added;
        if (!s->len[c]) continue;
        added = seen_add(&s->seen, sizes, s->len[c]);
        if (added < 0) return -1;
        if (added && side_fits(s, sizes, s->len[c])) s->fresh[s->nfresh++] = c;
    }
    return k0;
}

/* cap_walk._Generator._next: the next cap of either side (the least walking up, the greatest down). */
static int next_cap(Side *f, Side *b, int down, double *cap) {
    double x, y;
    int hx = head(&f->walk[down], &x), hy = head(&b->walk[down], &y);
    if (!hx && !hy) return 0;
    if (!hx) *cap = y;
    else if (!hy) *cap = x;
    else *cap = (down ? y > x : y < x) ? y : x; /* max() and min() keep the first of equals */
    return 1;
}

/* cap_walk._PyWalk.step for both sides of one fused size walking one way (down = 1) or up: the next cap; each
 * side whose head it is is popped and its layouts at the cap found (out[0], out[2]: the forward and backward k0,
 * -1 for a side not at the cap; out[1], out[3]: how many are new and may fit, their candidate indices in the
 * side's fresh); then the next cap (*cap) and the backward side's fewest stages under it (out[4]). Returns
 * 0: no cap left (nothing done), 1: stepped, 2: stepped and no cap left, -1: out of memory. */
int rp_step(Side *f, Side *b, int down, double *cap, int *out) {
    double at, h;
    Side *sides[2] = {f, b};
    if (!next_cap(f, b, down, &at)) return 0;
    for (int a = 0; a < 2; a++) {
        Side *s = sides[a];
        out[2 * a] = -1, out[2 * a + 1] = 0;
        if (!head(&s->walk[down], &h) || h != at) continue;
        pop(&s->walk[down], s->p, s->n);
        out[2 * a] = layouts(s, at);
        if (out[2 * a] < 0) return -1;
        out[2 * a + 1] = s->nfresh;
    }
    if (!next_cap(f, b, down, cap)) return 2;
    out[4] = rp_fewest(b->p, b->n, *cap);
    return 1;
}
