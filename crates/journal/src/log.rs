//! The on-disk JBD2 log: geometry, the commit write sequence, checkpointing
//! (ext4-format.md §8.9–8.11, §8.13).
//!
//! Commit protocol (ordered mode). The commit thread (pipeline.rs) does 1–3, the
//! flush thread 4–6:
//!
//! 1. File data was written to its home blocks by `write` before the commit starts
//!    (under handles of the transaction, which have all stopped).
//! 2. If the log is empty, the journal superblock is written with `s_start` = the
//!    transaction's first block and `s_sequence` = its tid.
//! 3. Revoke blocks, then descriptor + data-copy groups, are written to the log as
//!    one contiguous write per physically contiguous run ([`LogState::write_body`]).
//! 4. One device flush: log blocks, the superblock update and ordered file data
//!    are now durable (the same flush also makes the previous transactions'
//!    commit blocks durable: compound flush).
//! 5. The commit block: with FUA when nothing follows (the transaction is durable
//!    when it completes), otherwise a plain write that the next flush makes
//!    durable.
//! 6. [`LogState::committed`]: the copies become the buffers' committed
//!    versions; home writes happen only at checkpoint: write them home, flush, then
//!    write the journal superblock (FUA) marking the log empty.
//!
//! Per fsync with metadata, one at a time: 2 device writes (log run + commit
//! block; 3 when the superblock must first be pointed at a fresh log) and 1 flush
//! + 1 FUA.
//!
//! With `fc_data_csum` (and CSUM_V3) a commit with nothing in flight before it may
//! instead be *single-flush*: steps 2–3 and the commit block, carrying CRC32Cs of
//! the transaction's not-yet-flushed data ranges, without flush or FUA, then one
//! flush (like JBD2's `async_commit`, but verified per log block and per data
//! range at recovery).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use commitfs_device::{BlockDevice, IoCategory};
use commitfs_format::bytes::put_be32;
use commitfs_format::jbd2::{self, JournalSuperblock};
use commitfs_format::jbd2_log::{self, LogFormat, Tag, TAG_ESCAPE};

use crate::recovery::{log_end, log_format, read_superblock};
use crate::{Buffer, JournalError, Result};

/// Where the journal's blocks live: runs of (journal block, device block, length).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalMap {
    runs: Vec<(u32, u64, u32)>,
    len: u32,
}

impl JournalMap {
    /// Build from runs sorted by journal block; they must cover `[0, len)` without
    /// gaps.
    pub fn new(mut runs: Vec<(u32, u64, u32)>) -> Result<JournalMap> {
        runs.sort_by_key(|r| r.0);
        let mut next = 0u32;
        for &(j, _, l) in &runs {
            if j != next || l == 0 {
                return Err(JournalError::BadJournal(format!(
                    "journal inode has a hole at journal block {next}"
                )));
            }
            next = j
                .checked_add(l)
                .ok_or_else(|| JournalError::BadJournal("journal too large".into()))?;
        }
        Ok(JournalMap { runs, len: next })
    }
    /// A journal in one contiguous run.
    pub fn contiguous(start: u64, len: u32) -> JournalMap {
        JournalMap {
            runs: vec![(0, start, len)],
            len,
        }
    }
    pub fn len(&self) -> u32 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Device block of journal block `j`.
    pub fn phys(&self, j: u32) -> Option<u64> {
        let i = self.runs.partition_point(|r| r.0 <= j);
        let (js, ps, l) = *self.runs.get(i.checked_sub(1)?)?;
        (j < js + l).then(|| ps + (j - js) as u64)
    }

    /// [`Self::phys`], an error naming the block when it is not mapped.
    pub(crate) fn require(&self, j: u32) -> Result<u64> {
        self.phys(j)
            .ok_or_else(|| JournalError::BadJournal(format!("journal block {j} not mapped")))
    }
}

/// What the file system tells the log at mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LogOptions {
    /// The file system has `64bit`: tags carry high block numbers.
    pub bit64: bool,
    /// The file system has `metadata_csum`: use CSUM_V3.
    pub csum: bool,
    /// The file system has `fast_commit` (keeps the fast-commit area out of the log).
    pub fast_commit: bool,
    /// Write fast commits (sets the JBD2 FAST_COMMIT bit); needs `fast_commit`.
    pub use_fast_commit: bool,
}

