//! Fast-commit tracking and log building (FastCommit paper §3–4; kernel
//! `fs/ext4/fast_commit.c` behaviour as described in ext4-format.md §9).
//!
//! Between full JBD2 commits the file system records, per running transaction,
//! which inodes changed (and which logical ranges), and the directory-entry
//! operations in order. An fsync then writes one compact logical log covering every
//! eligible change (not only the fsynced inode, so earlier unsynced changes become
//! durable too), usually a single block, instead of a full commit. Anything the
//! log cannot express marks the transaction *ineligible* (counted by reason): every
//! fsync falls back to a full commit until that transaction has committed.

use std::collections::BTreeMap;

use std::borrow::Cow;

use commitfs_format::fast_commit::{Dentry, FcPacker, Tlv};

use crate::error::Result;
use crate::inner::Inner;

/// Why a transaction needs a full commit (the kernel's reasons where they apply,
/// plus ours for operations whose replay the kernel or e2fsck cannot express).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FcReason {
    Xattr,
    CrossRename,
    RenameDir,
    /// mkdir/rmdir: e2fsck 1.47 does not build '.'/'..' for fast-commit dirs.
    DirCreateRemove,
    /// A linear directory got a new block, a full one-block directory became an
    /// htree, or an htree leaf split needed a new index block. The blocks live only
    /// in the running transaction, so replaying the dentry records would have to
    /// grow the directory again, which e2fsck 1.47's `ext2fs_link` cannot do ("No
    /// free space in the directory", its replay aborts). (A plain leaf split stays
    /// eligible: both replayers split leaves, `Inner::fc_dir_grown`.)
    DirGrow,
    /// The last link of an inode with xattrs that replay knows (its CREAT is not
    /// pending in this fast commit) went away. The kernel's UNLINK replay frees
    /// the inode; e2fsck 1.47's only removes the name and leaves the inode with its
    /// links. Without xattrs a DEL_RANGE of the whole file before the UNLINK makes
    /// it a zero-length unattached inode, which e2fsck then clears; with xattrs it
    /// reconnects it to /lost+found instead. (An INODE record with no links would
    /// make the kernel's replay fail: its `ext4_iget` refuses the inode.)
    UnlinkLast,
    /// Replay would touch an inode in the journal inode's inode-table block while
    /// a committed version of that block is not home yet: e2fsck 1.47 replays
    /// fast commits through a copy of that block cached before journal recovery
    /// and writes it back, undoing what the full commits put there. Every commit
    /// writes that block home right away (`Journal::keep_home`), so this is rare:
    /// a commit racing with the fsync.
    JournalInodeBlock,
    /// Symlinks and device/fifo/socket nodes: their state lives in `i_block`,
    /// which neither replayer restores from an INODE tag (§9.8, §13).
    SpecialInode,
    /// Attribute change of a non-regular inode (directories are never tracked).
    NonRegularSetattr,
    /// Unlink of an open file: the orphan list is not expressible.
    Orphan,
    /// A single tag larger than a block, or a log larger than the whole area.
    LogTooBig,
    /// The fast-commit area has no room left for this log (kernel: the area
    /// fills and `jbd2_fc_get_buf` fails): a full commit empties it.
    AreaFull,
    /// No full commit since the journal was opened (§8.9 rule 4).
    NoFullCommitYet,
}

impl FcReason {
    pub const ALL: [FcReason; 13] = [
        FcReason::Xattr,
        FcReason::CrossRename,
        FcReason::RenameDir,
        FcReason::DirCreateRemove,
        FcReason::DirGrow,
        FcReason::UnlinkLast,
        FcReason::JournalInodeBlock,
        FcReason::SpecialInode,
        FcReason::NonRegularSetattr,
        FcReason::Orphan,
        FcReason::LogTooBig,
        FcReason::AreaFull,
        FcReason::NoFullCommitYet,
    ];
    pub fn name(self) -> &'static str {
        match self {
            FcReason::Xattr => "xattr",
            FcReason::CrossRename => "cross_rename",
            FcReason::RenameDir => "rename_dir",
            FcReason::DirCreateRemove => "dir_create_remove",
            FcReason::DirGrow => "dir_grow",
            FcReason::UnlinkLast => "unlink_last",
            FcReason::JournalInodeBlock => "journal_inode_block",
            FcReason::SpecialInode => "special_inode",
            FcReason::NonRegularSetattr => "non_regular_setattr",
            FcReason::Orphan => "orphan",
            FcReason::LogTooBig => "log_too_big",
            FcReason::AreaFull => "area_full",
            FcReason::NoFullCommitYet => "no_full_commit_yet",
        }
    }
}

/// A directory-entry operation, replayed in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DentryOp {
    Creat {
        parent: u32,
        ino: u32,
        name: Vec<u8>,
    },
    Link {
        parent: u32,
        ino: u32,
        name: Vec<u8>,
    },
    Unlink {
        parent: u32,
        ino: u32,
        name: Vec<u8>,
    },
}

