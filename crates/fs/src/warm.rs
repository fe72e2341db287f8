//! Warm passes of changing operations (ARCHITECTURE.md C.2, "no device I/O
//! under `Inner`"): before an operation that allocates, maps or frees
//! changes anything, `Fs::lock_warm` runs one of these with misses deferred.
//! Each walks, without changing anything, to the metadata blocks the
//! operation will read — the allocator's bitmap and the new inode's
//! inode-table block, the extent-tree blocks of a mapped or freed range, the
//! bitmaps of the blocks it frees, an xattr block — and ends with
//! [`FsError::MetadataMiss`] naming the ones not cached, which the caller
//! reads without the lock before running the pass again. The lock is held
//! from the last pass through the operation, so what the pass found cached
//! is what the operation reads.
//!
//! A pass predicts; it does not bind. Where the operation reads something
//! the pass did not foresee (a group found full after all, an extent split's
//! new tree block), it reads it under the lock as before: slower, never
//! wrong. Errors other than a deferred miss are the operation's to report.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering::Relaxed;

use commitfs_format::extent::NodeRef;
use commitfs_format::group_desc::{BG_BLOCK_UNINIT, BG_INODE_UNINIT};
use commitfs_format::inode::Inode;

use crate::error::{unless_miss, FsError, Result};
use crate::inner::{Inner, WARM_BATCH};

/// Past this many extents a freeing pass stops collecting bitmaps (a file
/// of millions of fragments frees them under the lock, in its own time).
const FREE_SCAN: usize = 4096;

/// Orphan-list members a last close's pass follows to find the one linking
/// to the closed inode (the list holds the open unlinked files).
const ORPHAN_WALK: usize = 64;

/// What a freeing pass ([`Inner::warm_free`]) prepares for besides the
/// blocks.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Evict {
    /// A truncate: the inode stays.
    No,
    /// The last link of an inode nobody holds open: it goes.
    Yes,
    /// An unlinked file's last close: it goes, and off the orphan list.
    Orphan,
}

/// Runs of consecutive dirty pages per file a cut's pass warms (a file
/// dirtied in many scattered pages maps the rest under the lock).
const CUT_RUNS: usize = 16;

impl Inner {
    fn deferring(&self) -> bool {
        self.defer_misses.load(Relaxed)
    }

    /// Inode `ino` and its inode-table block, which `write_inode` changes:
    /// the inode table may keep an inode whose block the buffer cache has
    /// let go.
    pub(crate) fn warm_inode(&mut self, ino: u32) -> Result<()> {
        self.read_inode(ino)?;
        if !self.deferring() {
            return Ok(());
        }
        match self.inode_location(ino) {
            Ok((blk, _)) => self.warm_all([blk]),
            Err(_) => Ok(()),
        }
    }

    /// The inode-table blocks of the inodes whose pending atimes (noted
    /// without `Inner` by cached reads, `touch_atime_deferred`) a flush
    /// writes: of `only`, or all of them (a sync's `prepare_commit`). Each
    /// pass reports every missing block at once (up to `WARM_BATCH`), not
    /// one per round.
    pub(crate) fn warm_lazy(&mut self, only: Option<u32>) -> Result<()> {
        if !self.deferring() || self.itable.lazy_is_empty() {
            return Ok(());
        }
        let inos = self.itable.lazy_inos(only);
        self.warm_itable_blocks(&inos)
    }

    /// [`Self::warm_lazy`] for the atimes pending longer than the lazytime
    /// expiry (`Inner::flush_lazy_expired_now`).
    pub(crate) fn warm_lazy_expired(&mut self) -> Result<()> {
        if !self.deferring() || self.itable.lazy_is_empty() {
            return Ok(());
        }
        let now = crate::inner::coarse_secs();
        let inos = self.itable.lazy_expired(now, crate::atime::LAZYTIME_EXPIRY);
        self.warm_itable_blocks(&inos)
    }

