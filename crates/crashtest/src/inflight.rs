//! Committing transactions in flight, seen from the device log alone (issue #10,
//! design B(c)): independent of the journal's internals, so a regression to one
//! commit at a time is caught whatever the journal code says about itself.
//!
//! A *unit* is one JBD2 transaction (its descriptor, revoke and escaped data-copy
//! blocks and its commit block, found by their JBD2 headers and log positions) or
//! one fast commit (the fast-commit area blocks up to and including the one with
//! its TAIL tag, whatever order they were written in). A unit is *in flight* at
//! crash point `k` when at least one of its writes is among requests `0..k` and
//! not all of them are durable at `k` (a write is durable once it was written with
//! FUA, or a flush completed after it): exactly the transactions whose fate a
//! crash at `k` still decides. CJFS (§4.1, dual-stage commit) keeps several in
//! flight; a serial journal never more than one.

use std::collections::{BTreeMap, HashMap};

use commitfs_device::{CrashLog, IoCategory, LogOp};
use commitfs_format::fast_commit::{TAG_HEAD, TAG_PAD, TAG_TAIL};
use commitfs_format::jbd2;
use commitfs_format::jbd2_log;

/// The least number of committing transactions at once that the concurrent crash
/// workloads must show (acceptance 1 of issue #10). The serial journal of main
/// never exceeds 1; the dual-stage pipeline (design A.2, migration step 4) makes
/// this reachable.
pub const MIN_INFLIGHT: usize = 2;

/// What kind of log unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UnitKind {
    Jbd2,
    FastCommit,
}

/// One JBD2 transaction or fast commit and the log indices of its writes.
#[derive(Debug, Clone)]
pub struct Unit {
    pub kind: UnitKind,
    /// Transaction id (JBD2 `h_sequence`; for a fast commit the TAIL's tid).
    pub tid: u32,
    /// Log index of its first write.
    pub first: usize,
    /// First crash point at which every write of the unit is durable
    /// (`usize::MAX` if that never happens in the recording).
    pub durable_at: usize,
    /// Writes of the unit (log indices, ascending, deduplicated).
    pub writes: Vec<usize>,
}

impl Unit {
    /// In flight at crash point `k`.
    pub fn in_flight(&self, k: usize) -> bool {
        self.first < k && k < self.durable_at
    }
}

/// In-flight counts of a recording.
#[derive(Debug, Clone, Default)]
pub struct Inflight {
    pub units: Vec<Unit>,
    /// `per_k[k]`: units in flight at crash point `k` (`0..=log.len()`).
    pub per_k: Vec<u16>,
}

impl Inflight {
    /// Largest number of units in flight at one crash point.
    pub fn max(&self) -> usize {
        self.per_k.iter().copied().max().unwrap_or(0) as usize
    }
    /// Units in flight at crash point `k`.
    pub fn at(&self, k: usize) -> usize {
        self.per_k
            .get(k)
            .or(self.per_k.last())
            .copied()
            .unwrap_or(0) as usize
    }
    /// Crash points by number of units in flight: `hist[n]` points with `n`.
    pub fn histogram(&self) -> Vec<usize> {
        let mut h = vec![0usize; self.max() + 1];
        for &n in &self.per_k {
            h[n as usize] += 1;
        }
        h
    }
    /// Crash points with at least `n` units in flight.
    pub fn points_with(&self, n: usize) -> Vec<usize> {
        (0..self.per_k.len())
            .filter(|&k| self.per_k[k] as usize >= n)
            .collect()
    }
    /// Number of units of `kind`.
    pub fn count(&self, kind: UnitKind) -> usize {
        self.units.iter().filter(|u| u.kind == kind).count()
    }
    /// `"max=M hist=[n0, n1, ...] jbd2=J fc=F"` for a run's summary line.
    pub fn describe(&self) -> String {
        format!(
            "inflight_max={} inflight_hist={:?} jbd2_units={} fc_units={}",
            self.max(),
            self.histogram(),
            self.count(UnitKind::Jbd2),
            self.count(UnitKind::FastCommit)
        )
    }
}

/// How far back from a header-less journal block to look for the descriptor that
/// owns it (a 4 KiB CSUM_V3 descriptor holds at most 255 tags).
const MAX_TAGS_BACK: u64 = 512;

