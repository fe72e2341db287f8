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

use commitfs_format::extent::{self as fx, Extent, NodeRef};
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
            let node = NodeRef::parse_block(
                &data,
                child,
                Some(depth),
                &self.csum,
                ino,
                inode.generation,
            )?;
            if node.is_leaf() {
                return self.leaf_hit(ino, &node, lblk, next_key);
            }
            child = Self::pick_child(&node, lblk, &mut next_key);
        }
    }

    /// Index entry to follow for `lblk`: the last one starting at or before it (or
    /// the first). Records the following key as the start of the next subtree.
    fn pick_child(node: &NodeRef<'_>, lblk: u32, next_key: &mut Option<u32>) -> u64 {
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
                let e = leaf.extent(i).ok_or_else(|| FsError::corrupt("extent leaf"))?;
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
        // Each round either answers or moves to a strictly larger subtree start; the
        // bound guards against a corrupt tree whose keys do not advance.
        for _ in 0..64 {
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
        while let Some((blk, depth, key)) = stack.pop() {
            let buf = self.read_meta(blk)?;
            let data = buf.data();
            let node = NodeRef::parse_block(&data, blk, Some(depth), &self.csum, ino, inode.generation)?;
            if node.entry_lblk(0) != Some(key) {
                return Err(FsError::corrupt(format!(
                    "inode {ino}: extent index key {key} does not match the first entry of block {blk}"
                )));
            }
            if node.is_leaf() {
                for e in node.extents() {
                    self.check_extent_range(ino, &e)?;
                    if out.last().is_some_and(|p: &Mapping| p.lblk as u64 + p.len as u64 > e.lblk as u64) {
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
            return Err(FsError::Invalid("extent insert of blocks outside the file system"));
        }
        let fast = self.ext_fast_op(h, ino, inode, lblk, end, |v| {
            list_insert(v, lblk, pblk, len, unwritten)
        })?;
        if let Some(r) = fast {
            return r;
        }
        self.ext_slow_op(h, ino, inode, TreeOp::Insert(Extent { lblk, len, pblk, unwritten }), pblk)?;
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
        let fast = self.ext_fast_op(h, ino, inode, start, end, |v| Ok(list_remove(v, start, end)))?;
        let freed = match fast {
            Some(r) => r?,
            None => {
                let goal = self.inode_goal(ino);
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
            list_convert(v, lblk, (end - lblk as u64) as u32);
            Ok(())
        })?;
        if let Some(r) = fast {
            return r;
        }
        let goal = self.inode_goal(ino);
        self.ext_slow_op(h, ino, inode, TreeOp::Convert(lblk, end), goal)?;
        Ok(())
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
            return Err(FsError::corrupt(format!("inode {ino}: extent path does not end in a leaf")));
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
            if v.is_empty() || v.len() > cap || eff_slack(v.len(), cap) > eff_slack(old.len(), cap) {
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
            if child_node.first_lblk() != Some(key) {
                return Err(FsError::corrupt(format!(
                    "inode {ino}: extent index key {key} does not match the first entry of block {c}"
                )));
            }
            node = child_node;
            blk = Some(c);
        }
        Ok(Path { nodes, next_key })
    }

    /// Read, verify and decode one tree block.
    fn read_tree_block(&self, ino: u32, generation: u32, blk: u64, depth: u16) -> Result<ExtentNode> {
        if blk < self.sb.first_data_block() as u64 {
            return Err(FsError::corrupt(format!("inode {ino}: extent tree block {blk} out of range")));
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
        let mut hint = goal;
        for l in 1..tree.levels.len() {
            for i in 0..tree.levels[l].len() {
                if let Some(b) = tree.levels[l][i].blk {
                    hint = b;
                    continue;
                }
                match self.alloc_blocks(h, hint, 1) {
                    Ok((b, _)) => {
                        tree.levels[l][i].blk = Some(b);
                        fresh.push(b);
                        hint = b;
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
    fn load_tree(&mut self, ino: u32, inode: &Inode) -> Result<(MemTree, HashMap<u64, ExtentNode>)> {
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
                if node.first_lblk() != Some(x.lblk) {
                    return Err(FsError::corrupt(format!(
                        "inode {ino}: extent index key {} does not match the first entry of block {}",
                        x.lblk, x.child
                    )));
                }
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
        for e in levels.last().into_iter().flatten().flat_map(|n| n.exts.iter()) {
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
fn list_convert(v: &mut Vec<Extent>, lblk: u32, len: u32) {
    let s = lblk as u64;
    let end = s + len as u64;
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
        assert_eq!(v, vec![e(0, 3, 100, false), e(25, 1, 205, true), e(27, 3, 207, true)]);
        let f = list_remove(&mut v, 0, 1 << 32);
        assert_eq!(f.iter().map(|x| x.1).sum::<u32>(), 7);
        assert!(v.is_empty());
    }

    #[test]
    fn convert_splits_and_merges() {
        let mut v = vec![e(0, 4, 100, false), e(4, 10, 104, true)];
        list_convert(&mut v, 6, 2);
        assert_eq!(
            v,
            vec![e(0, 4, 100, false), e(4, 2, 104, true), e(6, 2, 106, false), e(8, 6, 108, true)]
        );
        list_convert(&mut v, 4, 2);
        assert_eq!(v, vec![e(0, 8, 100, false), e(8, 6, 108, true)]);
        list_convert(&mut v, 8, 6);
        assert_eq!(v, vec![e(0, 14, 100, false)]);
    }
}
