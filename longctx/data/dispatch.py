"""Document dispatch: the `shard_balanced` packer, which places documents into the sp shards.

The ring splits each row into sp shards of L = seq_len / sp tokens (the contiguous layout: shard
d holds positions [d*L, (d+1)*L)). Where a document lies decides two costs of the ring
(ops/tables.document_schedule is the ground truth for both):
  - how far K/V travel: a document inside one shard needs no K/V from another device, so a row
    of such documents is done after ring step 0 and passes nothing (the ring stops after the
    last step any device needs, ops/ring._steps_to_visit);
  - how long each step takes: every step waits for its busiest device, and causal work grows
    with the square of a document's length, so shards of equal token count can differ in work
    many times over.
The first/best-fit packers fill rows without regard to shards: a short document that straddles
a boundary makes the ring pass K/V one step further, and the shards' work is left to chance.

The placement rule, per window of pieces (a piece is a document, or a seq_len piece of a longer
one: packing.SplitDocument):
  1. A piece no longer than a shard lies inside one shard; it never straddles a boundary.
  2. A longer piece starts on a shard boundary and spans the fewest shards it can,
     ceil(n / L): its first shards are full, its last holds its tail followed by short pieces.
     Starting on a boundary also minimises the work it puts on later ring steps (its tail's
     queries against the full shard before it, t x L, the smallest split of n into two parts).
     Long pieces are placed first, longest first, into the first row with enough free whole
     shards (first-fit decreasing), so long pieces of similar size share rows: the work they put
     on ring steps >= 1, which no placement spreads over every device of one row (shard 0 never
     sees K/V from an earlier shard of its document), is paid in as few rows as possible.
  3. Short pieces, longest first, go into the shard with the least room that still holds them
     (best-fit decreasing): first the room left in the rows of long pieces (their free whole
     shards take the longest short pieces, whose work is closest to the full shards' beside
     them), then new shards. Best-fit keeps the padding near that of the row-level packers.
  4. The new shards are sorted by their work, and every sp consecutive ones make a row, so a
     row's shards carry similar work and step 0 is balanced (the greedy by largest work that
     sorting amounts to, with many shards per window to choose from).
Work is counted in kernel blocks of the causal mask, m (m + 1) / 2 for a piece of m blocks,
the square law that decides the balance (ops/tables counts the real blocks for the report).

The layout: defined for "contiguous" only, whose shards are contiguous ranges of the row. Under
zigzag or striped a shard is two or many separate ranges and rule 1 could not hold, so
config.validate refuses them with this packer, and attention.layout="auto" resolves to
contiguous (train.state.resolve_layout, `LAYOUT`).

Deterministic and resumable like grain's packers: a window is the pieces, in the parent's
order, that fit in `window_rows` rows' tokens (at least one; the last window: what is left); its rows
are shuffled with a seed of (seed, rows emitted before it). The iterator state is the parent's
state at the window's start, the rows of the window already emitted and the count of all rows
emitted: a restore reads the window again, packs it identically and skips what was emitted.
Every host of one sp group reads the same data shard, so they pack the same rows.
"""

from __future__ import annotations

import bisect
import dataclasses

import grain
import numpy as np

PACKER = "shard_balanced"
LAYOUT = "contiguous"  # the one layout whose shards are contiguous ranges of the row