/// What the commit stage wrote ([`LogState::write_body`]).
pub(crate) struct Body {
    /// Log blocks including the commit block and a superblock update.
    pub log_blocks: u64,
    /// The commit block and its byte offset, for the flush stage; `None` when it
    /// was written already (single-flush).
    pub commit: Option<(u64, Vec<u8>)>,
}

pub(crate) struct LogState {
    map: JournalMap,
    bs: usize,
    raw_sb: Vec<u8>,
    fmt: LogFormat,
    first: u32,
    last: u32,
    /// Next log block to write.
    head: u32,
    /// First block of the oldest live transaction; 0 when the log is empty.
    tail: u32,
    next_tid: u32,
    fast_commit_bit: bool,
    last_commit_sec: u64,
    /// Fast-commit area: journal blocks `[fc_first, fc_end)` are writable (§8.10:
    /// `M - N + 1 .. M - 1`); `fc_off` blocks used since the last full commit.
    fc_first: u32,
    fc_end: u32,
    fc_off: u32,
    /// Full commits since the log was opened (fast commits need one first, §8.9).
    full_commits: u64,
    /// Buffers whose committed version is still only in the log, behind their
    /// own lock ([`CheckpointList`]): `Core::forget` asks it under the file
    /// system's lock and must not wait for the log lock, which is held across
    /// the checkpoint's and the log body's device I/O.
    checkpoint: CheckpointList,
}

/// The checkpoint list: block number to the buffer whose committed version
/// only the log holds. Changed under the log lock; read by `Core::forget`.
pub type CheckpointList = Arc<parking_lot::Mutex<BTreeMap<u64, Arc<Buffer>>>>;

fn now() -> (u64, u32) {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs(), d.subsec_nanos())
}

impl LogState {
    pub fn open(
        dev: &dyn BlockDevice,
        bs: usize,
        map: JournalMap,
        opts: LogOptions,
    ) -> Result<LogState> {
        let (jsb, mut raw) = read_superblock(dev, &map, bs)?;
        if jsb.start != 0 {
            return Err(JournalError::BadJournal(
                "the journal needs recovery before it can be used".into(),
            ));
        }
        if jsb.errno != 0 {
            return Err(JournalError::BadJournal(format!(
                "the journal recorded error {} (run e2fsck)",
                jsb.errno
            )));
        }
        // Features the kernel sets at a read-write mount (§8.4).
        let mut incompat =
            jsb.feature_incompat & !jbd2::INCOMPAT_CSUM_V2 & !jbd2::INCOMPAT_ASYNC_COMMIT;
        let mut compat = jsb.feature_compat;
        if opts.bit64 {
            incompat |= jbd2::INCOMPAT_64BIT;
        }
        if opts.csum {
            incompat |= jbd2::INCOMPAT_CSUM_V3;
            compat &= !jbd2::COMPAT_CHECKSUM;
            raw[jbd2::S_CHECKSUM_TYPE] = jbd2::CHECKSUM_TYPE_CRC32C;
        }
        // The fast-commit area is reserved whenever the file system has the feature;
        // the JBD2 FAST_COMMIT bit is set while fast commits may be written (§9.1).
        let use_fc = opts.fast_commit && opts.use_fast_commit;
        if use_fc {
            incompat |= jbd2::INCOMPAT_FAST_COMMIT;
        } else {
            incompat &= !jbd2::INCOMPAT_FAST_COMMIT;
        }
        put_be32(&mut raw, jbd2::S_FEATURE_INCOMPAT, incompat);
        put_be32(&mut raw, jbd2::S_FEATURE_COMPAT, compat);
        let jsb = JournalSuperblock {
            feature_incompat: incompat,
            feature_compat: compat,
            ..jsb
        };
        let fmt = log_format(&jsb, bs);
        let first = jsb.first;
        // Reserve the fast-commit area even before the bit is set, so enabling fast
        // commits never finds log blocks in it.
        let fc = if opts.fast_commit {
            jsb.fc_blocks(true)
        } else {
            0
        };
        let last = jsb
            .maxlen
            .saturating_sub(fc)
            .min(log_end(&jsb, opts.fast_commit));
        if last <= first + 8 {
            return Err(JournalError::BadJournal(format!(
                "journal of {} blocks is too small",
                jsb.maxlen
            )));
        }
        let fc_first = jsb.maxlen.saturating_sub(fc) + 1;
        let mut st = LogState {
            map,
            bs,
            raw_sb: raw,
            fmt,
            first,
            last,
            head: first,
            tail: 0,
            next_tid: jsb.sequence.wrapping_add(1),
            fast_commit_bit: incompat & jbd2::INCOMPAT_FAST_COMMIT != 0,
            last_commit_sec: 0,
            fc_first,
            // The whole area, like the kernel; a commit ending in its last block
            // carries a stopper (fast_commit::FcPacker::finish_stopped, §9.6).
            fc_end: if use_fc { jsb.maxlen } else { fc_first },
            fc_off: 0,
            full_commits: 0,
            checkpoint: Arc::default(),
        };
        if use_fc {
            // Whatever an earlier mount left in the area is stale now (the log is
            // empty); block 0's HEAD would make e2fsck refuse a later recovery
            // until our first fast commit overwrites it.
            st.zero_fc_head(dev)?;
        }
        st.write_sb(dev, 0, st.next_tid, true)?;
        Ok(st)
    }

