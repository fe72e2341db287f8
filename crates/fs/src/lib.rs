//! commitfs file-system layer: ext4 semantics over the journal and format layers.
//!
//! [`Fs`] is the embeddable library API with POSIX-like calls on inode numbers.
//! Internally all state sits in one `Inner` behind a mutex (see `inner.rs` for the
//! conventions every module follows).

mod acl;
mod alloc;
mod atime;
mod dataio;
mod dir;
mod error;
mod errors;
mod extent;
mod fc;
mod fc_replay;
mod file;
mod ilock;
mod inner;
mod itable;
mod ops;
mod orphan;
mod pagecache;
mod pending;
pub mod probe;
mod types;
mod warm;
mod writeback;
mod xattr;

pub mod fuzzing;
pub mod testutil;

use std::path::Path;
use std::sync::Arc;

pub use commitfs_device::AlignedBuf;
use commitfs_device::{DeviceRef, FileDevice, StatsSnapshot};
use commitfs_format::superblock::Superblock;
use parking_lot::Mutex;

pub use acl::{Acl, AclEntry, AclKind};
pub use dir::DirCacheStats;
pub use error::{FsError, Result};
pub use fc::{FcReason, FcStats};
pub use fc_replay::FcReplayReport;
pub use itable::InodeCacheStats;
pub use pagecache::CacheStats;
pub use types::*;

use inner::Inner;

/// An operation that may overwrite data of an inode in place, and the file-block
/// span `[lo, hi)` it may touch, computed under the lock (`fc_data_csum`).
type OverwriteGuard<'a> = (Ino, &'a dyn Fn(&mut Inner) -> Result<(u64, u64)>);

/// A warm pass ([`Fs::lock_warm`], warm.rs) run before an operation takes
/// the lock for good.
type WarmPass<'a> = &'a dyn Fn(&mut Inner) -> Result<()>;

/// The file-system lock for an operation checked by [`Fs::lock_guarded`], with the
/// journal handle that pins the transaction it was checked against.
struct Guarded<'a> {
    g: InnerGuard<'a>,
    h: Option<commitfs_journal::Handle>,
}

impl std::ops::Deref for Guarded<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.g
    }
}

impl std::ops::DerefMut for Guarded<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.g
    }
}

impl Drop for Guarded<'_> {
    fn drop(&mut self) {
        // Stop the pinning handle (Handle's drop) before the lock is released.
        self.h.take();
    }
}

/// Directory entries one [`Fs::readdir_plus`] call reads at most (a FUSE
/// reply buffer holds far fewer).
pub const READDIRPLUS_BATCH: usize = 512;

/// Passes after which [`Fs`]'s `lock_warm` reads under the lock (each pass
/// that misses reads what it missed and keeps it pinned, so each makes
/// progress).
const READ_RETRIES: usize = 64;

/// Metadata blocks one `lock_warm` keeps pinned at most (16 MiB of 4 KiB
/// blocks): a bigger cold read (a huge directory) goes on under the lock.
const PIN_BUDGET: usize = 4096;

/// Entries a plain readdir's warm pass reads ahead (the FUSE kernel asks for
/// a page of entries at a time, fewer than this).
const READDIR_WARM: usize = 1024;

/// Bytes a copy_file_range moves per read/write pair.
const COPY_CHUNK: u64 = 1 << 20;

/// Counters reported by `commitfs stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub device: StatsSnapshot,
    pub journal: commitfs_journal::JournalStats,
    pub journal_mode: &'static str,
    /// fsync and fdatasync calls.
    pub fsyncs: u64,
    /// fdatasyncs that only had to make file data durable (no commit: the
    /// inode's size and mapping were durable already, C.5).
    pub fdatasyncs_data_only: u64,
    /// Metadata blocks read without the file-system lock by an operation
    /// that met them missing from the cache and ran again (C.2).
    pub metadata_reads_unlocked: u64,
    /// Device reads made while holding the file-system lock (a miss no warm
    /// pass predicted, a partial block's bytes past the end of file, mount
    /// and unmount): C.2 wants none in steady state.
    pub reads_locked: u64,
}

/// The metadata caches now ([`Fs::meta_cache_stats`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MetaCacheStats {
    /// Metadata buffers cached (each one block).
    pub buffers: usize,
    /// Buffers the running transaction holds, and the size at which the
    /// journal commits it whatever operation grew it (a share of the
    /// buffers' budget, at most a quarter of the log).
    pub running_buffers: usize,
    pub running_cap: u64,
    pub inodes: InodeCacheStats,
    pub dirs: DirCacheStats,
    /// Changes the fast-commit tracker holds (not a cache, but it grew with
    /// every change until an fsync before it was bounded).
    pub fc_tracked: usize,
}

/// What the recovery at mount replayed after a crash: the JBD2 log, then the
/// fast commits after it (`None` on an image without a fast-commit area).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    pub journal: commitfs_journal::RecoveryReport,
    pub fast_commits: Option<FcReplayReport>,
}

/// A mounted commitfs file system.
pub struct Fs {
    /// Shared with the page cache's commit hooks (weakly).
    inner: Arc<Mutex<Inner>>,
    dev: DeviceRef,
    block_size: u32,
    read_only: bool,
    unmounted: std::sync::atomic::AtomicBool,
    committer: Mutex<Option<Committer>>,
    /// `errors=` state (errors.rs), shared with `Inner` and the committer.
    errors: Arc<errors::ErrorState>,
    /// One fast-commit leader at a time (fast commits are written in the
    /// caller's thread); followers find themselves covered (group commit).
    fc_lock: LeaderLock,
    /// fsync/fdatasync calls (flushes per fsync = device flushes / this).
    fsyncs: std::sync::atomic::AtomicU64,
    /// Metadata blocks read outside `Inner` by `lock_warm`.
    reads_outside: std::sync::atomic::AtomicU64,
    /// `Inner::reads_locked`, read without the lock.
    reads_locked: Arc<std::sync::atomic::AtomicU64>,
    /// [`Stats::fdatasyncs_data_only`].
    fdatasyncs_data_only: std::sync::atomic::AtomicU64,
    /// Fast-commit fsyncs under way (leader batching), and the most seen at
    /// once lately.
    fsync_active: std::sync::atomic::AtomicUsize,
    fsync_peak: std::sync::atomic::AtomicUsize,
    /// Fast-commit fsyncs entered so far: one entering after a leader's plan
    /// may need a successor fast commit, so the leader chains its TAIL.
    fsync_arrivals: std::sync::atomic::AtomicU64,
    /// The highest tracker sequence an entering fast-commit fsync noted: one
    /// above a plan's `upto` entered after it with changes the plan does not
    /// hold (an fsync a written commit already covers needs no successor).
    fsync_seq_max: std::sync::atomic::AtomicU64,
    /// The same for the page cache's write sequence (cached writes a cut has
    /// not taken).
    fsync_wseq_max: std::sync::atomic::AtomicU64,
    /// Batching limits (the journal pipeline's options).
    pipeline: commitfs_journal::PipelineOptions,
    /// Per inode, the flush generation when its data was last written (an
    /// fsync needs a flush started after it; entries leave once an fsync saw
    /// them durable).
    data_gens: Arc<writeback::DataGens>,
    /// The mount's journal (the same as `Inner::journal`).
    journal: Arc<commitfs_journal::Journal>,
    /// Per-inode locks: file data I/O runs under these, outside `inner`; taken
    /// before `inner`, never while holding it (ilock.rs).
    ilocks: ilock::InodeLocks,
    /// File data device access without `inner` (dataio.rs).
    dio: dataio::DataIo,
    /// Shared with `Inner`: cached inodes and open counts (itable.rs).
    itable: Arc<itable::InodeTable>,
    /// Shared with `Inner`: directory states (dir.rs), for lookups without it.
    dirs: Arc<parking_lot::Mutex<dir::DirCache>>,
    /// Shared with `Inner`: the descriptors' free counts (alloc.rs), for statfs.
    free: Arc<alloc::FreeCounts>,
    /// Blocks, reserved blocks, inodes: fixed while mounted (statfs).
    geometry: (u64, u64, u64),
    /// Where each inode lives (fixed while mounted), for the home copies an
    /// fsync warms outside `Inner` (`Some` when fast commits may need them).
    itable_loc: Option<ItableLoc>,
    /// Data write failures for the next fsync (shared with the write-back paths).
    data_errors: Arc<dataio::DataErrors>,
    /// The file-data page cache (pagecache.rs), shared with `Inner`.
    pc: Option<Arc<pagecache::PageCache>>,
    /// `-o fc_data_csum` in effect.
    fc_data_csum: bool,
    /// Fast commits written on this mount (as `Inner::fc_enabled`).
    fc_on: bool,
    /// Shared with `Inner`'s fast-commit tracker: what fsyncs check without
    /// `Inner` (fc.rs, lock order C.4: after `Inner`).
    fcd: Arc<fc::FcDurable>,
    /// Shared with `Inner`: fdatasync's stamps (C.5), read and cleared by
    /// fsyncs without `Inner`.
    datasync: Arc<Mutex<inner::DatasyncStamps>>,
    /// The mount's options (as `Inner::opts`), for decisions made without
    /// `Inner` (atime of a read answered from the page cache).
    opts: MountOptions,
    /// The page cache's commit hooks (the journal holds them weakly).
    _hooks: Option<Arc<dyn commitfs_journal::CommitHooks>>,
}

/// Commits `sync` forces, at most, to cut every cached write made before it
/// (a cut gives up after 2 s on a busy cache, or leaves pages it cannot map).
const SYNC_COMMITS: u32 = 8;

/// One fast-commit leader at a time. Followers wait for the leader to finish
/// and then all check at once whether its fast commit covered them, instead of
/// queueing on a mutex one by one (the leader's batching would otherwise wait
/// for threads that are stuck behind it).
#[derive(Default)]
struct LeaderLock {
    held: Mutex<bool>,
    cv: parking_lot::Condvar,
}

struct LeaderGuard<'a>(&'a LeaderLock);

impl LeaderLock {
    /// Take the lock, waiting as long as needed.
    fn lock(&self) -> LeaderGuard<'_> {
        let mut h = self.held.lock();
        while *h {
            self.cv.wait(&mut h);
        }
        *h = true;
        LeaderGuard(self)
    }

    /// Take the lock if free; otherwise wait until the holder lets go and return
    /// `None` (the caller checks again what it still needs).
    fn lead_or_wait(&self) -> Option<LeaderGuard<'_>> {
        let mut h = self.held.lock();
        if *h {
            self.cv.wait(&mut h);
            return None;
        }
        *h = true;
        Some(LeaderGuard(self))
    }
}

impl Drop for LeaderGuard<'_> {
    fn drop(&mut self) {
        *self.0.held.lock() = false;
        self.0.cv.notify_all();
    }
}

/// The file-system lock, held (`Fs::lock`). When it is let go, the cached
/// pages of files the holder freed are freed too, after the lock
/// (`PageCache::reap`): freeing a large file's pages under `Inner` held
/// every other operation for as long, and the holder that freed them is the
/// one to pay, with no lock left.
pub(crate) struct InnerGuard<'a> {
    g: std::mem::ManuallyDrop<parking_lot::MutexGuard<'a, Inner>>,
    pc: Option<&'a Arc<pagecache::PageCache>>,
}

impl std::ops::Deref for InnerGuard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.g
    }
}

impl std::ops::DerefMut for InnerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.g
    }
}

impl Drop for InnerGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `g` is dropped exactly once, here, and not used after.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.g) };
        if let Some(pc) = self.pc {
            pc.reap();
        }
    }
}

/// The inode tables' places (`Inner::inode_location` without the lock).
struct ItableLoc {
    tables: Vec<u64>,
    ipg: u32,
    inode_size: usize,
    bs: usize,
}

impl ItableLoc {
    /// The inode-table block holding inode `ino` (`None`: out of range).
    fn block_of(&self, ino: Ino) -> Option<u64> {
        inner::inode_place(ino, self.ipg, self.inode_size, self.bs, |g| {
            self.tables.get(g).copied()
        })
        .map(|(blk, _)| blk)
    }
}

/// Counts an fsync in [`Fs::fsync_active`] while it lives.
struct ActiveFsync<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> ActiveFsync<'a> {
    fn enter(c: &'a std::sync::atomic::AtomicUsize, peak: &std::sync::atomic::AtomicUsize) -> Self {
        let n = c.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1;
        peak.fetch_max(n, std::sync::atomic::Ordering::AcqRel);
        ActiveFsync(c)
    }
}

