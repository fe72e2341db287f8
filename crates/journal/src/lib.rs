//! The journal layer: metadata buffers, handles and transactions.
//!
//! Like the kernel's jbd2/ext4 split, this crate knows blocks, never files. The file
//! system changes metadata only through the handle protocol:
//!
//! ```text
//! let h = journal.start(credits)?;       // join the running transaction
//! let b = journal.bread(blocknr)?;       // cached metadata buffer
//! journal.get_write_access(&h, &b)?;     // declare intent
//! b.data_mut()[..] = ...;                // modify the live version
//! journal.dirty_metadata(&h, &b);        // the transaction now owns the change
//! journal.stop(h)?;
//! ```
//!
//! A [`Buffer`] is the one home of "several versions of a metadata block"
//! (DEVELOPERS.md, docs/ARCHITECTURE.md "Design: concurrent journaling"): the
//! live version in `data`, one frozen copy per committing transaction and the
//! last committed version in `vers` ([`Versions`]). CJFS shadow pages are those
//! frozen copies; exF2FS isolation and FJS subblock masks extend the same record.
//!
//! With an on-disk log the journal commits in a pipeline (CJFS §4, `pipeline.rs`):
//! a commit thread writes each transaction's log blocks, a flush thread makes them
//! durable and writes commit blocks, several transactions are in flight at once,
//! and one flush serves every commit (and fsync) waiting on it. Without a log
//! (write-home mode: images without a journal) a commit writes every dirty buffer
//! home and flushes, synchronously.

mod data;
mod fc_scan;
mod log;
mod pipeline;
mod recovery;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use commitfs_device::{BlockDevice, DeviceError, DeviceRef, IoCategory, IoStats};
use commitfs_format::FormatError;
use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use fc_scan::{
    commit_fast_commit_replay, data_range_crc, fc_area, finish_fast_commit_recovery,
    hold_log_for_fast_commits, read_fast_commits, read_fast_commits_with, FcArea,
};
pub use log::{FcFlush, JournalMap, LogOptions};

/// Buckets of [`Core`]'s eviction counters (`Journal::bread`).
const EVICTION_BUCKETS: u64 = 64;

/// What [`Journal::fast_commit_chained`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FcWritten {
    /// Nothing: a full commit took the transaction (and is durable).
    NotWritten,
    /// Written and durable.
    Durable,
    /// Written, its TAIL without FUA: durable once a flush numbered after this
    /// generation completes ([`Journal::wait_data`], [`Journal::flushed_since`]).
    Pending(u64),
}
pub use pipeline::{BadPipelineOption, PipelineOptions};
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

/// How the file system takes part in a full commit (ordered file data of a
/// page cache, docs/ARCHITECTURE.md "Design: the page cache and the commit
/// cut"). The journal knows blocks, never files: these calls are all it sees.
pub trait CommitHooks: Send + Sync {
    /// Called by the commit thread, without journal locks, when it is about to
    /// lock the running transaction `tid`: the hook must call `lock()` once,
    /// which locks it (`false`: it cannot be locked now; the commit is tried
    /// again later, and the hook must then not leave data of `tid` unwritten).
    fn cut(&self, tid: u32, lock: &mut dyn FnMut() -> bool) -> Result<()>;
    /// After the tid switch of `tid`, before its log blocks and data checksums:
    /// write the file data its cut collected (none: nothing to do).
    fn write_data(&self, tid: u32) -> Result<()>;
    /// At the tid switch of `tid` (journal locks held: no I/O, no waiting):
    /// the data blocks `(pblk, len)` its cuts mapped, for single-flush
    /// checksums. Reported here rather than at the cut, where a flush in
    /// between would count them durable before they are written.
    fn data_ranges(&self, tid: u32) -> Vec<(u64, u64)>;
}

/// `a <= b` in tid order (tids wrap; the kernel's `tid_geq`).
pub fn tid_le(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) >= 0
}

/// The versions of a metadata block besides the live one (CJFS §4.2
/// multi-version shadow pages). Invariant: `inflight` is in tid order and holds
/// at most one copy per transaction in flight.
#[derive(Default)]
pub(crate) struct Versions {
    /// The copy each committing transaction logs, oldest first. Handles of the
    /// running transaction keep changing the live version meanwhile.
    pub inflight: Vec<(u32, Arc<[u8]>)>,
    /// The newest durable version not yet written home (JBD2 mode). A checkpoint
    /// writes this, never the live version, which may hold uncommitted changes.
    pub committed: Option<Arc<[u8]>>,
    /// What the block's home location holds, once a fast commit read it
    /// ([`Core::replay_bases`]); `None`: not known. Only the journal writes
    /// the home copies of the blocks it caches, so this stays true until its
    /// next home write (checkpoint, [`Core::write_home`]), which replaces it.
    /// Saves a fast commit a device read per changed inode under the file
    /// system's lock; costs a block per inode-table block fast commits looked
    /// at while it stays cached.
    pub home: Option<Arc<[u8]>>,
    /// Home writes so far: a read that raced with one is not kept.
    pub home_gen: u64,
}

impl Versions {
    /// The home location was written with bytes not kept here: a kept copy
    /// is stale.
    pub fn home_unknown(&mut self) {
        self.home = None;
        self.home_gen = self.home_gen.wrapping_add(1);
    }

    /// The journal wrote `v` home. A kept copy follows it; none is started
    /// here (only blocks fast commits look at keep one: a checkpoint writes
    /// every committed block, and keeping each would double the cache).
    pub fn written_home(&mut self, v: &Arc<[u8]>) {
        if self.home.is_some() {
            self.home = Some(v.clone());
        }
        self.home_gen = self.home_gen.wrapping_add(1);
    }

    /// Transaction `tid` became durable: its copy is now the committed version
    /// (an older committed one is superseded; the log still holds it until the
    /// checkpoint, which writes only the newest).
    pub fn promote(&mut self, tid: u32) {
        if let Some(i) = self.inflight.iter().position(|v| v.0 == tid) {
            let (_, c) = self.inflight.remove(i);
            self.committed = Some(c);
        }
    }
}

/// One cached metadata block.
pub struct Buffer {
    blocknr: u64,
    data: RwLock<Box<[u8]>>,
    /// Modified by the running transaction since its last freeze.
    dirty: AtomicBool,
    /// Frozen and committed versions (a leaf lock: nothing else is taken while
    /// it is held).
    vers: Mutex<Versions>,
    /// Second-chance bit of the buffer cache: set by every cache hit, cleared
    /// by an eviction sweep that spares the buffer once.
    used: AtomicBool,
}

impl Buffer {
    fn new(blocknr: u64, data: Box<[u8]>) -> Buffer {
        Buffer {
            blocknr,
            data: RwLock::new(data),
            dirty: AtomicBool::new(false),
            vers: Mutex::new(Versions::default()),
            used: AtomicBool::new(false),
        }
    }
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
    /// Versions held for transactions in flight (stats and tests).
    pub fn versions_in_flight(&self) -> usize {
        self.vers.lock().inflight.len()
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
    core: Arc<Core>,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("tid", &self.tid)
            .field("credits", &self.credits)
            .finish()
    }
}

thread_local! {
    /// The journals (by `Core` address) this thread holds handles of, one entry
    /// per handle: a nested `start` joins the running transaction even while the
    /// commit thread has it locked — it is waiting for this very thread's outer
    /// handle (the kernel's `journal_current_handle`).
    static HELD: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Drop for Handle {
    fn drop(&mut self) {
        let key = Arc::as_ptr(&self.core) as usize;
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if let Some(i) = h.iter().rposition(|&k| k == key) {
                h.swap_remove(i);
            }
        });
        let mut q = self.core.txq.lock();
        q.running.handles = q.running.handles.saturating_sub(1);
        // Only a locked transaction's commit waits for the last handle (jbd2's
        // j_wait_updates). Waking every thread on `cv` (commit, flush,
        // batching waits) at each handle's end cost a single-threaded `cp -a`
        // through the mount two or three context switches per operation.
        if q.running.handles == 0 && q.running.locked {
            self.core.cv.notify_all();
        }
    }
}

impl Handle {
    pub fn tid(&self) -> u32 {
        self.tid
    }
    pub fn credits(&self) -> u32 {
        self.credits
    }
}

/// Transaction states. `Running → Locked` (handles drain; back to `Running` when
/// opportunistic coalescing gives up, CJFS §4.3) `→ Committing` (log blocks being
/// written) `→ Written` (commit block written, not known durable) `→ Committed →
/// Checkpointed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxState {
    Running,
    Locked,
    Committing,
    Written,
    Committed,
    Checkpointed,
}