    /// Single-flush commits are possible: the log has CSUM_V3 (per-block tag
    /// checksums recovery can verify).
    pub fn csum_v3(&self) -> bool {
        self.fmt.csum_v3()
    }

    pub fn next_tid(&self) -> u32 {
        self.next_tid
    }

    pub(crate) fn capacity(&self) -> u64 {
        (self.last - self.first) as u64
    }

    pub fn max_transaction_blocks(&self) -> u64 {
        (self.capacity() / 4).max(8)
    }

    fn used(&self) -> u64 {
        if self.tail == 0 {
            0
        } else if self.head >= self.tail {
            (self.head - self.tail) as u64
        } else {
            (self.last - self.tail + self.head - self.first) as u64
        }
    }

    fn advance(&self, j: u32) -> u32 {
        if j + 1 >= self.last {
            self.first
        } else {
            j + 1
        }
    }

    /// Block numbers with a committed version only in the log: a block freed
    /// while listed here still has a copy that replay would write over the
    /// block's next use, so the freeing transaction must revoke it. A block's
    /// pending checkpoint stays until the freeing transaction commits (see
    /// [`LogState::committed`]): a checkpoint before that must still write it
    /// home, because on disk the block stays in use until the free is durable,
    /// and the checkpoint empties the log that held its copy.
    pub fn checkpoint_list(&self) -> CheckpointList {
        self.checkpoint.clone()
    }

    fn write_sb(
        &mut self,
        dev: &dyn BlockDevice,
        start: u32,
        sequence: u32,
        fua: bool,
    ) -> Result<()> {
        put_be32(&mut self.raw_sb, jbd2::S_START, start);
        put_be32(&mut self.raw_sb, jbd2::S_SEQUENCE, sequence);
        if self.fmt.has_csum() {
            let c = jbd2::compute_checksum(&self.raw_sb);
            put_be32(&mut self.raw_sb, jbd2::S_CHECKSUM, c);
        }
        let p = self.map.phys(0).expect("journal block 0 is mapped");
        dev.write_at(p * self.bs as u64, &self.raw_sb, IoCategory::Journal, fua)?;
        Ok(())
    }

    /// Write `blocks` (already built) at consecutive log positions from `head`,
    /// merging physically contiguous runs into single device writes.
    /// Write `blocks` at the log head, advancing it (wrapping at the end).
    fn write_log_blocks(&mut self, dev: &dyn BlockDevice, blocks: &[Vec<u8>]) -> Result<()> {
        let mut items = Vec::with_capacity(blocks.len());
        for b in blocks {
            items.push((self.head, b.as_slice()));
            self.head = self.advance(self.head);
        }
        self.write_mapped(dev, &items, IoCategory::Journal)
    }