/// One logical log record: a fast-commit TLV (ext4-format.md §9.3).
pub type FcRecord = Tlv<'static>;

/// A changed logical range `[start, end)`, if any.
type LblkRange = Option<(u32, u64)>;

impl DentryOp {
    /// `(parent, ino)` of the record.
    fn parent_ino(&self) -> (u32, u32) {
        match self {
            DentryOp::Creat { parent, ino, .. }
            | DentryOp::Link { parent, ino, .. }
            | DentryOp::Unlink { parent, ino, .. } => (*parent, *ino),
        }
    }

    fn to_tlv(&self) -> FcRecord {
        let d = |parent: &u32, ino: &u32, name: &[u8]| Dentry {
            parent: *parent,
            ino: *ino,
            name: Cow::Owned(name.to_vec()),
        };
        match self {
            DentryOp::Creat { parent, ino, name } => Tlv::Creat(d(parent, ino, name)),
            DentryOp::Link { parent, ino, name } => Tlv::Link(d(parent, ino, name)),
            DentryOp::Unlink { parent, ino, name } => Tlv::Unlink(d(parent, ino, name)),
        }
    }
}

#[derive(Debug, Clone)]
struct Tracked {
    tid: u32,
    /// Changed logical range `[start, end)` since the last commit, if any.
    range: Option<(u32, u64)>,
    version: u64,
}

/// Device block -> its data, for blocks written after a plan is made.
pub type DataOverlay = std::collections::HashMap<u64, std::sync::Arc<Vec<u8>>>;

/// Fast-commit counters (like the kernel's `fc_info`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FcStats {
    pub commits: u64,
    pub blocks: u64,
    pub single_block: u64,
    pub total_ns: u64,
    /// Time in the journal writing the fast commits (planning, waits for the
    /// lock and batching excluded): what the next leader's batching wait is
    /// sized by, as jbd2 sizes its wait by the average commit time.
    pub io_ns: u64,
    pub ineligible: BTreeMap<&'static str, u64>,
    /// Fast commits skipped because a full commit had covered them meanwhile.
    pub skipped: u64,
    /// `fc_data_csum`: empty fast commits written before an in-place overwrite of
    /// a block the last commit's DATA_CSUM covers.
    pub confirms: u64,
}

#[derive(Default)]
pub struct FcTracker {
    /// Ineligible until transaction `.1` has fully committed.
    ineligible: Option<(FcReason, u32)>,
    inodes: BTreeMap<u32, Tracked>,
    dentries: Vec<(u32, DentryOp)>,
    next_version: u64,
    /// What fsyncs check without `Inner`: the published `next_version`, what
    /// is durable, the pending chained fast commits, the counters.
    pub dur: std::sync::Arc<FcDurable>,
    protect: FcProtect,
    /// Tracked entries past which tracking prunes what full commits made
    /// durable (without fsyncs nothing else would: memory, and the linear
    /// scans of `dentries`); doubles with what survives a prune.
    prune_at: usize,
}

/// The fast-commit tracker's durability state, under a lock of its own
/// (ARCHITECTURE.md C.1/C.4: taken after `Inner`, never before it; nothing is
/// taken under it and no I/O happens under it). An fsync notes [`Self::seq`]
/// on entry and checks [`FcDurState::covered`] without `Inner`: a fast commit's
/// followers find themselves covered without queueing on the file-system lock.
#[derive(Default)]
pub struct FcDurable {
    /// [`FcTracker`]'s change counter, published at each change (written
    /// under `Inner`; read by fsyncs without it).
    seq: std::sync::atomic::AtomicU64,
    st: parking_lot::Mutex<FcDurState>,
}

impl FcDurable {
    /// Every change tracked so far has a version `<=` this. An operation's
    /// change is tracked before it returns, so an fsync that reads this after
    /// the operation returned covers it.
    pub fn seq(&self) -> u64 {
        self.seq.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn lock(&self) -> parking_lot::MutexGuard<'_, FcDurState> {
        self.st.lock()
    }
}

/// [`FcDurable`]'s locked part.
#[derive(Default)]
pub struct FcDurState {
    /// Every change tracked with a version `<=` this is durable through a fast
    /// commit (group commit: an fsync that entered when the change counter was
    /// `v` is covered once `durable_upto >= v`).
    pub durable_upto: u64,
    /// Chained fast commits written but not yet durable, oldest first
    /// (`Fs::fc_harvest` moves them into `durable_upto`).
    pub pending: std::collections::VecDeque<FcPending>,
    pub stats: FcStats,
}

impl FcDurState {
    /// Whether every change tracked up to `seq` is durable in a fast commit.
    pub fn covered(&self, seq: u64) -> bool {
        self.durable_upto >= seq
    }
}

