//! Block and inode allocation (ext4-format.md §3).
//!
//! Uninitialised groups are handled as the kernel does (§3.2): a BLOCK_UNINIT bitmap
//! is synthesised and written at the first allocation, an INODE_UNINIT bitmap is
//! written zeroed with padding, `bg_itable_unused` tracks the used watermark. Free
//! counts live in the descriptors; the superblock totals are derived from them
//! (`Inner::refresh_super_counts`) and written home at unmount and after recovery.

use commitfs_format::bitmap;
use commitfs_format::group_desc::{BG_BLOCK_UNINIT, BG_INODE_UNINIT};
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::Inner;

/// Free blocks and inodes of every group and their totals, mirrored from
/// the group descriptors at every descriptor write (`Inner::write_gd`) and
/// load, so that statfs needs no file-system lock (`Fs::statfs`; under many
/// clients its waits on `Inner` were as many as GETXATTR's).
#[derive(Default)]
pub(crate) struct FreeCounts {
    st: parking_lot::Mutex<FreeState>,
}

#[derive(Default)]
struct FreeState {
    /// (free blocks, free inodes) per group, as last written.
    groups: Vec<(u32, u32)>,
    blocks: u64,
    inodes: u64,
}

impl FreeCounts {
    /// Start over from the descriptors (mount, reload after recovery).
    pub(crate) fn init(&self, gds: &[commitfs_format::group_desc::GroupDesc]) {
        let mut st = self.st.lock();
        st.groups = gds
            .iter()
            .map(|g| (g.free_blocks_count, g.free_inodes_count))
            .collect();
        st.blocks = st.groups.iter().map(|g| g.0 as u64).sum();
        st.inodes = st.groups.iter().map(|g| g.1 as u64).sum();
    }

    /// Group `g` now has `blocks` and `inodes` free.
    pub(crate) fn set(&self, g: u32, blocks: u32, inodes: u32) {
        let mut st = self.st.lock();
        let Some(&(b0, i0)) = st.groups.get(g as usize) else {
            return;
        };
        st.groups[g as usize] = (blocks, inodes);
        st.blocks = st.blocks + blocks as u64 - b0 as u64;
        st.inodes = st.inodes + inodes as u64 - i0 as u64;
    }

    /// (free blocks, free inodes) over all groups.
    pub(crate) fn totals(&self) -> (u64, u64) {
        let st = self.st.lock();
        (st.blocks, st.inodes)
    }
}

impl Inner {
    /// Group containing block `blk`.
    pub fn block_group(&self, blk: u64) -> u32 {
        let fdb = self.sb.first_data_block() as u64;
        ((blk.saturating_sub(fdb)) / self.bpg as u64).min(self.groups as u64 - 1) as u32
    }

    /// The bitmap content of a BLOCK_UNINIT group (§3.2 rule 1): superblock/GDT
    /// backups and any group's bitmaps or inode table inside this group are in use,
    /// as is padding past the group's end.
    fn synth_block_bitmap(&self, g: u32) -> Vec<u8> {
        let mut bm = vec![0u8; self.bs];
        let first = self.sb.group_first_block(g);
        let nblocks = self.sb.blocks_in_group(g) as u64;
        let mut mark = |b: u64| {
            if b >= first && b < first + nblocks {
                bitmap::set_bit(&mut bm, (b - first) as usize);
            }
        };
        if self.sb.group_has_super(g) {
            let n = 1 + self.sb.gdt_blocks() + self.sb.reserved_gdt_blocks() as u64;
            // With 1 KiB blocks group 0 starts at block 1, where the superblock is.
            for i in 0..n {
                mark(first + i);
            }
        }
        let itb = (self.ipg as u64 * self.inode_size as u64).div_ceil(self.bs as u64);
        for gd in &self.gds {
            mark(gd.block_bitmap);
            mark(gd.inode_bitmap);
            for i in 0..itb {
                mark(gd.inode_table + i);
            }
        }
        bitmap::set_padding(&mut bm, nblocks as usize);
        bm
    }

