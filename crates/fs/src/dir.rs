//! Directory operations (ext4-format.md §6).
//!
//! # API (all `impl Inner`)
//!
//! * [`Inner::dir_lookup`]`(dir, name) -> Option<(ino, file_type)>`; "." and ".." are
//!   answered too.
//! * [`Inner::dir_add_entry`]`(h, dir, name, ino, ft)`: the caller guarantees `name`
//!   is absent. Errors (`NoSpace` when no block can be allocated or the htree is full)
//!   leave the directory unchanged.
//! * [`Inner::dir_remove_entry`]`(h, dir, name) -> removed ino` (`NotFound` if absent).
//! * [`Inner::dir_replace_entry`]`(h, dir, name, ino, ft) -> old ino` (rename-over).
//! * [`Inner::dir_init`]`(h, dir, &mut inode, parent)`: allocates and writes block 0
//!   ('.', '..'), sets `i_size` and charges `i_blocks` in the caller's copy; the
//!   caller writes the inode (inner.rs convention for `&mut Inode` routines).
//! * [`Inner::dir_set_dotdot`]`(h, dir, parent)`, [`Inner::dir_is_empty`]`(dir)`,
//!   [`Inner::dir_forget`]`(dir)`.
//! * [`Inner::dir_readdir`]`(dir, offset, f)`; see "readdir offsets" below.
//!
//! Operations that grow a directory write its inode themselves (size, `i_blocks`,
//! `EXT4_INDEX_FL`), reading it fresh from the inode cache; callers that later touch
//! the directory inode re-read it (as `touch_dir` in ops.rs does).
//!
//! # In-memory index
//!
//! On first access a directory is read completely (every block checksum-verified and
//! validated) into a [`DirState`]: name -> (ino, type, logical block) in a hash map,
//! the logical -> physical block map, the largest free slot per block, and a mirror
//! of the on-disk htree index. Lookups and the choice of the block to insert into
//! are O(1) average; only the one block that changes is read and rewritten. Any
//! error other than NotFound/Exists/NoSpace drops the state, so it is rebuilt from
//! disk on the next access.
//!
//! # On-disk format kept
//!
//! Like the kernel: a linear directory whose single block overflows is converted to
//! an htree when `dir_index` is on (`make_indexed_dir`); otherwise linear directories
//! grow by appending blocks. In an htree, names go to the leaf the index selects for
//! their hash; a full leaf is split in half by size (continuation bit when the two
//! halves share a hash), and full interior nodes are split or, when the root is
//! full, a level is added up to `indirect_levels` 1 (2 with `largedir`). When the
//! index cannot grow, `NoSpace` is returned before anything is changed (the kernel
//! also fails with ENOSPC, "index full"). Leaves can become empty after removals
//! (valid); blocks are never freed and `EXT4_INDEX_FL` is never cleared. Every block
//! written gets its leaf tail or dx_tail checksum.
//!
//! # readdir offsets
//!
//! Offset 0 is ".", 1 is "..", 2 is "after ..". Every other entry has the cookie
//! `cookie_of(name)`: a 63-bit hash of the name (at least 3), independent of where the
//! entry is stored. Entries are returned in (cookie, name) order, each with
//! `next_offset` = its own cookie, and a resumed readdir returns the entries whose
//! cookie is greater than the offset. Entries present throughout are therefore
//! never skipped or repeated, whatever was added or removed and however blocks were
//! split in between. Collisions (two names with one cookie; odds about n²/2⁶⁴): all
//! members of a collision group but the last get the *previous* cookie as
//! `next_offset`, so stopping inside a group makes the next call return the whole
//! group again — a collision can repeat entries but never skip one.

mod htree;
#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use commitfs_format::dirent::{self, LeafGeometry};
use commitfs_format::dirhash;
use commitfs_format::dx::{self, DxGeometry};
use commitfs_format::inode::{Inode, FL_INDEX, FL_INLINE_DATA};
use commitfs_format::superblock as sbf;
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::Inner;

use htree::DxIndex;

/// First cookie of a real entry (0, 1, 2 are ".", ".." and "after ..").
const FIRST_COOKIE: u64 = 3;
/// Memory for directory states until [`DirCache::set_budget`] says otherwise.
const DEFAULT_BUDGET: usize = 512 << 20;
/// Estimated bytes a cached name costs beyond its own bytes: the shared key
/// allocation, its slot in the name map and its place in the readdir order.
const NAME_OVERHEAD: usize = 128;
/// A directory at least this many blocks long is not loaded for a lookup when
/// its state is not cached: the htree is probed instead ([`Inner::dx_lookup`]).
const PROBE_MIN_BLOCKS: usize = 16;
/// A linear directory at most this many blocks long is scanned for a lookup
/// instead of loaded whole when its state is not cached and loading it would
/// push others out of the cache (ext4's own linear lookup; an indexed one is
/// probed then, whatever its size).
const SCAN_MAX_BLOCKS: u64 = 64;
/// What a loaded state costs per directory block, at most, in block sizes
/// (short names: some 250 records of 16 bytes a 4 KiB block, each some 136
/// bytes in the state), to tell whether loading one would evict others.
const STATE_PER_BLOCK: usize = 8;
/// Directories [`DirCache::admit`] remembers at most.
const GHOSTS_MAX: usize = 4096;
/// `file_type` of '.' and '..'.
const FT_DIR: u8 = dirent::FT_DIR;

/// Where one name lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    ino: u32,
    ft: u8,
    /// Logical block of the directory holding the record.
    lblk: u32,
}

/// In-memory state of one directory (see the module docs).
pub(crate) struct DirState {
    /// Checksum seed of the directory's blocks (`inode_seed(dir, generation)`).
    seed: u32,
    /// Logical -> physical block.
    pblocks: Vec<u64>,
    /// Per logical block: largest record an insert could place there (0 for index
    /// blocks).
    free: Vec<u16>,
    names: HashMap<Arc<[u8]>, Slot>,
    /// readdir order: (cookie, name).
    order: BTreeSet<(u64, Arc<[u8]>)>,
    dot: u32,
    dotdot: u32,
    /// The htree index, for indexed directories.
    dx: Option<DxIndex>,
    /// Bytes of the cached names (for [`Self::mem`]).
    name_bytes: usize,
    /// Second-chance bit: set by every use, cleared by an eviction sweep.
    used: bool,
}

