/* Vector clocks of a program's instruction instances (passes/order.py, `HappensBefore`).

   Node v's row of k ints is the elementwise max of its predecessors' rows (preds ptr[v] .. ptr[v + 1]
   in idx, all < v: node order is topological), with its own column (col[v] >= 0) set to its position
   step[v] in its lane; -1 where no node of that column happens before. The Python loop it replaces
   does the same integer operations, so the rows are equal. */

void rp_clocks(int n, int k, const int *ptr, const int *idx, const int *col, const int *step, int *rows)
{
    for (int v = 0; v < n; v++) {
        int *row = rows + (long)v * k;
        int a = ptr[v], b = ptr[v + 1];
        if (a == b) {
            for (int c = 0; c < k; c++)
                row[c] = -1;
        } else {
            const int *first = rows + (long)idx[a] * k;
            for (int c = 0; c < k; c++)
                row[c] = first[c];
            for (int e = a + 1; e < b; e++) {
                const int *other = rows + (long)idx[e] * k;
                for (int c = 0; c < k; c++)
                    if (other[c] > row[c])
                        row[c] = other[c];
            }
        }
        if (col[v] >= 0)
            row[col[v]] = step[v];
    }
}