    /// Make sure group `g`'s block bitmap is initialised on disk.
    pub(crate) fn init_block_bitmap(&mut self, h: &Handle, g: u32) -> Result<()> {
        let gd = self.gds[g as usize];
        if !gd.has_flag(BG_BLOCK_UNINIT) {
            return Ok(());
        }
        let bm = self.synth_block_bitmap(g);
        let csum = bitmap::checksum(&bm, self.sb.clusters_per_group(), &self.csum);
        self.new_meta(h, gd.block_bitmap, |d| d.copy_from_slice(&bm))?;
        let gdm = &mut self.gds[g as usize];
        gdm.flags &= !BG_BLOCK_UNINIT;
        gdm.block_bitmap_csum = if self.csum.enabled { csum } else { 0 };
        self.write_gd(h, g)
    }

    /// Make sure group `g`'s inode bitmap is initialised (§3.2 rules 3-4).
    pub(crate) fn init_inode_bitmap(&mut self, h: &Handle, g: u32) -> Result<()> {
        let gd = self.gds[g as usize];
        if !gd.has_flag(BG_INODE_UNINIT) {
            return Ok(());
        }
        self.init_block_bitmap(h, g)?;
        let ipg = self.ipg as usize;
        let mut bm = vec![0u8; self.bs];
        bitmap::set_padding(&mut bm, ipg);
        let csum = bitmap::checksum(&bm, self.ipg, &self.csum);
        self.new_meta(h, gd.inode_bitmap, |d| d.copy_from_slice(&bm))?;
        let gdm = &mut self.gds[g as usize];
        gdm.flags &= !BG_INODE_UNINIT;
        gdm.itable_unused = self.ipg;
        gdm.inode_bitmap_csum = if self.csum.enabled { csum } else { 0 };
        self.write_gd(h, g)
    }

    /// Verify a bitmap block's checksum against its descriptor.
    fn check_bitmap_csum(&self, data: &[u8], stored: u32, bits: u32, blk: u64) -> Result<()> {
        if !self.csum.enabled {
            return Ok(());
        }
        let c = bitmap::checksum(data, bits, &self.csum);
        let c = if self.sb.desc_size() >= 64 {
            c
        } else {
            c & 0xFFFF
        };
        if c != stored {
            return Err(commitfs_format::FormatError::BadChecksum {
                structure: "bitmap",
                block: blk,
                stored,
                computed: c,
            }
            .into());
        }
        Ok(())
    }

    /// Allocate up to `count` contiguous blocks, as close to `goal` as possible.
    /// Returns the first block and how many were allocated (at least 1).
    pub fn alloc_blocks(&mut self, h: &Handle, goal: u64, count: u32) -> Result<(u64, u32)> {
        if count == 0 {
            return Err(FsError::Invalid("zero-length allocation"));
        }
        // Blocks reserved for cached delayed pages are theirs: any other
        // allocation (metadata, uncached data) leaves them (ext4's
        // ext4_claim_free_clusters against s_dirtyclusters_counter).
        let mut count = count;
        if let Some(pc) = &self.pc {
            // Granted but not yet reserved blocks count too.
            let reserved = pc.reserved() + *pc.grant.lock();
            if reserved > 0 && !self.claiming {
                let (free, _) = self.free_counts();
                let avail = free.saturating_sub(reserved);
                if avail == 0 {
                    return Err(FsError::NoSpace);
                }
                count = count.min(avail.min(u32::MAX as u64) as u32);
            }
        }
        let goal = goal.clamp(
            self.sb.first_data_block() as u64,
            self.sb.blocks_count() - 1,
        );
        if !self.warm_pruned {
            self.prune_pending_free();
        }
        let g0 = self.block_group(goal);
        for i in 0..self.groups {
            let g = (g0 + i) % self.groups;
            if self.gds[g as usize].free_blocks_count == 0 {
                continue;
            }
            let start = if i == 0 {
                (goal - self.sb.group_first_block(g)) as usize
            } else {
                0
            };
            if let Some(r) = self.alloc_in_group(h, g, start, count)? {
                return Ok(r);
            }
            if i == 0 && start > 0 {
                if let Some(r) = self.alloc_in_group(h, g, 0, count)? {
                    return Ok(r);
                }
            }
        }
        Err(FsError::NoSpace)
    }

