"""Stage 3's prefetch window: which units to all-gather ahead, and whether together.

One policy, used by the hooks that run it (model.py's _UnitHooks) and replayed by
estimate_memory to predict the most gathered bytes a rank holds.

  order    a pass's predicted unit sequence: (unit, in backward) pairs
  cursor   the position after the unit needed now
  numel    each unit's padded element count (numel[0] is the root unit)
  depth    prefetch_depth: units always fetched ahead, whatever their size
  budget   coalesce_numel (0 when depth is 0): further units of the same phase
           are added while the window stays within this many elements, and a
           window of small units is fetched in one collective (Note [Coalesced
           unit gathers], csrc/engine/units.cpp)
"""
from __future__ import annotations


def budget(depth: int, coalesce_numel: int) -> int:
    """The coalescing budget: none without prefetching (prefetch_depth 0)."""
    return coalesce_numel if depth > 0 else 0


def upcoming(order: list, cursor: int, k: int, depth: int, numel: list, budget: int = 0,
             phase: bool = False, into_backward: bool = True) -> list:
    """The next `depth` distinct units after the cursor, other than k, and more after
    them, needed in the same phase (forward or backward), while the whole list stays
    within `budget` elements. Without into_backward a forward's list ends where
    backward begins: the loss, at the activations' peak, holds no unit fetched early."""
    out, total, i = [], 0, cursor
    while i < len(order):
        u, in_backward = order[i]
        i += 1
        if in_backward and not phase and not into_backward:
            break
        if u == k or u in out:
            continue
        if len(out) >= depth and (in_backward != phase or total + numel[u] > budget):
            break
        out.append(u)
        total += numel[u]
    return out


def kept_after_forward(order: list, cursor: int, k: int, depth: int, numel: list) -> bool:
    """Whether unit k stays gathered after its forward: a unit of the forward window ahead,
    or (prefetching) the last one, whose backward comes next. Nothing else is held across
    the loss, where the activations peak."""
    if k in upcoming(order, cursor, -1, depth, numel, into_backward=False):
        return True
    return depth > 0 and cursor < len(order) and order[cursor] == (k, True)


def to_fetch(window: list, missing: list, depth: int, numel: list, budget: int):
    """(together, units): the window's missing units to launch now, and whether in
    one collective. Nothing is launched until half the window is missing, unless one
    of the next `depth` units is; small units go together, large ones one by one."""
    if not missing or (2 * len(missing) < len(window) and all(u not in missing for u in window[:depth])):
        return False, []
    return len(missing) > 1 and sum(numel[u] for u in missing) <= budget, missing


def replay_peak(numel: list, elem_bytes: int, depth: int, budget: int, world: int) -> int:
    """Most bytes of non-root units held gathered at once (their full buffers plus a
    coalesced gather's staging pair, slice + N slices) over one training step whose
    units run in registration order and backward in reverse, as the hooks run it:
    a unit is released after its forward unless one of the next `depth` needs it,
    and after its backward."""
    units = list(range(1, len(numel)))
    order = [(k, False) for k in units] + [(k, True) for k in reversed(units)]
    held: set = set()
    staged: list = []                      # [members, bytes] of gathers in flight
    peak = 0

    def note():
        nonlocal peak
        peak = max(peak, sum(numel[u] for u in held) * elem_bytes + sum(b for _, b in staged))

    def waited(u):                         # its gather completes: the staging is freed
        staged[:] = [g for g in staged if u not in g[0]]

    def prefetch(k, cursor, phase):
        window = upcoming(order, cursor, k, depth, numel, budget, phase, into_backward=False)
        together, launch = to_fetch(window, [u for u in window if u not in held], depth, numel, budget)
        held.update(launch)
        if together and world > 1:
            n = sum(numel[u] for u in launch)
            staged.append([set(launch), (n + n // world) * elem_bytes])
        note()

    prefetch(0, 0, False)                  # the root's forward
    for p, (k, in_backward) in enumerate(order):
        held.add(k)
        note()
        waited(k)
        prefetch(k, p + 1, in_backward)
        if in_backward or not kept_after_forward(order, p + 1, k, depth, numel):
            waited(k)
            held.discard(k)
    return peak