    /// Runs of `jblocks` (journal blocks, in order) that are consecutive both in
    /// the journal and on the device: `(physical block, first position, length)`.
    fn map_runs(&self, jblocks: &[u32]) -> Result<Vec<(u64, usize, usize)>> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < jblocks.len() {
            let p0 = self.map.require(jblocks[i])?;
            let mut k = i + 1;
            while k < jblocks.len()
                && jblocks[k] == jblocks[k - 1] + 1
                && self.map.phys(jblocks[k]) == Some(p0 + (k - i) as u64)
            {
                k += 1;
            }
            runs.push((p0, i, k - i));
            i = k;
        }
        Ok(runs)
    }

    /// Write `(journal block, contents)` items without FUA, in order, one request
    /// per run of consecutive journal blocks that are also consecutive on the
    /// device (the log and the fast-commit area share this).
    fn write_mapped(
        &self,
        dev: &dyn BlockDevice,
        items: &[(u32, &[u8])],
        cat: IoCategory,
    ) -> Result<()> {
        let jblocks: Vec<u32> = items.iter().map(|x| x.0).collect();
        for (p0, i, n) in self.map_runs(&jblocks)? {
            write_run(
                dev,
                p0 * self.bs as u64,
                items[i..i + n].iter().map(|x| x.1),
                cat,
            )?;
        }
        Ok(())
    }

    /// Whether the log must be checkpointed (emptied) before a transaction of
    /// `nbufs` buffers and `nrevokes` revokes can be written; an error when it
    /// could never fit. The caller drains the pipeline first: a checkpoint
    /// restarts the log at `s_first`, which only works with nothing in flight.
    pub fn needs_checkpoint(&self, nbufs: usize, revokes: &[u64]) -> Result<bool> {
        let f = self.fmt;
        let per_revoke = jbd2_log::build_revokes(&f, 0, revokes).len();
        let per = f.tags_per_descriptor().max(1);
        let needed = (per_revoke + nbufs.div_ceil(per) + nbufs + 1) as u64;
        if needed + 1 > self.capacity() {
            return Err(JournalError::TransactionTooBig {
                needed,
                capacity: self.capacity(),
            });
        }
        // Keep one block of slack so head never catches the tail. With the
        // FAST_COMMIT bit, never let a transaction straddle the wrap (e2fsprogs
        // 1.47 recovery bug, §8.10).
        let straddles = self.head as u64 + needed > self.last as u64;
        Ok(self.used() + needed + 1 > self.capacity() || (self.fast_commit_bit && straddles))
    }

    /// The commit stage of a transaction (CJFS §4.1): write its revoke,
    /// descriptor and data-copy blocks (and, for a log that was empty, the
    /// superblock pointing at it), no flush. Returns the commit block and where
    /// it goes, for the flush stage to write after a flush; or, for a
    /// single-flush commit (`single_flush` ranges given, CSUM_V3), writes the
    /// commit block too (no FUA): one flush then makes everything durable.
    /// Call only when [`Self::needs_checkpoint`] said no.
    pub fn write_body(
        &mut self,
        dev: &dyn BlockDevice,
        tid: u32,
        frozen: &[(Arc<Buffer>, Arc<[u8]>)],
        revokes: &std::collections::BTreeSet<u64>,
        single_flush: Option<&[(u64, u32, u32)]>,
    ) -> Result<Body> {
        let f = self.fmt;
        let revoke_list: Vec<u64> = revokes.iter().copied().collect();
        let revoke_blocks = jbd2_log::build_revokes(&f, tid, &revoke_list);
        let per = f.tags_per_descriptor().max(1);
        let mut sb_written = false;
        if self.tail == 0 {
            self.head = self.first;
            self.tail = self.head;
            self.write_sb(dev, self.tail, tid, false)?;
            sb_written = true;
        }
        let mut blocks: Vec<Vec<u8>> = revoke_blocks;
        for chunk in frozen.chunks(per) {
            let mut tags = Vec::with_capacity(chunk.len());
            let mut datas = Vec::with_capacity(chunk.len());
            for (b, data) in chunk {
                let mut copy = data.to_vec();
                let mut flags = 0;
                if jbd2_log::needs_escape(&copy) {
                    copy[..4].fill(0);
                    flags |= TAG_ESCAPE;
                }
                let checksum = if f.has_csum() {
                    jbd2_log::data_checksum(&f, tid, &copy)
                } else {
                    0
                };
                tags.push(Tag {
                    blocknr: b.blocknr(),
                    flags,
                    checksum,
                });
                datas.push(copy);
            }
            blocks.push(jbd2_log::build_descriptor(&f, tid, &tags));
            blocks.extend(datas);
        }
        self.write_log_blocks(dev, &blocks)?;
        let cj = self.head;
        let cp = self.map.require(cj)?;
        let off = cp * self.bs as u64;
        self.head = self.advance(cj);
        self.next_tid = tid.wrapping_add(1);
        let log_blocks = blocks.len() as u64 + 1 + sb_written as u64;
        // Single-flush commit (fc_data_csum, CSUM_V3 only): the commit block
        // carries the CRC32C of every data range the transaction makes reachable
        // that may not be durable yet, and goes out without FUA; one flush then
        // makes superblock pointer, log blocks, commit block and data durable
        // together. Recovery accepts such a transaction as the last one only when
        // every tag checksum and data range verifies (recovery.rs).
        if let Some(ranges) = single_flush.filter(|_| f.csum_v3()) {
            let (sec, nsec) = self.commit_time();
            if let Some(commit) = jbd2_log::build_commit_ext(&f, tid, sec, nsec, ranges) {
                dev.write_at(off, &commit, IoCategory::Journal, false)?;
                return Ok(Body {
                    log_blocks,
                    commit: None,
                });
            }
        }
        let (sec, nsec) = self.commit_time();
        Ok(Body {
            log_blocks,
            commit: Some((off, jbd2_log::build_commit(&f, tid, sec, nsec))),
        })
    }

    /// Transaction `tid` is durable (its commit block and everything before it):
    /// its copies become the buffers' committed versions, to be checkpointed;
    /// its frees stop being checkpointed; the fast-commit area restarts.
    pub fn committed(
        &mut self,
        dev: &dyn BlockDevice,
        tid: u32,
        bufs: &[Arc<Buffer>],
        revokes: &std::collections::BTreeSet<u64>,
    ) -> Result<()> {
        self.full_commits += 1;
        if self.fc_off > 0 {
            // The full commit supersedes this tid's fast commits; the area restarts
            // at block 0. A stale HEAD there would make e2fsck 1.47 refuse the
            // whole recovery (§9.8, §9.11 item 4): zero it (durable with the next
            // flush). Only now: until the commit is durable, those fast commits
            // are what recovery would replay.
            self.fc_off = 0;
            self.zero_fc_head(dev)?;
        }
        // This transaction's frees are durable now: the revoke records keep replay
        // from restoring the freed blocks, and a checkpoint must no longer write
        // them (they may be reused).
        let mut ck = self.checkpoint.lock();
        for blk in revokes {
            if let Some(b) = ck.remove(blk) {
                b.vers.lock().committed.take();
            }
        }
        for b in bufs {
            b.vers.lock().promote(tid);
            ck.insert(b.blocknr(), b.clone());
        }
        Ok(())
    }

    /// The commit time of a commit block written now (never going backwards).
    fn commit_time(&mut self) -> (u64, u32) {
        let (mut sec, nsec) = now();
        sec = sec.max(self.last_commit_sec);
        self.last_commit_sec = sec;
        (sec, nsec)
    }

    /// Write every committed version home, flush, then mark the log empty.
    pub fn checkpoint(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        // A copy: the list stays visible to `forget` until the log is empty, so
        // a block freed meanwhile is revoked (needlessly, but harmlessly).
        let bufs = self.checkpoint.lock().clone();
        for (blk, b) in &bufs {
            // Cleared only once written (as `Journal::write_home` does): until
            // then recovery could still start from this version, and
            // `replay_bases` must count it (the home copy is the old one).
            let v = b.vers.lock().committed.clone();
            if let Some(v) = v {
                dev.write_at(blk * self.bs as u64, &v, IoCategory::Metadata, false)?;
                let mut vs = b.vers.lock();
                vs.written_home(&v);
                if vs.committed.as_ref().is_some_and(|c| Arc::ptr_eq(c, &v)) {
                    vs.committed = None;
                }
            }
        }
        dev.flush()?;
        if self.fast_commit_bit {
            // Fast commits are only replayed when recovery runs, i.e. s_start != 0:
            // point s_start at an empty log of the next tid, as the kernel does.
            if self.tail != self.first || self.fc_off > 0 || self.head != self.first {
                self.tail = self.first;
                let seq = self.next_tid;
                self.write_sb(dev, self.first, seq, true)?;
            }
        } else if self.tail != 0 {
            // Empty log: nothing to replay; the next commit re-points s_start.
            self.tail = 0;
            let seq = self.next_tid;
            self.write_sb(dev, 0, seq, true)?;
        }
        self.head = self.first;
        self.checkpoint.lock().clear();
        Ok(())
    }

    /// Zero the first sector of fast-commit area block 0: a block whose first
    /// tag is not a HEAD ends the scan of every replayer (kernel, e2fsck,
    /// ours) with nothing to replay, and one sector costs an eighth of the
    /// block (issue #4 counts journal bytes against the kernel's).
    fn zero_fc_head(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        const SECTOR: [u8; 512] = [0u8; 512];
        if let Some(p) = self.map.phys(self.fc_first) {
            dev.write_sectors(p * self.bs as u64, &SECTOR, IoCategory::FastCommit)?;
        }
        Ok(())
    }

    /// Room for a fast commit of the running transaction: `(tid, first fast commit
    /// since the last full commit, free blocks)`, or `None` when fast commits are
    /// off or no full commit happened since the log was opened.
    pub fn fc_slot(&self) -> Option<(u32, bool, u32)> {
        if !self.fast_commit_bit || self.full_commits == 0 {
            return None;
        }
        let free = self.fc_end.saturating_sub(self.fc_first + self.fc_off);
        Some((self.next_tid, self.fc_off == 0, free))
    }

    /// Plan the device writes of a fast commit of `blocks` at the area's next
    /// free block (see [`FcIo`]); nothing is written and the area does not move
    /// until [`Self::fc_written`].
    pub fn fc_plan_io(&self, blocks: &[Vec<u8>], mode: FcFlush) -> Result<FcIo> {
        let n = blocks.len() as u32;
        if n == 0 || self.fc_first + self.fc_off + n > self.fc_end {
            return Err(JournalError::BadJournal("fast-commit area full".into()));
        }
        let start = self.fc_first + self.fc_off;
        // The block written last, after the others (and after the flush in
        // Ordered mode): normally the TAIL block. For the first fast commit since
        // the last full commit, in Ordered mode with several blocks, block 0
        // instead: it holds the HEAD, and the kernel fails recovery (and the mount)
        // on a HEAD of the expected tid followed by no valid TAIL (§9.6: the scan
        // returns -EFSBADCRC / -ECANCELED when no TAIL was valid yet), which a
        // crash between the body and the TAIL would leave. Block 0 was zeroed by
        // the full commit, so until it is written the area holds no HEAD.
        let last = if self.fc_off == 0 && n > 1 && matches!(mode, FcFlush::Ordered { .. }) {
            0
        } else {
            blocks.len() - 1
        };
        // The other blocks: contiguous runs in one write each.
        let others: Vec<usize> = (0..blocks.len()).filter(|&i| i != last).collect();
        let jblocks: Vec<u32> = others.iter().map(|&i| start + i as u32).collect();
        let bs = self.bs as u64;
        let runs = self
            .map_runs(&jblocks)?
            .into_iter()
            .map(|(p0, i, len)| (p0 * bs, others[i], len))
            .collect();
        let last_at = self.map.require(start + last as u32)? * bs;
        // Ordered: data and the other blocks durable before the last one (§9.4),
        // a flush only when there is something to order, the last block as FUA.
        // Together (fc_data_csum): DATA_CSUM records let recovery tell a complete
        // commit from one whose data was lost, so data, body and TAIL need no
        // order among themselves: one flush makes them all durable.
        let (flush_before, fua, flush_after) = match mode {
            FcFlush::Ordered { flush_first } => (flush_first || n > 1, true, false),
            FcFlush::Fua => (false, true, false),
            FcFlush::Together => (false, false, true),
        };
        Ok(FcIo {
            runs,
            last,
            last_at,
            flush_before,
            fua,
            flush_after,
            chainable: !matches!(mode, FcFlush::Fua),
            n,
        })
    }

    /// The fast commit planned as `io` is written: the area's next free block
    /// moves past it.
    pub fn fc_written(&mut self, io: &FcIo) {
        self.fc_off += io.n;
    }

    /// Blocks of the whole fast-commit area.
    pub fn fc_capacity(&self) -> u32 {
        self.fc_end.saturating_sub(self.fc_first)
    }

    /// Whether `n` more blocks fit the fast-commit area.
    pub fn fc_has_room(&self, n: u32) -> bool {
        self.fc_first + self.fc_off + n <= self.fc_end
    }

    /// Whether the area holds a fast commit since the last full commit.
    pub fn fc_started(&self) -> bool {
        self.fc_off > 0
    }

    /// Clean close: checkpoint and leave `s_start = 0`, `s_sequence` past every tid
    /// used, FAST_COMMIT cleared on disk (§8.11).
    pub fn close(&mut self, dev: &dyn BlockDevice, next_tid: u32) -> Result<()> {
        self.checkpoint(dev)?;
        if self.fc_off > 0 || self.fast_commit_bit {
            self.fc_off = 0;
            self.zero_fc_head(dev)?;
        }
        let incompat = self.fmt.incompat & !jbd2::INCOMPAT_FAST_COMMIT;
        put_be32(&mut self.raw_sb, jbd2::S_FEATURE_INCOMPAT, incompat);
        let seq = next_tid.max(self.next_tid).wrapping_add(1);
        self.write_sb(dev, 0, seq, true)
    }
}