    fn alloc_in_group(
        &mut self,
        h: &Handle,
        g: u32,
        start: usize,
        count: u32,
    ) -> Result<Option<(u64, u32)>> {
        self.init_block_bitmap(h, g)?;
        let gd = self.gds[g as usize];
        let nbits = self.sb.blocks_in_group(g) as usize;
        let buf = self.read_meta(gd.block_bitmap)?;
        let (bit, run) = {
            let d = buf.data();
            self.check_bitmap_csum(
                &d,
                gd.block_bitmap_csum,
                self.sb.clusters_per_group(),
                gd.block_bitmap,
            )?;
            let Some(first) = self.next_free_run(&d, g, start.min(nbits), nbits, count) else {
                return Ok(None);
            };
            // Prefer a run that satisfies the whole request if one starts soon after.
            let mut best = first;
            let mut probe = first.0 + first.1;
            let mut tries = 0;
            while best.1 < count as usize && tries < 8 {
                let Some(r) = self.next_free_run(&d, g, probe, nbits, count) else {
                    break;
                };
                if r.1 > best.1 {
                    best = r;
                }
                probe = r.0 + r.1;
                tries += 1;
            }
            best
        };
        if run == 0 {
            return Ok(None);
        }
        let cpg = self.sb.clusters_per_group();
        let csum_ctx = self.csum;
        let new_csum = self.modify_meta(h, gd.block_bitmap, |d| {
            for b in bit..bit + run {
                bitmap::set_bit(d, b);
            }
            bitmap::checksum(d, cpg, &csum_ctx)
        })?;
        let gdm = &mut self.gds[g as usize];
        gdm.free_blocks_count = gdm.free_blocks_count.saturating_sub(run as u32);
        if self.csum.enabled {
            gdm.block_bitmap_csum = new_csum;
        }
        self.write_gd(h, g)?;
        Ok(Some((
            self.sb.group_first_block(g) + bit as u64,
            run as u32,
        )))
    }

    /// First run of free bits at or after `from` in a group's bitmap that avoids
    /// blocks freed by transactions not yet committed (they may not be reused
    /// before their freeing is durable).
    fn next_free_run(
        &self,
        d: &[u8],
        g: u32,
        from: usize,
        nbits: usize,
        count: u32,
    ) -> Option<(usize, usize)> {
        let count = count as usize;
        Some(match self.pending_free.group_overlay(g) {
            None => {
                let bit = bitmap::find_zero(d, from, nbits)?;
                (bit, bitmap::zero_run(d, bit, nbits, count))
            }
            Some(m) => {
                let bit = bitmap::find_zero_masked(d, m, from, nbits)?;
                (bit, bitmap::zero_run_masked(d, m, bit, nbits, count))
            }
        })
    }

    /// Free inodes of group `g` that may be allocated now (not pending).
    pub(crate) fn usable_inodes(&self, g: u32) -> u32 {
        let pending = self.pending_free_inodes.in_group(g);
        self.gds[g as usize]
            .free_inodes_count
            .saturating_sub(pending)
    }

    /// Make inode numbers whose freeing transactions are durable reusable, and
    /// move their groups' hints back to them.
    pub(crate) fn prune_pending_free_inodes(&mut self) {
        let j = self.journal.clone();
        let (ipg, hints) = (self.ipg, &mut self.inode_hint);
        self.pending_free_inodes.prune(
            |tid| j.is_committed(tid),
            |ino| {
                let i = ino.saturating_sub(1);
                let (g, bit) = ((i / ipg) as usize, i % ipg);
                if let Some(hint) = hints.get_mut(g) {
                    *hint = (*hint).min(bit);
                }
            },
        );
    }

    /// Forget pending frees whose transactions are now durable.
    pub fn prune_pending_free(&mut self) {
        let j = self.journal.clone();
        self.pending_free.prune(|tid| j.is_committed(tid));
    }

