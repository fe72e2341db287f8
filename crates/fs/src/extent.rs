//! Extent tree operations (ext4-format.md §5).
//!
//! i_blocks rule (the contract between this module and its callers): extent *tree*
//! blocks are charged/uncharged here (`ext_insert` charges a new tree block,
//! `ext_remove` uncharges freed tree blocks); *data* blocks are charged by the caller
//! that allocated them and uncharged by the caller of `ext_remove`, using its
//! return value (the number of data blocks freed). Data blocks are allocated by the
//! caller (`alloc_blocks`) and freed here (`free_blocks`) when unmapped.
//!
//! Every method takes the inode *copy* (`inode`) and, for modifications, changes
//! only that copy's `block` (the root) and `i_blocks`; the caller writes the inode.
//!
//! Design. Lookups walk root to leaf, verifying each node (checksum, depth,
//! order). Modifications take one of two paths:
//! * fast path: the change touches one leaf, keeps it non-empty and within
//!   capacity, and does not add e2fsck slack (§5.3) — the leaf and, if its first
//!   key moved, the ancestors' keys are rewritten. This covers appends, merges,
//!   trims and inserts into leaves with room.
//! * slow path: the whole tree is loaded ([`MemTree`]), changed, then re-shaped:
//!   empty nodes dropped, overflowing nodes split (§5.4) or their entries shifted to
//!   the nearest siblings with room, sparse levels folded, the root grown or
//!   collapsed, so that e2fsck never finds the tree "could be narrower/shorter"
//!   (checked by emulating its rule, with a full balanced repack as a safety net).
//!   New blocks are allocated before anything is written, so ENOSPC leaves the tree
//!   untouched; only changed nodes are written; freed tree blocks are uncharged.
//!   Keeping every level within one block of slack means a random insert into a
//!   packed tree may rewrite a run of sibling leaves (cost O(leaves) at worst).
//!
//! Journal credits: a fast-path change dirties at most depth + 1 tree blocks; a
//! slow-path change may dirty every block of the tree (plus bitmaps/descriptors
//! for the blocks it allocates or frees).

use std::collections::{HashMap, HashSet};

use commitfs_format::extent::{self as fx, Entries, Extent, ExtentIdx, ExtentNode, NodeRef};
use commitfs_format::inode::Inode;
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::Inner;

/// One mapped piece of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub lblk: u32,
    pub pblk: u64,
    pub len: u32,
    pub unwritten: bool,
}

impl From<Extent> for Mapping {
    fn from(e: Extent) -> Self {
        Mapping {
            lblk: e.lblk,
            pblk: e.pblk,
            len: e.len,
            unwritten: e.unwritten,
        }
    }
}

/// Result of descending to the leaf responsible for a logical block.
struct LeafHit {
    /// The extent covering the block, if any.
    cover: Option<Extent>,
    /// First extent of the leaf starting after the block, if any.
    next_in_leaf: Option<u32>,
    /// Start of the next subtree to the right (smallest following index key on the
    /// path): the next mapped block when the leaf has nothing after `lblk`.
    next_key: Option<u32>,
}

impl Inner {
    /// Check that an extent's physical range lies inside the file system.
    fn check_extent_range(&self, ino: u32, e: &Extent) -> Result<()> {
        if e.pblk < self.sb.first_data_block() as u64 || e.pend() > self.sb.blocks_count() {
            return Err(FsError::corrupt(format!(
                "inode {ino}: extent at lblk {} maps blocks {}+{} outside the file system",
                e.lblk, e.pblk, e.len
            )));
        }
        Ok(())
    }

    /// Descend from the root to the leaf responsible for `lblk` (§5.4 lookup),
    /// verifying every node on the way.
    fn ext_find_leaf(&mut self, ino: u32, inode: &Inode, lblk: u32) -> Result<LeafHit> {
        let root = NodeRef::parse_root(&inode.block, ino)?;
        let mut next_key: Option<u32> = None;
        let mut depth = root.depth();
        if root.is_leaf() {
            return self.leaf_hit(ino, &root, lblk, next_key);
        }
        let mut child = Self::pick_child(&root, lblk, &mut next_key);
        loop {
            depth -= 1;
            let buf = self.read_meta(child)?;
            let data = buf.data();
            let node =
                NodeRef::parse_block(&data, child, Some(depth), &self.csum, ino, inode.generation)?;
            if node.is_leaf() {
                return self.leaf_hit(ino, &node, lblk, next_key);
            }
            child = Self::pick_child(&node, lblk, &mut next_key);
        }
    }

    /// Index entry to follow for `lblk`: the last one starting at or before it (or
    /// the first). Records the following key as the start of the next subtree.
    pub(crate) fn pick_child(node: &NodeRef<'_>, lblk: u32, next_key: &mut Option<u32>) -> u64 {
        let i = node.search(lblk).unwrap_or(0);
        if let Some(k) = node.entry_lblk(i + 1) {
            *next_key = Some(next_key.map_or(k, |n| n.min(k)));
        }
        // Index nodes are validated non-empty, so entry `i` exists.
        node.index(i).map_or(0, |x| x.child)
    }

    fn leaf_hit(
        &self,
        ino: u32,
        leaf: &NodeRef<'_>,
        lblk: u32,
        next_key: Option<u32>,
    ) -> Result<LeafHit> {
        let (cover, next_pos) = match leaf.search(lblk) {
            Some(i) => {
                let e = leaf
                    .extent(i)
                    .ok_or_else(|| FsError::corrupt("extent leaf"))?;
                if e.map(lblk).is_some() {
                    self.check_extent_range(ino, &e)?;
                    (Some(e), i + 1)
                } else {
                    (None, i + 1)
                }
            }
            None => (None, 0),
        };
        Ok(LeafHit {
            cover,
            next_in_leaf: leaf.entry_lblk(next_pos),
            next_key,
        })
    }

    /// The extent piece covering `lblk` (from `lblk` to the end of its extent), or
    /// `None` for a hole.
    /// File blocks `[lo, hi)` of `ino` (`hi` at most 2^32) as consecutive
    /// segments `(lblk, len, mapping)`: mapped runs (`Some`, clipped to the span)
    /// and the holes between them (`None`).
    pub fn ext_segments(
        &mut self,
        ino: u32,
        inode: &Inode,
        lo: u64,
        hi: u64,
    ) -> Result<Vec<(u64, u64, Option<Mapping>)>> {
        let hi = hi.min(1u64 << 32);
        let mut out = Vec::new();
        let mut l = lo;
        while l < hi {
            let lb = l as u32;
            let (len, m) = match self.ext_map(ino, inode, lb)? {
                Some(m) => ((m.len as u64).min(hi - l).max(1), Some(m)),
                None => {
                    let next = self
                        .ext_next_mapped(ino, inode, lb)?
                        .map(|n| n as u64)
                        .unwrap_or(hi)
                        .min(hi)
                        .max(l + 1);
                    (next - l, None)
                }
            };
            out.push((l, len, m));
            l += len;
        }
        Ok(out)
    }

    pub fn ext_map(&mut self, ino: u32, inode: &Inode, lblk: u32) -> Result<Option<Mapping>> {
        let hit = self.ext_find_leaf(ino, inode, lblk)?;
        Ok(hit.cover.map(|e| {
            let skip = lblk - e.lblk;
            Mapping {
                lblk,
                pblk: e.pblk + skip as u64,
                len: e.len - skip,
                unwritten: e.unwritten,
            }
        }))
    }

    /// First mapped logical block >= `lblk`.
    pub fn ext_next_mapped(&mut self, ino: u32, inode: &Inode, lblk: u32) -> Result<Option<u32>> {
        let mut at = lblk;
        // Each round either answers or moves to a strictly larger subtree start
        // (more than one only past empty leaves); the bound guards against loops.
        for _ in 0..4096 {
            let hit = self.ext_find_leaf(ino, inode, at)?;
            if hit.cover.is_some() {
                return Ok(Some(at));
            }
            if let Some(n) = hit.next_in_leaf {
                return Ok(Some(n));
            }
            match hit.next_key {
                Some(k) if k > at => at = k,
                Some(_) => {
                    return Err(FsError::corrupt(format!(
                        "inode {ino}: extent index keys do not advance at {at}"
                    )))
                }
                None => return Ok(None),
            }
        }
        Err(FsError::corrupt(format!(
            "inode {ino}: extent tree walk for {lblk} does not terminate"
        )))
    }

