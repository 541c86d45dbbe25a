"""Which source layer(s) feed each target layer."""

from __future__ import annotations

import numpy as np

Pairing = tuple[tuple[int, ...], ...]  # per target layer: the source layers whose features are concatenated


def depth_pairing(n_source: int, n_target: int) -> Pairing:
    """Each target layer takes the source layer at the nearest relative depth (layer centres aligned)."""
    if n_source < 1 or n_target < 1:
        raise ValueError(f"layer counts must be positive, got {n_source} and {n_target}")
    return tuple((int(np.clip(round((t + 0.5) * n_source / n_target - 0.5), 0, n_source - 1)),)
                 for t in range(n_target))


def topk_pairing(r2: np.ndarray, k: int) -> Pairing:
    """From calibration R^2 [n_target, n_source] (single-layer ridge fits), the k best source layers per target
    layer, in source order."""
    r2 = np.asarray(r2)
    if not 1 <= k <= r2.shape[1]:
        raise ValueError(f"k must be in 1..{r2.shape[1]} (source layers), got {k}")
    return tuple(tuple(sorted(int(s) for s in np.argsort(-row, kind="stable")[:k])) for row in r2)


def check_pairing(pairing: Pairing, n_source: int, n_target: int) -> Pairing:
    pairing = tuple(tuple(int(s) for s in p) for p in pairing)
    if len(pairing) != n_target or any(not p or min(p) < 0 or max(p) >= n_source for p in pairing):
        raise ValueError(f"a pairing needs one non-empty tuple of source layers in 0..{n_source - 1} for each of "
                         f"the {n_target} target layers, got {pairing}")
    return pairing
