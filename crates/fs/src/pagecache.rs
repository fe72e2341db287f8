//! The file-data page cache (issue #11; docs/ARCHITECTURE.md "Design: the page
//! cache and the commit cut").
//!
//! `write()` copies into pages here and touches neither the device nor the
//! journal; blocks are allocated when the pages are written back (delayed
//! allocation): by a file's write-back (`Fs::writeback_file`) or by the *cut*
//! every commit starts with (`Fs::cut`), which maps every dirty page of every
//! file under the `barrier` so that no cached write falls between the cut and
//! the commit that must contain it.
//!
//! Locking: the files are in shards by inode number, each behind its own
//! leaf lock held for map operations and page copies only (never across
//! device I/O, `Inner`, a journal call or another shard), so readers and
//! writers of different files rarely meet and none takes a lock of the
//! whole cache; counters are atomics. `barrier` is held shared by a writer
//! while it dirties pages (memory only) and exclusively by a cut; order:
//! inode lock → barrier → `Inner` → a shard.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use commitfs_format::inode::Timestamp;
use parking_lot::{Condvar, Mutex, RwLock};

/// One cached file block. `dirty`: changed since its last write-back
/// snapshot; `writing`: a snapshot of it is being written (it is not evicted
/// then, so a reader never falls through to a device without the data, and a
/// second write-back waits, so two snapshots never race to the device).
#[derive(Clone)]
struct Page {
    data: Arc<Vec<u8>>,
    dirty: bool,
    writing: bool,
    /// The block was a hole when the page was made (counted in `st_blocks`
    /// until it is allocated, as ext4 counts reserved delayed blocks).
    delayed: bool,
    /// Second-chance bit: set by a read that finds the page, cleared by an
    /// eviction pass that spares it (docs/ARCHITECTURE.md "Memory"). Writes do
    /// not set it: as in the kernel's use-once rule, data only written (a
    /// stream being saved) goes before data read again.
    used: bool,
}

/// One file's cached state.
#[derive(Default)]
struct FileCache {
    pages: BTreeMap<u32, Page>,
    /// The size `write()` made visible (the inode keeps the on-disk size until
    /// write-back; ext4's `i_size` vs `i_disksize`).
    size: u64,
    /// mtime/ctime of cached writes not in the inode yet.
    times: Option<Timestamp>,
    /// Pages with `dirty` set.
    dirty: u32,
    /// Delayed pages (dirty or under write-back, no block yet).
    delayed: u32,
    /// When the file last went from clean to dirty (`data_order=file`: the
    /// periodic commit writes back files dirty for [`DIRTY_EXPIRE`]).
    dirtied: Option<std::time::Instant>,
}

impl FileCache {
    /// Has something to write back (pages or times), and (when `t` is given)
    /// has had since before `t`.
    fn dirty_before(&self, t: Option<std::time::Instant>) -> bool {
        (self.dirty > 0 || self.times.is_some())
            && t.is_none_or(|t| self.dirtied.is_none_or(|d| d < t))
    }
}

/// The instant before which dirty data has expired (`None` this early after
/// boot).
fn expired_before() -> Option<std::time::Instant> {
    std::time::Instant::now().checked_sub(DIRTY_EXPIRE)
}

/// `data_order=file`: cached data older than this goes out with the next
/// periodic commit (the kernel's `dirty_expire_centisecs`, 30 s).
pub(crate) const DIRTY_EXPIRE: std::time::Duration = std::time::Duration::from_secs(30);

const ASK_EXPIRED: u8 = 1;
const ASK_ALL: u8 = 2;

/// What the commit about to lock must cut ([`PageCache::take_cut`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CutWhat {
    /// Nothing (`data_order=file`, nobody asked).
    Nothing,
    /// Files dirty since before this instant (the periodic commit's).
    DirtiedBefore(std::time::Instant),
    /// Every dirty file.
    All,
}

/// A snapshot taken for write-back: file block and data.
#[derive(Clone)]
pub(crate) struct Snap {
    pub lblk: u32,
    pub data: Arc<Vec<u8>>,
}

/// What a write-back of one file takes from the cache.
pub(crate) struct Taken {
    pub snaps: Vec<Snap>,
    /// Visible size and pending times to put into the inode.
    pub size: u64,
    pub times: Option<Timestamp>,
}

/// A planned write into the cache: which pages it needs read first.
pub(crate) struct WritePlan {
    /// File blocks the write covers only partly and that are neither cached nor
    /// past the end of the file: their current content must be read first.
    pub fill: Vec<u32>,
}

/// Shards of the file map: a power of two (inode numbers spread over them
/// by their low bits, so consecutive inodes never share one).
const SHARDS: usize = 64;

/// One shard: its files, and the condition signalled when a write of one of
/// their pages ends (waited for with the shard's lock).
#[derive(Default)]
struct Shard {
    files: Mutex<HashMap<u32, FileCache>>,
    written: Condvar,
}

/// The counters of [`CacheStats`] that the cache bumps.
#[derive(Default)]
pub(crate) struct Counters {
    pub bytes_written: AtomicU64,
    pub read_hits: AtomicU64,
    pub read_fills: AtomicU64,
    pub writebacks: AtomicU64,
    pub cuts: AtomicU64,
    pub blocks_written: AtomicU64,
    pub device_writes: AtomicU64,
    pub dropped_dirty: AtomicU64,
    pub evicted: AtomicU64,
}