    /// All leaf extents in order.
    pub fn ext_list(&mut self, ino: u32, inode: &Inode) -> Result<Vec<Mapping>> {
        let root = NodeRef::parse_root(&inode.block, ino)?;
        let mut out = Vec::new();
        if root.is_leaf() {
            for e in root.extents() {
                self.check_extent_range(ino, &e)?;
                out.push(e.into());
            }
            return Ok(out);
        }
        // Depth-first with an explicit stack of (block, depth, lower key bound).
        let mut stack: Vec<(u64, u16, u32)> = root
            .indexes()
            .map(|x| (x.child, root.depth() - 1, x.lblk))
            .collect();
        stack.reverse();
        let mut seen = HashSet::new();
        while let Some((blk, depth, key)) = stack.pop() {
            let buf = self.read_meta(blk)?;
            let data = buf.data();
            let node =
                NodeRef::parse_block(&data, blk, Some(depth), &self.csum, ino, inode.generation)?;
            if !seen.insert(blk) {
                return Err(FsError::corrupt(format!(
                    "inode {ino}: extent tree block {blk} referenced twice"
                )));
            }
            check_index_key(ino, key, node.entry_lblk(0), blk)?;
            if node.is_leaf() {
                for e in node.extents() {
                    self.check_extent_range(ino, &e)?;
                    if out
                        .last()
                        .is_some_and(|p: &Mapping| p.lblk as u64 + p.len as u64 > e.lblk as u64)
                    {
                        return Err(FsError::corrupt(format!(
                            "inode {ino}: extents out of order in block {blk}"
                        )));
                    }
                    out.push(e.into());
                }
            } else {
                let start = stack.len();
                stack.extend(node.indexes().map(|x| (x.child, depth - 1, x.lblk)));
                stack[start..].reverse();
            }
        }
        Ok(out)
    }

    /// Map a range that is currently a hole (merging with contiguous neighbours of the
    /// same state, §5.4). New tree blocks are allocated near `pblk` and charged to
    /// `inode`. On error (also ENOSPC for a tree block) nothing has changed on disk
    /// or in `inode`. Caller writes the inode afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn ext_insert(
        &mut self,
        h: &Handle,
        ino: u32,
        inode: &mut Inode,
        lblk: u32,
        pblk: u64,
        len: u32,
        unwritten: bool,
    ) -> Result<()> {
        if len == 0 {
            return Err(FsError::Invalid("extent insert of zero length"));
        }
        let end = lblk as u64 + len as u64;
        if end > fx::LBLK_SPACE_END {
            return Err(FsError::FileTooBig);
        }
        if pblk < self.sb.first_data_block() as u64 || pblk + len as u64 > self.sb.blocks_count() {
            return Err(FsError::Invalid(
                "extent insert of blocks outside the file system",
            ));
        }
        let fast = self.ext_fast_op(h, ino, inode, lblk, end, |v| {
            list_insert(v, lblk, pblk, len, unwritten)
        })?;
        if let Some(r) = fast {
            return r;
        }
        self.ext_slow_op(
            h,
            ino,
            inode,
            TreeOp::Insert(Extent {
                lblk,
                len,
                pblk,
                unwritten,
            }),
            pblk,
        )?;
        Ok(())
    }

    /// Unmap `[start, end)` (`end` exclusive, up to 2^32), freeing data blocks and
    /// tree blocks that become empty (tree blocks are uncharged from `inode`). Returns
    /// the number of data blocks freed, which the caller uncharges. Caller writes the
    /// inode afterwards.
    pub fn ext_remove(
        &mut self,
        h: &Handle,
        ino: u32,
        inode: &mut Inode,
        start: u32,
        end: u64,
    ) -> Result<u64> {
        let end = end.min(fx::LBLK_SPACE_END);
        if start as u64 >= end {
            return Ok(0);
        }
        let fast = self.ext_fast_op(h, ino, inode, start, end, |v| {
            Ok(list_remove(v, start, end))
        })?;
        let freed = match fast {
            Some(r) => r?,
            None => {
                let goal = self.tree_goal(ino, inode, start)?;
                self.ext_slow_op(h, ino, inode, TreeOp::Remove(start, end), goal)?
            }
        };
        self.free_runs(h, freed)
    }

    /// Mark `[lblk, lblk+len)` written where it lies inside unwritten extents
    /// (splitting them; writes into fallocated space). Parts of the range that are
    /// holes or already written are left alone. Caller writes the inode afterwards.
    pub fn ext_convert_written(
        &mut self,
        h: &Handle,
        ino: u32,
        inode: &mut Inode,
        lblk: u32,
        len: u32,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let end = (lblk as u64 + len as u64).min(fx::LBLK_SPACE_END);
        let fast = self.ext_fast_op(h, ino, inode, lblk, end, |v| {
            list_convert(v, lblk, end);
            Ok(())
        })?;
        if let Some(r) = fast {
            return r;
        }
        let goal = self.tree_goal(ino, inode, lblk)?;
        self.ext_slow_op(h, ino, inode, TreeOp::Convert(lblk, end), goal)?;
        Ok(())
    }

    /// Allocation goal for tree blocks of an operation at `lblk`: the data block
    /// mapped there (or the nearest one before it), else the inode's group.
    fn tree_goal(&mut self, ino: u32, inode: &Inode, lblk: u32) -> Result<u64> {
        if let Some(m) = self.ext_map(ino, inode, lblk)? {
            return Ok(m.pblk);
        }
        if let Some(n) = self.ext_next_mapped(ino, inode, lblk)? {
            if let Some(m) = self.ext_map(ino, inode, n)? {
                return Ok(m.pblk);
            }
        }
        Ok(self.inode_goal(ino))
    }

    /// Free data runs (coalescing physically adjacent ones); returns the block count.
    fn free_runs(&mut self, h: &Handle, mut runs: Vec<(u64, u32)>) -> Result<u64> {
        runs.sort_unstable();
        let mut total = 0u64;
        let mut cur: Option<(u64, u64)> = None;
        for (p, l) in runs {
            total += l as u64;
            cur = match cur {
                Some((cp, cl)) if cp + cl == p => Some((cp, cl + l as u64)),
                Some((cp, cl)) => {
                    self.free_blocks(h, cp, cl)?;
                    Some((p, l as u64))
                }
                None => Some((p, l as u64)),
            };
        }
        if let Some((cp, cl)) = cur {
            self.free_blocks(h, cp, cl)?;
        }
        Ok(total)
    }

    // ---- fast path: one leaf, no change of shape ----------------------------------

    /// Apply `op` to the leaf responsible for `[start, end)` when the whole range
    /// lies in that leaf and the result keeps the tree's shape: the leaf stays
    /// non-empty and within capacity, and its e2fsck slack (§5.3) does not grow.
    /// Returns `None` (nothing done) when the slow path must run instead. `op` runs
    /// on a copy; an `Err` from it is returned as `Some(Err)` with nothing changed.
    fn ext_fast_op<R>(
        &mut self,
        h: &Handle,
        ino: u32,
        inode: &mut Inode,
        start: u32,
        end: u64,
        op: impl FnOnce(&mut Vec<Extent>) -> Result<R>,
    ) -> Result<Option<Result<R>>> {
        let mut path = self.ext_load_path(ino, inode, start)?;
        if let Some(k) = path.next_key {
            if end > k as u64 {
                return Ok(None);
            }
        }
        let depth = path.nodes.len() - 1;
        let leaf = &path.nodes[depth];
        let Entries::Leaf(old) = &leaf.node.entries else {
            return Err(FsError::corrupt(format!(
                "inode {ino}: extent path does not end in a leaf"
            )));
        };
        let mut v = old.clone();
        let r = match op(&mut v) {
            Ok(r) => r,
            Err(e) => return Ok(Some(Err(e))),
        };
        if v == *old {
            return Ok(Some(Ok(r)));
        }
        if depth == 0 {
            if v.len() > fx::ROOT_CAPACITY as usize {
                return Ok(None);
            }
        } else {
            let cap = fx::block_capacity(self.bs) as usize;
            if v.is_empty() || v.len() > cap || eff_slack(v.len(), cap) > eff_slack(old.len(), cap)
            {
                return Ok(None);
            }
        }
        let first_changed = v.first().map(|e| e.lblk) != old.first().map(|e| e.lblk);
        path.nodes[depth].node.entries = Entries::Leaf(v);
        let mut dirty = vec![depth];
        if first_changed && depth > 0 {
            // Keep every ancestor's index key equal to its child's first key (§5.3).
            let mut key = path.nodes[depth].node.first_lblk().unwrap_or(0);
            for d in (0..depth).rev() {
                let pos = path.nodes[d].pos;
                let Entries::Index(ix) = &mut path.nodes[d].node.entries else {
                    break;
                };
                if ix[pos].lblk == key {
                    break;
                }
                ix[pos].lblk = key;
                dirty.push(d);
                if pos != 0 {
                    break;
                }
                key = ix[0].lblk;
            }
        }
        // Validate everything before the first write, so that a failure leaves the
        // tree untouched.
        for &d in &dirty {
            let n = &path.nodes[d];
            match n.blk {
                None => n.node.validate_root(ino)?,
                Some(b) => n.node.validate_block(b, self.bs)?,
            }
        }
        for &d in &dirty {
            let n = &path.nodes[d];
            match n.blk {
                None => n.node.write_root(&mut inode.block, ino)?,
                Some(b) => self.write_tree_block(h, ino, inode.generation, b, &n.node, false)?,
            }
        }
        Ok(Some(Ok(r)))
    }

    /// Root-to-leaf path for `lblk`, with the start of the next subtree.
    fn ext_load_path(&mut self, ino: u32, inode: &Inode, lblk: u32) -> Result<Path> {
        let root = NodeRef::parse_root(&inode.block, ino)?;
        let mut nodes = Vec::with_capacity(root.depth() as usize + 1);
        let mut next_key = None;
        let mut node = root.to_node();
        let mut blk = None;
        loop {
            let pos = match &node.entries {
                Entries::Leaf(_) => 0,
                Entries::Index(ix) => {
                    let i = ix.partition_point(|x| x.lblk <= lblk).saturating_sub(1);
                    if let Some(x) = ix.get(i + 1) {
                        next_key = Some(next_key.map_or(x.lblk, |k: u32| k.min(x.lblk)));
                    }
                    i
                }
            };
            let child = match &node.entries {
                Entries::Index(ix) => ix.get(pos).map(|x| (x.lblk, x.child)),
                Entries::Leaf(_) => None,
            };
            let depth = node.depth;
            nodes.push(PathNode { blk, node, pos });
            let Some((key, c)) = child else {
                break;
            };
            let child_node = self.read_tree_block(ino, inode.generation, c, depth - 1)?;
            check_index_key(ino, key, child_node.first_lblk(), c)?;
            node = child_node;
            blk = Some(c);
        }
        Ok(Path { nodes, next_key })
    }

    /// Read, verify and decode one tree block.
    fn read_tree_block(
        &self,
        ino: u32,
        generation: u32,
        blk: u64,
        depth: u16,
    ) -> Result<ExtentNode> {
        if blk < self.sb.first_data_block() as u64 {
            return Err(FsError::corrupt(format!(
                "inode {ino}: extent tree block {blk} out of range"
            )));
        }
        let buf = self.read_meta(blk)?;
        let data = buf.data();
        let node = NodeRef::parse_block(&data, blk, Some(depth), &self.csum, ino, generation)?;
        if node.is_leaf() {
            for e in node.extents() {
                self.check_extent_range(ino, &e)?;
            }
        }
        Ok(node.to_node())
    }

    /// Serialise `node` into tree block `blk` (with its tail checksum).
    fn write_tree_block(
        &self,
        h: &Handle,
        ino: u32,
        generation: u32,
        blk: u64,
        node: &ExtentNode,
        fresh: bool,
    ) -> Result<()> {
        let csum = self.csum;
        let f = |d: &mut [u8]| node.write_block(d, blk, &csum, ino, generation);
        let r = if fresh {
            self.new_meta(h, blk, f)?
        } else {
            self.modify_meta(h, blk, f)?
        };
        Ok(r?)
    }

    // ---- slow path: whole tree in memory ------------------------------------------

    /// Load the whole tree, apply `op`, restore the shape rules (capacity, §5.3
    /// compactness, ei_block keys, depth), allocate what is missing, then write the
    /// changed nodes and free the dropped ones. Returns freed data runs (not yet
    /// freed: the caller frees them once the tree no longer references them).
    fn ext_slow_op(
        &mut self,
        h: &Handle,
        ino: u32,
        inode: &mut Inode,
        op: TreeOp,
        goal: u64,
    ) -> Result<Vec<(u64, u32)>> {
        let (mut tree, orig) = self.load_tree(ino, inode)?;
        let freed = tree.apply(op)?;
        tree.normalize()?;
        if !tree.shape_ok() {
            tracing::debug!("inode {ino}: extent tree repacked for e2fsck compactness");
            tree.full_repack();
        }
        // Allocate blocks for new nodes; on failure give them back, nothing written.
        let mut fresh: Vec<u64> = Vec::new();
        for l in 1..tree.levels.len() {
            for i in 0..tree.levels[l].len() {
                if tree.levels[l][i].blk.is_some() {
                    continue;
                }
                // Near the data (like the kernel's ext4_ext_find_goal), after any
                // tree block already taken for this operation.
                let hint = fresh.last().map_or(goal, |&b| b + 1);
                match self.alloc_blocks(h, hint, 1) {
                    Ok((b, _)) => {
                        tree.levels[l][i].blk = Some(b);
                        fresh.push(b);
                    }
                    Err(e) => {
                        for b in fresh {
                            let _ = self.free_blocks(h, b, 1);
                        }
                        return Err(e);
                    }
                }
            }
        }
        let nodes = tree.materialize();
        // Validate all nodes before writing any.
        for (blk, node) in &nodes {
            let r = match blk {
                None => node.validate_root(ino),
                Some(b) => node.validate_block(*b, self.bs),
            };
            if let Err(e) = r {
                for b in fresh {
                    let _ = self.free_blocks(h, b, 1);
                }
                return Err(e.into());
            }
        }
        for (blk, node) in &nodes {
            match blk {
                None => node.write_root(&mut inode.block, ino)?,
                Some(b) => {
                    let is_fresh = fresh.contains(b);
                    if !is_fresh && orig.get(b) == Some(node) {
                        continue;
                    }
                    self.write_tree_block(h, ino, inode.generation, *b, node, is_fresh)?;
                }
            }
        }
        let unit = self.bs as u64 / 512;
        let spare = std::mem::take(&mut tree.spare);
        for &b in &spare {
            self.free_blocks(h, b, 1)?;
        }
        let blocks = (inode.blocks_512(self.bs) + fresh.len() as u64 * unit)
            .saturating_sub(spare.len() as u64 * unit);
        inode.set_blocks_512(blocks, self.bs);
        Ok(freed)
    }

    /// Read every node of the tree (verifying checksums, depths, keys and global
    /// order). Returns the tree and the decoded original of every tree block.
    fn load_tree(
        &mut self,
        ino: u32,
        inode: &Inode,
    ) -> Result<(MemTree, HashMap<u64, ExtentNode>)> {
        let root = NodeRef::parse_root(&inode.block, ino)?.to_node();
        let cap = fx::block_capacity(self.bs) as usize;
        let mut orig = HashMap::new();
        let mut levels = Vec::with_capacity(root.depth as usize + 1);
        let mut idx: Vec<ExtentIdx> = Vec::new();
        let root_depth = root.depth;
        match root.entries {
            Entries::Leaf(v) => {
                for e in &v {
                    self.check_extent_range(ino, e)?;
                }
                levels.push(vec![MNode::leaf(None, v)]);
            }
            Entries::Index(ix) => {
                levels.push(vec![MNode::index(None, ix.len())]);
                idx = ix;
            }
        }
        let mut seen = HashSet::new();
        for d in (0..root_depth).rev() {
            let mut level = Vec::with_capacity(idx.len());
            let mut next_idx = Vec::new();
            for x in &idx {
                if !seen.insert(x.child) {
                    return Err(FsError::corrupt(format!(
                        "inode {ino}: extent tree block {} referenced twice",
                        x.child
                    )));
                }
                let node = self.read_tree_block(ino, inode.generation, x.child, d)?;
                check_index_key(ino, x.lblk, node.first_lblk(), x.child)?;
                match &node.entries {
                    Entries::Leaf(v) => level.push(MNode::leaf(Some(x.child), v.clone())),
                    Entries::Index(ix) => {
                        level.push(MNode::index(Some(x.child), ix.len()));
                        next_idx.extend_from_slice(ix);
                    }
                }
                orig.insert(x.child, node);
            }
            levels.push(level);
            idx = next_idx;
        }
        // Leaves must be in global order without overlap.
        let mut prev_end = 0u64;
        for e in levels
            .last()
            .into_iter()
            .flatten()
            .flat_map(|n| n.exts.iter())
        {
            if (e.lblk as u64) < prev_end {
                return Err(FsError::corrupt(format!(
                    "inode {ino}: extents out of order at logical block {}",
                    e.lblk
                )));
            }
            prev_end = e.end();
        }
        Ok((
            MemTree {
                levels,
                cap,
                spare: Vec::new(),
            },
            orig,
        ))
    }
}

