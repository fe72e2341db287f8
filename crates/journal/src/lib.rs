//! The journal layer: metadata buffers, handles and transactions.
//!
//! Like the kernel's jbd2/ext4 split, this crate knows blocks, never files. The file
//! system changes metadata only through the handle protocol:
//!
//! ```text
//! let h = journal.start(credits)?;       // join the running transaction
//! let b = journal.bread(blocknr)?;       // cached metadata buffer
//! journal.get_write_access(&h, &b)?;     // declare intent (freezes a copy later)
//! b.data_mut()[..] = ...;                // modify the live version
//! journal.dirty_metadata(&h, &b);        // the transaction now owns the change
//! journal.stop(h)?;
//! ```
//!
//! A [`Buffer`] is the one home of "several versions of a metadata block"
//! (DEVELOPERS.md): the live version lives in `data`; the journal issue adds the
//! frozen copy per committing transaction and the last committed version beside it,
//! which CJFS shadow copies, exF2FS isolation and FJS subblock tracking all view.
//!
//! In this first version the journal runs in *write-home* mode: a commit writes every
//! dirty buffer to its home location and flushes the device. That is what a clean
//! unmount and `sync` need; crash atomicity through the on-disk JBD2 log comes with
//! the journal issue without changing this API.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use commitfs_device::{DeviceError, DeviceRef, IoCategory};
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Errors of the journal layer.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("journal is read-only")]
    ReadOnly,
    #[error("block {0} is beyond the end of the device")]
    OutOfRange(u64),
    #[error("journal aborted after an earlier write error")]
    Aborted,
}

pub type Result<T> = std::result::Result<T, JournalError>;

/// One cached metadata block.
pub struct Buffer {
    blocknr: u64,
    data: RwLock<Box<[u8]>>,
    /// Modified by a transaction and not yet written home.
    dirty: AtomicBool,
}

impl Buffer {
    pub fn blocknr(&self) -> u64 {
        self.blocknr
    }
    /// The live version, for reading.
    pub fn data(&self) -> RwLockReadGuard<'_, Box<[u8]>> {
        self.data.read()
    }
    /// The live version, for writing. Call only between `get_write_access` and
    /// `dirty_metadata` of a handle.
    pub fn data_mut(&self) -> RwLockWriteGuard<'_, Box<[u8]>> {
        self.data.write()
    }
    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Acquire)
    }
}

/// A handle: one atomic file-system operation's membership in a transaction.
#[derive(Debug)]
#[must_use = "a handle must be stopped"]
pub struct Handle {
    tid: u64,
    credits: u32,
}

impl Handle {
    pub fn tid(&self) -> u64 {
        self.tid
    }
    pub fn credits(&self) -> u32 {
        self.credits
    }
}

/// Transaction states (the journal issue uses all of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxState {
    Running,
    Locked,
    Committing,
    Committed,
    Checkpointed,
}

struct Running {
    tid: u64,
    /// Dirty buffers owned by the running transaction, by block number (sorted so a
    /// commit writes home in ascending order).
    buffers: BTreeMap<u64, Arc<Buffer>>,
    handles: u32,
}

/// Journal counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct JournalStats {
    pub commits: u64,
    pub buffers_written: u64,
    pub handles: u64,
}

/// Buffer cache plus transaction manager.
pub struct Journal {
    dev: DeviceRef,
    block_size: usize,
    blocks: u64,
    read_only: bool,
    cache: Mutex<HashMap<u64, Arc<Buffer>>>,
    running: Mutex<Running>,
    /// Commits are serialised; a commit holds this while writing.
    commit_lock: Mutex<()>,
    aborted: AtomicBool,
    commits: AtomicU64,
    buffers_written: AtomicU64,
    handles: AtomicU64,
    cache_limit: usize,
}

impl Journal {
    pub fn new(dev: DeviceRef, block_size: usize, read_only: bool) -> Journal {
        let blocks = dev.size() / block_size as u64;
        Journal {
            dev,
            block_size,
            blocks,
            read_only,
            cache: Mutex::new(HashMap::new()),
            running: Mutex::new(Running {
                tid: 1,
                buffers: BTreeMap::new(),
                handles: 0,
            }),
            commit_lock: Mutex::new(()),
            aborted: AtomicBool::new(false),
            commits: AtomicU64::new(0),
            buffers_written: AtomicU64::new(0),
            handles: AtomicU64::new(0),
            cache_limit: 1 << 18,
        }
    }