/// Forget the first `n` tracked dentry changes, which a fast commit of `tid`
/// logged, unless they are gone already: a full commit of `tid` between the
/// plan and this point lets a prune drop them, and the front then holds the
/// next transaction's changes, which no commit has logged yet (dropping
/// those by position would lose, say, a CREAT: its file nameless after a
/// crash although its fsync returned).
fn drain_logged(dentries: &mut Vec<(u32, DentryOp)>, tid: u32, n: usize) {
    let k = dentries
        .iter()
        .take(n)
        .take_while(|(t, _)| *t == tid)
        .count();
    dentries.drain(..k);
}

/// The first [`FcTracker::prune_at`].
const PRUNE_MIN: usize = 4096;

/// `fc_data_csum`: file blocks named by DATA_CSUM records of the fast commit that
/// is (or is about to become) the last one in the log. Recovery checks that
/// commit's data against its checksums, so those blocks must not be overwritten in
/// place until a later commit follows it in the log (docs/FORMAT.md).
#[derive(Default)]
struct FcProtect {
    /// Transaction of the protecting fast commits; once it has fully committed the
    /// fast-commit area is stale and nothing is protected.
    tid: u32,
    /// `(ino, lblk, len, serial)`; `serial` numbers the fast commit.
    ranges: Vec<(u32, u32, u32, u64)>,
    next_serial: u64,
    /// Chained fast commits without DATA_CHAIN, written but not yet durable:
    /// `(serial, flush generation)`. Once a flush numbered after the
    /// generation completes, the commit follows every earlier one in the log
    /// and their ranges are released ([`Inner::fc_protect_hit`]).
    deferred: Vec<(u64, u64)>,
}

/// A chained fast commit written with its TAIL left to a later flush.
#[derive(Debug, Clone, Copy)]
pub struct FcPending {
    /// Durable once a flush numbered after this completes.
    pub gen: u64,
    /// The tracker's `fc_seq` when it was planned.
    pub upto: u64,
    /// The page cache's cut it wrote, if complete.
    pub cut_seq: Option<u64>,
}

/// What an fsync should do.
pub enum FcPlan {
    /// Write these records as a fast commit of transaction `tid`; then call
    /// [`Inner::fc_logged`] with `logged`.
    Fast {
        tid: u32,
        records: Vec<FcRecord>,
        logged: FcLogged,
        /// `fc_data_csum`: DATA_CSUM records whose CRC is still 0, to fill
        /// with [`fill_data_csums`] outside `Inner` before packing
        /// (ARCHITECTURE.md C.2: no device read under a file-system-wide lock).
        csums: Vec<CsumTodo>,
    },
    /// Fall back to a full commit.
    Full(FcReason),
    /// Nothing tracked: only file data may need a flush.
    Nothing,
}

/// What a fast commit covered, to forget after it is durable.
pub struct FcLogged {
    inodes: Vec<(u32, u64)>,
    /// The transaction whose first `dentries` tracked dentry changes it
    /// logged.
    tid: u32,
    dentries: usize,
    /// Serial of its DATA_CSUM protection (`fc_data_csum`), if any.
    serial: Option<u64>,
    /// It carries DATA_CHAIN: recovery verifies the previous commit's data
    /// while this one is final, so that commit's ranges stay protected.
    chained: bool,
}

impl FcLogged {
    /// The commit carries DATA_CHAIN (see [`Self::chained`]).
    pub fn set_chained(&mut self) {
        self.chained = true;
    }
}

/// A DATA_CSUM record of a plan whose CRC is still to be computed: record
/// `index` covers device blocks `pblk..pblk+len`.
#[derive(Debug, Clone, Copy)]
pub struct CsumTodo {
    index: usize,
    ino: u32,
    lblk: u32,
    pblk: u64,
    len: u32,
}

/// Fill the CRCs `todo` names in `records`: each is the CRC of its blocks as
/// they are once the plan's cut is written — from `written` where the cut
/// wrote them, from the page cache where it holds a block clean (the
/// fsynced file's own write-back wrote it just before: no read-back), the
/// rest from the device. Called without `Inner` (the reads may reach the
/// device).
pub(crate) fn fill_data_csums(
    dio: &crate::dataio::DataIo,
    dev: &commitfs_device::DeviceRef,
    pc: Option<&crate::pagecache::PageCache>,
    records: &mut [FcRecord],
    todo: &[CsumTodo],
    written: &DataOverlay,
) -> Result<()> {
    for t in todo {
        let crc = range_crc(dio, dev, pc, t, written)?;
        match records.get_mut(t.index) {
            Some(Tlv::DataCsum { crc: c, pblk, .. }) if *pblk == t.pblk => *c = crc,
            _ => {
                return Err(crate::error::FsError::corrupt(
                    "fast-commit plan: DATA_CSUM record out of place",
                ))
            }
        }
    }
    Ok(())
}