/// A child's entries must not start before its index key. We write keys equal to
/// the child's first key (§5.3) and rewrite any other key when the parent is next
/// written; reading accepts smaller keys (lookups stay correct) and empty leaves.
fn check_index_key(ino: u32, key: u32, first: Option<u32>, blk: u64) -> Result<()> {
    match first {
        Some(f) if f < key => Err(FsError::corrupt(format!(
            "inode {ino}: extent block {blk} starts at {f}, before its index key {key}"
        ))),
        _ => Ok(()),
    }
}

// ---- in-memory structures ---------------------------------------------------------

/// A tree modification for the slow path.
#[derive(Debug, Clone, Copy)]
enum TreeOp {
    Insert(Extent),
    /// Unmap `[start, end)`.
    Remove(u32, u64),
    /// Mark `[start, end)` written.
    Convert(u32, u64),
}

/// One node on a root-to-leaf path.
struct PathNode {
    /// `None` for the root in `i_block`.
    blk: Option<u64>,
    node: ExtentNode,
    /// Index entry followed (index nodes only).
    pos: usize,
}

struct Path {
    nodes: Vec<PathNode>,
    /// Start of the subtree right of the leaf (first mapped block after it).
    next_key: Option<u32>,
}

/// e2fsck's free-slot count of a non-root node (§5.3): a node that is not full is
/// counted with one slot less than its capacity.
fn eff_slack(size: usize, cap: usize) -> usize {
    if size >= cap {
        0
    } else {
        cap - 1 - size
    }
}

/// `total` split into `k` sizes differing by at most one.
fn balanced(total: usize, k: usize) -> Vec<usize> {
    if k == 0 {
        return Vec::new();
    }
    let (q, r) = (total / k, total % k);
    (0..k).map(|i| q + usize::from(i < r)).collect()
}

