//! The file system's core state (`Inner`), mount/unmount, metadata buffer access and
//! inode I/O.
//!
//! `Inner` lives behind one lock in [`crate::Fs`]; every fs-internal routine is an
//! `impl Inner` method taking `&mut self`. Conventions every module follows:
//!
//! * Metadata blocks (bitmaps, descriptors, inode tables, directory blocks, extent
//!   tree blocks, xattr blocks) are touched only through [`Inner::read_meta`],
//!   [`Inner::modify_meta`] and [`Inner::new_meta`] with a journal [`Handle`], so the
//!   journal sees every change at buffer granularity.
//! * File data blocks bypass the buffer cache ([`Inner::read_data`],
//!   [`Inner::write_data`]).
//! * Inodes are read with [`Inner::read_inode`] (a copy from the inode cache) and
//!   written back with [`Inner::write_inode`]; a routine that takes `&mut Inode` only
//!   changes the copy and its caller writes it.
//! * Freed blocks go through [`Inner::free_blocks`], which also drops any cached
//!   metadata buffer for them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use commitfs_device::{DeviceRef, IoCategory};
use commitfs_format::csum::CsumCtx;
use commitfs_format::group_desc::{self, GroupDesc};
use commitfs_format::inode::{Inode, Timestamp};
use commitfs_format::superblock::{self as sbf, FeatureKind, Superblock};
use commitfs_format::FormatError;
use commitfs_journal::{Buffer, Handle, Journal, JournalMap, LogOptions};

use crate::error::{FsError, Result};
use crate::types::MountOptions;

/// Incompat features we can mount read-write (ext4-format.md §2.3).
/// Entries of [`DatasyncStamps`] past which those of durable transactions
/// are dropped (at first; then at twice what survived the last prune, so a
/// transaction with more entries is not rescanned at every write: it was, and
/// creating files spent 15% of the daemon's time there).
const DATASYNC_PRUNE_AT: usize = 4096;

/// fdatasync's rule (ext4's `i_datasync_tid`; docs/ARCHITECTURE.md C.5): the
/// transaction of each inode's last change that fdatasync must make durable
/// (size, block mapping, creation: every [`Inner::write_inode`], not
/// [`Inner::write_inode_times`]). An inode absent here, or whose transaction
/// is durable, needs only its data flushed. Lock order: after `Inner`.
///
/// A stamp also carries the fast-commit tracker's version bumped for it
/// (under `Inner`, with the change): a fast commit planned with a version at
/// least that was planned after the whole operation (plans take `Inner`), so
/// it carries every change the operation tracked. That lets an fsync read a
/// stamp without `Inner` and clear it only once such a commit is durable
/// ([`Stamp::made_durable`]); a stamp read beside a concurrent operation's
/// change is never cleared by an fsync that did not cover it.
pub struct DatasyncStamps {
    /// ino -> its last stamp.
    map: HashMap<u32, Stamp>,
    serial: u64,
    /// Entries at which the next prune runs (see `DATASYNC_PRUNE_AT`).
    prune_at: usize,
}

impl Default for DatasyncStamps {
    fn default() -> Self {
        DatasyncStamps {
            map: HashMap::new(),
            serial: 0,
            prune_at: DATASYNC_PRUNE_AT,
        }
    }
}

/// One inode's last change that fdatasync must persist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Its transaction.
    pub tid: u32,
    /// Tells a later change in the same transaction.
    serial: u64,
    /// The fast-commit tracker's version bumped for it (0: fast commits off).
    fc_version: u64,
}

impl Stamp {
    /// Whether a durable commit carries this change: its transaction has
    /// committed, or a fast commit planned at version `fc_version` or later
    /// is durable (`fc_durable_upto`, fast commits on).
    pub fn made_durable(&self, j: &commitfs_journal::Journal, fc_durable_upto: u64) -> bool {
        j.is_committed(self.tid) || (self.fc_version != 0 && fc_durable_upto >= self.fc_version)
    }
}

impl DatasyncStamps {
    /// `ino` changed in `tid` in a way fdatasync must persist; `fc_version`:
    /// the tracker's version bumped for it (0 without fast commits).
    fn stamp(&mut self, ino: u32, tid: u32, fc_version: u64, j: &commitfs_journal::Journal) {
        if self.map.len() >= self.prune_at {
            self.map.retain(|_, st| !j.is_committed(st.tid));
            self.prune_at = (2 * self.map.len()).max(DATASYNC_PRUNE_AT);
        }
        self.serial += 1;
        self.map.insert(
            ino,
            Stamp {
                tid,
                serial: self.serial,
                fc_version,
            },
        );
    }

    /// The stamp of `ino`'s last such change, if not pruned.
    pub fn get(&self, ino: u32) -> Option<Stamp> {
        self.map.get(&ino).copied()
    }

    /// Forget `ino`'s stamp if it is still `stamp` (no change since).
    pub fn clear_if(&mut self, ino: u32, stamp: Stamp) {
        if self.map.get(&ino) == Some(&stamp) {
            self.map.remove(&ino);
        }
    }
}