/// CRC of the blocks `t` names as they will be once the fast commit's cut is
/// written (see [`fill_data_csums`]).
fn range_crc(
    dio: &crate::dataio::DataIo,
    dev: &commitfs_device::DeviceRef,
    pc: Option<&crate::pagecache::PageCache>,
    t: &CsumTodo,
    written: &DataOverlay,
) -> Result<u32> {
    let bs = dio.bs;
    let known: Vec<Option<std::sync::Arc<Vec<u8>>>> = (0..t.len)
        .map(|i| {
            written.get(&(t.pblk + i as u64)).cloned().or_else(|| {
                let l = t.lblk.checked_add(i)?;
                pc?.clean_block(t.ino, l)
            })
        })
        .collect();
    if known.iter().all(Option::is_none) {
        return commitfs_journal::data_range_crc(&**dev, bs, t.pblk, t.len)?
            .ok_or_else(|| crate::error::FsError::corrupt("ADD_RANGE beyond the device"));
    }
    let mut crc = commitfs_format::fast_commit::DATA_CRC_SEED;
    let mut buf = vec![0u8; bs];
    for (b, k) in (t.pblk..).zip(&known) {
        match k {
            Some(d) => crc = commitfs_format::fast_commit::data_crc(crc, &d[..bs]),
            None => {
                dio.read(b, &mut buf)?;
                crc = commitfs_format::fast_commit::data_crc(crc, &buf);
            }
        }
    }
    Ok(crc)
}

impl FcTracker {
    fn bump(&mut self) -> u64 {
        self.next_version += 1;
        self.dur
            .seq
            .store(self.next_version, std::sync::atomic::Ordering::Release);
        self.next_version
    }
}

impl Inner {
    /// The tracker's change counter: every change tracked so far has a version
    /// `<= fc_seq()`. An fsync notes it on entry; a fast commit planned when it
    /// was `v` covers every change up to `v` (`FcTracker::durable_upto`).
    pub fn fc_seq(&self) -> u64 {
        self.fc.next_version
    }

    /// A new tracker version for an fdatasync stamp (`DatasyncStamps`), 0
    /// without fast commits. Like any change, it asks an fsync that enters
    /// after it for a fast commit planned at it or later.
    pub fn fc_bump_for_stamp(&mut self) -> u64 {
        if !self.fc_enabled {
            return 0;
        }
        self.fc.bump()
    }

    /// Fast commits are being tracked on this mount.
    pub fn fc_on(&self) -> bool {
        self.fc_enabled
    }

    /// Record that transaction `tid` cannot be fast-committed.
    pub fn fc_ineligible(&mut self, reason: FcReason, tid: u32) {
        if !self.fc_enabled {
            return;
        }
        // An untracked change: no fast commit covers it, so an fsync that
        // entered after it must not count as covered by one (`fc_covered`).
        self.fc.bump();
        let keep = match self.fc.ineligible {
            Some((_, t)) => (t.wrapping_sub(tid) as i32) >= 0,
            None => false,
        };
        if !keep {
            self.fc.ineligible = Some((reason, tid));
        }
    }

    /// Track an inode change in `tid`, optionally with a changed logical range.
    pub fn fc_track_inode(&mut self, ino: u32, tid: u32, range: Option<(u32, u64)>) {
        if !self.fc_enabled {
            return;
        }
        self.fc_prune_if_large();
        let v = self.fc.bump();
        let e = self.fc.inodes.entry(ino).or_insert(Tracked {
            tid,
            range: None,
            version: v,
        });
        e.tid = tid;
        e.version = v;
        if let Some((s, end)) = range {
            e.range = Some(match e.range {
                Some((a, b)) => (a.min(s), b.max(end)),
                None => (s, end),
            });
        }
    }

    pub fn fc_track_dentry(&mut self, op: DentryOp, tid: u32) {
        if !self.fc_enabled {
            return;
        }
        self.fc_prune_if_large();
        self.fc.bump();
        self.fc.dentries.push((tid, op));
    }

    /// Whether a CREAT of `ino` in `tid` has not gone out in a fast commit yet:
    /// then the inode is new to every replayer, and its dentry records can
    /// cancel out (see [`Self::fc_plan`]).
    pub fn fc_creat_pending(&self, ino: u32, tid: u32) -> bool {
        self.fc
            .dentries
            .iter()
            .any(|(t, d)| *t == tid && matches!(d, DentryOp::Creat { ino: i, .. } if *i == ino))
    }

    /// Inode and dentry changes tracked now (`commitfs stats`, memory tests).
    pub fn fc_tracked(&self) -> usize {
        self.fc.inodes.len() + self.fc.dentries.len()
    }

