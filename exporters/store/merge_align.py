"""What the merge checks across ranks once every rank file is in the store: ranks missing
from the world, collectives matched across ranks (``collective_issues``), and clock offsets
between processes (``processes.clock_offset_ns``)."""

from __future__ import annotations

import json
import statistics
import zlib

from tensor_trace import schema

CLOCK_SAMPLE_STEPS = 64
DIGEST_BLOCK_SEQS = 4096  # sequence numbers per block of a SequenceDigest
# point-to-point ops: a send on one rank pairs with a recv on another, never with the group's
# other ranks (pipeline stages), so they are not matched across the group as collectives are
P2P_SQL = "('send', 'recv', 'isend', 'irecv')"
# rooted ops whose tensors differ between the root and the others by design (a gather's list of
# outputs exists on its destination alone): matched by op, not by shapes
ROOTED_SQL = "('gather', 'scatter')"
ROOTED = ("gather", "scatter")


def text_code(text) -> int:
    """A number for a string that is the same in every process (str's hash is not), or -1 for None
    (and for 0, the loader's stand-in for a NULL text)."""
    return -1 if text is None or text == 0 else zlib.crc32(text.encode())


_TEXT_CODES: dict = {None: -1}  # text -> text_code: a few op names


class SequenceDigest:
    """What one process's collectives say, per group, for ``align_collectives`` to compare
    across processes without reading them back: the lowest and highest sequence number, and per
    block of DIGEST_BLOCK_SEQS sequence numbers the count and the sum of a hash of (seq, op,
    reduce op, shapes and dtypes). Blocks whose digests agree on every process hold no
    disagreement; only the others are read from the store. A block where a process's sequence
    numbers did not rise (a repeat, or an async collective recorded after a later one) is marked
    to be read. Memory: a few numbers per block, whatever the trace's length."""

    def __init__(self):
        self.block = DIGEST_BLOCK_SEQS
        self.groups: dict = {}  # group id -> [lo, hi, {block: [count, hash sum]}, {blocks to read}]

    def add(self, gid, seq, op_code: int, redop_code: int, sig_code: int) -> None:
        g = self.groups.get(gid)
        b = seq // self.block
        if g is None:
            g = self.groups[gid] = [seq, seq, {}, set()]
        elif seq > g[1]:
            g[1] = seq
        else:
            g[3].add(b)
            if seq < g[0]:
                g[0] = seq
        block = g[2].get(b)
        h = hash((seq, op_code, redop_code, sig_code))  # ints only: the same in every process
        if block is None:
            g[2][b] = [1, h]
        else:
            block[0] += 1
            block[1] += h

    def add_rows(self, rows, sig_codes: list) -> None:
        """``add`` every collective of ``rows`` (the loader's rows of a step: group id at 6,
        sequence number at 7, op and reduce op texts at 4 and 5 (0 or None: none), layout id at
        10, whose ``sig_codes`` entry is its signature's code) that has a group and an integer
        sequence number, in order: one call a step, not one a collective (a third of the
        loader's Python time per collective went to the call and its look-ups)."""
        groups, size, codes = self.groups, self.block, _TEXT_CODES
        for c in rows:
            gid, seq = c[6], c[7]
            if gid is None or seq.__class__ is not int:
                continue
            op = codes.get(c[4])
            if op is None:
                op = codes[c[4]] = text_code(c[4])
            redop = codes.get(c[5])
            if redop is None:
                redop = codes[c[5]] = text_code(c[5])
            lid = c[10]
            h = hash((seq, op, redop, -1 if lid is None else sig_codes[lid]))
            b = seq // size
            g = groups.get(gid)
            if g is None:
                g = groups[gid] = [seq, seq, {}, set()]
            elif seq > g[1]:
                g[1] = seq
            else:
                g[3].add(b)
                if seq < g[0]:
                    g[0] = seq
            block = g[2].get(b)
            if block is None:
                g[2][b] = [1, h]
            else:
                block[0] += 1
                block[1] += h

    def remapped(self, group_ids: list) -> "SequenceDigest":
        """The digest with group ids mapped (``group_ids[local id]`` = the store's)."""
        out = SequenceDigest()
        out.block = self.block
        out.groups = {group_ids[gid]: g for gid, g in self.groups.items()}
        return out


def check_missing_ranks(con, warn, report) -> None:
    """Warn (and report) ranks of the world size that left no rank file."""
    rows = con.execute("SELECT rank, world_size FROM processes WHERE rank IS NOT NULL").fetchall()
    if not rows:
        return
    world = max((w or 0) for _, w in rows)
    present = {r for r, _ in rows}
    missing = sorted(set(range(world)) - present)
    if missing:
        msg = f"rank(s) {', '.join(map(str, missing))} of world size {world} left no rank file; answers use the others"
        warn(msg)
        report["problems"].append(msg)


