//! Cached writes, reads and write-back (issue #11; docs/ARCHITECTURE.md
//! "Design: the page cache and the commit cut").
//!
//! * [`Fs::write_cached`]: `write()` into pages; no device I/O, no journal.
//! * [`Fs::read_cached`]: pages first, the device for the rest.
//! * [`Fs::writeback_file`]: one file's dirty pages mapped (delayed allocation)
//!   under `Inner` in a handle, written outside it — the old write path with
//!   data from pages, so ordered mode and fast-commit planning keep their rules.
//! * [`Inner::cut_all`] and [`CacheHooks`]: the cut every commit starts with.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use commitfs_journal::{CommitHooks, Handle, JournalError};
use parking_lot::Mutex;

use crate::dataio::{DataIo, InflightGuard};
use crate::error::{FsError, Result};
use crate::file::max_file_size;
use crate::inner::{now, Inner};
use crate::pagecache::{CutWhat, PageCache, Snap, Taken};
use crate::types::CallerOf;
use crate::Fs;

/// One contiguous device run of a write-back.
pub(crate) struct WbRun {
    pub ino: u32,
    pub pblk: u64,
    pub snaps: Vec<Snap>,
}

/// Blocks granted at once while free space is plentiful (so that most writes
/// reserve without `Inner`).
const GRANT_CHUNK: u64 = 1024;

impl Inner {
    /// Map the pages `t` took from `ino` (holes allocated in contiguous runs,
    /// unwritten extents converted: `write_map`), and put the visible size and
    /// pending times into the inode, in `h`. Returns the device runs and the
    /// pages left unmapped (ENOSPC), which the caller gives back as dirty.
    pub fn wb_map(&mut self, h: &Handle, ino: u32, t: &Taken) -> Result<(Vec<WbRun>, Vec<Snap>)> {
        let mut i = self.read_inode(ino)?;
        let bs = self.bs as u64;
        let old_size = i.size;
        let old_blocks = i.blocks_512(self.bs);
        let mut runs = Vec::new();
        let mut changed = false;
        // Pages left dirty (ENOSPC), in the order found.
        let mut unmapped: Vec<Snap> = Vec::new();
        self.fc_track_inode(ino, h.tid(), None);
        let mut k = 0;
        while k < t.snaps.len() {
            let mut full = k + 1;
            while full < t.snaps.len() && t.snaps[full].lblk == t.snaps[full - 1].lblk + 1 {
                full += 1;
            }
            let mut e = full;
            if !unmapped.is_empty() {
                // After an ENOSPC only pages that start inside the file's size
                // go on (in-place overwrites need no space): left dirty, such a
                // page's block could be in a commit's data checksums
                // (`fc_data_csum`) and be rewritten in place later, after that
                // commit, without the overwrite check; and the size must not
                // pass the first page left behind.
                let inside = t.snaps[k..full]
                    .iter()
                    .take_while(|s| (s.lblk as u64) * bs < old_size)
                    .count();
                unmapped.extend_from_slice(&t.snaps[k + inside..full]);
                e = k + inside;
                if e == k {
                    k = full;
                    continue;
                }
            }
            let done = self
                .wb_map_run(h, ino, &mut i, t, k..e, &mut runs, &mut changed)?
                .unwrap_or(0);
            if k + done < e {
                // ENOSPC (the reservation's margin for extent blocks ran
                // out). Of the rest, the pages over blocks already mapped
                // (not unwritten) are overwrites in place, which need no
                // space: those alone; the others stay dirty.
                let (a0, l0) = (k + done, t.snaps[k + done].lblk as u64);
                let segs = self.ext_segments(ino, &i, l0, l0 + (e - a0) as u64)?;
                let mut next = a0;
                for (sl, n, m) in segs {
                    let a = (a0 + sl.saturating_sub(l0) as usize).clamp(next, e);
                    let b = (a + n as usize).min(e);
                    unmapped.extend_from_slice(&t.snaps[next..a]);
                    let mapped = match m.is_some_and(|m| !m.unwritten) && a < b {
                        true => self
                            .wb_map_run(h, ino, &mut i, t, a..b, &mut runs, &mut changed)?
                            .unwrap_or(0),
                        false => 0,
                    };
                    unmapped.extend_from_slice(&t.snaps[a + mapped..b]);
                    next = b;
                }
                unmapped.extend_from_slice(&t.snaps[next..e]);
            }
            k = full;
        }
        // Visible up to the first page left dirty, if any; but at least to
        // the end of a page written that starts inside the old size (the
        // file's last, partial block overwritten in place after an ENOSPC):
        // clean, its bytes past the size would read as zeros once evicted.
        // No page left dirty starts between the old size and that end.
        let end = unmapped.iter().map(|s| s.lblk as u64 * bs).min();
        let inside_end = runs
            .iter()
            .flat_map(|r| r.snaps.iter())
            .map(|s| s.lblk as u64 * bs)
            .filter(|&o| o < old_size)
            .max()
            .map_or(0, |o| o + bs);
        i.size = i
            .size
            .max(end.map_or(t.size, |e| t.size.min(e.max(inside_end))));
        if let Some(tm) = t.times {
            i.mtime = tm;
            i.ctime = i.ctime.max(tm);
        }
        // An in-place overwrite changes only timestamps: fdatasync need not
        // commit them (C.5).
        if changed || i.size != old_size {
            self.write_inode(h, ino, &i)?;
        } else {
            self.write_inode_times(h, ino, &i)?;
        }
        if let Some(pc) = &self.pc {
            let delayed = pc.mapped(
                ino,
                runs.iter().flat_map(|r| r.snaps.iter().map(|s| s.lblk)),
            );
            // Delayed pages were in st_blocks already; anything more (extent
            // blocks) is news to the kernel's attribute cache.
            let grown = i.blocks_512(self.bs).saturating_sub(old_blocks);
            if grown > delayed * (bs / 512) {
                pc.note_attr_changed(ino);
            }
        }
        Ok((runs, unmapped))
    }