impl DirState {
    fn add_name(&mut self, name: &[u8], slot: Slot) -> bool {
        let key: Arc<[u8]> = Arc::from(name);
        if self.names.insert(key.clone(), slot).is_some() {
            return false;
        }
        self.order.insert((cookie_of(name), key));
        self.name_bytes += name.len();
        true
    }

    fn remove_name(&mut self, name: &[u8]) -> Option<Slot> {
        let (key, slot) = self.names.remove_entry(name)?;
        self.order.remove(&(cookie_of(name), key));
        self.name_bytes -= name.len();
        Some(slot)
    }

    /// Estimated memory of this state (the names dominate).
    fn mem(&self) -> usize {
        let dx = self.dx.as_ref().map_or(0, |i| {
            (i.root.len() + i.nodes.values().map(Vec::len).sum::<usize>()) * 8 + i.nodes.len() * 64
        });
        std::mem::size_of::<DirState>()
            + self.names.len() * NAME_OVERHEAD
            + self.name_bytes
            + self.pblocks.len() * 10
            + dx
    }
}

/// readdir callback: `(ino, file_type, name, next_offset) -> continue?`.
pub(crate) type ReaddirFn<'a> = dyn FnMut(u32, u8, &[u8], u64) -> bool + 'a;

/// Directory states by inode, owned by this module (field `Inner::dirs`),
/// bounded by a memory budget (docs/ARCHITECTURE.md "Memory").
pub struct DirCache {
    map: HashMap<u32, DirState>,
    /// Sum of [`DirState::mem`] of the states in `map` (a state is not changed
    /// while it is in the map: `with_dir` takes it out).
    bytes: usize,
    budget: usize,
    stats: DirCacheStats,
    /// Renames in progress ([`Renaming`]).
    renaming: u32,
    /// Directories scanned or probed because the cache was full, with the
    /// count of such lookups when they were ([`Self::admit`]).
    ghosts: HashMap<u32, (u64, u64)>,
    ghost_seq: u64,
}

impl Default for DirCache {
    fn default() -> Self {
        DirCache {
            map: HashMap::new(),
            bytes: 0,
            budget: DEFAULT_BUDGET,
            stats: DirCacheStats::default(),
            renaming: 0,
            ghosts: HashMap::new(),
            ghost_seq: 0,
        }
    }
}

/// Directory-cache sizes and counters (`commitfs stats`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DirCacheStats {
    /// Directories cached now, and their estimated bytes.
    pub cached: usize,
    pub bytes: usize,
    pub budget: usize,
    /// Directories read in whole from disk, and dropped to stay in budget.
    pub loads: u64,
    pub evicted: u64,
    /// Lookups answered by probing the on-disk htree of an uncached directory.
    pub probes: u64,
    /// Lookups answered by scanning the blocks of an uncached linear
    /// directory (its state would not have fit without evicting others).
    pub scans: u64,
}

impl DirCache {
    pub fn set_budget(&mut self, bytes: usize) {
        self.budget = bytes;
    }

    pub fn stats(&self) -> DirCacheStats {
        DirCacheStats {
            cached: self.map.len(),
            bytes: self.bytes,
            budget: self.budget,
            ..self.stats
        }
    }

    /// Whether caching a state of about `bytes` would evict others, or
    /// pass the level an eviction sweeps down to ([`Self::put`]: 3/4 of the
    /// budget; otherwise each sweep would open room for a burst of loads
    /// that only fills the cache for the next sweep).
    fn would_evict(&self, bytes: usize) -> bool {
        self.bytes.saturating_add(bytes) > self.budget / 4 * 3
    }

    /// A lookup of `name` in uncached `dir` found the cache full: whether
    /// to load it all the same. Yes when a lookup of another name in `dir`
    /// was answered by a scan or probe within the last such lookups a
    /// quarter as many as the cache holds directories (at least 16): used
    /// that often, it is worth a place (a ghost list, as 2Q's; lookups
    /// spread evenly over many more directories than fit seldom recur so
    /// soon, and go on scanning). Only answered lookups are noted
    /// ([`Self::note_scanned`]) and only another name counts: a warm pass
    /// run again after a miss (of this lookup's blocks, or of anything after
    /// it in the pass) is the same use, not a second one.
    fn admit(&self, dir: u32, name: &[u8]) -> bool {
        let window = (self.map.len() as u64 / 4).max(16);
        self.ghosts
            .get(&dir)
            .is_some_and(|&(s, h)| self.ghost_seq - s < window && h != cookie_of(name))
    }

    /// A lookup of `name` in `dir` was answered by a scan or probe of its
    /// blocks.
    fn note_scanned(&mut self, dir: u32, name: &[u8]) {
        self.ghost_seq += 1;
        let (seq, window) = (self.ghost_seq, (self.map.len() as u64 / 4).max(16));
        if self.ghosts.len() >= GHOSTS_MAX {
            self.ghosts.retain(|_, (s, _)| seq - *s <= window);
            if self.ghosts.len() >= GHOSTS_MAX {
                self.ghosts.clear();
            }
        }
        self.ghosts.insert(dir, (seq, cookie_of(name)));
    }

    fn take(&mut self, dir: u32) -> Option<DirState> {
        let st = self.map.remove(&dir)?;
        self.bytes -= st.mem();
        Some(st)
    }