def align_collectives(con, digests: dict | None = None) -> list:
    """Match collectives by (group, seq) across the group's ranks, as PyTorch's Flight Recorder
    analyser does; record the first disagreement per group (later ones follow from it): a rank
    that did not issue a collective the others did, or issued another op, shape or dtype.

    ``digests`` (proc -> SequenceDigest of every process in the store, as the loader made them)
    spare reading the blocks of sequence numbers where every process agrees; without them every
    collective is read."""
    issues = []
    groups = {gid: json.loads(ranks) for gid, ranks in con.execute("SELECT group_id, ranks FROM groups")}
    rank_of = dict(con.execute("SELECT proc, rank FROM processes"))
    if digests is not None and set(digests) != set(rank_of):
        digests = None
    # Compare only the range every present rank covered (a killed rank stops early, and a
    # --steps window starts late). Replayed copies repeat their capture's sequence numbers: the
    # captured call stands for them. One pass over the table for all groups (the index on
    # (group_id, seq) would cost a lookup per row).
    bounds: dict = {}
    if digests is not None:
        for proc, digest in digests.items():
            for gid, (lo, hi, _blocks, _read) in digest.groups.items():
                bounds.setdefault(gid, []).append((proc, lo, hi))
    else:
        for gid, proc, lo, hi in con.execute("SELECT group_id, proc, MIN(seq), MAX(seq) FROM collectives "
                                             "WHERE (flags & ?) = 0 GROUP BY proc, group_id",
                                             (schema.FLAG_REPLAYED,)):
            bounds.setdefault(gid, []).append((proc, lo, hi))
    # Layouts of equal signatures share a number: comparing it is comparing shapes and dtypes.
    con.execute("CREATE TEMP TABLE IF NOT EXISTS signatures(layout_id INTEGER PRIMARY KEY, sig INTEGER)")
    con.execute("DELETE FROM temp.signatures")
    con.execute("INSERT INTO temp.signatures SELECT layout_id, DENSE_RANK() OVER (ORDER BY signature) FROM layouts")
    for gid, ranks in groups.items():
        procs = [p for p, r in rank_of.items() if r in ranks]
        if len(procs) < 2:
            continue
        covered = bounds.get(gid, [])
        if len(covered) < len(procs):
            continue
        lo, hi = max(b[1] for b in covered), min(b[2] for b in covered)
        seq = None
        for first, last in _ranges_to_read(gid, [p for p, _, _ in covered], lo, hi, digests, len(procs)):
            sig = f"c.op || '|' || COALESCE(c.reduce_op, '') || '|' || CASE WHEN c.op IN {ROOTED_SQL} THEN 0 ELSE l.sig END"
            row = con.execute(
                f"SELECT c.seq, COUNT(*), COUNT(DISTINCT {sig}) "
                "FROM collectives c JOIN temp.signatures l USING(layout_id) WHERE c.group_id=? "
                f"AND c.seq BETWEEN ? AND ? AND (c.flags & ?) = 0 AND c.op NOT IN {P2P_SQL} "
                f"GROUP BY c.seq HAVING COUNT(*) != ? OR COUNT(DISTINCT {sig}) > 1 ORDER BY c.seq LIMIT 1",
                (gid, first, last, schema.FLAG_REPLAYED, len(procs))).fetchone()
            if row is not None:
                seq = row[0]
                break
        if seq is None:
            continue
        rows = con.execute("SELECT c.proc, c.op, c.reduce_op, l.signature FROM collectives c JOIN layouts l "
                           f"USING(layout_id) WHERE c.group_id=? AND c.seq=? AND (c.flags & ?) = 0 AND c.op NOT IN {P2P_SQL}",
                           (gid, seq, schema.FLAG_REPLAYED)).fetchall()
        have = {p for p, *_ in rows}
        missing = [rank_of[p] for p in procs if p not in have]
        if missing:
            issues.append((gid, seq, "skipped", json.dumps(missing),
                           f"rank(s) {missing} did not issue collective #{seq} of group {gid} ({rows[0][1]}) "
                           f"that rank(s) {sorted(rank_of[p] for p in have)} issued"))
            continue
        sigs: dict = {}
        for proc, op, redop, sig in rows:
            sigs.setdefault((op, redop, sig), []).append(rank_of[proc])
        if len({(op, redop) for op, redop, _ in sigs}) == 1 and rows[0][1] in ROOTED:
            continue  # (found through another row of the same seq: only the root's tensors differ)
        parts = [f"ranks {sorted(r)}: {op}{'(' + redop + ')' if redop else ''} "
                 + ", ".join(f"{shape} {dtype}" for shape, dtype in json.loads(sig))
                 for (op, redop, sig), r in sigs.items()]
        odd = min(sigs.values(), key=len)
        issues.append((gid, seq, "mismatch", json.dumps(sorted(odd)),
                       f"collective #{seq} of group {gid} differs: " + "; ".join(parts)))
    con.executemany("INSERT INTO collective_issues VALUES (?,?,?,?,?)", issues)
    return issues


