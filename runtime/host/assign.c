/* The host buffer assignment's loops (runtime/host/assign.py), each the same integer operations as its
   Python/torch version there, so the results are equal.

   rp_dominated: out[b * nc + c] = 1 when every column of R's row b is <= that of W's row c (buffer b's
       readers, their latest position per lane, all happen before c's writer, whose vector clock is W[c]).
   rp_and_dominated_t: the same test transposed and and-ed into a square ok: ok[c * n + b] stays 1 only when
       R's row b is <= W's row c (the entries already 0 are not tested).
   rp_pack: best-fit placement, buffers in the given order, each into the smallest gap between the placed
       buffers it may not share with (ok[k * n + j] == 0), the first such gap by (start, end) order, else
       on top of them.
   rp_clique: the heaviest of the greedy cliques grown from each seed (a set of buffers that can all be live at
       once): add the heaviest buffer (the lowest index on a tie) that can be live with every one taken so far
       (ok == 0, itself excluded). */
#include <stdlib.h>

void rp_dominated(int nb, int nc, int k, const int *R, const int *W, unsigned char *out)
{
    for (int b = 0; b < nb; b++) {
        const int *r = R + (long)b * k;
        unsigned char *o = out + (long)b * nc;
        for (int c = 0; c < nc; c++) {
            const int *w = W + (long)c * k;
            int all = 1;
            for (int l = 0; l < k; l++)
                if (r[l] > w[l]) {
                    all = 0;
                    break;
                }
            o[c] = (unsigned char)all;
        }
    }
}

void rp_and_dominated_t(int n, int k, const int *R, const int *W, unsigned char *ok)
{
    for (int c = 0; c < n; c++) {
        const int *w = W + (long)c * k;
        unsigned char *o = ok + (long)c * n;
        for (int b = 0; b < n; b++) {
            if (!o[b])
                continue;
            const int *r = R + (long)b * k;
            for (int l = 0; l < k; l++)
                if (r[l] > w[l]) {
                    o[b] = 0;
                    break;
                }
        }
    }
}

typedef struct { long long start, end; } span;

static int before(const span *x, const span *y)  /* (start, end) order */
{
    return x->start != y->start ? x->start < y->start : x->end < y->end;
}

int rp_pack(int n, const int *order, const long long *size, const unsigned char *ok, long long *offset)
{
    /* the placed buffers kept in (start, end) order as they are placed (an insertion per buffer), so each new
       one scans them once, skipping those it may share with: no sort per buffer */
    span *taken = malloc(sizeof(span) * (n ? n : 1));
    int *who = malloc(sizeof(int) * (n ? n : 1));
    if (!taken || !who) {
        free(taken);
        free(who);
        return -1;
    }
    for (int x = 0; x < n; x++) {
        int k = order[x];
        const unsigned char *row = ok + (long)k * n;
        long long top = 0, best_gap = -1, at = -1;
        for (int i = 0; i < x; i++) {
            if (row[who[i]])
                continue;
            long long gap = taken[i].start - top;  /* top: the highest end of the clashing spans before this one */
            if (gap >= size[k] && (best_gap < 0 || gap < best_gap)) {
                best_gap = gap;
                at = top;
            }
            if (taken[i].end > top)
                top = taken[i].end;
        }
        offset[k] = at >= 0 ? at : top;
        span mine = {offset[k], offset[k] + size[k]};
        int i = x;
        while (i > 0 && before(&mine, &taken[i - 1])) {
            taken[i] = taken[i - 1];
            who[i] = who[i - 1];
            i--;
        }
        taken[i] = mine;
        who[i] = k;
    }
    free(taken);
    free(who);
    return 0;
}

long long rp_clique(int n, int nseeds, const int *seed_ptr, const int *seed_idx, const long long *size,
                    const unsigned char *ok)
{
    /* the buffers still addable, in index order, filtered by each one taken: each pick scans only those */
    int *left = malloc(sizeof(int) * (n ? n : 1));
    if (!left)
        return -1;
    long long best = 0;
    for (int f = 0; f < nseeds; f++) {
        long long total = 0;
        int m = 0;
        for (int j = 0; j < n; j++)
            left[m++] = j;
        for (int e = seed_ptr[f]; e < seed_ptr[f + 1]; e++) {  /* the seed: buffers live together already */
            int s = seed_idx[e], kept = 0;
            const unsigned char *row = ok + (long)s * n;
            total += size[s];
            for (int i = 0; i < m; i++)
                if (left[i] != s && !row[left[i]])
                    left[kept++] = left[i];
            m = kept;
        }
        while (m > 0) {
            int pick = left[0], kept = 0;
            for (int i = 1; i < m; i++)
                if (size[left[i]] > size[pick])
                    pick = left[i];
            total += size[pick];
            const unsigned char *row = ok + (long)pick * n;
            for (int i = 0; i < m; i++)
                if (left[i] != pick && !row[left[i]])
                    left[kept++] = left[i];
            m = kept;
        }
        if (total > best)
            best = total;
    }
    free(left);
    return best;
}