impl Drop for ActiveFsync<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Background thread committing the running transaction every `commit=` seconds
/// (ext4's default is 5).
struct Committer {
    stop: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The periodic committer's step before each commit (without `lazytime`):
/// reads' atimes kept in the inode cache (`atime::touch_atime_deferred`) go
/// into the transaction it commits, 256 inodes per `Inner` hold so that a
/// burst of reads does not keep the lock long.
fn read_atimes_writer(
    inner: std::sync::Weak<Mutex<Inner>>,
    itable: Arc<itable::InodeTable>,
) -> Box<dyn Fn() + Send> {
    Box::new(move || {
        if itable.lazy_is_empty() {
            return;
        }
        let Some(i) = inner.upgrade() else {
            return;
        };
        for inos in itable.lazy_inos(None).chunks(256) {
            if let Err(e) = i.lock().flush_atimes_of(inos) {
                tracing::warn!("periodic atime update: {e}");
                break;
            }
        }
    })
}

impl Committer {
    fn spawn(
        journal: Arc<commitfs_journal::Journal>,
        errors: Arc<errors::ErrorState>,
        interval: std::time::Duration,
        pc: Option<Arc<pagecache::PageCache>>,
        before_commit: Option<Box<dyn Fn() + Send>>,
    ) -> Committer {
        let stop = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let s2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("commitfs-commit".into())
            .spawn(move || {
                let (m, cv) = &*s2;
                let mut stopped = m.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if *stopped {
                        return;
                    }
                    let (g, _) = cv
                        .wait_timeout(stopped, interval)
                        .unwrap_or_else(|e| e.into_inner());
                    stopped = g;
                    if *stopped {
                        return;
                    }
                    let dirty = pc.as_ref().is_some_and(|pc| pc.periodic_due());
                    if let Some(f) = &before_commit {
                        if !journal.is_aborted() {
                            f();
                        }
                    }
                    if (journal.pending() > 0 || dirty) && !journal.is_aborted() {
                        if dirty {
                            if let Some(pc) = &pc {
                                // data_order=file: this commit writes back
                                // data dirty for 30 s (ext4's flusher).
                                pc.ask_expired_cut();
                            }
                        }
                        // Cached data alone: a forced commit (its cut writes it).
                        let r = if journal.pending() > 0 {
                            journal.commit().map(|_| ())
                        } else {
                            journal.commit_forced()
                        };
                        if let Err(e) = r {
                            tracing::error!("periodic commit failed: {e}");
                            errors.journal_failed(&journal, "periodic_commit", &e);
                        }
                    }
                }
            })
            .ok();
        Committer { stop, thread }
    }

    fn shutdown(&mut self) {
        let (m, cv) = &*self.stop;
        *m.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Fs {
    /// Mount the file system on `dev`.
    pub fn open(dev: DeviceRef, opts: MountOptions) -> Result<Fs> {
        if opts.data_order == DataOrder::File && opts.fc_data_csum && !opts.read_only {
            // A commit's data checksums name blocks that other files' later
            // write-backs may still overwrite in place: without the cut of
            // every commit, recovery would find them changed and drop a
            // commit whose fsync returned (found by the crash harness).
            return Err(FsError::NotSupported(
                "data_order=file together with fc_data_csum".into(),
            ));
        }
        let interval = opts.commit_interval;
        let pipeline = opts.pipeline;
        let (page_cache, cache_mb, data_order) = (opts.page_cache, opts.cache_mb, opts.data_order);
        let mut inner = Inner::mount(dev.clone(), opts)?;
        // Every cache is bounded, together by `cache_size=` (CacheBudget).
        let budget = CacheBudget::of_mib(cache_mb);
        let pc = (page_cache && !inner.read_only && inner.journal.has_log()).then(|| {
            Arc::new(pagecache::PageCache::new(inner.bs, budget.pages).with_order(data_order))
        });
        inner.pc = pc.clone();
        inner.journal.set_cache_limit(budget.buffers / inner.bs);
        inner
            .itable
            .set_budget(budget.inodes, inner.sb.inode_size() as usize);
        inner.dirs.lock().set_budget(budget.dirs);
        // e2fsck 1.47 replays fast commits over a stale copy of this block unless
        // it is home (fc.rs, FcReason::JournalInodeBlock).
        inner.journal.keep_home(inner.fc_journal_inode_block());
        let errors = inner.errors.clone();
        let journal = inner.journal.clone();
        let dio = inner.data_io();
        let data_errors: Arc<dataio::DataErrors> = Default::default();
        let itable = inner.itable.clone();
        let dirs = inner.dirs.clone();
        let free = inner.free.clone();
        let reads_locked = inner.reads_locked.clone();
        let geometry = (
            inner.sb.blocks_count(),
            inner.sb.r_blocks_count(),
            inner.sb.inodes_count() as u64,
        );
        let fc_data_csum = inner.fc_data_csum;
        let (fc_on, fcd, datasync) = (
            inner.fc_enabled,
            inner.fc.dur.clone(),
            inner.datasync.clone(),
        );
        // Fast commits compare in-inode xattr areas with the home copy only
        // when inodes are larger than the kernel's record (`fc_inode_record`).
        let itable_loc = (inner.fc_enabled && inner.inode_size > 128).then(|| ItableLoc {
            tables: inner.gds.iter().map(|g| g.inode_table).collect(),
            ipg: inner.ipg,
            inode_size: inner.inode_size,
            bs: inner.bs,
        });
        let opts = inner.opts.clone();
        let (block_size, read_only) = (inner.bs as u32, inner.read_only);
        let inner = Arc::new(Mutex::new(inner));
        let committer = (!read_only && interval > 0).then(|| {
            Committer::spawn(
                journal.clone(),
                errors.clone(),
                std::time::Duration::from_secs(interval as u64),
                pc.clone(),
                (!opts.lazytime)
                    .then(|| read_atimes_writer(Arc::downgrade(&inner), itable.clone())),
            )
        });
        let data_gens: Arc<writeback::DataGens> = Default::default();
        let hooks = pc.as_ref().map(|pc| {
            let h: Arc<dyn commitfs_journal::CommitHooks> = Arc::new(writeback::CacheHooks {
                inner: Arc::downgrade(&inner),
                pc: pc.clone(),
                dio: dio.clone(),
                ordered: Default::default(),
                data_errors: data_errors.clone(),
                data_gens: data_gens.clone(),
            });
            journal.set_hooks(Some(&h));
            h
        });
        Ok(Fs {
            _hooks: hooks,
            pc,
            fc_data_csum,
            fc_on,
            fcd,
            datasync,
            opts,
            itable,
            dirs,
            free,
            geometry,
            itable_loc,
            ilocks: Default::default(),
            dio,
            data_errors,
            block_size,
            read_only,
            inner,
            dev,
            unmounted: Default::default(),
            committer: Mutex::new(committer),
            errors,
            fc_lock: LeaderLock::default(),
            fsyncs: Default::default(),
            reads_outside: Default::default(),
            reads_locked,
            fdatasyncs_data_only: Default::default(),
            fsync_active: Default::default(),
            fsync_peak: Default::default(),
            fsync_arrivals: Default::default(),
            fsync_seq_max: Default::default(),
            fsync_wseq_max: Default::default(),
            pipeline,
            data_gens,
            journal,
        })
    }

    /// Test seam: run `f` while holding the file-system lock, for tests that
    /// show an operation does not need it (it must return meanwhile).
    #[doc(hidden)]
    pub fn with_fs_lock_held<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        let _g = self.lock()?;
        Ok(f())
    }

    /// Test seam: at most `buffers` clean metadata buffers stay cached (below
    /// the floor `cache_size=` keeps), so that a test's blocks come and go.
    #[doc(hidden)]
    pub fn limit_buffer_cache(&self, buffers: usize) {
        self.journal.set_cache_limit_exact(buffers);
    }

    /// Test seam: whether the file-system lock is held now, by anyone
    /// (`testutil::LockProbe` asks it at each metadata read).
    #[doc(hidden)]
    pub fn fs_lock_probe(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        // Weak: the device that asks must not keep the file system alive.
        let inner = Arc::downgrade(&self.inner);
        move || inner.upgrade().is_some_and(|i| i.is_locked())
    }

    /// The file-system lock; `Err(Shutdown)` once errors=panic fired.
    fn lock(&self) -> Result<InnerGuard<'_>> {
        self.live()?;
        let mut g = self.inner.lock();
        // Reads are deferred only inside `lock_warm`'s pass; a pass that
        // panicked (the FUSE layer survives that) must not leave them so.
        g.defer_misses
            .store(false, std::sync::atomic::Ordering::Relaxed);
        g.warm_pruned = false;
        Ok(InnerGuard {
            g: std::mem::ManuallyDrop::new(g),
            pc: self.pc.as_ref(),
        })
    }

    /// The file-system lock for an operation whose metadata reads happen
    /// outside it (ARCHITECTURE.md C.2, "no device I/O under `Inner`"): `warm`
    /// runs under the lock with misses deferred; a block it needs that is not
    /// cached ends it with [`FsError::MetadataMiss`], the lock is dropped, the
    /// block read into the journal's cache, and `warm` runs again. `warm` must
    /// therefore change nothing before its last metadata read (a lookup, an
    /// attribute or mapping read). Returns the lock, still held, with `warm`'s
    /// result: what the caller does next under it finds those blocks cached.
    /// After [`READ_RETRIES`] misses in a row (a cache evicting faster than
    /// this reads) `warm` runs with reads under the lock, as before.
    fn lock_warm<R>(
        &self,
        mut warm: impl FnMut(&mut Inner) -> Result<R>,
    ) -> Result<(InnerGuard<'_>, R)> {
        let (mut g, v) = self.warm_loop(false, &mut warm)?;
        let v = match v {
            Some(v) => v,
            None => warm(&mut g)?,
        };
        Ok((g, v))
    }

    /// [`Self::lock_warm`] for a pass that reads ahead of what it must
    /// (`readdir_plus`'s batch of inodes, of which the caller may take only
    /// the first): a failed read outside the lock ends the warming, and the
    /// pass runs under the lock, where the read is made again and an error
    /// recorded and met where the pass needs the block (so the entries before
    /// an unreadable inode still go out).
    fn lock_warm_lenient<R>(
        &self,
        mut warm: impl FnMut(&mut Inner) -> Result<R>,
    ) -> Result<(InnerGuard<'_>, R)> {
        let (mut g, v) = self.warm_loop(true, &mut warm)?;
        let v = match v {
            Some(v) => v,
            None => warm(&mut g)?,
        };
        Ok((g, v))
    }