    fn fc_prune_if_large(&mut self) {
        let n = self.fc.inodes.len() + self.fc.dentries.len();
        if n >= self.fc.prune_at.max(PRUNE_MIN) {
            self.fc_prune();
            self.fc.prune_at = 2 * (self.fc.inodes.len() + self.fc.dentries.len());
        }
    }

    /// Drop what committed transactions made durable.
    fn fc_prune(&mut self) {
        let j = self.journal.clone();
        if let Some((_, t)) = self.fc.ineligible {
            if j.is_committed(t) {
                self.fc.ineligible = None;
            }
        }
        self.fc.inodes.retain(|_, t| !j.is_committed(t.tid));
        self.fc.dentries.retain(|(t, _)| !j.is_committed(*t));
    }

    /// Decide how to make the running transaction's changes durable. With
    /// `fc_data_csum` the caller fills the DATA_CSUM records' CRCs
    /// ([`fill_data_csums`]) after dropping `Inner`.
    pub fn fc_plan(&mut self) -> Result<FcPlan> {
        if !self.fc_enabled {
            return Ok(FcPlan::Full(FcReason::NoFullCommitYet));
        }
        // A write between its metadata step and its data write must not be
        // logged: its new blocks may not hold their data yet (ordered mode), and
        // fc_data_csum would checksum half-written blocks. In-flight writes never
        // take `Inner`, which is held here, so none starts and the wait ends
        // (dataio.rs; the kernel's jbd2_journal_lock_updates).
        let j = self.journal.clone();
        self.inflight.wait_idle_or(&|| j.is_aborted());
        self.fc_prune();
        let Some((tid, _, _)) = self.journal.fc_slot() else {
            return Ok(FcPlan::Full(FcReason::NoFullCommitYet));
        };
        if let Some((r, _)) = self.fc.ineligible {
            return Ok(FcPlan::Full(r));
        }
        if self.fc.inodes.is_empty() && self.fc.dentries.is_empty() {
            return Ok(FcPlan::Nothing);
        }
        // Anything tracked under another tid was not pruned, so it belongs to a
        // transaction still committing: let a full commit order things.
        if self.fc.inodes.values().any(|t| t.tid != tid)
            || self.fc.dentries.iter().any(|(t, _)| *t != tid)
        {
            return Ok(FcPlan::Full(FcReason::NoFullCommitYet));
        }
        let mut records = Vec::new();
        // Inodes whose ranges went out before their CREAT.
        let mut ranged = std::collections::BTreeSet::new();
        let dentries: Vec<DentryOp> = self.fc.dentries.iter().map(|(_, d)| d.clone()).collect();
        // The last CREAT of each inode number (collect keeps the last index).
        let last_creat: BTreeMap<u32, usize> = dentries
            .iter()
            .enumerate()
            .filter_map(|(k, d)| match d {
                DentryOp::Creat { ino, .. } => Some((*ino, k)),
                _ => None,
            })
            .collect();
        // The first CREAT of each inode number (collect keeps the last insert).
        let first_creat: BTreeMap<u32, usize> = dentries
            .iter()
            .enumerate()
            .rev()
            .filter_map(|(k, d)| match d {
                DentryOp::Creat { ino, .. } => Some((*ino, k)),
                _ => None,
            })
            .collect();
        // Inodes replay will read or write, for the journal-inode-block rule.
        let mut touched = std::collections::BTreeSet::new();
        let mut freed: BTreeMap<u32, bool> = BTreeMap::new();
        // Freed inodes whose DEL_RANGE went out.
        let mut emptied = std::collections::BTreeSet::new();
        for (k, d) in dentries.iter().enumerate() {
            let (parent, dino) = d.parent_ino();
            let is_freed = match freed.get(&dino) {
                Some(f) => *f,
                None => {
                    let f = self.read_inode(dino)?.links_count == 0;
                    freed.insert(dino, f);
                    f
                }
            };
            if is_freed && self.fc_other_replayers() {
                // An inode freed since it was created in this window gets no
                // record at all: no INODE or CREAT, as the kernel's writer drops
                // the CREAT of an evicted inode (ext4_fc_del) and the kernel's
                // INODE replay refuses an inode without links (ext4_iget fails
                // after the copy, recovery aborts with EFSCORRUPTED); and none of
                // its LINK/UNLINK records either, since e2fsck 1.47 aborts its
                // replay on an UNLINK of a name that is not there
                // (ext2fs_unlink: "No free space in the directory").
                if first_creat.get(&dino).is_some_and(|&f| f <= k) {
                    continue;
                }
                // An inode replay knows, now without links. Its data goes first
                // (DEL_RANGE of everything, before its first UNLINK here): the
                // kernel's UNLINK replay then frees it, and e2fsck 1.47, whose
                // replay keeps the links, clears it as an unattached zero-length
                // inode. With xattrs e2fsck would keep it: the unlink made the
                // transaction ineligible already; this is the safety net.
                let i = self.read_inode(dino)?;
                if i.file_acl != 0 || commitfs_format::xattr::ibody_has_magic(&i.xattr_area) {
                    return Ok(FcPlan::Full(FcReason::UnlinkLast));
                }
                if matches!(d, DentryOp::Unlink { .. }) && emptied.insert(dino) {
                    records.push(Tlv::DelRange {
                        ino: dino,
                        lblk: 0,
                        len: u32::MAX,
                    });
                }
            }
            touched.insert(parent);
            touched.insert(dino);
            if let DentryOp::Creat { ino, .. } = d {
                if is_freed {
                    // fc_data_csum: commitfs alone replays; it drops the CREAT of
                    // an inode freed since and ignores UNLINKs of absent names.
                    continue;
                }
                // Kernel order (§9.4 step 3): INODE, then the dentry — before
                // *every* CREAT, not only the first one of an inode: a number freed
                // and reused within one fast commit (unlink f1; create f2 gets the
                // same ino; unlink f2; create f3) is dropped by the UNLINK replay
                // and must be brought back before the next CREAT can link it.
                // Its ranges go out once, like the kernel (whose range writer
                // empties the inode's range once written): at its *last* CREAT,
                // since replaying the UNLINK of an earlier incarnation frees what
                // the inode maps then (create f2; unlink f2; create f3 reusing the
                // number: ranges at f2's CREAT were lost, f3 read zeros). The
                // per-inode pass below then logs only its final INODE.
                records.push(self.fc_inode_record(*ino)?);
                if last_creat.get(ino) == Some(&k) && ranged.insert(*ino) {
                    let range = self.fc.inodes.get(ino).and_then(|t| t.range);
                    if let Some(r) = range {
                        self.fc_range_records(*ino, r, &mut records)?;
                    }
                }
            }
            records.push(d.to_tlv());
        }
        let inos: Vec<(u32, LblkRange, u64)> = self
            .fc
            .inodes
            .iter()
            .map(|(i, t)| (*i, t.range, t.version))
            .collect();
        // Every tracked inode, created ones included (the kernel writes a created
        // inode twice: its INODE before the CREAT so replay can link it, and again
        // after its ranges so replay recomputes i_blocks from the final tree).
        for (ino, range, _) in &inos {
            // A freed inode is described by its UNLINK alone: replay drops the last
            // link and the orphan cleanup frees it (the kernel's writer likewise
            // forgets evicted inodes; its INODE replay refuses a deleted inode).
            let i = self.read_inode(*ino)?;
            if i.links_count == 0 {
                continue;
            }
            if i.file_acl != 0 {
                // The kernel's INODE replay recomputes i_blocks from the extent tree
                // alone (ext4_ext_replay_set_iblocks), dropping the xattr block from
                // the count: e2fsck then flags the inode ("i_blocks is N, should be
                // N+1 block"), with the kernel's own fast commits too.
                return Ok(FcPlan::Full(FcReason::Xattr));
            }
            if let Some(r) = range.filter(|_| !ranged.contains(ino)) {
                self.fc_range_records(*ino, r, &mut records)?;
            }
            records.push(self.fc_inode_record(*ino)?);
            touched.insert(*ino);
        }
        if let Some(jblk) = self
            .fc_journal_inode_block()
            .filter(|b| self.journal.home_is_stale(*b))
        {
            for &i in &touched {
                if self.inode_location(i)?.0 == jblk {
                    return Ok(FcPlan::Full(FcReason::JournalInodeBlock));
                }
            }
        }
        let (serial, csums) = if self.fc_data_csum {
            let (s, todo) = self.fc_add_data_csums(tid, &mut records);
            (Some(s), todo)
        } else {
            (None, Vec::new())
        };
        let logged = FcLogged {
            inodes: inos.iter().map(|(i, _, v)| (*i, *v)).collect(),
            tid,
            dentries: dentries.len(),
            serial,
            chained: false,
        };
        Ok(FcPlan::Fast {
            tid,
            records,
            logged,
            csums,
        })
    }