def _ranges_to_read(gid, covering: list, lo: int, hi: int, digests, n_procs: int):
    """The ranges of sequence numbers in [lo, hi] of group ``gid`` that must be read from the
    store, in order: all of it without digests; else the blocks that some process marked, that
    [lo, hi] cuts, or whose digests differ between the processes."""
    sizes = {digests[p].block for p in covering} if digests is not None else ()
    if len(sizes) != 1 or len(covering) != n_procs:
        yield lo, hi
        return
    parts = [digests[p].groups[gid] for p in covering]
    (size,) = sizes
    for b in range(lo // size, hi // size + 1):
        first, last = max(lo, b * size), min(hi, b * size + size - 1)
        whole = first == b * size and last == b * size + size - 1
        if whole and not any(b in g[3] for g in parts):
            blocks = [g[2].get(b) for g in parts]
            if all(x == blocks[0] for x in blocks):
                continue
        yield first, last


def estimate_clock_offsets(con) -> list:
    """Offset of every process's monotonic clock from the reference process (lowest rank).

    Processes of one clock domain (one host, unless a test shifted a process's clock) share a
    monotonic clock: offset 0. For another domain, every rank leaves a blocking collective at
    nearly the same moment, so the offset is the median over matched blocking collectives of
    (end on reference - end on p). The residual skew reported is the median absolute difference
    of those ends after correction. With no matched collective, other hosts fall back to the
    wall-clock anchors written when each process started.
    """
    procs = con.execute("SELECT proc, rank, host, mono_anchor_ns, wall_anchor_ns, file FROM processes "
                        "ORDER BY rank IS NULL, rank, proc").fetchall()
    if not procs:
        return []
    # Before estimation the column holds the shift a test injected into a process's clock
    # (its header's clock_offset_ns: a test's clock shift, tests/integration/clock_shift): such a
    # process is its own clock domain.
    injected = {proc: off or 0 for proc, off in con.execute("SELECT proc, clock_offset_ns FROM processes")}
    domains = {}
    ref = procs[0]
    for proc, rank, host, *_ in procs:
        domains[proc] = (host, injected.get(proc, 0))
    ends: dict = {}
    # A bounded sample (the first CLOCK_SAMPLE_STEPS traced steps) is plenty for a median and
    # keeps this independent of the trace's length.
    first_steps = [r[0] for r in con.execute(
        f"SELECT DISTINCT step FROM steps ORDER BY step LIMIT {CLOCK_SAMPLE_STEPS}")]
    last = first_steps[-1] if first_steps else -1
    # One process at a time, so that the sample is read through the collectives' primary key
    # (proc, step, idx) rather than by a scan of every collective of the trace.
    for (proc,) in con.execute("SELECT proc FROM processes ORDER BY proc").fetchall():
        cur = con.execute(
            "SELECT c.proc, c.group_id, c.seq, st.t_begin + c.t0 + c.dur FROM collectives c "
            "JOIN steps st ON st.proc = c.proc AND st.step = c.step WHERE c.proc = ? AND c.step <= ? "
            f"AND (c.flags & ?) = 0 AND c.op NOT IN {P2P_SQL} ORDER BY c.step, c.idx",
            (proc, last, schema.FLAG_ASYNC | schema.FLAG_CAPTURED | schema.FLAG_REPLAYED))
        for proc_, gid, seq, end in cur:
            if end is not None:  # a step whose begin record was lost has no time base
                ends.setdefault(proc_, {})[(gid, seq)] = end
    out = []
    ref_ends = ends.get(ref[0], {})
    for proc, rank, host, mono, wall, _file in procs:
        mine = ends.get(proc, {})
        diffs = [ref_ends[k] - v for k, v in mine.items() if k in ref_ends]
        same_domain = domains[proc] == domains[ref[0]]
        if same_domain:
            off = 0
        elif diffs:
            off = int(statistics.median(diffs))
        else:
            # t_ref = t_p + (wall_p - mono_p) - (wall_ref - mono_ref)
            off = (wall - mono) - (ref[4] - ref[3]) if None not in (wall, mono, ref[3], ref[4]) else 0
        resid = int(statistics.median(abs(d - off) for d in diffs)) if diffs else None
        out.append((proc, off, resid, len(diffs)))
    con.executemany("UPDATE processes SET clock_offset_ns=?, clock_residual_ns=?, clock_matches=? WHERE proc=?",
                    [(off, res, n, proc) for proc, off, res, n in out])
    return out