    /// The inode-table blocks holding `inos`, each once, in one pass.
    pub(crate) fn warm_itable_blocks(&mut self, inos: &[u32]) -> Result<()> {
        let blks: std::collections::BTreeSet<u64> = inos
            .iter()
            .filter_map(|&ino| self.inode_location(ino).ok().map(|(b, _)| b))
            .collect();
        self.warm_all(blks)
    }

    /// The inode-table block of `ino` when an access would write its atime
    /// ([`Inner::touch_atime`] after a read or a listing).
    pub(crate) fn warm_atime(&mut self, ino: u32) -> Result<()> {
        if !self.deferring() || !crate::atime::atime_maybe_due(&self.opts, &self.itable, ino) {
            return Ok(());
        }
        self.warm_inode(ino)
    }

    /// The block bitmaps allocating `want` blocks from `goal` on reads (a
    /// prediction): of the goal's group, or of the next group with free
    /// blocks, and of the groups after it until their usable free blocks
    /// (not freed by a transaction not yet committed) are twice `want`, at
    /// least two, at most [`ALLOC_GROUPS`]; none for a group whose bitmap is
    /// still uninitialised: that one is made, not read.
    pub(crate) fn warm_block_alloc(&mut self, goal: u64) -> Result<()> {
        self.warm_block_alloc_n(goal, 1)
    }