/// `total` split into `k` sizes, all full but the last (appending keeps nodes full).
fn left_packed(total: usize, k: usize, cap: usize) -> Vec<usize> {
    let mut v = Vec::with_capacity(k);
    let mut left = total;
    for _ in 0..k {
        let s = left.min(cap);
        v.push(s);
        left -= s;
    }
    v
}

/// A node of [`MemTree`]. Index nodes only record how many consecutive nodes of the
/// next level are their children; keys and child pointers are derived when the
/// tree is written, so regrouping never has to patch them.
#[derive(Debug, Clone)]
struct MNode {
    /// Tree block; `None` for the root, or for a new node not yet allocated.
    blk: Option<u64>,
    /// Number of children (index levels).
    n: usize,
    /// Extents (leaf level).
    exts: Vec<Extent>,
}

impl MNode {
    fn leaf(blk: Option<u64>, exts: Vec<Extent>) -> Self {
        MNode { blk, n: 0, exts }
    }
    fn index(blk: Option<u64>, n: usize) -> Self {
        MNode {
            blk,
            n,
            exts: Vec::new(),
        }
    }
}

/// A whole extent tree as levels of nodes: `levels[0]` is the root (one node), the
/// last level holds the leaves. The children of level `l` (in order) are exactly
/// the nodes of level `l + 1`.
struct MemTree {
    levels: Vec<Vec<MNode>>,
    /// Entries per tree block.
    cap: usize,
    /// Blocks of dropped nodes: reused for new nodes, the rest freed at the end.
    spare: Vec<u64>,
}

impl MemTree {
    fn depth(&self) -> usize {
        self.levels.len() - 1
    }

    fn size(&self, l: usize, i: usize) -> usize {
        let n = &self.levels[l][i];
        if l == self.depth() {
            n.exts.len()
        } else {
            n.n
        }
    }

    fn sizes(&self, l: usize) -> Vec<usize> {
        (0..self.levels[l].len()).map(|i| self.size(l, i)).collect()
    }

    /// Parent position of every node of level `l >= 1`.
    fn parents(&self, l: usize) -> Vec<usize> {
        let mut p = Vec::with_capacity(self.levels[l].len());
        for (i, n) in self.levels[l - 1].iter().enumerate() {
            p.extend(std::iter::repeat_n(i, n.n));
        }
        p
    }

    /// Replace nodes `a..=b` of level `l >= 1` by nodes with the given sizes holding
    /// the same entries in order. Blocks are reused in order (then spare blocks);
    /// new node `k` goes to the parent of old node `min(a + k, b)`.
    fn replace_range(&mut self, l: usize, a: usize, b: usize, sizes: &[usize]) {
        let leaf = l == self.depth();
        let parents = self.parents(l);
        let old: Vec<MNode> = self.levels[l].drain(a..=b).collect();
        let all: Vec<Extent> = if leaf {
            old.iter().flat_map(|n| n.exts.iter().copied()).collect()
        } else {
            Vec::new()
        };
        let mut new_nodes = Vec::with_capacity(sizes.len());
        let mut off = 0;
        for (k, &sz) in sizes.iter().enumerate() {
            let blk = old.get(k).and_then(|n| n.blk).or_else(|| self.spare.pop());
            new_nodes.push(if leaf {
                MNode::leaf(blk, all[off..off + sz].to_vec())
            } else {
                MNode::index(blk, sz)
            });
            off += sz;
        }
        for n in old.iter().skip(sizes.len()) {
            if let Some(b) = n.blk {
                self.spare.push(b);
            }
        }
        for &p in &parents[a..=b] {
            self.levels[l - 1][p].n -= 1;
        }
        for k in 0..sizes.len() {
            let p = parents[(a + k).min(b)];
            self.levels[l - 1][p].n += 1;
        }
        self.levels[l].splice(a..a, new_nodes);
    }

    /// Restore the rules at level `l >= 1`: no empty node, none over capacity, and
    /// at most one block's worth of e2fsck slack (§5.3 "could be narrower").
    fn normalize_level(&mut self, l: usize) {
        let cap = self.cap;
        let mut i = 0;
        while i < self.levels[l].len() {
            if self.size(l, i) == 0 {
                self.replace_range(l, i, i, &[]);
            } else {
                i += 1;
            }
        }
        while let Some(i) = (0..self.levels[l].len()).find(|&i| self.size(l, i) > cap) {
            let sizes = self.sizes(l);
            let sz = sizes[i];
            let k = sz.div_ceil(cap);
            let pieces = if i + 1 == sizes.len() {
                left_packed(sz, k, cap)
            } else {
                balanced(sz, k)
            };
            let others = sizes.iter().enumerate().filter(|&(j, _)| j != i);
            let f_other: usize = others.clone().map(|(_, &s)| eff_slack(s, cap)).sum();
            let room_other: usize = others.map(|(_, &s)| cap.saturating_sub(s)).sum();
            let f_split = f_other + pieces.iter().map(|&s| eff_slack(s, cap)).sum::<usize>();
            let excess = sz - cap;
            if f_split <= cap || room_other < excess {
                // Split (§5.4 step 3); the slack it adds stays within the budget.
                self.replace_range(l, i, i, &pieces);
                continue;
            }
            // Shift entries toward the nearest nodes with room instead.
            let (mut a, mut b, mut room) = (i, i, 0);
            while room < excess {
                let left = (0..a).rev().find(|&j| sizes[j] < cap);
                let right = (b + 1..sizes.len()).find(|&j| sizes[j] < cap);
                let pick_left = match (left, right) {
                    (Some(x), Some(y)) => i - x <= y - i,
                    (Some(_), None) => true,
                    (None, Some(_)) => false,
                    (None, None) => break,
                };
                if pick_left {
                    a = left.unwrap_or(a);
                    room += cap - sizes[a];
                } else {
                    b = right.unwrap_or(b);
                    room += cap - sizes[b];
                }
            }
            let total: usize = sizes[a..=b].iter().sum();
            let count = (b - a + 1).max(total.div_ceil(cap));
            self.replace_range(l, a, b, &balanced(total, count));
        }
        // Too much slack: fold the emptiest node into its neighbours.
        loop {
            let sizes = self.sizes(l);
            let f: usize = sizes.iter().map(|&s| eff_slack(s, cap)).sum();
            if f <= cap || sizes.len() < 2 {
                break;
            }
            let m = (0..sizes.len()).min_by_key(|&j| sizes[j]).unwrap_or(0);
            let (mut a, mut b, mut total) = (m, m, sizes[m]);
            while total > (b - a) * cap {
                let left = a.checked_sub(1).map(|j| sizes[j]);
                let right = sizes.get(b + 1).copied();
                match (left, right) {
                    (Some(x), Some(y)) if x <= y => {
                        a -= 1;
                        total += x;
                    }
                    (_, Some(y)) => {
                        b += 1;
                        total += y;
                    }
                    (Some(x), None) => {
                        a -= 1;
                        total += x;
                    }
                    (None, None) => break,
                }
            }
            if total > (b - a) * cap {
                break;
            }
            self.replace_range(l, a, b, &balanced(total, b - a));
        }
    }

    /// Bring the whole tree back to shape: every level, then the root (grow when
    /// it overflows, §5.4 step 4; collapse levels that fit in the root, §5.3).
    fn normalize(&mut self) -> Result<()> {
        let root_cap = fx::ROOT_CAPACITY as usize;
        for _ in 0..64 {
            for l in (1..self.levels.len()).rev() {
                self.normalize_level(l);
            }
            if self.size(0, 0) > root_cap {
                if self.depth() >= fx::MAX_DEPTH as usize {
                    return Err(FsError::FileTooBig);
                }
                let blk = self.spare.pop();
                let leaf_root = self.levels.len() == 1;
                let root = &mut self.levels[0][0];
                let node = if leaf_root {
                    MNode::leaf(blk, std::mem::take(&mut root.exts))
                } else {
                    MNode::index(blk, root.n)
                };
                root.n = 1;
                self.levels.insert(1, vec![node]);
                continue;
            }
            if self.depth() >= 1 {
                let s1: usize = (0..self.levels[1].len()).map(|i| self.size(1, i)).sum();
                if s1 <= root_cap {
                    let level1 = self.levels.remove(1);
                    let leaf = self.levels.len() == 1;
                    let root = &mut self.levels[0][0];
                    root.n = 0;
                    for n in level1 {
                        if leaf {
                            root.exts.extend(n.exts);
                        } else {
                            root.n += n.n;
                        }
                        if let Some(b) = n.blk {
                            self.spare.push(b);
                        }
                    }
                    continue;
                }
            }
            return Ok(());
        }
        Err(FsError::corrupt(
            "extent tree normalisation does not converge",
        ))
    }

    /// What e2fsck's pass 1 decides about this tree's shape (§5.3): false if it
    /// would print "could be narrower" or "could be shorter".
    fn shape_ok(&self) -> bool {
        let depth = self.depth();
        let cap = self.cap;
        let mut num = vec![0usize; depth + 1];
        let mut max = vec![0usize; depth + 1];
        num[0] = self.size(0, 0);
        max[0] = fx::ROOT_CAPACITY as usize;
        for l in 1..=depth {
            for i in 0..self.levels[l].len() {
                let s = self.size(l, i);
                num[l] += s;
                max[l] += cap - usize::from(s < cap);
            }
        }
        for i in 0..=depth {
            if max[i].saturating_sub(num[i]) > cap {
                return false;
            }
            if (0..i).any(|j| num[i] < max[j]) {
                return false;
            }
        }
        true
    }