/// Tags in a fast-commit block: `(has HEAD, has TAIL with this tid)`. Walks the
/// raw TLVs (ext4-format.md §9.2) without validating values: this only groups
/// writes, recovery judges them.
fn fc_tags(b: &[u8]) -> (bool, Option<u32>) {
    let (mut head, mut tail) = (false, None);
    let mut off = 0usize;
    while off + 4 <= b.len() {
        let tag = u16::from_le_bytes([b[off], b[off + 1]]);
        let len = u16::from_le_bytes([b[off + 2], b[off + 3]]) as usize;
        if tag == 0 && len == 0 {
            break;
        }
        let v = off + 4;
        match tag {
            TAG_HEAD => head = true,
            TAG_TAIL if v + 4 <= b.len() => {
                tail = Some(u32::from_le_bytes([b[v], b[v + 1], b[v + 2], b[v + 3]]));
            }
            TAG_PAD => break,
            _ => {}
        }
        off = v + len;
    }
    (head, tail)
}

/// A fast commit being assembled: positions of its blocks and their writes.
struct FcOpen {
    /// Area positions `start..=tail` once the TAIL was seen.
    start: u64,
    tail: Option<(u64, u32)>,
    /// Position → log index of the write that put the block there.
    blocks: BTreeMap<u64, usize>,
}