    /// [`Self::warm_block_alloc`] for `want` blocks.
    pub(crate) fn warm_block_alloc_n(&mut self, goal: u64, want: u64) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        let goal = goal.clamp(
            self.sb.first_data_block() as u64,
            self.sb.blocks_count() - 1,
        );
        // As `alloc_blocks` does first (bookkeeping of durable state only);
        // the operation then prunes no further (`warm_pruned`).
        self.prune_pending_free();
        self.warm_pruned = true;
        let g0 = self.block_group(goal);
        let mut blks = Vec::with_capacity(4);
        let (mut found, mut free) = (0, 0u64);
        for k in 0..self.groups {
            let g = (g0 + k) % self.groups;
            let gd = self.gds[g as usize];
            if gd.free_blocks_count == 0 {
                continue;
            }
            // The descriptor changes too.
            blks.extend(self.group_block_reads(g));
            found += 1;
            // Blocks freed by transactions not yet committed are skipped.
            free +=
                (gd.free_blocks_count as u64).saturating_sub(self.pending_free.group_pending(g));
            // Twice what is wanted: a run ends at the first used block, and
            // the next one's goal follows it, often into the next group.
            if found >= ALLOC_GROUPS || (found >= 2 && free > 2 * want) {
                break;
            }
        }
        self.warm_all(blks)
    }

    /// What `alloc_inode(parent, is_dir)` reads: the inode bitmap of the
    /// group it picks, and the inode-table block of the inode it will take
    /// (which `write_inode` of the new inode reads); with `block` (a
    /// directory, a slow symlink), the block bitmap its first block comes
    /// from.
    pub(crate) fn warm_inode_alloc(
        &mut self,
        parent: u32,
        is_dir: bool,
        block: bool,
    ) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        // As `alloc_inode` does first: numbers whose freeing transaction is
        // durable are usable again, and the hint moves back to them (only
        // bookkeeping of durable state, which any later allocation would do).
        self.prune_pending_free_inodes();
        self.warm_pruned = true;
        let Some(g0) = self.pick_inode_group(parent, is_dir) else {
            return Ok(());
        };
        let Some(g) = (0..self.groups)
            .map(|k| (g0 + k) % self.groups)
            .find(|&g| self.usable_inodes(g) > 0)
        else {
            return Ok(());
        };
        let gd = self.gds[g as usize];
        let bit = if gd.has_flag(BG_INODE_UNINIT) {
            self.warm_all([self.gd_block(g)])?;
            Some(0)
        } else {
            self.warm_all([gd.inode_bitmap, self.gd_block(g)])?;
            let buf = self.read_meta(gd.inode_bitmap)?;
            let d = buf.data();
            self.usable_inode_bit(g, &d)
        };
        let Some(bit) = bit else {
            return Ok(());
        };
        let ino = g * self.ipg + bit as u32 + 1;
        if let Ok((blk, _)) = self.inode_location(ino) {
            self.warm_all([blk])?;
        }
        if block {
            self.warm_block_alloc(self.inode_goal(ino))?;
        }
        Ok(())
    }

    /// The pass before creating `name` in `parent`: the lookup that checks
    /// it is free, the parent's xattr block (default ACLs are inherited),
    /// the new inode ([`Self::warm_inode_alloc`]) and the block the
    /// directory would grow by if the entry does not fit.
    pub(crate) fn warm_create(
        &mut self,
        parent: u32,
        name: &[u8],
        is_dir: bool,
        block: bool,
    ) -> Result<()> {
        self.warm_lookup(parent, name)?;
        if !self.deferring() {
            return Ok(());
        }
        if let Ok(p) = self.read_inode(parent) {
            if p.file_acl != 0 {
                self.warm_all([p.file_acl])?;
            }
        }
        // The parent's times (and a new directory's link) are written.
        let _ = unless_miss(self.warm_inode(parent))?;
        self.warm_dir_state(parent)?;
        let _ = unless_miss(self.warm_dir_change(parent, Some(name), None, false))?;
        let _ = unless_miss(self.warm_inode_alloc(parent, is_dir, block))?;
        let _ = unless_miss(self.warm_dir_growth(parent))?;
        Ok(())
    }

    /// The pass before removing `name` from `parent` (unlink, rmdir, a
    /// rename's replaced target): the lookup, the named inode, a directory's
    /// own blocks (the emptiness check) and, when this is the inode's last
    /// link and nothing holds it open, what freeing it reads.
    pub(crate) fn warm_remove(&mut self, parent: u32, name: &[u8]) -> Result<()> {
        self.warm_name(parent, name)?;
        if !self.deferring() {
            return Ok(());
        }
        self.warm_dir_state(parent)?;
        let _ = unless_miss(self.warm_dir_change(parent, None, Some(name), false))?;
        let _ = unless_miss(self.warm_inode(parent))?;
        let Ok(ino) = unless_miss(self.lookup_ino(parent, name))? else {
            return Ok(());
        };
        let _ = unless_miss(self.warm_inode(ino))?;
        let Ok(i) = unless_miss(self.read_inode(ino))? else {
            return Ok(());
        };
        let last = if i.is_dir() {
            let _ = unless_miss(self.dir_is_empty(ino))?;
            true
        } else {
            i.links_count <= 1
        };
        if last && !self.itable.is_open(ino) {
            let _ = unless_miss(self.warm_free(ino, 0, Evict::Yes))?;
        }
        Ok(())
    }

    /// The pass before a rename: both names ([`Self::warm_remove`] for a
    /// replaced target), a moved directory's `..` entry, and the block the
    /// new parent would grow by.
    pub(crate) fn warm_rename(
        &mut self,
        (parent, name): (u32, &[u8]),
        (new_parent, new_name): (u32, &[u8]),
    ) -> Result<()> {
        self.warm_name(parent, name)?;
        self.warm_remove(new_parent, new_name)?;
        if !self.deferring() {
            return Ok(());
        }
        self.warm_dir_state(parent)?;
        let _ = unless_miss(self.warm_dir_change(parent, None, Some(name), false))?;
        let _ = unless_miss(self.warm_inode(parent))?;
        let _ = unless_miss(self.warm_inode(new_parent))?;
        // The new name: a new entry, or (a target exists) one replaced in
        // place, which `warm_remove` above warmed.
        let _ = unless_miss(self.warm_dir_change(new_parent, Some(new_name), None, false))?;
        if let Ok(src) = unless_miss(self.lookup_ino(parent, name))? {
            // Its ctime.
            let _ = unless_miss(self.warm_inode(src))?;
            if matches!(unless_miss(self.read_inode(src))?, Ok(i) if i.is_dir()) {
                let _ = unless_miss(self.lookup_ino(src, b".."))?;
                if parent != new_parent {
                    let _ = unless_miss(self.warm_dir_change(src, None, None, true))?;
                }
                // The check that the new parent is not below the moved
                // directory walks `..` up to the root: one first block (and
                // inode) per level, a pass per level.
                let _ = unless_miss(self.is_descendant(new_parent, src))?;
            }
        }
        // A directory replaced (or exchanged): the walk from the old parent,
        // and (exchanged across parents) its `..`.
        if let Ok(dst) = unless_miss(self.lookup_ino(new_parent, new_name))? {
            if matches!(unless_miss(self.read_inode(dst))?, Ok(i) if i.is_dir()) {
                let _ = unless_miss(self.is_descendant(parent, dst))?;
                if parent != new_parent {
                    let _ = unless_miss(self.warm_dir_change(dst, None, None, true))?;
                }
            }
        }
        let _ = unless_miss(self.warm_dir_growth(new_parent))?;
        Ok(())
    }

    /// The state of a directory the operation will change (add, remove or
    /// replace an entry: `with_dir` loads it whole). A lookup may have only
    /// probed or scanned it (`dir_lookup` under cache pressure), which reads
    /// a few of its blocks.
    pub(crate) fn warm_dir_state(&mut self, dir: u32) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        let _ = unless_miss(self.with_dir_state(dir))?;
        Ok(())
    }

    /// The block bitmap a directory's next block would come from.
    pub(crate) fn warm_dir_growth(&mut self, dir: u32) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        let d = self.read_inode(dir)?;
        let next = d.size.div_ceil(self.bs as u64).min(u32::MAX as u64) as u32;
        let goal = self.data_goal(dir, &d, next)?;
        self.warm_block_alloc(goal)
    }

    /// Every extent-tree block of `i` (inode `ino`) whose key range meets
    /// file blocks `[lo, hi)`, a level at a time (so a cold tree costs one
    /// pass per level, not one per block).
    pub(crate) fn warm_tree(&mut self, ino: u32, i: &Inode, lo: u64, hi: u64) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        let Ok(root) = NodeRef::parse_root(&i.block, ino) else {
            // Not an extent-mapped inode, or a bad root: the operation's own
            // parse reports it.
            return Ok(());
        };
        let mut level = children_in(&root, lo, hi);
        let mut depth = root.depth();
        while depth > 0 && !level.is_empty() {
            self.warm_all(level.iter().copied())?;
            depth -= 1;
            if depth == 0 {
                break;
            }
            let mut next = Vec::new();
            for blk in level {
                let buf = self.read_meta(blk)?;
                let data = buf.data();
                let Ok(node) =
                    NodeRef::parse_block(&data, blk, Some(depth), &self.csum, ino, i.generation)
                else {
                    return Ok(());
                };
                next.extend(children_in(&node, lo, hi));
            }
            level = next;
        }
        Ok(())
    }

    /// Whether changing file blocks `[lo, hi)` of a tree with index levels
    /// may take `ext_slow_op`, which reads every tree block: the range
    /// crosses into the next leaf, or the leaf at `lo` has no room for two
    /// more extents (an unwritten extent converted in its middle splits in
    /// three). Reads only the path to that leaf (warmed by the caller).
    fn tree_may_rebuild(&mut self, ino: u32, i: &Inode, lo: u64, hi: u64) -> Result<bool> {
        let Ok(root) = NodeRef::parse_root(&i.block, ino) else {
            return Ok(false);
        };
        if root.is_leaf() {
            // The root alone: a rebuild reads no block.
            return Ok(false);
        }
        let cap = commitfs_format::extent::block_capacity(self.bs) as usize;
        let lblk = lo.min(u32::MAX as u64) as u32;
        let mut next_key = None;
        let mut depth = root.depth();
        let mut child = Inner::pick_child(&root, lblk, &mut next_key);
        while depth > 0 {
            depth -= 1;
            let buf = self.read_meta(child)?;
            let data = buf.data();
            let Ok(node) =
                NodeRef::parse_block(&data, child, Some(depth), &self.csum, ino, i.generation)
            else {
                return Ok(false);
            };
            if node.is_leaf() {
                let crosses = next_key.is_some_and(|k: u32| (k as u64) < hi);
                return Ok(crosses || node.len() + 2 > cap);
            }
            child = Inner::pick_child(&node, lblk, &mut next_key);
        }
        Ok(false)
    }

    /// The pass before mapping file blocks `[lo, hi)` of `ino` (write-back
    /// of its dirty pages): the inode, the tree blocks of the range (of the
    /// whole tree if a hole or unwritten extent there is to be mapped and the
    /// change may not fit its leaf), and the block bitmap the first hole's
    /// blocks would come from.
    pub(crate) fn warm_map(&mut self, ino: u32, lo: u64, hi: u64) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        self.warm_inode(ino)?;
        let i = self.read_inode(ino)?;
        self.warm_tree(ino, &i, lo, hi)?;
        let segs = self.ext_segments(ino, &i, lo, hi)?;
        if segs.iter().any(|s| s.2.is_none_or(|m| m.unwritten))
            && self.tree_may_rebuild(ino, &i, lo, hi)?
        {
            // A change that does not fit its leaf rebuilds the tree from all
            // of its blocks (`ext_slow_op`), and its new nodes are allocated
            // near the data (a conversion's: the unwritten extent's blocks).
            self.warm_tree(ino, &i, 0, 1 << 32)?;
        }
        // A conversion that splits an unwritten extent may need a new tree
        // node (a full in-inode root too), allocated near its data.
        if let Some(m) = segs.iter().find_map(|s| s.2.filter(|m| m.unwritten)) {
            self.warm_block_alloc(m.pblk)?;
        }
        // Each hole is allocated from a goal of its own (after the extent
        // before it, or the small-file stream): the first ALLOC_GROUPS
        // holes' goals.
        let holes = segs.iter().filter(|s| s.2.is_none());
        for &(l, n, _) in holes.take(ALLOC_GROUPS as usize) {
            self.warm_data_alloc(ino, &i, l, n)?;
        }
        Ok(())
    }

    /// The groups an allocation of `n` data blocks for file block `lblk` of
    /// `ino` comes from (`alloc_goal`). Small files' allocations all start
    /// from the stream's goal and follow one another: the groups warmed
    /// hold what the pass predicted from it so far.
    fn warm_data_alloc(&mut self, ino: u32, i: &Inode, lblk: u64, n: u64) -> Result<()> {
        let want = n.min(u32::MAX as u64) as u32;
        let (goal, small) = self.alloc_goal(ino, i, lblk.min(u32::MAX as u64) as u32, want)?;
        let n = if small {
            self.warm_stream_want += n;
            self.warm_stream_want
        } else {
            n
        };
        self.warm_block_alloc_n(goal, n)
    }

    /// The pass before a zeroed range frees the whole blocks `[lo, hi)` of
    /// `ino` and maps them again (unwritten extents): the groups the new
    /// blocks come from, by the rule the allocation follows (`alloc_goal`:
    /// for a small file the stream, which need not be where they were freed).
    pub(crate) fn warm_realloc(&mut self, ino: u32, lo: u64, hi: u64) -> Result<()> {
        if !self.deferring() || hi <= lo || lo > u32::MAX as u64 {
            return Ok(());
        }
        let i = self.read_inode(ino)?;
        self.warm_data_alloc(ino, &i, lo, hi - lo)
    }

    /// The pass before freeing `ino`'s blocks from file block `from` on
    /// (truncate, the last unlink or close): the inode, the tree blocks of
    /// that range and the bitmaps of the groups its blocks are in. `evict`:
    /// the inode itself goes too (its group's inode bitmap, its xattr block);
    /// [`Evict::Orphan`]: it is on the orphan list (an unlinked file's last
    /// close), whose member linking to it changes.
    pub(crate) fn warm_free(&mut self, ino: u32, from: u64, evict: Evict) -> Result<()> {
        self.warm_free_range(ino, from, u32::MAX as u64 + 1, evict)
    }

    /// The blocks allocating in or freeing from group `g` changes: its
    /// descriptor block and its block bitmap (unless still uninitialised:
    /// that one is made, not read).
    fn group_block_reads(&self, g: u32) -> Vec<u64> {
        let Some(gd) = self.gds.get(g as usize) else {
            return Vec::new();
        };
        let mut v = vec![self.gd_block(g)];
        if !gd.has_flag(BG_BLOCK_UNINIT) {
            v.push(gd.block_bitmap);
        }
        v
    }

    /// What `free_blocks` of block `blk` changes ([`Self::group_block_reads`]).
    fn free_blocks_reads(&self, blk: u64) -> Vec<u64> {
        self.group_block_reads(self.block_group(blk))
    }

    /// [`Self::warm_free`] of file blocks `[from, to)` only (a punched
    /// range).
    pub(crate) fn warm_free_range(
        &mut self,
        ino: u32,
        from: u64,
        to: u64,
        evict: Evict,
    ) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        self.warm_inode(ino)?;
        let i = self.read_inode(ino)?;
        let mut bitmaps = BTreeSet::new();
        if evict != Evict::No {
            let g = self.inode_group(ino);
            if let Some(gd) = self.gds.get(g as usize) {
                bitmaps.insert(gd.inode_bitmap);
                bitmaps.insert(self.gd_block(g));
            }
            if i.file_acl != 0 && i.file_acl < self.sb.blocks_count() {
                // The xattr block, and what freeing it (its last user) changes.
                bitmaps.insert(i.file_acl);
                bitmaps.extend(self.free_blocks_reads(i.file_acl));
            }
        }
        let tree = NodeRef::parse_root(&i.block, ino).is_ok();
        if tree && (i.size > 0 || i.blocks_512(self.bs) > 0) {
            // Removing extents rebuilds the tree from all its blocks
            // (`ext_slow_op`) when a leaf is cut short or emptied.
            self.warm_tree(ino, &i, 0, 1 << 32)?;
            // The bitmaps of the first FREE_SCAN extents freed.
            let mut l = from.min(u32::MAX as u64) as u32;
            for _ in 0..FREE_SCAN {
                if l as u64 >= to {
                    break;
                }
                let m = match self.ext_map(ino, &i, l)? {
                    Some(m) => m,
                    None => match self.ext_next_mapped(ino, &i, l)? {
                        Some(n) if n > l => {
                            l = n;
                            continue;
                        }
                        _ => break,
                    },
                };
                let (first, last) = (m.pblk, m.pblk + m.len.max(1) as u64 - 1);
                for g in self.block_group(first)..=self.block_group(last) {
                    bitmaps.extend(self.group_block_reads(g));
                }
                match l.checked_add(m.len.max(1)) {
                    Some(n) => l = n,
                    None => break,
                }
            }
        }
        self.warm_all(bitmaps)?;
        if evict == Evict::Orphan {
            self.warm_orphan_pred(ino)?;
        }
        Ok(())
    }

    /// The member of the orphan list that links to `ino` (`orphan_pred`'s
    /// walk, at most [`ORPHAN_WALK`] members; a longer list is walked under
    /// the lock).
    fn warm_orphan_pred(&mut self, ino: u32) -> Result<()> {
        let mut cur = self.sb.last_orphan();
        for _ in 0..ORPHAN_WALK {
            if cur == 0 || cur == ino {
                return Ok(());
            }
            let Ok(i) = unless_miss(self.read_inode(cur))? else {
                return Ok(());
            };
            if i.dtime == ino {
                // Its dtime changes.
                let _ = unless_miss(self.warm_inode(cur))?;
                return Ok(());
            }
            cur = i.dtime;
        }
        Ok(())
    }

    /// The pass before mapping the dirty pages of `inos` (a commit's or a
    /// fast commit's cut, a file's write-back): [`Self::warm_map`] of each
    /// run of a file's consecutive dirty pages (its first [`CUT_RUNS`]), the
    /// misses of all of them reported together.
    pub(crate) fn warm_cut(&mut self, inos: &[u32]) -> Result<()> {
        let Some(pc) = self.pc.clone() else {
            return Ok(());
        };
        if !self.deferring() {
            return Ok(());
        }
        let mut missing = Vec::new();
        'files: for &ino in inos {
            for (lo, hi) in pc.dirty_runs(ino, CUT_RUNS) {
                if let Err(FsError::MetadataMiss(b)) = self.warm_map(ino, lo, hi) {
                    missing.extend(b);
                    if missing.len() >= WARM_BATCH {
                        break 'files;
                    }
                }
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            missing.sort_unstable();
            missing.dedup();
            Err(FsError::MetadataMiss(missing))
        }
    }

    /// The pass before changing `ino`'s xattrs: the inode and its xattr
    /// block, or the bitmap a new xattr block would come from.
    pub(crate) fn warm_xattr(&mut self, ino: u32) -> Result<()> {
        if !self.deferring() {
            return Ok(());
        }
        self.warm_inode(ino)?;
        let i = self.read_inode(ino)?;
        if i.file_acl != 0 && i.file_acl < self.sb.blocks_count() {
            // A change may move the xattrs to a new block (a shared block is
            // copied, a grown set moves) and free the old one.
            let mut blks = vec![i.file_acl];
            blks.extend(self.free_blocks_reads(i.file_acl));
            self.warm_all(blks)?;
        }
        self.warm_block_alloc(self.inode_goal(ino))
    }
}