    /// Free `count` blocks starting at `start` (may cross groups). Freed blocks are
    /// dropped from the metadata cache so a stale buffer can never be written over
    /// a block that is reused for data.
    pub fn free_blocks(&mut self, h: &Handle, start: u64, count: u64) -> Result<()> {
        let end = start
            .checked_add(count)
            .filter(|&e| e <= self.sb.blocks_count() && start >= self.sb.first_data_block() as u64)
            .ok_or_else(|| {
                FsError::corrupt(format!("freeing blocks {start}+{count} out of range"))
            })?;
        for b in start..end {
            self.journal.forget(h, b);
        }
        // Single-flush commits (fc_data_csum): the freeing commit does not
        // checksum these blocks' data any more.
        self.journal.forget_data(start, count);
        self.pending_free.insert(start, end, h.tid());
        let mut b = start;
        while b < end {
            let g = self.block_group(b);
            let gfirst = self.sb.group_first_block(g);
            let gend = (gfirst + self.sb.blocks_in_group(g) as u64).min(end);
            self.init_block_bitmap(h, g)?;
            let gd = self.gds[g as usize];
            let cpg = self.sb.clusters_per_group();
            let csum_ctx = self.csum;
            let (lo, hi) = ((b - gfirst) as usize, (gend - gfirst) as usize);
            let (already_free, new_csum) = self.modify_meta(h, gd.block_bitmap, |d| {
                let mut already = 0;
                for i in lo..hi {
                    if !bitmap::test_bit(d, i) {
                        already += 1;
                    }
                    bitmap::clear_bit(d, i);
                }
                (already, bitmap::checksum(d, cpg, &csum_ctx))
            })?;
            let gdm = &mut self.gds[g as usize];
            gdm.free_blocks_count += (hi - lo - already_free) as u32;
            if self.csum.enabled {
                gdm.block_bitmap_csum = new_csum;
            }
            self.write_gd(h, g)?;
            if already_free > 0 {
                tracing::warn!("freed {already_free} blocks in group {g} that were already free");
            }
            b = gend;
        }
        Ok(())
    }

    /// Pick a group for a new inode: directories are spread over groups with
    /// above-average free space (a light Orlov), files stay near their parent.
    pub(crate) fn pick_inode_group(&self, parent: u32, is_dir: bool) -> Option<u32> {
        let pg = self.inode_group(parent);
        let ok = |g: u32| self.usable_inodes(g) > 0;
        if is_dir && parent == crate::types::ROOT_INO && self.groups > 1 {
            let avg_free_inodes: u64 = self
                .gds
                .iter()
                .map(|g| g.free_inodes_count as u64)
                .sum::<u64>()
                / self.groups as u64;
            let avg_free_blocks: u64 = self
                .gds
                .iter()
                .map(|g| g.free_blocks_count as u64)
                .sum::<u64>()
                / self.groups as u64;
            for i in 1..=self.groups {
                let g = (self.last_dir_group + i) % self.groups;
                let gd = &self.gds[g as usize];
                if gd.free_inodes_count as u64 >= avg_free_inodes.max(1)
                    && gd.free_blocks_count as u64 >= avg_free_blocks
                {
                    return Some(g);
                }
            }
        }
        if ok(pg) && (self.gds[pg as usize].free_blocks_count > 0 || !is_dir) {
            return Some(pg);
        }
        (1..self.groups)
            .map(|i| (pg + i) % self.groups)
            .find(|&g| ok(g))
    }

    /// The bit of group `g`'s inode bitmap `d` that [`Self::alloc_inode`]
    /// takes: the first free one from the group's hint on (then from its
    /// start) whose inode is not freed by an uncommitted transaction.
    pub(crate) fn usable_inode_bit(&self, g: u32, d: &[u8]) -> Option<usize> {
        let ipg = self.ipg as usize;
        let hint = self.inode_hint[g as usize] as usize;
        let base = g * self.ipg + 1;
        let usable = |from: usize, to: usize| {
            let mut b = from;
            while let Some(z) = bitmap::find_zero(d, b, to) {
                if !self.pending_free_inodes.contains(base + z as u32) {
                    return Some(z);
                }
                b = z + 1;
            }
            None
        };
        usable(hint.min(ipg), ipg).or_else(|| usable(0, hint.min(ipg)))
    }