    /// Whether the kernel and e2fsck may replay this mount's fast commits. Not with
    /// `fc_data_csum`: its incompat bit makes both refuse the image, so the
    /// eligibility rules that exist for them only (dir_grow, unlink_last,
    /// journal_inode_block) do not apply.
    pub fn fc_other_replayers(&self) -> bool {
        !self.fc_data_csum
    }

    /// The inode-table block holding the journal inode, if other replayers may
    /// replay this mount's fast commits (see [`FcReason::JournalInodeBlock`]).
    pub fn fc_journal_inode_block(&self) -> Option<u64> {
        let j = self.sb.journal_inum();
        if j == 0 || !self.fc_on() || !self.fc_other_replayers() {
            return None;
        }
        Some(self.inode_location(j).ok()?.0)
    }

    /// A planned fast commit was not written (an error, or a full commit took
    /// its transaction first): the data ranges its plan protected need no
    /// protection for it. Its tracked changes stay, for the next plan.
    pub fn fc_plan_dropped(&mut self, logged: &FcLogged) {
        if let Some(s) = logged.serial {
            self.fc.protect.ranges.retain(|r| r.3 != s);
        }
    }

    /// A fast commit covering `logged` is written, durable now (`pending` is
    /// `None`) or once a flush numbered after `pending` completes (chained):
    /// forget those changes (later fast commits of the same transaction carry
    /// only what changed since).
    pub fn fc_logged(&mut self, logged: &FcLogged, pending: Option<u64>) {
        if let (Some(s), false) = (logged.serial, logged.chained) {
            // Once durable this commit follows every earlier one in the log:
            // their data is proven durable by its presence, only its own
            // blocks stay protected. A DATA_CHAIN commit proves nothing of
            // the one before it (recovery verifies that one's data too).
            match pending {
                None => self.fc.protect.ranges.retain(|r| r.3 >= s),
                Some(g) => self.fc.protect.deferred.push((s, g)),
            }
        }
        for (ino, v) in &logged.inodes {
            if self.fc.inodes.get(ino).is_some_and(|t| t.version == *v) {
                self.fc.inodes.remove(ino);
            }
        }
        drain_logged(&mut self.fc.dentries, logged.tid, logged.dentries);
    }