    /// Cache `st`, first dropping other directories not used since the last
    /// sweep (second chance) until the rest fits in 3/4 of the budget. The
    /// state being cached stays even when it alone is over budget: it is in use.
    fn put(&mut self, dir: u32, mut st: DirState) {
        let m = st.mem();
        if self.bytes + m > self.budget {
            let target = (self.budget * 3 / 4).saturating_sub(m);
            for _pass in 0..2 {
                let DirCache {
                    map, bytes, stats, ..
                } = self;
                map.retain(|_, s| {
                    if *bytes <= target {
                        return true;
                    }
                    if std::mem::take(&mut s.used) {
                        return true;
                    }
                    *bytes -= s.mem();
                    stats.evicted += 1;
                    false
                });
                if self.bytes <= target {
                    break;
                }
            }
        }
        st.used = true;
        self.bytes += m;
        if let Some(old) = self.map.insert(dir, st) {
            self.bytes -= old.mem();
        }
    }

    fn remove(&mut self, dir: u32) {
        let _ = self.take(dir);
    }

    /// [`Inner::dir_readdir`] of an idle cached state (`false`: not cached,
    /// in use or a rename half done; ask `Inner`), without the file-system
    /// lock (`Fs::readdir`): `f` runs under this cache's lock.
    pub(crate) fn peek_readdir(&mut self, dir: u32, offset: u64, f: &mut ReaddirFn<'_>) -> bool {
        if self.renaming > 0 {
            return false;
        }
        let Some(st) = self.map.get_mut(&dir) else {
            return false;
        };
        st.used = true;
        readdir_state(st, offset, f);
        true
    }

    /// `name` in `dir` if `dir`'s state is cached and not in use by an
    /// operation (`None`: ask `Inner`): `Some(None)` when it is absent. Used
    /// without the file-system lock (`Fs::lookup_cached`); a state is only
    /// changed while out of the map, so what is in it is whole, and no rename
    /// is half done ([`Renaming`]).
    pub(crate) fn peek(&mut self, dir: u32, name: &[u8]) -> Option<Option<u32>> {
        if self.renaming > 0 {
            return None;
        }
        let st = self.map.get_mut(&dir)?;
        st.used = true;
        Some(match name {
            b"." => Some(st.dot),
            b".." => Some(st.dotdot),
            _ => st.names.get(name).map(|s| s.ino),
        })
    }
}

/// The entries of `st` from `offset` on ("." and ".." first), to `f` until
/// it answers false.
fn readdir_state(st: &DirState, offset: u64, f: &mut ReaddirFn<'_>) {
    if offset == 0 && !f(st.dot, FT_DIR, b".", 1) {
        return;
    }
    if offset <= 1 && !f(st.dotdot, FT_DIR, b"..", 2) {
        return;
    }
    let start = offset.max(2);
    if start >= u64::MAX >> 1 {
        return;
    }
    let from: (u64, Arc<[u8]>) = (start + 1, Arc::from(&[][..]));
    let mut it = st
        .order
        .range((Bound::Included(from), Bound::Unbounded))
        .peekable();
    let mut prev = start;
    while let Some((c, name)) = it.next() {
        let same_next = matches!(it.peek(), Some((c2, _)) if c2 == c);
        let next_off = if same_next { prev } else { *c };
        let Some(slot) = st.names.get(name) else {
            continue;
        };
        if !f(slot.ino, slot.ft, name, next_off) {
            return;
        }
        if !same_next {
            prev = *c;
        }
    }
}

/// A rename in progress (`Inner::rename`): its steps change two directory
/// states one after the other, so [`DirCache::peek`] answers nothing until
/// it ends (a name must never be seen in neither or both places).
pub(crate) struct Renaming(Arc<parking_lot::Mutex<DirCache>>);

impl Renaming {
    pub(crate) fn start(dirs: &Arc<parking_lot::Mutex<DirCache>>) -> Renaming {
        dirs.lock().renaming += 1;
        Renaming(dirs.clone())
    }
}

impl Drop for Renaming {
    fn drop(&mut self) {
        self.0.lock().renaming -= 1;
    }
}

/// readdir cookie of a name (module docs): a 64-bit mix of the bytes, shifted to 63
/// bits so it fits an `i64` offset, and kept clear of 0..=2.
pub(crate) fn cookie_of(name: &[u8]) -> u64 {
    fn fmix(mut h: u64) -> u64 {
        h ^= h >> 33;
        h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^= h >> 33;
        h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
        h ^ (h >> 33)
    }
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = K ^ (name.len() as u64).wrapping_mul(0x87C3_7B91_1142_53D5);
    for chunk in name.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = fmix(h ^ u64::from_le_bytes(w)).wrapping_add(K);
    }
    (fmix(h) >> 1).max(FIRST_COOKIE)
}

/// Whether an error leaves the in-memory state trustworthy.
fn state_survives(e: &FsError) -> bool {
    matches!(e, FsError::NotFound | FsError::Exists | FsError::NoSpace)
}

impl Inner {
    // ---- geometry helpers --------------------------------------------------------

    pub(crate) fn leaf_geo(&self) -> LeafGeometry {
        LeafGeometry {
            block_size: self.bs,
            csum: self.csum.enabled,
            inodes_count: self.sb.inodes_count(),
        }
    }

    pub(crate) fn dx_geo(&self) -> DxGeometry {
        DxGeometry {
            block_size: self.bs,
            csum: self.csum.enabled,
            largedir: self.sb.has_incompat(sbf::INCOMPAT_LARGEDIR),
        }
    }

    /// Run `f` on the (lazily loaded) state of `dir`. The state is taken out of the
    /// cache while `f` runs, and dropped if `f` fails in a way that may have left it
    /// out of step with the disk.
    fn with_dir<R>(
        &mut self,
        dir: u32,
        f: impl FnOnce(&mut Inner, &mut DirState) -> Result<R>,
    ) -> Result<R> {
        let taken = self.dirs.lock().take(dir);
        let mut st = match taken {
            Some(s) => s,
            None => {
                let st = self.load_dir(dir)?;
                self.dirs.lock().stats.loads += 1;
                st
            }
        };
        let r = f(self, &mut st);
        match &r {
            Err(e) if !state_survives(e) => {}
            _ => self.cache_dir(dir, st),
        }
        r
    }

    /// Load `dir`'s state into the cache if it is not there (a changing
    /// operation's warm pass, warm.rs).
    pub(crate) fn with_dir_state(&mut self, dir: u32) -> Result<()> {
        self.with_dir(dir, |_, _| Ok(()))
    }

