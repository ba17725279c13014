"""One-to-one alignment of gold items with answer items (the Hungarian method).

`align(weights)` pairs rows (gold items) with columns (answer items) to maximize the summed
integer weight. Ties are broken by a stated rule, so the same lists always pair the same way:
among pairings of equal weight, the first gold item takes the earliest answer item it can, then
the second gold item, and so on (a gold item left unpaired counts as later than any). The rule
is folded into the weights (each pairing's tie-break value is a number written in base m + 1,
one digit per gold item), so one exact integer optimization gives both.

Pure; O(n^2 m) for n x m weights, exact on Python integers.
"""

from __future__ import annotations

from collections.abc import Sequence


def _min_cost_rows(cost: Sequence[Sequence[int]]) -> list[int]:
    """For n <= m: the column of each row in a minimum-cost assignment (e-maxx's Hungarian)."""
    n, m = len(cost), len(cost[0])
    inf = float("inf")
    u, v = [0] * (n + 1), [0] * (m + 1)
    owner, way = [0] * (m + 1), [0] * (m + 1)  # owner[j]: the row (1-based) holding column j
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        minv = [inf] * (m + 1)
        used = [False] * (m + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = owner[j0], inf, 0
            for j in range(1, m + 1):
                if not used[j]:
                    cur = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(m + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if owner[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    rows = [-1] * n
    for j in range(1, m + 1):
        if owner[j]:
            rows[owner[j] - 1] = j - 1
    return rows


def align(weights: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(row, column) pairs of a maximum-weight one-to-one pairing, ties broken by the module's
    rule; pairs of weight 0 are left out (those items stay unpaired). Weights are >= 0 ints."""
    n = len(weights)
    m = len(weights[0]) if n else 0
    if n == 0 or m == 0:
        return []
    scale = (m + 1) ** n  # above any sum of tie-break values
    combined = [
        [weights[i][j] * scale + (m - j) * (m + 1) ** (n - 1 - i) for j in range(m)]
        for i in range(n)
    ]
    top = max(max(row) for row in combined)
    if n <= m:
        cols = _min_cost_rows([[top - w for w in row] for row in combined])
        pairs = list(enumerate(cols))
    else:
        rows = _min_cost_rows([[top - combined[i][j] for i in range(n)] for j in range(m)])
        pairs = [(i, j) for j, i in enumerate(rows)]
    return sorted((i, j) for i, j in pairs if weights[i][j] > 0)