pub(crate) struct Running {
    pub tid: u32,
    /// Dirty buffers owned by the running transaction, by block number (sorted so a
    /// commit writes in ascending order).
    pub buffers: BTreeMap<u64, Arc<Buffer>>,
    /// Blocks freed while their logged copies are still live (JBD2 revoke records).
    pub revokes: BTreeSet<u64>,
    pub handles: u32,
    /// T_LOCKED: the commit thread is draining handles and freezing buffers; no
    /// handle may start.
    pub locked: bool,
    /// Data blocks for single-flush commits (`fc_data_csum`, data.rs).
    pub data: data::DataTrack,
}

impl Running {
    fn is_empty(&self) -> bool {
        self.buffers.is_empty() && self.revokes.is_empty()
    }
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
    /// Fast commits whose TAIL went out without FUA, made durable by the next
    /// fast commit's flush (chained fast commits).
    pub fc_chained: u64,
    /// Device flushes the journal issued (commits, fast commits, data-only
    /// fsyncs, checkpoints).
    pub flushes: u64,
    /// Flushes of the flush thread that completed at least one full commit, and
    /// the commits they completed (commits per flush = the ratio; CJFS §4.4
    /// compound flush).
    pub commit_flushes: u64,
    pub commits_by_flush: u64,
    /// Most full commits completed by one flush.
    pub max_commits_per_flush: u64,
    /// Most transactions in flight (committing or written, not yet durable) at
    /// once, and the current number.
    pub max_inflight: u64,
    pub inflight: u64,
    /// Commits that found a buffer with `max_versions` copies in flight and let
    /// the running transaction go on taking handles instead (CJFS §4.3).
    pub lock_unlocks: u64,
    /// Waits for durability ([`Journal::commit`], [`Journal::wait_data`]) and
    /// their total time, ns.
    pub durability_waits: u64,
    pub durability_wait_ns: u64,
    /// Handles that joined committed transactions (coalescing degree: handles per
    /// commit).
    pub commit_handles: u64,
    /// Time from a commit's start to its durability, summed (average commit time
    /// for batching).
    pub commit_ns: u64,
    /// Where a full commit's time goes before that, summed over commits: the
    /// commit thread's batching wait, then locking the transaction (the file
    /// system's cut and its data writes, handles draining, freezing), then
    /// writing its log blocks (part of `commit_ns`).
    pub batch_ns: u64,
    pub lock_ns: u64,
    pub log_write_ns: u64,
    /// The device's average flush time, ns (moving average; 0: none yet).
    pub flush_avg_ns: u64,
}

/// Flush numbering: every flush the journal issues gets the next number when it
/// starts; `done` is the highest number completed. A write that completed while
/// `started == s` is durable once `done > s`.
#[derive(Default)]
pub(crate) struct FlushGens {
    started: AtomicU64,
    done: AtomicU64,
    /// `started` when the last file-data write completed ([`Journal::note_data_written`]).
    data: AtomicU64,
    /// Moving average of a device flush's duration (ns, weight 1/8; 0 until
    /// the first): the pipeline's waits for a successor are a fraction of it.
    flush_avg_ns: AtomicU64,
}

impl FlushGens {
    /// The average flush time, or `None` before the first flush.
    pub(crate) fn flush_avg(&self) -> Option<std::time::Duration> {
        match self.flush_avg_ns.load(Ordering::Relaxed) {
            0 => None,
            n => Some(std::time::Duration::from_nanos(n)),
        }
    }

    fn note_flush(&self, ns: u64) {
        let ns = ns.max(1);
        let old = self.flush_avg_ns.load(Ordering::Relaxed);
        let new = if old == 0 { ns } else { old - old / 8 + ns / 8 };
        self.flush_avg_ns.store(new.max(1), Ordering::Relaxed);
    }
}

/// The device as the journal sees it: every flush numbered ([`FlushGens`]).
struct GenDevice {
    inner: DeviceRef,
    gens: Arc<FlushGens>,
}

