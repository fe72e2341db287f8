//! Fast-commit replay at mount (ext4-format.md §9.6, §9.7, §9.9, §9.11 item 6).
//!
//! Runs right after the JBD2 replay (whose blocks are then home and durable):
//!
//! 1. Hold the log: point the journal superblock at an empty live log of the
//!    recovery's end tid `T` ([`commitfs_journal::hold_log_for_fast_commits`]), so a
//!    crash from here on repeats recovery and this replay from the same home state.
//! 2. Scan the fast-commit area (only with the JBD2 FAST_COMMIT bit set on disk) with
//!    `expected_tid = T`.
//! 3. Apply the records in log order with the kernel's rules (table of §9.7), on a
//!    write-home journal over an in-memory overlay of the device: nothing reaches the
//!    disk yet. The allocator (tree blocks, directory blocks) must not hand out the
//!    physical ranges named by ADD_RANGE records nor blocks an INODE record releases
//!    (they may still be in use): their bits are *held* set during replay and the
//!    releases deferred; blocks freed through the extent code are kept out of
//!    allocation by `pending_free`.
//! 4. Release held blocks no touched inode maps, set the bits of every block (data
//!    and tree) the touched inodes map, recompute their `i_blocks`, recompute every
//!    group's free counts and bitmap checksums and the superblock totals (as e2fsck
//!    does).
//! 5. Commit the changed blocks as JBD2 transaction `T`, then write them home
//!    ([`commitfs_journal::commit_fast_commit_replay`]): the replay is atomic, and a
//!    full commit of `T` supersedes the fast commits of `T` (§9.9). The kernel writes
//!    its replay home block by block (its own source lists journaling it as a TODO);
//!    a crash in the middle can then leave, e.g., a removed name with its inode
//!    reverted by the repeated JBD2 replay, which no record repairs.
//! 6. Mark the log empty with FAST_COMMIT cleared; fast-commit block 0 was zeroed
//!    right after the commit ([`commitfs_journal::finish_fast_commit_recovery`]).
//!
//! Deliberate differences from the kernel, where its behaviour would leave an image
//! e2fsck rejects or lose data on a repeated replay:
//! * CREAT of a directory puts '.'/'..' in logical block 0 (the kernel appends a block
//!   at `i_size`, which the INODE record already set), gives it 2 links and counts
//!   the link in the parent.
//! * UNLINK whose name now points at another inode leaves that name and the inode's
//!   link count alone (the kernel still drops a link); UNLINK of a directory frees it.
//! * An INODE record with no links (a deleted file) frees the inode number, as
//!   e2fsck does, instead of failing the replay.
//! * `i_blocks` also counts the xattr block, and is recomputed after the last
//!   record for every touched inode (the kernel only at INODE records).
//! * An INODE record shorter than the on-disk inode, for a number free on disk
//!   (a new inode reusing it), clears the rest of the inode (the dead inode's
//!   in-inode xattrs, which the kernel would hand to the new file).
//! * A scan that the kernel would reject (§9.6) still replays its valid prefix.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use commitfs_device::{BlockDevice, DeviceRef, IoCategory, IoStats};
use parking_lot::Mutex;

use commitfs_format::bitmap;
use commitfs_format::bytes::{le16, le32};
use commitfs_format::csum::CsumCtx;
use commitfs_format::extent::{NodeRef, EXT_MAGIC};
use commitfs_format::fast_commit::{Dentry, FcScan, Tlv};
use commitfs_format::group_desc::{BG_BLOCK_UNINIT, BG_INODE_UNINIT};
use commitfs_format::inode::{self as fi, Inode};
use commitfs_format::jbd2::JournalSuperblock;
use commitfs_format::superblock as sbf;
use commitfs_journal::{Handle, Journal, JournalMap};

use crate::error::{FsError, Result};
use crate::inner::Inner;
use crate::ops::empty_extent_root;

/// `i_block` inside a raw inode (§4.2); INODE replay keeps the on-disk copy of it.
const I_BLOCK: std::ops::Range<usize> = 0x28..0x64;
/// `i_flags` inside a raw inode.
const I_FLAGS: usize = 0x20;
/// Data runs `(pblk, len)` and tree blocks of an inode.
type InodeBlocks = (Vec<(u64, u32)>, Vec<u64>);

/// Longest extent-tree walk accepted (blocks), against loops in corrupt trees.
const MAX_TREE_BLOCKS: usize = 1 << 20;