    /// Map the pages `t.snaps[r]` (consecutive blocks) for [`Self::wb_map`]:
    /// the device runs go to `runs`. `Some(n)`: the first `n` pages are
    /// mapped (fewer than all: ENOSPC part-way); `None`: ENOSPC before any.
    #[allow(clippy::too_many_arguments)]
    fn wb_map_run(
        &mut self,
        h: &Handle,
        ino: u32,
        i: &mut commitfs_format::inode::Inode,
        t: &Taken,
        r: std::ops::Range<usize>,
        runs: &mut Vec<WbRun>,
        changed: &mut bool,
    ) -> Result<Option<usize>> {
        let bs = self.bs as u64;
        let k = r.start;
        let l0 = t.snaps[k].lblk;
        let mut chunks = Vec::new();
        self.claiming = true;
        let res = self.write_map(
            h,
            ino,
            i,
            l0 as u64 * bs,
            r.len() * bs as usize,
            &mut chunks,
        );
        self.claiming = false;
        if let Err(FsError::NoSpace) = res {
            return Ok(None);
        }
        if let Err(err) = res {
            // Blocks mapped for this run must not stay mapped without data.
            for c in chunks.iter().filter(|c| c.changed > 0) {
                let end = c.lblk as u64 + c.changed as u64;
                let _ = self.remove_blocks(h, ino, i, c.lblk, end);
            }
            let _ = self.write_inode(h, ino, i);
            return Err(err);
        }
        let mut done = 0;
        for c in &chunks {
            *changed |= c.changed > 0;
            let first = k + c.pos / bs as usize;
            let n = c.span / bs as usize;
            runs.push(WbRun {
                ino,
                pblk: c.pblk,
                snaps: t.snaps[first..first + n].to_vec(),
            });
            done += n;
        }
        Ok(Some(done))
    }

    /// Put the pending times of cached writes into the cached inode (written
    /// with it by the caller's next `write_inode`).
    pub fn fold_cached_times(&mut self, ino: u32) -> Result<()> {
        let Some(t) = self.pc.as_ref().and_then(|pc| pc.take_times(ino)) else {
            return Ok(());
        };
        let mut i = self.read_inode(ino)?;
        i.mtime = t;
        i.ctime = i.ctime.max(t);
        self.itable.insert(ino, i);
        Ok(())
    }

    /// The cut (see the module doc): map every dirty page of every file in `h`
    /// and return the runs to write. The caller holds the cache's barrier
    /// exclusively, so no cached write is half done. With `note`, the runs are
    /// reported to single-flush tracking now (their commit writes them after
    /// its tid switch).
    pub fn cut_all(&mut self, h: &Handle) -> Result<(Vec<WbRun>, bool)> {
        self.cut_dirtied_before(h, None)
    }

    /// [`Self::cut_all`] of the files dirty since before `t` only (when
    /// given; the cut then covers less than every write).
    pub fn cut_dirtied_before(
        &mut self,
        h: &Handle,
        t: Option<std::time::Instant>,
    ) -> Result<(Vec<WbRun>, bool)> {
        let Some(pc) = self.pc.clone() else {
            return Ok((Vec::new(), true));
        };
        let inos = pc.dirty_inos_before(t);
        self.cut_inos(h, inos, t.is_none())
    }

    /// The cut of the files `inos` only; `complete` when they are every dirty
    /// file (the cut then covers every write so far).
    pub fn cut_inos(
        &mut self,
        h: &Handle,
        inos: Vec<u32>,
        mut complete: bool,
    ) -> Result<(Vec<WbRun>, bool)> {
        let Some(pc) = self.pc.clone() else {
            return Ok((Vec::new(), true));
        };
        let mut all: Vec<WbRun> = Vec::new();
        for ino in inos {
            let Some(t) = pc.take_dirty(ino, &|| self.journal.is_aborted()) else {
                continue;
            };
            match self.wb_map(h, ino, &t) {
                Ok((runs, unmapped)) => {
                    if !unmapped.is_empty() {
                        // ENOSPC: these stay dirty, so this cut covers less
                        // than every write so far.
                        complete = false;
                        pc.finish(ino, &unmapped, true);
                    }
                    all.extend(runs);
                }
                Err(e) => {
                    // Blocks mapped so far in this transaction have no data:
                    // the caller aborts the journal; the pages stay cached.
                    pc.finish(ino, &t.snaps, true);
                    pc.restore_times(ino, t.times);
                    for r in &all {
                        pc.finish(r.ino, &r.snaps, true);
                    }
                    return Err(e);
                }
            }
        }
        if !all.is_empty() {
            crate::pagecache::Counters::add(&pc.stats.cuts, 1);
        }
        Ok((all, complete))
    }
}

/// Per inode, the flush generation when its data was last written (an fsync
/// of it needs a flush that starts later; `Fs::data_gens`).
pub(crate) type DataGens = Mutex<std::collections::HashMap<u32, u64>>;