    /// The file-system lock for a changing operation after its warm pass
    /// (warm.rs): as [`Self::lock_warm`], but what the pass reads is a
    /// prediction, which the operation may never need. So a failed read
    /// outside the lock only ends the warming (the operation then reads
    /// under the lock, and records and reports an error it meets there), and
    /// past the retry or pin budget the pass is not run again under the lock.
    fn lock_change(
        &self,
        mut warm: impl FnMut(&mut Inner) -> Result<()>,
    ) -> Result<InnerGuard<'_>> {
        self.warm_loop(true, &mut warm).map(|(g, _)| g)
    }

    /// The loop of [`Self::lock_warm`] and [`Self::lock_change`]: the lock
    /// and `warm`'s result, `None` when it gave up warming (the budgets, or
    /// a failed read of a predicted block).
    fn warm_loop<R>(
        &self,
        predicted: bool,
        warm: &mut impl FnMut(&mut Inner) -> Result<R>,
    ) -> Result<(InnerGuard<'_>, Option<R>)> {
        // What was read outside the lock stays pinned (a cache sweep keeps
        // held buffers) until the pass that needs it has run; past
        // PIN_BUDGET blocks the pass reads under the lock instead.
        let mut pins = Vec::new();
        for _ in 0..READ_RETRIES {
            if pins.len() >= PIN_BUDGET {
                break;
            }
            let mut g = self.lock()?;
            let r = {
                let _d = g.defer_pass();
                warm(&mut g)
            };
            match r {
                Err(FsError::MetadataMiss(blks)) => {
                    drop(g);
                    if let Err(e) = self.read_meta_unlocked(&blks, &mut pins, !predicted) {
                        if !predicted {
                            return Err(e);
                        }
                        break;
                    }
                }
                Err(e) => return Err(e),
                Ok(v) => return Ok((g, Some(v))),
            }
        }
        Ok((self.lock()?, None))
    }

    /// [`Self::lock_warm`] for an operation that is all reads: its result.
    fn read_locked<R>(&self, f: impl FnMut(&mut Inner) -> Result<R>) -> Result<R> {
        self.lock_warm(f).map(|(_, v)| v)
    }

    /// Read metadata blocks `blks` into the journal's cache without `Inner`,
    /// keeping them in `pins`, with `Inner::read_meta`'s error handling: a
    /// device error is an ext4_error (`errors=` decides, with `record`) and the
    /// operation's error. (Read again under the lock, a transient error could
    /// pass unrecorded.) Without `record` (a changing operation's predicted
    /// blocks) the error is only returned.
    fn read_meta_unlocked(
        &self,
        blks: &[u64],
        pins: &mut Vec<Arc<commitfs_journal::Buffer>>,
        record: bool,
    ) -> Result<()> {
        for &blk in blks {
            self.reads_outside
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match self.journal.bread(blk) {
                Ok(b) => pins.push(b),
                Err(e) => {
                    if let (true, commitfs_journal::JournalError::Device(d)) = (record, &e) {
                        let cause = format!("metadata read failed: {d}");
                        // Not under `Inner`: the record is written at once.
                        self.errors
                            .handle(&self.journal, "read_meta", 0, blk, &cause, false);
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    /// What every operation checks first, with or without the lock: an error
    /// reported under the lock is recorded on disk here, outside it;
    /// `Err(Shutdown)` once errors=panic fired.
    fn live(&self) -> Result<()> {
        self.errors.write_deferred();
        if self.errors.is_dead() {
            return Err(FsError::Shutdown);
        }
        Ok(())
    }

    /// The attributes of a cached inode from the inode table alone, sizes of
    /// cached writes included (`None`: not cached).
    fn cached_attr(&self, ino: Ino) -> Option<Result<Attr>> {
        let a = self.itable.cached_attr(ino, self.block_size as usize)?;
        Some(a.map(|mut a| {
            if let Some(pc) = &self.pc {
                pc.patch_attr(&mut a);
            }
            a
        }))
    }

    /// Pass on the result of a journal operation; a failure that aborted the
    /// journal is handled per `errors=` (once).
    fn check<T>(&self, j: &commitfs_journal::Journal, func: &str, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.errors.journal_failed(j, func, e);
        }
        r
    }

    /// The `errors=` behaviour in effect (the option, or the superblock's).
    pub fn errors_behavior(&self) -> ErrorsBehavior {
        self.errors.mode()
    }

    /// errors=panic fired: the file system serves nothing more (the FUSE
    /// daemon exits).
    pub fn has_shut_down(&self) -> bool {
        self.errors.is_dead()
    }

    /// Run `f` once when errors=panic fires (at once if it already has): the
    /// FUSE daemon exits there, like a kernel panic, leaving recovery to the
    /// next mount.
    pub fn on_shutdown(&self, f: impl FnOnce() + Send + 'static) {
        self.errors.on_shutdown(Box::new(f));
    }

    /// Run `f` after the warm pass `warm` ([`Self::lock_change`], in the same
    /// lock hold: the metadata the operation reads is read outside the lock);
    /// on ENOSPC while blocks freed by uncommitted transactions exist, commit
    /// (making them reusable) and retry once, like ext4's retry-alloc.
    fn retry_nospace_warm<T>(
        &self,
        warm: impl Fn(&mut Inner) -> Result<()>,
        f: impl FnMut(&mut Inner) -> Result<T>,
    ) -> Result<T> {
        // The retry after the commit warms again: the commit may have let
        // the blocks go.
        self.retry_nospace_guarded(None, Some(&warm), f)
    }

    /// [`Self::retry_nospace_warm`] for an operation that may overwrite data of
    /// `guard.0` in place at file blocks `guard.1(inner)` (`fc_data_csum`: see
    /// [`Self::lock_guarded`]), after the warm pass `warm`.
    fn retry_nospace_guarded<T>(
        &self,
        guard: Option<OverwriteGuard<'_>>,
        warm: Option<WarmPass<'_>>,
        mut f: impl FnMut(&mut Inner) -> Result<T>,
    ) -> Result<T> {
        let first = f(&mut *self.lock_guarded(guard, warm)?);
        if !matches!(first, Err(FsError::NoSpace)) {
            return first;
        }
        let j = {
            let g = self.lock()?;
            if g.pending_free.is_empty() && g.pending_free_inodes.is_empty() {
                return first;
            }
            g.journal.clone()
        };
        let r = j.commit().map_err(FsError::from);
        self.check(&j, "commit", r)?;
        f(&mut *self.lock_guarded(guard, warm)?)
    }

    /// Lock the file system for an operation that may overwrite blocks of `ino`
    /// in place in the file-block span `span(inner)`. With `fc_data_csum`, a block
    /// named by a DATA_CSUM record of the last fast commit must keep its content
    /// until a later commit follows (recovery verifies the last commit's data, and
    /// a mismatch would drop a commit whose fsync returned): append a confirming
    /// empty fast commit first. The check and the operation run under one lock
    /// hold, so no fast commit can protect the span in between.
    ///
    /// The same holds for the data ranges of a single-flush full commit (the last
    /// transaction in the log, or one still committing): a journal handle is held
    /// from the check through the operation, so the transaction the operation
    /// joins is the one checked against, and a conflict first waits for that
    /// commit and confirms it ([`Self::data_confirm`]).
    fn lock_guarded(
        &self,
        guard: Option<OverwriteGuard<'_>>,
        warm: Option<WarmPass<'_>>,
    ) -> Result<Guarded<'_>> {
        loop {
            let mut g = match warm {
                Some(w) => self.lock_change(w)?,
                None => self.lock()?,
            };
            let Some((ino, span)) = guard else {
                return Ok(Guarded { h: None, g });
            };
            if !g.fc_data_csum {
                return Ok(Guarded { h: None, g });
            }
            let (lo, hi) = span(&mut g)?;
            if let Some(tid) = g.fc_protect_hit(ino, lo, hi) {
                drop(g);
                self.fc_confirm(tid)?;
                continue;
            }
            if !g.journal.tracks_data() {
                return Ok(Guarded { h: None, g });
            }
            let h = g.start(0)?;
            let runs = g.mapped_runs(ino, lo, hi)?;
            match g.journal.data_conflict(&h, &runs) {
                None => return Ok(Guarded { h: Some(h), g }),
                Some(tid) => {
                    drop(h);
                    drop(g);
                    self.data_confirm(tid)?;
                }
            }
        }
    }

    /// Make the single-flush commit of `tid` non-final before one of its data
    /// blocks is overwritten in place (see [`Self::lock_guarded`]): an empty fast
    /// commit of the next transaction with FUA, or a commit of it.
    fn data_confirm(&self, tid: u32) -> Result<()> {
        // No fast commit is between plan and write while this is held.
        let _fcl = self.fc_lock.lock();
        let (j, bs) = {
            let g = self.lock()?;
            (g.journal.clone(), g.bs)
        };
        let pack = |t: u32, head: bool, free: u32| {
            fc::pack(&[], t, head, bs, free).and_then(|mut b| (b.len() == 1).then(|| b.remove(0)))
        };
        let r = j.confirm_data(tid, &pack).map_err(FsError::from);
        if self.check(&j, "confirm_data", r)? {
            self.fcd.lock().stats.confirms += 1;
        }
        Ok(())
    }

    /// Make every fast commit of `tid` written so far non-final (see
    /// [`Self::lock_guarded`]): a lone TAIL with FUA in the fast-commit area, or a
    /// full commit when the area is full or `tid` is already committing.
    fn fc_confirm(&self, tid: u32) -> Result<()> {
        // No fast commit is between plan and write while this is held.
        let _fcl = self.fc_lock.lock();
        let (j, bs) = {
            let g = self.lock()?;
            (g.journal.clone(), g.bs)
        };
        if !j.is_committed(tid) {
            // A lone TAIL where the next fast commit would go (with a stopper if
            // that is the area's last block); no room: a full commit instead.
            let block = match j.fc_slot() {
                Some((t, false, free)) if t == tid => fc::pack(&[], tid, false, bs, free),
                _ => None,
            };
            let wrote = match block {
                Some(b) => {
                    let r = j.fc_confirm(tid, &b[0]).map_err(FsError::from);
                    self.check(&j, "fast_commit", r)?
                }
                None => false,
            };
            if wrote {
                self.fcd.lock().stats.confirms += 1;
            } else {
                self.sync()?;
            }
        }
        self.lock()?.fc_protect_confirmed();
        Ok(())
    }

    /// Commit early when the running transaction has grown large.
    fn maybe_commit(&self) -> Result<()> {
        // Asked after every change: the size test needs no file-system lock
        // (it is rarely true).
        if !self.journal.should_commit() {
            return Ok(());
        }
        let j = {
            let g = self.lock()?;
            if g.read_only || !g.journal.should_commit() {
                return Ok(());
            }
            g.journal.clone()
        };
        let r = j.commit().map_err(FsError::from);
        self.check(&j, "commit", r)?;
        Ok(())
    }

    /// [`Self::maybe_commit`] after an access updated atime: a failure there is
    /// only logged, the access itself succeeded.
    fn commit_after_access(&self) {
        if let Err(e) = self.maybe_commit() {
            tracing::warn!("commit after an atime update: {e}");
        }
    }

    /// Mount an image file or block device by path.
    pub fn open_path(path: &Path, opts: MountOptions) -> Result<Fs> {
        let dev: DeviceRef = Arc::new(FileDevice::open(path, opts.read_only)?);
        Fs::open(dev, opts).map_err(|e| e.with_image(path))
    }

    /// [`Self::unmount`] has begun (the daemon's control socket refuses a
    /// `sync` then: the unmount writes everything home itself).
    pub fn is_unmounting(&self) -> bool {
        self.unmounted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Write everything home, mark the file system clean. Idempotent; also done on
    /// drop (errors are then only logged).
    pub fn unmount(&self) -> Result<()> {
        if self
            .unmounted
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Ok(());
        }
        if let Some(mut c) = self.committer.lock().take() {
            c.shutdown();
        }
        if self.errors.is_dead() {
            // errors=panic: nothing more is written (the journal recovers).
            return Ok(());
        }
        let mut lost = None;
        if let Some(pc) = self.pc.clone().filter(|_| !self.journal.is_aborted()) {
            // Cached data first, by a commit (its cut), before `Inner` is held
            // across the final commit (which must find nothing to cut).
            if let Err(e) = self.sync() {
                tracing::warn!("unmount: writing cached data: {e}");
            }
            for ino in pc.dirty_inos() {
                if let Err(e) = self.writeback_file(ino) {
                    tracing::error!("unmount: cached data of inode {ino} not written: {e}");
                    lost = Some(e);
                }
            }
            if let Err(e) = self.sync() {
                lost.get_or_insert(e);
            }
        }
        let (j, r) = {
            let mut g = self.inner.lock();
            (g.journal.clone(), g.unmount())
        };
        // Files unlinked while open, freed by the unmount (under the lock
        // taken directly, not through `Fs::lock`).
        if let Some(pc) = &self.pc {
            pc.reap();
        }
        self.check(&j, "unmount", r)?;
        // Unmounted cleanly, but cached data could not be written (ENOSPC or
        // an I/O error): say so.
        match lost {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Read-only: mounted so, or turned so by an I/O error (errors=remount-ro,
    /// or an aborted journal, which refuses every change in any errors= mode).
    pub fn is_read_only(&self) -> bool {
        self.read_only || self.errors.is_read_only() || self.inner.lock().journal.is_aborted()
    }
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    pub fn device(&self) -> &DeviceRef {
        &self.dev
    }
    /// Device I/O counters.
    pub fn io_stats(&self) -> StatsSnapshot {
        self.dev.stats().snapshot()
    }
    /// Describe the journal of an image without mounting it or replaying anything:
    /// (journal superblock, what a recovery would replay, journal length in blocks).
    /// `None` when the image has no journal.
    pub fn inspect_journal(
        dev: DeviceRef,
    ) -> Result<
        Option<(
            commitfs_format::jbd2::JournalSuperblock,
            commitfs_journal::RecoveryReport,
            u32,
        )>,
    > {
        let opts = MountOptions {
            read_only: true,
            ..Default::default()
        };
        let mut inner = Inner::mount_with(dev, opts, true)?;
        inner.inspect_journal()
    }

    /// What this mount's journal recovery replayed; `None` when the image was
    /// clean (nothing to replay). For reports such as `commitfs demo`'s power cut.
    pub fn recovery(&self) -> Option<Recovery> {
        self.inner.lock().recovery.clone()
    }

    /// Start noting the files [`Self::take_attr_changed`] returns (a front
    /// end that caches attributes calls this once; nothing is noted before).
    pub fn watch_attr_changes(&self) {
        if let Some(pc) = &self.pc {
            pc.watch_attr_changes();
        }
    }

    /// Files whose `st_blocks` changed since the last call without an
    /// operation on them (write-back allocated extent blocks): a front end
    /// that caches attributes (FUSE) invalidates them.
    pub fn take_attr_changed(&self) -> Vec<Ino> {
        self.pc
            .as_ref()
            .map(|pc| pc.take_attr_changed())
            .unwrap_or_default()
    }

    /// The options this file system was mounted with.
    pub fn options(&self) -> &MountOptions {
        &self.opts
    }

    /// Live counters: device I/O by category and journal activity.
    pub fn stats(&self) -> Stats {
        let j = &self.journal;
        Stats {
            device: self.dev.stats().snapshot(),
            journal: j.stats(),
            journal_mode: if j.has_log() {
                "jbd2-ordered"
            } else {
                "write-home"
            },
            fsyncs: self.fsyncs.load(std::sync::atomic::Ordering::Relaxed),
            fdatasyncs_data_only: self
                .fdatasyncs_data_only
                .load(std::sync::atomic::Ordering::Relaxed),
            metadata_reads_unlocked: self
                .reads_outside
                .load(std::sync::atomic::Ordering::Relaxed),
            reads_locked: self.reads_locked.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Sizes and counters of the metadata caches (buffers, inodes,
    /// directories), for `commitfs stats` and the memory tests.
    pub fn meta_cache_stats(&self) -> MetaCacheStats {
        let g = self.inner.lock();
        let dirs = self.dirs.lock().stats();
        MetaCacheStats {
            buffers: g.journal.cached_buffers(),
            running_buffers: g.journal.pending(),
            running_cap: g.journal.max_transaction_blocks(),
            inodes: g.itable.cache_stats(),
            dirs,
            fc_tracked: g.fc_tracked(),
        }
    }

    /// A copy of the in-memory superblock.
    pub fn superblock(&self) -> Superblock {
        self.inner.lock().sb.clone()
    }

    /// A full commit's step under `Inner` (sync, an fsync's full commit):
    /// the superblock totals and pending atimes into the running transaction
    /// (`Inner::prepare_commit`; those atimes' inode-table blocks are read
    /// outside the lock first). `None`: read-only, nothing to commit;
    /// aborted: nothing after the error can be made durable.
    fn prepare_for_commit(&self) -> Result<Option<Arc<commitfs_journal::Journal>>> {
        let mut g = self.lock_change(|g| g.warm_lazy(None))?;
        if g.journal.is_aborted() {
            return Err(commitfs_journal::JournalError::Aborted.into());
        }
        if g.read_only {
            return Ok(None);
        }
        g.prepare_commit()?;
        Ok(Some(g.journal.clone()))
    }

    /// An fsync's full commit: transaction `tid` (the running one when the fsync
    /// began) and every earlier one durable, and the file's data written up to
    /// flush generation `dgen` (group commit: `Journal::commit_upto`).
    fn sync_for(&self, tid: u32, dgen: Option<u64>, wseq: Option<u64>) -> Result<()> {
        let Some(journal) = self.prepare_for_commit()? else {
            return Ok(());
        };
        // An fsync's full commit makes every earlier change durable, cached
        // writes included: with pages dirty the running transaction is
        // committed even if it is empty, so that its cut writes them.
        let r = if !self.cache_covered(wseq) {
            // The fsync's transaction, even if empty: its cut comes at its
            // lock, after this fsync began, unless it was locked already; then
            // the one after it.
            journal
                .commit_upto_forced(tid, dgen)
                .map(|_| ())
                .and_then(|()| {
                    if self.cache_covered(wseq) {
                        Ok(())
                    } else {
                        journal.commit_forced()
                    }
                })
        } else {
            journal.commit_upto(tid, dgen).map(|_| ())
        };
        let r = r.map_err(FsError::from);
        self.check(&journal, "commit", r)
    }

    /// Note that file data of `ino` was written up to now: its next fsync waits
    /// for a flush that starts later.
    fn note_data(&self, ino: Ino) {
        let g = self.journal.flush_gen();
        self.data_gens.lock().insert(ino, g);
    }

    /// Commit all pending changes and flush the device. The device writes and the
    /// flush happen outside the file-system lock.
    pub fn sync(&self) -> Result<()> {
        let Some(journal) = self.prepare_for_commit()? else {
            return Ok(());
        };
        // Cached data alone leaves the running transaction empty: a commit
        // is forced so that its cut writes the data.
        let wseq = self.pc.as_ref().map(|pc| pc.wseq());
        let r = if !self.cache_covered(wseq) {
            let pc = self.pc.as_ref().expect("cached writes need a cache");
            // Until a durable cut covers every write made before the call: a
            // commit that locked before the request took it without covering
            // these writes (data_order=file), and a cut gives up when the
            // cache's barrier stays busy (2 s, `CacheHooks::cut`); sync waits
            // as the kernel's does, and never returns with data left out.
            let mut r = Ok(());
            let mut tries = 0u32;
            while r.is_ok() && !self.cache_covered(wseq) {
                tries += 1;
                if tries > SYNC_COMMITS {
                    r = Err(FsError::WritebackIncomplete);
                    break;
                }
                if tries > 2 {
                    tracing::warn!("sync: cached data not yet cut after {} commits", tries - 1);
                }
                pc.ask_cut();
                r = journal.commit_forced().map_err(FsError::from);
            }
            r
        } else {
            journal.commit().map(|_| ()).map_err(FsError::from)
        };
        self.check(&journal, "commit", r)?;
        Ok(())
    }

    /// Free counts from the descriptors' mirror (`FreeCounts`), without the
    /// file-system lock; the geometry does not change while mounted.
    pub fn statfs(&self) -> Result<StatFs> {
        self.live()?;
        let (fb, fi) = self.free.totals();
        Ok(self.statfs_of(fb, fi))
    }

    fn statfs_of(&self, fb: u64, fi: u64) -> StatFs {
        // Blocks reserved by cached writes are as good as used (ext4 subtracts
        // its dirty clusters the same way).
        let fb = fb.saturating_sub(self.pc.as_ref().map_or(0, |pc| pc.reserved()));
        let (blocks, r, files) = self.geometry;
        StatFs {
            block_size: self.block_size,
            blocks,
            blocks_free: fb,
            blocks_avail: fb.saturating_sub(r),
            files,
            files_free: fi,
            name_max: 255,
        }
    }

    /// The physical blocks mapped to a file, in logical order (tests check
    /// the allocator's choices with it; delayed pages have none yet).
    #[doc(hidden)]
    pub fn mapped_blocks(&self, ino: Ino) -> Result<Vec<u64>> {
        let mut g = self.lock()?;
        let inode = g.read_inode(ino)?;
        Ok(g.ext_list(ino, &inode)?
            .iter()
            .flat_map(|m| m.pblk..m.pblk + m.len as u64)
            .collect())
    }

    /// [`Fs::statfs`] summed from the group descriptors under the file-system
    /// lock (what it was before the mirror; tests compare the two).
    #[doc(hidden)]
    pub fn statfs_exact(&self) -> Result<StatFs> {
        let g = self.lock()?;
        let (fb, fi) = g.free_counts();
        Ok(self.statfs_of(fb, fi))
    }

    /// A cached inode is answered by the inode table alone (its own short lock,
    /// itable.rs), without the file-system lock; a miss reads it under `Inner`.
    pub fn getattr(&self, ino: Ino) -> Result<Attr> {
        self.live()?;
        if let Some(a) = self.cached_attr(ino) {
            return a;
        }
        self.read_locked(|g| g.getattr(ino))
    }

    pub fn lookup(&self, parent: Ino, name: &[u8]) -> Result<Attr> {
        if let Some(r) = self.lookup_cached(parent, name) {
            return r;
        }
        self.read_locked(|g| {
            let ino = g.lookup_ino(parent, name)?;
            g.getattr(ino)
        })
    }

    /// [`Fs::lookup`] answered by the directory cache and the inode table
    /// alone, without the file-system lock, when the directory's state is
    /// cached and idle and the inode cached (`None`: ask `Inner`). Under many
    /// clients lookups were the most frequent waiters on `Inner` (dbench, 10
    /// clients). The name is looked up again after the inode's attributes
    /// were read: had it been removed (and its inode number reused) in
    /// between, the state would have left the map or changed.
    fn lookup_cached(&self, parent: Ino, name: &[u8]) -> Option<Result<Attr>> {
        if name.len() > 255 {
            return Some(Err(FsError::NameTooLong));
        }
        if let Err(e) = self.live() {
            return Some(Err(e));
        }
        let ino = match self.dirs.lock().peek(parent, name)? {
            Some(ino) => ino,
            None => return Some(Err(FsError::NotFound)),
        };
        let a = self.cached_attr(ino)?;
        if self.dirs.lock().peek(parent, name)? != Some(ino) {
            return None;
        }
        Some(a)
    }

    /// Resolve an absolute path (without following symlinks), e.g. `/a/b`.
    pub fn resolve(&self, path: &str) -> Result<Ino> {
        self.read_locked(|g| {
            let mut ino = ROOT_INO;
            for comp in path.split('/').filter(|c| !c.is_empty()) {
                ino = g.lookup_ino(ino, comp.as_bytes())?;
            }
            Ok(ino)
        })
    }

    pub fn setattr(&self, ino: Ino, set: &SetAttr) -> Result<Attr> {
        self.setattr_by(ino, set, None)
    }

    /// [`Fs::setattr`] on behalf of `caller`: a truncate by a caller without
    /// `CAP_FSETID` clears setuid/setgid (see [`Caller::mode_after_change`]).
    pub fn setattr_by(&self, ino: Ino, set: &SetAttr, caller: CallerOf<'_>) -> Result<Attr> {
        // A size change frees or zeroes blocks: no read or write of them may be
        // under way.
        let il = set.size.map(|_| self.ilocks.write(ino));
        if set.size.is_some() {
            // The on-disk size and mapping must be the whole truth first.
            self.cache_settle(ino)?;
        }
        let a = match set.size {
            // A truncate zeroes the tail of the new last block, through the
            // write path (outside the lock) first.
            Some(new) => {
                let bs = self.block_size as u64;
                let zeroed = match new % bs {
                    0 => None,
                    _ => self.zero_partial_outside(ino, new, new.div_ceil(bs) * bs)?,
                };
                let span = move |g: &mut Inner| -> Result<(u64, u64)> {
                    let size = g.read_inode(ino)?.size;
                    Ok((new.min(size) / g.bs64(), u64::MAX))
                };
                // What a shrink frees, read before the lock is kept.
                let warm = move |g: &mut Inner| -> Result<()> {
                    let r = match g.read_inode(ino) {
                        Ok(i) if new < i.size => {
                            g.warm_free(ino, new.div_ceil(g.bs64()), warm::Evict::No)
                        }
                        _ => g.warm_inode(ino),
                    };
                    error::unless_miss(r).map(drop)
                };
                let r = {
                    let mut g = self.lock_guarded(Some((ino, &span)), Some(&warm))?;
                    g.zeroed_outside = zeroed.map(|(a, b)| (ino, a, b)).into_iter().collect();
                    let r = g.setattr(ino, set, caller);
                    g.zeroed_outside.clear();
                    r
                };
                // A truncate zeroes the tail of the last block in place.
                self.note_data(ino);
                if new == 0 && r.is_ok() {
                    if let Some(pc) = &self.pc {
                        pc.note_truncated_to_zero(ino);
                    }
                }
                r?
            }
            None => {
                // chmod rewrites an access ACL (`acl_chmod`): the xattr block.
                let chmod = set.mode.is_some();
                self.lock_change(|g| {
                    let r = match chmod {
                        true => g.warm_xattr(ino),
                        false => g.warm_inode(ino),
                    };
                    error::unless_miss(r).map(drop)
                })?
                .setattr(ino, set, caller)?
            }
        };
        drop(il);
        self.maybe_commit()?;
        Ok(a)
    }

    /// Call `f` for each entry from `offset` on (0 starts at "."); stop when it
    /// returns false. `f` runs under a lock of the file system (the
    /// directory cache's or `Inner`): it must not call into this `Fs`.
    pub fn readdir(
        &self,
        ino: Ino,
        offset: u64,
        mut f: impl FnMut(DirEntry) -> bool,
    ) -> Result<()> {
        // An idle cached directory is listed without the file-system lock
        // (as `lookup_cached`); its atime only takes the lock when due.
        let mut entry = |ino, ft, name: &[u8], next| f(DirEntry::of(ino, ft, name, next));
        if self.dirs.lock().peek_readdir(ino, offset, &mut entry) {
            self.readdir_atime(ino);
            return Ok(());
        }
        // The listing's blocks are read outside the lock first (a pass that
        // hands out nothing), then listed under it.
        let (mut g, ()) = self.lock_warm(|g| {
            let d = g.read_inode(ino)?;
            if !d.is_dir() {
                return Err(FsError::NotDir);
            }
            let mut n = 0usize;
            g.dir_readdir(ino, offset, &mut |_, _, _, _| {
                n += 1;
                n < READDIR_WARM
            })?;
            g.warm_atime(ino)
        })?;
        g.dir_readdir(ino, offset, &mut entry)?;
        if g.touch_atime(ino) {
            drop(g);
            self.commit_after_access();
        }
        Ok(())
    }

    /// The atime update of a listing made without the file-system lock:
    /// decided on the inode cache, taken under the lock only when due.
    fn readdir_atime(&self, ino: Ino) {
        if !atime::atime_maybe_due(&self.opts, &self.itable, ino) {
            return;
        }
        let touched = match self.lock_change(|g| g.warm_atime(ino)) {
            Ok(mut g) => g.touch_atime(ino),
            Err(_) => false,
        };
        if touched {
            self.commit_after_access();
        }
    }

    /// readdir with each entry's attributes (FUSE readdirplus): `f(entry,
    /// attr)` answers whether it took the entry; for every entry taken other
    /// than "." and "..", a reference is held as for a lookup
    /// ([`Fs::open_inode`]; the kernel's FORGET drops it). Reads at most
    /// [`READDIRPLUS_BATCH`] entries per call; continue from the last taken
    /// entry's `next_offset`. As for [`Fs::readdir`], `f` must not call into
    /// this `Fs`.
    pub fn readdir_plus(
        &self,
        ino: Ino,
        offset: u64,
        mut f: impl FnMut(&DirEntry, &Attr) -> bool,
    ) -> Result<()> {
        if let Some(r) = self.readdir_plus_cached(ino, offset, &mut f) {
            return r;
        }
        // The batch and its inodes are read outside the lock (the warm pass
        // changes nothing), then handed out under it.
        let (mut g, entries) = self.lock_warm_lenient(|g| {
            let d = g.read_inode(ino)?;
            if !d.is_dir() {
                return Err(FsError::NotDir);
            }
            let mut entries = Vec::new();
            g.dir_readdir(ino, offset, &mut |ino, ft, name, next| {
                entries.push(DirEntry::of(ino, ft, name, next));
                entries.len() < READDIRPLUS_BATCH
            })?;
            // The batch's inode-table blocks at once, not one pass each.
            let uncached: Vec<u32> = entries
                .iter()
                .filter(|e| g.itable.with(e.ino, |_| ()).is_none())
                .map(|e| e.ino)
                .collect();
            g.warm_itable_blocks(&uncached)?;
            // The attributes are taken here, in the pass that ends holding
            // the lock, and handed out below as they are: asked again, an
            // inode the pass's own reads evicted from the inode table would
            // be read under `Inner` (seen in the random tiny-cache test).
            let mut attrs = Vec::with_capacity(entries.len());
            for e in &entries {
                // Other errors are reported by the run below, as before.
                match error::unless_miss(g.getattr(e.ino))? {
                    Ok(a) => attrs.push(a),
                    Err(_) => break,
                }
            }
            let _ = error::unless_miss(g.warm_atime(ino))?;
            Ok((entries, attrs))
        })?;
        let (entries, attrs) = entries;
        let mut attrs = attrs.into_iter();
        for (k, e) in entries.iter().enumerate() {
            let got = match attrs.next() {
                Some(a) => Ok(a),
                None => g.getattr(e.ino),
            };
            let attr = match got {
                Ok(a) => a,
                // A bad inode behind a name: what was taken so far goes out;
                // alone, the error does.
                Err(err) if k == 0 => return Err(err),
                Err(_) => break,
            };
            if !f(e, &attr) {
                break;
            }
            if e.name != b"." && e.name != b".." {
                g.itable.open(e.ino);
            }
        }
        if g.touch_atime(ino) {
            drop(g);
            self.commit_after_access();
        }
        Ok(())
    }

    /// [`Fs::readdir_plus`] of an idle cached directory whose entries' inodes
    /// are cached, without the file-system lock (`None`: ask `Inner`). The
    /// batch is read from the directory cache, the attributes from the inode
    /// table, and the names checked again before any is handed out (as
    /// [`Self::lookup_cached`]); a batch with an inode not cached goes to
    /// `Inner` whole.
    fn readdir_plus_cached(
        &self,
        ino: Ino,
        offset: u64,
        f: &mut impl FnMut(&DirEntry, &Attr) -> bool,
    ) -> Option<Result<()>> {
        if let Err(e) = self.live() {
            return Some(Err(e));
        }
        let mut entries = Vec::new();
        let listed = self
            .dirs
            .lock()
            .peek_readdir(ino, offset, &mut |ino, ft, name, next| {
                entries.push(DirEntry::of(ino, ft, name, next));
                entries.len() < READDIRPLUS_BATCH
            });
        if !listed {
            return None;
        }
        let mut attrs: Vec<Attr> = Vec::with_capacity(entries.len());
        for e in &entries {
            match self.cached_attr(e.ino) {
                Some(Ok(a)) => attrs.push(a),
                // Not cached (a cold listing), or gone meanwhile: the whole
                // batch under `Inner`, which reads the inodes (a short batch
                // would cost the kernel one more request).
                _ => return None,
            }
        }
        {
            // Under the cache's lock: each name checked again, handed out and
            // its reference taken before a removal can take the state out of
            // the map (which then finds the inode open and keeps it).
            let mut d = self.dirs.lock();
            for (k, (e, a)) in entries.iter().zip(&attrs).enumerate() {
                let dots = e.name == b"." || e.name == b"..";
                if !dots && d.peek(ino, &e.name) != Some(Some(e.ino)) {
                    if k == 0 {
                        return None;
                    }
                    break;
                }
                if !f(e, a) {
                    break;
                }
                if !dots {
                    self.itable.open(e.ino);
                }
            }
        }
        self.readdir_atime(ino);
        Some(Ok(()))
    }

    /// All entries of a directory, including "." and "..".
    pub fn readdir_all(&self, ino: Ino) -> Result<Vec<DirEntry>> {
        let mut v = Vec::new();
        self.readdir(ino, 0, |e| {
            v.push(e);
            true
        })?;
        Ok(v)
    }

    /// Create a regular file with permission bits `perm`. A default ACL of the
    /// directory is inherited and masks `perm` (see [`Fs::create_umask`]).
    pub fn create(&self, parent: Ino, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        self.create_umask(parent, name, perm, 0, uid, gid)
    }

    /// [`Fs::create`] as the kernel's `open(O_CREAT)`: `umask` applies unless the
    /// directory has a default ACL, which then masks `perm` instead (ext4).
    pub fn create_umask(
        &self,
        parent: Ino,
        name: &[u8],
        perm: u16,
        umask: u16,
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        let mode = FileType::Regular.mode_bits() | (perm & 0o7777);
        let a = self.retry_nospace_warm(
            |g| g.warm_create(parent, name, false, false),
            |g| g.create_node_umask(parent, name, mode, umask, 0, uid, gid, None),
        )?;
        self.maybe_commit()?;
        Ok(a)
    }

    /// Create a node of any non-directory type; `mode` includes the type bits.
    pub fn mknod(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u16,
        rdev: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        self.mknod_umask(parent, name, mode, 0, rdev, uid, gid)
    }

    /// [`Fs::mknod`] with the caller's umask (see [`Fs::create_umask`]).
    #[allow(clippy::too_many_arguments)]
    pub fn mknod_umask(
        &self,
        parent: Ino,
        name: &[u8],
        mode: u16,
        umask: u16,
        rdev: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        match FileType::from_mode(mode) {
            Some(FileType::Directory) | Some(FileType::Symlink) | None => {
                Err(FsError::Invalid("mknod: bad file type"))
            }
            _ => self.retry_nospace_warm(
                |g| g.warm_create(parent, name, false, false),
                |g| g.create_node_umask(parent, name, mode, umask, rdev, uid, gid, None),
            ),
        }
    }

    /// Create a directory; it inherits a default ACL of its parent as its own
    /// default ACL and, masked, as its access ACL.
    pub fn mkdir(&self, parent: Ino, name: &[u8], perm: u16, uid: u32, gid: u32) -> Result<Attr> {
        self.mkdir_umask(parent, name, perm, 0, uid, gid)
    }

    /// [`Fs::mkdir`] with the caller's umask (see [`Fs::create_umask`]).
    pub fn mkdir_umask(
        &self,
        parent: Ino,
        name: &[u8],
        perm: u16,
        umask: u16,
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        let mode = FileType::Directory.mode_bits() | (perm & 0o7777);
        // Through `lock` like every other change: errors=panic refuses it.
        self.lock_change(|g| g.warm_create(parent, name, true, true))?
            .create_node_umask(parent, name, mode, umask, 0, uid, gid, None)
    }

    pub fn symlink(
        &self,
        parent: Ino,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        let mode = FileType::Symlink.mode_bits() | 0o777;
        // A target of 60 bytes or more needs a block (a slow symlink).
        self.retry_nospace_warm(
            |g| g.warm_create(parent, name, false, target.len() >= 60),
            |g| g.create_node(parent, name, mode, 0, uid, gid, Some(target)),
        )
    }

    pub fn readlink(&self, ino: Ino) -> Result<Vec<u8>> {
        // The inode and a slow symlink's mapping read outside the lock, its
        // block after it, under the inode's lock (nothing frees it meanwhile).
        let _il = self.ilocks.read(ino);
        match self.read_locked(|g| g.readlink_begin(ino))? {
            ops::LinkTarget::Inline(target) => Ok(target),
            ops::LinkTarget::Block(n, segs) => {
                // Through the journal's cache, outside `Inner`: the block is
                // written as metadata (`Inner::init_symlink`), so its home
                // may be older than the copy a commit logged.
                let mut buf = vec![0u8; n];
                for s in &segs {
                    let dst = &mut buf[s.pos..s.pos + s.span];
                    match s.pblk {
                        Some(p) => {
                            self.dio.check_range(p, self.block_size as usize)?;
                            let b = self.journal.bread(p)?;
                            dst.copy_from_slice(&b.data()[s.in_blk..s.in_blk + s.span]);
                        }
                        None => dst.fill(0),
                    }
                }
                Ok(buf)
            }
        }
    }

    pub fn link(&self, ino: Ino, new_parent: Ino, new_name: &[u8]) -> Result<Attr> {
        self.retry_nospace_warm(
            |g| {
                g.warm_lookup(new_parent, new_name)?;
                let _ = error::unless_miss(g.warm_inode(ino))?;
                let _ = error::unless_miss(g.warm_dir_growth(new_parent))?;
                let _ = error::unless_miss(g.warm_inode(new_parent))?;
                g.warm_dir_state(new_parent)?;
                g.warm_dir_change(new_parent, Some(new_name), None, false)
            },
            |g| g.link(ino, new_parent, new_name),
        )
    }

    pub fn unlink(&self, parent: Ino, name: &[u8]) -> Result<()> {
        // The last link of a closed file frees its blocks: under its inode lock,
        // taken before the file-system lock (so looked up first, and checked again).
        loop {
            let victim = self.victim_hint(parent, name)?;
            let _il = self.ilocks.write(victim);
            let mut g = self.lock_change(|g| g.warm_remove(parent, name))?;
            if g.lookup_ino(parent, name)? != victim {
                continue;
            }
            g.unlink(parent, name)?;
            break;
        }
        self.maybe_commit()
    }

    /// The inode `name` in `parent` names, to lock before `Inner` (unlink's
    /// and rename's victim): from the directory cache without `Inner` when the
    /// directory is cached. A hint only: the caller checks it again under
    /// `Inner` and retries if the name moved meanwhile.
    fn victim_hint(&self, parent: Ino, name: &[u8]) -> Result<Ino> {
        // The cache's guard ends here: `Inner` comes before `dirs` (dir.rs).
        let peeked = self.dirs.lock().peek(parent, name);
        match peeked {
            Some(Some(ino)) => Ok(ino),
            _ => self.read_locked(|g| g.lookup_ino(parent, name)),
        }
    }

    pub fn rmdir(&self, parent: Ino, name: &[u8]) -> Result<()> {
        self.lock_change(|g| g.warm_remove(parent, name))?
            .rmdir(parent, name)
    }

    pub fn rename(
        &self,
        parent: Ino,
        name: &[u8],
        new_parent: Ino,
        new_name: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
        if !flags.exchange {
            if let Err(e) = self.auto_da_alloc_rename((parent, name), (new_parent, new_name)) {
                // Best effort, as ext4's: the rename goes on; an I/O error is
                // the next fsync's to report (data_errors), ENOSPC leaves
                // pages dirty.
                tracing::warn!("rename: write-back of the renamed file first: {e}");
            }
        }
        // A replaced target may be freed: under its inode lock, as in unlink.
        loop {
            let victim = if flags.exchange {
                None
            } else {
                self.victim_hint(new_parent, new_name).ok()
            };
            let _il = victim.map(|v| self.ilocks.write(v));
            let mut moved = false;
            let warm = |g: &mut Inner| g.warm_rename((parent, name), (new_parent, new_name));
            let r = self.retry_nospace_warm(warm, |g| {
                if !flags.exchange && g.lookup_ino(new_parent, new_name).ok() != victim {
                    moved = true;
                    return Ok(());
                }
                g.rename(parent, name, new_parent, new_name, flags)
            });
            if !moved {
                return r;
            }
        }
    }

    /// `data_order=file`: renaming a file over an existing one writes the
    /// renamed file's cached data back first, so the rename never commits
    /// before the data it now names (ext4's `auto_da_alloc`: the
    /// write-to-temporary-then-rename idiom survives a crash without fsync).
    fn auto_da_alloc_rename(
        &self,
        (parent, name): (Ino, &[u8]),
        (new_parent, new_name): (Ino, &[u8]),
    ) -> Result<()> {
        let Some(pc) = self
            .pc
            .as_ref()
            .filter(|pc| pc.per_file() && pc.has_dirty())
        else {
            return Ok(());
        };
        let (src, replaces) = self.read_locked(|g| {
            let src = error::unless_miss(g.lookup_ino(parent, name))?.ok();
            let replaces = error::unless_miss(g.lookup_ino(new_parent, new_name))?.is_ok();
            Ok((src, replaces))
        })?;
        match src {
            Some(s) if replaces && pc.is_dirty(s) => self.writeback_file(s),
            _ => Ok(()),
        }
    }

    /// Note an open file handle (an unlinked file stays until its last close).
    pub fn open_inode(&self, ino: Ino) -> Result<()> {
        // Every LOOKUP reply takes one: a cached live inode counts in the
        // inode table alone (`InodeTable::open_if_live`).
        if self.itable.open_if_live(ino).is_some() {
            return Ok(());
        }
        let (g, ()) = self.lock_warm(|g| g.read_inode(ino).map(drop))?;
        g.itable.open(ino);
        Ok(())
    }

    /// Close a file handle opened with [`Fs::open_inode`].
    pub fn release(&self, ino: Ino) -> Result<()> {
        if self
            .pc
            .as_ref()
            .is_some_and(|pc| pc.take_da_alloc_close(ino))
        {
            // data_order=file: truncated to zero and rewritten (ext4's
            // auto_da_alloc at close); an error is the next fsync's to report.
            if let Err(e) = self.writeback_file(ino) {
                tracing::warn!("close: write-back of inode {ino} after truncate: {e}");
            }
        }
        // The last close of an unlinked file frees its blocks, under the
        // file-system lock; any other close only counts, in the inode table.
        let _il = self.ilocks.write(ino);
        if self.itable.release_unless_last_unlinked(ino) {
            return Ok(());
        }
        self.lock_change(|g| {
            error::unless_miss(g.warm_free(ino, 0, warm::Evict::Orphan)).map(drop)
        })?
        .release(ino)
    }

    /// Read file data; updates atime under the mount's atime policy.
    ///
    /// The blocks are mapped under the file-system lock and read from the device
    /// outside it, under the inode's lock (shared): nothing can free them
    /// meanwhile (every path that frees or remaps blocks holds it exclusively).
    pub fn read(&self, ino: Ino, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let il = self.ilocks.read(ino);
        if let Some(pc) = &self.pc {
            if let Some((n, atime)) = self.read_cached(pc, ino, offset, buf)? {
                drop(il);
                if atime {
                    self.commit_after_access();
                }
                return Ok(n);
            }
        }
        let (n, segs, atime) = {
            // The inode and extent blocks are read outside the lock.
            let (mut g, (n, segs)) = self.lock_warm(|g| {
                let r = g.read_begin(ino, offset, buf.len())?;
                g.warm_atime(ino)?;
                Ok(r)
            })?;
            (n, segs, !buf.is_empty() && g.touch_atime(ino))
        };
        let r = self.dio.read_segs(&segs, &mut buf[..n]);
        drop(il);
        if atime {
            self.commit_after_access();
        }
        r.map(|()| n)
    }

    /// A read the page cache answers whole, with no data read from the
    /// device and no wait for a writer of this file: `None` when it would
    /// need either (ask [`Self::read`] then). As any cached read, it may
    /// take `Inner` for a due atime update (and commit under `strictatime`).
    /// For a front end with few event loops: `commitfs-fuse` answers hits
    /// on its loop and hands the rest to threads that may block, so that
    /// readahead's concurrent reads reach the device together instead of
    /// one after another.
    pub fn read_if_cached(&self, ino: Ino, offset: u64, buf: &mut [u8]) -> Result<Option<usize>> {
        let Some(pc) = &self.pc else {
            return Ok(None);
        };
        let Some(il) = self.ilocks.try_read(ino) else {
            return Ok(None);
        };
        let n = match pc.read(ino, offset, buf) {
            Some((n, hits)) if n > 0 && hits.iter().all(|&h| h) => n,
            _ => return Ok(None),
        };
        let atime = self.cached_read_done(ino)?;
        drop(il);
        if atime {
            self.commit_after_access();
        }
        Ok(Some(n))
    }

    /// lseek(2) `SEEK_DATA` (`data`) or `SEEK_HOLE` (see
    /// [`Inner::seek_data_hole`]): under the inode's read lock, so no write of
    /// this file is half done.
    pub fn seek_data_hole(&self, ino: Ino, offset: u64, data: bool) -> Result<u64> {
        // Cached data counts: its blocks are mapped first.
        self.writeback_file(ino)?;
        let _il = self.ilocks.read(ino);
        self.read_locked(|g| g.seek_data_hole(ino, offset, data))
    }

    /// copy_file_range(2) as a plain copy (nothing is shared): up to `len`
    /// bytes from `src` at `src_off` to `dst` at `dst_off`, stopping at the end of
    /// `src`; returns the bytes copied. A hole of the source becomes a hole of
    /// the destination where the destination had nothing yet (past its end), and
    /// zeros elsewhere. Overlapping ranges of one file are refused (EINVAL), as
    /// the kernel does.
    pub fn copy_file_range(
        &self,
        src: Ino,
        src_off: u64,
        dst: Ino,
        dst_off: u64,
        len: u64,
        caller: CallerOf<'_>,
    ) -> Result<u64> {
        if src == dst
            && src_off < dst_off.saturating_add(len)
            && dst_off < src_off.saturating_add(len)
        {
            return Err(FsError::Invalid(
                "copy_file_range: overlapping ranges of one file",
            ));
        }
        let src_size = self.getattr(src)?.size;
        dst_off
            .checked_add(len.min(src_size))
            .ok_or(FsError::FileTooBig)?;
        let end = src_size.min(src_off.saturating_add(len));
        if src_off >= end {
            return Ok(0);
        }
        let mut dst_size = self.getattr(dst)?.size;
        let mut buf = vec![0u8; COPY_CHUNK.min(end - src_off) as usize];
        let mut pos = src_off;
        while pos < end {
            let at = dst_off + (pos - src_off);
            let data_at = match self.seek_data_hole(src, pos, true) {
                Ok(d) => d.min(end),
                Err(FsError::NoSuchOffset) => end,
                Err(e) => return Err(e),
            };
            let n = if data_at > pos {
                // A hole up to `data_at`: zeros where the destination has bytes.
                let n = (data_at - pos).min(buf.len() as u64) as usize;
                if at < dst_size {
                    let z = n.min((dst_size - at) as usize);
                    buf[..z].fill(0);
                    self.write_all_by(dst, at, &buf[..z], caller)?;
                }
                n
            } else {
                let hole_at = match self.seek_data_hole(src, pos, false) {
                    Ok(h) => h.min(end),
                    Err(FsError::NoSuchOffset) => end,
                    Err(e) => return Err(e),
                };
                let n = (hole_at - pos).min(buf.len() as u64) as usize;
                let got = self.read(src, pos, &mut buf[..n])?;
                if got == 0 {
                    break;
                }
                self.write_all_by(dst, at, &buf[..got], caller)?;
                got
            };
            pos += n as u64;
            dst_size = dst_size.max(at + n as u64);
        }
        // A source range ending in a hole: the destination still grows over it.
        let want = dst_off + (pos - src_off);
        if self.getattr(dst)?.size < want {
            let set = SetAttr {
                size: Some(want),
                ..Default::default()
            };
            self.setattr_by(dst, &set, caller)?;
        }
        Ok(pos - src_off)
    }

    /// Write all of `data` at `off` (a short write is retried; none at all is
    /// ENOSPC).
    fn write_all_by(&self, ino: Ino, off: u64, data: &[u8], caller: CallerOf<'_>) -> Result<()> {
        let mut done = 0;
        while done < data.len() {
            let w = self.write_by(ino, off + done as u64, &data[done..], caller)?;
            if w == 0 {
                return Err(FsError::NoSpace);
            }
            done += w;
        }
        Ok(())
    }

    /// Write by a privileged caller (setuid/setgid bits stay).
    pub fn write(&self, ino: Ino, offset: u64, data: &[u8]) -> Result<usize> {
        self.write_by(ino, offset, data, None)
    }

    /// Write on behalf of `caller`, clearing setuid/setgid like the kernel's
    /// `file_remove_privs` (see [`Caller::mode_after_change`]).
    pub fn write_by(
        &self,
        ino: Ino,
        offset: u64,
        data: &[u8],
        caller: CallerOf<'_>,
    ) -> Result<usize> {
        if let Some(pc) = &self.pc {
            return self.write_cached(pc, ino, offset, data, caller);
        }
        let il = self.ilocks.write(ino);
        let n = self.write_uncached(ino, offset, data, caller)?;
        drop(il);
        self.maybe_commit()?;
        Ok(n)
    }

    /// Zero bytes `[from, to)` of `ino` (inside one block) through the write
    /// path, so that the data I/O happens outside `Inner` (C.2) with the
    /// write path's ordering and `fc_data_csum` guards: the partial block a
    /// truncate or a punch leaves (ext4's `block_truncate_page` zeroes it in
    /// the page cache too). Only bytes below the size, of a block mapped and
    /// written: a hole or an unwritten extent reads as zeros already. The
    /// caller holds the inode's lock exclusively and has settled its cache;
    /// the operation that follows skips those bytes (`Inner::zeroed_outside`;
    /// bytes of the block past the end of file, which a write cannot reach
    /// without extending the file, are still zeroed by the operation).
    /// Returns the byte range it zeroed.
    fn zero_partial_outside(&self, ino: Ino, from: u64, to: u64) -> Result<Option<(u64, u64)>> {
        let bs = self.block_size as u64;
        let lblk = (from / bs) as u32;
        if from >= to || from / bs != (to - 1) / bs {
            return Ok(None);
        }
        let (g, (size, m)) = self.lock_warm(|g| {
            let i = g.live_inode(ino)?;
            if !i.is_reg() {
                return Ok((0, None));
            }
            Ok((i.size, g.ext_map(ino, &i, lblk)?))
        })?;
        drop(g);
        let to = to.min(size);
        if from >= to || m.is_none_or(|m| m.unwritten) {
            return Ok(None);
        }
        let zeros = vec![0u8; (to - from) as usize];
        match &self.pc {
            Some(pc) => {
                while self
                    .write_cached_once(pc, ino, from, &zeros, None)?
                    .is_none()
                {}
                // Written back now: the operation after it changes the
                // mapping, which must be the whole truth.
                self.cache_settle(ino)?;
            }
            None => {
                if self.write_uncached(ino, from, &zeros, None)? < zeros.len() {
                    // Short (a device error, recorded for the next fsync):
                    // the operation zeroes the block itself.
                    return Ok(None);
                }
            }
        }
        Ok(Some((from, to)))
    }

    /// The write-through path of [`Self::write_by`] (`-o nocache`); the
    /// caller holds the inode's lock exclusively.
    fn write_uncached(
        &self,
        ino: Ino,
        offset: u64,
        data: &[u8],
        caller: CallerOf<'_>,
    ) -> Result<usize> {
        let end = offset.saturating_add(data.len() as u64);
        let span = move |g: &mut Inner| -> Result<(u64, u64)> {
            let size = g.read_inode(ino)?.size;
            Ok((offset.min(size) / g.bs64(), end.div_ceil(g.bs64())))
        };
        let warm = move |g: &mut Inner| -> Result<()> {
            let (lo, hi) = (offset / g.bs64(), end.div_ceil(g.bs64()));
            error::unless_miss(g.warm_map(ino, lo, hi)).map(drop)
        };
        let Some(b) = self.retry_nospace_guarded(Some((ino, &span)), Some(&warm), |g| {
            g.write_begin(ino, offset, data.len(), caller)
        })?
        else {
            return Ok(0);
        };
        // The data, outside the file-system lock: under the inode's lock and the
        // handle of the transaction that maps the blocks (dataio.rs).
        let mut failed = None;
        for (k, c) in b.chunks.iter().enumerate() {
            if let Err(e) = self.dio.write_chunk(c, &data[c.pos..c.pos + c.span]) {
                failed = Some((k, e));
                break;
            }
        }
        let dataio::WriteBegun {
            chunks,
            old_size,
            inflight,
            h,
        } = b;
        drop(inflight);
        drop(h);
        // Its next fsync needs a flush that starts after these writes.
        self.note_data(ino);
        let mut n = chunks.iter().map(|c| c.span).sum();
        if let Some((k, e)) = failed {
            n = chunks[k].pos;
            let device = matches!(e, FsError::Device(_));
            if device {
                // The next fsync reports the loss (the writer sees it too when
                // nothing was written).
                self.data_errors.insert(ino);
            }
            let undo = self
                .lock()
                .and_then(|mut g| g.write_undo(ino, offset, n, &chunks[k..], old_size));
            if let Err(u) = undo {
                tracing::warn!("undoing the mapping of a failed data write of inode {ino}: {u}");
            }
            if !device || n == 0 {
                return Err(e);
            }
        }
        Ok(n)
    }

    /// `fallocate` by a privileged caller (setuid/setgid bits stay).
    pub fn fallocate(&self, ino: Ino, offset: u64, len: u64, flags: FallocFlags) -> Result<()> {
        self.fallocate_by(ino, offset, len, flags, None)
    }

    /// `fallocate` on behalf of `caller`: like every data change by a caller
    /// without `CAP_FSETID`, it clears setuid (and setgid, by the kernel's rule:
    /// [`Caller::mode_after_change`]) in the same transaction. FUSE passes no
    /// "kill privileges" hint with fallocate, so the daemon must decide.
    pub fn fallocate_by(
        &self,
        ino: Ino,
        offset: u64,
        len: u64,
        flags: FallocFlags,
        caller: CallerOf<'_>,
    ) -> Result<()> {
        let end = offset.saturating_add(len);
        let span = move |g: &mut Inner| -> Result<(u64, u64)> {
            let size = g.read_inode(ino)?.size;
            Ok((offset.min(size) / g.bs64(), end.div_ceil(g.bs64())))
        };
        // Allocating and punching both walk the range's tree; a punch (or a
        // zeroed range) frees the whole blocks inside it: their bitmaps.
        let warm = move |g: &mut Inner| -> Result<()> {
            let (lo, hi) = (offset / g.bs64(), end.div_ceil(g.bs64()));
            let _ = error::unless_miss(g.warm_map(ino, lo, hi))?;
            if flags.punch_hole || flags.zero_range {
                let r = g.warm_free_range(ino, offset.div_ceil(g.bs64()), hi, warm::Evict::No);
                let _ = error::unless_miss(r)?;
            }
            // A zeroed range maps its whole blocks again where a new
            // allocation goes.
            if flags.zero_range {
                let r = g.warm_realloc(ino, offset.div_ceil(g.bs64()), end / g.bs64());
                let _ = error::unless_miss(r)?;
            }
            Ok(())
        };
        let il = self.ilocks.write(ino);
        self.cache_settle(ino)?;
        // A punch or a zeroed range zeroes its partial edge blocks: through
        // the write path (outside the lock) first, when the call is valid.
        let mut zeroed = Vec::new();
        let bs = self.block_size as u64;
        if ((flags.punch_hole && flags.keep_size) || (flags.zero_range && !flags.punch_hole))
            && len > 0
            && end <= file::max_file_size(self.block_size as usize)
        {
            let size = self.lock_warm(|g| g.live_inode(ino).map(|i| i.size))?.1;
            let (edges, _) = file::falloc_zero_plan(offset, end, size, flags, bs);
            for (a, b) in edges {
                zeroed.extend(
                    self.zero_partial_outside(ino, a, b)?
                        .map(|(a, b)| (ino, a, b)),
                );
            }
        }
        let r = self.retry_nospace_guarded(Some((ino, &span)), Some(&warm), |g| {
            g.zeroed_outside.clone_from(&zeroed);
            let r = g.fallocate(ino, offset, len, flags, caller);
            g.zeroed_outside.clear();
            r
        });
        self.note_data(ino);
        r?;
        drop(il);
        self.maybe_commit()
    }

    pub fn getxattr(&self, ino: Ino, name: &[u8]) -> Result<Vec<u8>> {
        if let Some(r) = self.getxattr_cached(ino, name) {
            return r;
        }
        self.read_locked(|g| {
            if name.starts_with(b"user.") && !g.user_xattr_allowed(ino)? {
                return Err(FsError::NoData);
            }
            g.xattr_get(ino, name)
        })
    }

    /// [`Fs::getxattr`] of a cached inode without an xattr block, from its
    /// in-inode area alone, without the file-system lock: the kernel asks for
    /// `security.capability` before the first write after every attribute
    /// refresh, and under many writers those GETXATTRs queued on `Inner`
    /// behind commits and write-backs (dbench, 10 clients: one wait on
    /// `Inner` in nine was a GETXATTR's). `None`: ask `Inner` (not cached,
    /// an xattr block, an ACL, a name or area it would reject).
    fn getxattr_cached(&self, ino: Ino, name: &[u8]) -> Option<Result<Vec<u8>>> {
        if let Err(e) = self.live() {
            return Some(Err(e));
        }
        let (index, suffix) = xattr::split_for_get(name)?;
        let r = self.itable.with_live(ino, |i| {
            if i.file_acl != 0 {
                return None;
            }
            if name.starts_with(b"user.") && !(i.is_reg() || i.is_dir()) {
                return Some(Err(FsError::NoData));
            }
            let ibody = commitfs_format::xattr::parse_ibody(&i.xattr_area, 0).ok()?;
            Some(
                ibody
                    .into_iter()
                    .find(|e| e.index == index && e.name == suffix)
                    .map(|e| e.value)
                    .ok_or(FsError::NoData),
            )
        })?;
        match r {
            Ok(r) => r,
            Err(e) => Some(Err(e)),
        }
    }

    pub fn listxattr(&self, ino: Ino) -> Result<Vec<Vec<u8>>> {
        self.read_locked(|g| g.xattr_list(ino))
    }

    /// Set an attribute. `system.posix_acl_access` also sets the mode (and is not
    /// stored when the mode says it all); `system.posix_acl_default` only exists
    /// on directories. Both have the kernel's VFS format.
    pub fn setxattr(&self, ino: Ino, name: &[u8], value: &[u8], flags: XattrFlags) -> Result<()> {
        self.setxattr_ext(ino, name, value, flags, false)
    }

    /// [`Fs::setxattr`]; `acl_kill_sgid` (FUSE_SETXATTR_ACL_KILL_SGID): an access
    /// ACL also clears S_ISGID, because the caller is neither in the file's group
    /// nor has CAP_FSETID.
    pub fn setxattr_ext(
        &self,
        ino: Ino,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        acl_kill_sgid: bool,
    ) -> Result<()> {
        self.retry_nospace_warm(
            |g| error::unless_miss(g.warm_xattr(ino)).map(drop),
            |g| {
                if name.starts_with(b"user.") && !g.user_xattr_allowed(ino)? {
                    return Err(FsError::Permission("user xattrs on a special file"));
                }
                let h = g.start(8)?;
                g.fc_ineligible(fc::FcReason::Xattr, h.tid());
                let r = g.xattr_set_ext(&h, ino, name, value, flags, acl_kill_sgid);
                g.stop(h)?;
                r
            },
        )
    }

    pub fn removexattr(&self, ino: Ino, name: &[u8]) -> Result<()> {
        let mut g = self.lock_change(|g| error::unless_miss(g.warm_xattr(ino)).map(drop))?;
        if name.starts_with(b"user.") && !g.user_xattr_allowed(ino)? {
            return Err(FsError::Permission("user xattrs on a special file"));
        }
        let h = g.start(8)?;
        g.fc_ineligible(fc::FcReason::Xattr, h.tid());
        let r = g.xattr_remove(&h, ino, name);
        g.stop(h)?;
        r
    }

    /// Make the file's data and metadata durable (and, like ext4, every change
    /// committed before it). On a `fast_commit` image an eligible fsync writes one
    /// compact logical log in the caller's thread (usually one block, with a flush
    /// only when data or earlier log blocks must be durable first); otherwise, or
    /// when something ineligible happened, a full JBD2 commit.
    ///
    /// After an I/O error an fsync never claims durability it lacks: EIO once
    /// the journal is aborted (every later fsync too), and EIO once for a file
    /// whose data write failed since its last fsync.
    pub fn fsync(&self, ino: Ino, datasync: bool) -> Result<()> {
        self.live()?;
        let j = self.journal.clone();
        let data_err = self.data_errors.take(ino);
        if j.is_aborted() {
            return Err(commitfs_journal::JournalError::Aborted.into());
        }
        let r = self.fsync_inner(ino, datasync);
        self.check(&j, "fsync", r)?;
        if data_err {
            return Err(FsError::DataWriteFailed);
        }
        Ok(())
    }

    /// Group commit (jbd2 `jbd2_complete_transaction`, ext4 `ext4_fc_commit`):
    /// the fsync notes what covers it on entry — the running tid, the fast-commit
    /// tracker's change counter and the flush generation of the last data write —
    /// and returns as soon as something durable covers all three, however many
    /// other fsyncs that commit or flush served. One fsync at a time leads a fast
    /// commit (`fc_lock`); those queued behind it usually find themselves covered
    /// when they get the lock and return without I/O.
    fn fsync_inner(&self, ino: Ino, datasync: bool) -> Result<()> {
        // Its cached data first (allocation, data write): from here on the
        // rules of the write-through path apply unchanged. Pages a cut is
        // still writing are waited for (their data generation is noted when
        // written).
        self.writeback_file(ino)?;
        if let Some(pc) = &self.pc {
            // data_order=file: a fast commit may carry other files'
            // truncates to zero; their rewritten data goes first (as every
            // full commit's cut does, `CacheHooks::cut`). Best effort, as
            // ext4's auto_da_alloc: a failure is that file's next fsync's.
            for m in pc.da_alloc_dirty() {
                if m != ino {
                    if let Err(e) = self.writeback_file(m) {
                        tracing::warn!("fsync: write-back of inode {m} after truncate: {e}");
                    }
                }
            }
            pc.wait_written(ino, &|| self.journal.is_aborted());
        }
        // The home copy of this inode's inode-table block, which the fast
        // commit's INODE record compares with (`Journal::replay_bases`): read
        // here, without `Inner`, rather than by the plan under it. Best
        // effort: a failed read is the plan's to report.
        if let Some(blk) = self.itable_loc.as_ref().and_then(|l| l.block_of(ino)) {
            let _ = self.journal.warm_home(blk);
        }
        // The entry values: the running tid, the tracker's change counter and
        // fdatasync's stamp. Without `Inner` (C.1: the tracker's durability
        // state and the stamps have locks of their own) when the inode is
        // cached and has no lazytime atime to write (an fsync writes it, as
        // the kernel's does): every change an operation made is tracked and
        // stamped before it returns, so values read after that cover it. A
        // stamp read beside a concurrent operation may belong to a change
        // these values do not cover; it is cleared only once a durable commit
        // carries its change (`Stamp::made_durable`: its transaction, or a
        // fast commit planned after the operation), never on this fsync's
        // word alone. A stamp a durable commit carries counts as none
        // (fdatasync owes it nothing; pruning drops committed ones).
        if self.itable.with(ino, |_| ()).is_none() || (!datasync && self.itable.has_lazy(ino)) {
            let mut g = self.lock_change(|g| g.warm_inode(ino))?;
            g.read_inode(ino)?;
            if !datasync {
                g.flush_lazy_atimes(Some(ino))?;
            }
        }
        let j = self.journal.clone();
        let (entry_tid, entry_seq, stamp) = (
            j.running_tid(),
            self.fcd.seq(),
            self.datasync.lock().get(ino),
        );
        let carried = |st: &inner::Stamp| st.made_durable(&j, self.fcd.lock().durable_upto);
        let stamp = match stamp {
            Some(st) if carried(&st) => {
                // Done with: forget it unless the inode changed since.
                self.datasync.lock().clear_if(ino, st);
                None
            }
            st => st,
        };
        let dgen = self.data_gens.lock().get(&ino).copied();
        let fc_on = self.fc_on;
        if datasync && stamp.is_none() {
            // C.5 (ext4's i_datasync_tid): what fdatasync must persist besides
            // the data — size, mapping — is durable already; timestamps of an
            // in-place overwrite can wait for the next commit. Only the data's
            // flush remains (none when nothing was written since the last).
            use std::sync::atomic::Ordering::Relaxed;
            self.fsyncs.fetch_add(1, Relaxed);
            self.fdatasyncs_data_only.fetch_add(1, Relaxed);
            if let Some(g) = dgen {
                j.wait_data(g)?;
                let mut m = self.data_gens.lock();
                if m.get(&ino) == Some(&g) {
                    m.remove(&ino);
                }
            }
            return Ok(());
        }
        // Cached writes of every file that returned before this fsync: a cut
        // must have taken them into a durable commit (data_order=prefix; under
        // data_order=file its own write-back above is all the fsync owes).
        let wseq = self
            .pc
            .as_ref()
            .filter(|pc| !pc.per_file())
            .map(|pc| pc.wseq());
        let r = self.fsync_covered(&j, (entry_tid, entry_seq, wseq), dgen, fc_on);
        if let (Ok(()), Some(stamp)) = (&r, stamp) {
            // Everything changed before the entry is durable now: unless the
            // inode changed since, or the stamp belongs to a concurrent
            // change no durable commit carries yet, its next fdatasync needs
            // no commit.
            if carried(&stamp) {
                self.datasync.lock().clear_if(ino, stamp);
            }
        }
        if r.is_ok() {
            if let Some(g) = dgen {
                let mut m = self.data_gens.lock();
                if m.get(&ino) == Some(&g) && j.flushed_since(g) {
                    m.remove(&ino);
                }
            }
        }
        r
    }

    /// [`Self::fsync_inner`] once the entry values are noted.
    fn fsync_covered(
        &self,
        j: &Arc<commitfs_journal::Journal>,
        (entry_tid, entry_seq, wseq): (u32, u64, Option<u64>),
        dgen: Option<u64>,
        fc_on: bool,
    ) -> Result<()> {
        let data_done = |j: &commitfs_journal::Journal| dgen.is_none_or(|g| j.flushed_since(g));
        let wait_data = |j: &commitfs_journal::Journal| -> Result<()> {
            if let Some(g) = dgen {
                j.wait_data(g)?;
            }
            Ok(())
        };
        self.fsyncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if !fc_on {
            // JBD2 mode: the journal's group commit (concurrent callers share
            // commits and flushes).
            return self.sync_for(entry_tid, dgen, wseq);
        }
        let _active = ActiveFsync::enter(&self.fsync_active, &self.fsync_peak);
        self.fsync_seq_max
            .fetch_max(entry_seq, std::sync::atomic::Ordering::AcqRel);
        if let Some(w) = wseq {
            self.fsync_wseq_max
                .fetch_max(w, std::sync::atomic::Ordering::AcqRel);
        }
        self.fsync_arrivals
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let t0 = std::time::Instant::now();
        let mut batched = false;
        let mut _fcl = None;
        loop {
            // Whether something durable covers this fsync, checked on the
            // tracker's durability state alone (C.1): a fast commit's
            // followers, woken at once, do not queue on `Inner` for it.
            let (meta_covered, pending) = {
                let mut d = self.fcd.lock();
                self.fc_harvest(&mut d);
                // After the harvest, which may mark a cut durable.
                let cache_ok = self.cache_covered(wseq);
                let meta_covered = d.covered(entry_seq) || j.is_committed(entry_tid);
                if meta_covered && cache_ok && data_done(j) {
                    d.stats.skipped += 1;
                    return Ok(());
                }
                let pending = match meta_covered && cache_ok {
                    true => None,
                    false => self.fc_pending_cover(&d, entry_seq, entry_tid, wseq),
                };
                (meta_covered && cache_ok, pending)
            };
            if let Some(pg) = pending {
                // A chained fast commit written but not yet durable covers
                // this fsync: wait for the flush that makes it so (leading
                // nothing: let another leader write the next one).
                _fcl = None;
                j.wait_data(pg)?;
                continue;
            }
            if _fcl.is_none() {
                // Lead, or wait for the leader's fast commit and check again:
                // every follower wakes at once (no queue on a mutex).
                _fcl = self.fc_lock.lead_or_wait();
                continue;
            }
            if j.full_commit_in_flight() {
                // The kernel waits for an ongoing full commit, then checks again:
                // it often covers this fsync.
                j.wait_full_commits()?;
                continue;
            }
            if meta_covered {
                return wait_data(j);
            }
            if !batched && !self.fcd.lock().pending.is_empty() {
                // A chained predecessor waits for this fast commit's flush:
                // its time in flight was the batching window.
                batched = true;
            }
            if !batched {
                batched = true;
                // Leading with other fsyncs under way: let those arriving join
                // this fast commit (jbd2's batching, see `batch_fsyncs`).
                // Sized by the fast commits' own time: the fsyncs' time includes
                // this wait, which would feed back into ever longer waits.
                let avg = {
                    let d = self.fcd.lock();
                    d.stats.io_ns.checked_div(d.stats.commits)
                };
                if self.fsync_active.load(std::sync::atomic::Ordering::Acquire) > 1 {
                    self.batch_fsyncs(std::time::Duration::from_nanos(avg.unwrap_or(0)));
                    continue;
                }
            }
            // The cut (ARCHITECTURE.md, "the commit cut"): every cached write
            // that returned before this plan goes into it, mapped under the
            // barrier and `Inner` and written before the fast commit.
            // Taken whether or not pages look dirty now: a write returning
            // between such a look and the plan would be missing from it while
            // a later operation of its thread is in.
            let (bw, cut, mut g) = match &self.pc {
                Some(pc) if !pc.per_file() => {
                    let b = pc.barrier.write();
                    // What mapping the dirty pages reads, read first without
                    // `Inner` (warm.rs); the barrier keeps the dirty set still.
                    let mut g = self.lock_change(|g| g.warm_cut(&pc.dirty_inos()))?;
                    match self.fc_cut(pc, &mut g) {
                        Ok(c) => (Some(b), Some(c), g),
                        Err(e) => {
                            // Blocks it mapped have no data: never commit them.
                            drop(g);
                            self.journal.abort();
                            self.errors.journal_failed(&self.journal, "writeback", &e);
                            return Err(e);
                        }
                    }
                }
                _ => (None, None, self.lock()?),
            };
            let cut_seq = cut.as_ref().and_then(|c| c.seq);
            let upto = g.fc_seq();
            let arrivals = self
                .fsync_arrivals
                .load(std::sync::atomic::Ordering::Acquire);
            let mut plan = g.fc_plan();
            drop(bw);
            let crcs = matches!(&plan, Ok(fc::FcPlan::Fast { csums, .. }) if !csums.is_empty());
            if cut.is_some() || crcs {
                drop(g);
                // The cut's data by block, for the CRCs (built from its own
                // snapshots: no lock needed).
                let written = match &cut {
                    Some(c) if crcs => c.overlay(),
                    _ => Default::default(),
                };
                if let (Some(c), Some(pc)) = (cut, &self.pc) {
                    let r = writeback::write_runs(&self.dio, pc, &c.runs, true, &self.data_gens);
                    if let Err(e) = &r {
                        // Mapped in the running transaction: it must not commit
                        // without them (data_err=abort, see writeback_locked).
                        for run in &c.runs {
                            self.data_errors.insert(run.ino);
                        }
                        self.journal.abort();
                        self.errors.journal_failed(&self.journal, "writeback", e);
                    }
                    drop(c.h);
                    r?;
                }
                // fc_data_csum: the CRCs of the plan's data ranges, read
                // without `Inner` (C.2); the ranges are protected and this
                // thread leads, so no in-place overwrite changes them first.
                if let Ok(fc::FcPlan::Fast {
                    records,
                    csums,
                    logged,
                    ..
                }) = &mut plan
                {
                    let r = fc::fill_data_csums(
                        &self.dio,
                        &self.dev,
                        self.pc.as_deref(),
                        records,
                        csums,
                        &written,
                    );
                    if let Err(e) = r {
                        // Never written: its ranges need no protection (an
                        // overwrite would pay a confirming commit for nothing).
                        self.lock()?.fc_plan_dropped(logged);
                        return Err(e);
                    }
                }
                g = self.lock()?;
            }
            let (tid, blocks, flush, logged) = match plan? {
                fc::FcPlan::Nothing => {
                    let mut d = self.fcd.lock();
                    if let Some(gen) = d.pending.back().map(|p| p.gen) {
                        // Everything tracked went out in chained fast commits
                        // not yet durable: this one's turn comes with the last
                        // of them.
                        d.pending.push_back(fc::FcPending { gen, upto, cut_seq });
                        drop(d);
                        drop(g);
                        _fcl = None;
                        j.wait_data(gen)?;
                        continue;
                    }
                    // Everything tracked is durable (or was never tracked: the
                    // full commit that pruned it is durable); data may not be.
                    d.durable_upto = d.durable_upto.max(upto);
                    if let (Some(pc), Some(s)) = (&self.pc, cut_seq) {
                        pc.cut_durable(s);
                    }
                    drop(d);
                    drop(g);
                    return wait_data(j);
                }
                fc::FcPlan::Full(_) if j.full_commit_in_flight() => continue,
                fc::FcPlan::Full(r) => {
                    g.fc_count_ineligible(r);
                    drop(g);
                    return self.sync_for(entry_tid, dgen, wseq);
                }
                fc::FcPlan::Fast {
                    tid,
                    mut records,
                    mut logged,
                    ..
                } => {
                    if g.fc_data_csum && j.fc_chain_pending() {
                        // A chained fast commit's flush has not completed:
                        // recovery must verify its data with this one's
                        // (docs/FORMAT.md, DATA_CHAIN). Checked under the
                        // leader's lock: no other fast commit is written
                        // before this one.
                        records.push(commitfs_format::fast_commit::Tlv::DataChain);
                        logged.set_chained();
                    }
                    let packed = g
                        .journal
                        .fc_slot()
                        .filter(|s| s.0 == tid)
                        .and_then(|(_, head, free)| fc::pack(&records, tid, head, g.bs, free));
                    let Some(blocks) = packed else {
                        if j.full_commit_in_flight()
                            || g.journal.fc_slot().is_some_and(|s| s.0 != tid)
                        {
                            // A full commit took (or is taking) the planned
                            // transaction while the locks were dropped (the
                            // cut's write-back, the CRC reads): check what it
                            // covered, not a fallback for a full area.
                            g.fc_plan_dropped(&logged);
                            continue;
                        }
                        // Would it fit an empty area? Then the area is just full.
                        let r = match fc::pack(&records, tid, true, g.bs, g.journal.fc_capacity()) {
                            Some(_) => fc::FcReason::AreaFull,
                            None => fc::FcReason::LogTooBig,
                        };
                        g.fc_count_ineligible(r);
                        g.fc_ineligible(r, tid);
                        drop(g);
                        return self.sync_for(j.running_tid(), dgen, wseq);
                    };
                    let mode = if g.fc_data_csum {
                        commitfs_journal::FcFlush::Together
                    } else {
                        // Flush first only when some data write may not be
                        // durable yet.
                        commitfs_journal::FcFlush::Ordered {
                            flush_first: j.data_unflushed(),
                        }
                    };
                    (tid, blocks, mode, logged)
                }
            };
            drop(g);
            let t_io = std::time::Instant::now();
            // Chain (leave the TAIL, or the flush, to the next fast commit's
            // flush) when an fsync entered after this plan with changes it
            // does not hold: that one needs a successor. One this commit
            // covers (a second fsync of a file) would only wait for the
            // flush thread's hand-off.
            let chain = || {
                use std::sync::atomic::Ordering::Acquire;
                self.fsync_arrivals.load(Acquire) != arrivals
                    && (self.fsync_seq_max.load(Acquire) > upto
                        || self.fsync_wseq_max.load(Acquire) > cut_seq.unwrap_or(0))
            };
            let wrote = j.fast_commit_chained(tid, &blocks, flush, &chain)?;
            let io_ns = t_io.elapsed().as_nanos() as u64;
            if wrote == commitfs_journal::FcWritten::NotWritten {
                // A full commit took the transaction (and waited for it): loop to
                // check what it covered.
                self.fcd.lock().stats.skipped += 1;
                continue;
            }
            // Logged once written: the next plan (possibly before this one is
            // durable) must not repeat its records; a failed write aborts.
            let mut g = self.lock()?;
            let pending = match wrote {
                commitfs_journal::FcWritten::Pending(gen) => Some(gen),
                _ => None,
            };
            g.fc_logged(&logged, pending);
            let mut d = self.fcd.lock();
            let st = &mut d.stats;
            st.commits += 1;
            st.io_ns += io_ns;
            st.blocks += blocks.len() as u64;
            st.single_block += (blocks.len() == 1) as u64;
            st.total_ns += t0.elapsed().as_nanos() as u64;
            if let commitfs_journal::FcWritten::Pending(gen) = wrote {
                d.pending.push_back(fc::FcPending { gen, upto, cut_seq });
                drop(d);
                drop(g);
                // Let the successor lead while this one waits for its flush.
                _fcl = None;
                j.wait_data(gen)?;
                self.fc_harvest(&mut self.fcd.lock());
                return wait_data(j);
            }
            d.durable_upto = d.durable_upto.max(upto);
            if let (Some(pc), Some(s)) = (&self.pc, cut_seq) {
                pc.cut_durable(s);
            }
            drop(d);
            drop(g);
            // The fast commit's flush (if any) covers data written before it.
            return wait_data(j);
        }
    }

    /// Chained fast commits that a later flush has made durable: what they
    /// covered counts as durable now (in order: flush generations grow).
    fn fc_harvest(&self, d: &mut fc::FcDurState) {
        while let Some(p) = d.pending.front() {
            if !self.journal.flushed_since(p.gen) {
                break;
            }
            let p = d.pending.pop_front().expect("front");
            d.durable_upto = d.durable_upto.max(p.upto);
            if let (Some(pc), Some(s)) = (&self.pc, p.cut_seq) {
                pc.cut_durable(s);
            }
        }
    }

    /// The flush generation to wait for when chained fast commits written but
    /// not yet durable (with what is durable already) cover an fsync that
    /// entered at `entry_seq`/`entry_tid` after cached writes up to `wseq`.
    fn fc_pending_cover(
        &self,
        d: &fc::FcDurState,
        entry_seq: u64,
        entry_tid: u32,
        wseq: Option<u64>,
    ) -> Option<u64> {
        let last = d.pending.back()?;
        let upto = d.pending.iter().map(|p| p.upto).max().unwrap_or(0);
        let cut = d.pending.iter().filter_map(|p| p.cut_seq).max();
        let meta =
            d.covered(entry_seq) || upto >= entry_seq || self.journal.is_committed(entry_tid);
        let cache = match (wseq, cut) {
            (None, _) => true,
            (Some(w), Some(c)) if c >= w => true,
            (Some(_), _) => self.cache_covered(wseq),
        };
        (meta && cache).then_some(last.gen)
    }

    /// Batching for a fast-commit leader (jbd2's `min_batch_time` /
    /// `max_batch_time` rule, adapted): wait until as many fsyncs are under way
    /// as lately (at least `min_batch_time`, at most the average fast-commit time
    /// capped by `max_batch_time`), so that one fast commit and one flush serve
    /// them all. A lone fsync never waits.
    fn batch_fsyncs(&self, avg: std::time::Duration) {
        use std::sync::atomic::Ordering;
        use std::time::{Duration, Instant};
        let p = self.pipeline;
        let min = Duration::from_micros(p.min_batch_us);
        let max = Duration::from_micros(p.max_batch_us).min(avg.max(min));
        // Wait for as many fsyncs as were under way at once lately (a thread
        // released by the last fast commit is busy with its next request through
        // FUSE for longer than any fixed quiet period), then set the mark to what
        // this wait saw, so it follows the load down as well as up.
        let target = self.fsync_peak.load(Ordering::Acquire);
        let t0 = Instant::now();
        let mut seen = 0;
        loop {
            let n = self.fsync_active.load(Ordering::Acquire);
            seen = seen.max(n);
            let e = t0.elapsed();
            if e >= max || (n >= target && e >= min) {
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.fsync_peak.store(seen, Ordering::Release);
    }

    /// Page cache counters (`None`: no page cache on this mount).
    pub fn cache_stats(&self) -> Option<CacheStats> {
        self.pc.as_ref().map(|pc| pc.snapshot())
    }

    /// Fast-commit counters (commits, blocks, single-block count, time, fallbacks
    /// to full commits by reason).
    pub fn fc_stats(&self) -> FcStats {
        self.fcd.lock().stats.clone()
    }

    pub fn fsyncdir(&self, ino: Ino) -> Result<()> {
        self.fsync(ino, false)
    }
}

impl Drop for Fs {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::error!("unmount on drop failed: {e}");
        }
        self.journal.set_hooks(None);
    }
}