    /// Append a DATA_CSUM record (CRC still 0) for every written ADD_RANGE in
    /// `records` and protect those blocks under a new serial. Returns the
    /// serial and what [`fill_data_csums`] must compute: the blocks' content
    /// cannot change until this fast commit is written, since an in-place
    /// overwrite of a protected range first waits for the fast-commit leader
    /// ([`crate::Fs`]'s `fc_confirm`), whose lock the planner holds.
    fn fc_add_data_csums(&mut self, tid: u32, records: &mut Vec<FcRecord>) -> (u64, Vec<CsumTodo>) {
        let mut csums = Vec::new();
        let mut todo = Vec::new();
        let mut ranges = Vec::new();
        for r in records.iter() {
            if let Tlv::AddRange {
                ino,
                lblk,
                len,
                pblk,
                unwritten: false,
            } = r
            {
                todo.push(CsumTodo {
                    index: records.len() + csums.len(),
                    ino: *ino,
                    lblk: *lblk,
                    pblk: *pblk,
                    len: *len,
                });
                csums.push(Tlv::DataCsum {
                    ino: *ino,
                    lblk: *lblk,
                    len: *len,
                    pblk: *pblk,
                    crc: 0,
                });
                ranges.push((*ino, *lblk, *len));
            }
        }
        records.extend(csums);
        let p = &mut self.fc.protect;
        if p.tid != tid {
            p.ranges.clear();
            p.deferred.clear();
            p.tid = tid;
        }
        p.next_serial += 1;
        let s = p.next_serial;
        p.ranges
            .extend(ranges.into_iter().map(|(i, l, n)| (i, l, n, s)));
        (s, todo)
    }

    /// `fc_data_csum`: the transaction whose last fast commit protects a block of
    /// `ino` in `lo..hi` (file blocks), if any — writing there in place first needs
    /// [`Self::fc_protect_confirmed`] after a confirming commit.
    pub fn fc_protect_hit(&mut self, ino: u32, lo: u64, hi: u64) -> Option<u32> {
        let p = &mut self.fc.protect;
        if p.ranges.is_empty() {
            return None;
        }
        if self.journal.is_committed(p.tid) {
            p.ranges.clear();
            p.deferred.clear();
            return None;
        }
        // Chained commits made durable since: release what they follow.
        let j = &self.journal;
        let mut upto = None;
        p.deferred.retain(|&(s, g)| {
            let durable = j.flushed_since(g);
            if durable {
                upto = upto.max(Some(s));
            }
            !durable
        });
        if let Some(s) = upto {
            p.ranges.retain(|r| r.3 >= s);
        }
        p.ranges
            .iter()
            .any(|&(i, l, n, _)| i == ino && (l as u64) < hi && lo < l as u64 + n as u64)
            .then_some(p.tid)
    }

    /// Every fast commit written so far is followed by a later commit (or a full
    /// commit): nothing is protected any more.
    pub fn fc_protect_confirmed(&mut self) {
        self.fc.protect.ranges.clear();
        self.fc.protect.deferred.clear();
    }