/// Block groups whose bitmaps one allocation's warm pass reads at most
/// ([`Inner::warm_block_alloc_n`]).
const ALLOC_GROUPS: u32 = 16;

/// Child blocks of index node `node` whose key range meets `[lo, hi)` (none
/// for a leaf).
fn children_in(node: &NodeRef<'_>, lo: u64, hi: u64) -> Vec<u64> {
    if node.is_leaf() {
        return Vec::new();
    }
    let n = node.len();
    (0..n)
        .filter_map(|k| {
            let x = node.index(k)?;
            let start = if k == 0 { 0 } else { x.lblk as u64 };
            let end = node.entry_lblk(k + 1).map_or(1 << 32, |e| e as u64);
            (start < hi && end > lo).then_some(x.child)
        })
        .collect()
}

/// [`Inner`]'s lock taken by `lock` (`None`: give up) for an operation whose
/// warm pass `warm` runs first with misses deferred, reading what it misses
/// without the lock, as `Fs::lock_warm` does, for the commit thread's cut
/// (which holds no `Fs`). A read error ends the warming: the operation then
/// reads under the lock and reports it there.
pub(crate) fn lock_warm_with<'a>(
    mut lock: impl FnMut() -> Option<parking_lot::MutexGuard<'a, Inner>>,
    mut warm: impl FnMut(&mut Inner) -> Result<()>,
) -> Option<parking_lot::MutexGuard<'a, Inner>> {
    let mut pins = Vec::new();
    for _ in 0..crate::READ_RETRIES {
        let mut g = lock()?;
        let r = {
            let _d = g.defer_pass();
            warm(&mut g)
        };
        let Err(FsError::MetadataMiss(blks)) = r else {
            return Some(g);
        };
        if pins.len() + blks.len() > crate::PIN_BUDGET {
            return Some(g);
        }
        let j = g.journal.clone();
        drop(g);
        for b in blks {
            match j.bread(b) {
                Ok(buf) => pins.push(buf),
                Err(_) => return unwarmed(&mut lock),
            }
        }
    }
    unwarmed(&mut lock)
}

/// The lock after warming gave up: no pass of this hold pruned, so the
/// operation prunes as it would without one (`Inner::warm_pruned`).
fn unwarmed<'a>(
    lock: &mut impl FnMut() -> Option<parking_lot::MutexGuard<'a, Inner>>,
) -> Option<parking_lot::MutexGuard<'a, Inner>> {
    let mut g = lock()?;
    g.warm_pruned = false;
    Some(g)
}
