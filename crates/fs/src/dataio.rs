//! File data I/O outside the file-system lock (issue #10, design C.2; docs/
//! ARCHITECTURE.md "Implemented: concurrent core, step 1").
//!
//! A write maps and allocates its blocks and updates the inode under `Inner`
//! inside a journal handle ([`crate::inner::Inner::write_begin`]), releases
//! `Inner`, writes the data here under the inode's lock ([`crate::ilock`]), and
//! only then stops the handle: the transaction that exposes the new blocks cannot
//! commit before their data is written (ordered mode). A read maps under `Inner`
//! and reads here under the inode's lock (shared).
//!
//! Fast commits are built under `Inner` from the live inodes and extent trees, so
//! a write between its metadata step and its data write (*in flight*) must not be
//! logged by one: [`Inflight`] counts such writes and `fc_plan` waits for them
//! (the kernel's fast commit does the same with `jbd2_journal_lock_updates`
//! before it snapshots). An in-flight write never takes `Inner`, so the wait
//! ends.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use commitfs_device::{DeviceRef, IoCategory};
use commitfs_journal::{Handle, Journal};
use parking_lot::{Condvar, Mutex};

use crate::error::{FsError, Result};

/// Inodes a data write failed for since their last fsync: the next fsync
/// reports EIO once (errseq-like). Its own lock, so a write can record a failure
/// without `Inner`.
#[derive(Default)]
pub(crate) struct DataErrors(Mutex<HashSet<u32>>);

impl DataErrors {
    pub fn insert(&self, ino: u32) {
        self.0.lock().insert(ino);
    }
    /// Take the failure of `ino`, if any.
    pub fn take(&self, ino: u32) -> bool {
        self.0.lock().remove(&ino)
    }
}

/// The key a page-cache cut's writes are in flight under: they span files,
/// and no inode has number 0.
pub(crate) const CUT_WRITES: u32 = 0;

/// Data writes between their metadata step and the end of their device write,
/// per inode (see the module doc).
#[derive(Default)]
pub(crate) struct Inflight {
    m: Mutex<HashMap<u32, u32>>,
    cv: Condvar,
}

impl Inflight {
    /// Mark a write of `ino` in flight until the guard drops.
    pub fn begin(self: &Arc<Self>, ino: u32) -> InflightGuard {
        *self.m.lock().entry(ino).or_insert(0) += 1;
        InflightGuard {
            set: self.clone(),
            ino,
        }
    }

    /// Wait until no write is in flight. Called under `Inner` (which keeps new
    /// writes from starting); in-flight writes never take `Inner`.
    /// Gives up once `stop()` (the journal aborted: a commit's data that
    /// will never be written).
    pub fn wait_idle_or(&self, stop: &dyn Fn() -> bool) {
        let mut m = self.m.lock();
        while !m.is_empty() && !stop() {
            self.cv
                .wait_for(&mut m, std::time::Duration::from_millis(50));
        }
    }
}

pub(crate) struct InflightGuard {
    set: Arc<Inflight>,
    ino: u32,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        let mut m = self.set.m.lock();
        if let Some(c) = m.get_mut(&self.ino) {
            *c -= 1;
            if *c == 0 {
                m.remove(&self.ino);
            }
        }
        if m.is_empty() {
            self.set.cv.notify_all();
        }
    }
}

/// One contiguous piece of a write: `span` bytes of the caller's buffer from
/// `pos`, at byte `in_blk` of device blocks from `pblk` (file block `lblk`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    pub lblk: u32,
    pub pblk: u64,
    pub in_blk: usize,
    pub span: usize,
    pub pos: usize,
    /// Newly allocated blocks: the rest of a partial block is zeros.
    pub fresh: bool,
    /// Was an unwritten extent (converted by the metadata step): zeros too.
    pub unwritten: bool,
    /// File blocks from `lblk` that the metadata step newly mapped or converted
    /// (undone if the data write fails).
    pub changed: u32,
}

/// A write whose metadata step is done: the handle that pins its transaction
/// and the pieces to write. Dropping it ends the in-flight mark and stops the
/// handle (the data must be written, or the failure undone, by then).
pub(crate) struct WriteBegun {
    pub chunks: Vec<Chunk>,
    pub old_size: u64,
    pub inflight: InflightGuard,
    pub h: Handle,
}

/// One piece of a read: `span` bytes into the caller's buffer at `pos`, from
/// byte `in_blk` of device blocks from `pblk` (`None`: a hole or unwritten
/// extent, zeros).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seg {
    pub pblk: Option<u64>,
    pub in_blk: usize,
    pub span: usize,
    pub pos: usize,
}

/// Device access for file data without `Inner`: what `Inner::read_data` and
/// `Inner::write_data` need, shared.
#[derive(Clone)]
pub(crate) struct DataIo {
    pub dev: DeviceRef,
    pub journal: Arc<Journal>,
    pub bs: usize,
    pub first_data_block: u64,
    pub blocks_count: u64,
    pub errors: Arc<crate::errors::ErrorState>,
    pub read_only: bool,
}