/// Write blocks `bufs` as one request at byte `at`.
fn write_run<'a>(
    dev: &dyn BlockDevice,
    at: u64,
    mut bufs: impl ExactSizeIterator<Item = &'a [u8]>,
    cat: IoCategory,
) -> Result<()> {
    if bufs.len() == 1 {
        let b = bufs.next().expect("one block");
        dev.write_at(at, b, cat, false)?;
    } else {
        let n = bufs.len();
        let mut run: Vec<u8> = Vec::new();
        for b in bufs {
            if run.is_empty() {
                run.reserve_exact(b.len() * n);
            }
            run.extend_from_slice(b);
        }
        dev.write_at(at, &run, cat, false)?;
    }
    Ok(())
}

/// The device writes of one fast commit, planned under the log lock
/// ([`LogState::fc_plan_io`]) and issued without it ([`FcIo::issue`]): while a
/// fast commit is claimed (`Core::claim_fc`) nothing else writes the area or
/// moves its free pointer, so other users of the log — `Core::forget` under the
/// file system's lock among them — need not wait for the fast commit's flush.
#[derive(Debug)]
pub struct FcIo {
    /// `(byte offset, first block index, blocks)`: the blocks other than the
    /// last, in device-contiguous runs.
    runs: Vec<(u64, usize, usize)>,
    /// Index of the block written last, and where.
    last: usize,
    last_at: u64,
    flush_before: bool,
    fua: bool,
    flush_after: bool,
    /// `Ordered` or `Together`: the last block (`Together`: the flush) may be
    /// left to a later flush ([`Self::issue_chained`]).
    chainable: bool,
    n: u32,
}

