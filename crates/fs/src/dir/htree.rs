//! htree maintenance: converting a full linear directory, inserting into the leaf the
//! index selects, splitting leaves and interior nodes, adding an index level
//! (ext4-format.md §6.5). The index is mirrored in memory ([`DxIndex`]) and every
//! change is written through to its block with a fresh dx_tail checksum.

use std::collections::HashMap;

use commitfs_format::dirent;
use commitfs_format::dx::{self, DxEntry, RootHeader, HASH_CONTINUATION};
use commitfs_format::inode::FL_INDEX;
use commitfs_journal::Handle;

use super::{DirState, Slot};
use crate::error::{FsError, Result};
use crate::inner::Inner;

/// In-memory copy of a directory's htree index.
pub(crate) struct DxIndex {
    /// `dx_root_info.hash_version` as stored.
    pub hash_version: u8,
    /// Version actually used for hashing (signedness applied, §2.5).
    pub eff_version: u8,
    /// `indirect_levels`.
    pub levels: u8,
    /// '..' inode, stored in the root block.
    pub dotdot: u32,
    /// Root entries (`[0].hash` = 0).
    pub root: Vec<DxEntry>,
    /// Interior nodes by logical block (`[0].hash` = 0).
    pub nodes: HashMap<u32, Vec<DxEntry>>,
}

/// One step of a root-to-leaf path: the index block (`None` = root) and the entry
/// followed in it.
type Step = (Option<u32>, usize);

impl DxIndex {
    fn entries(&self, node: Option<u32>) -> &[DxEntry] {
        match node {
            None => &self.root,
            Some(b) => self.nodes.get(&b).map(Vec::as_slice).unwrap_or(&[]),
        }
    }

    /// The path the kernel's `dx_probe` takes for `hash`, and the leaf it ends at.
    fn probe(&self, hash: u32) -> Result<(Vec<Step>, u32)> {
        let mut path = Vec::with_capacity(self.levels as usize + 1);
        let mut node = None;
        for level in 0..=self.levels {
            let entries = self.entries(node);
            if entries.is_empty() {
                return Err(FsError::corrupt("htree index node missing"));
            }
            let i = dx::lookup(entries, hash);
            path.push((node, i));
            let child = entries[i].block;
            if level == self.levels {
                return Ok((path, child));
            }
            node = Some(child);
        }
        Err(FsError::corrupt("htree probe fell off the tree"))
    }
}

/// Split sorted `(hash, size)` records in two halves by size; returns the index of
/// the first record of the upper half (in `1..len`, `len >= 2`).
fn split_point(sizes: &[usize]) -> usize {
    let total: usize = sizes.iter().sum();
    let mut acc = 0;
    let mut s = sizes.len();
    for (i, &sz) in sizes.iter().enumerate() {
        if acc + sz / 2 > total / 2 {
            s = i;
            break;
        }
        acc += sz;
    }
    s.clamp(1, sizes.len() - 1)
}

/// One record being redistributed by a split: (hash, minor hash, ino, type, name).
type Rec = (u32, u32, u32, u8, Vec<u8>);

impl Inner {
    fn dx_header(&self, st: &DirState, idx: &DxIndex) -> RootHeader {
        RootHeader {
            dot_inode: st.dot,
            dotdot_inode: idx.dotdot,
            hash_version: idx.hash_version,
            indirect_levels: idx.levels,
        }
    }

    /// Rewrite the root block from the in-memory index.
    fn dx_write_root(&mut self, h: &Handle, st: &DirState) -> Result<()> {
        let Some(idx) = st.dx.as_ref() else {
            return Err(FsError::corrupt("not an indexed directory"));
        };
        let geo = self.dx_geo();
        let hdr = self.dx_header(st, idx);
        let (csum, seed) = (self.csum.enabled, st.seed);
        let entries = &idx.root;
        self.modify_meta(h, st.pblocks[0], |d| -> Result<()> {
            dx::write_root_parts(d, &geo, hdr, entries)?;
            if csum {
                dx::set_csum(d, dx::ROOT_COUNT_OFFSET, seed)?;
            }
            Ok(())
        })??;
        Ok(())
    }