impl DataIo {
    pub(crate) fn check_range(&self, pblk: u64, len: usize) -> Result<()> {
        let nblocks = len.div_ceil(self.bs) as u64;
        if pblk < self.first_data_block || pblk.saturating_add(nblocks) > self.blocks_count {
            return Err(FsError::corrupt(format!(
                "data block {pblk} (+{nblocks}) outside the file system"
            )));
        }
        Ok(())
    }

    pub fn read(&self, pblk: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(pblk, buf.len())?;
        self.dev
            .read_at(pblk * self.bs as u64, buf, IoCategory::Data)?;
        Ok(())
    }

    /// As `Inner::write_data`: refused once nothing may change, reported to the
    /// single-flush tracking (`note_data`, under the writer's handle) and to
    /// group flushing (`Journal::note_data_written`, once the write completed).
    pub fn write(&self, pblk: u64, buf: &[u8]) -> Result<()> {
        self.write_noting(pblk, buf, true)
    }

    /// [`Self::write`]; without `note`, not reported to single-flush tracking
    /// (a full commit's cut reports its blocks at the tid switch instead).
    pub fn write_noting(&self, pblk: u64, buf: &[u8], note: bool) -> Result<()> {
        if self.errors.is_dead() {
            return Err(FsError::Shutdown);
        }
        if self.read_only || self.errors.is_read_only() || self.journal.is_aborted() {
            return Err(FsError::ReadOnly);
        }
        self.check_range(pblk, buf.len())?;
        self.dev
            .write_at(pblk * self.bs as u64, buf, IoCategory::Data, false)?;
        if note {
            self.journal
                .note_data(pblk, buf.len().div_ceil(self.bs) as u64);
        }
        self.journal.note_data_written();
        Ok(())
    }

    /// Several [`Self::write_noting`]s at once: `(first block, pieces)`, the
    /// pieces (whole blocks) written contiguously from it; the device submits
    /// them together where it can (`BlockDevice::write_batch`).
    pub fn write_batch(&self, writes: &[(u64, Vec<&[u8]>)], note: bool) -> Result<()> {
        if self.errors.is_dead() {
            return Err(FsError::Shutdown);
        }
        if self.read_only || self.errors.is_read_only() || self.journal.is_aborted() {
            return Err(FsError::ReadOnly);
        }
        let bs = self.bs as u64;
        let mut dev_writes = Vec::with_capacity(writes.len());
        for (pblk, pieces) in writes {
            let len: usize = pieces.iter().map(|p| p.len()).sum();
            self.check_range(*pblk, len)?;
            dev_writes.push((pblk * bs, &pieces[..]));
        }
        self.dev.write_batch(&dev_writes, IoCategory::Data)?;
        if note {
            for (pblk, pieces) in writes {
                let len: usize = pieces.iter().map(|p| p.len()).sum();
                self.journal.note_data(*pblk, len.div_ceil(self.bs) as u64);
            }
        }
        self.journal.note_data_written();
        Ok(())
    }

    /// Write one piece: whole blocks directly; a partial head/tail block is
    /// read-modify-written unless it is new or was unwritten (then the rest is
    /// zeros, never stale data).
    pub fn write_chunk(&self, c: &Chunk, src: &[u8]) -> Result<()> {
        let bs = self.bs;
        if c.in_blk == 0 && c.span.is_multiple_of(bs) {
            return self.write(c.pblk, src);
        }
        let covered = (c.in_blk + c.span).div_ceil(bs);
        let mut tmp = vec![0u8; covered * bs];
        if !c.fresh && !c.unwritten {
            if c.in_blk != 0 {
                self.read(c.pblk, &mut tmp[..bs])?;
            }
            let tail_end = c.in_blk + c.span;
            if !tail_end.is_multiple_of(bs) && (covered > 1 || c.in_blk == 0) {
                let last = covered - 1;
                self.read(c.pblk + last as u64, &mut tmp[last * bs..])?;
            }
        }
        tmp[c.in_blk..c.in_blk + c.span].copy_from_slice(src);
        self.write(c.pblk, &tmp)
    }

    /// Read the pieces of a read plan into `buf`.
    pub fn read_segs(&self, segs: &[Seg], buf: &mut [u8]) -> Result<()> {
        let bs = self.bs;
        for s in segs {
            let dst = &mut buf[s.pos..s.pos + s.span];
            match s.pblk {
                Some(pblk) if s.in_blk == 0 && s.span.is_multiple_of(bs) => self.read(pblk, dst)?,
                Some(pblk) => {
                    let nblk = (s.in_blk + s.span).div_ceil(bs);
                    let mut tmp = vec![0u8; nblk * bs];
                    self.read(pblk, &mut tmp)?;
                    dst.copy_from_slice(&tmp[s.in_blk..s.in_blk + s.span]);
                }
                None => dst.fill(0),
            }
        }
        Ok(())
    }
}