def causal_blocks(length, block: int):
    """Blocks a causal kernel computes for one piece of `length` tokens, aligned: m (m + 1) / 2
    (elementwise for an integer array of lengths: packer_report's bounds)."""
    m = -(-length // block)
    return m * (m + 1) // 2


@dataclasses.dataclass
class _Shard:
    room: int                    # tokens still free at its end
    work: int = 0                # estimated step-0 blocks
    used: int = 0                # tokens from its start already placed
    pieces: list = dataclasses.field(default_factory=list)  # (piece index, offset in the shard)


def place(lengths, seq_len: int, num_shards: int, block: int) -> list[list[tuple[int, int]]]:
    """Rows of (piece index, start position in the row) for pieces of `lengths` (each at most
    seq_len) under the rule of the module docstring; every piece appears exactly once."""
    shard_len = seq_len // num_shards
    block = max(1, min(block, shard_len))
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    long_rows: list[list[_Shard]] = []   # rows started by long pieces: their shards, filled so far
    spans: list[list[tuple[int, int]]] = []  # per long row: (piece, first shard)
    open_shards: list[_Shard] = []       # whole free shards and tail rooms of the long rows
    for i in order:
        n = int(lengths[i])
        if n <= shard_len:
            break
        span = -(-n // shard_len)
        row = next((r for r, shards in enumerate(long_rows) if num_shards - len(shards) >= span), None)
        if row is None:
            long_rows.append([])
            spans.append([])
            row = len(long_rows) - 1
        spans[row].append((i, len(long_rows[row])))
        tail = n - (span - 1) * shard_len
        full = [_Shard(room=0, work=causal_blocks(shard_len, block), used=shard_len)
                for _ in range(span - 1)]
        long_rows[row] += full + [_Shard(room=shard_len - tail, work=causal_blocks(tail, block), used=tail)]
    for shards in long_rows:
        shards += [_Shard(room=shard_len) for _ in range(num_shards - len(shards))]
        open_shards += [s for s in shards if s.room > 0]

    # Best fit: the shard with the least room that holds the piece (`rooms` sorted, with `keys`).
    new_shards: list[_Shard] = []
    keys = sorted(range(len(open_shards)), key=lambda k: (open_shards[k].room, k))
    rooms = [open_shards[k].room for k in keys]
    for i in order:
        n = int(lengths[i])
        if n > shard_len:
            continue
        at = bisect.bisect_left(rooms, n)
        if at == len(rooms):
            shard = _Shard(room=shard_len)
            new_shards.append(shard)
            open_shards.append(shard)
            k = len(open_shards) - 1
        else:
            k = keys.pop(at)
            rooms.pop(at)
            shard = open_shards[k]
        shard.pieces.append((i, shard.used))
        shard.used += n
        shard.room -= n
        shard.work += causal_blocks(n, block)
        if shard.room > 0:
            at = bisect.bisect_left(rooms, shard.room)
            rooms.insert(at, shard.room)
            keys.insert(at, k)

    new_shards.sort(key=lambda s: -s.work)  # stable: ties keep their order of opening
    rows = long_rows + [new_shards[r:r + num_shards] for r in range(0, len(new_shards), num_shards)]
    out = []
    for r, shards in enumerate(rows):
        placed = [(i, s * shard_len + offset) for s, shard in enumerate(shards)
                  for i, offset in shard.pieces]
        if r < len(long_rows):
            placed += [(i, first * shard_len) for i, first in spans[r]]
        out.append(sorted(placed, key=lambda p: p[1]))
    return out


class ShardBalancedPackIterDataset(grain.IterDataset):
    """`{feature: [n <= seq_len, k]}` pieces -> rows `{feature: [seq_len, k], feature +
    "_segment_ids": [seq_len]}` (grain's packed format, 0 = padding), placed by `place`."""

    def __init__(self, parent: grain.IterDataset, *, feature: str, seq_len: int, num_shards: int,
                 block_size: int, window_rows: int, seed: int, pad_id: int):
        super().__init__(parent)
        if seq_len % num_shards:
            raise ValueError(f"seq_len={seq_len} is not divisible by num_shards={num_shards}")
        self.options = dict(feature=feature, seq_len=seq_len, num_shards=num_shards,
                            block_size=block_size, window_rows=max(1, window_rows), seed=seed,
                            pad_id=pad_id)

    def __iter__(self):
        return _ShardBalancedIterator(self._parent.__iter__(), **self.options)


class _ShardBalancedIterator(grain.DatasetIterator):
    def __init__(self, parent, *, feature, seq_len, num_shards, block_size, window_rows, seed, pad_id):
        super().__init__(parent)
        self._feature, self._seq_len, self._num_shards = feature, seq_len, num_shards
        self._block, self._window_rows, self._seed, self._pad_id = block_size, window_rows, seed, pad_id
        self._window_start = parent.get_state()  # the parent's state where this window begins
        self._rows = None       # the packed rows of the current window, once read
        self._window_end = None
        self._carry = None      # the piece read last, which starts the next window
        self._next_row = 0      # rows of this window already emitted
        self._counter = 0       # rows emitted in all

    def __next__(self):
        if self._rows is None:
            self._rows, self._window_end = self._read_window()
        row = self._rows[self._next_row]
        self._next_row += 1
        self._counter += 1
        if self._next_row == len(self._rows):
            self._rows, self._window_start, self._next_row = None, self._window_end, 0
        return row

    def _read_window(self):
        pieces, target = [], self._window_rows * self._seq_len
        if self._carry is not None:
            pieces.append(self._carry)
            self._carry = None
        tokens = sum(len(p) for p in pieces)
        while True:
            end = self._parent.get_state()
            try:
                piece = next(self._parent)[self._feature]
            except StopIteration:
                break
            if pieces and tokens + len(piece) > target:
                # It starts the next window, whose state is the parent's before it (held here
                # rather than read again: rewinding would restart the parent's read-ahead).
                self._carry = piece
                break
            pieces.append(piece)
            tokens += len(piece)
        if not pieces:
            raise StopIteration
        placed = place([len(p) for p in pieces], self._seq_len, self._num_shards, self._block)
        order = np.random.default_rng(self._seed + self._counter - self._next_row).permutation(len(placed))
        return [self._row(pieces, placed[r]) for r in order], end

    def _row(self, pieces, placed):
        width = pieces[placed[0][0]].shape[1:]
        data = np.full((self._seq_len, *width), self._pad_id, dtype=pieces[placed[0][0]].dtype)
        segment_ids = np.zeros(self._seq_len, np.int32)
        for segment, (i, start) in enumerate(placed, start=1):
            data[start:start + len(pieces[i])] = pieces[i]
            segment_ids[start:start + len(pieces[i])] = segment
        return {self._feature: data, f"{self._feature}_segment_ids": segment_ids}

    def get_state(self):
        return {"parent": self._window_start, "next_row": self._next_row, "counter": self._counter}

    def set_state(self, state):
        self._parent.set_state(state["parent"])
        self._window_start = state["parent"]
        self._rows, self._window_end, self._carry = None, None, None
        self._next_row, self._counter = int(state["next_row"]), int(state["counter"])