/// Reads missing at least this many bytes from the cache stream past it: they
/// are not kept (`Fs::read_cached`).
const FILL_MAX: usize = 256 << 10;

/// Write the runs (one device write per run, or per MiB of one; runs that
/// meet on the device joined, up to a MiB) and mark
/// their pages clean; on a failure the pages of the batch that failed and of
/// every later one go back to dirty and the error is returned. `note`: report
/// to single-flush tracking here (under the caller's handle).
pub(crate) fn write_runs(
    dio: &DataIo,
    pc: &PageCache,
    runs: &[WbRun],
    note: bool,
    gens: &DataGens,
) -> Result<()> {
    let bs = dio.bs;
    // Device writes of at most 1 MiB each (one per contiguous run or piece of
    // one, or per group of runs that meet), submitted in batches of at most BATCH_BYTES (the device keeps the
    // large ones in flight together); the pages themselves are the buffers.
    let per = ((1 << 20) / bs).max(1);
    let mut k = 0usize;
    while k < runs.len() {
        let (mut end, mut bytes) = (k, 0usize);
        while end < runs.len() && (end == k || bytes + runs[end].snaps.len() * bs <= BATCH_BYTES) {
            bytes += runs[end].snaps.len() * bs;
            end += 1;
        }
        let mut writes: Vec<(u64, Vec<&[u8]>)> = Vec::new();
        // In device order, and runs that meet on the device (small files of
        // one commit, from the small-file stream: `Inner::alloc_goal`) as
        // one write, up to `per` blocks: data writes of one batch are
        // unordered among themselves (the flush or commit after them orders).
        let mut order: Vec<&WbRun> = runs[k..end].iter().collect();
        order.sort_by_key(|r| r.pblk);
        for r in order {
            for (i, piece) in r.snaps.chunks(per).enumerate() {
                let pblk = r.pblk + (i * per) as u64;
                if let Some((at, last)) = writes.last_mut() {
                    if *at + last.len() as u64 == pblk && last.len() + piece.len() <= per {
                        last.extend(piece.iter().map(|s| &s.data[..bs]));
                        continue;
                    }
                }
                writes.push((pblk, piece.iter().map(|s| &s.data[..bs]).collect()));
            }
        }
        if let Err(e) = dio.write_batch(&writes, note) {
            for r in &runs[k..] {
                pc.finish(r.ino, &r.snaps, true);
            }
            return Err(e);
        }
        crate::pagecache::Counters::add(&pc.stats.device_writes, writes.len() as u64);
        for r in &runs[k..end] {
            // Before the pages turn clean: an fdatasync that finds them clean
            // then finds this generation too.
            gens.lock().insert(r.ino, dio.journal.flush_gen());
            pc.finish(r.ino, &r.snaps, false);
        }
        k = end;
    }
    Ok(())
}

/// Bytes of write-back runs submitted to the device in one batch.
const BATCH_BYTES: usize = 32 << 20;

/// The cut's runs for a full commit, waiting for the commit thread's
/// `write_data` (and the in-flight mark that keeps fast commits from
/// planning over blocks without their data), and every cut's device ranges
/// by transaction, for its single-flush checksums (`data_ranges`).
#[derive(Default)]
pub(crate) struct Ordered {
    runs: BTreeMap<u32, Vec<(Vec<WbRun>, InflightGuard)>>,
    ranges: BTreeMap<u32, Vec<(u64, u64)>>,
}

/// The page cache's part in full commits ([`CommitHooks`]).
pub(crate) struct CacheHooks {
    pub inner: Weak<parking_lot::Mutex<Inner>>,
    pub pc: Arc<PageCache>,
    pub dio: DataIo,
    pub ordered: Mutex<Ordered>,
    pub data_errors: Arc<crate::dataio::DataErrors>,
    pub data_gens: Arc<DataGens>,
}

fn to_journal(e: FsError) -> JournalError {
    match e {
        FsError::Journal(j) => j,
        FsError::Device(d) => JournalError::Device(d),
        other => JournalError::BadJournal(format!("file data write-back: {other}")),
    }
}

impl CacheHooks {
    /// Write a cut's runs; after a failure the rest are given back as dirty
    /// (the journal aborts: their transaction never commits).
    fn write(&self, batch: Vec<(Vec<WbRun>, InflightGuard)>) -> commitfs_journal::Result<()> {
        let mut res = Ok(());
        for (runs, guard) in batch {
            if res.is_ok() && self.dio.journal.is_aborted() {
                res = Err(JournalError::Aborted);
            }
            if res.is_err() {
                for r in &runs {
                    self.pc.finish(r.ino, &r.snaps, true);
                }
                continue;
            }
            let r = write_runs(&self.dio, &self.pc, &runs, false, &self.data_gens);
            drop(guard);
            if let Err(e) = r {
                for r in &runs {
                    self.data_errors.insert(r.ino);
                }
                res = Err(to_journal(e));
            }
        }
        if self.pc.over_cap() {
            self.pc.evict();
        }
        res
    }
}