    fn fc_inode_record(&mut self, ino: u32) -> Result<FcRecord> {
        let i = self.read_inode(ino)?;
        // The kernel's writer logs 128 + i_extra_isize bytes; replay copies the
        // record over the on-disk inode and keeps the rest (the in-inode xattr
        // area). That is right when the area replay starts from already holds what
        // the inode has now, and wrong for a reused inode number: it would get back
        // the in-inode xattrs of the freed inode that last had it. So: the short
        // form when every version replay could start from matches, else the whole
        // on-disk inode (both replayers accept up to s_inode_size).
        let mut buf = vec![0u8; self.inode_size];
        i.serialize(&mut buf, ino, &self.csum);
        let short = (128 + i.extra_isize as usize).min(buf.len());
        if short < buf.len() {
            let (blk, off) = self.inode_location(ino)?;
            let bases = self.journal.replay_bases(blk)?;
            let same = bases
                .iter()
                .all(|b| b.get(off + short..off + self.inode_size) == Some(&buf[short..]));
            if same {
                buf.truncate(short);
            }
        }
        Ok(Tlv::Inode {
            ino,
            raw: Cow::Owned(buf),
        })
    }

    /// ADD_RANGE for mapped runs and DEL_RANGE for holes in `[start, end)` (§9.4
    /// step 4), split to the extent length limits.
    fn fc_range_records(
        &mut self,
        ino: u32,
        (start, end): (u32, u64),
        out: &mut Vec<FcRecord>,
    ) -> Result<()> {
        let i = self.read_inode(ino)?;
        let end = end.min(1u64 << 32);
        if i.links_count == 0 || i.mode == 0 {
            out.push(Tlv::DelRange {
                ino,
                lblk: start,
                len: (end - start as u64).min(u32::MAX as u64) as u32,
            });
            return Ok(());
        }
        for (l, len, m) in self.ext_segments(ino, &i, start as u64, end)? {
            let lb = l as u32;
            match m {
                Some(m) => {
                    let len = len as u32;
                    let max = if m.unwritten { 32767 } else { 32768 };
                    let mut done = 0;
                    while done < len {
                        let n = (len - done).min(max);
                        out.push(Tlv::AddRange {
                            ino,
                            lblk: lb + done,
                            len: n,
                            pblk: m.pblk + done as u64,
                            unwritten: m.unwritten,
                        });
                        done += n;
                    }
                }
                None => out.push(Tlv::DelRange {
                    ino,
                    lblk: lb,
                    len: len.min(u32::MAX as u64) as u32,
                }),
            }
        }
        Ok(())
    }

    /// Count a fallback to a full commit.
    pub fn fc_count_ineligible(&mut self, r: FcReason) {
        *self
            .fc
            .dur
            .lock()
            .stats
            .ineligible
            .entry(r.name())
            .or_insert(0) += 1;
    }
}

/// Encode `records` as one fast commit of `tid` in the kernel's TLV layout
/// (§9.4, packer in `commitfs_format::fast_commit`): HEAD when `need_head`,
/// PAD-closed blocks, TAIL with the CRC. `None` when it needs more than `free`
/// blocks or a record can never fit a block (the caller falls back to a full
/// commit, like the kernel).
pub fn pack(
    records: &[FcRecord],
    tid: u32,
    need_head: bool,
    block_size: usize,
    free: u32,
) -> Option<Vec<Vec<u8>>> {
    let mut p = FcPacker::new(block_size, tid, need_head).ok()?;
    for r in records {
        p.push(r).ok()?;
        if p.blocks_when_finished() as u32 > free {
            return None;
        }
    }
    // A commit may end in the area's last block only with a stopper (§9.6).
    let plain = p.clone().finish();
    let packed = if (plain.nblocks as u32) < free {
        plain
    } else {
        p.finish_stopped()
    };
    if packed.nblocks as u32 > free {
        return None;
    }
    Some(
        packed
            .blocks
            .chunks(block_size)
            .map(|c| c.to_vec())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creat(ino: u32) -> DentryOp {
        DentryOp::Creat {
            parent: 2,
            ino,
            name: format!("f{ino}").into_bytes(),
        }
    }

    #[test]
    fn logged_dentries_are_drained_only_while_they_are_there() {
        // The plan of tid 7 logged the first two; nothing pruned meanwhile.
        let mut d = vec![(7, creat(12)), (7, creat(13)), (7, creat(14))];
        drain_logged(&mut d, 7, 2);
        assert_eq!(d.len(), 1);
        assert!(matches!(d[0].1, DentryOp::Creat { ino: 14, .. }));
        // A full commit of tid 7 and a prune came between the plan and here:
        // tid 8's changes are at the front and stay.
        let mut d = vec![(8, creat(20)), (8, creat(21))];
        drain_logged(&mut d, 7, 2);
        assert_eq!(d.len(), 2, "the next transaction's dentries were dropped");
        // Fewer left than logged (cannot happen without a prune, but safe).
        let mut d = vec![(7, creat(12))];
        drain_logged(&mut d, 7, 3);
        assert!(d.is_empty());
    }
}