    /// For a changing operation's warm pass (warm.rs): the blocks of `dir`
    /// that adding `add`, removing or replacing the entry `remove` and (with
    /// `dotdot`) pointing `..` elsewhere will modify: the leaf each name is
    /// in or goes to, an htree leaf's index path when it would split, block
    /// 0 for `..` or a single full block becoming indexed. The directory's
    /// state (the index) may be cached while these buffers are not: they
    /// are read here, outside the lock, instead of by the operation under it.
    pub(crate) fn warm_dir_change(
        &mut self,
        dir: u32,
        add: Option<&[u8]>,
        remove: Option<&[u8]>,
        dotdot: bool,
    ) -> Result<()> {
        if !self.defer_misses.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let mut blks = Vec::new();
        self.with_dir(dir, |me, st| {
            let pblk = |l: u32| st.pblocks.get(l as usize).copied();
            if let Some(slot) = remove.and_then(|n| st.names.get(n)) {
                blks.extend(pblk(slot.lblk));
            }
            if dotdot {
                blks.extend(pblk(0));
            }
            if let Some(name) = add {
                if st.dx.is_some() {
                    blks.extend(me.dx_add_blocks(st, name));
                } else {
                    let need = dirent::min_rec_len(name.len());
                    match st.free.iter().position(|&f| f as usize >= need) {
                        Some(l) => blks.extend(pblk(l as u32)),
                        // Full: one block becomes indexed (reads it), more grow.
                        None if st.pblocks.len() == 1 => blks.extend(pblk(0)),
                        None => {}
                    }
                }
            }
            Ok(())
        })?;
        self.warm_all(blks)
    }

    fn cache_dir(&mut self, dir: u32, st: DirState) {
        self.dirs.lock().put(dir, st);
    }

    // ---- loading -----------------------------------------------------------------

    /// Read a whole directory into a [`DirState`], verifying every block.
    fn load_dir(&mut self, dir: u32) -> Result<DirState> {
        let inode = self.read_inode(dir)?;
        if !inode.is_dir() {
            return Err(FsError::NotDir);
        }
        if inode.has_flag(FL_INLINE_DATA) {
            return Err(FsError::NotSupported("inline-data directories".into()));
        }
        let bs = self.bs64();
        if inode.size == 0 || inode.size % bs != 0 || inode.size / bs > u32::MAX as u64 / 2 {
            return Err(FsError::corrupt(format!(
                "directory {dir}: size {} is not a positive multiple of the block size",
                inode.size
            )));
        }
        let nblocks = (inode.size / bs) as usize;
        // i_blocks counts every mapped block, so a larger size is corrupt; checking
        // it first keeps a damaged size from sizing the allocations below.
        let charged = inode.blocks_512(self.bs) / (bs / 512);
        if nblocks as u64 > charged || nblocks as u64 > self.sb.blocks_count() {
            return Err(FsError::corrupt(format!(
                "directory {dir}: size {} exceeds its {charged} allocated blocks",
                inode.size
            )));
        }
        let mut pblocks = vec![0u64; nblocks];
        for m in self.ext_list(dir, &inode)? {
            if m.unwritten {
                return Err(FsError::corrupt(format!(
                    "directory {dir}: unwritten extent at block {}",
                    m.lblk
                )));
            }
            for i in 0..m.len {
                let l = m.lblk as usize + i as usize;
                if l < nblocks {
                    pblocks[l] = m.pblk + i as u64;
                }
            }
        }
        if let Some(l) = pblocks.iter().position(|&p| p == 0) {
            return Err(FsError::corrupt(format!(
                "directory {dir}: hole at block {l}"
            )));
        }
        let mut st = DirState {
            seed: self.csum.inode_seed(dir, inode.generation),
            free: vec![0; nblocks],
            pblocks,
            names: HashMap::new(),
            order: BTreeSet::new(),
            dot: dir,
            dotdot: 0,
            dx: None,
            name_bytes: 0,
            used: true,
        };
        let mut is_leaf = vec![true; nblocks];
        if inode.has_flag(FL_INDEX) {
            let idx = self.load_index(dir, &st)?;
            st.dotdot = idx.dotdot;
            is_leaf[0] = false;
            for &n in idx.nodes.keys() {
                is_leaf[n as usize] = false;
            }
            st.dx = Some(idx);
        }
        let geo = self.leaf_geo();
        // Deferred misses: every missing leaf at once.
        self.warm_all(
            is_leaf
                .iter()
                .zip(&st.pblocks)
                .filter(|(leaf, _)| **leaf)
                .map(|(_, &p)| p),
        )?;
        for (l, leaf) in is_leaf.iter().enumerate() {
            if !leaf {
                continue;
            }
            let pblk = st.pblocks[l];
            let buf = self.read_meta(pblk)?;
            let d = buf.data();
            if self.csum.enabled {
                dirent::verify_leaf_csum(&d, st.seed, pblk)?;
            }
            let mut it = dirent::iter(&d, geo, pblk);
            if l == 0 {
                let (dot, dotdot) = dirent::dot_dotdot(&d, geo, pblk)?;
                if dot != dir {
                    return Err(FsError::corrupt(format!(
                        "directory {dir}: '.' names inode {dot}"
                    )));
                }
                st.dotdot = dotdot;
                it.next();
                it.next();
                st.free[0] = st.free[0].max(dirent::max_slack(&d, geo, pblk)? as u16);
            }
            let mut best = 0usize;
            for e in it {
                let e = e?;
                best = best.max(e.slack());
                if e.inode == 0 {
                    continue;
                }
                let slot = Slot {
                    ino: e.inode,
                    ft: e.file_type,
                    lblk: l as u32,
                };
                if e.name == b"." || e.name == b".." || !st.add_name(e.name, slot) {
                    return Err(FsError::corrupt(format!(
                        "directory {dir}: duplicate entry {:?} in block {pblk}",
                        String::from_utf8_lossy(e.name)
                    )));
                }
            }
            st.free[l] = st.free[l].max(best as u16);
        }
        Ok(st)
    }

