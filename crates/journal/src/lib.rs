//! The journal layer: metadata buffers, handles and transactions.
//!
//! Like the kernel's jbd2/ext4 split, this crate knows blocks, never files. The file
//! system changes metadata only through the handle protocol:
//!
//! ```text
//! let h = journal.start(credits)?;       // join the running transaction
//! let b = journal.bread(blocknr)?;       // cached metadata buffer
//! journal.get_write_access(&h, &b)?;     // declare intent (freezes a copy later)
//! b.data_mut()[..] = ...;                // modify the live version
//! journal.dirty_metadata(&h, &b);        // the transaction now owns the change
//! journal.stop(h)?;
//! ```
//!
//! A [`Buffer`] is the one home of "several versions of a metadata block"
//! (DEVELOPERS.md): the live version lives in `data`; the journal issue adds the
//! frozen copy per committing transaction and the last committed version beside it,
//! which CJFS shadow copies, exF2FS isolation and FJS subblock tracking all view.
//!
//! In this first version the journal runs in *write-home* mode: a commit writes every
//! dirty buffer to its home location and flushes the device. That is what a clean
//! unmount and `sync` need; crash atomicity through the on-disk JBD2 log comes with
//! the journal issue without changing this API.

mod data;
mod fc_scan;
mod log;
mod recovery;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use commitfs_device::{DeviceError, DeviceRef, IoCategory};
use commitfs_format::FormatError;
use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use fc_scan::{
    commit_fast_commit_replay, data_range_crc, fc_area, finish_fast_commit_recovery,
    hold_log_for_fast_commits, read_fast_commits, read_fast_commits_with, FcArea,
};
pub use log::{FcFlush, JournalMap, LogOptions};
pub use recovery::{
    read_superblock, recover, recover_with, scan, scan_with, RecoverOptions, RecoveryReport,
};

/// Errors of the journal layer.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("journal is read-only")]
    ReadOnly,
    #[error("block {0} is beyond the end of the device")]
    OutOfRange(u64),
    #[error("journal aborted after an earlier write error")]
    Aborted,
    #[error("journal corrupt: {0}")]
    Format(#[from] FormatError),
    #[error("journal unusable: {0}")]
    BadJournal(String),
    #[error("transaction of {needed} log blocks does not fit in a journal of {capacity}")]
    TransactionTooBig { needed: u64, capacity: u64 },
}

pub type Result<T> = std::result::Result<T, JournalError>;

/// One cached metadata block.
pub struct Buffer {
    blocknr: u64,
    data: RwLock<Box<[u8]>>,
    /// Modified by a transaction and not yet written home.
    dirty: AtomicBool,
    /// The last committed version not yet checkpointed to its home location (JBD2
    /// mode). A checkpoint writes this, never the live version, which may hold
    /// uncommitted changes.
    committed: Mutex<Option<Arc<[u8]>>>,
}

impl Buffer {
    pub fn blocknr(&self) -> u64 {
        self.blocknr
    }
    /// The live version, for reading.
    pub fn data(&self) -> RwLockReadGuard<'_, Box<[u8]>> {
        self.data.read()
    }
    /// The live version, for writing. Call only between `get_write_access` and
    /// `dirty_metadata` of a handle.
    pub fn data_mut(&self) -> RwLockWriteGuard<'_, Box<[u8]>> {
        self.data.write()
    }
    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Acquire)
    }
}

/// A handle: one atomic file-system operation's membership in a transaction. A
/// commit waits until every handle of the transaction has stopped, so an
/// operation's changes are never split between two transactions. Dropping a handle
/// stops it (also on error paths).
#[must_use = "a handle must be stopped"]
pub struct Handle {
    tid: u32,
    credits: u32,
    tx: Arc<TxShared>,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("tid", &self.tid)
            .field("credits", &self.credits)
            .finish()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut r = self.tx.running.lock();
        r.handles = r.handles.saturating_sub(1);
        if r.handles == 0 {
            self.tx.idle.notify_all();
        }
    }
}

/// The running transaction and the condition "no handle is open".
struct TxShared {
    running: Mutex<Running>,
    idle: Condvar,
}

impl Handle {
    pub fn tid(&self) -> u32 {
        self.tid
    }
    pub fn credits(&self) -> u32 {
        self.credits
    }
}

/// The log gets a copy of each buffer; handles of the next transaction may keep
/// changing the live version. Call only while no handle is open.
fn freeze(buffers: BTreeMap<u64, Arc<Buffer>>) -> Vec<(Arc<Buffer>, Arc<[u8]>)> {
    buffers
        .into_values()
        .map(|b| {
            b.dirty.store(false, Ordering::Release);
            let copy: Arc<[u8]> = Arc::from(&b.data.read()[..]);
            (b, copy)
        })
        .collect()
}

/// Transaction states (the journal issue uses all of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxState {
    Running,
    Locked,
    Committing,
    Committed,
    Checkpointed,
}

struct Running {
    tid: u32,
    /// Dirty buffers owned by the running transaction, by block number (sorted so a
    /// commit writes home in ascending order).
    buffers: BTreeMap<u64, Arc<Buffer>>,
    /// Blocks freed while their logged copies are still live (JBD2 revoke records).
    revokes: BTreeSet<u64>,
    handles: u32,
    /// Data blocks for single-flush commits (`fc_data_csum`, data.rs).
    data: data::DataTrack,
}

/// Journal counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct JournalStats {
    pub commits: u64,
    pub buffers_written: u64,
    pub handles: u64,
    /// Log blocks written (descriptor, data copies, revoke, commit).
    pub log_blocks: u64,
    pub checkpoints: u64,
    pub revokes: u64,
    /// Fast commits written and their blocks.
    pub fc_commits: u64,
    pub fc_blocks: u64,
}