    /// Allocate an inode number for a new inode of `parent` (§4.10 step 1).
    pub fn alloc_inode(&mut self, h: &Handle, parent: u32, is_dir: bool) -> Result<u32> {
        if !self.warm_pruned {
            self.prune_pending_free_inodes();
        }
        let Some(start_g) = self.pick_inode_group(parent, is_dir) else {
            return Err(FsError::NoSpace);
        };
        for i in 0..self.groups {
            let g = (start_g + i) % self.groups;
            if self.usable_inodes(g) == 0 {
                continue;
            }
            self.init_inode_bitmap(h, g)?;
            let gd = self.gds[g as usize];
            let buf = self.read_meta(gd.inode_bitmap)?;
            let bit = {
                let d = buf.data();
                self.check_bitmap_csum(&d, gd.inode_bitmap_csum, self.ipg, gd.inode_bitmap)?;
                self.usable_inode_bit(g, &d)
            };
            let Some(bit) = bit else {
                continue;
            };
            let ino = g * self.ipg + bit as u32 + 1;
            if ino < self.sb.first_ino() {
                return Err(FsError::corrupt(format!(
                    "inode bitmap of group {g} marks reserved inode {ino} free"
                )));
            }
            let ipg32 = self.ipg;
            let csum_ctx = self.csum;
            let new_csum = self.modify_meta(h, gd.inode_bitmap, |d| {
                bitmap::set_bit(d, bit);
                bitmap::checksum(d, ipg32, &csum_ctx)
            })?;
            self.inode_hint[g as usize] = bit as u32 + 1;
            let gdm = &mut self.gds[g as usize];
            gdm.free_inodes_count = gdm.free_inodes_count.saturating_sub(1);
            if is_dir {
                gdm.used_dirs_count += 1;
            }
            // Never leave a live inode in the "never used" tail (§3.2 rule 5).
            let used_watermark = ipg32.saturating_sub(gdm.itable_unused);
            if bit as u32 + 1 > used_watermark {
                gdm.itable_unused = ipg32 - (bit as u32 + 1);
            }
            if self.csum.enabled {
                gdm.inode_bitmap_csum = new_csum;
            }
            self.write_gd(h, g)?;
            if is_dir {
                self.last_dir_group = g;
            }
            return Ok(ino);
        }
        Err(FsError::NoSpace)
    }

    /// Release inode number `ino`.
    pub fn free_inode(&mut self, h: &Handle, ino: u32, was_dir: bool) -> Result<()> {
        if ino < self.sb.first_ino() || ino > self.sb.inodes_count() {
            return Err(FsError::corrupt(format!(
                "freeing reserved or invalid inode {ino}"
            )));
        }
        let g = self.inode_group(ino);
        let bit = ((ino - 1) % self.ipg) as usize;
        let gd = self.gds[g as usize];
        let ipg32 = self.ipg;
        let csum_ctx = self.csum;
        let (was_set, new_csum) = self.modify_meta(h, gd.inode_bitmap, |d| {
            let was = bitmap::test_bit(d, bit);
            bitmap::clear_bit(d, bit);
            (was, bitmap::checksum(d, ipg32, &csum_ctx))
        })?;
        let gdm = &mut self.gds[g as usize];
        if was_set {
            gdm.free_inodes_count += 1;
            if was_dir {
                gdm.used_dirs_count = gdm.used_dirs_count.saturating_sub(1);
            }
        }
        if self.csum.enabled {
            gdm.inode_bitmap_csum = new_csum;
        }
        self.write_gd(h, g)?;
        // The hint goes back to this number only once it may be reused
        // (`prune_pending_free_inodes`).
        self.pending_free_inodes.insert(ino, h.tid());
        self.orphans_added.remove(&ino);
        self.itable.remove(ino);
        Ok(())
    }

    /// Free blocks and inodes, for statfs.
    pub fn free_counts(&self) -> (u64, u64) {
        (
            self.gds.iter().map(|g| g.free_blocks_count as u64).sum(),
            self.gds.iter().map(|g| g.free_inodes_count as u64).sum(),
        )
    }
}