    /// Write interior node `lblk` from the in-memory index (`fresh`: newly allocated).
    fn dx_write_node(&mut self, h: &Handle, st: &DirState, lblk: u32, fresh: bool) -> Result<()> {
        let Some(entries) = st.dx.as_ref().and_then(|i| i.nodes.get(&lblk)) else {
            return Err(FsError::corrupt("htree node missing"));
        };
        let geo = self.dx_geo();
        let (csum, seed) = (self.csum.enabled, st.seed);
        let fill = |d: &mut [u8]| -> Result<()> {
            dx::write_node_entries(d, &geo, entries)?;
            if csum {
                dx::set_csum(d, dx::NODE_COUNT_OFFSET, seed)?;
            }
            Ok(())
        };
        let pblk = st.pblocks[lblk as usize];
        if fresh {
            self.new_meta(h, pblk, fill)??;
        } else {
            self.modify_meta(h, pblk, fill)??;
        }
        Ok(())
    }

    pub(super) fn dx_set_dotdot(
        &mut self,
        h: &Handle,
        st: &mut DirState,
        parent: u32,
    ) -> Result<()> {
        let (csum, seed) = (self.csum.enabled, st.seed);
        let pblk = st.pblocks[0];
        self.modify_meta(h, pblk, |d| -> Result<()> {
            if csum {
                dx::verify_csum(d, dx::ROOT_COUNT_OFFSET, seed, pblk)?;
            }
            dx::set_root_dotdot(d, parent);
            if csum {
                dx::set_csum(d, dx::ROOT_COUNT_OFFSET, seed)?;
            }
            Ok(())
        })??;
        if let Some(idx) = st.dx.as_mut() {
            idx.dotdot = parent;
        }
        Ok(())
    }

    /// Read the live records of leaf `lblk` (checksum verified) with their hashes.
    fn leaf_records(
        &self,
        st: &DirState,
        idx: &DxIndex,
        lblk: u32,
        skip_dots: bool,
    ) -> Result<Vec<Rec>> {
        let pblk = st.pblocks[lblk as usize];
        let buf = self.read_meta(pblk)?;
        let d = buf.data();
        if self.csum.enabled {
            dirent::verify_leaf_csum(&d, st.seed, pblk)?;
        }
        let mut out = Vec::new();
        let mut it = dirent::iter(&d, self.leaf_geo(), pblk);
        if skip_dots {
            dirent::dot_dotdot(&d, self.leaf_geo(), pblk)?;
            it.next();
            it.next();
        }
        for e in it {
            let e = e?;
            if e.inode != 0 {
                let (hash, minor) = self.name_hash(idx, e.name);
                out.push((hash, minor, e.inode, e.file_type, e.name.to_vec()));
            }
        }
        Ok(out)
    }

    /// Sort records by hash and split them by size. Returns the split index and the
    /// index hash of the upper half (continuation bit set when the halves share a
    /// hash).
    fn split_records(recs: &mut [Rec]) -> (usize, u32) {
        recs.sort_unstable_by(|a, b| (a.0, a.1, &a.4).cmp(&(b.0, b.1, &b.4)));
        let sizes: Vec<usize> = recs
            .iter()
            .map(|r| dirent::min_rec_len(r.4.len()))
            .collect();
        let s = split_point(&sizes);
        let hash2 = recs[s].0;
        let cont = if recs[s - 1].0 == hash2 {
            HASH_CONTINUATION
        } else {
            0
        };
        (s, hash2 | cont)
    }

    /// The kernel's `make_indexed_dir`: block 0 of a linear directory is full; move
    /// its entries into two new leaves split by hash and turn block 0 into the root.
    pub(super) fn make_indexed(&mut self, h: &Handle, dir: u32, st: &mut DirState) -> Result<()> {
        let mut idx = DxIndex {
            hash_version: self.default_hash_version(),
            eff_version: 0,
            levels: 0,
            dotdot: st.dotdot,
            root: Vec::new(),
            nodes: HashMap::new(),
        };
        idx.eff_version = self.sb.effective_hash_version(idx.hash_version);
        let mut recs = self.leaf_records(st, &idx, 0, true)?;
        if recs.len() < 2 {
            return Err(FsError::corrupt(format!(
                "directory {dir}: full first block with fewer than two entries"
            )));
        }
        let (s, hash2) = Self::split_records(&mut recs);
        // Everything that can fail for lack of space happens before block 0 changes.
        let first = self.dir_grow(h, dir, st, 2)?;
        self.fc_dir_grown(h, dir, false);
        let (l1, l2) = (first, first + 1);
        let lo: Vec<(u32, u8, &[u8])> = recs[..s]
            .iter()
            .map(|r| (r.2, r.3, r.4.as_slice()))
            .collect();
        let hi: Vec<(u32, u8, &[u8])> = recs[s..]
            .iter()
            .map(|r| (r.2, r.3, r.4.as_slice()))
            .collect();
        self.leaf_write_new(h, st, l1, &lo)?;
        self.leaf_write_new(h, st, l2, &hi)?;
        idx.root = vec![
            DxEntry { hash: 0, block: l1 },
            DxEntry {
                hash: hash2,
                block: l2,
            },
        ];
        st.dx = Some(idx);
        st.free[0] = 0;
        self.dx_write_root(h, st)?;
        let mut inode = self.read_inode(dir)?;
        inode.flags |= FL_INDEX;
        self.write_inode(h, dir, &inode)?;
        for (i, r) in recs.iter().enumerate() {
            if let Some(slot) = st.names.get_mut(r.4.as_slice()) {
                slot.lblk = if i < s { l1 } else { l2 };
            }
        }
        Ok(())
    }