    pub fn device(&self) -> &DeviceRef {
        &self.dev
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Read a metadata block through the cache.
    pub fn bread(&self, blocknr: u64) -> Result<Arc<Buffer>> {
        if let Some(b) = self.cache.lock().get(&blocknr) {
            return Ok(b.clone());
        }
        if blocknr >= self.blocks {
            return Err(JournalError::OutOfRange(blocknr));
        }
        let mut data = vec![0u8; self.block_size].into_boxed_slice();
        self.dev.read_at(
            blocknr * self.block_size as u64,
            &mut data,
            IoCategory::Metadata,
        )?;
        let mut cache = self.cache.lock();
        if cache.len() >= self.cache_limit {
            // Drop clean buffers nobody holds; dirty ones stay until written home.
            cache.retain(|_, b| b.is_dirty() || Arc::strong_count(b) > 1);
        }
        let b = cache
            .entry(blocknr)
            .or_insert_with(|| {
                Arc::new(Buffer {
                    blocknr,
                    data: RwLock::new(data),
                    dirty: AtomicBool::new(false),
                })
            })
            .clone();
        Ok(b)
    }

    /// A buffer for a newly allocated metadata block: zero-filled, never read from
    /// the device (its old content is garbage by definition).
    pub fn getblk_zeroed(&self, blocknr: u64) -> Result<Arc<Buffer>> {
        if blocknr >= self.blocks {
            return Err(JournalError::OutOfRange(blocknr));
        }
        let mut cache = self.cache.lock();
        let b = cache
            .entry(blocknr)
            .or_insert_with(|| {
                Arc::new(Buffer {
                    blocknr,
                    data: RwLock::new(vec![0u8; self.block_size].into_boxed_slice()),
                    dirty: AtomicBool::new(false),
                })
            })
            .clone();
        b.data.write().fill(0);
        Ok(b)
    }

    /// Start a handle in the running transaction.
    pub fn start(&self, credits: u32) -> Result<Handle> {
        if self.read_only {
            return Err(JournalError::ReadOnly);
        }
        if self.aborted.load(Ordering::Acquire) {
            return Err(JournalError::Aborted);
        }
        let mut r = self.running.lock();
        r.handles += 1;
        self.handles.fetch_add(1, Ordering::Relaxed);
        Ok(Handle { tid: r.tid, credits })
    }

    /// Declare that `h` is about to modify `b`.
    pub fn get_write_access(&self, _h: &Handle, _b: &Arc<Buffer>) -> Result<()> {
        if self.read_only {
            return Err(JournalError::ReadOnly);
        }
        Ok(())
    }

    /// The modification of `b` by `h` is complete; the running transaction owns it.
    pub fn dirty_metadata(&self, _h: &Handle, b: &Arc<Buffer>) {
        b.dirty.store(true, Ordering::Release);
        self.running.lock().buffers.insert(b.blocknr, b.clone());
    }

    /// A metadata block was freed: its pending change must never reach the device,
    /// and a later reuse as a data block must not see a stale cached copy.
    pub fn forget(&self, _h: &Handle, blocknr: u64) {
        self.running.lock().buffers.remove(&blocknr);
        if let Some(b) = self.cache.lock().remove(&blocknr) {
            b.dirty.store(false, Ordering::Release);
        }
    }

    pub fn stop(&self, h: Handle) -> Result<()> {
        let mut r = self.running.lock();
        if r.tid == h.tid {
            r.handles = r.handles.saturating_sub(1);
        }
        Ok(())
    }

    /// Commit the running transaction: write its buffers home in block order, then
    /// flush the device cache. Returns the number of buffers written.
    pub fn commit(&self) -> Result<usize> {
        if self.read_only {
            return Ok(0);
        }
        let _c = self.commit_lock.lock();
        let buffers = {
            let mut r = self.running.lock();
            r.tid += 1;
            std::mem::take(&mut r.buffers)
        };
        let n = buffers.len();
        for (blocknr, b) in buffers {
            // Clear first: a change racing with the write re-dirties the buffer and
            // re-queues it, so nothing is lost.
            b.dirty.store(false, Ordering::Release);
            let data = b.data.read();
            if let Err(e) = self.dev.write_at(
                blocknr * self.block_size as u64,
                &data,
                IoCategory::Metadata,
                false,
            ) {
                self.aborted.store(true, Ordering::Release);
                return Err(e.into());
            }
        }
        self.dev.flush()?;
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.buffers_written.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// Number of dirty buffers waiting for the next commit.
    pub fn pending(&self) -> usize {
        self.running.lock().buffers.len()
    }

    pub fn stats(&self) -> JournalStats {
        JournalStats {
            commits: self.commits.load(Ordering::Relaxed),
            buffers_written: self.buffers_written.load(Ordering::Relaxed),
            handles: self.handles.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commitfs_device::{BlockDevice, MemDevice};

    #[test]
    fn commit_writes_dirty_buffers_home_once() {
        let dev = Arc::new(MemDevice::new(64 * 1024));
        let j = Journal::new(dev.clone(), 1024, false);
        let h = j.start(4).unwrap();
        let b = j.bread(5).unwrap();
        j.get_write_access(&h, &b).unwrap();
        b.data_mut()[0] = 0xAB;
        j.dirty_metadata(&h, &b);
        let n = j.getblk_zeroed(9).unwrap();
        j.get_write_access(&h, &n).unwrap();
        n.data_mut()[1] = 0xCD;
        j.dirty_metadata(&h, &n);
        j.forget(&h, 9);
        j.stop(h).unwrap();
        let before = dev.stats().snapshot();
        assert_eq!(j.commit().unwrap(), 1);
        let d = dev.stats().snapshot().since(&before);
        assert_eq!(d.metadata.writes, 1);
        assert_eq!(d.flushes, 1);
        let img = dev.contents();
        assert_eq!(img[5 * 1024], 0xAB);
        assert_eq!(img[9 * 1024 + 1], 0, "forgotten buffer must not be written");
        assert_eq!(j.commit().unwrap(), 0);
    }

    #[test]
    fn read_only_journal_refuses_handles() {
        let dev = Arc::new(MemDevice::new(8192));
        let j = Journal::new(dev, 1024, true);
        assert!(matches!(j.start(1), Err(JournalError::ReadOnly)));
        assert!(j.bread(100).is_err());
    }
}
