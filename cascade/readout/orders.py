"""Option orders for position debiasing.

A model reading lettered options favours some positions (often "A"). Scoring a question under K
orders and averaging the probabilities back in the original order cancels that bias. The orders
are constructed, never drawn from an enumeration of permutations (16 options have 2e13 of them):
cyclic shifts first, because K evenly spaced shifts put every option in a different position each
time (K = n shifts: every option in every position exactly once), then reversed shifts, which also
vary each option's neighbours.
"""

from __future__ import annotations

import numpy as np

from cascade.errors import RequestError

Order = tuple[int, ...]


def _shift(n: int, s: int, reverse: bool) -> Order:
    base = list(range(n))[::-1] if reverse else list(range(n))
    return tuple(base[(j + s) % n] for j in range(n))


def _evenly_spaced(count: int, take: int) -> list[int]:
    return sorted({(i * count) // take for i in range(take)})


def max_orders(n_options: int) -> int:
    """How many distinct balanced orders exist for ``n_options`` (2 has only 2)."""
    return 2 if n_options == 2 else 2 * n_options


def balanced_orders(n_options: int, k: int) -> list[Order]:
    """``min(k, max_orders(n))`` distinct orders, the identity first.

    ``order[j]`` is the option shown at letter position j. Cost is O(k x n), independent of n!.
    """
    if k < 1:
        raise RequestError(f"permutations must be at least 1; got {k}")
    k = min(k, max_orders(n_options))
    n_shifts = min(k, n_options)
    orders = [_shift(n_options, s, False) for s in _evenly_spaced(n_options, n_shifts)]
    rest = k - len(orders)
    if rest > 0:
        orders += [_shift(n_options, s, True) for s in _evenly_spaced(n_options, rest)]
    return orders


def unpermute(probabilities: np.ndarray, order: Order) -> np.ndarray:
    """Probabilities read per letter position, put back in the original option order."""
    out = np.empty_like(probabilities)
    out[list(order)] = probabilities
    return out