    // ---- block access -------------------------------------------------------------

    /// Modify leaf `lblk` of a directory: verify its checksum, run `f`, restore the
    /// checksum. Returns `f`'s result and the block's new largest free slot.
    fn leaf_modify<R>(
        &mut self,
        h: &Handle,
        st: &mut DirState,
        lblk: u32,
        f: impl FnOnce(&mut [u8], LeafGeometry, u64) -> Result<R>,
    ) -> Result<R> {
        let pblk = *st
            .pblocks
            .get(lblk as usize)
            .ok_or_else(|| FsError::corrupt(format!("directory block {lblk} out of range")))?;
        let geo = self.leaf_geo();
        let csum = self.csum.enabled;
        let seed = st.seed;
        let (r, free) = self.modify_meta(h, pblk, |d| -> Result<(R, usize)> {
            if csum {
                dirent::verify_leaf_csum(d, seed, pblk)?;
            }
            let r = f(d, geo, pblk)?;
            if csum {
                dirent::set_leaf_csum(d, seed);
            }
            Ok((r, dirent::max_slack(d, geo, pblk)?))
        })??;
        st.free[lblk as usize] = free as u16;
        Ok(r)
    }

    /// Write a brand-new leaf holding `entries` at `lblk`.
    fn leaf_write_new(
        &mut self,
        h: &Handle,
        st: &mut DirState,
        lblk: u32,
        entries: &[(u32, u8, &[u8])],
    ) -> Result<()> {
        let pblk = st.pblocks[lblk as usize];
        let geo = self.leaf_geo();
        let csum = self.csum.enabled;
        let seed = st.seed;
        let free = self.new_meta(h, pblk, |d| -> Result<usize> {
            dirent::pack(d, geo, pblk, entries.iter().copied())?;
            if csum {
                dirent::set_leaf_csum(d, seed);
            }
            Ok(dirent::max_slack(d, geo, pblk)?)
        })??;
        st.free[lblk as usize] = free as u16;
        Ok(())
    }

    /// Append `n` blocks to directory `dir`: allocate, map, update `i_size` and
    /// `i_blocks`, write the inode. Returns the first new logical block. On failure
    /// nothing stays allocated or mapped. The new blocks must be written by the caller.
    fn dir_grow(&mut self, h: &Handle, dir: u32, st: &mut DirState, n: u32) -> Result<u32> {
        let mut inode = self.read_inode(dir)?;
        let first = st.pblocks.len() as u32;
        let mut goal = st
            .pblocks
            .last()
            .map(|p| p + 1)
            .unwrap_or_else(|| self.inode_goal(dir));
        let mut runs: Vec<(u64, u32)> = Vec::new();
        let mut got = 0;
        while got < n {
            match self.alloc_blocks(h, goal, n - got) {
                Ok((p, c)) => {
                    runs.push((p, c));
                    got += c;
                    goal = p + c as u64;
                }
                Err(e) => {
                    for &(p, c) in &runs {
                        let _ = self.free_blocks(h, p, c as u64);
                    }
                    return Err(e);
                }
            }
        }
        let mut lblk = first;
        for (i, &(p, c)) in runs.iter().enumerate() {
            if let Err(e) = self.ext_insert(h, dir, &mut inode, lblk, p, c, false) {
                if lblk > first {
                    let _ = self.ext_remove(h, dir, &mut inode, first, lblk as u64);
                }
                for &(p, c) in &runs[i..] {
                    let _ = self.free_blocks(h, p, c as u64);
                }
                let _ = self.write_inode(h, dir, &inode);
                return Err(e);
            }
            lblk += c;
        }
        let bs = self.bs64();
        inode.size = (first as u64 + n as u64) * bs;
        let b = inode.blocks_512(self.bs) + n as u64 * (bs / 512);
        inode.set_blocks_512(b, self.bs);
        self.write_inode(h, dir, &inode)?;
        for &(p, c) in &runs {
            for i in 0..c {
                st.pblocks.push(p + i as u64);
                st.free.push(0);
            }
        }
        Ok(first)
    }

    /// A directory got new blocks in this transaction. Fast-commit replay must be
    /// able to add the logged names as well: e2fsck 1.47's `ext2fs_link` cannot
    /// grow a linear directory or convert it to an htree (its replay aborts, "No
    /// free space in the directory") and the kernel's replay grows directories
    /// without charging `i_blocks`. A plain htree leaf split (`leaf_split`) both
    /// replayers redo themselves: then an INODE record of the directory after its
    /// names lets them recompute `i_blocks` from the final tree. Anything else
    /// needs a full commit (docs/FORMAT.md, "Fast commits other tools replay").
    pub(crate) fn fc_dir_grown(&mut self, h: &Handle, dir: u32, leaf_split: bool) {
        if !self.fc_other_replayers() {
            return;
        }
        if leaf_split {
            self.fc_track_inode(dir, h.tid(), None);
        } else {
            self.fc_ineligible(crate::fc::FcReason::DirGrow, h.tid());
        }
    }

    // ---- public operations ----------------------------------------------------------