const SUPPORTED_INCOMPAT: u32 = sbf::INCOMPAT_FILETYPE
    | sbf::INCOMPAT_RECOVER
    | sbf::INCOMPAT_EXTENTS
    | sbf::INCOMPAT_64BIT
    | sbf::INCOMPAT_FLEX_BG
    | sbf::INCOMPAT_CSUM_SEED
    | sbf::INCOMPAT_LARGEDIR
    | sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM;
/// Read-only compat features we maintain correctly when writing.
const SUPPORTED_RO_COMPAT: u32 = sbf::RO_COMPAT_SPARSE_SUPER
    | sbf::RO_COMPAT_LARGE_FILE
    | sbf::RO_COMPAT_HUGE_FILE
    | sbf::RO_COMPAT_DIR_NLINK
    | sbf::RO_COMPAT_EXTRA_ISIZE
    | sbf::RO_COMPAT_METADATA_CSUM
    | sbf::RO_COMPAT_ORPHAN_PRESENT;

/// Missing blocks one deferred pass reports at most ([`Inner::warm_all`]).
pub(crate) const WARM_BATCH: usize = 256;

/// Cached blocks one warm pass holds at most for the operation after it
/// (`Inner::warm_pins`; 4 MiB of 4 KiB blocks).
const WARM_PINS_MAX: usize = 1024;

/// A warm pass in progress ([`Inner::defer_pass`]): misses are deferred
/// until it ends, by return or by panic.
pub(crate) struct DeferPass(Arc<std::sync::atomic::AtomicBool>);

impl Drop for DeferPass {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

pub(crate) struct Inner {
    pub dev: DeviceRef,
    /// Set while an operation that may be run again (one without side
    /// effects so far, `Fs::read_locked`) holds the lock: a metadata miss
    /// returns [`FsError::MetadataMiss`] instead of reading the device.
    pub defer_misses: Arc<std::sync::atomic::AtomicBool>,
    /// The cached blocks the last warm pass touched, held (a cache sweep
    /// keeps held buffers) until the next pass starts: the operation that
    /// follows the pass under the lock finds them all, even when what it
    /// inserts itself (a new block, a loaded directory) sweeps a cache at its
    /// budget ([`Inner::defer_pass`]). At most [`WARM_PINS_MAX`].
    warm_pins: std::cell::RefCell<HashMap<u64, Arc<Buffer>>>,
    /// Shared so that a commit (device writes and flush) can run outside the
    /// `Inner` lock: a slow fsync must not block unrelated requests.
    pub journal: Arc<Journal>,
    pub sb: Superblock,
    pub sb_dirty: bool,
    /// The superblock's buffer, held for the mount (read-write mounts).
    sb_pin: Option<Arc<Buffer>>,
    pub gds: Vec<GroupDesc>,
    /// The descriptors' free counts, for statfs without `Inner` (alloc.rs).
    pub free: Arc<crate::alloc::FreeCounts>,
    pub csum: CsumCtx,
    /// Block size in bytes.
    pub bs: usize,
    pub groups: u32,
    pub ipg: u32,
    pub bpg: u32,
    pub inode_size: usize,
    pub read_only: bool,
    /// Cached inodes, open counts, open-unlinked inodes, lazytime atimes
    /// (itable.rs: its own lock, design C.1).
    pub itable: Arc<crate::itable::InodeTable>,
    /// Directory state owned by `dir.rs` (in-memory indexes).
    /// Behind its own lock (taken after `Inner`, never before it), so that
    /// a lookup in a cached directory needs no file-system lock
    /// (`Fs::lookup_cached`).
    pub dirs: std::sync::Arc<parking_lot::Mutex<crate::dir::DirCache>>,
    /// Blocks freed by transactions that are not committed yet: the
    /// allocator skips them (`pending.rs`).
    pub pending_free: crate::pending::PendingBlocks,
    /// Inode numbers freed by transactions that are not committed yet: not
    /// reused until then (`pending.rs`).
    pub pending_free_inodes: crate::pending::PendingInodes,
    /// Orphans put on the list by the running transaction: ino -> tid. Not on
    /// the committed list, so taking them off it needs no full commit.
    pub orphans_added: HashMap<u32, u32>,
    /// Fast-commit tracking (`fc.rs`); `fc_enabled` once the log writes fast commits.
    pub fc: crate::fc::FcTracker,
    pub fc_enabled: bool,
    /// `-o fc_data_csum` in effect (fast commits on, read-write).
    pub fc_data_csum: bool,
    /// Data writes between their metadata step and their device write
    /// (`dataio.rs`); fast commits wait for them.
    pub inflight: Arc<crate::dataio::Inflight>,
    /// fdatasync's rule (ext4's `i_datasync_tid`, C.5), under a lock of its
    /// own so that an fsync reads and clears its stamp without `Inner`.
    pub datasync: Arc<parking_lot::Mutex<DatasyncStamps>>,
    /// Per-group hint: first inode bit that may be free.
    pub inode_hint: Vec<u32>,
    /// Last group a directory was placed in (spreads top-level directories).
    pub last_dir_group: u32,
    /// Where the next small file's data goes: right after the last small
    /// file's (`Inner::alloc_goal`; 0 until the first).
    pub small_file_goal: u64,
    pub next_generation: u32,
    pub opts: MountOptions,
    /// `errors=` handling, shared with `Fs` and the committer (errors.rs).
    pub errors: Arc<crate::errors::ErrorState>,
    /// What this mount's recovery replayed (`None`: the journal was empty).
    pub recovery: Option<crate::Recovery>,
    /// The file-data page cache (`None`: `-o nocache`, read-only, no journal).
    pub pc: Option<Arc<crate::pagecache::PageCache>>,
    /// A write-back is allocating delayed pages: it may use reserved blocks.
    pub claiming: bool,
    /// `(ino, from, to)`: bytes of partial blocks the operation under way
    /// need not zero: `Fs` zeroed them through the write path, outside the
    /// lock (a truncate's tail, a punch's edges; `Fs::zero_partial_outside`).
    pub zeroed_outside: Vec<(u32, u64, u64)>,
    /// A warm pass of this lock hold pruned the pending frees: the
    /// operation after it allocates against the same state, not against
    /// transactions that became durable meanwhile (the commit threads do not
    /// take `Inner`), which could pick a group or an inode the pass did not
    /// read. Cleared by each new pass and each `Fs::lock`.
    pub warm_pruned: bool,
    /// Blocks a warm pass has predicted from the small-file stream so far:
    /// its allocations follow one another from one goal, so the groups
    /// warmed must hold them all (`warm_map`). Reset by each pass.
    pub warm_stream_want: u64,
    /// Device reads made under this lock (metadata misses `read_meta` could
    /// not defer, data read by `read_data`): what C.2 wants at zero, counted
    /// for `commitfs stats` (shared with `Fs`).
    pub reads_locked: Arc<std::sync::atomic::AtomicU64>,
}

/// Seconds of the coarse realtime clock, which is what `time()` (and so e2fsck)
/// reads; the precise clock can run a tick ahead, and a superblock time one second
/// "in the future" makes e2fsck complain.
pub(crate) fn coarse_secs() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) };
    if r == 0 {
        ts.tv_sec as u64
    } else {
        now().sec as u64
    }
}