impl CommitHooks for CacheHooks {
    fn cut(&self, tid: u32, lock: &mut dyn FnMut() -> bool) -> commitfs_journal::Result<()> {
        let what = self.pc.take_cut();
        // data_order=file, nobody asked: a file's data goes out with its own
        // write-back (which moves its on-disk size and mapping in the same
        // handle), never with other files' commits; except files truncated to
        // zero and being rewritten (auto_da_alloc), whose truncate this
        // commit may carry.
        let marked = if what == CutWhat::Nothing {
            self.pc.da_alloc_dirty()
        } else {
            Vec::new()
        };
        if what == CutWhat::Nothing && marked.is_empty() {
            lock();
            return Ok(());
        }
        let before = match what {
            CutWhat::DirtiedBefore(t) => Some(t),
            _ => None,
        };
        // Bounded: a writer holding it shared may wait for `Inner`, which an
        // unmount holds while it waits for this commit (see below).
        let Some(_bw) = self.pc.barrier.try_write_for(Duration::from_secs(2)) else {
            tracing::warn!("commit cut: cache barrier busy, cached data joins the next commit");
            self.pc.ask_again(what);
            lock();
            return Ok(());
        };
        if !self.pc.has_dirty() {
            // Every cached write so far is in this transaction or an earlier
            // one (a write-back under way started its handle before it took
            // its pages, so in one of them).
            if what != CutWhat::Nothing {
                self.pc.note_cut(tid);
            }
            lock();
            return Ok(());
        }
        let Some(inner) = self.inner.upgrade() else {
            lock();
            return Ok(());
        };
        // Nothing that holds `Inner` waits for a commit while pages are dirty
        // (unmount writes them first); the bound only guards against a
        // library user writing during unmount.
        // The tree blocks and bitmaps the mapping reads, read first without
        // `Inner` (warm.rs); the barrier keeps the dirty set still.
        let inos = match what {
            CutWhat::Nothing => marked.clone(),
            _ => self.pc.dirty_inos_before(before),
        };
        let Some(mut g) = crate::warm::lock_warm_with(
            || inner.try_lock_for(Duration::from_secs(2)),
            |g| g.warm_cut(&inos),
        ) else {
            tracing::warn!("commit cut: file-system lock busy, cached data joins the next commit");
            self.pc.ask_again(what);
            lock();
            return Ok(());
        };
        let h = g.start(64).map_err(to_journal)?;
        let cut = if what == CutWhat::Nothing {
            g.cut_inos(&h, marked, false)
        } else {
            g.cut_dirtied_before(&h, before)
        };
        drop(h);
        let guard = g.inflight.begin(crate::dataio::CUT_WRITES);
        drop(g);
        let (runs, complete) = cut.map_err(to_journal)?;
        if complete {
            self.pc.note_cut(tid);
        }
        if runs.is_empty() {
            drop(guard);
            lock();
            return Ok(());
        }
        let ranges: Vec<(u64, u64)> = runs
            .iter()
            .map(|r| (r.pblk, r.snaps.len() as u64))
            .collect();
        self.ordered
            .lock()
            .ranges
            .entry(tid)
            .or_default()
            .extend(ranges);
        if lock() {
            self.ordered
                .lock()
                .runs
                .entry(tid)
                .or_default()
                .push((runs, guard));
            Ok(())
        } else {
            // Not committing now: the data goes out at once (its transaction
            // still pins nothing; a fast commit may plan over it next).
            self.write(vec![(runs, guard)])
        }
    }

    fn write_data(&self, tid: u32) -> commitfs_journal::Result<()> {
        let batch = self.ordered.lock().runs.remove(&tid).unwrap_or_default();
        self.write(batch)
    }

    fn data_ranges(&self, tid: u32) -> Vec<(u64, u64)> {
        let mut o = self.ordered.lock();
        let r = o.ranges.remove(&tid).unwrap_or_default();
        // Older transactions' leftovers (none normally) go too.
        o.ranges.retain(|&t, _| !commitfs_journal::tid_le(t, tid));
        r
    }
}

/// A fast-commit leader's cut: the runs to write while `h` pins their
/// transaction, and the write sequence it covers (`None`: not every write,
/// pages were left dirty by ENOSPC).
pub(crate) struct FcCut {
    pub runs: Vec<WbRun>,
    pub h: Handle,
    pub seq: Option<u64>,
}

impl FcCut {
    /// The runs' data by device block (`fc_data_csum`: the fsync checksums
    /// these blocks from the snapshots, which are what gets written, after the
    /// plan and outside `Inner`; `fc::fill_data_csums`).
    pub fn overlay(&self) -> crate::fc::DataOverlay {
        self.runs
            .iter()
            .flat_map(|r| {
                r.snaps
                    .iter()
                    .enumerate()
                    .map(move |(k, s)| (r.pblk + k as u64, s.data.clone()))
            })
            .collect()
    }
}

/// The facts a cached write needs about its inode.
struct WriteFacts {
    disk_size: u64,
}

impl Fs {
    /// Reserve up to `want` blocks for delayed pages (ENOSPC is decided here,
    /// at `write()` time, never at write-back: ext4's delalloc reservation).
    /// Free space counts blocks that are free and not waiting for their
    /// freeing commit, less what is reserved or granted and a margin for the
    /// extent blocks write-back may need. Returns the blocks reserved (fewer
    /// than `want` near a full file system; 0 is ENOSPC for the caller).
    fn reserve_delayed(&self, pc: &PageCache, want: u64) -> Result<u64> {
        if pc.take_grant(want) {
            return Ok(want);
        }
        let mut committed = false;
        loop {
            let g = self.lock()?;
            let (free, _) = g.free_counts();
            let blocks = g.sb.blocks_count();
            let margin = (blocks / 1024).clamp(8, 1024);
            let mut grant = pc.grant.lock();
            let used = pc.reserved() + *grant + margin;
            let avail = free.saturating_sub(used);
            if avail >= want + 4 * GRANT_CHUNK {
                *grant += GRANT_CHUNK;
                drop(grant);
                pc.reserve(want);
                return Ok(want);
            }
            // Near full: exact, without slack, and without the blocks that
            // only a commit makes reusable.
            let pending = g.pending_free.blocks();
            let exact = avail.saturating_sub(pending);
            if exact >= want || (exact > 0 && (committed || pending == 0)) {
                let n = exact.min(want);
                drop(grant);
                pc.reserve(n);
                return Ok(n);
            }
            if committed || pending == 0 {
                return Ok(0);
            }
            drop(grant);
            let j = g.journal.clone();
            drop(g);
            let r = j.commit().map(|_| ()).map_err(FsError::from);
            self.check(&j, "commit", r)?;
            committed = true;
        }
    }