/// What one fast-commit replay did (logged at mount; returned for tests).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FcReplayReport {
    /// Valid fast commits found.
    pub commits: u32,
    /// Records applied (HEAD, PAD and TAIL not counted).
    pub applied: u32,
    /// Records skipped (missing inode, bad values), with a warning each.
    pub skipped: u32,
    /// Inodes whose blocks and `i_blocks` were re-derived.
    pub inodes: usize,
}

#[derive(Default)]
struct ReplayState {
    /// Inodes touched by INODE / ADD_RANGE / DEL_RANGE (and created directories), in
    /// first-touch order.
    modified: Vec<u32>,
    seen: HashSet<u32>,
    /// Block ranges `[start, end)` held set during replay that become free at the end
    /// unless a touched inode maps them: bits replay set to keep ADD_RANGE targets
    /// out of allocation, and the old mappings of inodes an INODE record replaced.
    held: Vec<(u64, u64)>,
    report: FcReplayReport,
}

impl ReplayState {
    fn touch(&mut self, ino: u32) {
        if self.seen.insert(ino) {
            self.modified.push(ino);
        }
    }
}

/// A record that cannot be applied: skipped with a warning (the kernel ignores most
/// of these too); device and journal errors abort the replay.
fn skippable(e: &FsError) -> bool {
    !matches!(e, FsError::Device(_) | FsError::Journal(_))
}

impl Inner {
    /// Replay the fast commits following the JBD2 log (call right after
    /// `commitfs_journal::recover` and `reload_after_recovery`). `before` is the journal
    /// superblock as read before recovery, `end_tid` the recovery's end tid.
    pub(crate) fn replay_fast_commits(
        &mut self,
        map: &JournalMap,
        before: &JournalSuperblock,
        end_tid: u32,
    ) -> Result<Option<FcReplayReport>> {
        if commitfs_journal::fc_area(before).is_none() {
            return Ok(None);
        }
        let dev = self.dev.clone();
        commitfs_journal::hold_log_for_fast_commits(&*dev, map, self.bs, end_tid)?;
        let scan = commitfs_journal::read_fast_commits_with(
            &*dev,
            map,
            self.bs,
            before,
            self.inode_size,
            end_tid,
            self.sb
                .has_incompat(commitfs_format::superblock::INCOMPAT_COMMITFS_FC_DATA_CSUM),
        )?
        .ok_or_else(|| FsError::corrupt("fast-commit area vanished"))?;
        if scan.kernel_error() {
            tracing::warn!(
                "fast-commit area: scan ended with {:?} after {} valid commits (the kernel \
                 would refuse this journal); replaying the valid prefix",
                scan.end,
                scan.commits
            );
        }
        let mut report = None;
        if scan.commits > 0 {
            // Compute the replay against an overlay: the disk stays as recovery left
            // it until the result is committed as one transaction.
            let overlay = Arc::new(Overlay::new(dev.clone(), self.bs));
            self.journal = Arc::new(Journal::new(overlay.clone(), self.bs, false));
            let r = self.fc_replay(&scan);
            self.journal = Arc::new(Journal::new(dev.clone(), self.bs, self.read_only));
            let r = r?;
            let blocks = overlay.take();
            if !blocks.is_empty()
                && !commitfs_journal::commit_fast_commit_replay(
                    &*dev, map, self.bs, end_tid, &blocks,
                )?
            {
                tracing::warn!(
                    "fast-commit replay: {} changed blocks do not fit one transaction; \
                     writing them home directly",
                    blocks.len()
                );
                for (b, d) in &blocks {
                    dev.write_at(b * self.bs as u64, d, IoCategory::Metadata, false)?;
                }
                dev.flush()?;
            }
            tracing::info!(
                "fast-commit replay (tid {end_tid}): {} commits, {} records applied, {} skipped, \
                 {} inodes re-derived, {} blocks written",
                r.commits,
                r.applied,
                r.skipped,
                r.inodes,
                blocks.len()
            );
            report = Some(r);
        }
        commitfs_journal::finish_fast_commit_recovery(
            &*dev,
            map,
            self.bs,
            end_tid.wrapping_add(1),
        )?;
        Ok(report)
    }

    /// Apply scanned records and commit them to the current journal (steps 3–4).
    pub(crate) fn fc_replay(&mut self, scan: &FcScan) -> Result<FcReplayReport> {
        let empty = self.pending_free.empty_like();
        let saved_pending = std::mem::replace(&mut self.pending_free, empty);
        let empty = self.pending_free_inodes.empty_like();
        let saved_inodes = std::mem::replace(&mut self.pending_free_inodes, empty);
        let saved_incompat = self.sb.feature_incompat();
        // Should anything write the superblock during replay, the home copy must keep
        // needs_recovery while the log is live: without it the kernel would wipe the
        // log instead of replaying it after a crash.
        self.sb
            .set_feature_incompat(saved_incompat | sbf::INCOMPAT_RECOVER);
        let r = self.fc_replay_inner(scan);
        self.pending_free = saved_pending;
        self.pending_free_inodes = saved_inodes;
        self.sb.set_feature_incompat(saved_incompat);
        r
    }