pub(crate) fn now() -> Timestamp {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Timestamp::new(d.as_secs() as i64, d.subsec_nanos())
}

impl Inner {
    /// How to recover this image's journal: an image left by an fc_data_csum
    /// mount (its incompat bit still set, whatever this mount's options) may end
    /// in a single-flush commit, whose last transaction must verify completely.
    fn recover_options(&self) -> commitfs_journal::RecoverOptions {
        commitfs_journal::RecoverOptions {
            verify_last: self.sb.has_incompat(sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM),
            inode_size: self.inode_size,
        }
    }

    /// Open a file system: read and check the superblock and descriptors, decide
    /// read-only vs read-write from the feature flags.
    pub fn mount(dev: DeviceRef, opts: MountOptions) -> Result<Inner> {
        Self::mount_with(dev, opts, false)
    }

    /// With `inspect_only`, load the superblock and descriptors only: no journal
    /// replay, no writes (`commitfs info` on an image that needs recovery).
    pub fn mount_with(dev: DeviceRef, opts: MountOptions, inspect_only: bool) -> Result<Inner> {
        let sb = crate::probe::read_superblock(&*dev)?;
        let bs = sb.block_size();
        if dev.size() < sb.blocks_count() * bs as u64 {
            return Err(FsError::corrupt(format!(
                "device has {} bytes but the superblock claims {} blocks of {bs}",
                dev.size(),
                sb.blocks_count()
            )));
        }
        // Incompat features we do not understand: refuse entirely (§2.3).
        let bad_incompat = sb.feature_incompat() & !SUPPORTED_INCOMPAT;
        if bad_incompat != 0 {
            return Err(crate::probe::OpenError::UnsupportedIncompat(
                sbf::feature_names(FeatureKind::Incompat, bad_incompat).join(", "),
            )
            .into());
        }
        let mut read_only = opts.read_only || dev.is_read_only();
        let bad_ro = sb.feature_ro_compat() & !SUPPORTED_RO_COMPAT;
        if bad_ro != 0 && !read_only {
            return Err(FsError::UnsupportedFeature(format!(
                "{} (read-only compatible: mount with -o ro)",
                sbf::feature_names(FeatureKind::RoCompat, bad_ro).join(", ")
            )));
        }
        if !sb.has_incompat(sbf::INCOMPAT_EXTENTS) && !read_only {
            return Err(FsError::UnsupportedFeature(
                "no extent feature (ext2/ext3 block-mapped files)".into(),
            ));
        }
        if sb.has_ro_compat(sbf::RO_COMPAT_GDT_CSUM) && !sb.metadata_csum() && !read_only {
            return Err(FsError::UnsupportedFeature("uninit_bg".into()));
        }
        if dev.is_read_only() {
            read_only = true;
        }
        let csum = CsumCtx {
            enabled: sb.metadata_csum(),
            fs_seed: sb.csum_seed(),
        };
        let journal = Arc::new(Journal::new(dev.clone(), bs, read_only));
        let groups = sb.group_count();
        let first_data_block = sb.first_data_block() as u64;
        let blocks_per_group = sb.blocks_per_group();
        let ipg = sb.inodes_per_group();
        let mode = opts
            .errors
            .unwrap_or_else(|| crate::types::ErrorsBehavior::from_superblock(sb.errors_behavior()));
        let errors = Arc::new(crate::errors::ErrorState::new(dev.clone(), mode, &sb));
        if sb.state() & sbf::STATE_ERROR_FS != 0 && !inspect_only {
            tracing::warn!(
                "mounting a file system with errors ({} recorded, last in {}): run e2fsck -f",
                sb.error_count(),
                sb.last_error_func()
            );
        }
        let mut inner = Inner {
            dev,
            defer_misses: Default::default(),
            warm_pins: Default::default(),
            journal,
            bs,
            groups,
            ipg,
            bpg: sb.blocks_per_group(),
            inode_size: sb.inode_size() as usize,
            csum,
            sb,
            sb_dirty: false,
            sb_pin: None,
            gds: Vec::with_capacity(groups as usize),
            free: Default::default(),
            read_only,
            itable: Default::default(),
            dirs: Default::default(),
            pending_free: crate::pending::PendingBlocks::new(first_data_block, blocks_per_group),
            pending_free_inodes: crate::pending::PendingInodes::new(groups, ipg),
            orphans_added: HashMap::new(),
            fc: Default::default(),
            fc_enabled: false,
            fc_data_csum: false,
            inflight: Default::default(),
            datasync: Default::default(),
            inode_hint: vec![0; groups as usize],
            last_dir_group: 0,
            small_file_goal: 0,
            next_generation: now().nsec ^ 0x9E37_79B9,
            opts,
            errors,
            recovery: None,
            pc: None,
            claiming: false,
            zeroed_outside: Vec::new(),
            warm_pruned: false,
            warm_stream_want: 0,
            reads_locked: Default::default(),
        };
        inner.load_group_descs()?;
        if inspect_only {
            return Ok(inner);
        }
        inner.open_journal()?;
        if !inner.read_only {
            let mut sb = inner.sb.clone();
            // Until the journal issue makes commits atomic, a crash can leave the
            // image inconsistent: clear VALID_FS so e2fsck checks it (as the kernel
            // does for unjournalled file systems, §2.4); a clean unmount sets it.
            if !inner.journal.has_log() {
                sb.set_state(sb.state() & !sbf::STATE_VALID_FS);
            } else {
                // Journaled: VALID_FS stays set, needs_recovery marks a live log
                // (§2.4, §8.11).
                sb.set_feature_incompat(sb.feature_incompat() | sbf::INCOMPAT_RECOVER);
            }
            // fc_data_csum logs may exist exactly while mounted with the option
            // (recovery above already replayed any left by a crash): the kernel and
            // e2fsck must refuse the image meanwhile (docs/FORMAT.md).
            let f = sb.feature_incompat() & !sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM;
            sb.set_feature_incompat(if inner.fc_data_csum {
                f | sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM
            } else {
                f
            });
            sb.set_mnt_count(sb.mnt_count().wrapping_add(1));
            sb.set_mtime(coarse_secs());
            inner.sb = sb;
            // Written home directly, not through the log: needs_recovery must be on
            // disk before the first transaction reaches the log, or the kernel would
            // wipe the log instead of replaying it.
            inner.write_super_direct()?;
            // Every orphan-list change logs the superblock: kept cached, so
            // no operation reads it under the lock (C.2).
            let blk = if inner.bs == 1024 { 1 } else { 0 };
            inner.sb_pin = Some(inner.journal.bread(blk)?);
            if inner.sb.last_orphan() != 0 {
                inner.process_orphans()?;
            }
        }
        Ok(inner)
    }

