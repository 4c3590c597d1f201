"""The per-document layout: each packed row gets its own permutation, worked out from its documents.

The static layouts (layout.py) place positions, whatever documents hold them. Here each
document is placed on its own, so that every device does the same work at every ring step:

- a document whose causal work one device could not balance is spread over every shard as
  whole blocks, zigzag: cut into 2 sp chunks of whole blocks, shard d holding chunks d and
  2 sp - 1 - d, so that at every ring step every device computes the same blocks of it (equal
  chunks give every (device, step) 2 c^2 blocks); which documents are spread is chosen per row
  by the work model below, not by a length threshold;
- the others stay whole on one shard, placed largest first where they fit: on the shard with
  the least work (their work is all at ring step 0), among those whose spread documents' last
  partial blocks leave gaps they fit first (`_finish`);
- one that fits no shard is scattered: its whole blocks dealt one by one to the shards with
  room, each where it adds least to the busiest device of the steps it touches.

Why whole blocks: the ring computes a block whole or not at all, so a chunk that ends inside a
block makes that block hold two chunks, needed at both chunks' steps; with every spread piece
a run of whole blocks at the front of its shard, the blocks the ring computes are the blocks
the documents need (on the embedded corpus at 131,072 tokens, sp 8, block 512: within 2% of the
natural order's). The rest of a shard follows: its whole documents and the pieces that are
not whole blocks (a spread document's last partial block, a scattered document's pieces), each
piece of a document with pieces on other shards starting a block or ending on a block edge,
whole documents cut at an edge to make room, and where they run out the shard's padding
(padding is no document to the ring's block tests), the rest of it last (`_arrange`: the ring sums
up a block by its first document, its last and the range of ids between; a document of
another shard between two others would make that range cover documents that live elsewhere,
and every device would compute their blocks against it at every step).

The work model: blocks per (device, ring step), closed form for spread documents, the causal
triangle of each whole document, block pairs for scattered ones; a layout's cost is the sum
over ring steps of the busiest device's blocks (the ring's critical path) plus one block per
ring step visited. Every row is planned with the k longest documents spread, for the k from
the fewest possible (those longer than a shard) up to CANDIDATES more, and the cheapest plan is
kept. A row whose documents all stay whole runs on ring step 0 alone.

Masks stay exact: each token keeps its position in its document (RoPE's), and its segment id
becomes 1 + its document's offset in a numbering of the row's own (first the documents strictly
inside a block, block by block, so that each block's are one run of ids; then the others in the
order the shards hold them, each where its first piece that is not whole blocks of it lies;
those in whole blocks only last), so that `global_positions` = segment id - 1 + position is a
position in a virtual row where every document is one run of positions: causal, window and chunked
masks, functions of positions within a document, are what they were. The numbering follows
each shard's order, so that a block's id range covers only documents of its shard
(ops/row_blocks.py's block tests rely on it for speed, never for correctness).

Pure numpy and deterministic: every host of an sp group computes the same permutation of the
same row, and a resumed run the same as before.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

NAME = "per_document"
CANDIDATES = 48          # spread sets tried per row beyond the fewest possible
MIN_SPREAD_BLOCKS = 8    # documents of fewer blocks are never spread (their chunks would be empty)
RESIDUES = 8             # starting shards tried per group spacing of a spread document
STEP_COST = 1.0          # blocks a ring step costs beyond its blocks (ops/auto_layout.py's rule)

# What a piece of a shard is: whole blocks of a spread or scattered document (at the front of
# the shard), the rest of one (its partial block, pieces of a scattered one), a whole document.
_BLOCKS, _PARTIAL, _WHOLE = 0, 1, 2
# The document of a piece of padding: _arrange lays the shard's padding where it saves a cut.
_PADDING = -1


def documents(segment_ids) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) int64 of the documents of one natural-order row: runs of one id > 0."""
    ids = np.asarray(segment_ids)
    starts = np.r_[0, np.flatnonzero(np.diff(ids)) + 1]
    ends = np.r_[starts[1:], len(ids)]
    real = ids[starts] > 0
    return starts[real].astype(np.int64), (ends - starts)[real].astype(np.int64)