    /// Look `name` up in `dir`. A large indexed directory whose state is not
    /// cached is probed on disk instead of loaded whole (so a lookup stays a
    /// few block reads after the state was evicted); so is any other whose
    /// state would only fit by evicting others (an indexed one probed, a
    /// linear one of at most [`SCAN_MAX_BLOCKS`] scanned): lookups spread
    /// over more directories than the cache holds would otherwise load a
    /// whole directory each, evicting the one the next lookup needs.
    pub fn dir_lookup(&mut self, dir: u32, name: &[u8]) -> Result<Option<(u32, u8)>> {
        if name == b".." && !self.dirs.lock().map.contains_key(&dir) {
            // Rename's ancestor walk asks this of every directory up to the
            // root: its first block answers, not the whole directory.
            if let Some(p) = self.dir_dotdot(dir)? {
                return Ok(Some((p, FT_DIR)));
            }
        }
        if name != b"." && name != b".." && !self.dirs.lock().map.contains_key(&dir) {
            let inode = self.read_inode(dir)?;
            let blocks = inode.size / self.bs64();
            let plain = inode.is_dir()
                && !inode.has_flag(FL_INLINE_DATA)
                && inode.size % self.bs64() == 0
                && blocks > 0
                && blocks <= u32::MAX as u64 / 2;
            let indexed = plain && inode.has_flag(FL_INDEX);
            let full = plain && {
                let est = (blocks as usize).saturating_mul(self.bs * STATE_PER_BLOCK);
                let c = self.dirs.lock();
                c.would_evict(est) && !c.admit(dir, name)
            };
            if indexed && (full || blocks >= PROBE_MIN_BLOCKS as u64) {
                if let Some(found) = self.dx_lookup(dir, &inode, name)? {
                    let mut c = self.dirs.lock();
                    c.stats.probes += 1;
                    c.note_scanned(dir, name);
                    return Ok(found);
                }
            } else if full && !indexed && blocks <= SCAN_MAX_BLOCKS {
                if let Some(found) = self.dir_scan(dir, &inode, name)? {
                    let mut c = self.dirs.lock();
                    c.stats.scans += 1;
                    c.note_scanned(dir, name);
                    return Ok(found);
                }
            }
        }
        self.with_dir(dir, |_, st| {
            Ok(match name {
                b"." => Some((st.dot, FT_DIR)),
                b".." => Some((st.dotdot, FT_DIR)),
                _ => st.names.get(name).map(|s| (s.ino, s.ft)),
            })
        })
    }

    /// Add `name -> ino` to `dir` (the caller checked that `name` is absent).
    pub fn dir_add_entry(
        &mut self,
        h: &Handle,
        dir: u32,
        name: &[u8],
        ino: u32,
        file_type: u8,
    ) -> Result<()> {
        if name.is_empty() || name.len() > dirent::MAX_NAME_LEN {
            return Err(FsError::Invalid("bad directory entry name"));
        }
        self.with_dir(dir, |me, st| {
            if name == b"." || name == b".." || st.names.contains_key(name) {
                return Err(FsError::Exists);
            }
            if st.dx.is_some() {
                return me.dx_add_entry(h, dir, st, name, ino, file_type);
            }
            me.linear_add_entry(h, dir, st, name, ino, file_type)
        })
    }

    fn linear_add_entry(
        &mut self,
        h: &Handle,
        dir: u32,
        st: &mut DirState,
        name: &[u8],
        ino: u32,
        ft: u8,
    ) -> Result<()> {
        let need = dirent::min_rec_len(name.len());
        let target = st.free.iter().position(|&f| f as usize >= need);
        let lblk = match target {
            Some(l) => l as u32,
            None => {
                if st.pblocks.len() == 1 && self.sb.has_compat(sbf::COMPAT_DIR_INDEX) {
                    // The kernel's make_indexed_dir: the single block is full.
                    self.make_indexed(h, dir, st)?;
                    return self.dx_add_entry(h, dir, st, name, ino, ft);
                }
                let l = self.dir_grow(h, dir, st, 1)?;
                self.fc_dir_grown(h, dir, false);
                self.leaf_write_new(h, st, l, &[])?;
                l
            }
        };
        let placed = self.leaf_modify(h, st, lblk, |d, geo, pblk| {
            Ok(dirent::insert(d, geo, pblk, name, ino, ft)?)
        })?;
        if placed.is_none() {
            return Err(FsError::corrupt(format!(
                "directory {dir}: block {lblk} has less room than recorded"
            )));
        }
        st.add_name(name, Slot { ino, ft, lblk });
        Ok(())
    }

    /// Remove `name` from `dir`, returning the inode it named.
    pub fn dir_remove_entry(&mut self, h: &Handle, dir: u32, name: &[u8]) -> Result<u32> {
        self.with_dir(dir, |me, st| {
            let slot = *st.names.get(name).ok_or(FsError::NotFound)?;
            let removed = me.leaf_modify(h, st, slot.lblk, |d, geo, pblk| {
                Ok(dirent::remove(d, geo, pblk, name)?)
            })?;
            if removed != Some(slot.ino) {
                return Err(FsError::corrupt(format!(
                    "directory {dir}: entry {:?} not where the index says",
                    String::from_utf8_lossy(name)
                )));
            }
            st.remove_name(name);
            Ok(slot.ino)
        })
    }

    /// Point existing entry `name` at `ino` (type `file_type`); returns the old inode.
    pub fn dir_replace_entry(
        &mut self,
        h: &Handle,
        dir: u32,
        name: &[u8],
        ino: u32,
        file_type: u8,
    ) -> Result<u32> {
        self.with_dir(dir, |me, st| {
            let slot = *st.names.get(name).ok_or(FsError::NotFound)?;
            let old = me.leaf_modify(h, st, slot.lblk, |d, geo, pblk| {
                let e = dirent::find(d, geo, pblk, name)?
                    .ok_or_else(|| FsError::corrupt("directory entry not where the index says"))?;
                let (off, old) = (e.offset, e.inode);
                dirent::set_entry_inode(d, geo, pblk, off, ino, file_type)?;
                Ok(old)
            })?;
            st.names.insert(
                Arc::from(name),
                Slot {
                    ino,
                    ft: file_type,
                    lblk: slot.lblk,
                },
            );
            Ok(old)
        })
    }