/// Buffer cache plus transaction manager.
pub struct Journal {
    dev: DeviceRef,
    block_size: usize,
    blocks: u64,
    read_only: bool,
    cache: Mutex<HashMap<u64, Arc<Buffer>>>,
    tx: Arc<TxShared>,
    /// Commits are serialised; a commit holds this while writing.
    commit_lock: Mutex<()>,
    aborted: AtomicBool,
    commits: AtomicU64,
    buffers_written: AtomicU64,
    handles: AtomicU64,
    cache_limit: usize,
    /// The on-disk JBD2 log; `None` = write-home mode (no journal on the image).
    log: Option<Mutex<log::LogState>>,
    log_blocks: AtomicU64,
    checkpoints: AtomicU64,
    revoke_count: AtomicU64,
    fc_commits: AtomicU64,
    fc_blocks: AtomicU64,
    /// Highest tid whose commit is durable (0: none yet).
    committed_tid: std::sync::atomic::AtomicU32,
    /// A block written home after every commit (`u64::MAX`: none); see
    /// [`Journal::keep_home`].
    keep_home: AtomicU64,
    /// That block was written home and no fast commit has flushed since.
    home_unflushed: AtomicBool,
}

impl Journal {
    /// A journal in write-home mode: commits write buffers to their homes (for
    /// images without a journal, and read-only mounts).
    pub fn new(dev: DeviceRef, block_size: usize, read_only: bool) -> Journal {
        let blocks = dev.size() / block_size as u64;
        Journal {
            dev,
            block_size,
            blocks,
            read_only,
            cache: Mutex::new(HashMap::new()),
            tx: Arc::new(TxShared {
                running: Mutex::new(Running {
                    tid: 1,
                    buffers: BTreeMap::new(),
                    revokes: BTreeSet::new(),
                    handles: 0,
                    data: Default::default(),
                }),
                idle: Condvar::new(),
            }),
            commit_lock: Mutex::new(()),
            aborted: AtomicBool::new(false),
            commits: AtomicU64::new(0),
            buffers_written: AtomicU64::new(0),
            handles: AtomicU64::new(0),
            cache_limit: 1 << 18,
            log: None,
            log_blocks: AtomicU64::new(0),
            checkpoints: AtomicU64::new(0),
            revoke_count: AtomicU64::new(0),
            committed_tid: std::sync::atomic::AtomicU32::new(0),
            keep_home: AtomicU64::new(u64::MAX),
            home_unflushed: AtomicBool::new(false),
            fc_commits: AtomicU64::new(0),
            fc_blocks: AtomicU64::new(0),
        }
    }

    /// A journal writing JBD2 transactions into the on-disk log described by `map`.
    /// The log must be empty (run [`recover`] first). Sets the JBD2 features the
    /// kernel would set (§8.4) and writes the journal superblock.
    pub fn open_log(
        dev: DeviceRef,
        block_size: usize,
        map: JournalMap,
        opts: LogOptions,
    ) -> Result<Journal> {
        let state = log::LogState::open(&*dev, block_size, map, opts)?;
        let mut j = Journal::new(dev, block_size, false);
        j.tx.running.lock().tid = state.next_tid();
        j.log = Some(Mutex::new(state));
        Ok(j)
    }

    /// Whether transactions go to an on-disk JBD2 log.
    pub fn has_log(&self) -> bool {
        self.log.is_some()
    }

    /// Whether the journal is aborted: a log, home or flush write failed (or the
    /// file system gave up, [`Self::abort`]). Like `jbd2_journal_abort`, nothing
    /// is committed, checkpointed or marked empty from then on: what the log holds
    /// stays for recovery at the next mount, and handles cannot start.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Abort the journal (see [`Self::is_aborted`]). Returns whether this call
    /// aborted it (false: it already was).
    pub fn abort(&self) -> bool {
        !self.aborted.swap(true, Ordering::AcqRel)
    }

    /// Flush the device for an fsync that has nothing to log (its data only). A
    /// failure aborts the journal: the cache may have lost data and committed
    /// blocks alike, and a later flush that succeeds proves nothing about them.
    pub fn flush_device(&self) -> Result<()> {
        self.check_live()?;
        let r = self.dev.flush().map_err(Into::into);
        self.or_abort(r)
    }

    /// `Err(Aborted)` once the journal is aborted.
    fn check_live(&self) -> Result<()> {
        if self.is_aborted() {
            return Err(JournalError::Aborted);
        }
        Ok(())
    }