    /// Rebuild the tree from its extents as a balanced, minimal-depth tree, reusing
    /// its blocks (the safety net behind [`MemTree::normalize`]).
    fn full_repack(&mut self) {
        let depth = self.depth();
        let exts: Vec<Extent> = self.levels[depth]
            .iter_mut()
            .flat_map(|n| std::mem::take(&mut n.exts))
            .collect();
        let mut blks: Vec<u64> = self
            .levels
            .iter()
            .skip(1)
            .flatten()
            .filter_map(|n| n.blk)
            .collect();
        blks.append(&mut self.spare);
        blks.reverse();
        let root_cap = fx::ROOT_CAPACITY as usize;
        if exts.len() <= root_cap {
            self.levels = vec![vec![MNode::leaf(None, exts)]];
            self.spare = blks;
            return;
        }
        let cap = self.cap;
        let mut lv: Vec<Vec<MNode>> = Vec::new();
        let k = exts.len().div_ceil(cap);
        let mut off = 0;
        let mut leaves = Vec::with_capacity(k);
        for s in balanced(exts.len(), k) {
            leaves.push(MNode::leaf(None, exts[off..off + s].to_vec()));
            off += s;
        }
        lv.push(leaves);
        let mut count = k;
        while count > root_cap {
            let k2 = count.div_ceil(cap);
            lv.push(
                balanced(count, k2)
                    .into_iter()
                    .map(|s| MNode::index(None, s))
                    .collect(),
            );
            count = k2;
        }
        lv.push(vec![MNode::index(None, count)]);
        lv.reverse();
        for n in lv.iter_mut().skip(1).flatten() {
            n.blk = blks.pop();
        }
        self.levels = lv;
        self.spare = blks;
    }

    /// Apply a modification to the leaves (shape is restored by `normalize`).
    /// Returns the data runs no longer mapped.
    fn apply(&mut self, op: TreeOp) -> Result<Vec<(u64, u32)>> {
        let d = self.depth();
        let leaves = &mut self.levels[d];
        let leaf_for = |leaves: &[MNode], lblk: u32| {
            leaves
                .partition_point(|n| n.exts.first().is_none_or(|x| x.lblk <= lblk))
                .saturating_sub(1)
        };
        match op {
            TreeOp::Insert(e) => {
                let li = leaf_for(leaves, e.lblk);
                if let Some(next) = leaves.get(li + 1).and_then(|n| n.exts.first()) {
                    if e.end() > next.lblk as u64 {
                        return Err(FsError::Invalid("extent insert over a mapped block"));
                    }
                }
                list_insert(&mut leaves[li].exts, e.lblk, e.pblk, e.len, e.unwritten)?;
                merge_across(leaves, li);
                Ok(Vec::new())
            }
            TreeOp::Remove(start, end) => {
                let first = leaf_for(leaves, start);
                let mut freed = Vec::new();
                for n in leaves[first..].iter_mut() {
                    if n.exts.first().is_some_and(|x| x.lblk as u64 >= end) {
                        break;
                    }
                    freed.extend(list_remove(&mut n.exts, start, end));
                }
                Ok(freed)
            }
            TreeOp::Convert(start, end) => {
                let first = leaf_for(leaves, start);
                let mut last = first;
                for (j, n) in leaves.iter_mut().enumerate().skip(first) {
                    if n.exts.first().is_some_and(|x| x.lblk as u64 >= end) {
                        break;
                    }
                    list_convert(&mut n.exts, start, end);
                    last = j;
                }
                for j in (first.saturating_sub(1)..=last).rev() {
                    merge_across(leaves, j);
                }
                Ok(Vec::new())
            }
        }
    }

    /// The on-disk form of every node: (block or `None` for the root, node), with
    /// index keys equal to the first key of each child subtree (§5.3).
    fn materialize(&self) -> Vec<(Option<u64>, ExtentNode)> {
        let depth = self.depth();
        let mut keys: Vec<Vec<u32>> = vec![Vec::new(); depth + 1];
        keys[depth] = self.levels[depth]
            .iter()
            .map(|n| n.exts.first().map_or(0, |e| e.lblk))
            .collect();
        for l in (0..depth).rev() {
            let mut c = 0;
            let mut k = Vec::with_capacity(self.levels[l].len());
            for n in &self.levels[l] {
                k.push(keys[l + 1].get(c).copied().unwrap_or(0));
                c += n.n;
            }
            keys[l] = k;
        }
        let mut out = Vec::new();
        for l in 0..=depth {
            let mut c = 0;
            for n in &self.levels[l] {
                let node = if l == depth {
                    ExtentNode::leaf(n.exts.clone())
                } else {
                    let ix = (c..c + n.n)
                        .map(|j| ExtentIdx {
                            lblk: keys[l + 1].get(j).copied().unwrap_or(0),
                            child: self.levels[l + 1].get(j).and_then(|x| x.blk).unwrap_or(0),
                        })
                        .collect();
                    ExtentNode::index((depth - l) as u16, ix)
                };
                c += n.n;
                out.push((if l == 0 { None } else { n.blk }, node));
            }
        }
        out
    }
}

/// Merge the last extent of leaf `j` with the first of leaf `j + 1` when possible.
fn merge_across(leaves: &mut [MNode], j: usize) {
    if j + 1 >= leaves.len() {
        return;
    }
    let (l, r) = leaves.split_at_mut(j + 1);
    if let (Some(a), Some(b)) = (l[j].exts.last_mut(), r[0].exts.first()) {
        if a.can_merge(b) {
            a.len += b.len;
            r[0].exts.remove(0);
        }
    }
}

// ---- operations on a sorted extent list (one leaf, or a whole flattened tree) ----

/// Insert the mapping `lblk..lblk+len -> pblk` into a sorted, non-overlapping list,
/// merging with neighbours (§5.4 step 1) and splitting runs longer than §5.2 allows.
fn list_insert(v: &mut Vec<Extent>, lblk: u32, pblk: u64, len: u32, unwritten: bool) -> Result<()> {
    if len == 0 {
        return Err(FsError::Invalid("extent insert of zero length"));
    }
    let end = lblk as u64 + len as u64;
    if end > fx::LBLK_SPACE_END || pblk + len as u64 > fx::PBLK_LIMIT {
        return Err(FsError::Invalid("extent insert beyond the address space"));
    }
    let pos = v.partition_point(|e| e.lblk <= lblk);
    if pos > 0 && v[pos - 1].end() > lblk as u64 {
        return Err(FsError::Invalid("extent insert over a mapped block"));
    }
    if pos < v.len() && (v[pos].lblk as u64) < end {
        return Err(FsError::Invalid("extent insert over a mapped block"));
    }
    let max = fx::max_len(unwritten);
    let mut at = pos;
    let mut off = 0u32;
    while off < len {
        let piece = (len - off).min(max);
        let e = Extent {
            lblk: lblk + off,
            len: piece,
            pblk: pblk + off as u64,
            unwritten,
        };
        if at > 0 && v[at - 1].can_merge(&e) {
            v[at - 1].len += e.len;
        } else if at < v.len() && e.can_merge(&v[at]) {
            let r = &mut v[at];
            r.lblk = e.lblk;
            r.pblk = e.pblk;
            r.len += e.len;
            at += 1;
        } else {
            v.insert(at, e);
            at += 1;
        }
        off += piece;
    }
    // A piece may have closed the gap between two neighbours.
    merge_around(v, pos.saturating_sub(1), at + 1);
    Ok(())
}

/// Merge mergeable neighbours among `v[from..to]` (bounds clamped).
fn merge_around(v: &mut Vec<Extent>, from: usize, to: usize) {
    let mut i = from;
    let mut to = to.min(v.len());
    while i + 1 < to {
        if v[i].can_merge(&v[i + 1]) {
            v[i].len += v[i + 1].len;
            v.remove(i + 1);
            to -= 1;
        } else {
            i += 1;
        }
    }
}

/// Unmap `[start, end)` from the list. Returns the freed physical runs.
fn list_remove(v: &mut Vec<Extent>, start: u32, end: u64) -> Vec<(u64, u32)> {
    let mut freed = Vec::new();
    let s = start as u64;
    let mut i = v.partition_point(|e| e.end() <= s);
    while i < v.len() && (v[i].lblk as u64) < end {
        let e = v[i];
        let cut_lo = s.max(e.lblk as u64);
        let cut_hi = end.min(e.end());
        let skip = (cut_lo - e.lblk as u64) as u32;
        let n = (cut_hi - cut_lo) as u32;
        freed.push((e.pblk + skip as u64, n));
        let head = skip;
        let tail = (e.end() - cut_hi) as u32;
        match (head > 0, tail > 0) {
            (false, false) => {
                v.remove(i);
            }
            (true, false) => {
                v[i].len = head;
                i += 1;
            }
            (false, true) => {
                let d = e.len - tail;
                v[i] = Extent {
                    lblk: e.lblk + d,
                    len: tail,
                    pblk: e.pblk + d as u64,
                    unwritten: e.unwritten,
                };
                i += 1;
            }
            (true, true) => {
                v[i].len = head;
                let d = e.len - tail;
                v.insert(
                    i + 1,
                    Extent {
                        lblk: e.lblk + d,
                        len: tail,
                        pblk: e.pblk + d as u64,
                        unwritten: e.unwritten,
                    },
                );
                i += 2;
            }
        }
    }
    freed
}