    /// Give a new directory its first block ('.' and '..'). Sets `i_size` and
    /// `i_blocks` in `dir_inode`; the caller writes the inode.
    pub fn dir_init(
        &mut self,
        h: &Handle,
        dir: u32,
        dir_inode: &mut Inode,
        parent: u32,
    ) -> Result<()> {
        let (pblk, _) = self.alloc_blocks(h, self.inode_goal(dir), 1)?;
        if let Err(e) = self.ext_insert(h, dir, dir_inode, 0, pblk, 1, false) {
            let _ = self.free_blocks(h, pblk, 1);
            return Err(e);
        }
        let geo = self.leaf_geo();
        let seed = self.csum.inode_seed(dir, dir_inode.generation);
        let csum = self.csum.enabled;
        let free = self.new_meta(h, pblk, |d| -> Result<usize> {
            dirent::init_first(d, geo, dir, parent);
            if csum {
                dirent::set_leaf_csum(d, seed);
            }
            Ok(dirent::max_slack(d, geo, pblk)?)
        })??;
        dir_inode.size = self.bs64();
        let b = dir_inode.blocks_512(self.bs) + self.bs64() / 512;
        dir_inode.set_blocks_512(b, self.bs);
        let st = DirState {
            seed,
            pblocks: vec![pblk],
            free: vec![free as u16],
            names: HashMap::new(),
            order: BTreeSet::new(),
            dot: dir,
            dotdot: parent,
            dx: None,
            name_bytes: 0,
            used: true,
        };
        self.cache_dir(dir, st);
        Ok(())
    }

    /// Point '..' of `dir` at `new_parent` (rename across directories).
    pub fn dir_set_dotdot(&mut self, h: &Handle, dir: u32, new_parent: u32) -> Result<()> {
        self.with_dir(dir, |me, st| {
            if st.dx.is_some() {
                me.dx_set_dotdot(h, st, new_parent)?;
            } else {
                me.leaf_modify(h, st, 0, |d, geo, pblk| {
                    dirent::dot_dotdot(d, geo, pblk)?;
                    // '..' follows the 12-byte '.' record (checked just above).
                    dirent::set_entry_inode(d, geo, pblk, dirent::MIN_REC_LEN, new_parent, FT_DIR)?;
                    Ok(())
                })?;
            }
            st.dotdot = new_parent;
            Ok(())
        })
    }

    /// Whether `dir` has no entries besides '.' and '..'.
    pub fn dir_is_empty(&mut self, dir: u32) -> Result<bool> {
        self.with_dir(dir, |_, st| Ok(st.names.is_empty()))
    }

    /// Entries from `offset` on (module docs: "readdir offsets"). `f(ino, type, name,
    /// next_offset)` returns false to stop.
    pub fn dir_readdir(&mut self, dir: u32, offset: u64, f: &mut ReaddirFn<'_>) -> Result<()> {
        self.with_dir(dir, |_, st| {
            readdir_state(st, offset, f);
            Ok(())
        })
    }

    /// Forget the in-memory state of `dir` (after rmdir, or to save memory).
    pub fn dir_forget(&mut self, dir: u32) {
        self.dirs.lock().remove(dir);
    }

    // ---- htree entry points (bodies in dir/htree.rs) ----------------------------------

    /// Directory hash of `name` in an indexed directory.
    fn name_hash(&self, idx: &DxIndex, name: &[u8]) -> (u32, u32) {
        dirhash::dx_hash(name, idx.eff_version, &self.sb.hash_seed())
    }

    /// Hash version (on disk) for a new index: the superblock default, or half_md4
    /// when that is not one we know.
    fn default_hash_version(&self) -> u8 {
        let v = self.sb.def_hash_version();
        if v <= dirhash::DX_HASH_TEA {
            v
        } else {
            dirhash::DX_HASH_HALF_MD4
        }
    }

    /// Look `name` up in a linear directory without its state, as the
    /// kernel's `ext4_find_entry` does: each block read (misses deferred
    /// together), checksum-verified and searched. `None` when the scan cannot
    /// tell (a hole or unwritten extent: loading reports the corruption).
    /// `..` of an uncached directory from its first block (a leaf, or the
    /// htree root, whose first records are `.` and `..` as well), checksum
    /// verified. `None`: not a plain extent-mapped directory (the caller
    /// loads it and reports what is wrong).
    fn dir_dotdot(&mut self, dir: u32) -> Result<Option<u32>> {
        let inode = self.read_inode(dir)?;
        if !inode.is_dir()
            || inode.has_flag(FL_INLINE_DATA)
            || inode.size < self.bs64()
            || inode.size % self.bs64() != 0
        {
            return Ok(None);
        }
        let pblk = match self.ext_map(dir, &inode, 0)? {
            Some(m) if !m.unwritten => m.pblk,
            _ => return Ok(None),
        };
        let buf = self.read_meta(pblk)?;
        let d = buf.data();
        let seed = self.csum.inode_seed(dir, inode.generation);
        let (dot, dotdot) = if inode.has_flag(FL_INDEX) {
            if self.csum.enabled {
                dx::verify_csum(&d, dx::ROOT_COUNT_OFFSET, seed, pblk)?;
            }
            let r = dx::parse_root(&d, &self.dx_geo(), pblk)?;
            (r.dot_inode, r.dotdot_inode)
        } else {
            if self.csum.enabled {
                dirent::verify_leaf_csum(&d, seed, pblk)?;
            }
            dirent::dot_dotdot(&d, self.leaf_geo(), pblk)?
        };
        if dot != dir {
            return Err(FsError::corrupt(format!(
                "directory {dir}: '.' names inode {dot}"
            )));
        }
        Ok(Some(dotdot))
    }

    fn dir_scan(
        &mut self,
        dir: u32,
        inode: &Inode,
        name: &[u8],
    ) -> Result<Option<Option<(u32, u8)>>> {
        let nblocks = (inode.size / self.bs64()) as u32;
        let mut pblocks = Vec::with_capacity(nblocks as usize);
        for m in self.ext_list(dir, inode)? {
            if m.unwritten || m.lblk != pblocks.len() as u32 {
                return Ok(None);
            }
            let n = m.len.min(nblocks - m.lblk.min(nblocks));
            pblocks.extend((0..n as u64).map(|i| m.pblk + i));
        }
        if pblocks.len() != nblocks as usize {
            return Ok(None);
        }
        self.warm_all(pblocks.iter().copied())?;
        let seed = self.csum.inode_seed(dir, inode.generation);
        for &p in &pblocks {
            let buf = self.read_meta(p)?;
            let found = self.leaf_find(&buf.data(), seed, p, name)?;
            if let Some(found) = found {
                return Ok(Some(Some(found)));
            }
        }
        Ok(Some(None))
    }