/// Find the units of `log` (block size `bs`) and count them in flight at every
/// crash point.
pub fn analyze(log: &CrashLog, bs: usize) -> Inflight {
    let ops = log.ops();
    // next_flush[i]: index of the first flush at or after i (ops.len() if none).
    let mut next_flush = vec![ops.len(); ops.len() + 1];
    for i in (0..ops.len()).rev() {
        next_flush[i] = if ops[i].is_flush() {
            i
        } else {
            next_flush[i + 1]
        };
    }
    let durable_from = |i: usize| -> usize {
        match &ops[i] {
            LogOp::Write { fua: true, .. } => i + 1,
            _ if next_flush[i] < ops.len() => next_flush[i] + 1,
            _ => usize::MAX,
        }
    };
    // First position of the fast-commit area: the lowest fast-commit write.
    let fc_first = ops
        .iter()
        .filter_map(|o| match o {
            LogOp::Write {
                offset,
                cat: IoCategory::FastCommit,
                ..
            } => Some(offset / bs as u64),
            _ => None,
        })
        .min();

    // JBD2: tid → (writes, committed); position → latest header owner.
    let mut jbd2: BTreeMap<u32, (Vec<usize>, bool)> = BTreeMap::new();
    let mut owner: HashMap<u64, (u32, u32)> = HashMap::new();
    // Fast commits: finished units and the one being written.
    let mut fc_done: Vec<FcOpen> = Vec::new();
    let mut fc_pending: BTreeMap<u64, usize> = BTreeMap::new();
    let mut fc_next_start = fc_first.unwrap_or(0);

    for (i, op) in ops.iter().enumerate() {
        let LogOp::Write {
            offset, data, cat, ..
        } = op
        else {
            continue;
        };
        match cat {
            IoCategory::Journal => {
                for (n, b) in data.chunks(bs).enumerate() {
                    let pos = offset / bs as u64 + n as u64;
                    match jbd2_log::parse_header(b) {
                        Some((t, _))
                            if t == jbd2::BLOCKTYPE_SUPERBLOCK_V1
                                || t == jbd2::BLOCKTYPE_SUPERBLOCK_V2 => {}
                        Some((t, seq)) => {
                            let e = jbd2.entry(seq).or_default();
                            e.0.push(i);
                            if t == jbd2::BLOCKTYPE_COMMIT {
                                e.1 = true;
                            }
                            owner.insert(pos, (t, seq));
                        }
                        None => {
                            // A data copy: owned by the nearest descriptor before it
                            // whose transaction has no commit block yet.
                            owner.remove(&pos);
                            let found = (1..=MAX_TAGS_BACK.min(pos)).find_map(|d| {
                                match owner.get(&(pos - d)) {
                                    Some(&(t, seq)) if t == jbd2::BLOCKTYPE_DESCRIPTOR => Some(seq),
                                    _ => None,
                                }
                            });
                            if let Some(seq) = found {
                                if let Some(e) = jbd2.get_mut(&seq) {
                                    if !e.1 {
                                        e.0.push(i);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            IoCategory::FastCommit => {
                for (n, b) in data.chunks(bs).enumerate() {
                    // Area resets (a zeroed sector of block 0) carry no commit.
                    if b.len() < bs || b.iter().all(|&x| x == 0) {
                        continue;
                    }
                    let pos = offset / bs as u64 + n as u64;
                    // A missing block of a finished commit (block 0 written last).
                    if let Some(u) = fc_done.iter_mut().rev().take(4).find(|u| {
                        u.tail.is_some_and(|(t, _)| (u.start..=t).contains(&pos))
                            && !u.blocks.contains_key(&pos)
                    }) {
                        u.blocks.insert(pos, i);
                        continue;
                    }
                    let (head, tail) = fc_tags(b);
                    // The area restarted (after a full commit): positions go back.
                    // Blocks still pending belonged to no finished commit.
                    if pos < fc_next_start || (head && Some(pos) == fc_first) {
                        fc_next_start = fc_first.unwrap_or(pos).min(pos);
                        fc_pending.clear();
                    }
                    fc_pending.insert(pos, i);
                    if let Some(tid) = tail {
                        // The commit is the pending blocks up to its TAIL; blocks
                        // beyond it (a successor's body written early) stay pending.
                        let mut blocks = fc_pending.split_off(&(pos + 1));
                        std::mem::swap(&mut blocks, &mut fc_pending);
                        blocks.retain(|&p, _| p >= fc_next_start);
                        fc_done.push(FcOpen {
                            start: fc_next_start,
                            tail: Some((pos, tid)),
                            blocks,
                        });
                        fc_next_start = pos + 1;
                    }
                }
            }
            _ => {}
        }
    }

    let mut units = Vec::new();
    let mut push = |kind, tid, mut writes: Vec<usize>, complete: bool| {
        writes.sort_unstable();
        writes.dedup();
        // A transaction that never completed (no commit block, a fast commit
        // without TAIL or with a block never written) is not counted at all: the
        // count errs low, never high.
        let Some(&first) = writes.first().filter(|_| complete) else {
            return;
        };
        let durable_at = if complete {
            writes
                .iter()
                .map(|&w| durable_from(w))
                .max()
                .unwrap_or(usize::MAX)
        } else {
            usize::MAX
        };
        units.push(Unit {
            kind,
            tid,
            first,
            durable_at,
            writes,
        });
    };
    for (tid, (writes, committed)) in jbd2 {
        push(UnitKind::Jbd2, tid, writes, committed);
    }
    for u in fc_done {
        let complete = u
            .tail
            .is_some_and(|(t, _)| (u.start..=t).all(|p| u.blocks.contains_key(&p)));
        let tid = u.tail.map_or(0, |(_, tid)| tid);
        push(
            UnitKind::FastCommit,
            tid,
            u.blocks.values().copied().collect(),
            complete,
        );
    }
    // Sweep: +1 at first+1, -1 at durable_at.
    let len = ops.len();
    let mut delta = vec![0i64; len + 2];
    for u in &units {
        let a = u.first + 1;
        let b = u.durable_at.min(len + 1);
        if a < b {
            delta[a] += 1;
            delta[b] -= 1;
        }
    }
    let mut per_k = Vec::with_capacity(len + 1);
    let mut cur = 0i64;
    for d in delta.iter().take(len + 1) {
        cur += d;
        per_k.push(cur.max(0) as u16);
    }
    Inflight { units, per_k }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commitfs_device::{BlockDevice, RecordingDevice};
    use commitfs_format::fast_commit::TAG_TAIL;

    const BS: usize = 1024;

    fn hdr(blocktype: u32, tid: u32) -> Vec<u8> {
        let mut b = vec![0u8; BS];
        b[0..4].copy_from_slice(&jbd2::JBD2_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&blocktype.to_be_bytes());
        b[8..12].copy_from_slice(&tid.to_be_bytes());
        b
    }

    fn jw(d: &RecordingDevice, pos: u64, b: &[u8], fua: bool) {
        d.write_at(pos * BS as u64, b, IoCategory::Journal, fua)
            .unwrap();
    }

    /// Serial commits (log, flush, commit with FUA) never overlap; a pipelined
    /// pair (T+1's log written before T's commit is durable) counts 2.
    #[test]
    fn serial_commits_count_one_pipelined_two() {
        let d = RecordingDevice::new(vec![0; 64 * BS]);
        for (t, pos) in [(1u32, 10u64), (2, 14)] {
            let mut w = hdr(jbd2::BLOCKTYPE_DESCRIPTOR, t);
            w.extend_from_slice(&[7u8; BS]); // a data copy in the same write
            jw(&d, pos, &w, false);
            jw(&d, pos + 2, &[9u8; BS], false); // a separate data copy
            d.flush().unwrap();
            jw(&d, pos + 3, &hdr(jbd2::BLOCKTYPE_COMMIT, t), true);
        }
        let a = analyze(&d.crash_log(), BS);
        assert_eq!(a.count(UnitKind::Jbd2), 2);
        assert_eq!(a.max(), 1, "{}", a.describe());
        assert_eq!(a.units[0].writes, vec![0, 1, 3]);
        // After the FUA commit block nothing is in flight.
        assert_eq!(a.at(4), 0);
        assert_eq!(a.at(1), 1);

        // Pipelined: T=3's log is written, then T=4's log, one flush for both,
        // then C(3) without FUA, C(4) with FUA.
        let d = RecordingDevice::new(vec![0; 64 * BS]);
        jw(&d, 10, &hdr(jbd2::BLOCKTYPE_DESCRIPTOR, 3), false); // 0
        jw(&d, 11, &[1u8; BS], false); // 1
        jw(&d, 13, &hdr(jbd2::BLOCKTYPE_DESCRIPTOR, 4), false); // 2
        d.flush().unwrap(); // 3
        jw(&d, 12, &hdr(jbd2::BLOCKTYPE_COMMIT, 3), false); // 4
        jw(&d, 14, &hdr(jbd2::BLOCKTYPE_COMMIT, 4), false); // 5
        d.flush().unwrap(); // 6
        let a = analyze(&d.crash_log(), BS);
        assert_eq!(a.max(), 2, "{}", a.describe());
        assert_eq!(a.points_with(2), vec![3, 4, 5, 6]);
        assert_eq!(a.at(7), 0);
        assert_eq!(a.histogram(), vec![2, 2, 4]);
    }

    /// Fast commits: body then TAIL, and the block-0-last order; a commit is one
    /// unit however its blocks were written.
    #[test]
    fn fast_commits_are_grouped_by_tail() {
        let fw = |d: &RecordingDevice, pos: u64, tags: &[(u16, u32)], fua: bool| {
            let mut b = vec![0u8; BS];
            let mut off = 0;
            for &(tag, v) in tags {
                b[off..off + 2].copy_from_slice(&tag.to_le_bytes());
                b[off + 2..off + 4].copy_from_slice(&8u16.to_le_bytes());
                b[off + 4..off + 8].copy_from_slice(&v.to_le_bytes());
                off += 12;
            }
            d.write_at(pos * BS as u64, &b, IoCategory::FastCommit, fua)
                .unwrap();
        };
        let d = RecordingDevice::new(vec![0; 64 * BS]);
        // FC1 at 40..=41, block 0 (HEAD) last.
        fw(&d, 41, &[(1, 5), (TAG_TAIL, 5)], false); // 0
        d.flush().unwrap(); // 1
        fw(&d, 40, &[(TAG_HEAD, 5)], true); // 2
                                            // FC2 at 42 (one block).
        fw(&d, 42, &[(1, 5), (TAG_TAIL, 5)], true); // 3
        let a = analyze(&d.crash_log(), BS);
        assert_eq!(a.count(UnitKind::FastCommit), 2, "{:?}", a.units);
        assert_eq!(a.units[0].writes, vec![0, 2]);
        assert_eq!(a.units[0].tid, 5);
        assert_eq!(a.max(), 1);
        assert_eq!(a.at(2), 1);
        assert_eq!(a.at(3), 0);

        // Chained: FC2's body written before FC1's TAIL; both in flight until the
        // flush, FC1's TAIL then FC2's with FUA. A fast commit never finished (no
        // TAIL) is not counted.
        let d = RecordingDevice::new(vec![0; 64 * BS]);
        fw(&d, 40, &[(TAG_HEAD, 6)], false); // 0
        fw(&d, 42, &[(1, 6)], false); // 1: FC2 body
        fw(&d, 41, &[(1, 6), (TAG_TAIL, 6)], false); // 2: FC1 tail
        d.flush().unwrap(); // 3
        fw(&d, 43, &[(1, 6), (TAG_TAIL, 6)], true); // 4: FC2 tail
        fw(&d, 44, &[(1, 6)], false); // 5: never finished
        let a = analyze(&d.crash_log(), BS);
        assert_eq!(a.count(UnitKind::FastCommit), 2, "{:?}", a.units);
        assert_eq!(a.units[0].writes, vec![0, 2]);
        assert_eq!(a.units[1].writes, vec![1, 4]);
        assert_eq!(a.max(), 2);
        assert_eq!(a.points_with(2), vec![2, 3]);
        assert_eq!(a.at(5), 0);
        assert_eq!(a.at(6), 0);
    }
}