    /// Superblock and log contents of the journal, without replaying it.
    pub fn inspect_journal(
        &mut self,
    ) -> Result<
        Option<(
            commitfs_format::jbd2::JournalSuperblock,
            commitfs_journal::RecoveryReport,
            u32,
        )>,
    > {
        if !self.sb.has_compat(sbf::COMPAT_HAS_JOURNAL) || self.sb.journal_inum() == 0 {
            return Ok(None);
        }
        let map = self.journal_map()?;
        let fc = self.sb.has_compat(sbf::COMPAT_FAST_COMMIT);
        let (jsb, report) =
            commitfs_journal::scan_with(&*self.dev, &map, self.bs, fc, self.recover_options())?;
        Ok(Some((jsb, report, map.len())))
    }

    /// Device blocks of the journal inode (§8.1).
    fn journal_map(&mut self) -> Result<JournalMap> {
        let jino = self.sb.journal_inum();
        let ji = self.read_inode(jino)?;
        if ji.mode & commitfs_format::inode::S_IFMT != commitfs_format::inode::S_IFREG
            || !ji.has_flag(commitfs_format::inode::FL_EXTENTS)
        {
            return Err(FsError::UnsupportedFeature(format!(
                "journal inode {jino} is not an extent-mapped regular file"
            )));
        }
        let runs = self
            .ext_list(jino, &ji)?
            .into_iter()
            .filter(|m| !m.unwritten)
            .map(|m| (m.lblk, m.pblk, m.len))
            .collect();
        Ok(JournalMap::new(runs)?)
    }