    fn fc_replay_inner(&mut self, scan: &FcScan) -> Result<FcReplayReport> {
        let mut st = ReplayState::default();
        st.report.commits = scan.commits;
        let h = self.start(u32::MAX)?;
        let r = (|| -> Result<()> {
            // The kernel's "excluded regions": hold the ADD_RANGE targets (only the
            // bits this sets are released again at the end).
            for &(p, len) in &scan.in_use {
                let flipped = self.fc_set_blocks(&h, p, len as u64, true)?;
                st.held.extend(flipped);
            }
            for tlv in scan.replayable() {
                match self.fc_apply(&h, &mut st, tlv) {
                    Ok(()) => st.report.applied += 1,
                    Err(e) if skippable(&e) => {
                        tracing::warn!("fast-commit replay: skipping {tlv:?}: {e}");
                        st.report.skipped += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
            self.fc_remark(&h, &mut st)?;
            self.fc_recount(&h)
        })();
        self.stop(h)?;
        r?;
        self.journal.commit()?;
        Ok(st.report)
    }

    fn fc_apply(&mut self, h: &Handle, st: &mut ReplayState, tlv: &Tlv<'_>) -> Result<()> {
        match tlv {
            Tlv::Inode { ino, raw } => self.fc_inode(h, st, *ino, raw),
            Tlv::AddRange {
                ino,
                lblk,
                len,
                pblk,
                unwritten,
            } => self.fc_add_range(h, st, *ino, *lblk, *len, *pblk, *unwritten),
            Tlv::DelRange { ino, lblk, len } => self.fc_del_range(h, st, *ino, *lblk, *len),
            Tlv::Creat(d) => self.fc_creat(h, st, d),
            Tlv::Link(d) => self.fc_link_tag(h, d),
            Tlv::Unlink(d) => self.fc_unlink(h, d),
            Tlv::Head { .. }
            | Tlv::Pad { .. }
            | Tlv::Tail { .. }
            | Tlv::DataCsum { .. }
            | Tlv::DataChain => Ok(()),
        }
    }

    // ---- records ------------------------------------------------------------------

    /// INODE: copy the logged inode over the on-disk one except `i_block` (§9.7).
    fn fc_inode(&mut self, h: &Handle, st: &mut ReplayState, ino: u32, raw: &[u8]) -> Result<()> {
        self.fc_check_ino(ino)?;
        if raw.len() > self.inode_size || raw.len() < I_BLOCK.end {
            return Err(FsError::Invalid("INODE record of a bad size"));
        }
        // Its current blocks become free unless still mapped at the end (the kernel
        // clears them now and re-marks later; holding them keeps the allocator off).
        if let Some(old) = self.fc_existing(ino) {
            if let Ok((data, tree)) = self.fc_inode_blocks(ino, &old) {
                st.held
                    .extend(data.iter().map(|&(p, l)| (p, p.saturating_add(l as u64))));
                st.held.extend(tree.iter().map(|&t| (t, t + 1)));
            }
        }
        st.touch(ino);
        // A number free on disk (deleted in a committed transaction or by an
        // UNLINK replayed just before; the record is a new inode reusing it): the
        // bytes past a short record are the dead inode's in-inode xattr area. The
        // kernel keeps them and so resurrects its xattrs on the new file (its own
        // writer logs 128 + i_extra_isize bytes); here they are cleared. A new
        // inode never has in-inode xattrs a short record would lose: setting one
        // makes the transaction ineligible, so the inode would exist on disk.
        let free_on_disk = !self.fc_inode_bit(ino)?;
        let (blk, off) = self.inode_location(ino)?;
        let isz = self.inode_size;
        let mut rec = self.read_meta(blk)?.data()[off..off + isz].to_vec();
        rec[..I_BLOCK.start].copy_from_slice(&raw[..I_BLOCK.start]);
        rec[I_BLOCK.end..raw.len()].copy_from_slice(&raw[I_BLOCK.end..]);
        if free_on_disk {
            rec[raw.len()..].fill(0);
        }
        let flags = le32(&rec, I_FLAGS);
        if flags & fi::FL_EXTENTS != 0 {
            if le16(&rec, I_BLOCK.start) != EXT_MAGIC {
                rec[I_BLOCK].copy_from_slice(&empty_extent_root());
            }
        } else if flags & fi::FL_INLINE_DATA != 0 {
            rec[I_BLOCK].copy_from_slice(&raw[I_BLOCK]);
        }
        // The checksum fields are stale in the log; the write recomputes them.
        let no_csum = CsumCtx {
            enabled: false,
            ..self.csum
        };
        let inode = Inode::parse(&rec, ino, &no_csum, blk)?;
        self.write_inode(h, ino, &inode)?;
        if inode.links_count == 0 {
            // A deleted inode: e2fsck frees its number; the kernel would stop here.
            if ino >= self.sb.first_ino() {
                self.free_inode(h, ino, inode.is_dir())?;
            }
        } else {
            self.fc_mark_inode_used(h, ino, inode.is_dir())?;
        }
        if inode.is_dir() {
            self.dir_forget(ino);
        }
        Ok(())
    }

    /// ADD_RANGE: map `lblk..lblk+len` to `pblk..`, remapping or converting what is
    /// mapped differently (§9.7).
    #[allow(clippy::too_many_arguments)]
    fn fc_add_range(
        &mut self,
        h: &Handle,
        st: &mut ReplayState,
        ino: u32,
        lblk: u32,
        len: u32,
        pblk: u64,
        unwritten: bool,
    ) -> Result<()> {
        let mut inode = self.fc_extent_inode(ino)?;
        st.touch(ino);
        let end = (lblk as u64 + len as u64).min(1 << 32);
        let mut cur = lblk as u64;
        let r = (|| -> Result<()> {
            while cur < end {
                let want = pblk + (cur - lblk as u64);
                match self.ext_map(ino, &inode, cur as u32)? {
                    None => {
                        let next = self
                            .ext_next_mapped(ino, &inode, cur as u32)?
                            .map_or(end, |n| (n as u64).clamp(cur + 1, end));
                        let n = (next - cur) as u32;
                        self.ext_insert(h, ino, &mut inode, cur as u32, want, n, unwritten)?;
                        cur = next;
                    }
                    Some(m) => {
                        let n = (m.len as u64).min(end - cur) as u32;
                        if m.pblk != want {
                            // Remapped: the old blocks are freed (bits cleared, kept out
                            // of allocation); re-marked at the end if still used.
                            self.ext_remove(h, ino, &mut inode, cur as u32, cur + n as u64)?;
                            self.ext_insert(h, ino, &mut inode, cur as u32, want, n, unwritten)?;
                        } else if m.unwritten && !unwritten {
                            self.ext_convert_written(h, ino, &mut inode, cur as u32, n)?;
                        } else if !m.unwritten && unwritten {
                            self.ext_remove(h, ino, &mut inode, cur as u32, cur + n as u64)?;
                            self.ext_insert(h, ino, &mut inode, cur as u32, want, n, true)?;
                        }
                        cur += n as u64;
                    }
                }
            }
            Ok(())
        })();
        // The tree blocks written so far belong to this root: keep them together.
        self.write_inode(h, ino, &inode)?;
        r
    }

    /// DEL_RANGE: unmap `lblk..lblk+len`, freeing what was mapped there (§9.7).
    fn fc_del_range(
        &mut self,
        h: &Handle,
        st: &mut ReplayState,
        ino: u32,
        lblk: u32,
        len: u32,
    ) -> Result<()> {
        let mut inode = self.fc_extent_inode(ino)?;
        st.touch(ino);
        let end = (lblk as u64 + len as u64).min(1 << 32);
        let r = self.ext_remove(h, ino, &mut inode, lblk, end);
        self.write_inode(h, ino, &inode)?;
        r.map(|_| ())
    }

    /// CREAT: the inode (written by the INODE record before it) becomes used and
    /// named; a directory gets its '.'/'..' block (§9.7).
    fn fc_creat(&mut self, h: &Handle, st: &mut ReplayState, d: &Dentry<'_>) -> Result<()> {
        self.fc_check_ino(d.ino)?;
        let mut inode = self.fc_existing(d.ino).ok_or(FsError::NotFound)?;
        self.fc_mark_inode_used(h, d.ino, inode.is_dir())?;
        if inode.is_dir() {
            if self.fc_existing(d.parent).filter(Inode::is_dir).is_none() {
                return Err(FsError::NotFound);
            }
            st.touch(d.ino);
            if inode.has_flag(fi::FL_EXTENTS) && self.ext_map(d.ino, &inode, 0)?.is_none() {
                self.dir_forget(d.ino);
                self.dir_init(h, d.ino, &mut inode, d.parent)?;
            }
            inode.links_count = 2;
            self.write_inode(h, d.ino, &inode)?;
            if self.fc_add_name(h, d, &inode)? {
                self.fc_adjust_dir_links(h, d.parent, 1)?;
            }
            return Ok(());
        }
        self.fc_add_name(h, d, &inode)?;
        inode.links_count = 1;
        self.write_inode(h, d.ino, &inode)
    }

    /// LINK: add the name if it is absent (an existing one is fine, §9.7).
    fn fc_link_tag(&mut self, h: &Handle, d: &Dentry<'_>) -> Result<()> {
        let mut inode = self.fc_existing(d.ino).ok_or(FsError::NotFound)?;
        if self.fc_add_name(h, d, &inode)? {
            inode.links_count = inode.links_count.saturating_add(1);
            self.write_inode(h, d.ino, &inode)?;
        }
        Ok(())
    }

    /// UNLINK: remove the name if it still names this inode; the last link frees the
    /// inode, as the kernel's replay does through eviction (§9.7).
    fn fc_unlink(&mut self, h: &Handle, d: &Dentry<'_>) -> Result<()> {
        let mut inode = self.fc_existing(d.ino).ok_or(FsError::NotFound)?;
        if self.fc_existing(d.parent).filter(Inode::is_dir).is_none() {
            return Err(FsError::NotFound);
        }
        fc_check_name(&d.name)?;
        match self.dir_lookup(d.parent, &d.name)? {
            Some((e, _)) if e == d.ino => {}
            // Missing, or renamed over since: nothing to undo.
            _ => return Ok(()),
        }
        self.dir_remove_entry(h, d.parent, &d.name)?;
        if inode.is_dir() {
            self.fc_adjust_dir_links(h, d.parent, -1)?;
            inode.links_count = 0;
        } else {
            inode.links_count = inode.links_count.saturating_sub(1);
        }
        self.write_inode(h, d.ino, &inode)?;
        if inode.links_count == 0 {
            self.evict_orphan(h, d.ino)?;
        }
        Ok(())
    }

    // ---- end of replay ------------------------------------------------------------

    /// Release held blocks no touched inode maps, set the bits of every block still
    /// mapped by a touched inode and recompute its `i_blocks` (the kernel's
    /// `ext4_fc_set_bitmaps_and_counters` plus `ext4_ext_replay_set_iblocks`).
    fn fc_remark(&mut self, h: &Handle, st: &mut ReplayState) -> Result<()> {
        let mut mapped: Vec<(u64, u64)> = Vec::new();
        for ino in std::mem::take(&mut st.modified) {
            let Some(mut inode) = self.fc_existing(ino) else {
                continue;
            };
            if !inode.has_flag(fi::FL_EXTENTS) {
                continue;
            }
            let (data, tree) = match self.fc_inode_blocks(ino, &inode) {
                Ok(x) => x,
                Err(e) if skippable(&e) => {
                    tracing::warn!("fast-commit replay: inode {ino}: {e}");
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut n = tree.len() as u64 + u64::from(inode.file_acl != 0);
            for &(p, l) in &data {
                mapped.push((p, p.saturating_add(l as u64)));
                n += l as u64;
            }
            mapped.extend(tree.iter().map(|&t| (t, t + 1)));
            let sectors = n * (self.bs as u64 / 512);
            if inode.blocks_512(self.bs) != sectors {
                inode.set_blocks_512(sectors, self.bs);
                self.write_inode(h, ino, &inode)?;
            }
            if inode.is_dir() {
                self.dir_forget(ino);
            }
            st.report.inodes += 1;
        }
        let mapped = merge_ranges(mapped);
        for (s, e) in subtract_ranges(merge_ranges(std::mem::take(&mut st.held)), &mapped) {
            self.fc_set_blocks(h, s, e - s, false)?;
        }
        for &(s, e) in &mapped {
            self.fc_set_blocks(h, s, e - s, true)?;
        }
        Ok(())
    }

    /// Recompute every group's free counts and bitmap checksums from its bitmaps,
    /// then the superblock totals (what e2fsck does after its fast-commit replay). A
    /// replay interrupted by a crash can leave a bitmap already in its final state
    /// while its descriptor was lost, so nothing here relies on bits having changed.
    fn fc_recount(&mut self, h: &Handle) -> Result<()> {
        let cpg = self.sb.clusters_per_group();
        // 32-byte descriptors keep only the low half of bitmap checksums.
        let mask = if self.sb.desc_size() >= 64 {
            u32::MAX
        } else {
            0xFFFF
        };
        for g in 0..self.groups {
            let gd = self.gds[g as usize];
            let mut new = gd;
            if !gd.has_flag(BG_BLOCK_UNINIT) {
                let n = self.sb.blocks_in_group(g) as usize;
                let b = self.read_meta(gd.block_bitmap)?;
                let d = b.data();
                new.free_blocks_count = bitmap::count_zeros(&d, n) as u32;
                if self.csum.enabled {
                    new.block_bitmap_csum = bitmap::checksum(&d, cpg, &self.csum) & mask;
                }
            }
            if !gd.has_flag(BG_INODE_UNINIT) {
                let b = self.read_meta(gd.inode_bitmap)?;
                let d = b.data();
                new.free_inodes_count = bitmap::count_zeros(&d, self.ipg as usize) as u32;
                if self.csum.enabled {
                    new.inode_bitmap_csum = bitmap::checksum(&d, self.ipg, &self.csum) & mask;
                }
            }
            if new != gd {
                self.gds[g as usize] = new;
                self.write_gd(h, g)?;
            }
        }
        // The totals are only refreshed in memory: the mount writes the superblock
        // directly right after journal recovery, and keeping it out of the replay's
        // transaction means a torn home write of it (two sectors) can never stop
        // the next mount before recovery.
        self.refresh_super_counts();
        Ok(())
    }

    // ---- helpers ------------------------------------------------------------------

    /// Inode numbers a record may name: the root or a non-reserved inode.
    fn fc_check_ino(&self, ino: u32) -> Result<()> {
        if ino == fi::ROOT_INO || (ino >= self.sb.first_ino() && ino <= self.sb.inodes_count()) {
            Ok(())
        } else {
            Err(FsError::Invalid(
                "fast-commit record names a reserved or invalid inode",
            ))
        }
    }

    /// The inode if it exists in the kernel's sense (`ext4_iget` succeeds: readable,
    /// checksum good, in use with at least one link).
    fn fc_existing(&mut self, ino: u32) -> Option<Inode> {
        self.fc_check_ino(ino).ok()?;
        let i = self.read_inode(ino).ok()?;
        (i.mode != 0 && i.links_count > 0).then_some(i)
    }

    /// An existing extent-mapped inode for a range record.
    fn fc_extent_inode(&mut self, ino: u32) -> Result<Inode> {
        let inode = self.fc_existing(ino).ok_or(FsError::NotFound)?;
        if !inode.has_flag(fi::FL_EXTENTS) {
            return Err(FsError::NotSupported(format!(
                "range record for block-mapped inode {ino}"
            )));
        }
        Ok(inode)
    }

    /// Add `d.name -> d.ino` to `d.parent` unless the name exists; whether it added.
    fn fc_add_name(&mut self, h: &Handle, d: &Dentry<'_>, inode: &Inode) -> Result<bool> {
        fc_check_name(&d.name)?;
        if self.fc_existing(d.parent).filter(Inode::is_dir).is_none() {
            return Err(FsError::NotFound);
        }
        if self.dir_lookup(d.parent, &d.name)?.is_some() {
            return Ok(false);
        }
        let ft = fi::file_type_of_mode(inode.mode);
        self.dir_add_entry(h, d.parent, &d.name, d.ino, ft)?;
        Ok(true)
    }

    /// A subdirectory appeared in / left `dir` (`i_links_count` rules of §4.9).
    fn fc_adjust_dir_links(&mut self, h: &Handle, dir: u32, delta: i32) -> Result<()> {
        let mut d = self.read_inode(dir)?;
        if delta > 0 {
            if d.links_count >= 2 && d.links_count < 64999 {
                d.links_count += 1;
            } else {
                d.links_count = 1;
            }
        } else if d.links_count > 2 {
            d.links_count -= 1;
        }
        self.write_inode(h, dir, &d)
    }

    /// Data runs and tree blocks of an extent-mapped inode, every node verified.
    fn fc_inode_blocks(&mut self, ino: u32, inode: &Inode) -> Result<InodeBlocks> {
        let mut data = Vec::new();
        let mut tree = Vec::new();
        if !inode.has_flag(fi::FL_EXTENTS) {
            return Ok((data, tree));
        }
        let root = NodeRef::parse_root(&inode.block, ino)?;
        if root.is_leaf() {
            data.extend(root.extents().map(|e| (e.pblk, e.len)));
            return Ok((data, tree));
        }
        let mut stack: Vec<(u64, u16)> = root
            .indexes()
            .map(|x| (x.child, root.depth() - 1))
            .collect();
        let mut seen = HashSet::new();
        while let Some((blk, depth)) = stack.pop() {
            if !seen.insert(blk) || tree.len() >= MAX_TREE_BLOCKS {
                return Err(FsError::corrupt(format!(
                    "inode {ino}: extent tree block {blk} referenced twice"
                )));
            }
            tree.push(blk);
            let buf = self.read_meta(blk)?;
            let d = buf.data();
            let node =
                NodeRef::parse_block(&d, blk, Some(depth), &self.csum, ino, inode.generation)?;
            if node.is_leaf() {
                data.extend(node.extents().map(|e| (e.pblk, e.len)));
            } else {
                stack.extend(node.indexes().map(|x| (x.child, depth - 1)));
            }
        }
        Ok((data, tree))
    }

    /// Set (`used`) or clear block bits `start..start+count`, keeping the group's
    /// free count and bitmap checksum in step. Blocks outside the file system's data
    /// range are ignored. Returns the runs `[s, e)` whose bits changed.
    fn fc_set_blocks(
        &mut self,
        h: &Handle,
        start: u64,
        count: u64,
        used: bool,
    ) -> Result<Vec<(u64, u64)>> {
        let mut flipped: Vec<(u64, u64)> = Vec::new();
        let s = start.max(self.sb.first_data_block() as u64);
        let end = start.saturating_add(count).min(self.sb.blocks_count());
        let mut b = s;
        while b < end {
            let g = self.block_group(b);
            let gfirst = self.sb.group_first_block(g);
            let gend = (gfirst + self.sb.blocks_in_group(g) as u64).min(end);
            self.init_block_bitmap(h, g)?;
            let gd = self.gds[g as usize];
            let cpg = self.sb.clusters_per_group();
            let csum = self.csum;
            let (lo, hi) = ((b - gfirst) as usize, (gend - gfirst) as usize);
            let (changed, c) = self.modify_meta(h, gd.block_bitmap, |d| {
                let mut n = 0u32;
                for i in lo..hi {
                    if bitmap::test_bit(d, i) != used {
                        if used {
                            bitmap::set_bit(d, i);
                        } else {
                            bitmap::clear_bit(d, i);
                        }
                        n += 1;
                        let blk = gfirst + i as u64;
                        match flipped.last_mut() {
                            Some(r) if r.1 == blk => r.1 += 1,
                            _ => flipped.push((blk, blk + 1)),
                        }
                    }
                }
                (n, bitmap::checksum(d, cpg, &csum))
            })?;
            if changed > 0 {
                let bpg = self.bpg;
                let gdm = &mut self.gds[g as usize];
                gdm.free_blocks_count = if used {
                    gdm.free_blocks_count.saturating_sub(changed)
                } else {
                    (gdm.free_blocks_count + changed).min(bpg)
                };
                if csum.enabled {
                    gdm.block_bitmap_csum = c;
                }
                self.write_gd(h, g)?;
            }
            b = gend;
        }
        Ok(flipped)
    }

    /// Whether the inode's bit is set in its group's inode bitmap (an
    /// INODE_UNINIT group has none set).
    fn fc_inode_bit(&mut self, ino: u32) -> Result<bool> {
        let g = self.inode_group(ino);
        let gd = self.gds[g as usize];
        if gd.has_flag(BG_INODE_UNINIT) {
            return Ok(false);
        }
        let bit = ((ino - 1) % self.ipg) as usize;
        let b = self.read_meta(gd.inode_bitmap)?;
        let d = b.data();
        Ok(bitmap::test_bit(&d, bit))
    }

    /// The kernel's `ext4_mark_inode_used`: set the inode's bit, initialising an
    /// INODE_UNINIT group and moving `bg_itable_unused` past it (§3.2).
    fn fc_mark_inode_used(&mut self, h: &Handle, ino: u32, is_dir: bool) -> Result<()> {
        if ino < self.sb.first_ino() || ino > self.sb.inodes_count() {
            return Ok(());
        }
        let g = self.inode_group(ino);
        let bit = ((ino - 1) % self.ipg) as usize;
        let ipg = self.ipg;
        let csum = self.csum;
        self.init_block_bitmap(h, g)?;
        let gd = self.gds[g as usize];
        if gd.has_flag(BG_INODE_UNINIT) {
            let mut bm = vec![0u8; self.bs];
            bitmap::set_padding(&mut bm, ipg as usize);
            self.new_meta(h, gd.inode_bitmap, |d| d.copy_from_slice(&bm))?;
            let gdm = &mut self.gds[g as usize];
            gdm.flags &= !BG_INODE_UNINIT;
            gdm.itable_unused = ipg;
            gdm.free_inodes_count = ipg;
        }
        let gd = self.gds[g as usize];
        let (was, c) = self.modify_meta(h, gd.inode_bitmap, |d| {
            let was = bitmap::test_bit(d, bit);
            bitmap::set_bit(d, bit);
            (was, bitmap::checksum(d, ipg, &csum))
        })?;
        let gdm = &mut self.gds[g as usize];
        if !was {
            gdm.free_inodes_count = gdm.free_inodes_count.saturating_sub(1);
            if is_dir {
                gdm.used_dirs_count += 1;
            }
        }
        if bit as u32 + 1 > ipg.saturating_sub(gdm.itable_unused) {
            gdm.itable_unused = ipg - (bit as u32 + 1);
        }
        if csum.enabled {
            gdm.inode_bitmap_csum = c;
        }
        self.write_gd(h, g)
    }
}

/// A device whose writes stay in memory (whole blocks), read back over the real
/// device: the replay is computed here and committed afterwards as one transaction.
struct Overlay {
    dev: DeviceRef,
    bs: u64,
    blocks: Mutex<BTreeMap<u64, Vec<u8>>>,
}

impl Overlay {
    fn new(dev: DeviceRef, bs: usize) -> Overlay {
        Overlay {
            dev,
            bs: bs as u64,
            blocks: Mutex::new(BTreeMap::new()),
        }
    }

    /// The blocks written, by block number.
    fn take(&self) -> BTreeMap<u64, Vec<u8>> {
        std::mem::take(&mut self.blocks.lock())
    }
}

impl BlockDevice for Overlay {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> commitfs_device::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (blk, within) = (pos / self.bs, (pos % self.bs) as usize);
            let n = (self.bs as usize - within).min(buf.len() - done);
            let piece = &mut buf[done..done + n];
            match self.blocks.lock().get(&blk) {
                Some(b) => piece.copy_from_slice(&b[within..within + n]),
                None => self.dev.read_at(pos, piece, cat)?,
            }
            done += n;
        }
        Ok(())
    }

    fn write_at(
        &self,
        offset: u64,
        buf: &[u8],
        cat: IoCategory,
        _fua: bool,
    ) -> commitfs_device::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let (blk, within) = (pos / self.bs, (pos % self.bs) as usize);
            let n = (self.bs as usize - within).min(buf.len() - done);
            let mut map = self.blocks.lock();
            let b = match map.entry(blk) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let mut b = vec![0u8; self.bs as usize];
                    if n < self.bs as usize {
                        self.dev.read_at(blk * self.bs, &mut b, cat)?;
                    }
                    e.insert(b)
                }
            };
            b[within..within + n].copy_from_slice(&buf[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn flush(&self) -> commitfs_device::Result<()> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn is_read_only(&self) -> bool {
        false
    }
    fn stats(&self) -> &IoStats {
        self.dev.stats()
    }
}

/// Names a directory can hold.
fn fc_check_name(name: &[u8]) -> Result<()> {
    if name.is_empty()
        || name.len() > 255
        || name == b"."
        || name == b".."
        || name.contains(&b'/')
        || name.contains(&0)
    {
        return Err(FsError::Invalid("bad name in a fast-commit record"));
    }
    Ok(())
}

/// Sort and merge half-open ranges.
fn merge_ranges(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.retain(|r| r.0 < r.1);
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// `a` minus `b`, both sorted and merged.
fn subtract_ranges(a: Vec<(u64, u64)>, b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut j = 0;
    for (mut s, e) in a {
        while j < b.len() && b[j].1 <= s {
            j += 1;
        }
        let mut k = j;
        while s < e {
            match b.get(k) {
                Some(&(bs, be)) if bs < e => {
                    if bs > s {
                        out.push((s, bs));
                    }
                    s = s.max(be);
                    k += 1;
                }
                _ => {
                    out.push((s, e));
                    s = e;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_arithmetic() {
        assert_eq!(
            merge_ranges(vec![(5, 9), (1, 3), (3, 4), (8, 12), (20, 20)]),
            vec![(1, 4), (5, 12)]
        );
        let b = merge_ranges(vec![(2, 4), (6, 7), (10, 30)]);
        assert_eq!(
            subtract_ranges(vec![(0, 12), (15, 20), (30, 33)], &b),
            vec![(0, 2), (4, 6), (7, 10), (30, 33)]
        );
        assert_eq!(subtract_ranges(vec![(3, 4)], &b), vec![]);
        assert_eq!(subtract_ranges(vec![(0, 5)], &[]), vec![(0, 5)]);
    }
}