impl Counters {
    /// Add `n` to counter `c`.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

pub(crate) struct PageCache {
    bs: usize,
    /// Memory cap for pages, bytes.
    cap: usize,
    /// The files, in [`SHARDS`] shards by inode number: no lock of the
    /// cache is file-system-wide (issue #11: reads of file data take none).
    shards: Box<[Shard]>,
    /// Held by the eviction pass under way ([`Self::evict`]).
    evicting: Mutex<()>,
    /// Files dropped under `Inner`, not freed yet ([`Self::reap`]), and
    /// whether there are any.
    graveyard: Mutex<Vec<FileCache>>,
    dead: std::sync::atomic::AtomicBool,
    /// Shared: a writer dirtying pages; exclusive: a cut (see the module doc).
    pub barrier: RwLock<()>,
    /// Pages cached, and of them dirty or being written.
    pages: AtomicUsize,
    dirty: AtomicUsize,
    /// Blocks reserved for delayed pages (ext4's `s_dirtyclusters_counter`):
    /// taken from `grant` before the pages exist, given back as they are
    /// allocated or dropped.
    reserved: AtomicU64,
    /// Blocks approved for reservation without asking `Inner` (slack while
    /// space is plentiful; see `Fs::reserve_delayed`).
    pub grant: Mutex<u64>,
    /// Files with `dirty > 0` (a cut maps each: bounds its transaction).
    dirty_files: AtomicUsize,
    /// Cached writes so far (bumped under the barrier, shared): an fsync
    /// notes it on entry.
    wseq: AtomicU64,
    /// Cuts not known durable yet: (transaction, `wseq` when cut). Every
    /// write up to that `wseq` is mapped in that transaction or an earlier one.
    cuts: Mutex<std::collections::VecDeque<(u32, u64)>>,
    /// Every cached write up to this `wseq` is durable (through a durable cut).
    durable_seq: AtomicU64,
    /// Calls of [`Self::discard`] so far (bumped under the file's shard): a fill
    /// started before one is dropped, since the file it read may be freed and
    /// its number reused (see [`Self::fill`]).
    discards: AtomicU64,
    /// Counters for `commitfs stats` (atomics: every read and write counts).
    pub(crate) stats: Counters,
    /// `data_order=file`: a commit cuts (writes every file's cached data)
    /// only when asked ([`Self::ask_cut`]); fsyncs write back their own file.
    per_file: bool,
    /// A cut was asked for (sync, the periodic commit) and no commit took it yet.
    cut_asked: std::sync::atomic::AtomicU8,
    /// `data_order=file`: files truncated to zero since their last close
    /// (ext4's `EXT4_STATE_DA_ALLOC_CLOSE`): their next close writes them back.
    da_alloc_close: Mutex<std::collections::HashSet<u32>>,
    /// See [`Self::note_attr_changed`].
    attr_changed: Mutex<std::collections::HashSet<u32>>,
    watch_attrs: std::sync::atomic::AtomicBool,
}

/// Page cache counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes `write()` put into the cache.
    pub bytes_written: u64,
    /// Reads answered entirely from the cache.
    pub read_hits: u64,
    /// Blocks read from the device and kept as clean pages.
    pub read_fills: u64,
    /// Write-backs of one file, and cuts that mapped something.
    pub writebacks: u64,
    pub cuts: u64,
    /// Blocks written back, and the device writes that carried them (one per
    /// contiguous run).
    pub blocks_written: u64,
    pub device_writes: u64,
    /// Dirty pages dropped unwritten (a file freed or truncated to zero).
    pub dropped_dirty: u64,
    /// Clean pages evicted under the cap.
    pub evicted: u64,
    /// Now: bytes cached, and of them dirty or being written.
    pub cached_bytes: u64,
    pub dirty_bytes: u64,
}