def _triangle(blocks):
    """Causal blocks of a run of `blocks` blocks (a float: a run across block edges)."""
    return 0.5 * blocks * (blocks + 1)


def zigzag_work(chunks: np.ndarray, num_shards: int, rotation: int) -> np.ndarray:
    """Blocks [device, ring step] of one spread document whose 2 sp chunks have `chunks` whole
    blocks each, chunk k (< sp) and 2 sp - 1 - k on device (rotation + k) mod sp: causal block
    pairs between the chunks a device holds and those of the device whose K/V it holds."""
    sp, c = num_shards, np.asarray(chunks, np.float64)
    later = np.arange(2 * sp)[:, None] > np.arange(2 * sp)[None, :]
    pairs = np.where(later, c[:, None] * c[None, :], 0.0)
    pairs[np.arange(2 * sp), np.arange(2 * sp)] = _triangle(c)
    k = np.empty(sp, np.int64)
    k[(rotation + np.arange(sp)) % sp] = np.arange(sp)
    front, back = k, 2 * sp - 1 - k
    by_source = sum(pairs[a[:, None], b[None, :]] for a in (front, back) for b in (front, back))
    d, s = np.arange(sp)[:, None], np.arange(sp)[None, :]
    return by_source[d, (d - s) % sp]


@dataclasses.dataclass
class _Plan:
    """Where the pieces of a row's documents go. pieces[d]: (document, first, stop, region) of
    shard d, in-document token ranges; work: the model's blocks [device, step]."""
    pieces: list
    room: np.ndarray
    work: np.ndarray
    spread: list

    @property
    def cost(self) -> float:
        return _cost(self.work)

    def copy(self) -> _Plan:
        return _Plan([list(p) for p in self.pieces], self.room.copy(), self.work.copy(),
                     list(self.spread))