    /// Check a write against the inode and drop privileges as the kernel's
    /// `file_remove_privs` (under `Inner` only when there is something to do or
    /// the inode is not cached); returns the on-disk size.
    fn write_facts(&self, ino: u32, caller: CallerOf<'_>) -> Result<WriteFacts> {
        let cached = self.itable.with(ino, |i| {
            (
                i.mode,
                i.links_count,
                i.is_reg(),
                i.is_dir(),
                i.size,
                i.mode & 0o6000 != 0,
            )
        });
        if let Some((mode, links, reg, dir, size, privs)) = cached {
            let live = mode != 0 && (links > 0 || self.itable.is_open(ino));
            if live && reg && !(privs && caller.is_some()) {
                return Ok(WriteFacts { disk_size: size });
            }
            if live && dir {
                return Err(FsError::IsDir);
            }
        }
        let mut g = self.lock_change(|g| crate::error::unless_miss(g.warm_inode(ino)).map(drop))?;
        let mut i = g.live_inode(ino)?;
        if i.is_dir() {
            return Err(FsError::IsDir);
        }
        if !i.is_reg() {
            return Err(FsError::Invalid("write to a non-regular file"));
        }
        if Inner::drop_privs(&mut i, caller) {
            i.ctime = now();
            let h = g.start(8)?;
            g.fc_track_inode(ino, h.tid(), None);
            let r = g.write_inode(&h, ino, &i);
            g.stop(h)?;
            r?;
        }
        Ok(WriteFacts { disk_size: i.size })
    }