/// Mark `[lblk, lblk+len)` written where it lies in unwritten extents, splitting
/// them, then merge what became mergeable.
fn list_convert(v: &mut Vec<Extent>, lblk: u32, end: u64) {
    let s = lblk as u64;
    let first = v.partition_point(|e| e.end() <= s);
    let mut i = first;
    while i < v.len() && (v[i].lblk as u64) < end {
        let e = v[i];
        if !e.unwritten {
            i += 1;
            continue;
        }
        let lo = s.max(e.lblk as u64);
        let hi = end.min(e.end());
        let head = (lo - e.lblk as u64) as u32;
        let mid = (hi - lo) as u32;
        let tail = e.len - head - mid;
        let mut pieces = Vec::with_capacity(3);
        if head > 0 {
            pieces.push(Extent { len: head, ..e });
        }
        pieces.push(Extent {
            lblk: e.lblk + head,
            len: mid,
            pblk: e.pblk + head as u64,
            unwritten: false,
        });
        if tail > 0 {
            pieces.push(Extent {
                lblk: e.lblk + head + mid,
                len: tail,
                pblk: e.pblk + (head + mid) as u64,
                unwritten: true,
            });
        }
        let n = pieces.len();
        v.splice(i..i + 1, pieces);
        i += n;
    }
    merge_around(v, first.saturating_sub(1), i + 1);
}

#[cfg(test)]
mod list_tests {
    use super::*;

    fn e(lblk: u32, len: u32, pblk: u64, unwritten: bool) -> Extent {
        Extent {
            lblk,
            len,
            pblk,
            unwritten,
        }
    }

    #[test]
    fn insert_merges_and_splits() {
        let mut v = vec![];
        list_insert(&mut v, 10, 100, 5, false).unwrap();
        list_insert(&mut v, 15, 105, 5, false).unwrap();
        assert_eq!(v, vec![e(10, 10, 100, false)]);
        list_insert(&mut v, 5, 95, 5, false).unwrap();
        assert_eq!(v, vec![e(5, 15, 95, false)]);
        list_insert(&mut v, 30, 120, 5, false).unwrap();
        list_insert(&mut v, 20, 110, 10, false).unwrap();
        assert_eq!(v, vec![e(5, 30, 95, false)]);
        assert!(list_insert(&mut v, 34, 1, 1, false).is_err());
        assert!(list_insert(&mut v, 0, 1, 6, false).is_err());
        // Long runs are split at the §5.2 limit.
        let mut w = vec![];
        list_insert(&mut w, 0, 1000, 70000, true).unwrap();
        assert_eq!(w.len(), 3);
        assert!(w.iter().all(|x| x.len <= 32767 && x.unwritten));
        assert_eq!(w.iter().map(|x| x.len).sum::<u32>(), 70000);
    }

    #[test]
    fn remove_trims_and_splits() {
        let mut v = vec![e(0, 10, 100, false), e(20, 10, 200, true)];
        let f = list_remove(&mut v, 3, 25);
        assert_eq!(f, vec![(103, 7), (200, 5)]);
        assert_eq!(v, vec![e(0, 3, 100, false), e(25, 5, 205, true)]);
        let f = list_remove(&mut v, 26, 27);
        assert_eq!(f, vec![(206, 1)]);
        assert_eq!(
            v,
            vec![
                e(0, 3, 100, false),
                e(25, 1, 205, true),
                e(27, 3, 207, true)
            ]
        );
        let f = list_remove(&mut v, 0, 1 << 32);
        assert_eq!(f.iter().map(|x| x.1).sum::<u32>(), 7);
        assert!(v.is_empty());
    }

    #[test]
    fn convert_splits_and_merges() {
        let mut v = vec![e(0, 4, 100, false), e(4, 10, 104, true)];
        list_convert(&mut v, 6, 8);
        assert_eq!(
            v,
            vec![
                e(0, 4, 100, false),
                e(4, 2, 104, true),
                e(6, 2, 106, false),
                e(8, 6, 108, true)
            ]
        );
        list_convert(&mut v, 4, 6);
        assert_eq!(v, vec![e(0, 8, 100, false), e(8, 6, 108, true)]);
        list_convert(&mut v, 8, 14);
        assert_eq!(v, vec![e(0, 14, 100, false)]);
    }
}

#[cfg(test)]
mod tree_tests {
    //! Randomised insert/remove/convert sequences on real mkfs.ext4 images, checked
    //! against a model after every step, then judged by `e2fsck -fn` and by the
    //! kernel reading the file through a loop mount.

    use super::*;
    use crate::testutil::{self, TempImage};
    use crate::types::MountOptions;
    use commitfs_device::{DeviceRef, FileDevice};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;
    use std::path::PathBuf;
    use std::process::Command;
    use std::sync::Arc;

    /// Kernel loop mount, unmounted (and its loop device detached) on drop.
    struct KernelMount {
        dir: PathBuf,
        mounted: bool,
    }

    impl KernelMount {
        fn new(img: &std::path::Path, read_only: bool) -> Self {
            let dir = img.with_extension("mnt");
            std::fs::create_dir_all(&dir).unwrap();
            let mut m = KernelMount {
                dir,
                mounted: false,
            };
            let out = Command::new("mount")
                .args(["-o", if read_only { "loop,ro" } else { "loop" }])
                .arg(img)
                .arg(&m.dir)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "mount: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            m.mounted = true;
            m
        }
    }

    impl Drop for KernelMount {
        fn drop(&mut self) {
            if self.mounted {
                let _ = Command::new("umount").arg("-d").arg(&self.dir).status();
            }
            let _ = std::fs::remove_dir(&self.dir);
        }
    }