def _group_options(num_shards: int, blocks: int):
    """(members, stride) of every group a document of `blocks` blocks may be spread over: n
    shards spaced sp / n apart along the ring (n dividing sp, at least one block per chunk),
    a few starting shards and zigzag starts each. A group of sp / n spacing has work at ring steps
    0, sp / n, 2 sp / n, ... only; at large sp a mid-sized document spread over all shards would
    hold less than a block per chunk."""
    sp = num_shards
    for n in range(2, sp + 1):
        if sp % n or blocks < n:
            continue
        stride = sp // n
        for first in range(0, stride, max(1, stride // RESIDUES)):
            for start in range(0, n, max(1, n // RESIDUES)):
                yield (first + stride * ((np.arange(n) + start) % n)) % sp, stride


def _spread(plan: _Plan, doc: int, length: int, block: int) -> None:
    """Spreads document `doc` zigzag as whole blocks over the group of shards (`_group_options`)
    where it adds least to the critical path: each member's share of its blocks equal but for
    the remainder, which goes to the members with the most room, the odd block of a share to
    its first or second chunk, whichever adds less. Blocks no member has room for are
    scattered (_scatter)."""
    sp = len(plan.room)
    blocks = -(-length // block)
    best = None
    tried, zigzags = set(), {}
    for (members, stride), extra_from in itertools.product(_group_options(sp, blocks), range(RESIDUES)):
        n = len(members)
        if extra_from >= min(n, RESIDUES):
            continue
        room = plan.room[members]
        capacity = room // block
        per_member = np.minimum(blocks // n, capacity)
        # the rest one each to the members with most room left, ties from member extra_from on:
        # where the odd blocks sit along the zigzag decides the steps they weigh on
        ties = (np.arange(n) - extra_from * n // min(n, RESIDUES)) % n
        while per_member.sum() < blocks:
            spare = np.flatnonzero(per_member < capacity)
            if len(spare) == 0:
                break
            left = room[spare] - per_member[spare] * block
            order = np.lexsort((ties[spare], -left))
            per_member[spare[order][:blocks - per_member.sum()]] += 1
        short = blocks - int(per_member.sum())
        for front_heavy in (True, False):
            big, small = (per_member + 1) // 2, per_member // 2
            first, second = (big, small) if front_heavy else (small, big)
            chunks = np.concatenate([first, second[::-1]])
            # Many options come to the same shards and chunks (shards of equal room): each is
            # scored once, and the first of equals wins as before.
            signature = (members.tobytes(), chunks.tobytes())
            if signature in tried:
                continue
            tried.add(signature)
            if chunks.tobytes() not in zigzags:
                zigzags[chunks.tobytes()] = zigzag_work(chunks, n, 0)
            work = np.zeros((sp, sp))
            work[members[:, None], stride * np.arange(n)[None, :]] = zigzags[chunks.tobytes()]
            total = plan.work + work
            key = (short, _cost(total), float(np.square(total).sum()))
            if best is None or key < best[0]:
                best = (key, work, chunks, members, per_member)
    if best is None:  # too few blocks for any group: dealt block by block
        _scatter(plan, doc, length, block)
        return
    _, work, chunks, members, per_member = best
    n = len(members)
    plan.work += work
    spread_tokens = min(length, int(per_member.sum()) * block)
    edges = np.minimum(np.r_[0, np.cumsum(chunks)] * block, spread_tokens)
    for k in range(2 * n):
        _add(plan, int(members[k if k < n else 2 * n - 1 - k]), doc, int(edges[k]),
             int(edges[k + 1]), block)
    plan.spread.append(doc)
    if spread_tokens < length:  # a tight row (little padding): the rest in pieces
        _scatter(plan, doc, length, block, offset=spread_tokens)


def _cost(work: np.ndarray) -> float:
    """The work model's cost of blocks [device, ring step]: the critical path plus a block per
    ring step visited."""
    busiest = work.max(axis=0)
    steps = int(np.flatnonzero(busiest > 0).max()) + 1 if busiest.any() else 1
    return float(busiest.sum()) + STEP_COST * steps


def _add(plan: _Plan, d: int, doc: int, first: int, stop: int, block: int) -> None:
    """A spread or scattered piece: its whole blocks to the front region, the rest partial."""
    if stop <= first:
        return
    cut = first + (stop - first) // block * block
    if cut > first:
        plan.pieces[d].append((doc, first, cut, _BLOCKS))
    if stop > cut:
        plan.pieces[d].append((doc, cut, stop, _PARTIAL))
    plan.room[d] -= stop - first


def _scatter(plan: _Plan, doc: int, length: int, block: int, offset: int = 0) -> None:
    """Deals a document that fits no shard whole over the shards with room: block by block in
    its order, each to the shard where it raises the busiest device of the steps it touches
    least; what no shard holds as a whole block goes in pieces to the shards with most room."""
    sp = len(plan.room)
    held = []  # the shard of each block placed so far
    while length - offset >= block:
        fits = np.flatnonzero(plan.room >= block)
        if len(fits) == 0:
            break
        busiest = plan.work.max(axis=0)
        best = None
        for d in fits:
            add = np.zeros(sp)
            add[0] += 1
            for h in held:
                add[(d - h) % sp] += 1
            rise = np.maximum(plan.work[d] + add - busiest, 0.0).sum()
            key = (rise, plan.work[d].sum())
            if best is None or key < best[0]:
                best = (key, d, add)
        _, d, add = best
        plan.work[d] += add
        held.append(int(d))
        plan.pieces[d].append((doc, offset, offset + block, _BLOCKS))
        plan.room[d] -= block
        offset += block
    for d in np.argsort(-plan.room, kind="stable"):
        take = int(min(plan.room[d], length - offset))
        if take <= 0:
            break
        plan.work[d, 0] += _triangle(take / block + 1)
        for h in held:
            plan.work[d, (d - h) % sp] += 1
        held.append(int(d))
        plan.pieces[d].append((doc, offset, offset + take, _PARTIAL))
        plan.room[d] -= take
        offset += take
    if offset < length:
        raise AssertionError(f"document of {length} tokens does not fit the row's room")


def _finish(plan: _Plan, docs, lengths, block: int) -> _Plan:
    """`plan` with documents `docs` (longest first) placed whole, and those that fit no shard
    scattered. A document goes first to a shard whose gaps it fits: the room that shard's spread
    documents' last partial blocks leave to their blocks' ends. `_arrange` fills those gaps with
    the shard's whole documents, so that each partial block starts or ends on a block edge;
    where a shard has too few, it cuts a shared piece instead, and the ring computes a cut piece
    again in every block it reaches. Among the shards whose gaps it fits (or, where it fits none,
    among all with room), the one whose step-0 work is least."""
    gaps = np.array([sum(block - (p[2] - p[1]) for p in held if p[3] == _PARTIAL) for held in plan.pieces])
    misfits = []
    for doc in docs:
        length = int(lengths[doc])
        fits = np.flatnonzero(plan.room >= length)
        if len(fits) == 0:
            misfits.append(int(doc))
            continue
        filling = fits[gaps[fits] >= length]
        among = filling if len(filling) else fits
        d = int(among[np.argmin(plan.work[among, 0])])
        gaps[d] -= length
        _place_whole(plan, int(doc), length, d, block)
    for doc in misfits:
        _scatter(plan, doc, int(lengths[doc]), block)
    return plan


def _place_whole(plan: _Plan, doc: int, length: int, d: int, block: int) -> None:
    plan.pieces[d].append((doc, 0, length, _WHOLE))
    plan.room[d] -= length
    plan.work[d, 0] += _triangle(length / block + 1)


def best_plan(segment_ids, num_shards: int, block: int) -> _Plan:
    """The cheapest placement of one natural-order row by the work model: its k longest
    documents spread (each over the group `_spread` picks), the others whole where they fit,
    for k from the fewest possible (those longer than a shard) up to CANDIDATES more, tried at
    a few k in between (0, 1, 2, 4, 8, ... more)."""
    sp = num_shards
    shard_len = len(segment_ids) // sp
    _, lengths = documents(segment_ids)
    order = np.argsort(-lengths, kind="stable")
    fewest = int((lengths > shard_len).sum())
    most = fewest + int(np.sum(lengths[order[fewest:fewest + CANDIDATES]] >= MIN_SPREAD_BLOCKS * block))
    tried = {fewest, most} | {fewest + 2 ** i for i in range(CANDIDATES.bit_length()) if fewest + 2 ** i < most}
    plan = _Plan([[] for _ in range(sp)], np.full(sp, shard_len, np.int64), np.zeros((sp, sp)), [])
    best = None
    for k in range(most + 1):
        if k in tried:
            done = _finish(plan.copy(), order[k:], lengths, block)
            if best is None or done.cost < best.cost:
                best = done
        if k < most:
            _spread(plan, int(order[k]), int(lengths[order[k]]), block)
    return best


def _homes(pieces) -> dict:
    """Each document's home: the first shard holding a piece of it that is not whole blocks of
    it (where it is numbered; elsewhere it is foreign). Documents in whole blocks only have none."""
    home = {}
    for d, held in enumerate(pieces):
        for doc, _, _, region in held:
            if region != _BLOCKS:
                home.setdefault(doc, d)
    return home


def _shared(pieces) -> set:
    """The documents with pieces on more than one shard (spread or scattered)."""
    shards = {}
    for d, held in enumerate(pieces):
        for doc, _, _, _ in held:
            shards.setdefault(doc, set()).add(d)
    return {doc for doc, where in shards.items() if len(where) > 1}


def _arrange(pieces, d: int, home: dict, shared: set, block: int, padding: int = 0) -> list:
    """Shard d's pieces in layout order: its whole blocks of single documents, then the rest,
    where every piece of a document `shared` with other shards starts a block or ends on a
    block edge, the shard's whole documents filling between (cut at the edges where needed: the
    two parts of one are still one run of its positions). Why: row_blocks sums up a block by its
    first document, its last and the range of ids between them. A foreign document between two
    others (one numbered with its `home` shard's) would make that range cover documents numbered
    in between that live elsewhere, and the ring would compute their blocks against the block
    at every step; one of the shard's own there only makes its blocks elsewhere compute the
    block (their positions follow its other documents'). So foreign pieces take the edges
    first, and where whole documents run out, `padding` tokens of the shard fill (pieces of
    _PADDING, none of them cut a piece of a document), then the shard's own shared pieces; the
    padding left over ends the shard."""
    out = [p for p in pieces if p[3] == _BLOCKS]
    at = sum(p[2] - p[1] for p in out)
    rest = [p for p in pieces if p[3] != _BLOCKS]
    pending = ([p for p in rest if home[p[0]] != d] +                    # foreign: edges first
               [p for p in rest if home[p[0]] == d and p[0] in shared])  # the shard's own shared
    stream = [p for p in rest if p[0] not in shared][::-1]
    pad = padding

    def fill(upto):  # whole documents, padding, own shared pieces up to `upto`, the last cut there
        nonlocal at, pad
        while at < upto:
            if stream:
                doc, first, stop, region = stream.pop()
            elif pad:
                take = min(pad, upto - at)
                out.append((_PADDING, padding - pad, padding - pad + take, _WHOLE))
                pad -= take
                at += take
                continue
            elif pending and home[pending[-1][0]] == d:
                doc, first, stop, region = pending.pop()
            else:
                return
            cut = min(stop, first + upto - at)
            out.append((doc, first, cut, region))
            if cut < stop:
                stream.append((doc, cut, stop, region))
            at += cut - first

    def put(piece):
        nonlocal at
        out.append(piece)
        at += piece[2] - piece[1]

    while pending:
        fill(-(-at // block) * block)
        if not pending:
            break
        put(pending.pop(0))                                  # first in its block
        if pending and at % block:
            edge = -(-at // block) * block
            length = pending[0][2] - pending[0][1]
            if length <= edge - at:                          # and one last in it
                fill(edge - length)
                if pending:
                    put(pending.pop(0))
    fill(at + sum(p[2] - p[1] for p in stream) + pad)
    return out


def _block_runs(pieces, block: int, at: int = 0) -> dict:
    """{block: the documents in it, in order, once per run} of `pieces` laid out from token `at`."""
    runs = {}
    for doc, first, stop, _ in pieces:
        if doc == _PADDING:
            at += stop - first
            continue
        for b in range(at // block, (at + stop - first - 1) // block + 1):
            held = runs.setdefault(b, [])
            if not held or held[-1] != doc:
                held.append(doc)
        at += stop - first
    return runs


def _strictly_inside(held: list) -> list:
    """The documents of a block's run `held` that are neither its first nor its last: what
    row_blocks sums up as one range of ids and positions."""
    return [doc for doc in held if doc not in (held[0], held[-1])]


def _waste(units, at: int, block: int, weight: dict, tails: set) -> int:
    """What the ring computes beyond the work model for a shard's pieces `units` laid out in this
    order from `at`, by `weight` (blocks of each document shared with other shards): a shared
    document's pieces in more blocks than they fill are computed again in each block more,
    against every block of their document; a block with several documents strictly inside it
    sums them up as one range, so that the blocks elsewhere of those shared in it (all but a
    spread document's last piece, first in the range) are computed against it too."""
    runs = _block_runs(units, block, at)
    spans, tokens = {}, {}
    for doc, first, stop, _ in units:
        tokens[doc] = tokens.get(doc, 0) + stop - first
    for b, held in runs.items():
        for doc in held:
            spans.setdefault(doc, set()).add(b)
    waste = sum(weight.get(doc, 0) * (len(blocks) - -(-tokens[doc] // block)) for doc, blocks in spans.items())
    for held in runs.values():
        inside = _strictly_inside(held)
        if len(inside) > 1:
            waste += sum(weight.get(doc, 0) for k, doc in enumerate(inside)
                         if k or doc not in tails)
    return waste


def _settle(pieces, block: int, weight: dict, tails: set, most: int = 12) -> list:
    """`pieces` (a shard in _arrange's order) with the rest after its whole blocks reordered
    where that lowers `_waste`: where the shard's whole documents run out, _arrange cuts shared
    pieces to fill, and a cut one is computed again in each block it reaches. The order is the
    cheapest by `weight` of the pieces (each document's pieces on the shard one run) across
    block edges, with at most three in a block (its first, one strictly inside, its last),
    found over the subsets of pieces placed (shards of at most `most` pieces)."""
    front = [p for p in pieces if p[3] == _BLOCKS]
    at = sum(p[2] - p[1] for p in front)
    start = _waste(pieces[len(front):], at, block, weight, tails)
    if start == 0:
        return pieces
    units = []
    for doc, first, stop, region in pieces[len(front):]:
        joined = next((k for k, u in enumerate(units) if u[0] == doc and u[3] == region
                       and u[2] == first), None)
        if joined is None:
            units.append((doc, first, stop, region))
        else:
            units[joined] = (doc, units[joined][1], stop, region)
    n = len(units)
    if n > most:
        return pieces
    sizes = [u[2] - u[1] for u in units]
    costs = [weight.get(u[0], 0) for u in units]
    # best[(placed, pieces begun in the current block)] = (cost, last piece, previous state)
    best = {(0, 0): (0, None, None)}
    for placed in range(1 << n):
        end = at + sum(sizes[k] for k in range(n) if placed >> k & 1)
        for begun in range(4):
            here = best.get((placed, begun))
            if here is None:
                continue
            for k in range(n):
                if placed >> k & 1:
                    continue
                count = 1 if end % block == 0 else begun + 1
                if count > 3:
                    continue
                stop = end + sizes[k]
                edges = (stop - 1) // block - end // block
                after = 0 if stop % block == 0 else (1 if edges else count)
                key = (placed | 1 << k, after)
                cost = here[0] + costs[k] * edges
                if key not in best or cost < best[key][0]:
                    best[key] = (cost, k, (placed, begun))
    done = [key for key in best if key[0] == (1 << n) - 1]
    if not done:
        return pieces
    state = min(done, key=lambda key: best[key][0])
    order = []
    while best[state][1] is not None:
        order.append(units[best[state][1]])
        state = best[state][2]
    order = order[::-1]
    return front + order if _waste(order, at, block, weight, tails) < start else pieces


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """One row in the per-document layout: `permutation` int64 [S] (x_layout =
    x_natural[permutation], as layout.permutation) and the row's `segment_ids` int32 [S] in
    layout order, renumbered: 1 + the document's offset in the virtual row (0 on padding)."""
    permutation: np.ndarray
    segment_ids: np.ndarray


def row_layout(segment_ids, num_shards: int, block: int, positions=None) -> RowLayout:
    """The per-document layout of one natural-order row of segment ids [S] (0 = padding).
    `positions` (in-document, default 0, 1, ... from each document's start): a document whose
    positions go beyond its length (a caller's rows at inference) gets room for all of them in
    the numbering, so that no two documents' global positions meet."""
    ids = np.asarray(segment_ids)
    seq_len = len(ids)
    if seq_len % num_shards or (seq_len // num_shards) % block:
        raise ValueError(f"seq_len={seq_len} is not a multiple of num_shards={num_shards} x "
                         f"block={block}")
    starts, lengths = documents(ids)
    plan = best_plan(ids, num_shards, block)
    spans = lengths
    if positions is not None and len(lengths):
        ends = np.maximum.reduceat(np.asarray(positions, np.int64), starts) + 1
        spans = np.maximum(lengths, ends)
    offset = np.zeros(len(lengths), np.int64)
    numbered = np.zeros(len(lengths), bool)
    cursor = 0

    def number(doc):
        nonlocal cursor
        if not numbered[doc]:
            offset[doc], numbered[doc] = cursor, True
            cursor += int(spans[doc])

    home, shared = _homes(plan.pieces), _shared(plan.pieces)
    weight = {doc: -(-int(lengths[doc]) // block) for doc in shared}
    tails = {doc for doc in plan.spread if sum(p[0] == doc and p[3] != _BLOCKS
                                               for held in plan.pieces for p in held) == 1}
    shard_len = seq_len // num_shards
    spare = [shard_len - sum(p[2] - p[1] for p in held) for held in plan.pieces]  # each shard's padding
    order = [_settle(_arrange(plan.pieces[d], d, home, shared, block, spare[d]), block, weight, tails)
             for d in range(num_shards)]
    for pieces in order:  # a block's documents strictly inside it first: their ids one run
        for held in _block_runs(pieces, block).values():
            for doc in _strictly_inside(held):
                number(doc)
    for pieces in order:  # in the order the shards hold them, blocks of one document last
        for doc, _, _, region in pieces:
            if region != _BLOCKS and doc != _PADDING:
                number(doc)
    for pieces in order:
        for doc, _, _, _ in pieces:
            if doc != _PADDING:
                number(doc)
    if cursor >= 2 ** 30:
        raise ValueError(f"positions up to {cursor:,} in a row: global positions must stay below "
                         "2**30 (int32 on device)")
    padding = np.flatnonzero(ids <= 0)
    perm = np.empty(seq_len, np.int64)
    new_ids = np.zeros(seq_len, np.int32)
    used = 0
    for d in range(num_shards):
        slot = d * shard_len
        for doc, first, stop, _ in order[d]:
            n = stop - first
            if doc == _PADDING:
                perm[slot:slot + n] = padding[used:used + n]
                used += n
            else:
                perm[slot:slot + n] = starts[doc] + np.arange(first, stop)
                new_ids[slot:slot + n] = offset[doc] + 1
            slot += n
        if slot != (d + 1) * shard_len:
            raise AssertionError(f"shard {d} laid out {slot - d * shard_len} of {shard_len} tokens")
    return RowLayout(perm, new_ids)


def global_positions(segment_ids, positions):
    """Each token's position in the virtual row of its per-document layout (numpy or jax.numpy
    arrays, any shape): segment id - 1 + its position in its document; 0 on padding."""
    return (segment_ids > 0) * (segment_ids - 1 + positions)


def permute_rows(batch: dict, num_shards: int, block: int) -> tuple[dict, np.ndarray]:
    """(the batch laid out, the permutations int64 [b, S]) of a batch of natural-order rows (a
    dict of [b, S] arrays: tokens, segment_ids, positions, ...): every array of each row
    permuted by that row's layout, its segment ids renumbered (`RowLayout`)."""
    ids = np.asarray(batch["segment_ids"])
    positions = batch.get("positions")
    out = {k: np.empty_like(v) for k, v in batch.items()}
    perms = np.empty(ids.shape, np.int64)
    for r in range(len(ids)):
        row = row_layout(ids[r], num_shards, block, None if positions is None else positions[r])
        for k, v in batch.items():
            out[k][r] = np.asarray(v[r])[row.permutation]
        out["segment_ids"][r] = row.segment_ids
        perms[r] = row.permutation
    return out, perms
