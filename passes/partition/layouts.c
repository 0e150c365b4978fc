/* The cap walk's layouts in C (see native.py): cap_walk._fewest, _even and _greedy, line for line on the same
 * doubles (built with -ffp-contract=off), so the same layouts as the Python functions. p: prefix sums of one
 * side's layer times (n + 1 values), cap: the stage-time cap; EPS as cap_walk._EPS.
 */
#include <stddef.h>

#define EPS 1e-12

/* bisect.bisect_right(p, x, lo, hi) */
static int bisect_right(const double *p, double x, int lo, int hi) {
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (x < p[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* bisect.bisect_left(p, x, lo, hi) */
static int bisect_left(const double *p, double x, int lo, int hi) {
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (p[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* cap_walk._fewest */
int rp_fewest(const double *p, int n, double cap) {
    int k = 0, i = 0;
    double slack = cap * EPS;
    while (i < n) {
        int j = bisect_right(p, p[i] + cap + slack, i + 1, n + 1) - 1;
        i = j > i + 1 ? j : i + 1;
        k++;
    }
    return k;
}

/* cap_walk._greedy into sizes (room for k); returns 1, or 0 for None. */
static int greedy(const double *p, int n, double cap, int k, int *sizes) {
    int i = 0, len = 0;
    double slack = cap * EPS;
    while (i < n) {
        int j = bisect_right(p, p[i] + cap + slack, i + 1, n + 1) - 1, bound = n - (k - len - 1);
        j = j > i + 1 ? j : i + 1;
        j = j < bound ? j : bound;
        if (j <= i || len == k) return 0;
        sizes[len++] = j - i;
        i = j;
    }
    return len == k;
}

/* cap_walk._even into sizes (room for k); reach: room for k + 1. Returns 1, or 0 for None. */
static int even(const double *p, int n, double cap, int k, int *sizes, int *reach) {
    double slack = cap * EPS;
    int q, j, prev = 0;
    reach[0] = n;
    for (q = 0; q < k; q++) {
        int i = reach[q];
        if (i > 0) {
            int b = bisect_left(p, p[i] - cap - slack, 0, i);
            b = b < i - 1 ? b : i - 1;
            reach[q + 1] = b > 0 ? b : 0;
        } else {
            reach[q + 1] = 0;
        }
    }
    if (reach[k] > 0) return 0;
    for (j = 1; j < k; j++) {
        int hi = bisect_right(p, p[prev] + cap + slack, prev + 1, n + 1) - 1, lo, i;
        double target;
        hi = hi > prev + 1 ? hi : prev + 1;
        hi = hi < n - (k - j) ? hi : n - (k - j);
        lo = reach[k - j] > prev + 1 ? reach[k - j] : prev + 1;
        lo = lo < hi ? lo : hi;
        target = p[n] * (double)j / (double)k;
        i = bisect_left(p, target, lo, hi + 1);
        i = i < hi ? i : hi;
        if (i > lo && target - p[i - 1] <= p[i] - target) i--;
        sizes[j - 1] = i - prev;
        prev = i;
    }
    sizes[k - 1] = n - prev;
    return 1;
}

/* cap_walk._Caps.layouts' candidates at one cap: for k = k0 .. min(n, k0 + extra) (k0 = the fewest stages),
 * _even, _greedy and _greedy on the reversed sums rp (reversed back), in that order. Layout c goes to
 * sizes[c * n ..] with len[c] stages (0: None). work: room for n + 1 ints. Returns k0. */
int rp_layouts(const double *p, const double *rp, int n, double cap, int extra, int *sizes, int *len, int *work) {
    int k0 = rp_fewest(p, n, cap), top = k0 + extra < n ? k0 + extra : n, k, c = 0;
    for (k = k0; k <= top; k++, c += 3) {
        int *e = sizes + (size_t)c * n, *g = e + n, *r = g + n, a;
        len[c] = even(p, n, cap, k, e, work) ? k : 0;
        len[c + 1] = greedy(p, n, cap, k, g) ? k : 0;
        len[c + 2] = greedy(rp, n, cap, k, r) ? k : 0;
        for (a = 0; a < k / 2 && len[c + 2]; a++) { /* right[::-1] */
            int t = r[a];
            r[a] = r[k - 1 - a];
            r[k - 1 - a] = t;
        }
    }
    return k0;
}