    /// `name` in leaf block `d` (device block `pblk`) of a directory with
    /// checksum seed `seed`, after verifying the block's checksum.
    fn leaf_find(&self, d: &[u8], seed: u32, pblk: u64, name: &[u8]) -> Result<Option<(u32, u8)>> {
        if self.csum.enabled {
            dirent::verify_leaf_csum(d, seed, pblk)?;
        }
        for e in dirent::iter(d, self.leaf_geo(), pblk) {
            let e = e?;
            if e.inode != 0 && e.name == name {
                return Ok(Some((e.inode, e.file_type)));
            }
        }
        Ok(None)
    }

    /// Look `name` up in an indexed directory without its state, as the
    /// kernel's `ext4_dx_find_entry`: the root, the interior node on the path
    /// and one leaf, each checksum-verified. `None` when the probe cannot tell:
    /// the name's hash may continue into a leaf the path does not reach (a
    /// continuation entry follows, or the leaf is the last of its node); the
    /// caller then loads the directory.
    fn dx_lookup(
        &mut self,
        dir: u32,
        inode: &Inode,
        name: &[u8],
    ) -> Result<Option<Option<(u32, u8)>>> {
        let nblocks = (inode.size / self.bs64()) as u32;
        let seed = self.csum.inode_seed(dir, inode.generation);
        let geo = self.dx_geo();
        let csum = self.csum.enabled;
        let block = |me: &mut Inner, l: u32| -> Result<(u64, Vec<u8>)> {
            let m = if l < nblocks {
                me.ext_map(dir, inode, l)?
            } else {
                None
            };
            let pblk = match m {
                Some(m) if !m.unwritten => m.pblk,
                _ => {
                    return Err(FsError::corrupt(format!(
                        "directory {dir}: htree block {l} of {nblocks} is not mapped"
                    )))
                }
            };
            Ok((pblk, me.read_meta(pblk)?.data().to_vec()))
        };
        let (p0, b0) = block(self, 0)?;
        if csum {
            dx::verify_csum(&b0, dx::ROOT_COUNT_OFFSET, seed, p0)?;
        }
        let root = dx::parse_root(&b0, &geo, p0)?;
        let eff = self.sb.effective_hash_version(root.hash_version);
        let (hash, _) = dirhash::dx_hash(name, eff, &self.sb.hash_seed());
        let mut entries = root.entries;
        for level in 0..=root.indirect_levels {
            if entries.is_empty() {
                return Err(FsError::corrupt(format!(
                    "directory {dir}: empty htree node"
                )));
            }
            let i = dx::lookup(&entries, hash);
            let child = entries[i].block;
            if child == 0 || child >= nblocks {
                return Err(FsError::corrupt(format!(
                    "directory {dir}: htree points at block {child} of {nblocks}"
                )));
            }
            if level < root.indirect_levels {
                let (p, d) = block(self, child)?;
                if csum {
                    dx::verify_csum(&d, dx::NODE_COUNT_OFFSET, seed, p)?;
                }
                entries = dx::parse_node(&d, &geo, p)?.entries;
                continue;
            }
            let (p, d) = block(self, child)?;
            if let Some(found) = self.leaf_find(&d, seed, p, name)? {
                return Ok(Some(Some(found)));
            }
            let continues = match entries.get(i + 1) {
                Some(next) => next.hash & dx::HASH_CONTINUATION != 0 && next.hash & !1 == hash,
                None => root.indirect_levels > 0,
            };
            return Ok(if continues { None } else { Some(None) });
        }
        Err(FsError::corrupt(format!(
            "directory {dir}: htree probe fell off the tree"
        )))
    }

    /// Read the dx root (and interior nodes) of an indexed directory.
    fn load_index(&mut self, dir: u32, st: &DirState) -> Result<DxIndex> {
        let geo = self.dx_geo();
        let nblocks = st.pblocks.len() as u32;
        let read = |me: &Inner, lblk: u32, root: bool| -> Result<Vec<u8>> {
            let pblk = st.pblocks[lblk as usize];
            let b = me.read_meta(pblk)?;
            let d = b.data().to_vec();
            if me.csum.enabled {
                let co = if root {
                    dx::ROOT_COUNT_OFFSET
                } else {
                    dx::NODE_COUNT_OFFSET
                };
                dx::verify_csum(&d, co, st.seed, pblk)?;
            }
            Ok(d)
        };
        let b0 = read(self, 0, true)?;
        let root = dx::parse_root(&b0, &geo, st.pblocks[0])?;
        let mut idx = DxIndex {
            hash_version: root.hash_version,
            eff_version: self.sb.effective_hash_version(root.hash_version),
            levels: root.indirect_levels,
            dotdot: root.dotdot_inode,
            root: root.entries,
            nodes: HashMap::new(),
        };
        let check_child = |b: u32| -> Result<()> {
            if b == 0 || b >= nblocks {
                return Err(FsError::corrupt(format!(
                    "directory {dir}: htree points at block {b} of {nblocks}"
                )));
            }
            Ok(())
        };
        let mut frontier: Vec<u32> = Vec::new();
        for e in &idx.root {
            check_child(e.block)?;
            frontier.push(e.block);
        }
        for _ in 0..idx.levels {
            let mut next = Vec::new();
            for b in frontier {
                if idx.nodes.contains_key(&b) {
                    return Err(FsError::corrupt(format!(
                        "directory {dir}: htree node {b} referenced twice"
                    )));
                }
                let d = read(self, b, false)?;
                let node = dx::parse_node(&d, &geo, st.pblocks[b as usize])?;
                for e in &node.entries {
                    check_child(e.block)?;
                    next.push(e.block);
                }
                idx.nodes.insert(b, node.entries);
            }
            frontier = next;
        }
        for b in frontier {
            if idx.nodes.contains_key(&b) {
                return Err(FsError::corrupt(format!(
                    "directory {dir}: htree block {b} is both a node and a leaf"
                )));
            }
        }
        Ok(idx)
    }
}