    /// Replay a journal left by a crash (ours or the kernel's), then open the log for
    /// writing on a read-write mount.
    fn open_journal(&mut self) -> Result<()> {
        if !self.sb.has_compat(sbf::COMPAT_HAS_JOURNAL) {
            if self.sb.has_incompat(sbf::INCOMPAT_RECOVER) {
                return Err(FsError::NeedsRecovery);
            }
            return Ok(());
        }
        if self.sb.journal_inum() == 0 {
            return Err(FsError::UnsupportedFeature("external journal".into()));
        }
        let map = self.journal_map()?;
        let fast_commit = self.sb.has_compat(sbf::COMPAT_FAST_COMMIT);
        let (jsb, _) = commitfs_journal::read_superblock(&*self.dev, &map, self.bs)?;
        if jsb.start != 0 {
            if self.read_only {
                return Err(FsError::NeedsRecovery);
            }
            // An image left by an fc_data_csum mount (its incompat bit is still
            // set, whatever this mount's options) may end in a single-flush
            // commit: recovery verifies the last transaction completely.
            let report = commitfs_journal::recover_with(
                &*self.dev,
                &map,
                self.bs,
                fast_commit,
                self.recover_options(),
            )?;
            tracing::info!(
                "journal recovery: {} transactions ({}..{}), {} blocks replayed, {} revoked{}",
                report.transactions,
                report.start_tid,
                report.end_tid,
                report.blocks_replayed,
                report.blocks_revoked,
                report
                    .stopped_at
                    .as_deref()
                    .map(|s| format!("; stopped early: {s}"))
                    .unwrap_or_default()
            );
            self.reload_after_recovery()?;
            // Fast commits after the JBD2 log (ext4-format.md §9.7): replayed now and
            // committed as one JBD2 transaction; see fc_replay.rs for the order.
            let fast_commits = self.replay_fast_commits(&map, &jsb, report.end_tid)?;
            self.recovery = Some(crate::Recovery {
                journal: report,
                fast_commits,
            });
        }
        if self.read_only {
            if self.sb.has_incompat(sbf::INCOMPAT_RECOVER) && jsb.start != 0 {
                return Err(FsError::NeedsRecovery);
            }
            return Ok(());
        }
        let opts = LogOptions {
            bit64: self.sb.is_64bit(),
            csum: self.sb.metadata_csum(),
            fast_commit,
            use_fast_commit: fast_commit && self.opts.fast_commit,
        };
        self.journal = Arc::new(Journal::open_log_with(
            self.dev.clone(),
            self.bs,
            map,
            opts,
            self.opts.pipeline,
        )?);
        self.fc_enabled = opts.use_fast_commit;
        self.fc_data_csum = self.fc_enabled && self.opts.fc_data_csum;
        // Single-flush full commits (needs CSUM_V3; the journal checks).
        self.journal.set_single_flush(self.fc_data_csum);
        Ok(())
    }

    /// After a replay every cached structure may be stale: reread the superblock and
    /// the descriptors, drop caches.
    fn reload_after_recovery(&mut self) -> Result<()> {
        let mut raw = [0u8; sbf::SUPERBLOCK_SIZE];
        self.dev
            .read_at(sbf::SUPERBLOCK_OFFSET, &mut raw, IoCategory::Metadata)?;
        let mut sb = Superblock::parse(&raw)?;
        sb.set_feature_incompat(sb.feature_incompat() & !sbf::INCOMPAT_RECOVER);
        // A replayed superblock copy predates the errors recorded since: keep
        // the record (ext4_load_journal does the same).
        self.errors.apply(&mut sb);
        self.sb = sb;
        self.journal = Arc::new(Journal::new(self.dev.clone(), self.bs, self.read_only));
        self.itable.clear();
        self.gds.clear();
        self.load_group_descs()?;
        // Free counts in the superblock may lag (the kernel keeps them in memory);
        // the descriptors are authoritative.
        self.refresh_super_counts();
        Ok(())
    }

    fn load_group_descs(&mut self) -> Result<()> {
        let ds = self.sb.desc_size();
        let first = self.sb.first_data_block() as u64 + 1;
        for g in 0..self.groups {
            let off = g as usize * ds;
            let blk = first + (off / self.bs) as u64;
            let buf = self.read_meta(blk)?;
            let data = buf.data();
            let raw = &data[off % self.bs..off % self.bs + ds];
            group_desc::verify(raw, g, &self.csum, blk)?;
            let gd = GroupDesc::parse(raw, g, blk)?;
            let total = self.sb.blocks_count();
            if gd.block_bitmap >= total || gd.inode_bitmap >= total || gd.inode_table >= total {
                return Err(FormatError::corrupt(
                    "group descriptor",
                    blk,
                    format!("group {g}: bitmap or inode table beyond the end of the device"),
                )
                .into());
            }
            if gd.free_inodes_count > self.ipg
                || gd.free_blocks_count > self.bpg
                || gd.itable_unused > self.ipg
                || gd.used_dirs_count > self.ipg
            {
                return Err(FormatError::corrupt(
                    "group descriptor",
                    blk,
                    format!("group {g}: free/used counts exceed the group size"),
                )
                .into());
            }
            drop(data);
            self.gds.push(gd);
        }
        self.free.init(&self.gds);
        Ok(())
    }