    /// Pass `r` on; an error aborts the journal: after a failed write the state
    /// of the log (or of the home blocks and the device cache) is unknown, so no
    /// later commit may build on it.
    fn or_abort<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if self.abort() {
                tracing::error!("journal aborted: {e}");
            }
        }
        r
    }

    /// A running transaction this large should be committed now (a quarter of the
    /// log, like the kernel's maximum transaction size).
    pub fn should_commit(&self) -> bool {
        match &self.log {
            Some(l) => self.pending() as u64 >= l.lock().max_transaction_blocks(),
            None => self.pending() >= 16384,
        }
    }

    pub fn device(&self) -> &DeviceRef {
        &self.dev
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Read a metadata block through the cache.
    pub fn bread(&self, blocknr: u64) -> Result<Arc<Buffer>> {
        if let Some(b) = self.cache.lock().get(&blocknr) {
            return Ok(b.clone());
        }
        if blocknr >= self.blocks {
            return Err(JournalError::OutOfRange(blocknr));
        }
        let mut data = vec![0u8; self.block_size].into_boxed_slice();
        self.dev.read_at(
            blocknr * self.block_size as u64,
            &mut data,
            IoCategory::Metadata,
        )?;
        let mut cache = self.cache.lock();
        if cache.len() >= self.cache_limit {
            // Drop clean buffers nobody holds; dirty ones stay until written home.
            cache.retain(|_, b| b.is_dirty() || Arc::strong_count(b) > 1);
        }
        let b = cache
            .entry(blocknr)
            .or_insert_with(|| {
                Arc::new(Buffer {
                    blocknr,
                    data: RwLock::new(data),
                    dirty: AtomicBool::new(false),
                    committed: Mutex::new(None),
                })
            })
            .clone();
        Ok(b)
    }

    /// Whether recovery after a crash now would rewrite block `blocknr` from the log:
    /// a committed version of it is not home yet. (e2fsck 1.47 replays fast
    /// commits over inode-table blocks it cached before journal recovery; see
    /// `FcReason::JournalInodeBlock` in commitfs-fs.)
    pub fn home_is_stale(&self, blocknr: u64) -> bool {
        let b = self.cache.lock().get(&blocknr).cloned();
        b.is_some_and(|b| b.committed.lock().is_some())
    }

    /// Write the committed version of block `blocknr` home now, if it is not home
    /// yet (no flush: the next `Ordered` fast commit flushes before its log block).
    /// Later checkpoints skip it. Safe at any time: recovery would write that very
    /// version (or a newer one). Returns whether a write was made.
    pub fn write_home(&self, blocknr: u64) -> Result<bool> {
        let Some(b) = self.cache.lock().get(&blocknr).cloned() else {
            return Ok(false);
        };
        // The buffer's own lock: a commit publishing a newer version waits.
        let mut c = b.committed.lock();
        let Some(v) = c.as_ref() else {
            return Ok(false);
        };
        self.dev.write_at(
            blocknr * self.block_size as u64,
            v,
            IoCategory::Metadata,
            false,
        )?;
        // Before the block stops looking stale to `home_is_stale`.
        self.home_unflushed.store(true, Ordering::Release);
        *c = None;
        Ok(true)
    }

    /// The versions of a metadata block that recovery could start from after a
    /// crash now: the last committed version (if not yet home) and the home copy
    /// (if the live version differs from it). Fast commits use this to tell which
    /// bytes replay would leave as they are.
    pub fn replay_bases(&self, blocknr: u64) -> Result<Vec<Vec<u8>>> {
        let b = self.bread(blocknr)?;
        let mut out = Vec::with_capacity(2);
        if let Some(c) = b.committed.lock().as_ref() {
            out.push(c.to_vec());
        }
        if b.is_dirty() {
            let mut home = vec![0u8; self.block_size];
            self.dev.read_at(
                blocknr * self.block_size as u64,
                &mut home,
                IoCategory::Metadata,
            )?;
            out.push(home);
        } else {
            out.push(b.data().to_vec());
        }
        Ok(out)
    }

    /// A buffer for a newly allocated metadata block: zero-filled, never read from
    /// the device (its old content is garbage by definition).
    pub fn getblk_zeroed(&self, blocknr: u64) -> Result<Arc<Buffer>> {
        if blocknr >= self.blocks {
            return Err(JournalError::OutOfRange(blocknr));
        }
        let mut cache = self.cache.lock();
        let b = cache
            .entry(blocknr)
            .or_insert_with(|| {
                Arc::new(Buffer {
                    blocknr,
                    data: RwLock::new(vec![0u8; self.block_size].into_boxed_slice()),
                    dirty: AtomicBool::new(false),
                    committed: Mutex::new(None),
                })
            })
            .clone();
        b.data.write().fill(0);
        Ok(b)
    }

    /// Start a handle in the running transaction.
    pub fn start(&self, credits: u32) -> Result<Handle> {
        if self.read_only {
            return Err(JournalError::ReadOnly);
        }
        if self.aborted.load(Ordering::Acquire) {
            return Err(JournalError::Aborted);
        }
        let mut r = self.tx.running.lock();
        r.handles += 1;
        self.handles.fetch_add(1, Ordering::Relaxed);
        Ok(Handle {
            tid: r.tid,
            credits,
            tx: self.tx.clone(),
        })
    }

    /// Declare that `h` is about to modify `b`.
    pub fn get_write_access(&self, _h: &Handle, _b: &Arc<Buffer>) -> Result<()> {
        if self.read_only {
            return Err(JournalError::ReadOnly);
        }
        Ok(())
    }

    /// The modification of `b` by `h` is complete; the running transaction owns it.
    pub fn dirty_metadata(&self, _h: &Handle, b: &Arc<Buffer>) {
        b.dirty.store(true, Ordering::Release);
        let mut r = self.tx.running.lock();
        // A block journaled again after being revoked: its new copy must replay.
        r.revokes.remove(&b.blocknr);
        r.buffers.insert(b.blocknr, b.clone());
    }

    /// A metadata block was freed: its pending change must never reach the device,
    /// and a later reuse as a data block must not see a stale cached copy.
    pub fn forget(&self, _h: &Handle, blocknr: u64) {
        self.tx.running.lock().buffers.remove(&blocknr);
        let cached = self.cache.lock().remove(&blocknr);
        if let Some(b) = &cached {
            // Its committed version (if any) stays: until this free commits, a
            // checkpoint must still write it home (log.rs `forget`).
            b.dirty.store(false, Ordering::Release);
        }
        if let Some(l) = &self.log {
            // Its logged copy must never be replayed over the block's next use.
            if l.lock().forget(blocknr) {
                self.tx.running.lock().revokes.insert(blocknr);
            }
        }
    }

    pub fn stop(&self, h: Handle) -> Result<()> {
        drop(h);
        Ok(())
    }

    /// Commit the running transaction: write its buffers home in block order, then
    /// flush the device cache. Returns the number of buffers written.
    pub fn commit(&self) -> Result<usize> {
        let n = self.commit_inner(false)?;
        self.write_kept_home()?;
        Ok(n)
    }

    /// Write `blocknr` home right after every full commit that logs it, and flush
    /// before the next fast commit's log block (`Ordered` fast commits) so that a
    /// log which replay would apply never outlives the home write. For e2fsck
    /// 1.47, which replays fast commits over the journal inode's inode-table
    /// block as it read it before journal recovery (commitfs-fs,
    /// `FcReason::JournalInodeBlock`).
    pub fn keep_home(&self, blocknr: Option<u64>) {
        self.keep_home
            .store(blocknr.unwrap_or(u64::MAX), Ordering::Release);
    }

    fn write_kept_home(&self) -> Result<()> {
        let b = self.keep_home.load(Ordering::Acquire);
        if b != u64::MAX {
            self.write_home(b)?;
        }
        Ok(())
    }

    /// Flush the device; with single-flush tracking, the data blocks of the running
    /// transaction written so far are durable afterwards and leave the list a
    /// commit must checksum. Call with the commit lock held.
    fn flush_data(&self) -> Result<usize> {
        let r = self.flushing_data(|| Ok(self.dev.flush()?));
        self.or_abort(r)?;
        Ok(0)
    }

    /// Run `io`, which ends with a flush: the data blocks written before it are
    /// durable once it succeeds and leave the single-flush tracking; on failure
    /// they stay tracked.
    fn flushing_data<T>(&self, io: impl FnOnce() -> Result<T>) -> Result<T> {
        {
            let mut r = self.tx.running.lock();
            let d = std::mem::take(&mut r.data.running);
            r.data.flushing.union(&d);
        }
        let res = io();
        let mut r = self.tx.running.lock();
        let d = std::mem::take(&mut r.data.flushing);
        if res.is_err() {
            r.data.running.union(&d);
        }
        res
    }

    fn commit_inner(&self, force: bool) -> Result<usize> {
        if self.read_only {
            return Ok(0);
        }
        let _c = self.commit_lock.lock();
        self.check_live()?;
        let (tid, buffers) = {
            let mut r = self.tx.running.lock();
            // T_LOCKED: wait until every handle of the transaction has stopped.
            while r.handles > 0 {
                self.tx.idle.wait(&mut r);
            }
            if r.buffers.is_empty() && r.revokes.is_empty() && !force {
                // Nothing to log; an fsync still needs its data durable.
                drop(r);
                return self.flush_data();
            }
            let tid = r.tid;
            r.tid = r.tid.wrapping_add(1);
            let buffers = std::mem::take(&mut r.buffers);
            let revokes = std::mem::take(&mut r.revokes);
            if let Some(l) = &self.log {
                // Freeze while no handle is open and none can start (we hold the
                // running lock): a copy taken after releasing it could contain
                // changes of the next transaction, i.e. half an operation.
                let frozen = freeze(buffers);
                // Its data blocks: guarded from now on (a handle of the next
                // transaction must not overwrite them in place before this
                // commit, and a later one behind it, are durable).
                let data = if r.data.on {
                    let mut d = std::mem::take(&mut r.data.running);
                    d.union(&std::mem::take(&mut r.data.flushing));
                    r.data.committing = Some((tid, d.clone()));
                    Some(d)
                } else {
                    None
                };
                drop(r);
                return self.commit_log(l, tid, frozen, revokes, data);
            }
            // Write-home mode has no log to revoke from.
            (tid, buffers)
        };
        let n = buffers.len();
        for (blocknr, b) in buffers {
            // Clear first: a change racing with the write re-dirties the buffer and
            // re-queues it, so nothing is lost.
            b.dirty.store(false, Ordering::Release);
            let data = b.data.read();
            let r = self.dev.write_at(
                blocknr * self.block_size as u64,
                &data,
                IoCategory::Metadata,
                false,
            );
            self.or_abort(r.map_err(Into::into))?;
        }
        let r = self.dev.flush();
        self.or_abort(r.map_err(Into::into))?;
        self.committed_tid.store(tid, Ordering::Release);
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.buffers_written.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    fn commit_log(
        &self,
        l: &Mutex<log::LogState>,
        tid: u32,
        frozen: Vec<(Arc<Buffer>, Arc<[u8]>)>,
        revokes: BTreeSet<u64>,
        data: Option<data::RangeSet>,
    ) -> Result<usize> {
        let n = frozen.len();
        let mut st = l.lock();
        // Single-flush: the CRC32C of every data run (read back from the device:
        // written by handles of this transaction, which have all stopped; no other
        // transaction may overwrite them in place meanwhile, see data_conflict).
        // Too many runs, or a run outside the device: the two-flush commit.
        let ext = match &data {
            Some(d) if st.csum_v3() => self.data_crcs(d),
            _ => None,
        };
        let res = st.commit(&*self.dev, tid, &frozen, &revokes, ext.as_deref());
        {
            let mut r = self.tx.running.lock();
            r.data.committing = None;
            if let Ok(w) = &res {
                // A durable commit makes every earlier one non-final; a
                // single-flush one with data ranges is itself final until the
                // next commit is durable behind it.
                r.data.protected = match (w.single_flush, data) {
                    (true, Some(d)) if !d.is_empty() => Some((tid, d)),
                    _ => None,
                };
            }
        }
        let written = self.or_abort(res)?;
        if written.checkpointed {
            self.checkpoints.fetch_add(1, Ordering::Relaxed);
        }
        self.log_blocks
            .fetch_add(written.log_blocks, Ordering::Relaxed);
        self.revoke_count
            .fetch_add(revokes.len() as u64, Ordering::Relaxed);
        self.committed_tid.store(tid, Ordering::Release);
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.buffers_written.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// `(pblk, len, crc)` of the runs of `d`, if they fit one commit block.
    fn data_crcs(&self, d: &data::RangeSet) -> Option<Vec<(u64, u32, u32)>> {
        let runs = d.runs();
        if runs.len() > commitfs_format::jbd2_log::commit_ext_capacity(self.block_size) {
            return None;
        }
        let mut out = Vec::with_capacity(runs.len());
        for (pblk, len) in runs {
            match data_range_crc(&*self.dev, self.block_size, pblk, len) {
                Ok(Some(crc)) => out.push((pblk, len, crc)),
                _ => return None,
            }
        }
        Some(out)
    }

    /// `fc_data_csum`: make full commits single-flush (only on a log with
    /// CSUM_V3; otherwise this does nothing). From now on the file system must
    /// report data writes and frees ([`Self::note_data`], [`Self::forget_data`])
    /// and check in-place overwrites with [`Self::data_conflict`].
    pub fn set_single_flush(&self, on: bool) {
        let v3 = self.log.as_ref().is_some_and(|l| l.lock().csum_v3());
        let mut r = self.tx.running.lock();
        r.data = data::DataTrack {
            on: on && v3 && !self.read_only,
            ..Default::default()
        };
    }

    /// Whether single-flush data tracking is on.
    pub fn tracks_data(&self) -> bool {
        self.tx.running.lock().data.on
    }

    /// Data blocks `pblk..pblk+len` were written (not yet flushed) under a handle
    /// of the running transaction.
    pub fn note_data(&self, pblk: u64, len: u64) {
        let mut r = self.tx.running.lock();
        if r.data.on {
            r.data.running.insert(pblk, pblk.saturating_add(len));
        }
    }

    /// Data blocks `pblk..pblk+len` were freed by the running transaction: its
    /// commit no longer makes them reachable, so it must not checksum them (they
    /// may hold another file's data once the free is durable).
    pub fn forget_data(&self, pblk: u64, len: u64) {
        let mut r = self.tx.running.lock();
        if r.data.on {
            let e = pblk.saturating_add(len);
            r.data.running.remove(pblk, e);
            r.data.flushing.remove(pblk, e);
        }
    }

    /// Whether writing the data blocks `runs` (`(pblk, len)`) in place under `h`
    /// would change data that a committing transaction, or the last single-flush
    /// commit (still final in the log), checksummed. Returns that transaction's
    /// tid: call [`Self::confirm_data`] with it (without holding a handle) first.
    pub fn data_conflict(&self, h: &Handle, runs: &[(u64, u32)]) -> Option<u32> {
        let r = self.tx.running.lock();
        if !r.data.on {
            return None;
        }
        runs.iter()
            .filter_map(|&(p, n)| r.data.conflict(p, p.saturating_add(n as u64)))
            .find(|&t| t != h.tid)
    }

    /// Make transaction `tid`'s single-flush commit non-final before one of its
    /// data blocks is overwritten in place: wait for its commit, then append an
    /// empty fast commit of the next transaction with FUA (`pack(tid, needs HEAD,
    /// free blocks)` builds the block), or commit the next transaction (even an
    /// empty one) when no fast commit can be written. Returns whether an empty fast
    /// commit was written. Call without holding a handle.
    pub fn confirm_data(
        &self,
        tid: u32,
        pack: &dyn Fn(u32, bool, u32) -> Option<Vec<u8>>,
    ) -> Result<bool> {
        let Some(l) = &self.log else {
            return Ok(false);
        };
        {
            let _c = self.commit_lock.lock();
            self.check_live()?;
            let running = {
                let r = self.tx.running.lock();
                if r.data.protected.as_ref().is_none_or(|p| p.0 != tid) {
                    // Two-flush, confirmed already, or superseded.
                    return Ok(false);
                }
                r.tid
            };
            let mut st = l.lock();
            if let Some((t, head, free)) = st.fc_slot() {
                if t == running && st.fc_has_room(1) {
                    if let Some(b) = pack(t, head, free) {
                        let r = st.fc_write(&*self.dev, &[b], FcFlush::Fua);
                        self.or_abort(r)?;
                        self.fc_blocks.fetch_add(1, Ordering::Relaxed);
                        self.tx.running.lock().data.protected = None;
                        return Ok(true);
                    }
                }
            }
        }
        self.commit_inner(true)?;
        self.write_kept_home()?;
        Ok(false)
    }

    /// Where the next fast commit would go: `(tid of the running transaction, needs
    /// a HEAD, free fast-commit blocks)`; `None` when a full commit is required.
    pub fn fc_slot(&self) -> Option<(u32, bool, u32)> {
        let l = self.log.as_ref()?;
        if self.read_only {
            return None;
        }
        l.lock().fc_slot()
    }

    /// Blocks of the whole fast-commit area (0 without one).
    pub fn fc_capacity(&self) -> u32 {
        self.log.as_ref().map_or(0, |l| l.lock().fc_capacity())
    }

    /// Write a fast commit built for transaction `tid` (TLV blocks, the last one
    /// holding the TAIL). Returns `false` without writing when `tid` is no longer
    /// running: a full commit has made everything it described durable already.
    pub fn fast_commit(&self, tid: u32, blocks: &[Vec<u8>], flush_first: bool) -> Result<bool> {
        self.fast_commit_mode(tid, blocks, FcFlush::Ordered { flush_first })
    }

    /// [`Self::fast_commit`] with an explicit flush discipline (see [`FcFlush`]).
    pub fn fast_commit_mode(&self, tid: u32, blocks: &[Vec<u8>], mode: FcFlush) -> Result<bool> {
        let Some(l) = &self.log else {
            return Err(JournalError::BadJournal("no journal log".into()));
        };
        let _c = self.commit_lock.lock();
        self.check_live()?;
        if self.tx.running.lock().tid != tid {
            return Ok(false);
        }
        let mode = match mode {
            FcFlush::Ordered { .. } if self.home_unflushed.swap(false, Ordering::AcqRel) => {
                FcFlush::Ordered { flush_first: true }
            }
            m => m,
        };
        let mut st = l.lock();
        let mut write = || st.fc_write(&*self.dev, blocks, mode);
        let r = if mode == FcFlush::Together {
            // Its flush makes the data written so far durable.
            self.flushing_data(write)
        } else {
            write()
        };
        // A failed fast commit leaves the area in an unknown state; the kernel
        // falls back to a full commit, which then writes the same device: abort.
        self.or_abort(r)?;
        // A durable fast commit of the next tid follows the last full commit:
        // that commit is no longer final.
        self.tx.running.lock().data.protected = None;
        self.fc_commits.fetch_add(1, Ordering::Relaxed);
        self.fc_blocks
            .fetch_add(blocks.len() as u64, Ordering::Relaxed);
        Ok(true)
    }

    /// `fc_data_csum`: make the last fast commit of `tid` (whose data checksums
    /// recovery would verify) final before one of its data blocks is overwritten in
    /// place, by appending an empty fast commit (a lone TAIL) with FUA. No-op when a
    /// full commit has superseded `tid` or nothing is in the area. Returns whether
    /// it wrote.
    pub fn fc_confirm(&self, tid: u32, block: &[u8]) -> Result<bool> {
        let Some(l) = &self.log else {
            return Ok(false);
        };
        let _c = self.commit_lock.lock();
        self.check_live()?;
        if self.tx.running.lock().tid != tid {
            return Ok(false);
        }
        let mut st = l.lock();
        if !st.fc_has_room(1) || !st.fc_started() {
            return Ok(false);
        }
        let r = st.fc_write(&*self.dev, &[block.to_vec()], FcFlush::Fua);
        self.or_abort(r)?;
        self.tx.running.lock().data.protected = None;
        self.fc_blocks.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Write every committed buffer home, flush, and empty the log.
    pub fn checkpoint(&self) -> Result<()> {
        if let Some(l) = &self.log {
            let _c = self.commit_lock.lock();
            self.check_live()?;
            // A failed checkpoint leaves the log tail where it was: recovery
            // replays those transactions again.
            let r = l.lock().checkpoint(&*self.dev);
            self.or_abort(r)?;
            // The log is empty: no commit in it is verified at recovery.
            self.tx.running.lock().data.protected = None;
            self.checkpoints.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Clean shutdown of the log: commit, checkpoint, mark the journal empty with the
    /// FAST_COMMIT bit cleared on disk (§8.11).
    pub fn close(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.commit()?;
        if let Some(l) = &self.log {
            let _c = self.commit_lock.lock();
            self.check_live()?;
            let next = self.tx.running.lock().tid;
            let r = l.lock().close(&*self.dev, next);
            self.or_abort(r)?;
        }
        Ok(())
    }

    /// Whether transaction `tid` is durable. Blocks freed by a transaction must not
    /// be reused for data before then: a crash would leave the old owner pointing
    /// at the new owner's data.
    pub fn is_committed(&self, tid: u32) -> bool {
        let c = self.committed_tid.load(Ordering::Acquire);
        c != 0 && (c.wrapping_sub(tid) as i32) >= 0
    }

    /// Number of dirty buffers waiting for the next commit.
    pub fn pending(&self) -> usize {
        self.tx.running.lock().buffers.len()
    }

    pub fn stats(&self) -> JournalStats {
        JournalStats {
            commits: self.commits.load(Ordering::Relaxed),
            buffers_written: self.buffers_written.load(Ordering::Relaxed),
            handles: self.handles.load(Ordering::Relaxed),
            log_blocks: self.log_blocks.load(Ordering::Relaxed),
            checkpoints: self.checkpoints.load(Ordering::Relaxed),
            revokes: self.revoke_count.load(Ordering::Relaxed),
            fc_commits: self.fc_commits.load(Ordering::Relaxed),
            fc_blocks: self.fc_blocks.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commitfs_device::{BlockDevice, MemDevice};

    #[test]
    fn commit_writes_dirty_buffers_home_once() {
        let dev = Arc::new(MemDevice::new(64 * 1024));
        let j = Journal::new(dev.clone(), 1024, false);
        let h = j.start(4).unwrap();
        let b = j.bread(5).unwrap();
        j.get_write_access(&h, &b).unwrap();
        b.data_mut()[0] = 0xAB;
        j.dirty_metadata(&h, &b);
        let n = j.getblk_zeroed(9).unwrap();
        j.get_write_access(&h, &n).unwrap();
        n.data_mut()[1] = 0xCD;
        j.dirty_metadata(&h, &n);
        j.forget(&h, 9);
        j.stop(h).unwrap();
        let before = dev.stats().snapshot();
        assert_eq!(j.commit().unwrap(), 1);
        let d = dev.stats().snapshot().since(&before);
        assert_eq!(d.metadata.writes, 1);
        assert_eq!(d.flushes, 1);
        let img = dev.contents();
        assert_eq!(img[5 * 1024], 0xAB);
        assert_eq!(img[9 * 1024 + 1], 0, "forgotten buffer must not be written");
        assert_eq!(j.commit().unwrap(), 0);
    }

    #[test]
    fn read_only_journal_refuses_handles() {
        let dev = Arc::new(MemDevice::new(8192));
        let j = Journal::new(dev, 1024, true);
        assert!(matches!(j.start(1), Err(JournalError::ReadOnly)));
        assert!(j.bread(100).is_err());
    }
}

#[cfg(test)]
mod log_tests {
    use super::*;
    use commitfs_device::{BlockDevice, MemDevice};
    use commitfs_format::bytes::put_be32;
    use commitfs_format::jbd2;

    const BS: usize = 1024;
    const JSTART: u64 = 200;
    const JLEN: u32 = 64;

    fn fresh_device() -> Arc<MemDevice> {
        let dev = Arc::new(MemDevice::new(400 * BS));
        let mut sb = vec![0u8; BS];
        put_be32(&mut sb, jbd2::H_MAGIC, jbd2::JBD2_MAGIC);
        put_be32(&mut sb, jbd2::H_BLOCKTYPE, jbd2::BLOCKTYPE_SUPERBLOCK_V2);
        put_be32(&mut sb, jbd2::S_BLOCKSIZE, BS as u32);
        put_be32(&mut sb, jbd2::S_MAXLEN, JLEN);
        put_be32(&mut sb, jbd2::S_FIRST, 1);
        put_be32(&mut sb, jbd2::S_SEQUENCE, 1);
        put_be32(&mut sb, jbd2::S_NR_USERS, 1);
        sb[jbd2::S_UUID..jbd2::S_UUID + 16].copy_from_slice(&[7u8; 16]);
        dev.write_at(JSTART * BS as u64, &sb, IoCategory::Journal, false)
            .unwrap();
        dev
    }

    fn opts() -> LogOptions {
        LogOptions {
            bit64: true,
            csum: true,
            fast_commit: false,
            use_fast_commit: false,
        }
    }

    fn write_tx(j: &Journal, blocks: &[(u64, u8)]) {
        let h = j.start(blocks.len() as u32).unwrap();
        for &(b, v) in blocks {
            let buf = j.bread(b).unwrap();
            j.get_write_access(&h, &buf).unwrap();
            buf.data_mut().fill(v);
            j.dirty_metadata(&h, &buf);
        }
        j.stop(h).unwrap();
    }

    fn home(dev: &MemDevice, b: u64) -> u8 {
        dev.contents()[b as usize * BS]
    }

    #[test]
    fn committed_transactions_survive_a_crash_and_uncommitted_do_not() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
        let mut model = std::collections::HashMap::new();
        let mut snapshots = Vec::new();
        for t in 0..40u8 {
            let blocks: Vec<(u64, u8)> = (0..(1 + t as u64 % 7))
                .map(|i| (10 + (t as u64 * 3 + i * 5) % 60, t + 1))
                .collect();
            write_tx(&j, &blocks);
            // A magic-looking block exercises escaping.
            if t == 5 {
                let h = j.start(1).unwrap();
                let b = j.bread(90).unwrap();
                j.get_write_access(&h, &b).unwrap();
                put_be32(&mut b.data_mut()[..], 0, jbd2::JBD2_MAGIC);
                j.dirty_metadata(&h, &b);
                j.stop(h).unwrap();
            }
            let before = dev.stats().snapshot();
            let cps = j.stats().checkpoints;
            j.commit().unwrap();
            let d = dev.stats().snapshot().since(&before);
            let checkpointed = j.stats().checkpoints - cps;
            // One FUA commit block, plus the superblock update of a checkpoint.
            assert_eq!(d.journal.fua_writes, 1 + checkpointed, "tx {t}");
            assert!(d.flushes >= 1);
            for &(b, v) in &blocks {
                model.insert(b, v);
            }
            snapshots.push((dev.contents(), model.clone()));
        }
        assert!(
            j.stats().checkpoints > 0,
            "a 64-block log must have wrapped"
        );
        // Recover every post-commit snapshot: exactly the committed state.
        for (img, m) in &snapshots {
            let d2 = MemDevice::from_vec(img.clone());
            let r = recover(&d2, &map, BS, false).unwrap();
            for (&b, &v) in m {
                assert_eq!(home(&d2, b), v, "block {b} after recovery {r:?}");
            }
            // Idempotent: a second recovery finds an empty log.
            assert!(!recover(&d2, &map, BS, false).unwrap().needed);
        }
        let last = &snapshots.last().unwrap().0;
        let d3 = MemDevice::from_vec(last.clone());
        recover(&d3, &map, BS, false).unwrap();
        assert_eq!(
            &d3.contents()[90 * BS..90 * BS + 4],
            &jbd2::JBD2_MAGIC.to_be_bytes()
        );
    }

    #[test]
    fn torn_commit_is_not_replayed_and_revokes_apply() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
        write_tx(&j, &[(20, 1), (21, 1)]);
        j.commit().unwrap();
        // Block 21 is freed (revoked) in the next transaction.
        let h = j.start(1).unwrap();
        j.forget(&h, 21);
        j.stop(h).unwrap();
        write_tx(&j, &[(22, 2)]);
        j.commit().unwrap();
        let good = dev.contents();
        write_tx(&j, &[(20, 3)]);
        j.commit().unwrap();
        // Destroy the last commit block: that transaction must not replay.
        let mut torn = dev.contents();
        let jsb = &good[JSTART as usize * BS..];
        let _ = jsb;
        // Find the commit block of tid 3 (the last commit) by scanning the log.
        let mut found = false;
        for jb in 1..JLEN as usize {
            let off = (JSTART as usize + jb) * BS;
            let blk = &torn[off..off + BS];
            if let Some((t, seq)) = commitfs_format::jbd2_log::parse_header(blk) {
                if t == jbd2::BLOCKTYPE_COMMIT && seq == j.tx.running.lock().tid - 1 {
                    torn[off + 0x40] ^= 0xFF;
                    found = true;
                }
            }
        }
        assert!(found);
        let d = MemDevice::from_vec(torn);
        let r = recover(&d, &map, BS, false).unwrap();
        assert!(r.stopped_at.is_some(), "{r:?}");
        assert_eq!(home(&d, 20), 1, "torn transaction must not be applied");
        assert_eq!(home(&d, 22), 2);
        assert_eq!(home(&d, 21), 0, "revoked block must not be replayed");
        assert!(r.blocks_revoked >= 1);
    }

    /// A block freed by the running transaction is still in use on disk until that
    /// transaction commits: a checkpoint in between (the log filled up) must write
    /// its committed version home before emptying the log, or a crash then leaves
    /// it with whatever was there before (found by the crash harness: a directory
    /// created, fsynced, removed, then a checkpoint; the crash state's directory
    /// block was stale file data).
    #[test]
    fn checkpoint_before_a_free_commits_still_writes_the_block_home() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
        write_tx(&j, &[(40, 7)]);
        j.commit().unwrap();
        assert_eq!(home(&dev, 40), 0, "only in the log so far");
        let h = j.start(1).unwrap();
        j.forget(&h, 40);
        j.stop(h).unwrap();
        j.checkpoint().unwrap();
        // Crash here: the free did not commit, so block 40 must hold version 7.
        let crash = MemDevice::from_vec(dev.contents());
        recover(&crash, &map, BS, false).unwrap();
        assert_eq!(home(&crash, 40), 7);
        // Once the free commits, later checkpoints leave the block alone (it may
        // hold new data by then).
        j.commit().unwrap();
        dev.write_at(40 * BS as u64, &[9u8; BS], IoCategory::Data, false)
            .unwrap();
        write_tx(&j, &[(41, 1)]);
        j.commit().unwrap();
        j.checkpoint().unwrap();
        assert_eq!(home(&dev, 40), 9, "a freed block was written back");
        let crash = MemDevice::from_vec(dev.contents());
        recover(&crash, &map, BS, false).unwrap();
        assert_eq!(home(&crash, 40), 9);
    }

    fn verify() -> RecoverOptions {
        RecoverOptions {
            verify_last: true,
            inode_size: 256,
        }
    }

    /// Single-flush commits: one flush, no FUA; recovery (verifying) accepts the
    /// last one only with all its data, earlier ones always; a conflicting
    /// overwrite is confirmed by a commit of the next transaction when no fast
    /// commit can be written.
    #[test]
    fn single_flush_commits_verify_the_last_transaction() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
        j.set_single_flush(true);
        assert!(j.tracks_data());
        let data = |b: u64, v: u8| {
            dev.write_at(b * BS as u64, &[v; BS], IoCategory::Data, false)
                .unwrap();
            j.note_data(b, 1);
        };
        // T1: block 20 plus data 100..102.
        write_tx(&j, &[(20, 1)]);
        data(100, 0xA1);
        data(101, 0xA2);
        let before = dev.stats().snapshot();
        j.commit().unwrap();
        let d = dev.stats().snapshot().since(&before);
        assert_eq!(d.flushes, 1, "{d:?}");
        assert_eq!(d.journal.fua_writes, 0, "{d:?}");
        let t1 = dev.contents();
        // Complete: replayed, with or without verification.
        let c = MemDevice::from_vec(t1.clone());
        assert_eq!(
            recover_with(&c, &map, BS, false, verify())
                .unwrap()
                .transactions,
            1
        );
        assert_eq!(home(&c, 20), 1);
        // A data block lost: dropped when verifying (not an error), replayed by
        // the default rules (which never see such a log: the incompat bit).
        let mut lost = t1.clone();
        lost[101 * BS] ^= 1;
        let c = MemDevice::from_vec(lost.clone());
        let r = recover_with(&c, &map, BS, false, verify()).unwrap();
        assert_eq!(r.transactions, 0, "{r:?}");
        assert!(r.stopped_at.is_some());
        assert_eq!(home(&c, 20), 0);
        let c = MemDevice::from_vec(lost);
        recover(&c, &map, BS, false).unwrap();
        assert_eq!(home(&c, 20), 1);
        // A logged metadata block lost: dropped too.
        let mut torn = t1.clone();
        let jb = (1..JLEN as usize)
            .map(|k| (JSTART as usize + k) * BS)
            .find(|&o| torn[o..o + BS].iter().all(|&x| x == 1))
            .expect("the logged copy of block 20");
        torn[jb] = 7;
        let c = MemDevice::from_vec(torn);
        assert_eq!(
            recover_with(&c, &map, BS, false, verify())
                .unwrap()
                .transactions,
            0
        );
        assert_eq!(home(&c, 20), 0);
        // T2 follows: T1 is no longer the last, its data is not checked.
        write_tx(&j, &[(21, 2)]);
        data(110, 0xB0);
        j.commit().unwrap();
        let mut t2 = dev.contents();
        t2[100 * BS] ^= 1;
        let c = MemDevice::from_vec(t2);
        assert_eq!(
            recover_with(&c, &map, BS, false, verify())
                .unwrap()
                .transactions,
            2
        );
        assert_eq!((home(&c, 20), home(&c, 21)), (1, 2));
        // Block 110 is guarded while T2 is the last commit; 111 is not.
        let h = j.start(1).unwrap();
        let t2_tid = h.tid().wrapping_sub(1);
        assert_eq!(j.data_conflict(&h, &[(109, 3)]), Some(t2_tid));
        assert_eq!(j.data_conflict(&h, &[(111, 5)]), None);
        drop(h);
        // No fast-commit area here: the confirmation is a commit (empty) of the
        // next transaction.
        let commits = j.stats().commits;
        assert!(!j.confirm_data(t2_tid, &|_, _, _| None).unwrap());
        assert_eq!(j.stats().commits, commits + 1);
        let h = j.start(1).unwrap();
        assert_eq!(j.data_conflict(&h, &[(109, 3)]), None);
        drop(h);
        // Overwritten after the confirmation: T2 still replays.
        dev.write_at(110 * BS as u64, &[0xEE; BS], IoCategory::Data, false)
            .unwrap();
        let c = MemDevice::from_vec(dev.contents());
        let r = recover_with(&c, &map, BS, false, verify()).unwrap();
        assert_eq!(r.transactions, 3, "{r:?}");
        assert_eq!(home(&c, 21), 2);
        // Freed data is not checksummed by the freeing commit.
        data(120, 0xC0);
        j.forget_data(120, 1);
        write_tx(&j, &[(22, 3)]);
        j.commit().unwrap();
        dev.write_at(120 * BS as u64, &[0x11; BS], IoCategory::Data, false)
            .unwrap();
        let c = MemDevice::from_vec(dev.contents());
        recover_with(&c, &map, BS, false, verify()).unwrap();
        assert_eq!(home(&c, 22), 3);
    }

    /// A failed log write aborts the journal: no later commit, checkpoint or
    /// close goes through even once the device works again, and the log on disk
    /// still recovers exactly the transactions committed before the failure.
    #[test]
    fn failed_log_write_aborts_and_keeps_the_log() {
        use commitfs_device::{Fault, FaultyDevice};
        let mem = fresh_device();
        let dev = Arc::new(FaultyDevice::new(mem.clone()));
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
        write_tx(&j, &[(30, 1)]);
        j.commit().unwrap();
        write_tx(&j, &[(31, 2)]);
        dev.inject(Fault::writes().category(IoCategory::Journal).once());
        assert!(matches!(j.commit(), Err(JournalError::Device(_))));
        assert!(j.is_aborted());
        let after = mem.stats().snapshot();
        // Healed (the fault was once): still nothing goes through.
        assert!(matches!(j.start(1), Err(JournalError::Aborted)));
        assert!(matches!(j.commit(), Err(JournalError::Aborted)));
        assert!(matches!(j.checkpoint(), Err(JournalError::Aborted)));
        assert!(matches!(j.close(), Err(JournalError::Aborted)));
        assert!(matches!(j.flush_device(), Err(JournalError::Aborted)));
        assert_eq!(mem.stats().snapshot(), after, "no I/O after the abort");
        let crash = MemDevice::from_vec(mem.contents());
        recover(&crash, &map, BS, false).unwrap();
        assert_eq!(home(&crash, 30), 1);
        assert_eq!(
            home(&crash, 31),
            0,
            "the failed transaction is not replayed"
        );
    }

    /// A failed checkpoint leaves the log tail where it was: recovery replays.
    #[test]
    fn failed_checkpoint_keeps_the_tail() {
        use commitfs_device::{Fault, FaultyDevice};
        let mem = fresh_device();
        let dev = Arc::new(FaultyDevice::new(mem.clone()));
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
        write_tx(&j, &[(40, 5), (41, 6)]);
        j.commit().unwrap();
        dev.inject(
            Fault::writes()
                .category(IoCategory::Metadata)
                .after(1)
                .once(),
        );
        assert!(j.checkpoint().is_err());
        assert!(j.is_aborted());
        let (jsb, _) = read_superblock(&*mem, &map, BS).unwrap();
        assert_ne!(jsb.start, 0, "the log is not marked empty");
        let crash = MemDevice::from_vec(mem.contents());
        recover(&crash, &map, BS, false).unwrap();
        assert_eq!((home(&crash, 40), home(&crash, 41)), (5, 6));
    }

    #[test]
    fn clean_close_leaves_empty_log_with_everything_home() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
        write_tx(&j, &[(30, 9)]);
        j.commit().unwrap();
        write_tx(&j, &[(31, 8)]);
        j.close().unwrap();
        assert_eq!(home(&dev, 30), 9);
        assert_eq!(home(&dev, 31), 8);
        let (jsb, _) = read_superblock(&*dev, &map, BS).unwrap();
        assert_eq!(jsb.start, 0);
        assert!(jsb.sequence > 2);
        assert!(!recover(&*dev, &map, BS, false).unwrap().needed);
    }
}