impl FcIo {
    /// Issue the writes (and flushes) for `blocks`, the blocks it was planned
    /// for; except that when `chain()` says so just before the
    /// last write (a successor is expected: its flush will make this one
    /// durable, CJFS §4.4 compound flush, docs/ARCHITECTURE.md "Chained fast
    /// commits") an `Ordered` commit's last block is written without FUA and a
    /// `Together` commit skips its flush. Returns `(durable, flushes issued)`.
    pub fn issue_chained(
        &self,
        dev: &dyn BlockDevice,
        blocks: &[Vec<u8>],
        chain: &dyn Fn() -> bool,
    ) -> Result<(bool, u32)> {
        let mut flushes = 0;
        for &(at, i, len) in &self.runs {
            let bufs = blocks[i..i + len].iter().map(|b| b.as_slice());
            write_run(dev, at, bufs, IoCategory::FastCommit)?;
        }
        if self.flush_before {
            dev.flush()?;
            flushes += 1;
        }
        // `Ordered`: asked before the TAIL (FUA or not); `Together`: after it,
        // as late as possible (an fsync arriving meanwhile needs the successor).
        let ordered_chain = self.chainable && self.fua && chain();
        let fua = self.fua && !ordered_chain;
        dev.write_at(
            self.last_at,
            &blocks[self.last],
            IoCategory::FastCommit,
            fua,
        )?;
        let flush_after = self.flush_after && !(self.chainable && chain());
        if flush_after {
            dev.flush()?;
            flushes += 1;
        }
        Ok((fua || flush_after, flushes))
    }
}

/// How a fast commit reaches stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FcFlush {
    /// The kernel's discipline: flush first (when data was written since the last
    /// flush, or the commit has more than one block), then the TAIL block with FUA.
    Ordered { flush_first: bool },
    /// The TAIL block with FUA and no flush (everything it depends on is durable).
    Fua,
    /// Every block without FUA, then a single flush (`fc_data_csum`).
    Together,
}