    // ---- metadata buffers -------------------------------------------------------

    /// Block holding the on-disk copy of `bytes` of a block-sized buffer.
    pub fn read_meta(&self, blk: u64) -> Result<Arc<Buffer>> {
        if blk >= self.sb.blocks_count() {
            return Err(FsError::corrupt(format!(
                "metadata block {blk} beyond the end of the file system"
            )));
        }
        if self.defer_misses.load(std::sync::atomic::Ordering::Relaxed) {
            // No device read under `Inner` (ARCHITECTURE.md C.2): the caller
            // reads it outside and runs the operation again.
            let b = self
                .journal
                .bread_cached(blk)
                .ok_or_else(|| FsError::MetadataMiss(vec![blk]))?;
            self.warm_pin(&b);
            return Ok(b);
        }
        match self.journal.bread_noting(blk, Some(&self.reads_locked)) {
            Ok(b) => Ok(b),
            Err(e) => {
                if let commitfs_journal::JournalError::Device(d) = &e {
                    // A metadata read error is an ext4_error: errors= decides.
                    let cause = format!("metadata read failed: {d}");
                    self.errors
                        .handle(&self.journal, "read_meta", 0, blk, &cause, true);
                }
                Err(e.into())
            }
        }
    }

    /// Start a warm pass: metadata misses are deferred (reported as
    /// [`FsError::MetadataMiss`]) until the returned guard drops, and the
    /// blocks the previous pass held are let go (what this pass touches is
    /// held anew).
    pub(crate) fn defer_pass(&mut self) -> DeferPass {
        self.warm_pins.borrow_mut().clear();
        self.warm_pruned = false;
        self.warm_stream_want = 0;
        self.defer_misses
            .store(true, std::sync::atomic::Ordering::Relaxed);
        DeferPass(self.defer_misses.clone())
    }

    /// Hold `b`, touched by a warm pass, for the operation after it. Each
    /// block once: a pass touches many blocks more than once (a directory's
    /// leaves are warmed, then read), and repeats must not use up the cap.
    fn warm_pin(&self, b: &Arc<Buffer>) {
        let mut p = self.warm_pins.borrow_mut();
        if p.len() < WARM_PINS_MAX {
            p.entry(b.blocknr()).or_insert_with(|| b.clone());
        }
    }