    /// `write()` into the page cache (see the module doc).
    pub(crate) fn write_cached(
        &self,
        pc: &Arc<PageCache>,
        ino: u32,
        offset: u64,
        data: &[u8],
        caller: CallerOf<'_>,
    ) -> Result<usize> {
        let bs = self.block_size as u64;
        offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= max_file_size(bs as usize))
            .ok_or(FsError::FileTooBig)?;
        if self.read_only || self.errors.is_read_only() || self.journal.is_aborted() {
            return Err(FsError::ReadOnly);
        }
        let il = self.ilocks.write(ino);
        // A cut (which takes no inode lock) may move the on-disk size, and
        // eviction may drop a page, between the plan below and the copy: then
        // nothing is written and the write is planned again.
        let n = loop {
            if let Some(n) = self.write_cached_once(pc, ino, offset, data, caller)? {
                break n;
            }
        };
        // Throttle: past the dirty limit a writer writes its own file back.
        if pc.dirty_bytes() > pc.dirty_limit() {
            // The write is in the cache either way: a failure here is the next
            // fsync's to report (ENOSPC: the pages stay dirty; EIO: aborted).
            if let Err(e) = self.writeback_locked(pc, ino) {
                tracing::debug!("write-back under the dirty limit: {e}");
            }
            if pc.dirty_bytes() > pc.dirty_limit() && !pc.per_file() {
                // data_order=prefix: the commit's cut writes the rest.
                self.journal.start_commit();
            }
        }
        // A cut maps every dirty file in one transaction: commit before that
        // could outgrow the log. A small file costs its share of an
        // inode-table block (16 inodes of 256 bytes in 4 KiB) plus shared
        // bitmap and descriptor blocks: 4 files per allowed block keeps a cut
        // within about a quarter of the limit.
        if pc.dirty_files() as u64 > self.journal.max_transaction_blocks() * 4 {
            pc.ask_cut();
            self.journal.start_commit();
        }
        if pc.over_cap() {
            pc.evict();
        }
        drop(il);
        if pc.per_file() && pc.dirty_bytes() > pc.dirty_limit() {
            self.writeback_others(pc);
        }
        Ok(n)
    }

    /// `data_order=file`, past the dirty limit after the writer's own file:
    /// write other files back (the kernel's `balance_dirty_pages` starting
    /// the flusher) until under the limit, without a commit (their handles
    /// join the running transaction, as ext4's write-back does). The caller
    /// holds no inode lock (each write-back takes its file's).
    fn writeback_others(&self, pc: &Arc<PageCache>) {
        for ino in pc.dirty_inos() {
            if pc.dirty_bytes() <= pc.dirty_limit() / 2 {
                break;
            }
            // An error is the next fsync's of that file to report.
            if let Err(e) = self.writeback_file(ino) {
                tracing::debug!("write-back of inode {ino} under the dirty limit: {e}");
            }
        }
    }

    /// One attempt of [`Self::write_cached`] (the caller holds the inode's
    /// lock): `None` when it must be planned again.
    pub(crate) fn write_cached_once(
        &self,
        pc: &Arc<PageCache>,
        ino: u32,
        offset: u64,
        data: &[u8],
        caller: CallerOf<'_>,
    ) -> Result<Option<usize>> {
        let bs = self.block_size as u64;
        let facts = self.write_facts(ino, caller)?;
        if data.is_empty() {
            return Ok(Some(0));
        }
        // Space for the blocks the write adds (delayed: allocated later): past
        // the on-disk size, and holes below it (found in the extent tree).
        let mut data = data;
        let holes = match pc.uncached_inside(ino, offset, data.len(), facts.disk_size) {
            Some((lo, hi)) => {
                // A read: the extent-tree blocks it misses are read outside
                // the lock and the lookup runs again (C.2).
                let (g, segs) = self.lock_warm(|g| {
                    let i = g.live_inode(ino)?;
                    g.ext_segments(ino, &i, lo as u64, hi as u64)
                })?;
                drop(g);
                let holes: Vec<u32> = segs
                    .into_iter()
                    .filter(|(_, _, m)| m.is_none())
                    .flat_map(|(l, n, _)| (l..l + n).map(|b| b as u32))
                    .collect();
                pc.uncached(ino, holes)
            }
            None => Vec::new(),
        };
        let want = pc.new_delayed(ino, offset, data.len(), facts.disk_size) + holes.len() as u64;
        let mut reserved = 0;
        if want > 0 {
            reserved = self.reserve_delayed(pc, want)?;
            if reserved == 0 {
                return Err(FsError::NoSpace);
            }
            if reserved < want {
                // A short write: up to the last block that has space (holes
                // first, then the blocks from the on-disk end on).
                if (reserved as usize) < holes.len() {
                    let stop = holes[reserved as usize] as u64 * bs;
                    let keep = stop.saturating_sub(offset) as usize;
                    if keep == 0 {
                        pc.unreserve(reserved);
                        return Err(FsError::NoSpace);
                    }
                    data = &data[..keep.min(data.len())];
                }
                let first = (offset / bs).max(facts.disk_size.div_ceil(bs));
                let past = reserved.saturating_sub(holes.len() as u64);
                let stop = (first + past) * bs;
                let keep = stop.saturating_sub(offset).min(data.len() as u64) as usize;
                if keep == 0 {
                    pc.unreserve(reserved);
                    return Err(FsError::NoSpace);
                }
                data = &data[..keep];
            }
        }
        match self.write_reserved(pc, ino, offset, data, (&facts, &holes), reserved) {
            Ok(true) => Ok(Some(data.len())),
            Ok(false) => {
                pc.unreserve(reserved);
                Ok(None)
            }
            Err(e) => {
                pc.unreserve(reserved);
                Err(e)
            }
        }
    }

    /// [`Self::write_cached`] once space is reserved: read partial blocks,
    /// check the `fc_data_csum` guards, copy into the cache. `false`: the
    /// on-disk size or a page it counted on changed meanwhile (nothing done).
    fn write_reserved(
        &self,
        pc: &Arc<PageCache>,
        ino: u32,
        offset: u64,
        data: &[u8],
        (facts, holes): (&WriteFacts, &[u32]),
        reserved: u64,
    ) -> Result<bool> {
        let bs = self.block_size as u64;
        let end = offset + data.len() as u64;
        // Partial blocks with content on the device: read them first, outside
        // `Inner` (mapped under it).
        let plan = pc.plan_write(ino, offset, data.len(), facts.disk_size);
        let mut filled = Vec::with_capacity(plan.fill.len());
        if !plan.fill.is_empty() {
            // A read of the mapping: tree blocks it misses are read outside
            // the lock and the plan runs again (C.2).
            let (g, segs) = self.lock_warm(|g| {
                let i = g.live_inode(ino)?;
                let mut v = Vec::new();
                for &l in &plan.fill {
                    v.push((l, g.read_plan(ino, &i, l as u64 * bs, bs as usize)?));
                }
                Ok(v)
            })?;
            drop(g);
            for (l, s) in segs {
                let mut b = vec![0u8; bs as usize];
                self.dio.read_segs(&s, &mut b)?;
                filled.push((l, b));
            }
        }
        let (lo, hi) = (offset / bs, end.div_ceil(bs));
        let mut filled = Some(filled);
        loop {
            let br = pc.barrier.read();
            if self.fc_data_csum {
                // The fc_data_csum guards (Self::lock_guarded), checked under the
                // barrier: no cut can take the page between the check and the
                // copy, so the write-back that overwrites these blocks belongs to
                // a commit at least as late as the one checked against.
                let mut g = self.lock()?;
                if let Some(tid) = g.fc_protect_hit(ino, lo, hi) {
                    drop(g);
                    drop(br);
                    self.fc_confirm(tid)?;
                    continue;
                }
                if g.journal.tracks_data() {
                    let h = g.start(0)?;
                    let runs = g.mapped_runs(ino, lo, hi)?;
                    if let Some(tid) = g.journal.data_conflict(&h, &runs) {
                        drop(h);
                        drop(g);
                        drop(br);
                        self.data_confirm(tid)?;
                        continue;
                    }
                }
            }
            if self.itable.with(ino, |i| i.size) != Some(facts.disk_size) {
                return Ok(false);
            }
            let filled = filled.take().unwrap_or_default();
            let r = pc.write(
                ino,
                offset,
                data,
                filled,
                (facts.disk_size, holes),
                reserved,
            );
            drop(br);
            return Ok(r.is_ok());
        }
    }

    /// The end of a read the cache answered whole: counted, and its atime
    /// noted (without `Inner` when the inode is cached); true when that
    /// asks for a commit.
    pub(crate) fn cached_read_done(&self, ino: u32) -> Result<bool> {
        if self.dio.errors.is_dead() {
            return Err(FsError::Shutdown);
        }
        if let Some(pc) = &self.pc {
            crate::pagecache::Counters::add(&pc.stats.read_hits, 1);
        }
        Ok(
            match crate::atime::touch_atime_deferred(&self.opts, &self.itable, ino) {
                None => self.lock_change(|g| g.warm_atime(ino))?.touch_atime(ino),
                Some(true) => self
                    .lock_change(|g| g.warm_lazy_expired())?
                    .flush_lazy_expired_now(),
                Some(false) => false,
            },
        )
    }

    /// Read through the cache (the caller holds the inode's lock shared, so
    /// no write of this file is half done). A read the cache answers whole
    /// takes no file-system lock (`Inner` only when an atime update is due).
    /// Otherwise the missing blocks are mapped under `Inner` after the cache
    /// was looked at (a page missing then was never delayed, so its mapping is
    /// final), read from the device as whole blocks outside it, and the
    /// written ones are kept as clean pages (the cache serves the next read;
    /// holes and unwritten extents are not cached). `None`: not a read this
    /// path serves (not a regular file): the caller's uncached path gives
    /// its answer.
    pub(crate) fn read_cached(
        &self,
        pc: &Arc<PageCache>,
        ino: u32,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<Option<(usize, bool)>> {
        let bs = self.block_size as u64;
        let looked = pc.read(ino, offset, buf);
        let known = looked.is_some();
        let (n, hits) = match looked {
            // A zero-length read of a file the cache knows: nothing to copy,
            // no atime (Linux's `filemap_read` returns before `file_accessed`).
            Some((0, _)) if buf.is_empty() => {
                if self.dio.errors.is_dead() {
                    return Err(FsError::Shutdown);
                }
                return Ok(Some((0, false)));
            }
            // Every block in the cache; this includes a read at or past the
            // end of a file the cache knows (no blocks): the cache's size is
            // the visible one, as for the bytes before it, so that answer
            // needs no lock either (every `read_all` ends with such a read;
            // under `Inner` it was a fifth of varmail's waits on the lock).
            Some((n, hits)) if hits.iter().all(|&h| h) => {
                return Ok(Some((n, self.cached_read_done(ino)?)));
            }
            Some((n, hits)) => (Some(n), hits),
            None => (None, Vec::new()),
        };
        let epoch = pc.discard_epoch();
        // The inode, the extent-tree blocks over the range and the block of
        // its atime are read outside the lock (C.2).
        let (mut g, i) = self.lock_warm(|g| {
            let i = g.live_inode(ino)?;
            if i.is_reg() {
                let bs = g.bs as u64;
                let end = offset.saturating_add(buf.len() as u64).div_ceil(bs);
                g.warm_tree(ino, &i, offset / bs, end)?;
                g.warm_atime(ino)?;
            }
            Ok(i)
        })?;
        if !i.is_reg() {
            return Ok(None);
        }
        let disk_size = i.size;
        // The byte ranges the cache did not have, merged into runs: only these
        // are read from the device.
        let mut misses: Vec<(usize, usize)> = Vec::new();
        let n = match n {
            Some(n) => {
                let mut pos = 0usize;
                for hit in hits {
                    let k = (bs - (offset + pos as u64) % bs).min((n - pos) as u64) as usize;
                    if !hit {
                        match misses.last_mut() {
                            Some((s, l)) if *s + *l == pos => *l += k,
                            _ => misses.push((pos, k)),
                        }
                    }
                    pos += k;
                }
                n
            }
            None => {
                // Unknown to the cache: the on-disk size is the visible one
                // (at or past it: end of file, answered under this hold; a
                // zero-length read reads nothing and leaves atime alone).
                if buf.is_empty() {
                    return Ok(Some((0, false)));
                }
                if offset >= disk_size {
                    return Ok(Some((0, g.touch_atime(ino))));
                }
                let n = ((disk_size - offset) as usize).min(buf.len());
                misses.push((0, n));
                n
            }
        };
        // A large read streams: straight into the caller's buffer, nothing
        // kept (measured: keeping a 1 GiB sequential read cost the library
        // 40% of its MiB/s in copies and evictions, and it would push
        // everything else out of the cache).
        if misses.iter().map(|m| m.1).sum::<usize>() >= FILL_MAX {
            let mut plans = Vec::with_capacity(misses.len());
            for &(p, l) in &misses {
                plans.push((p, l, g.read_plan(ino, &i, offset + p as u64, l)?));
            }
            let atime = g.touch_atime(ino);
            drop(g);
            for (p, l, segs) in plans {
                self.dio.read_segs(&segs, &mut buf[p..p + l])?;
            }
            return Ok(Some((n, atime)));
        }
        // Each run widened to whole blocks, so that what is read can be kept.
        let mut plans = Vec::with_capacity(misses.len());
        for &(p, l) in &misses {
            let start = (offset + p as u64) / bs * bs;
            let end = (offset + (p + l) as u64).div_ceil(bs) * bs;
            let len = (end - start) as usize;
            plans.push((p, l, start, g.read_plan(ino, &i, start, len)?));
        }
        let atime = g.touch_atime(ino);
        drop(g);
        let mut fill = Vec::new();
        for (p, l, start, segs) in plans {
            let len = segs.last().map_or(0, |s| s.pos + s.span);
            let mut tmp = vec![0u8; len];
            self.dio.read_segs(&segs, &mut tmp)?;
            // Past the on-disk size a block reads as zeros, whatever the
            // device holds there.
            if start + len as u64 > disk_size {
                tmp[disk_size.saturating_sub(start) as usize..].fill(0);
            }
            let from = (offset + p as u64 - start) as usize;
            buf[p..p + l].copy_from_slice(&tmp[from..from + l]);
            for seg in segs.iter().filter(|s| s.pblk.is_some()) {
                for k in (seg.pos..seg.pos + seg.span).step_by(bs as usize) {
                    let lblk = ((start + k as u64) / bs) as u32;
                    fill.push((lblk, tmp[k..k + bs as usize].to_vec()));
                }
            }
        }
        pc.fill(ino, disk_size, fill, epoch, !known);
        Ok(Some((n, atime)))
    }

    /// Write `ino`'s dirty pages back now (fsync, truncate, fallocate, seek,
    /// memory pressure); takes the inode's lock.
    pub(crate) fn writeback_file(&self, ino: u32) -> Result<()> {
        let Some(pc) = self.pc.clone() else {
            return Ok(());
        };
        if !pc.is_dirty(ino) {
            return Ok(());
        }
        let _il = self.ilocks.write(ino);
        self.writeback_locked(&pc, ino)
    }

    /// [`Self::writeback_file`] with the inode's lock held by the caller.
    pub(crate) fn writeback_locked(&self, pc: &Arc<PageCache>, ino: u32) -> Result<()> {
        let (runs, unmapped, guard, h) = {
            // The inode lock keeps the dirty pages from changing under the
            // warm pass (writers take it too).
            let mut g = self.lock_change(|g| g.warm_cut(&[ino]))?;
            // The handle before the pages: a cut that finds them gone knows
            // they are mapped in its transaction or an earlier one.
            let h = g.start(64)?;
            let Some(t) = pc.take_dirty(ino, &|| self.journal.is_aborted()) else {
                return Ok(());
            };
            let (runs, unmapped) = match g.wb_map(&h, ino, &t) {
                Ok(x) => x,
                Err(e) => {
                    // Runs mapped before the error have no data: this
                    // transaction must not commit.
                    pc.finish(ino, &t.snaps, true);
                    pc.restore_times(ino, t.times);
                    drop(h);
                    drop(g);
                    self.journal.abort();
                    self.errors.journal_failed(&self.journal, "writeback", &e);
                    return Err(e);
                }
            };
            if !unmapped.is_empty() {
                pc.finish(ino, &unmapped, true);
            }
            (runs, unmapped.len(), g.inflight.begin(ino), h)
        };
        crate::pagecache::Counters::add(&pc.stats.writebacks, 1);
        let r = write_runs(&self.dio, pc, &runs, true, &self.data_gens);
        drop(guard);
        if let Err(e) = &r {
            // Mapped by this transaction, so it must not commit without the
            // data: abort (ext4's data_err=abort); every later fsync says EIO,
            // and errors= decides what else happens.
            self.data_errors.insert(ino);
            self.journal.abort();
            self.errors.journal_failed(&self.journal, "writeback", e);
        }
        drop(h);
        self.note_data(ino);
        r?;
        if unmapped > 0 {
            return Err(FsError::NoSpace);
        }
        if pc.over_cap() {
            pc.evict();
        }
        Ok(())
    }

    /// The fast-commit leader's cut: under the barrier and `Inner` (`g`),
    /// every dirty page mapped in a handle that the caller holds until the
    /// runs are written ([`write_runs`]).
    pub(crate) fn fc_cut(&self, pc: &PageCache, g: &mut Inner) -> Result<FcCut> {
        // The handle first: every write-back under way started its handle
        // before taking its pages, so what is not dirty now is mapped in this
        // transaction or an earlier one.
        let h = g.start(64)?;
        let (runs, complete) = if pc.has_dirty() {
            g.cut_all(&h)?
        } else {
            (Vec::new(), true)
        };
        let seq = complete.then(|| pc.note_cut(h.tid()));
        if runs.is_empty() {
            return Ok(FcCut { runs, h, seq });
        }
        Ok(FcCut { runs, h, seq })
    }

    /// Whether every cached write up to `seq` is durable (`None`: no cache).
    pub(crate) fn cache_covered(&self, seq: Option<u64>) -> bool {
        match (&self.pc, seq) {
            (Some(pc), Some(s)) => pc.covered(s, &|t| self.journal.is_committed(t)),
            _ => true,
        }
    }

    /// Before an operation that changes `ino`'s size or mapping under `Inner`
    /// (truncate, fallocate; the caller holds the inode's lock): write its
    /// dirty pages back, wait for writes of its pages in flight, and drop
    /// them all (a page could hold bytes the operation zeroes or frees).
    ///
    /// Pages past a truncate's new size are written back too: the size that
    /// exposes them may already be in a transaction that commits before the
    /// truncate's, and a crash between the two must find their bytes (the
    /// prefix rule). Dropping them unwritten let such a crash show the file's
    /// older bytes there (found by `fc_crash_states` mt4, about 1 run in 25).
    /// Their space was reserved at `write()`, so this needs none.
    pub(crate) fn cache_settle(&self, ino: u32) -> Result<()> {
        if let Some(pc) = &self.pc {
            self.writeback_locked(pc, ino)?;
            pc.wait_written(ino, &|| self.journal.is_aborted());
            pc.discard(ino);
        }
        Ok(())
    }
}
