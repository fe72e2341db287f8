//! The orphan list (ext4-format.md §4.9): inodes with no links that are still open
//! are chained from `s_last_orphan` through their `i_dtime`, in the same transaction
//! as the unlink, so that a crash frees them at the next mount (ours or the
//! kernel's) instead of leaking their blocks.
//!
//! We keep the classic superblock-rooted list even when the image has the
//! `orphan_file` feature: the kernel and e2fsck process both.

use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::Inner;

impl Inner {
    /// Put `ino` (already written with `links_count == 0`) at the head of the list.
    pub fn orphan_add(&mut self, h: &Handle, ino: u32) -> Result<()> {
        let mut i = self.read_inode(ino)?;
        i.dtime = self.sb.last_orphan();
        self.write_inode(h, ino, &i)?;
        self.sb.set_last_orphan(ino);
        self.orphans_added.insert(ino, h.tid());
        self.write_super(h)
    }

    /// The list member that links to `ino` (0: the superblock), if `ino` is on
    /// the list.
    pub fn orphan_pred(&mut self, ino: u32) -> Result<Option<u32>> {
        let mut cur = self.sb.last_orphan();
        if cur == ino {
            return Ok(Some(0));
        }
        let mut steps = 0u32;
        while cur != 0 {
            steps += 1;
            if steps > self.sb.inodes_count() {
                return Err(FsError::corrupt("orphan list loops"));
            }
            let next = self.read_inode(cur)?.dtime;
            if next == ino {
                return Ok(Some(cur));
            }
            cur = next;
        }
        Ok(None)
    }

    /// Unlink `ino` from the list (before it is freed); `pred` is
    /// [`Self::orphan_pred`]`(ino)`, which the caller needed too.
    pub fn orphan_unlink(&mut self, h: &Handle, ino: u32, pred: Option<u32>) -> Result<()> {
        let next = self.read_inode(ino)?.dtime;
        match pred {
            None => Ok(()),
            Some(0) => {
                self.sb.set_last_orphan(next);
                self.write_super(h)
            }
            Some(p) => {
                let mut pi = self.read_inode(p)?;
                pi.dtime = next;
                self.write_inode(h, p, &pi)
            }
        }
    }

    /// At mount after journal recovery: finish what a crash interrupted. Inodes
    /// with no links are freed; others (interrupted truncates) are cut to `i_size`.
    pub fn process_orphans(&mut self) -> Result<u32> {
        let mut done = 0;
        let mut cur = self.sb.last_orphan();
        while cur != 0 {
            if cur < self.sb.first_ino()
                || cur > self.sb.inodes_count()
                || done > self.sb.inodes_count()
            {
                tracing::warn!("orphan list points at invalid inode {cur}; dropping the rest");
                break;
            }
            let i = self.read_inode(cur)?;
            let next = i.dtime;
            let h = self.start(64)?;
            self.sb.set_last_orphan(next);
            self.write_super(&h)?;
            if i.links_count == 0 {
                self.evict_orphan(&h, cur)?;
            } else {
                let mut i = i;
                i.dtime = 0;
                self.write_inode(&h, cur, &i)?;
                if i.is_reg() {
                    self.truncate_blocks_past_size(&h, cur)?;
                }
            }
            self.stop(h)?;
            done += 1;
            cur = next;
        }
        if done > 0 {
            tracing::info!("orphan cleanup: {done} inodes");
        }
        Ok(done)
    }
}