    /// While misses are deferred, the blocks of `blks` that are not cached (at
    /// most [`WARM_BATCH`]),
    /// as one [`FsError::MetadataMiss`] (a pass over many blocks, a whole
    /// directory, then runs again once instead of once per block).
    pub fn warm_all(&self, blks: impl IntoIterator<Item = u64>) -> Result<()> {
        if !self.defer_misses.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        // At most WARM_BATCH per pass: what is read is pinned until the
        // pass runs again, so a huge directory pins a bounded amount.
        let missing: Vec<u64> = blks
            .into_iter()
            .filter(|&b| {
                if b >= self.sb.blocks_count() {
                    return false;
                }
                match self.journal.bread_cached(b) {
                    Some(buf) => {
                        self.warm_pin(&buf);
                        false
                    }
                    None => true,
                }
            })
            .take(WARM_BATCH)
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(FsError::MetadataMiss(missing))
        }
    }

    /// Modify an existing metadata block under handle `h`.
    pub fn modify_meta<R>(
        &self,
        h: &Handle,
        blk: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        let b = self.read_meta(blk)?;
        self.journal.get_write_access(h, &b)?;
        let r = f(&mut b.data_mut()[..]);
        self.journal.dirty_metadata(h, &b);
        Ok(r)
    }

    /// Fill a freshly allocated metadata block (zeroed first, never read from disk).
    pub fn new_meta<R>(&self, h: &Handle, blk: u64, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let b = self.journal.getblk_zeroed(blk)?;
        self.journal.get_write_access(h, &b)?;
        let r = f(&mut b.data_mut()[..]);
        self.journal.dirty_metadata(h, &b);
        Ok(r)
    }

    /// Start a handle (errors with ReadOnly on a read-only mount).
    pub fn start(&self, credits: u32) -> Result<Handle> {
        self.check_writable()?;
        Ok(self.journal.start(credits)?)
    }

    pub fn stop(&self, h: Handle) -> Result<()> {
        Ok(self.journal.stop(h)?)
    }

    // ---- data blocks ------------------------------------------------------------

    pub fn read_data(&self, pblk: u64, buf: &mut [u8]) -> Result<()> {
        self.check_data_range(pblk, buf.len())?;
        self.reads_locked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.dev
            .read_at(pblk * self.bs as u64, buf, IoCategory::Data)?;
        Ok(())
    }

    /// `Err` when nothing may change any more: a read-only mount, a file
    /// system turned read-only by an error, an aborted journal (EROFS, as
    /// ext4's journal start says), or errors=panic (EIO).
    pub fn check_writable(&self) -> Result<()> {
        if self.errors.is_dead() {
            return Err(FsError::Shutdown);
        }
        if self.read_only || self.errors.is_read_only() || self.journal.is_aborted() {
            return Err(FsError::ReadOnly);
        }
        Ok(())
    }

    pub fn write_data(&self, pblk: u64, buf: &[u8]) -> Result<()> {
        self.check_writable()?;
        self.check_data_range(pblk, buf.len())?;
        self.dev
            .write_at(pblk * self.bs as u64, buf, IoCategory::Data, false)?;
        // fc_data_csum: the next commit checksums the blocks written since the
        // last flush (single-flush commits; a no-op otherwise).
        self.journal
            .note_data(pblk, buf.len().div_ceil(self.bs) as u64);
        // An fsync now needs a flush that starts after this write (group
        // flush: `Journal::wait_data`).
        self.journal.note_data_written();
        Ok(())
    }

    /// Device access for file data without the `Inner` lock (`dataio.rs`).
    pub fn data_io(&self) -> crate::dataio::DataIo {
        crate::dataio::DataIo {
            dev: self.dev.clone(),
            journal: self.journal.clone(),
            bs: self.bs,
            first_data_block: self.sb.first_data_block() as u64,
            blocks_count: self.sb.blocks_count(),
            errors: self.errors.clone(),
            read_only: self.read_only,
        }
    }

    fn check_data_range(&self, pblk: u64, len: usize) -> Result<()> {
        let nblocks = len.div_ceil(self.bs) as u64;
        if pblk < self.sb.first_data_block() as u64
            || pblk.saturating_add(nblocks) > self.sb.blocks_count()
        {
            return Err(FsError::corrupt(format!(
                "data block {pblk} (+{nblocks}) outside the file system"
            )));
        }
        Ok(())
    }

    // ---- superblock and descriptors ----------------------------------------------

    /// Copy the in-memory superblock into its buffer (block 0 at byte 1024, or
    /// block 1 with 1 KiB blocks).
    pub fn write_super(&mut self, h: &Handle) -> Result<()> {
        let (blk, off) = if self.bs == 1024 { (1, 0) } else { (0, 1024) };
        self.errors.apply(&mut self.sb);
        let bytes = self.sb.to_bytes();
        self.modify_meta(h, blk, |d| {
            d[off..off + sbf::SUPERBLOCK_SIZE].copy_from_slice(&bytes)
        })?;
        self.sb_dirty = false;
        Ok(())
    }

    /// Serialise group descriptor `g` into the primary GDT.
    pub fn write_gd(&mut self, h: &Handle, g: u32) -> Result<()> {
        let ds = self.sb.desc_size();
        let off = g as usize * ds;
        let blk = self.gd_block(g);
        let o = off % self.bs;
        let gd = self.gds[g as usize];
        let csum = self.csum;
        self.free.set(g, gd.free_blocks_count, gd.free_inodes_count);
        self.modify_meta(h, blk, |d| gd.serialize(&mut d[o..o + ds], g, &csum))
    }

    /// The block of the descriptor table holding group `g`'s descriptor.
    pub fn gd_block(&self, g: u32) -> u64 {
        let off = g as usize * self.sb.desc_size();
        self.sb.first_data_block() as u64 + 1 + (off / self.bs) as u64
    }

    /// Recompute superblock totals from the descriptors (§3.5) and stamp wtime.
    pub fn refresh_super_counts(&mut self) {
        let fb: u64 = self.gds.iter().map(|g| g.free_blocks_count as u64).sum();
        let fi: u64 = self.gds.iter().map(|g| g.free_inodes_count as u64).sum();
        self.sb.set_free_blocks_count(fb);
        self.sb.set_free_inodes_count(fi as u32);
        self.sb.set_wtime(coarse_secs());
    }

    /// Write everything home and flush (no crash atomicity yet, see journal docs).
    pub fn sync(&mut self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.prepare_commit()?;
        self.journal.commit()?;
        Ok(())
    }

    /// Put the superblock totals into the running transaction; the caller then
    /// commits the journal, possibly after dropping the `Inner` lock.
    pub fn prepare_commit(&mut self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        // A sync writes lazytime atimes too, as the kernel's syncfs does.
        self.flush_lazy_atimes(None)?;
        self.refresh_super_counts();
        if self.errors.take_sb_update() {
            // errors=continue recorded an error: log the superblock carrying it.
            self.sb_dirty = true;
        }
        if self.journal.has_log() && !self.sb_dirty {
            // Like the kernel, free counts are not logged at every commit: the
            // descriptors are authoritative and the totals are rewritten at
            // unmount and after recovery.
            return Ok(());
        }
        let h = self.start(1)?;
        self.write_super(&h)?;
        self.stop(h)
    }

    /// Clean unmount: release inodes that were unlinked while open, mark the file
    /// system clean, write everything home.
    pub fn unmount(&mut self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        if self.errors.is_read_only() || self.journal.is_aborted() || self.errors.is_dead() {
            // Like ext4_put_super on an aborted journal: no checkpoint, the log
            // and needs_recovery stay for the next mount to replay; the error
            // record is on disk already.
            tracing::warn!(
                "unmount after an I/O error: the journal is recovered at the next mount"
            );
            self.errors.retry_record();
            return Ok(());
        }
        for ino in self.itable.take_unlinked_open() {
            self.evict_inode(ino)?;
        }
        let st = self.sb.state() | sbf::STATE_VALID_FS;
        self.sb.set_state(st);
        if !self.journal.has_log() {
            return self.sync();
        }
        // Commit and checkpoint everything, mark the log empty, then clear
        // needs_recovery in the home superblock (§8.11 clean unmount).
        self.sync()?;
        self.journal.close()?;
        self.sb.set_feature_incompat(
            self.sb.feature_incompat()
                & !(sbf::INCOMPAT_RECOVER | sbf::INCOMPAT_COMMITFS_FC_DATA_CSUM),
        );
        self.refresh_super_counts();
        self.write_super_direct()
    }

    /// Write the superblock to its home location and flush, bypassing the journal
    /// (mount and unmount state changes, like the kernel's ext4_commit_super).
    fn write_super_direct(&mut self) -> Result<()> {
        self.errors.apply(&mut self.sb);
        let bytes = self.sb.to_bytes();
        self.dev
            .write_at(sbf::SUPERBLOCK_OFFSET, &bytes, IoCategory::Metadata, false)?;
        self.dev.flush()?;
        // Keep a cached copy of the block coherent.
        let (blk, off) = if self.bs == 1024 { (1, 0) } else { (0, 1024) };
        if let Ok(b) = self.journal.bread(blk) {
            b.data_mut()[off..off + sbf::SUPERBLOCK_SIZE].copy_from_slice(&bytes);
        }
        Ok(())
    }

    // ---- inodes -----------------------------------------------------------------

    /// Inode-table block and byte offset of inode `ino` (§4.1).
    pub fn inode_location(&self, ino: u32) -> Result<(u64, usize)> {
        if ino == 0 || ino > self.sb.inodes_count() {
            return Err(FsError::corrupt(format!("inode number {ino} out of range")));
        }
        inode_place(ino, self.ipg, self.inode_size, self.bs, |g| {
            self.gds.get(g).map(|d| d.inode_table)
        })
        .ok_or_else(|| FsError::corrupt(format!("inode number {ino} has no group")))
    }

    /// A copy of inode `ino` (from the cache or the inode table).
    pub fn read_inode(&mut self, ino: u32) -> Result<Inode> {
        if let Some(i) = self.itable.get(ino) {
            return Ok(i);
        }
        let (blk, off) = self.inode_location(ino)?;
        let buf = self.read_meta(blk)?;
        let inode = {
            let d = buf.data();
            Inode::parse(&d[off..off + self.inode_size], ino, &self.csum, blk)?
        };
        self.itable.insert(ino, inode.clone());
        Ok(inode)
    }

    /// Write inode `ino` to its inode-table buffer and the cache; fdatasync of
    /// it must commit this change (see [`DatasyncStamps`]).
    ///
    /// Invariant the stamp relies on ([`Stamp::made_durable`]): a change of a
    /// live regular file written here is tracked for fast commits
    /// (`fc_track_*`) or makes its transaction ineligible in the same `Inner`
    /// hold, so any fast commit planned after the hold carries it.
    pub fn write_inode(&mut self, h: &Handle, ino: u32, inode: &Inode) -> Result<()> {
        self.write_inode_times(h, ino, inode)?;
        let v = self.fc_bump_for_stamp();
        self.datasync.lock().stamp(ino, h.tid(), v, &self.journal);
        Ok(())
    }

    /// [`Inner::write_inode`] for a change fdatasync need not persist: only
    /// timestamps (an in-place overwrite, an access) or privilege bits changed.
    pub fn write_inode_times(&mut self, h: &Handle, ino: u32, inode: &Inode) -> Result<()> {
        let (blk, off) = self.inode_location(ino)?;
        let isz = self.inode_size;
        let csum = self.csum;
        self.modify_meta(h, blk, |d| {
            inode.serialize(&mut d[off..off + isz], ino, &csum)
        })?;
        // The table now holds whatever atime the cache had.
        self.itable.store_written(ino, inode.clone());
        Ok(())
    }

    /// Fresh generation number for a new inode.
    pub fn new_generation(&mut self) -> u32 {
        self.next_generation = self
            .next_generation
            .wrapping_mul(1_103_515_245)
            .wrapping_add(12345);
        self.next_generation
    }

    /// Group of inode `ino`.
    pub fn inode_group(&self, ino: u32) -> u32 {
        (ino.max(1) - 1) / self.ipg
    }

    /// Goal block for new data of an inode: the start of its group's data area.
    pub fn inode_goal(&self, ino: u32) -> u64 {
        self.sb.group_first_block(self.inode_group(ino))
    }

    pub fn bs64(&self) -> u64 {
        self.bs as u64
    }
}

/// Block and byte offset of inode `ino` (numbered from 1), `ipg` to a group,
/// given each group's inode-table start (`table`; `None`: no such group).
/// One formula for `Inner::inode_location` and `Fs`'s lock-free copy.
pub(crate) fn inode_place(
    ino: u32,
    ipg: u32,
    inode_size: usize,
    bs: usize,
    table: impl Fn(usize) -> Option<u64>,
) -> Option<(u64, usize)> {
    let i = ino.checked_sub(1)?;
    let start = table(i.checked_div(ipg)? as usize)?;
    let byte = (i % ipg) as usize * inode_size;
    Some((start + (byte / bs) as u64, byte % bs))
}