    /// Block content written for logical block `lblk`.
    fn pattern(lblk: u32, bs: usize) -> Vec<u8> {
        let mut b = vec![0u8; bs];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (lblk as usize).wrapping_mul(31).wrapping_add(i * 7) as u8 ^ (i >> 8) as u8;
        }
        b[..4].copy_from_slice(&lblk.to_le_bytes());
        b
    }

    struct Harness {
        img: TempImage,
        inner: Option<Inner>,
        ino: u32,
        /// lblk -> (pblk, unwritten)
        model: BTreeMap<u32, (u64, bool)>,
        rng: StdRng,
        bs: usize,
        max_depth_seen: usize,
    }

    impl Harness {
        fn new(tag: &str, size_mib: u64, seed: u64) -> Self {
            Self::with_block_size(tag, size_mib, seed, 1024)
        }

        /// Fresh image with an empty regular file `/file` (inode 12) from debugfs.
        fn with_block_size(tag: &str, size_mib: u64, seed: u64, bs: usize) -> Self {
            let img = testutil::mkfs(tag, size_mib, &["-b", &bs.to_string()]);
            let out = Command::new("debugfs")
                .args(["-w", "-R", "write /dev/null file"])
                .arg(&img.path)
                .output()
                .unwrap();
            assert!(out.status.success());
            let mut hs = Self::open(img, seed);
            // A random generation so that the checksum seed is exercised (the file
            // has no tree blocks yet, so nothing else depends on it).
            let ino = hs.ino;
            let inner = hs.inner();
            let mut i = inner.read_inode(ino).unwrap();
            assert!(i.is_reg() && i.has_flag(commitfs_format::inode::FL_EXTENTS));
            i.generation = 0x5EED_0000 ^ seed as u32;
            let h = inner.start(4).unwrap();
            inner.write_inode(&h, ino, &i).unwrap();
            inner.stop(h).unwrap();
            hs
        }

        /// `/file` written by the kernel: every other block of `nblocks` (one extent
        /// each, so a deep tree on 1 KiB blocks), then an fallocated range.
        fn from_kernel(tag: &str, size_mib: u64, seed: u64, nblocks: u32) -> Self {
            let img = testutil::mkfs(tag, size_mib, &["-b", "1024"]);
            {
                let m = KernelMount::new(&img.path, false);
                let path = m.dir.join("file");
                let mut f = std::fs::File::create(&path).unwrap();
                use std::io::{Seek, SeekFrom, Write};
                for k in (0..nblocks).step_by(2) {
                    f.seek(SeekFrom::Start(k as u64 * 1024)).unwrap();
                    f.write_all(&pattern(k, 1024)).unwrap();
                }
                f.sync_all().unwrap();
                drop(f);
                let out = Command::new("fallocate")
                    .args([
                        "-o",
                        &(nblocks as u64 * 1024 + 4096).to_string(),
                        "-l",
                        "40960",
                    ])
                    .arg(&path)
                    .output()
                    .unwrap();
                assert!(out.status.success());
            }
            let mut hs = Self::open(img, seed);
            let ino = hs.ino;
            let inner = hs.inner();
            let i = inner.read_inode(ino).unwrap();
            let list = inner.ext_list(ino, &i).unwrap();
            for m in list {
                for k in 0..m.len {
                    hs.model
                        .insert(m.lblk + k, (m.pblk + k as u64, m.unwritten));
                }
            }
            hs
        }

        fn open(img: TempImage, seed: u64) -> Self {
            let dev: DeviceRef = Arc::new(FileDevice::open(&img.path, false).unwrap());
            let inner = Inner::mount(dev, MountOptions::default()).unwrap();
            let bs = inner.bs;
            Harness {
                img,
                inner: Some(inner),
                ino: 12,
                model: BTreeMap::new(),
                rng: StdRng::seed_from_u64(seed),
                bs,
                max_depth_seen: 0,
            }
        }

        /// Unmount and mount again (the tree must read back the same).
        fn remount(&mut self) {
            let mut inner = self.inner.take().unwrap();
            inner.unmount().unwrap();
            drop(inner);
            let dev: DeviceRef = Arc::new(FileDevice::open(&self.img.path, false).unwrap());
            self.inner = Some(Inner::mount(dev, MountOptions::default()).unwrap());
        }

        fn inner(&mut self) -> &mut Inner {
            self.inner.as_mut().unwrap()
        }

        fn unit(&self) -> u64 {
            self.bs as u64 / 512
        }

        /// Length of the hole starting at `lblk` (0 if mapped), capped at `max`.
        fn hole_len(&self, lblk: u32, max: u32) -> u32 {
            if self.model.contains_key(&lblk) {
                return 0;
            }
            match self.model.range(lblk..).next() {
                Some((&k, _)) => (k - lblk).min(max),
                None => max,
            }
        }

        /// Allocate and map `len` blocks at `lblk` (must be a hole), writing data.
        fn insert(&mut self, lblk: u32, len: u32, unwritten: bool, goal: u64) -> Result<()> {
            let ino = self.ino;
            let bs = self.bs;
            let unit = self.unit();
            let inner = self.inner.as_mut().unwrap();
            let mut i = inner.read_inode(ino)?;
            let h = inner.start(64)?;
            let (p, n) = inner.alloc_blocks(&h, goal, len)?;
            for k in 0..n {
                // Unwritten blocks get garbage that must never be read back.
                let data = if unwritten {
                    vec![0xEE; bs]
                } else {
                    pattern(lblk + k, bs)
                };
                inner.write_data(p + k as u64, &data)?;
            }
            if let Err(e) = inner.ext_insert(&h, ino, &mut i, lblk, p, n, unwritten) {
                inner.free_blocks(&h, p, n as u64)?;
                inner.stop(h)?;
                return Err(e);
            }
            let b = i.blocks_512(bs) + n as u64 * unit;
            i.set_blocks_512(b, bs);
            inner.write_inode(&h, ino, &i)?;
            inner.stop(h)?;
            for k in 0..n {
                self.model.insert(lblk + k, (p + k as u64, unwritten));
            }
            Ok(())
        }

        fn remove(&mut self, start: u32, end: u64) {
            let ino = self.ino;
            let bs = self.bs;
            let unit = self.unit();
            let inner = self.inner.as_mut().unwrap();
            let mut i = inner.read_inode(ino).unwrap();
            let h = inner.start(64).unwrap();
            let freed = inner.ext_remove(&h, ino, &mut i, start, end).unwrap();
            let b = i.blocks_512(bs) - freed * unit;
            i.set_blocks_512(b, bs);
            inner.write_inode(&h, ino, &i).unwrap();
            inner.stop(h).unwrap();
            let keys: Vec<u32> = self
                .model
                .range(start..)
                .take_while(|(&k, _)| (k as u64) < end)
                .map(|(&k, _)| k)
                .collect();
            assert_eq!(
                freed,
                keys.len() as u64,
                "blocks freed by remove({start}, {end})"
            );
            for k in keys {
                self.model.remove(&k);
            }
        }

        fn convert(&mut self, lblk: u32, len: u32) {
            let ino = self.ino;
            let bs = self.bs;
            let targets: Vec<(u32, u64)> = self
                .model
                .range(lblk..lblk + len)
                .filter(|(_, &(_, u))| u)
                .map(|(&k, &(p, _))| (k, p))
                .collect();
            let inner = self.inner.as_mut().unwrap();
            for &(k, p) in &targets {
                inner.write_data(p, &pattern(k, bs)).unwrap();
            }
            let mut i = inner.read_inode(ino).unwrap();
            let h = inner.start(64).unwrap();
            inner
                .ext_convert_written(&h, ino, &mut i, lblk, len)
                .unwrap();
            inner.write_inode(&h, ino, &i).unwrap();
            inner.stop(h).unwrap();
            for (k, _) in targets {
                self.model.get_mut(&k).unwrap().1 = false;
            }
        }

        /// Compare the tree with the model; check shape, i_blocks, lookups.
        fn check(&mut self) {
            let ino = self.ino;
            let unit = self.unit();
            let bs = self.bs;
            let inner = self.inner.as_mut().unwrap();
            let i = inner.read_inode(ino).unwrap();
            let list = inner.ext_list(ino, &i).unwrap();
            let mut got = BTreeMap::new();
            for m in &list {
                assert!(m.len >= 1 && m.len <= fx::max_len(m.unwritten));
                for k in 0..m.len {
                    got.insert(m.lblk + k, (m.pblk + k as u64, m.unwritten));
                }
            }
            assert_eq!(got, self.model, "extent list differs from the model");
            // No two adjacent extents that should have been merged inside a leaf is
            // not required; but extents must be sorted and disjoint.
            for w in list.windows(2) {
                assert!(w[0].lblk as u64 + w[0].len as u64 <= w[1].lblk as u64);
            }
            let (tree, _) = inner.load_tree(ino, &i).unwrap();
            assert!(
                tree.shape_ok(),
                "tree shape would make e2fsck complain: {:?}",
                tree_shape(&tree)
            );
            let tree_blocks: usize = tree.levels.iter().skip(1).map(|l| l.len()).sum();
            assert_eq!(
                i.blocks_512(bs),
                (self.model.len() + tree_blocks) as u64 * unit,
                "i_blocks"
            );
            self.max_depth_seen = self.max_depth_seen.max(tree.depth());
            // Point lookups.
            let top = self.model.keys().next_back().copied().unwrap_or(0) + 3;
            for _ in 0..20 {
                let q = self.rng.gen_range(0..=top);
                let m = inner.ext_map(ino, &i, q).unwrap();
                match self.model.get(&q) {
                    Some(&(p, u)) => {
                        let m = m.expect("mapped block reported as hole");
                        assert_eq!((m.lblk, m.pblk, m.unwritten), (q, p, u));
                        for k in 0..m.len {
                            assert_eq!(self.model.get(&(q + k)), Some(&(p + k as u64, u)));
                        }
                    }
                    None => assert_eq!(m, None),
                }
                let next = inner.ext_next_mapped(ino, &i, q).unwrap();
                assert_eq!(next, self.model.range(q..).next().map(|(&k, _)| k));
            }
        }

        /// Set i_size, unmount, run e2fsck -fn and compare the kernel's view.
        fn finish(mut self) {
            let ino = self.ino;
            let bs = self.bs;
            let size = self
                .model
                .keys()
                .next_back()
                .map_or(0, |&k| (k as u64 + 1) * bs as u64);
            let inner = self.inner.as_mut().unwrap();
            let mut i = inner.read_inode(ino).unwrap();
            i.size = size;
            let h = inner.start(2).unwrap();
            inner.write_inode(&h, ino, &i).unwrap();
            inner.stop(h).unwrap();
            let mut inner = self.inner.take().unwrap();
            inner.unmount().unwrap();
            drop(inner);
            let r = testutil::fsck(&self.img.path);
            assert!(
                r.is_clean(),
                "e2fsck -fn reported problems (exit {}):\n{}",
                r.code,
                r.output
            );
            let m = KernelMount::new(&self.img.path, true);
            let data = std::fs::read(m.dir.join("file")).unwrap();
            assert_eq!(data.len() as u64, size);
            for (n, blk) in data.chunks(bs).enumerate() {
                let want = match self.model.get(&(n as u32)) {
                    Some(&(_, false)) => pattern(n as u32, bs),
                    _ => vec![0u8; bs],
                };
                assert!(
                    blk == want.as_slice(),
                    "kernel reads different bytes in block {n}"
                );
            }
        }
    }

    fn tree_shape(t: &MemTree) -> Vec<Vec<usize>> {
        (0..t.levels.len()).map(|l| t.sizes(l)).collect()
    }

    fn seed() -> u64 {
        std::env::var("COMMITFS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0xC0FFEE)
    }

    /// Random insert of a short run into a hole of `[0, span)`.
    fn random_insert(hs: &mut Harness, span: u32, p_contig: f64) {
        for _ in 0..100 {
            let lblk = hs.rng.gen_range(0..span);
            let want = hs.rng.gen_range(1..=3);
            let len = hs.hole_len(lblk, want);
            if len == 0 {
                continue;
            }
            let unwritten = hs.rng.gen_bool(0.2);
            let blocks = hs.inner().sb.blocks_count();
            let goal = match hs.model.get(&lblk.wrapping_sub(1)) {
                Some(&(p, _)) if hs.rng.gen_bool(p_contig) => p + 1,
                _ => hs.rng.gen_range(0..blocks),
            };
            hs.insert(lblk, len, unwritten, goal).unwrap();
            return;
        }
    }

    /// `n` random inserts, removes (short, sometimes long) and conversions in
    /// `[0, span)`, checking against the model every `every` steps.
    fn random_mix(hs: &mut Harness, span: u32, n: usize, every: usize) {
        for k in 0..n {
            match hs.rng.gen_range(0..10) {
                0..=4 => random_insert(hs, span, 0.3),
                5..=7 => {
                    let s = hs.rng.gen_range(0..span);
                    let len = if hs.rng.gen_bool(0.05) {
                        hs.rng.gen_range(50..600)
                    } else {
                        hs.rng.gen_range(1..6)
                    };
                    hs.remove(s, s as u64 + len);
                }
                _ => {
                    let s = hs.rng.gen_range(0..span);
                    let len = hs.rng.gen_range(1..8);
                    hs.convert(s, len);
                }
            }
            if k % every == 0 {
                hs.check();
            }
        }
        hs.check();
    }

    #[test]
    fn random_ops_depth2_match_model_fsck_and_kernel() {
        for round in 0..2u64 {
            let mut hs = Harness::new("ext-rand", 64, seed() + round);
            let span = 9000;
            // Grow to thousands of extents (depth 2 on 1 KiB blocks).
            for n in 0..3000 {
                random_insert(&mut hs, span, 0.1);
                if n % 50 == 0 {
                    hs.check();
                }
            }
            hs.check();
            assert!(
                hs.max_depth_seen >= 2,
                "depth {} reached",
                hs.max_depth_seen
            );
            random_mix(&mut hs, span, 3000, 25);
            hs.remount();
            random_mix(&mut hs, span, 500, 25);
            hs.finish();
        }
    }

    #[test]
    fn random_ops_4k_blocks() {
        let mut hs = Harness::with_block_size("ext-rand4k", 64, seed() ^ 5, 4096);
        let span = 6000;
        for n in 0..2500 {
            random_insert(&mut hs, span, 0.1);
            if n % 50 == 0 {
                hs.check();
            }
        }
        hs.check();
        assert!(
            hs.max_depth_seen >= 2,
            "depth {} reached",
            hs.max_depth_seen
        );
        random_mix(&mut hs, span, 2000, 25);
        hs.finish();
    }

    #[test]
    fn kernel_made_tree_is_modified_cleanly() {
        let mut hs = Harness::from_kernel("ext-kern", 64, seed() ^ 6, 3000);
        hs.check();
        assert!(
            hs.max_depth_seen >= 2,
            "kernel tree depth {}",
            hs.max_depth_seen
        );
        assert!(
            hs.model.values().any(|&(_, u)| u),
            "no unwritten extent from fallocate"
        );
        random_mix(&mut hs, 3200, 1500, 25);
        hs.finish();
    }

    #[test]
    fn shrinking_tree_collapses_back_to_the_root() {
        let mut hs = Harness::new("ext-shrink", 32, seed() ^ 1);
        for n in 0..1200u32 {
            // Every other block: one extent each, appended in order.
            let blocks = hs.inner().sb.blocks_count();
            let goal = hs.rng.gen_range(0..blocks);
            hs.insert(n * 2, 1, n % 7 == 0, goal).unwrap();
        }
        hs.check();
        assert!(hs.max_depth_seen >= 2);
        // Punch from random places until little is left; every step must stay tidy.
        while hs.model.len() > 3 {
            let keys: Vec<u32> = hs.model.keys().copied().collect();
            let k = keys[hs.rng.gen_range(0..keys.len())];
            let len = hs.rng.gen_range(1..40);
            hs.remove(k, k as u64 + len);
            hs.check();
        }
        let ino = hs.ino;
        let i = hs.inner().read_inode(ino).unwrap();
        assert_eq!(NodeRef::parse_root(&i.block, ino).unwrap().depth(), 0);
        hs.finish();
    }

    #[test]
    fn depth3_by_appends_then_random_punches() {
        let mut hs = Harness::new("ext-deep", 64, seed() ^ 2);
        // > 4 * 84 leaves of 84 extents -> depth 3 on 1 KiB blocks.
        let n = 4 * 84 * 84 + 200;
        for k in 0..n as u32 {
            let prev = k
                .checked_sub(1)
                .and_then(|j| hs.model.get(&(j * 2)).copied());
            let goal = prev.map_or(20000, |(p, _)| p + 2);
            hs.insert(k * 2, 1, false, goal).unwrap();
            if k % 5000 == 0 {
                hs.check();
            }
        }
        hs.check();
        assert!(hs.max_depth_seen >= 3, "depth {}", hs.max_depth_seen);
        for r in 0..300 {
            let s = hs.rng.gen_range(0..2 * n as u32);
            if hs.rng.gen_bool(0.5) {
                let len = hs.rng.gen_range(1..10);
                hs.remove(s, s as u64 + len);
            } else {
                random_insert(&mut hs, 2 * n as u32, 0.0);
            }
            if r % 50 == 0 {
                hs.check();
            }
        }
        hs.check();
        // Truncate most of the file.
        hs.remove(2000, 1 << 32);
        hs.check();
        hs.finish();
    }

    #[test]
    fn enospc_on_tree_block_leaves_tree_unchanged() {
        let mut hs = Harness::new("ext-nospc", 8, seed() ^ 3);
        // 4 full leaves under a full root: any new extent needs new tree blocks.
        for k in 0..4 * 84u32 {
            let blocks = hs.inner().sb.blocks_count();
            let goal = hs.rng.gen_range(0..blocks);
            hs.insert(k * 2, 1, false, goal).unwrap();
        }
        hs.check();
        let ino = hs.ino;
        let before_inode = hs.inner().read_inode(ino).unwrap();
        let before = hs.inner().ext_list(ino, &before_inode).unwrap();
        {
            let (tree, _) = hs.inner().load_tree(ino, &before_inode).unwrap();
            assert_eq!(tree_shape(&tree), vec![vec![4], vec![84; 4]]);
        }
        // Take one data block, then exhaust the file system.
        let h = hs.inner().start(8).unwrap();
        let (data, _) = hs.inner().alloc_blocks(&h, 0, 1).unwrap();
        let mut hoard = Vec::new();
        while let Ok(r) = hs.inner().alloc_blocks(&h, 0, 1 << 15) {
            hoard.push(r);
        }
        let mut i = before_inode.clone();
        for lblk in [1u32, 301, 4 * 84 * 2 + 5] {
            let r = hs.inner().ext_insert(&h, ino, &mut i, lblk, data, 1, false);
            assert!(matches!(r, Err(FsError::NoSpace)), "{r:?}");
            // Nothing changed: same mapping, same root and i_blocks in the copy.
            assert_eq!(hs.inner().ext_list(ino, &i).unwrap(), before);
            assert_eq!(i.block, before_inode.block);
            assert_eq!(i.blocks_raw, before_inode.blocks_raw);
        }
        // Still nothing free: the failed attempts gave back what they took.
        assert!(hs.inner().alloc_blocks(&h, 0, 1).is_err());
        for (p, n) in hoard {
            hs.inner().free_blocks(&h, p, n as u64).unwrap();
        }
        hs.inner().free_blocks(&h, data, 1).unwrap();
        hs.inner().stop(h).unwrap();
        // Freed blocks are reusable once their freeing is durable: remount.
        hs.remount();
        hs.check();
        // With space back the same insert works and grows the tree.
        hs.insert(1, 1, false, 0).unwrap();
        hs.check();
        hs.finish();
    }

    #[test]
    fn corrupt_tree_block_gives_typed_error() {
        let mut hs = Harness::new("ext-corrupt", 16, seed() ^ 4);
        for k in 0..200u32 {
            let blocks = hs.inner().sb.blocks_count();
            let goal = hs.rng.gen_range(0..blocks);
            hs.insert(k * 2, 1, false, goal).unwrap();
        }
        let ino = hs.ino;
        let i = hs.inner().read_inode(ino).unwrap();
        let root = NodeRef::parse_root(&i.block, ino).unwrap();
        let leaf = root.index(0).unwrap().child;
        let mut inner = hs.inner.take().unwrap();
        inner.unmount().unwrap();
        drop(inner);
        // Flip a byte of an extent entry on disk.
        use std::io::{Read, Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&hs.img.path)
            .unwrap();
        let off = leaf * 1024 + 12 + 12 * 3 + 8;
        let mut b = [0u8; 1];
        f.seek(SeekFrom::Start(off)).unwrap();
        f.read_exact(&mut b).unwrap();
        f.seek(SeekFrom::Start(off)).unwrap();
        f.write_all(&[b[0] ^ 0x10]).unwrap();
        drop(f);
        let dev: DeviceRef = Arc::new(FileDevice::open(&hs.img.path, false).unwrap());
        let mut inner = Inner::mount(dev, MountOptions::default()).unwrap();
        let mut i = inner.read_inode(ino).unwrap();
        let e = inner.ext_list(ino, &i).unwrap_err();
        assert!(e.is_corruption(), "{e}");
        assert!(inner.ext_map(ino, &i, 6).unwrap_err().is_corruption());
        let h = inner.start(8).unwrap();
        let e = inner.ext_remove(&h, ino, &mut i, 0, 1 << 32).unwrap_err();
        assert!(e.is_corruption(), "{e}");
        inner.stop(h).unwrap();
    }
}