impl BlockDevice for GenDevice {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> commitfs_device::Result<()> {
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(
        &self,
        offset: u64,
        buf: &[u8],
        cat: IoCategory,
        fua: bool,
    ) -> commitfs_device::Result<()> {
        self.inner.write_at(offset, buf, cat, fua)
    }
    fn write_sectors(
        &self,
        offset: u64,
        buf: &[u8],
        cat: IoCategory,
    ) -> commitfs_device::Result<()> {
        self.inner.write_sectors(offset, buf, cat)
    }
    fn write_batch(
        &self,
        writes: &[(u64, &[&[u8]])],
        cat: IoCategory,
    ) -> commitfs_device::Result<()> {
        self.inner.write_batch(writes, cat)
    }
    fn flush(&self) -> commitfs_device::Result<()> {
        let n = self.gens.started.fetch_add(1, Ordering::AcqRel) + 1;
        let t0 = std::time::Instant::now();
        let r = self.inner.flush();
        if r.is_ok() {
            self.gens.note_flush(t0.elapsed().as_nanos() as u64);
            self.gens.done.fetch_max(n, Ordering::AcqRel);
        }
        r
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.inner.stats()
    }
}

/// A transaction in flight (after its tid switch, before it is durable).
pub(crate) struct InFlight {
    pub tid: u32,
    pub state: TxState,
    pub bufs: Vec<Arc<Buffer>>,
    pub revokes: BTreeSet<u64>,
    /// Two-flush commit block still to write, after a flush: (offset, bytes).
    pub commit: Option<(u64, Vec<u8>)>,
    /// Written as a single-flush commit with these data ranges.
    pub single_data: Option<data::RangeSet>,
    pub log_blocks: u64,
    pub handles: u64,
    /// When the commit thread picked it (commit time statistics).
    pub started: std::time::Instant,
}

/// The running transaction and the pipeline (CJFS §4.1): everything the commit
/// thread, the flush thread, fast-commit writers and waiters share. One mutex,
/// held only for bookkeeping, never across device I/O.
pub(crate) struct TxQueue {
    pub running: Running,
    /// Transactions in flight, in tid order.
    pub inflight: VecDeque<InFlight>,
    /// Highest tid an fsync or sync asked to commit (0: none).
    pub commit_req: u32,
    /// Commit this tid even if it is empty (confirming a single-flush commit).
    pub force: Option<u32>,
    /// A fast commit is being written: no full commit may lock the running
    /// transaction, no flush-thread flush may move data tracking.
    pub fc_ongoing: bool,
    /// The flush thread is flushing.
    pub flush_busy: bool,
    /// Flush generation after the last chained fast commit's TAIL was written
    /// without FUA (0: none): durable once a flush numbered after it completes.
    pub fc_pending: u64,
    /// Until then the flush thread holds back flush requests: the successor of
    /// a chained fast commit is expected to claim the slot, and its pre-tail
    /// flush serves both (`Core::fast_commit_chained`).
    pub fc_handoff: Option<std::time::Instant>,
    /// Holders that need the pipeline empty and still (checkpoint, close).
    pub hold: u32,
    /// Some waiter needs `FlushGens::done >= flush_req`.
    pub flush_req: u64,
    /// Handles started in the running transaction (coalescing degree).
    pub running_handles_total: u64,
    /// Commit requests since the commit thread last picked a transaction, and
    /// how many the last batch had (the batching target).
    pub requesters: u32,
    pub peak_requesters: u32,
    pub stop: bool,
}

/// Everything the journal's threads share.
pub struct Core {
    dev: DeviceRef,
    gens: Arc<FlushGens>,
    block_size: usize,
    blocks: u64,
    read_only: bool,
    cache: Mutex<HashMap<u64, Arc<Buffer>>>,
    txq: Mutex<TxQueue>,
    /// Every state change of `txq` (handles drained, a transaction written or
    /// durable, a flush done, a request) wakes every waiter.
    cv: Condvar,
    /// Write-home commits are serialised.
    commit_lock: Mutex<()>,
    aborted: AtomicBool,
    /// Buffers cached at most before clean, unheld ones are dropped.
    cache_limit: std::sync::atomic::AtomicUsize,
    /// Size at which the next drop is tried (when most buffers were dirty or
    /// held at the last one, not at every insertion).
    cache_next: std::sync::atomic::AtomicUsize,
    /// Per bucket of block numbers (`blocknr % EVICTION_BUCKETS`), bumped
    /// under the cache lock whenever a buffer of the bucket leaves the cache
    /// (a sweep, `forget`): a device read of a block of the bucket that
    /// started before cannot be inserted, the block may have been changed,
    /// written home and dropped meanwhile ([`Self::bread`] runs without the
    /// file system's lock). Per bucket, so evictions elsewhere do not make
    /// a read start again.
    evictions: Box<[AtomicU64]>,
    /// The on-disk JBD2 log; `None` = write-home mode (no journal on the image).
    log: Option<Mutex<log::LogState>>,
    /// `LogState::checkpoint_list`: asked by [`Core::forget`] without the log lock.
    logged: Option<log::CheckpointList>,
    /// The fast-commit area's size and the log's checksum version, fixed at
    /// open: read under the file system's lock, so not behind the log lock.
    fc_capacity: u32,
    csum_v3: bool,
    /// A quarter of the log (blocks): a running transaction this large commits.
    max_tx_blocks: AtomicU64,
    opts: PipelineOptions,
    /// Highest tid whose commit is durable (0: none yet).
    committed_tid: AtomicU32,
    /// A block written home after every full commit (`u64::MAX`: none); see
    /// [`Core::keep_home`].
    keep_home: AtomicU64,
    /// That block was written home and no fast commit has flushed since.
    home_unflushed: AtomicBool,
    stats: Mutex<JournalStats>,
    /// The device error that aborted the journal in a pipeline thread, given to
    /// the callers that were waiting for that commit.
    failure: Mutex<Option<IoFailure>>,
    /// The file system's part in full commits ([`CommitHooks`]); weak: the
    /// hooks reach the journal themselves, and the file system owns them.
    hooks: Mutex<Option<std::sync::Weak<dyn CommitHooks>>>,
}

/// A device I/O error kept for later callers: offset, length, kind, errno.
type IoFailure = (u64, usize, std::io::ErrorKind, Option<i32>);

/// Buffer cache plus transaction manager: a handle on [`Core`] that owns the
/// commit and flush threads (joined on drop).
pub struct Journal {
    core: Arc<Core>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl std::ops::Deref for Journal {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.core.txq.lock().stop = true;
        self.core.cv.notify_all();
        let me = std::thread::current().id();
        for t in self.threads.lock().drain(..) {
            // The last reference may go on one of its own threads (through
            // the file system's hooks): that thread stops by itself.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

/// Safety net against a lost wakeup on abort (set without the queue lock).
const WAIT_SLICE: Duration = Duration::from_millis(50);

impl Journal {
    /// A journal in write-home mode: commits write buffers to their homes (for
    /// images without a journal, and read-only mounts).
    pub fn new(dev: DeviceRef, block_size: usize, read_only: bool) -> Journal {
        Journal {
            core: Arc::new(Core::new(dev, block_size, read_only, Default::default())),
            threads: Mutex::new(Vec::new()),
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
        Self::open_log_with(dev, block_size, map, opts, PipelineOptions::default())
    }

    /// [`Self::open_log`] with pipeline settings (transactions in flight,
    /// versions per buffer, batching).
    pub fn open_log_with(
        dev: DeviceRef,
        block_size: usize,
        map: JournalMap,
        opts: LogOptions,
        popts: PipelineOptions,
    ) -> Result<Journal> {
        let gens = Arc::new(FlushGens::default());
        let gdev: DeviceRef = Arc::new(GenDevice {
            inner: dev,
            gens: gens.clone(),
        });
        let state = log::LogState::open(&*gdev, block_size, map, opts)?;
        let mut core = Core::new_with_gens(gdev, gens, block_size, false, popts);
        core.txq.get_mut().running.tid = state.next_tid();
        core.max_tx_blocks = AtomicU64::new(state.max_transaction_blocks());
        core.logged = Some(state.checkpoint_list());
        core.fc_capacity = state.fc_capacity();
        core.csum_v3 = state.csum_v3();
        core.log = Some(Mutex::new(state));
        let core = Arc::new(core);
        let threads = pipeline::spawn(&core)?;
        Ok(Journal {
            core,
            threads: Mutex::new(threads),
        })
    }
}

impl Journal {
    /// Start a handle in the running transaction (waits while the commit thread
    /// has it locked: draining handles and freezing buffers).
    pub fn start(&self, credits: u32) -> Result<Handle> {
        self.core.start_handle(credits)
    }
}

impl Core {
    fn new(dev: DeviceRef, block_size: usize, read_only: bool, opts: PipelineOptions) -> Core {
        let gens = Arc::new(FlushGens::default());
        let gdev: DeviceRef = Arc::new(GenDevice {
            inner: dev,
            gens: gens.clone(),
        });
        Core::new_with_gens(gdev, gens, block_size, read_only, opts)
    }

    fn new_with_gens(
        dev: DeviceRef,
        gens: Arc<FlushGens>,
        block_size: usize,
        read_only: bool,
        opts: PipelineOptions,
    ) -> Core {
        let blocks = dev.size() / block_size as u64;
        Core {
            dev,
            gens,
            block_size,
            blocks,
            read_only,
            cache: Mutex::new(HashMap::new()),
            txq: Mutex::new(TxQueue {
                running: Running {
                    tid: 1,
                    buffers: BTreeMap::new(),
                    revokes: BTreeSet::new(),
                    handles: 0,
                    locked: false,
                    data: Default::default(),
                },
                inflight: VecDeque::new(),
                commit_req: 0,
                force: None,
                fc_ongoing: false,
                flush_busy: false,
                fc_pending: 0,
                fc_handoff: None,
                hold: 0,
                flush_req: 0,
                running_handles_total: 0,
                requesters: 0,
                peak_requesters: 0,
                stop: false,
            }),
            cv: Condvar::new(),
            commit_lock: Mutex::new(()),
            aborted: AtomicBool::new(false),
            cache_limit: std::sync::atomic::AtomicUsize::new(1 << 18),
            cache_next: std::sync::atomic::AtomicUsize::new(0),
            evictions: (0..EVICTION_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            log: None,
            logged: None,
            fc_capacity: 0,
            csum_v3: false,
            max_tx_blocks: AtomicU64::new(16384),
            opts,
            committed_tid: AtomicU32::new(0),
            keep_home: AtomicU64::new(u64::MAX),
            home_unflushed: AtomicBool::new(false),
            stats: Mutex::new(JournalStats::default()),
            failure: Mutex::new(None),
            hooks: Mutex::new(None),
        }
    }

    /// Metadata buffers cached now (`commitfs stats`).
    pub fn cached_buffers(&self) -> usize {
        self.cache.lock().len()
    }

    /// Bound the journal's metadata memory to about `buffers` blocks (at
    /// least 1,024; docs/ARCHITECTURE.md "Memory"): the cache holds at most
    /// 2/3 of it (past that, clean buffers nobody holds are dropped, those not
    /// used since the last sweep first), committed buffers waiting for a
    /// checkpoint (each also holds its committed copy) at most 1/3, and a
    /// running transaction is committed at 1/6 (its frozen copies).
    pub fn set_cache_limit(&self, buffers: usize) {
        let b = buffers.max(1024);
        self.cache_limit.store(b * 2 / 3, Ordering::Relaxed);
        let _ = self
            .max_tx_blocks
            .fetch_min((b / 6).max(256) as u64, Ordering::Relaxed);
    }

    /// Test seam: a cache of at most `buffers` clean buffers, below
    /// [`Self::set_cache_limit`]'s floor (tests of what an operation reads
    /// when its blocks come and go).
    #[doc(hidden)]
    pub fn set_cache_limit_exact(&self, buffers: usize) {
        self.cache_limit.store(buffers.max(1), Ordering::Relaxed);
    }

    /// Blocks a running transaction may log before it is committed (a quarter
    /// of the log, and a share of the memory bound).
    pub fn max_transaction_blocks(&self) -> u64 {
        self.max_tx_blocks.load(Ordering::Relaxed)
    }

    /// Register the file system's [`CommitHooks`] (replacing any earlier).
    /// The journal keeps a weak reference: the caller owns them.
    pub fn set_hooks(&self, hooks: Option<&Arc<dyn CommitHooks>>) {
        *self.hooks.lock() = hooks.map(Arc::downgrade);
    }

    pub(crate) fn hooks(&self) -> Option<Arc<dyn CommitHooks>> {
        self.hooks.lock().as_ref().and_then(|w| w.upgrade())
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
    /// aborted it (false: it already was). Wakes every waiter.
    pub fn abort(&self) -> bool {
        let first = !self.aborted.swap(true, Ordering::AcqRel);
        self.cv.notify_all();
        first
    }

    /// Flush the device for an fsync that has nothing to log (its data only). A
    /// failure aborts the journal: the cache may have lost data and committed
    /// blocks alike, and a later flush that succeeds proves nothing about them.
    pub fn flush_device(&self) -> Result<()> {
        self.check_live()?;
        let r = self.dev.flush().map_err(Into::into);
        self.count_flush();
        self.or_abort(r)
    }

    fn count_flush(&self) {
        self.stats.lock().flushes += 1;
    }

    /// A pipeline thread failed with `e`: abort, and keep the cause for waiters.
    fn pipeline_failed(&self, e: &JournalError) {
        if let JournalError::Device(DeviceError::Io {
            offset,
            len,
            source,
        }) = e
        {
            self.failure.lock().get_or_insert((
                *offset,
                *len,
                source.kind(),
                source.raw_os_error(),
            ));
        }
        if self.abort() {
            tracing::error!("journal aborted: {e}");
        }
    }

    /// The error for a caller whose commit the abort interrupted: the device
    /// error when a pipeline thread hit one.
    fn wait_error(&self) -> JournalError {
        match *self.failure.lock() {
            Some((offset, len, kind, raw)) => JournalError::Device(DeviceError::Io {
                offset,
                len,
                source: match raw {
                    Some(c) => std::io::Error::from_raw_os_error(c),
                    None => std::io::Error::from(kind),
                },
            }),
            None => JournalError::Aborted,
        }
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
        self.pending() as u64 >= self.max_tx_blocks.load(Ordering::Relaxed)
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

    /// The cached buffer of `blocknr`, without reading the device (`None`: not
    /// cached). Marks it used, as [`Self::bread`] does.
    pub fn bread_cached(&self, blocknr: u64) -> Option<Arc<Buffer>> {
        let b = self.cache.lock().get(&blocknr).cloned()?;
        if !b.used.load(Ordering::Relaxed) {
            b.used.store(true, Ordering::Relaxed);
        }
        Some(b)
    }

    /// Read a metadata block through the cache. Callers need not hold any
    /// lock: a read that raced with an eviction (or `forget`) of the block is
    /// not inserted but made again, since the evicted copy may have been newer
    /// than what the device returned to this read.
    pub fn bread(&self, blocknr: u64) -> Result<Arc<Buffer>> {
        self.bread_noting(blocknr, None)
    }

    /// [`Self::bread`], adding 1 to `reads` for each device read it makes
    /// (the file system counts the reads it makes under its lock).
    pub fn bread_noting(
        &self,
        blocknr: u64,
        reads: Option<&std::sync::atomic::AtomicU64>,
    ) -> Result<Arc<Buffer>> {
        loop {
            if let Some(b) = self.bread_cached(blocknr) {
                return Ok(b);
            }
            if blocknr >= self.blocks {
                return Err(JournalError::OutOfRange(blocknr));
            }
            let bucket = &self.evictions[(blocknr % EVICTION_BUCKETS) as usize];
            let epoch = bucket.load(Ordering::Acquire);
            let mut data = vec![0u8; self.block_size].into_boxed_slice();
            if let Some(r) = reads {
                r.fetch_add(1, Ordering::Relaxed);
            }
            self.dev.read_at(
                blocknr * self.block_size as u64,
                &mut data,
                IoCategory::Metadata,
            )?;
            let mut cache = self.cache.lock();
            if let Some(b) = cache.get(&blocknr) {
                return Ok(b.clone());
            }
            if bucket.load(Ordering::Acquire) != epoch {
                continue;
            }
            let lim = self.cache_limit.load(Ordering::Relaxed);
            if cache.len() >= lim.max(self.cache_next.load(Ordering::Relaxed)) {
                let evicted = |b: &Buffer| {
                    self.evictions[(b.blocknr % EVICTION_BUCKETS) as usize]
                        .fetch_add(1, Ordering::AcqRel);
                };
                // Drop clean buffers nobody holds and nobody used since the last
                // sweep (second chance); if that is not enough, every clean
                // unheld one. Dirty ones stay until written home.
                cache.retain(|_, b| {
                    let keep = b.is_dirty()
                        || Arc::strong_count(b) > 1
                        || b.used.swap(false, Ordering::Relaxed);
                    if !keep {
                        evicted(b);
                    }
                    keep
                });
                let mut excess = cache.len().saturating_sub(lim);
                if excess > 0 {
                    cache.retain(|_, b| {
                        if excess == 0 || b.is_dirty() || Arc::strong_count(b) > 1 {
                            return true;
                        }
                        excess -= 1;
                        evicted(b);
                        false
                    });
                }
                self.cache_next
                    .store(cache.len() + lim / 8, Ordering::Relaxed);
            }
            let b = cache
                .entry(blocknr)
                .or_insert_with(|| Arc::new(Buffer::new(blocknr, data)))
                .clone();
            return Ok(b);
        }
    }

    /// Whether recovery after a crash now would rewrite block `blocknr` from the log:
    /// a committed version of it is not home yet. (e2fsck 1.47 replays fast
    /// commits over inode-table blocks it cached before journal recovery; see
    /// `FcReason::JournalInodeBlock` in commitfs-fs.)
    pub fn home_is_stale(&self, blocknr: u64) -> bool {
        let b = self.cache.lock().get(&blocknr).cloned();
        b.is_some_and(|b| b.vers.lock().committed.is_some())
    }

    /// Write the committed version of block `blocknr` home now, if it is not home
    /// yet (no flush: the next `Ordered` fast commit flushes before its log block).
    /// Later checkpoints skip it. Safe at any time: recovery would write that very
    /// version (or a newer one). Returns whether a write was made.
    pub fn write_home(&self, blocknr: u64) -> Result<bool> {
        let Some(b) = self.cache.lock().get(&blocknr).cloned() else {
            return Ok(false);
        };
        // Taken out under the buffer's lock, written without it: a commit
        // publishing a newer version meanwhile keeps that newer one.
        let Some(v) = b.vers.lock().committed.clone() else {
            return Ok(false);
        };
        self.dev.write_at(
            blocknr * self.block_size as u64,
            &v,
            IoCategory::Metadata,
            false,
        )?;
        // Before the block stops looking stale to `home_is_stale`.
        self.home_unflushed.store(true, Ordering::Release);
        let mut vers = b.vers.lock();
        vers.written_home(&v);
        if vers.committed.as_ref().is_some_and(|c| Arc::ptr_eq(c, &v)) {
            vers.committed = None;
        }
        Ok(true)
    }

    /// The versions of a metadata block that recovery could start from after a
    /// crash now: the last committed version (if not yet home) and the home copy
    /// (if the live version differs from it). Fast commits use this to tell which
    /// bytes replay would leave as they are.
    ///
    /// The home copy is read from the device once and then kept with the
    /// buffer's versions ([`Versions::home`]) until the journal writes the
    /// block home again. For blocks only the journal writes home (inode
    /// tables: never freed, never file data).
    pub fn replay_bases(&self, blocknr: u64) -> Result<Vec<Arc<[u8]>>> {
        let b = self.bread(blocknr)?;
        let mut out = Vec::with_capacity(2);
        if let Some(c) = b.vers.lock().committed.clone() {
            out.push(c);
        }
        if b.is_dirty() || b.versions_in_flight() > 0 {
            out.push(self.kept_home(&b)?);
        } else {
            out.push(Arc::from(&b.data()[..]));
        }
        Ok(out)
    }

    /// Buffer `b`'s kept home copy (`Versions::home`), read from the device
    /// and kept if there is none (a read that raced with a home write is
    /// returned but not kept: `home_gen`).
    fn kept_home(&self, b: &Buffer) -> Result<Arc<[u8]>> {
        let gen = {
            let v = b.vers.lock();
            if let Some(h) = &v.home {
                return Ok(h.clone());
            }
            v.home_gen
        };
        let mut home = vec![0u8; self.block_size];
        self.dev.read_at(
            b.blocknr * self.block_size as u64,
            &mut home,
            IoCategory::Metadata,
        )?;
        let home: Arc<[u8]> = Arc::from(home);
        let mut v = b.vers.lock();
        if v.home_gen == gen && v.home.is_none() {
            v.home = Some(home.clone());
        }
        Ok(home)
    }

    /// Read the home copy of cached block `blocknr` now and keep it for a
    /// later [`Self::replay_bases`] (`Versions::home`), which then needs no
    /// device read. Called without the file system's lock, so the fast
    /// commit planned under it does not read there. Nothing happens for a
    /// block not cached, not changed since it was home, or with a copy kept.
    pub fn warm_home(&self, blocknr: u64) -> Result<()> {
        let Some(b) = self.cache.lock().get(&blocknr).cloned() else {
            return Ok(());
        };
        // Unchanged since home: `replay_bases` takes the live version then.
        if b.is_dirty() || b.versions_in_flight() > 0 {
            self.kept_home(&b)?;
        }
        Ok(())
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
                Arc::new(Buffer::new(
                    blocknr,
                    vec![0u8; self.block_size].into_boxed_slice(),
                ))
            })
            .clone();
        drop(cache);
        b.data.write().fill(0);
        Ok(b)
    }

    fn start_handle(self: &Arc<Self>, credits: u32) -> Result<Handle> {
        if self.read_only {
            return Err(JournalError::ReadOnly);
        }
        let key = Arc::as_ptr(self) as usize;
        let nested = HELD.with(|h| h.borrow().contains(&key));
        let mut q = self.txq.lock();
        loop {
            self.check_live()?;
            if !q.running.locked || nested {
                break;
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
        // A running transaction past its size bound is committed now, by the
        // commit thread, whatever operation grew it (jbd2 starts a commit in
        // `add_transaction_credits` when a handle would take the running
        // transaction past `j_max_transaction_buffers`): it holds a frozen
        // copy of every buffer it logged, so its size is memory.
        if !nested
            && self.log.is_some()
            && q.running.buffers.len() as u64 >= self.max_tx_blocks.load(Ordering::Relaxed)
        {
            let t = q.running.tid;
            if q.commit_req == 0 || !tid_le(t, q.commit_req) {
                q.commit_req = t;
                self.cv.notify_all();
            }
        }
        q.running.handles += 1;
        HELD.with(|h| h.borrow_mut().push(key));
        q.running_handles_total += 1;
        let tid = q.running.tid;
        drop(q);
        self.stats.lock().handles += 1;
        Ok(Handle {
            tid,
            credits,
            core: self.clone(),
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
        let mut q = self.txq.lock();
        // A block journaled again after being revoked: its new copy must replay.
        q.running.revokes.remove(&b.blocknr);
        q.running.buffers.insert(b.blocknr, b.clone());
    }

    /// A metadata block was freed: its pending change must never reach the device,
    /// and a later reuse as a data block must not see a stale cached copy.
    pub fn forget(&self, _h: &Handle, blocknr: u64) {
        self.txq.lock().running.buffers.remove(&blocknr);
        let cached = {
            let mut cache = self.cache.lock();
            // Under the cache lock, cached or not: a read of the block in
            // progress must not insert its pre-free content.
            self.evictions[(blocknr % EVICTION_BUCKETS) as usize].fetch_add(1, Ordering::AcqRel);
            cache.remove(&blocknr)
        };
        // A copy in the log (committing or committed, not checkpointed) must
        // never be replayed over the block's next use: revoke it.
        let mut logged = false;
        if let Some(b) = &cached {
            // Its committed version (if any) stays: until this free commits, a
            // checkpoint must still write it home (log.rs `committed`).
            b.dirty.store(false, Ordering::Release);
            let v = b.vers.lock();
            logged = !v.inflight.is_empty() || v.committed.is_some();
        }
        if let Some(l) = &self.logged {
            logged |= l.lock().contains_key(&blocknr);
            if logged {
                self.txq.lock().running.revokes.insert(blocknr);
            }
        }
    }

    pub fn stop(&self, h: Handle) -> Result<()> {
        drop(h);
        Ok(())
    }

    /// Make everything done so far durable: commit the running transaction (if it
    /// changed anything) and wait until it and every earlier one are durable, and
    /// until every file-data write reported before the call is flushed. Concurrent
    /// callers share commits and flushes (group commit). Returns the number of
    /// buffers the running transaction held.
    pub fn commit(&self) -> Result<usize> {
        if self.log.is_none() || self.read_only {
            return self.commit_home();
        }
        let tid = self.running_tid();
        self.commit_upto(tid, Some(self.data_gen()))
    }

    /// [`Self::commit`], even when the running transaction is empty: the file
    /// system's [`CommitHooks`] may have something to put into it (cached data
    /// a cut maps). Waits until it is durable.
    pub fn commit_forced(&self) -> Result<()> {
        if self.log.is_none() || self.read_only {
            return self.commit_home().map(|_| ());
        }
        self.check_live()?;
        let tid = {
            let mut q = self.txq.lock();
            // One being locked now had its hooks' cut before this call: the
            // next one is the one to commit.
            while q.running.locked {
                self.check_live()?;
                self.cv.wait_for(&mut q, WAIT_SLICE);
            }
            let t = q.running.tid;
            q.force = Some(t);
            if q.commit_req == 0 || !tid_le(t, q.commit_req) {
                q.commit_req = t;
            }
            q.requesters += 1;
            self.cv.notify_all();
            t
        };
        self.wait_committed(tid)?;
        self.wait_data(self.data_gen())
    }

    /// Group commit for one caller (an fsync): make transaction `tid` and every
    /// earlier one durable — when `tid` is still running, commit it (if it
    /// changed anything) — and, with `data_gen`, wait for a flush that started
    /// after that flush generation (the caller's file data). Concurrent callers
    /// share commits and flushes. Returns the number of buffers the running
    /// transaction held when it was asked for.
    pub fn commit_upto(&self, tid: u32, data_gen: Option<u64>) -> Result<usize> {
        self.commit_upto_with(tid, data_gen, false)
    }

    /// [`Self::commit_upto`] that commits `tid` even if it is empty, when it is
    /// still running: the file system's [`CommitHooks`] may have something to
    /// put into it (cached data its cut maps).
    pub fn commit_upto_forced(&self, tid: u32, data_gen: Option<u64>) -> Result<usize> {
        self.commit_upto_with(tid, data_gen, true)
    }

    fn commit_upto_with(&self, tid: u32, data_gen: Option<u64>, force: bool) -> Result<usize> {
        if self.log.is_none() || self.read_only {
            return self.commit_home();
        }
        self.check_live()?;
        let t0 = std::time::Instant::now();
        let (target, n) = {
            let mut q = self.txq.lock();
            if !tid_le(q.running.tid, tid) {
                // Switched already: in flight or durable.
                (Some(tid), 0)
            } else if q.running.locked {
                // Being frozen by the commit thread right now: not in flight yet.
                (Some(q.running.tid), 0)
            } else if !q.running.is_empty() || force {
                let t = q.running.tid;
                if force && q.running.is_empty() {
                    q.force = Some(t);
                }
                if q.commit_req == 0 || !tid_le(t, q.commit_req) {
                    q.commit_req = t;
                }
                q.requesters += 1;
                self.cv.notify_all();
                (Some(t), q.running.buffers.len())
            } else {
                (q.inflight.back().map(|t| t.tid), 0)
            }
        };
        if let Some(t) = target {
            self.wait_committed(t)?;
        }
        if let Some(g) = data_gen {
            self.wait_data(g)?;
        }
        let mut s = self.stats.lock();
        s.durability_waits += 1;
        s.durability_wait_ns += t0.elapsed().as_nanos() as u64;
        Ok(n)
    }

    /// The number of flushes started so far: a data write that completes now is
    /// durable once [`Self::flushed_since`] this value.
    pub fn flush_gen(&self) -> u64 {
        self.gens.started.load(Ordering::Acquire)
    }

    /// Ask for the running transaction to be committed without waiting (like
    /// `jbd2_log_start_commit`). Returns its tid, or `None` when it is empty.
    pub fn start_commit(&self) -> Option<u32> {
        if self.log.is_none() || self.read_only {
            return None;
        }
        let mut q = self.txq.lock();
        if q.running.is_empty() {
            return None;
        }
        let t = q.running.tid;
        if q.commit_req == 0 || !tid_le(t, q.commit_req) {
            q.commit_req = t;
        }
        self.cv.notify_all();
        Some(t)
    }

    /// Wait until transaction `tid` (and every earlier one) is durable.
    pub fn wait_committed(&self, tid: u32) -> Result<()> {
        let mut q = self.txq.lock();
        loop {
            if self.is_committed(tid) {
                return Ok(());
            }
            if self.is_aborted() {
                return Err(self.wait_error());
            }
            if q.running.tid == tid && !q.running.locked && q.running.is_empty() {
                // Nothing was ever logged in it (a forced empty commit is
                // requested through `force`).
                if q.force != Some(tid) {
                    return Ok(());
                }
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
    }

    /// The flush generation of the last file-data write ([`Self::note_data_written`]).
    pub fn data_gen(&self) -> u64 {
        self.gens.data.load(Ordering::Acquire)
    }

    /// A file-data write (to its home blocks) completed: the next fsync must see a
    /// flush that started after it.
    pub fn note_data_written(&self) {
        let s = self.gens.started.load(Ordering::Acquire);
        self.gens.data.fetch_max(s, Ordering::AcqRel);
    }

    /// Whether a flush that started after generation `g` has completed.
    pub fn flushed_since(&self, g: u64) -> bool {
        self.gens.done.load(Ordering::Acquire) > g
    }

    /// Whether file data written so far may still be only in the device cache.
    pub fn data_unflushed(&self) -> bool {
        !self.flushed_since(self.data_gen())
    }

    /// Wait until a flush that started after generation `g` has completed (group
    /// flush: every data-only fsync waiting rides on the same flush).
    pub fn wait_data(&self, g: u64) -> Result<()> {
        if self.flushed_since(g) {
            return Ok(());
        }
        if self.log.is_none() || self.read_only {
            // No flush thread: flush here.
            let _c = self.commit_lock.lock();
            if self.flushed_since(g) {
                return Ok(());
            }
            return self.flush_data();
        }
        let mut q = self.txq.lock();
        loop {
            if self.flushed_since(g) {
                return Ok(());
            }
            if self.is_aborted() {
                return Err(self.wait_error());
            }
            if q.flush_req <= g {
                q.flush_req = g + 1;
                self.cv.notify_all();
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
    }

    /// The running transaction's tid.
    pub fn running_tid(&self) -> u32 {
        self.txq.lock().running.tid
    }

    /// Whether a full commit is in flight (fast commits wait for it: the kernel's
    /// `JBD2_FULL_COMMIT_ONGOING`).
    pub fn full_commit_in_flight(&self) -> bool {
        let q = self.txq.lock();
        !q.inflight.is_empty() || q.running.locked
    }

    /// Wait until no full commit is in flight.
    pub fn wait_full_commits(&self) -> Result<()> {
        let mut q = self.txq.lock();
        loop {
            self.check_live()?;
            if q.inflight.is_empty() && !q.running.locked {
                return Ok(());
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
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
    /// commit must checksum.
    fn flush_data(&self) -> Result<()> {
        let r = self.flushing_data(|| Ok(self.dev.flush()?));
        self.count_flush();
        self.or_abort(r)
    }

    /// Run `io`, which ends with a flush: the data blocks written before it are
    /// durable once it succeeds and leave the single-flush tracking; on failure
    /// they stay tracked. The caller excludes other flushes that move the
    /// tracking (`fc_ongoing`, `flush_busy`).
    fn flushing_data<T>(&self, io: impl FnOnce() -> Result<T>) -> Result<T> {
        self.flushing_data_if(io, |_| true)
    }

    /// [`Self::flushing_data`] for I/O that may end without its flush
    /// (`flushed` says whether it did: a chained fast commit leaves it to a
    /// successor): the data blocks then stay tracked.
    fn flushing_data_if<T>(
        &self,
        io: impl FnOnce() -> Result<T>,
        flushed: impl FnOnce(&T) -> bool,
    ) -> Result<T> {
        {
            let mut q = self.txq.lock();
            let d = std::mem::take(&mut q.running.data.running);
            q.running.data.flushing.union(&d);
        }
        let res = io();
        let mut q = self.txq.lock();
        let d = std::mem::take(&mut q.running.data.flushing);
        if !res.as_ref().is_ok_and(flushed) {
            q.running.data.running.union(&d);
        }
        res
    }

    /// Write-home mode: write the running transaction's buffers home in block
    /// order, then flush.
    fn commit_home(&self) -> Result<usize> {
        if self.read_only {
            return Ok(0);
        }
        let _c = self.commit_lock.lock();
        self.check_live()?;
        let (tid, buffers) = {
            let mut q = self.txq.lock();
            // T_LOCKED: wait until every handle of the transaction has stopped.
            q.running.locked = true;
            while q.running.handles > 0 {
                self.cv.wait_for(&mut q, WAIT_SLICE);
            }
            q.running.locked = false;
            self.cv.notify_all();
            if q.running.buffers.is_empty() {
                // Nothing to write; an fsync still needs its data durable.
                drop(q);
                self.flush_data()?;
                return Ok(0);
            }
            let tid = q.running.tid;
            q.running.tid = tid.wrapping_add(1);
            q.running.revokes.clear();
            (tid, std::mem::take(&mut q.running.buffers))
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
            drop(data);
            // Home changed: a kept home copy is stale now.
            b.vers.lock().home_unknown();
            self.or_abort(r.map_err(Into::into))?;
        }
        let r = self.dev.flush();
        self.count_flush();
        self.or_abort(r.map_err(Into::into))?;
        self.committed_tid.store(tid, Ordering::Release);
        let mut s = self.stats.lock();
        s.commits += 1;
        s.buffers_written += n as u64;
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
        let v3 = self.log.is_some() && self.csum_v3;
        let mut q = self.txq.lock();
        q.running.data = data::DataTrack {
            on: on && v3 && !self.read_only,
            ..Default::default()
        };
    }

    /// Whether single-flush data tracking is on.
    pub fn tracks_data(&self) -> bool {
        self.txq.lock().running.data.on
    }

    /// Data blocks `pblk..pblk+len` were written (not yet flushed) under a handle
    /// of the running transaction.
    pub fn note_data(&self, pblk: u64, len: u64) {
        let mut q = self.txq.lock();
        if q.running.data.on {
            q.running
                .data
                .running
                .insert(pblk, pblk.saturating_add(len));
        }
    }

    /// Data blocks `pblk..pblk+len` were freed by the running transaction: its
    /// commit no longer makes them reachable, so it must not checksum them (they
    /// may hold another file's data once the free is durable).
    pub fn forget_data(&self, pblk: u64, len: u64) {
        let mut q = self.txq.lock();
        if q.running.data.on {
            let e = pblk.saturating_add(len);
            q.running.data.running.remove(pblk, e);
            q.running.data.flushing.remove(pblk, e);
        }
    }

    /// Whether writing the data blocks `runs` (`(pblk, len)`) in place under `h`
    /// would change data that a committing transaction, or the last single-flush
    /// commit (still final in the log), checksummed. Returns that transaction's
    /// tid: call [`Self::confirm_data`] with it (without holding a handle) first.
    pub fn data_conflict(&self, h: &Handle, runs: &[(u64, u32)]) -> Option<u32> {
        let mut q = self.txq.lock();
        if !q.running.data.on {
            return None;
        }
        q.running
            .data
            .settle(self.gens.done.load(Ordering::Acquire));
        runs.iter()
            .filter_map(|&(p, n)| q.running.data.conflict(p, p.saturating_add(n as u64)))
            .find(|&t| t != h.tid)
    }

    /// Wait until a fast commit of the running transaction `tid` may be written
    /// (no full commit in flight or locking, no other fast commit, no flush-thread
    /// flush, nothing holding the pipeline) and claim the fast-commit slot.
    /// `Ok(false)`: `tid` is no longer running (a full commit took it; this waits
    /// until that commit is durable).
    fn claim_fc(&self, tid: u32) -> Result<bool> {
        let mut q = self.txq.lock();
        loop {
            self.check_live()?;
            if q.running.tid != tid {
                drop(q);
                self.wait_committed(tid)?;
                return Ok(false);
            }
            if q.inflight.is_empty()
                && !q.running.locked
                && !q.fc_ongoing
                && !q.flush_busy
                && q.hold == 0
            {
                q.fc_ongoing = true;
                // The successor a chained fast commit waited for is here.
                q.fc_handoff = None;
                return Ok(true);
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        }
    }

    /// Release the slot [`Self::claim_fc`] took. `wrote`: a fast commit was
    /// written, durable at once (`None`) or once a flush numbered after
    /// `Some(gen)` completes (chained).
    fn release_fc(&self, wrote: bool, pending: Option<u64>) {
        let mut q = self.txq.lock();
        q.fc_ongoing = false;
        if wrote {
            // A durable fast commit of the running tid follows the last full
            // commit: that commit is no longer final. A chained one only once
            // its flush completes.
            match pending {
                None => {
                    q.running.data.protected = None;
                    q.running.data.unprotect_after = None;
                }
                Some(g) => {
                    if q.running.data.protected.is_some() {
                        q.running.data.unprotect_after = Some(g);
                    }
                }
            }
        }
        self.cv.notify_all();
    }

    /// Whether a chained fast commit's flush has not completed yet: a fast
    /// commit written now must carry DATA_CHAIN (`fc_data_csum`, docs/FORMAT.md),
    /// and a confirming one must flush first.
    pub fn fc_chain_pending(&self) -> bool {
        let q = self.txq.lock();
        q.fc_pending != 0 && !self.flushed_since(q.fc_pending)
    }

    /// The flush discipline of a confirming empty fast commit: FUA alone, or a
    /// flush first while a chained fast commit is not durable (else the
    /// confirmation could be durable without it, and recovery, stopping at the
    /// chained one, would still verify the commit this confirms).
    fn confirm_mode(&self) -> FcFlush {
        if self.fc_chain_pending() {
            FcFlush::Ordered { flush_first: true }
        } else {
            FcFlush::Fua
        }
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
        self.wait_committed(tid)?;
        let running = loop {
            let running = self.running_tid();
            {
                let mut q = self.txq.lock();
                q.running
                    .data
                    .settle(self.gens.done.load(Ordering::Acquire));
                if q.running.data.protected.as_ref().is_none_or(|p| p.0 != tid) {
                    // Two-flush, confirmed already, or superseded.
                    return Ok(false);
                }
            }
            if self.claim_fc(running)? {
                break running;
            }
        };
        let mut wrote = false;
        let mode = self.confirm_mode();
        let r = (|| {
            let planned = {
                let st = l.lock();
                match st.fc_slot() {
                    Some((t, head, free)) if t == running && st.fc_has_room(1) => {
                        pack(t, head, free)
                            .map(|b| {
                                st.fc_plan_io(std::slice::from_ref(&b), mode)
                                    .map(|io| (b, io))
                            })
                            .transpose()?
                    }
                    _ => None,
                }
            };
            let mut flushes = 0;
            if let Some((b, io)) = planned {
                flushes = io
                    .issue_chained(&*self.dev, std::slice::from_ref(&b), &|| false)?
                    .1;
                l.lock().fc_written(&io);
                wrote = true;
            }
            Ok(flushes)
        })();
        self.release_fc(wrote, None);
        let flushes = self.or_abort(r)?;
        if wrote {
            let mut s = self.stats.lock();
            s.fc_blocks += 1;
            s.flushes += flushes as u64;
            return Ok(true);
        }
        // A commit of the next transaction, even an empty one.
        {
            let mut q = self.txq.lock();
            let t = q.running.tid;
            q.force = Some(t);
            self.cv.notify_all();
            drop(q);
            self.wait_committed(t)?;
        }
        self.write_kept_home()?;
        Ok(false)
    }

    /// Where the next fast commit would go: `(tid of the running transaction, needs
    /// a HEAD, free fast-commit blocks)`; `None` when a full commit is required or
    /// in flight (then the area still belongs to the committing transaction).
    pub fn fc_slot(&self) -> Option<(u32, bool, u32)> {
        let l = self.log.as_ref()?;
        if self.read_only || self.full_commit_in_flight() {
            return None;
        }
        l.lock().fc_slot()
    }

    /// Blocks of the whole fast-commit area (0 without one).
    pub fn fc_capacity(&self) -> u32 {
        self.fc_capacity
    }

    /// Write a fast commit built for transaction `tid` (TLV blocks, the last one
    /// holding the TAIL). Returns `false` without writing when `tid` is no longer
    /// running: a full commit has made everything it described durable already.
    pub fn fast_commit(&self, tid: u32, blocks: &[Vec<u8>], flush_first: bool) -> Result<bool> {
        self.fast_commit_mode(tid, blocks, FcFlush::Ordered { flush_first })
    }

    /// [`Self::fast_commit`] with an explicit flush discipline (see [`FcFlush`]).
    /// Waits while a full commit is in flight; when that commit took `tid`, waits
    /// for it to be durable and returns `false`.
    pub fn fast_commit_mode(&self, tid: u32, blocks: &[Vec<u8>], mode: FcFlush) -> Result<bool> {
        Ok(
            match self.fast_commit_chained(tid, blocks, mode, &|| false)? {
                FcWritten::NotWritten => false,
                FcWritten::Durable => true,
                FcWritten::Pending(g) => {
                    self.wait_data(g)?;
                    true
                }
            },
        )
    }

    /// [`Self::fast_commit_mode`] that may leave an `Ordered` or `Together` fast
    /// commit's durability to a later flush (chained fast commits, CJFS
    /// §4.1/§4.4 on the fast-commit area; docs/ARCHITECTURE.md "Chained fast
    /// commits"): when `chain()` says, just before the last write, that a
    /// successor is expected, an `Ordered` commit's TAIL goes out without FUA
    /// (a `Together` one skips its flush) and the slot is released at once; the
    /// successor's flush (`Ordered`: its pre-tail flush, forced while a chained
    /// TAIL is not durable) makes it durable, and one flush then serves two
    /// fast commits. Recovery stops at the first block whose tag or checksum
    /// chain fails, so the successor never replays without it; a `Together`
    /// successor carries DATA_CHAIN (the caller packs it when
    /// [`Self::fc_chain_pending`]) so that recovery verifies both commits' data. The caller waits for
    /// [`FcWritten::Pending`] with [`Self::wait_data`] (the flush thread holds
    /// such a request back briefly for the expected successor).
    pub fn fast_commit_chained(
        &self,
        tid: u32,
        blocks: &[Vec<u8>],
        mode: FcFlush,
        chain: &dyn Fn() -> bool,
    ) -> Result<FcWritten> {
        let Some(l) = &self.log else {
            return Err(JournalError::BadJournal("no journal log".into()));
        };
        if !self.claim_fc(tid)? {
            return Ok(FcWritten::NotWritten);
        }
        let chained_before = self.fc_chain_pending();
        let mode = match mode {
            FcFlush::Ordered { flush_first } => FcFlush::Ordered {
                // A chained predecessor's TAIL must be durable before this one's.
                flush_first: flush_first
                    | chained_before
                    | self.home_unflushed.swap(false, Ordering::AcqRel),
            },
            m => m,
        };
        // The log lock only to plan and to advance: never across the I/O (see
        // `log::FcIo`).
        let write = || -> Result<(bool, u32)> {
            let io = l.lock().fc_plan_io(blocks, mode)?;
            let r = io.issue_chained(&*self.dev, blocks, chain)?;
            l.lock().fc_written(&io);
            Ok(r)
        };
        let r = if mode == FcFlush::Together {
            // Its flush (unless chained) makes the data written so far durable.
            self.flushing_data_if(write, |r| r.0)
        } else {
            write()
        };
        let out = match &r {
            Ok((true, _)) => FcWritten::Durable,
            // Written before the slot is released: any flush numbered after
            // this makes it durable.
            Ok((false, _)) => FcWritten::Pending(self.gens.started.load(Ordering::Acquire)),
            Err(_) => FcWritten::NotWritten,
        };
        let pending = match out {
            FcWritten::Pending(g) => {
                let mut q = self.txq.lock();
                q.fc_pending = g;
                q.fc_handoff = Some(std::time::Instant::now() + self.flush_batch());
                Some(g)
            }
            _ => None,
        };
        self.release_fc(r.is_ok(), pending);
        // A failed fast commit leaves the area in an unknown state; the kernel
        // falls back to a full commit, which then writes the same device: abort.
        let (_, flushed) = self.or_abort(r)?;
        let mut s = self.stats.lock();
        s.fc_commits += 1;
        s.fc_blocks += blocks.len() as u64;
        s.flushes += flushed as u64;
        s.fc_chained += matches!(out, FcWritten::Pending(_)) as u64;
        Ok(out)
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
        if !self.claim_fc(tid)? {
            return Ok(false);
        }
        let mode = self.confirm_mode();
        let r = (|| {
            let blocks = [block.to_vec()];
            let io = {
                let st = l.lock();
                if !st.fc_has_room(1) || !st.fc_started() {
                    return Ok(None);
                }
                st.fc_plan_io(&blocks, mode)?
            };
            let (_, flushes) = io.issue_chained(&*self.dev, &blocks, &|| false)?;
            l.lock().fc_written(&io);
            Ok(Some(flushes))
        })();
        let wrote = matches!(r, Ok(Some(_)));
        self.release_fc(wrote, None);
        let flushes = self.or_abort(r)?;
        if let Some(f) = flushes {
            let mut s = self.stats.lock();
            s.fc_blocks += 1;
            s.flushes += f as u64;
        }
        Ok(wrote)
    }

    /// Hold the pipeline: wait until nothing is in flight, no fast commit is
    /// being written and the running transaction is not locked, and keep it so
    /// while `f` runs (checkpoint, close).
    fn with_pipeline_held<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut q = self.txq.lock();
        q.hold += 1;
        let r = loop {
            if let Err(e) = self.check_live() {
                break Err(e);
            }
            if q.inflight.is_empty() && !q.fc_ongoing && !q.running.locked && !q.flush_busy {
                drop(q);
                let r = f();
                q = self.txq.lock();
                break r;
            }
            self.cv.wait_for(&mut q, WAIT_SLICE);
        };
        q.hold -= 1;
        self.cv.notify_all();
        r
    }

    /// Write every committed buffer home, flush, and empty the log.
    pub fn checkpoint(&self) -> Result<()> {
        if let Some(l) = &self.log {
            self.check_live()?;
            // A failed checkpoint leaves the log tail where it was: recovery
            // replays those transactions again.
            let r = self.with_pipeline_held(|| {
                let r = l.lock().checkpoint(&*self.dev);
                self.count_flush();
                r
            });
            self.or_abort(r)?;
            // The log is empty: no commit in it is verified at recovery.
            self.txq.lock().running.data.protected = None;
            self.stats.lock().checkpoints += 1;
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
            self.check_live()?;
            let r = self.with_pipeline_held(|| {
                let next = self.txq.lock().running.tid;
                let r = l.lock().close(&*self.dev, next);
                self.count_flush();
                r
            });
            self.or_abort(r)?;
        }
        Ok(())
    }

    /// Whether transaction `tid` is durable. Blocks freed by a transaction must not
    /// be reused for data before then: a crash would leave the old owner pointing
    /// at the new owner's data.
    pub fn is_committed(&self, tid: u32) -> bool {
        let c = self.committed_tid.load(Ordering::Acquire);
        c != 0 && tid_le(tid, c)
    }

    /// Number of dirty buffers waiting for the next commit.
    pub fn pending(&self) -> usize {
        self.txq.lock().running.buffers.len()
    }

    pub fn stats(&self) -> JournalStats {
        let mut s = *self.stats.lock();
        s.inflight = self.txq.lock().inflight.len() as u64;
        s.flush_avg_ns = self.gens.flush_avg_ns.load(Ordering::Relaxed);
        s
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

    /// The pipeline's wait for a successor commit follows the device's flush
    /// time: a SATA SSD's 1.5 ms until a flush is measured, then the moving
    /// average, within 100 µs..1.5 ms.
    #[test]
    fn flush_batch_follows_the_measured_flush_time() {
        use std::time::Duration;
        let dev = Arc::new(MemDevice::new(64 * 1024));
        let j = Journal::new(dev, 1024, false);
        let c = &j.core;
        assert_eq!(c.flush_batch(), Duration::from_micros(1500));
        c.gens.note_flush(20_000); // 20 µs: clamped up
        assert_eq!(c.flush_batch(), Duration::from_micros(100));
        for _ in 0..200 {
            c.gens.note_flush(800_000);
        }
        let b = c.flush_batch();
        assert!(
            b > Duration::from_micros(700) && b < Duration::from_micros(900),
            "{b:?}"
        );
        for _ in 0..200 {
            c.gens.note_flush(9_000_000); // slow device: capped
        }
        assert_eq!(c.flush_batch(), Duration::from_micros(1500));
        // A real flush through the journal's device is timed too.
        let before = c.gens.flush_avg().unwrap();
        c.dev.flush().unwrap();
        assert!(c.gens.flush_avg().unwrap() < before);
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
        device_with_log(400, JSTART, JLEN)
    }

    fn device_with_log(blocks: usize, jstart: u64, jlen: u32) -> Arc<MemDevice> {
        let dev = Arc::new(MemDevice::new(blocks * BS));
        let mut sb = vec![0u8; BS];
        put_be32(&mut sb, jbd2::H_MAGIC, jbd2::JBD2_MAGIC);
        put_be32(&mut sb, jbd2::H_BLOCKTYPE, jbd2::BLOCKTYPE_SUPERBLOCK_V2);
        put_be32(&mut sb, jbd2::S_BLOCKSIZE, BS as u32);
        put_be32(&mut sb, jbd2::S_MAXLEN, jlen);
        put_be32(&mut sb, jbd2::S_FIRST, 1);
        put_be32(&mut sb, jbd2::S_SEQUENCE, 1);
        put_be32(&mut sb, jbd2::S_NR_USERS, 1);
        sb[jbd2::S_UUID..jbd2::S_UUID + 16].copy_from_slice(&[7u8; 16]);
        dev.write_at(jstart * BS as u64, &sb, IoCategory::Journal, false)
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

    /// A fast commit's look at what replay would start from reads a dirty
    /// block's home copy from the device once; the journal's own home writes
    /// (checkpoint) keep that copy current, so later looks read nothing and
    /// still see what the device holds.
    #[test]
    fn replay_bases_read_the_home_copy_once_then_follow_home_writes() {
        let dev = fresh_device();
        dev.write_at(20 * BS as u64, &[9u8; BS], IoCategory::Metadata, false)
            .unwrap();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev.clone(), BS, map, opts()).unwrap();
        let bytes = |v: &[Arc<[u8]>]| v.iter().map(|b| b[0]).collect::<Vec<u8>>();
        // Dirty in the running transaction: replay would start from home.
        write_tx(&j, &[(20, 1)]);
        let before = dev.stats().snapshot();
        assert_eq!(bytes(&j.replay_bases(20).unwrap()), vec![9]);
        assert_eq!(dev.stats().snapshot().since(&before).metadata.reads, 1);
        let before = dev.stats().snapshot();
        assert_eq!(bytes(&j.replay_bases(20).unwrap()), vec![9]);
        // Committed (not home yet) and changed again: both bases.
        j.commit().unwrap();
        write_tx(&j, &[(20, 2)]);
        assert_eq!(bytes(&j.replay_bases(20).unwrap()), vec![1, 9]);
        // The checkpoint writes version 1 home; the kept copy follows it.
        j.checkpoint().unwrap();
        assert_eq!(home(&dev, 20), 1);
        assert_eq!(bytes(&j.replay_bases(20).unwrap()), vec![1]);
        assert_eq!(dev.stats().snapshot().since(&before).metadata.reads, 0);
        // Clean again (committed and home): the live version is the base.
        j.commit().unwrap();
        j.checkpoint().unwrap();
        assert_eq!(bytes(&j.replay_bases(20).unwrap()), vec![2]);
        assert_eq!(home(&dev, 20), 2);
        // A block no fast commit looked at keeps no copy past its checkpoint
        // (a second copy of every checkpointed block would double the cache).
        write_tx(&j, &[(21, 5)]);
        j.commit().unwrap();
        j.checkpoint().unwrap();
        assert_eq!(home(&dev, 21), 5);
        assert!(j.bread(21).unwrap().vers.lock().home.is_none());
        assert!(j.bread(20).unwrap().vers.lock().home.is_some());
    }

    /// `commitfs stats` shows where a full commit's time goes: every phase is
    /// timed (batching may be zero: one caller alone never waits).
    #[test]
    fn commit_phases_are_timed() {
        let dev = fresh_device();
        let map = JournalMap::contiguous(JSTART, JLEN);
        let j = Journal::open_log(dev, BS, map, opts()).unwrap();
        let s0 = j.stats();
        assert_eq!(
            (s0.commits, s0.lock_ns, s0.log_write_ns, s0.flush_avg_ns),
            (0, 0, 0, 0)
        );
        write_tx(&j, &[(20, 1), (21, 2)]);
        j.commit().unwrap();
        let s = j.stats();
        assert_eq!(s.commits, 1);
        assert!(s.lock_ns > 0, "{s:?}");
        assert!(s.log_write_ns > 0, "{s:?}");
        assert!(s.commit_ns >= s.log_write_ns, "{s:?}");
        assert!(s.flush_avg_ns > 0, "a commit flushes: {s:?}");
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
        let _ = good;
        // The log block holding the commit block of the last transaction.
        let last = j.running_tid() - 1;
        let after = dev.contents();
        let off = (1..JLEN as usize)
            .map(|jb| (JSTART as usize + jb) * BS)
            .find(|&off| {
                commitfs_format::jbd2_log::parse_header(&after[off..off + BS])
                    == Some((jbd2::BLOCKTYPE_COMMIT, last))
            })
            .expect("the last commit block is in the log");
        // Damage inside the commit header: that transaction must not replay.
        let mut torn = after.clone();
        torn[off + 0x20] ^= 0xFF;
        let d = MemDevice::from_vec(torn);
        let r = recover(&d, &map, BS, false).unwrap();
        assert!(r.stopped_at.is_some(), "{r:?}");
        assert_eq!(r.torn_commits, 0);
        assert_eq!(home(&d, 20), 1, "torn transaction must not be applied");
        assert_eq!(home(&d, 22), 2);
        assert_eq!(home(&d, 21), 0, "revoked block must not be replayed");
        assert!(r.blocks_revoked >= 1);

        // Only the sectors after the header lost (stale bytes there): the
        // header proves the commit, as the kernel decides
        // (`jbd2_commit_block_csum_verify_partial`), so it replays.
        let mut torn = after;
        torn[off + 512..off + BS].fill(0xA5);
        let d = MemDevice::from_vec(torn);
        let r = recover(&d, &map, BS, false).unwrap();
        assert!(r.stopped_at.is_none(), "{r:?}");
        assert_eq!(r.torn_commits, 1);
        assert_eq!(home(&d, 20), 3, "a commit torn after its header replays");
        assert_eq!(home(&d, 21), 0, "revoked block must not be replayed");
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

    /// Memory bound (docs/ARCHITECTURE.md "Memory"): committed buffers wait on
    /// the checkpoint list, where they cannot be evicted; once a commit would
    /// take the list past the cache bound it checkpoints first, though the log
    /// has room. The cache then stays near the bound, the blocks are home, and
    /// everything still reads back.
    #[test]
    fn committed_buffers_are_checkpointed_past_the_cache_bound() {
        const LOG: u32 = 4096;
        let dev = device_with_log(8192, 4096, LOG);
        let map = JournalMap::contiguous(4096, LOG);
        for bounded in [false, true] {
            let j = Journal::open_log(dev.clone(), BS, map.clone(), opts()).unwrap();
            if bounded {
                j.set_cache_limit(1024);
            }
            let before = j.stats().checkpoints;
            let v0 = if bounded { 21 } else { 1 };
            // 10 commits of 250 blocks: 2,500 committed buffers, a log of 4,096.
            for t in 0..10u64 {
                let blocks: Vec<(u64, u8)> = (0..250)
                    .map(|i| (100 + t * 250 + i, v0 + t as u8))
                    .collect();
                write_tx(&j, &blocks);
                j.commit().unwrap();
            }
            let checkpoints = j.stats().checkpoints - before;
            if bounded {
                assert!(checkpoints >= 2, "{checkpoints} checkpoints");
                assert!(j.cached_buffers() <= 1024 + 250, "{}", j.cached_buffers());
                assert_eq!(home(&dev, 100), v0, "checkpointed home");
            } else {
                assert_eq!(checkpoints, 0, "the log had room");
                assert!(j.cached_buffers() >= 2500, "{}", j.cached_buffers());
            }
            for t in 0..10u64 {
                assert_eq!(j.bread(100 + t * 250).unwrap().data()[0], v0 + t as u8);
            }
            j.checkpoint().unwrap();
        }
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