impl PageCache {
    pub fn new(bs: usize, cap_bytes: usize) -> PageCache {
        PageCache {
            bs,
            cap: cap_bytes.max(bs * 64),
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            evicting: Mutex::new(()),
            graveyard: Mutex::new(Vec::new()),
            dead: std::sync::atomic::AtomicBool::new(false),
            barrier: RwLock::new(()),
            pages: AtomicUsize::new(0),
            dirty: AtomicUsize::new(0),
            reserved: AtomicU64::new(0),
            grant: Mutex::new(0),
            wseq: AtomicU64::new(0),
            dirty_files: AtomicUsize::new(0),
            cuts: Mutex::new(Default::default()),
            durable_seq: AtomicU64::new(0),
            discards: AtomicU64::new(0),
            stats: Counters::default(),
            per_file: false,
            cut_asked: std::sync::atomic::AtomicU8::new(0),
            da_alloc_close: Mutex::new(Default::default()),
            attr_changed: Mutex::new(Default::default()),
            watch_attrs: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The shard holding `ino`.
    fn shard(&self, ino: u32) -> &Shard {
        &self.shards[ino as usize & (SHARDS - 1)]
    }

    /// This cache under `data_order=` `order`.
    pub fn with_order(mut self, order: crate::DataOrder) -> PageCache {
        self.per_file = order == crate::DataOrder::File;
        self
    }

    /// `data_order=file`: commits cut only when asked.
    pub fn per_file(&self) -> bool {
        self.per_file
    }

    /// Ask the next commit to cut every dirty file (`data_order=file`:
    /// sync, too many dirty files for one transaction; a no-op under
    /// `prefix`, where every commit cuts).
    pub fn ask_cut(&self) {
        self.cut_asked.fetch_max(ASK_ALL, Ordering::AcqRel);
    }

    /// Whether a periodic commit has cached data to write: any dirty file
    /// under `prefix`, files dirty for [`DIRTY_EXPIRE`] under `file`.
    pub fn periodic_due(&self) -> bool {
        if !self.per_file {
            return self.has_dirty();
        }
        let Some(t) = expired_before() else {
            return false;
        };
        self.has_dirty()
            && self
                .shards
                .iter()
                .any(|sh| sh.files.lock().values().any(|f| f.dirty_before(Some(t))))
    }

    /// Ask the next commit to cut files dirty for [`DIRTY_EXPIRE`] or longer
    /// (`data_order=file`: the periodic commit, ext4's flusher).
    pub fn ask_expired_cut(&self) {
        self.cut_asked.fetch_max(ASK_EXPIRED, Ordering::AcqRel);
    }

    /// What the commit about to lock must cut: everything under
    /// `data_order=prefix`; under `file` what was asked (the request is taken).
    pub fn take_cut(&self) -> CutWhat {
        if !self.per_file {
            return CutWhat::All;
        }
        match self.cut_asked.swap(0, Ordering::AcqRel) {
            0 => CutWhat::Nothing,
            ASK_EXPIRED => expired_before().map_or(CutWhat::Nothing, CutWhat::DirtiedBefore),
            _ => CutWhat::All,
        }
    }

    /// Give a taken request back (the commit could not cut).
    pub fn ask_again(&self, what: CutWhat) {
        match what {
            CutWhat::All => self.ask_cut(),
            CutWhat::DirtiedBefore(_) => self.ask_expired_cut(),
            CutWhat::Nothing => {}
        }
    }

    /// `data_order=file`: `ino` was truncated to zero; its next close writes
    /// its cached data back (ext4's `auto_da_alloc` for truncate-and-rewrite).
    pub fn note_truncated_to_zero(&self, ino: u32) {
        if self.per_file {
            self.da_alloc_close.lock().insert(ino);
        }
    }

    /// Files marked by [`Self::note_truncated_to_zero`] that have dirty
    /// pages: every commit and fast commit writes them back, since through
    /// FUSE a close sends no request (the kernel's `auto_da_alloc` writes
    /// them at close, before any later commit can expose the truncate alone).
    pub fn da_alloc_dirty(&self) -> Vec<u32> {
        if !self.per_file {
            return Vec::new();
        }
        let marked: Vec<u32> = self.da_alloc_close.lock().iter().copied().collect();
        if marked.is_empty() {
            return marked;
        }
        marked
            .into_iter()
            .filter(|&i| {
                self.shard(i)
                    .files
                    .lock()
                    .get(&i)
                    .is_some_and(|f| f.dirty > 0)
            })
            .collect()
    }

    /// Whether closing `ino` must write it back (see
    /// [`Self::note_truncated_to_zero`]); the mark is taken.
    pub fn take_da_alloc_close(&self, ino: u32) -> bool {
        self.per_file && self.da_alloc_close.lock().remove(&ino)
    }

    /// Bytes of dirty (or under write-back) pages past which a writer writes
    /// its own file back.
    pub fn dirty_limit(&self) -> usize {
        self.cap / 2
    }

    pub fn dirty_bytes(&self) -> usize {
        self.dirty.load(Ordering::Acquire) * self.bs
    }

    /// The counters, with the current sizes.
    pub fn snapshot(&self) -> CacheStats {
        let c = &self.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = CacheStats {
            bytes_written: get(&c.bytes_written),
            read_hits: get(&c.read_hits),
            read_fills: get(&c.read_fills),
            writebacks: get(&c.writebacks),
            cuts: get(&c.cuts),
            blocks_written: get(&c.blocks_written),
            device_writes: get(&c.device_writes),
            dropped_dirty: get(&c.dropped_dirty),
            evicted: get(&c.evicted),
            ..Default::default()
        };
        s.cached_bytes = (self.pages.load(Ordering::Acquire) * self.bs) as u64;
        s.dirty_bytes = self.dirty_bytes() as u64;
        s
    }

    /// Files with dirty pages.
    pub fn dirty_files(&self) -> usize {
        self.dirty_files.load(Ordering::Acquire)
    }

    /// Blocks reserved for delayed pages.
    pub fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }

    /// Reserve `n` blocks from the grant; false when it has fewer.
    pub fn take_grant(&self, n: u64) -> bool {
        let mut g = self.grant.lock();
        if *g < n {
            return false;
        }
        *g -= n;
        self.reserved.fetch_add(n, Ordering::AcqRel);
        true
    }

    /// Reserve `n` blocks approved by the caller (under `Inner`).
    pub fn reserve(&self, n: u64) {
        self.reserved.fetch_add(n, Ordering::AcqRel);
    }

    /// Give back `n` reserved blocks.
    pub fn unreserve(&self, n: u64) {
        let _ = self
            .reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                Some(r.saturating_sub(n))
            });
    }

    /// Whether a write of `len` bytes at `off` covers a block below the
    /// on-disk size that has no page (it may be a hole: a delayed page then).
    pub fn uncached_inside(
        &self,
        ino: u32,
        off: u64,
        len: usize,
        disk_size: u64,
    ) -> Option<(u32, u32)> {
        let bs = self.bs as u64;
        let lo = off / bs;
        let hi = (off + len as u64).div_ceil(bs).min(disk_size.div_ceil(bs));
        if lo >= hi {
            return None;
        }
        let files = self.shard(ino).files.lock();
        // Inclusive: the last block of the largest file is 2^32 - 1.
        let cached = files.get(&ino).map_or(0, |f| {
            f.pages.range(lo as u32..=(hi - 1) as u32).count() as u64
        });
        (cached < hi - lo).then_some((lo as u32, (hi - 1) as u32))
    }

    /// Of the holes `holes` (file blocks), those without a page: each becomes
    /// a delayed page when written.
    pub fn uncached(&self, ino: u32, holes: Vec<u32>) -> Vec<u32> {
        let files = self.shard(ino).files.lock();
        match files.get(&ino) {
            Some(f) => holes
                .into_iter()
                .filter(|l| !f.pages.contains_key(l))
                .collect(),
            None => holes,
        }
    }

    /// Blocks a write of `len` bytes at `off` would add as delayed pages past
    /// the on-disk size.
    pub fn new_delayed(&self, ino: u32, off: u64, len: usize, disk_size: u64) -> u64 {
        let bs = self.bs as u64;
        let first = (off / bs).max(disk_size.div_ceil(bs));
        let end = (off + len as u64).div_ceil(bs);
        if first >= end {
            return 0;
        }
        let files = self.shard(ino).files.lock();
        // Inclusive: the last block of the largest file is 2^32 - 1.
        let cached = files.get(&ino).map_or(0, |f| {
            f.pages.range(first as u32..=(end - 1) as u32).count() as u64
        });
        end - first - cached
    }

    /// The cached-write counter (an fsync's entry value).
    pub fn wseq(&self) -> u64 {
        self.wseq.load(Ordering::Acquire)
    }

    /// A cut of transaction `tid` (the caller holds the barrier exclusively):
    /// returns the `wseq` it covers.
    pub fn note_cut(&self, tid: u32) -> u64 {
        let s = self.wseq();
        let mut c = self.cuts.lock();
        if c.back().is_none_or(|&(t, q)| t != tid || q < s) {
            c.push_back((tid, s));
        }
        s
    }

    /// A cut that covered writes up to `seq` is durable (a fast commit).
    pub fn cut_durable(&self, seq: u64) {
        self.durable_seq.fetch_max(seq, Ordering::AcqRel);
    }

    /// Whether every cached write up to `seq` is durable; `committed(tid)`
    /// tells durable transactions.
    pub fn covered(&self, seq: u64, committed: &dyn Fn(u32) -> bool) -> bool {
        if self.durable_seq.load(Ordering::Acquire) >= seq {
            return true;
        }
        let mut c = self.cuts.lock();
        while let Some(&(t, s)) = c.front() {
            if !committed(t) {
                break;
            }
            self.durable_seq.fetch_max(s, Ordering::AcqRel);
            c.pop_front();
        }
        self.durable_seq.load(Ordering::Acquire) >= seq
    }

    /// Whether more is cached than the cap allows.
    pub fn over_cap(&self) -> bool {
        self.pages.load(Ordering::Acquire) * self.bs > self.cap
    }

    /// Whether any page is dirty (not under write-back): O(1), every fsync
    /// and commit asks.
    pub fn has_dirty(&self) -> bool {
        self.dirty_files() > 0
    }

    /// Put back pending times a failed write-back took ([`Self::take_dirty`]),
    /// unless newer ones came meanwhile.
    pub fn restore_times(&self, ino: u32, t: Option<Timestamp>) {
        if let (Some(t), Some(f)) = (t, self.shard(ino).files.lock().get_mut(&ino)) {
            f.times = Some(f.times.map_or(t, |n| n.max(t)));
        }
    }

    /// Inodes with dirty pages.
    pub fn dirty_inos(&self) -> Vec<u32> {
        self.dirty_inos_before(None)
    }

    /// [`Self::dirty_inos`], only files dirty since before `t` (with pending
    /// times alone: always) when `t` is given.
    pub fn dirty_inos_before(&self, t: Option<std::time::Instant>) -> Vec<u32> {
        let mut v = Vec::new();
        for sh in self.shards.iter() {
            v.extend(
                sh.files
                    .lock()
                    .iter()
                    .filter(|(_, f)| f.dirty_before(t))
                    .map(|(&i, _)| i),
            );
        }
        v
    }

    /// The size `write()` made visible for `ino` (0 when not cached).
    pub fn cached_size(&self, ino: u32) -> u64 {
        self.shard(ino).files.lock().get(&ino).map_or(0, |f| f.size)
    }

    /// The first `max` runs `[lo, hi)` of consecutive dirty pages of `ino`:
    /// what a write-back's warm pass walks (warm.rs).
    pub fn dirty_runs(&self, ino: u32, max: usize) -> Vec<(u64, u64)> {
        let files = self.shard(ino).files.lock();
        let Some(f) = files.get(&ino).filter(|f| f.dirty > 0) else {
            return Vec::new();
        };
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (&l, p) in &f.pages {
            if !p.dirty {
                continue;
            }
            let n = runs.len();
            match runs.last_mut() {
                Some(r) if r.1 == l as u64 => r.1 += 1,
                _ if n == max => break,
                _ => runs.push((l as u64, l as u64 + 1)),
            }
        }
        runs
    }

    /// Whether `ino` has dirty pages or pending times.
    pub fn is_dirty(&self, ino: u32) -> bool {
        self.shard(ino)
            .files
            .lock()
            .get(&ino)
            .is_some_and(|f| f.dirty > 0 || f.times.is_some())
    }

    /// Patch attributes from the inode with what cached writes changed: size,
    /// times, delayed blocks.
    pub fn patch_attr(&self, a: &mut crate::Attr) {
        let files = self.shard(a.ino).files.lock();
        let Some(f) = files.get(&a.ino) else {
            return;
        };
        a.size = f.size;
        if let Some(t) = f.times {
            a.mtime = t;
            a.ctime = a.ctime.max(t);
        }
        a.blocks += f.delayed as u64 * (self.bs as u64 / 512);
    }

    /// The blocks a write of `len` bytes at `off` covers only partly (its
    /// first and last) that hold on-disk data (below `disk_size`) and are not
    /// `present`: their current content must be read before the write.
    fn needs_content(
        &self,
        off: u64,
        len: usize,
        disk_size: u64,
        present: impl Fn(u32) -> bool,
    ) -> Vec<u32> {
        let bs = self.bs as u64;
        let end = off + len as u64;
        let (first, last) = ((off / bs) as u32, ((end - 1) / bs) as u32);
        [
            (
                first,
                !off.is_multiple_of(bs) || (first == last && !end.is_multiple_of(bs)),
            ),
            (last, !end.is_multiple_of(bs)),
        ]
        .into_iter()
        .filter(|&(l, partial)| partial && (l as u64 * bs) < disk_size && !present(l))
        .map(|(l, _)| l)
        .collect()
    }

    /// Plan a write of `len` bytes at `off` into a file whose on-disk size is
    /// `disk_size`: which partial blocks need their content first.
    pub fn plan_write(&self, ino: u32, off: u64, len: usize, disk_size: u64) -> WritePlan {
        let files = self.shard(ino).files.lock();
        let f = files.get(&ino);
        let mut fill = self.needs_content(off, len, disk_size, |l| {
            f.is_some_and(|f| f.pages.contains_key(&l))
        });
        fill.dedup();
        WritePlan { fill }
    }

    /// Copy `data` at `off` into pages of `ino` (call with the barrier held
    /// shared and the inode's lock exclusively). `filled`: content of blocks
    /// [`Self::plan_write`] asked for; `disk_size`: the inode's on-disk size (a
    /// new page at or past it is delayed: no block yet), `holes`: file blocks
    /// below it that are holes (sorted; their new pages are delayed too);
    /// `reserved`: blocks the caller reserved for delayed pages (any not used
    /// are given back). Returns the pages that became dirty.
    pub fn write(
        &self,
        ino: u32,
        off: u64,
        data: &[u8],
        filled: Vec<(u32, Vec<u8>)>,
        (disk_size, holes): (u64, &[u32]),
        reserved: u64,
    ) -> Result<usize, ()> {
        let now = crate::inner::now();
        let bs = self.bs;
        let mut files = self.shard(ino).files.lock();
        // A partial block over on-disk data needs its page or its content:
        // a page the caller counted on may have been evicted since it planned
        // (then nothing is changed and the caller plans again).
        let f = files.get(&ino);
        let missing = self.needs_content(off, data.len(), disk_size, |l| {
            f.is_some_and(|f| f.pages.contains_key(&l)) || filled.iter().any(|(b, _)| *b == l)
        });
        if !missing.is_empty() {
            return Err(());
        }
        let f = files.entry(ino).or_insert_with(|| FileCache {
            size: disk_size,
            ..Default::default()
        });
        let mut filled: HashMap<u32, Vec<u8>> = filled.into_iter().collect();
        let mut pos = 0usize;
        let (mut new_dirty, mut new_pages, mut delayed) = (0, 0, 0u64);
        if f.dirty == 0 {
            self.dirty_files.fetch_add(1, Ordering::AcqRel);
            f.dirtied = Some(std::time::Instant::now());
        }
        while pos < data.len() {
            let cur = off + pos as u64;
            let lblk = (cur / bs as u64) as u32;
            let in_blk = (cur % bs as u64) as usize;
            let n = (bs - in_blk).min(data.len() - pos);
            let mut created = false;
            let page = f.pages.entry(lblk).or_insert_with(|| {
                created = true;
                let mut d = filled.remove(&lblk).unwrap_or_default();
                d.resize(bs, 0);
                Page {
                    data: Arc::new(d),
                    dirty: false,
                    writing: false,
                    delayed: false,
                    used: false,
                }
            });
            if created {
                new_pages += 1;
                if lblk as u64 * bs as u64 >= disk_size || holes.binary_search(&lblk).is_ok() {
                    page.delayed = true;
                    f.delayed += 1;
                    delayed += 1;
                }
            }
            Arc::make_mut(&mut page.data)[in_blk..in_blk + n].copy_from_slice(&data[pos..pos + n]);
            if !page.dirty {
                page.dirty = true;
                f.dirty += 1;
                // Being written: counted in `dirty` already.
                if !page.writing {
                    new_dirty += 1;
                }
            }
            pos += n;
        }
        f.size = f.size.max(off + data.len() as u64);
        f.times = Some(now);
        // Counted before the shard lock goes: an eviction that finds the
        // pages must find them counted (`pages` never runs below zero).
        self.pages.fetch_add(new_pages, Ordering::AcqRel);
        drop(files);
        self.wseq.fetch_add(1, Ordering::AcqRel);
        if delayed < reserved {
            self.unreserve(reserved - delayed);
        }
        self.dirty.fetch_add(new_dirty, Ordering::AcqRel);
        Counters::add(&self.stats.bytes_written, data.len() as u64);
        Ok(new_dirty)
    }

    /// Copy cached bytes of `ino` at `off` into `buf`, up to the visible size,
    /// under one hold of the lock: the bytes there are, and per block whether
    /// it came from the cache. `None`: the cache does not know the file.
    pub fn read(&self, ino: u32, off: u64, buf: &mut [u8]) -> Option<(usize, Vec<bool>)> {
        let bs = self.bs as u64;
        let mut files = self.shard(ino).files.lock();
        let f = files.get_mut(&ino)?;
        if off >= f.size {
            return Some((0, Vec::new()));
        }
        let len = ((f.size - off) as usize).min(buf.len());
        let buf = &mut buf[..len];
        let mut hit = Vec::new();
        let mut pos = 0usize;
        while pos < buf.len() {
            let cur = off + pos as u64;
            let lblk = (cur / bs) as u32;
            let in_blk = (cur % bs) as usize;
            let n = (bs as usize - in_blk).min(buf.len() - pos);
            match f.pages.get_mut(&lblk) {
                Some(p) => {
                    buf[pos..pos + n].copy_from_slice(&p.data[in_blk..in_blk + n]);
                    p.used = true;
                    hit.push(true);
                }
                None => hit.push(false),
            }
            pos += n;
        }
        Some((len, hit))
    }

    /// The data of `ino`'s page `lblk` when it is cached and clean (neither
    /// dirty nor being written): then it is what the block holds on the
    /// device, since reads are served from it.
    pub fn clean_block(&self, ino: u32, lblk: u32) -> Option<Arc<Vec<u8>>> {
        let files = self.shard(ino).files.lock();
        let p = files.get(&ino)?.pages.get(&lblk)?;
        (!p.dirty && !p.writing).then(|| p.data.clone())
    }

    /// The discard count, taken by a reader before it checks under `Inner`
    /// that its file is live; [`Self::fill`] compares it.
    pub fn discard_epoch(&self) -> u64 {
        self.discards.load(Ordering::Acquire)
    }

    /// Keep blocks just read from the device as clean pages of `ino` (whose
    /// on-disk size is `disk_size`, the visible one if the cache does not know
    /// the file yet). The caller holds the inode's lock shared, so no write
    /// races with this; a page that exists already (another reader's) stays.
    /// Nothing is kept if any file was discarded since `epoch`: a file freed
    /// by an unlink (which does not take the inode's lock) while it was read
    /// would otherwise come back with its old pages under a number a new file
    /// may get. Filled pages start without the second-chance bit: data read
    /// once goes before data read again.
    ///
    /// `create`: the reader found no entry for the file (then it had no dirty
    /// page, and with writes held off `disk_size` is its visible size). A
    /// reader that found one keeps nothing if it is gone now: meanwhile a
    /// commit's cut may have written its pages back and moved the on-disk
    /// size past `disk_size`, and eviction dropped the entry.
    pub fn fill(
        &self,
        ino: u32,
        disk_size: u64,
        blocks: Vec<(u32, Vec<u8>)>,
        epoch: u64,
        create: bool,
    ) {
        if blocks.is_empty() {
            return;
        }
        let bs = self.bs as u64;
        let mut files = self.shard(ino).files.lock();
        if self.discards.load(Ordering::Acquire) != epoch {
            return;
        }
        if !create && !files.contains_key(&ino) {
            return;
        }
        let f = files.entry(ino).or_insert_with(|| FileCache {
            size: disk_size,
            ..Default::default()
        });
        let mut added = 0usize;
        for (lblk, data) in blocks {
            if lblk as u64 * bs >= f.size || data.len() != self.bs {
                continue;
            }
            f.pages.entry(lblk).or_insert_with(|| {
                added += 1;
                Page {
                    data: Arc::new(data),
                    dirty: false,
                    writing: false,
                    delayed: false,
                    used: false,
                }
            });
        }
        if f.pages.is_empty() && f.times.is_none() {
            files.remove(&ino);
        }
        // Before the lock goes, as in `write`.
        self.pages.fetch_add(added, Ordering::AcqRel);
        drop(files);
        Counters::add(&self.stats.read_fills, added as u64);
        if self.over_cap() {
            self.evict();
        }
    }

    /// Take every dirty page of `ino` for write-back: their snapshots are
    /// returned with the visible size and pending times (which leave the
    /// cache: the caller puts them into the inode). Waits first while an
    /// earlier snapshot of one of them is still being written (`None` once
    /// `stop()`: the journal aborted, so that write may never end).
    pub fn take_dirty(&self, ino: u32, stop: &dyn Fn() -> bool) -> Option<Taken> {
        let sh = self.shard(ino);
        let mut files = sh.files.lock();
        loop {
            let f = files.get(&ino)?;
            if f.dirty == 0 && f.times.is_none() {
                return None;
            }
            if !f.pages.values().any(|p| p.dirty && p.writing) {
                break;
            }
            if stop() {
                return None;
            }
            sh.written
                .wait_for(&mut files, std::time::Duration::from_millis(50));
        }
        let f = files.get_mut(&ino)?;
        let mut snaps = Vec::with_capacity(f.dirty as usize);
        for (&lblk, p) in f.pages.iter_mut() {
            if p.dirty {
                p.dirty = false;
                p.writing = true;
                snaps.push(Snap {
                    lblk,
                    data: p.data.clone(),
                });
            }
        }
        if f.dirty > 0 {
            self.dirty_files.fetch_sub(1, Ordering::AcqRel);
        }
        f.dirty = 0;
        f.dirtied = None;
        Some(Taken {
            snaps,
            size: f.size,
            times: f.times.take(),
        })
    }

    /// Wait until no page of `ino` is being written (or `stop()`).
    pub fn wait_written(&self, ino: u32, stop: &dyn Fn() -> bool) {
        let sh = self.shard(ino);
        let mut files = sh.files.lock();
        while files
            .get(&ino)
            .is_some_and(|f| f.pages.values().any(|p| p.writing))
            && !stop()
        {
            sh.written
                .wait_for(&mut files, std::time::Duration::from_millis(50));
        }
    }

    /// Take the pending times of `ino` (the caller puts them into the inode).
    pub fn take_times(&self, ino: u32) -> Option<Timestamp> {
        self.shard(ino)
            .files
            .lock()
            .get_mut(&ino)
            .and_then(|f| f.times.take())
    }

    /// Pages `lblks` of `ino` are mapped now (no longer delayed).
    /// Returns how many of them were delayed (counted in `st_blocks` already).
    pub fn mapped(&self, ino: u32, lblks: impl Iterator<Item = u32>) -> u64 {
        let mut files = self.shard(ino).files.lock();
        let Some(f) = files.get_mut(&ino) else {
            return 0;
        };
        let mut n = 0;
        for l in lblks {
            if let Some(p) = f.pages.get_mut(&l) {
                if p.delayed {
                    p.delayed = false;
                    f.delayed -= 1;
                    n += 1;
                }
            }
        }
        drop(files);
        self.unreserve(n);
        n
    }

    /// `ino`'s `st_blocks` changed without a request (write-back allocated
    /// extent-tree blocks): the FUSE layer tells the kernel, whose cached
    /// attributes would stay stale until they expire ([`Self::take_attr_changed`]).
    pub fn note_attr_changed(&self, ino: u32) {
        if self.watch_attrs.load(Ordering::Relaxed) {
            self.attr_changed.lock().insert(ino);
        }
    }

    /// Note attribute changes from now on (a front end that drains them with
    /// [`Self::take_attr_changed`] asks; without one the set would only grow).
    pub fn watch_attr_changes(&self) {
        self.watch_attrs.store(true, Ordering::Relaxed);
    }

    /// The inodes noted by [`Self::note_attr_changed`] since the last call.
    pub fn take_attr_changed(&self) -> Vec<u32> {
        let mut s = self.attr_changed.lock();
        if s.is_empty() {
            return Vec::new();
        }
        std::mem::take(&mut *s).into_iter().collect()
    }

    /// A write-back of `snaps` finished: pages not dirtied since become clean;
    /// with `failed`, dirty again (the data is still only here).
    pub fn finish(&self, ino: u32, snaps: &[Snap], failed: bool) {
        let sh = self.shard(ino);
        let mut files = sh.files.lock();
        let mut cleaned = 0;
        // Dropped meanwhile (freed or truncated): `discard` did the accounting.
        if let Some(f) = files.get_mut(&ino) {
            for s in snaps {
                let Some(p) = f.pages.get_mut(&s.lblk) else {
                    continue;
                };
                if !p.writing {
                    continue;
                }
                p.writing = false;
                if p.dirty {
                    // Written again since the snapshot: still counted.
                } else if failed {
                    p.dirty = true;
                    if f.dirty == 0 {
                        self.dirty_files.fetch_add(1, Ordering::AcqRel);
                        f.dirtied.get_or_insert_with(std::time::Instant::now);
                    }
                    f.dirty += 1;
                } else {
                    cleaned += 1;
                }
            }
        }
        drop(files);
        sh.written.notify_all();
        self.dirty.fetch_sub(cleaned, Ordering::AcqRel);
        if !failed {
            Counters::add(&self.stats.blocks_written, snaps.len() as u64);
        }
    }

    /// Drop every page of `ino` (the file is freed, truncated or rewritten
    /// under `Inner`): dirty data included.
    pub fn discard(&self, ino: u32) {
        drop(self.discard_kept(ino));
    }

    /// [`Self::discard`] under `Inner` (a freed file): the pages are freed
    /// later, outside it, by [`Self::reap`] (freeing a large cached file's
    /// pages took the file-system lock for as long).
    pub fn discard_deferred(&self, ino: u32) {
        if let Some(f) = self.discard_kept(ino) {
            self.graveyard.lock().push(f);
            self.dead.store(true, Ordering::Release);
        }
    }

    /// Free what [`Self::discard_deferred`] dropped: called as `Inner` is let
    /// go (`InnerGuard`; the holder that freed the files pays, with no lock
    /// left) and after unmount. Not part of [`Self::evict`], which a commit's
    /// cut may run under the barrier.
    pub fn reap(&self) {
        // Every release of `Inner` asks: the common answer without a lock.
        if !self.dead.swap(false, Ordering::AcqRel) {
            return;
        }
        let dead = std::mem::take(&mut *self.graveyard.lock());
        drop(dead);
    }

    /// Drop `ino`'s entry, accounted as gone; its pages are returned.
    fn discard_kept(&self, ino: u32) -> Option<FileCache> {
        let f = {
            let mut files = self.shard(ino).files.lock();
            self.discards.fetch_add(1, Ordering::AcqRel);
            files.remove(&ino)
        };
        if self.per_file {
            // A freed file's marks must not outlive it (its number may be
            // reused); a truncate notes its own after this.
            self.da_alloc_close.lock().remove(&ino);
        }
        let f = f?;
        let dirty = f.pages.values().filter(|p| p.dirty || p.writing).count();
        if f.dirty > 0 {
            self.dirty_files.fetch_sub(1, Ordering::AcqRel);
        }
        self.unreserve(f.delayed as u64);
        self.pages.fetch_sub(f.pages.len(), Ordering::AcqRel);
        self.dirty.fetch_sub(dirty, Ordering::AcqRel);
        Counters::add(&self.stats.dropped_dirty, dirty as u64);
        Some(f)
    }

    /// Evict clean pages while over the cap (no LRU yet: any clean page
    /// goes). A file left with no page and no pending times is forgotten: with
    /// no page, no cached write is pending, so its visible size is the
    /// on-disk one.
    pub fn evict(&self) {
        let cap_pages = self.cap / self.bs;
        let target = cap_pages - cap_pages / 8;
        loop {
            if self.pages.load(Ordering::Acquire) <= cap_pages {
                return;
            }
            // One pass at a time (two would count the same pages to go): a
            // caller that finds one under way leaves the work to it, which
            // passes again while the cache is over its cap.
            let Some(one) = self.evicting.try_lock() else {
                return;
            };
            let evicted = self.evict_pass(target);
            drop(one);
            if evicted == 0 {
                // Nothing clean left to drop (all dirty or being written).
                return;
            }
        }
    }

    /// One pass of [`Self::evict`] down to `target` pages: clean pages not
    /// used since the last pass first (second chance, their bits cleared on
    /// the way), then any clean page; one shard locked at a time, the count
    /// read again at each (writers and readers add pages meanwhile).
    /// Returns the pages dropped.
    fn evict_pass(&self, target: usize) -> u64 {
        let mut evicted = 0u64;
        for second_chance in [true, false] {
            for sh in self.shards.iter() {
                let mut files = sh.files.lock();
                let mut n = self.pages.load(Ordering::Acquire);
                if n <= target {
                    break;
                }
                let mut gone = 0usize;
                let mut empty = Vec::new();
                for (&ino, f) in files.iter_mut() {
                    if n <= target {
                        break;
                    }
                    let before = f.pages.len();
                    f.pages.retain(|_, p| {
                        if n <= target || p.dirty || p.writing {
                            return true;
                        }
                        if second_chance && std::mem::take(&mut p.used) {
                            return true;
                        }
                        n -= 1;
                        false
                    });
                    gone += before - f.pages.len();
                    if before > 0 && f.pages.is_empty() && f.times.is_none() {
                        empty.push(ino);
                    }
                }
                for ino in empty {
                    files.remove(&ino);
                }
                self.pages.fetch_sub(gone, Ordering::AcqRel);
                drop(files);
                evicted += gone as u64;
            }
        }
        Counters::add(&self.stats.evicted, evicted);
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attribute changes are noted only once a front end watches them (the
    /// library alone would only grow the set), and a discard takes a freed
    /// file's close-time write-back mark with it.
    #[test]
    fn attr_changes_need_a_watcher_and_discard_clears_marks() {
        let pc = PageCache::new(4096, 1 << 20).with_order(crate::DataOrder::File);
        pc.note_attr_changed(5);
        assert!(pc.take_attr_changed().is_empty());
        pc.watch_attr_changes();
        pc.note_attr_changed(5);
        pc.note_attr_changed(5);
        assert_eq!(pc.take_attr_changed(), vec![5]);
        assert!(pc.take_attr_changed().is_empty());
        pc.note_truncated_to_zero(7);
        pc.discard(7);
        assert!(!pc.take_da_alloc_close(7));
        pc.note_truncated_to_zero(7);
        assert!(pc.take_da_alloc_close(7));
    }

    /// A fill that started before a discard keeps nothing (the file may have
    /// been freed and its number reused); one after it does, and a later
    /// read finds the pages, with bytes past the visible size not kept; a
    /// fill that may not create the file's entry keeps nothing without one.
    #[test]
    fn fill_after_a_discard_is_dropped() {
        let pc = PageCache::new(4096, 1 << 20);
        let epoch = pc.discard_epoch();
        pc.discard(7);
        pc.fill(
            7,
            8192,
            vec![(0, vec![1u8; 4096]), (1, vec![2u8; 4096])],
            epoch,
            true,
        );
        assert!(pc.read(7, 0, &mut [0u8; 10]).is_none(), "stale fill kept");
        assert_eq!(pc.snapshot().cached_bytes, 0);
        let epoch = pc.discard_epoch();
        pc.fill(
            7,
            8192,
            vec![
                (0, vec![1u8; 4096]),
                (1, vec![2u8; 4096]),
                (2, vec![3u8; 4096]),
            ],
            epoch,
            true,
        );
        // A reader that saw an entry makes none once it is gone.
        pc.fill(
            9,
            8192,
            vec![(0, vec![4u8; 4096])],
            pc.discard_epoch(),
            false,
        );
        assert!(
            pc.read(9, 0, &mut [0u8; 10]).is_none(),
            "entry made without create"
        );
        let mut buf = vec![0u8; 8192];
        let (n, hits) = pc.read(7, 0, &mut buf).expect("filled file");
        assert_eq!((n, hits), (8192, vec![true, true]));
        assert_eq!(&buf[4096..], &[2u8; 4096][..]);
        assert_eq!(pc.snapshot().cached_bytes, 8192, "block past the size kept");
        assert_eq!(pc.snapshot().read_fills, 2);
    }

    /// The sharded map behaves as one cache: dirty files are found in every
    /// shard, a write-back that waits for an earlier snapshot of its file
    /// wakes when that one finishes (its shard's condition), eviction brings
    /// the cache under its cap across shards (clean pages only) and forgets
    /// files left empty, and the counters add up.
    #[test]
    fn shards_act_as_one_cache() {
        let bs = 4096;
        let pc = Arc::new(PageCache::new(bs, 64 * bs));
        // 200 files, each one dirty page: inode numbers cover every shard
        // several times over.
        let inos: Vec<u32> = (1..=200).collect();
        for &ino in &inos {
            pc.write(ino, 0, &[ino as u8; 100], Vec::new(), (0, &[]), 1)
                .unwrap();
        }
        let mut dirty = pc.dirty_inos();
        dirty.sort_unstable();
        assert_eq!(dirty, inos);
        assert_eq!(pc.dirty_files(), 200);
        assert_eq!(pc.snapshot().bytes_written, 200 * 100);
        // Snapshots of file 70 being written; it is dirtied again, and the
        // next write-back must wait for the first to finish.
        let t = pc.take_dirty(70, &|| false).unwrap();
        pc.write(70, 0, &[1u8; 10], Vec::new(), (4096, &[]), 0)
            .unwrap();
        let waiter = {
            let pc = pc.clone();
            std::thread::spawn(move || pc.take_dirty(70, &|| false).map(|t| t.snaps.len()))
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!waiter.is_finished(), "took pages still being written");
        pc.finish(70, &t.snaps, false);
        assert_eq!(waiter.join().unwrap(), Some(1));
        pc.finish(70, &t.snaps, false);
        // Write every other file back: clean pages, then over the cap.
        for &ino in &inos {
            if let Some(t) = pc.take_dirty(ino, &|| false) {
                pc.finish(ino, &t.snaps, false);
            }
        }
        assert_eq!(pc.dirty_files(), 0);
        assert!(pc.over_cap());
        pc.evict();
        let st = pc.snapshot();
        assert!(
            st.cached_bytes <= 64 * bs as u64,
            "still {} bytes cached",
            st.cached_bytes
        );
        assert_eq!(st.evicted * bs as u64 + st.cached_bytes, 200 * bs as u64);
        // The files left without a page are forgotten.
        let known = inos
            .iter()
            .filter(|&&i| pc.read(i, 0, &mut [0u8; 1]).is_some())
            .count();
        assert_eq!(known as u64 * bs as u64, st.cached_bytes);
    }

    /// A discard under `Inner` takes the file out of the cache and its
    /// counts at once, and frees its pages only at the next `reap`.
    #[test]
    fn deferred_discard_accounts_at_once_and_frees_at_reap() {
        let pc = PageCache::new(4096, 1 << 20);
        pc.write(3, 0, &[7u8; 8192], Vec::new(), (0, &[]), 2)
            .unwrap();
        let t = pc.take_dirty(3, &|| false).unwrap();
        pc.finish(3, &t.snaps, false);
        drop(t);
        let page = pc.clean_block(3, 0).expect("clean page");
        assert_eq!(Arc::strong_count(&page), 2);
        pc.discard_deferred(3);
        assert!(pc.read(3, 0, &mut [0u8; 10]).is_none(), "file still cached");
        let st = pc.snapshot();
        assert_eq!((st.cached_bytes, st.dirty_bytes), (0, 0));
        assert_eq!(Arc::strong_count(&page), 2, "freed before the reap");
        pc.reap();
        assert_eq!(Arc::strong_count(&page), 1, "not freed by the reap");
    }
}