    /// Blocks an index insertion below `path` needs (node splits, a new level), or
    /// `NoSpace` when the index is at its maximum depth and full.
    fn dx_blocks_needed(&self, idx: &DxIndex, path: &[Step]) -> Result<u32> {
        let geo = self.dx_geo();
        let mut need = 0;
        for &(node, _) in path.iter().rev() {
            let (len, limit) = match node {
                None => (idx.root.len(), geo.root_limit()),
                Some(_) => (idx.entries(node).len(), geo.node_limit()),
            };
            if len < limit {
                return Ok(need);
            }
            if node.is_none() {
                if idx.levels < geo.max_indirect_levels() {
                    return Ok(need + 1);
                }
                return Err(FsError::NoSpace);
            }
            need += 1;
        }
        Ok(need)
    }

    /// Insert into an indexed directory.
    /// The blocks [`Self::dx_add_entry`] would change for `name` (a warm
    /// pass): the leaf its hash selects and, when that leaf lacks the room
    /// and would split, every index block on the way to it.
    pub(super) fn dx_add_blocks(&self, st: &DirState, name: &[u8]) -> Vec<u64> {
        let Some(idx) = st.dx.as_ref() else {
            return Vec::new();
        };
        let (hash, _) = self.name_hash(idx, name);
        let Ok((path, leaf)) = idx.probe(hash) else {
            return Vec::new();
        };
        let pblk = |l: u32| st.pblocks.get(l as usize).copied();
        let mut v: Vec<u64> = pblk(leaf).into_iter().collect();
        let need = dirent::min_rec_len(name.len());
        if (st.free.get(leaf as usize).copied().unwrap_or(0) as usize) < need {
            v.extend(path.iter().filter_map(|&(node, _)| pblk(node.unwrap_or(0))));
        }
        v
    }

    pub(super) fn dx_add_entry(
        &mut self,
        h: &Handle,
        dir: u32,
        st: &mut DirState,
        name: &[u8],
        ino: u32,
        ft: u8,
    ) -> Result<()> {
        let Some(idx) = st.dx.as_ref() else {
            return Err(FsError::corrupt("not an indexed directory"));
        };
        let (hash, minor) = self.name_hash(idx, name);
        let (path, leaf) = idx.probe(hash)?;
        let need = dirent::min_rec_len(name.len());
        if st.free.get(leaf as usize).copied().unwrap_or(0) as usize >= need {
            let placed = self.leaf_modify(h, st, leaf, |d, geo, pblk| {
                Ok(dirent::insert(d, geo, pblk, name, ino, ft)?)
            })?;
            if placed.is_none() {
                return Err(FsError::corrupt(format!(
                    "directory {dir}: leaf {leaf} has less room than recorded"
                )));
            }
            st.add_name(
                name,
                Slot {
                    ino,
                    ft,
                    lblk: leaf,
                },
            );
            return Ok(());
        }
        // Split the leaf. First make sure the index can take one more entry.
        let extra = self.dx_blocks_needed(idx, &path)?;
        let mut recs = self.leaf_records(st, idx, leaf, false)?;
        recs.push((hash, minor, ino, ft, name.to_vec()));
        let (s, hash2) = Self::split_records(&mut recs);
        let first = self.dir_grow(h, dir, st, 1 + extra)?;
        // A new index node too: e2fsck 1.47's dx_link does not grow the index.
        self.fc_dir_grown(h, dir, extra == 0);
        let new_leaf = first;
        let mut spare: Vec<u32> = (first + 1..first + 1 + extra).rev().collect();
        let lo: Vec<(u32, u8, &[u8])> = recs[..s]
            .iter()
            .map(|r| (r.2, r.3, r.4.as_slice()))
            .collect();
        let hi: Vec<(u32, u8, &[u8])> = recs[s..]
            .iter()
            .map(|r| (r.2, r.3, r.4.as_slice()))
            .collect();
        let pblk = st.pblocks[leaf as usize];
        let geo = self.leaf_geo();
        let (csum, seed) = (self.csum.enabled, st.seed);
        let free = self.modify_meta(h, pblk, |d| -> Result<usize> {
            dirent::pack(d, geo, pblk, lo.iter().copied())?;
            if csum {
                dirent::set_leaf_csum(d, seed);
            }
            Ok(dirent::max_slack(d, geo, pblk)?)
        })??;
        st.free[leaf as usize] = free as u16;
        self.leaf_write_new(h, st, new_leaf, &hi)?;
        st.add_name(
            name,
            Slot {
                ino,
                ft,
                lblk: leaf,
            },
        );
        for (i, r) in recs.iter().enumerate() {
            if let Some(slot) = st.names.get_mut(r.4.as_slice()) {
                slot.lblk = if i < s { leaf } else { new_leaf };
            }
        }
        self.dx_insert_index(h, st, &path, path.len() - 1, hash2, new_leaf, &mut spare)?;
        if !spare.is_empty() {
            return Err(FsError::corrupt(
                "htree split used fewer blocks than planned",
            ));
        }
        Ok(())
    }

    /// Insert `(hash, child)` after the entry `path[lvl]` points at, splitting index
    /// blocks upwards as needed; new index blocks come from `spare`.
    #[allow(clippy::too_many_arguments)]
    fn dx_insert_index(
        &mut self,
        h: &Handle,
        st: &mut DirState,
        path: &[Step],
        lvl: usize,
        hash: u32,
        child: u32,
        spare: &mut Vec<u32>,
    ) -> Result<()> {
        let geo = self.dx_geo();
        let (node, at) = path[lvl];
        let Some(idx) = st.dx.as_mut() else {
            return Err(FsError::corrupt("not an indexed directory"));
        };
        let (entries, limit) = match node {
            None => (&mut idx.root, geo.root_limit()),
            Some(b) => (
                idx.nodes
                    .get_mut(&b)
                    .ok_or_else(|| FsError::corrupt("htree node missing"))?,
                geo.node_limit(),
            ),
        };
        entries.insert(at + 1, DxEntry { hash, block: child });
        if entries.len() <= limit {
            return match node {
                None => self.dx_write_root(h, st),
                Some(b) => self.dx_write_node(h, st, b, false),
            };
        }
        let new_node = spare
            .pop()
            .ok_or_else(|| FsError::corrupt("htree split ran out of planned blocks"))?;
        match node {
            None => {
                // Root full: its entries move into a new node one level down.
                let moved = std::mem::replace(
                    &mut idx.root,
                    vec![DxEntry {
                        hash: 0,
                        block: new_node,
                    }],
                );
                idx.nodes.insert(new_node, moved);
                idx.levels += 1;
                st.free[new_node as usize] = 0;
                self.dx_write_node(h, st, new_node, true)?;
                self.dx_write_root(h, st)
            }
            Some(b) => {
                let half = entries.len() / 2;
                let mut right = entries.split_off(half);
                let rhash = right[0].hash;
                right[0].hash = 0;
                idx.nodes.insert(new_node, right);
                st.free[new_node as usize] = 0;
                self.dx_write_node(h, st, b, false)?;
                self.dx_write_node(h, st, new_node, true)?;
                self.dx_insert_index(h, st, path, lvl - 1, rhash, new_node, spare)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::split_point;

    #[test]
    fn split_point_halves_by_size() {
        assert_eq!(split_point(&[12, 12]), 1);
        assert_eq!(split_point(&[12, 12, 12, 12]), 2);
        assert_eq!(split_point(&[264, 12, 12, 12]), 1);
        assert_eq!(split_point(&[12, 12, 12, 264]), 3);
    }
}
