//! Per-inode locks for file data I/O (issue #10, design C.2/C.4: data I/O runs
//! under the inode's lock only, never under the file-system lock `Inner`).
//!
//! A reader holds its inode's lock shared, a writer exclusively; every operation
//! that can free or remap an inode's blocks (truncate, fallocate, the last
//! unlink or close, rename over a file) holds it exclusively first. So a reader
//! or writer that mapped blocks under `Inner` and does its device I/O after
//! releasing `Inner` never touches blocks that were freed and reused meanwhile.
//!
//! Lock order (docs/ARCHITECTURE.md, "Implemented: concurrent core, step 1"): an
//! inode lock is always taken *before* `Inner`, never while holding it, and a
//! thread holds at most one inode lock at a time (so stripes sharing a lock
//! cannot deadlock). The locks are striped by inode number: allocation-free, and
//! with [`STRIPES`] stripes unrelated inodes rarely share one (consecutive
//! numbers never do).

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Number of lock stripes (a power of two).
const STRIPES: usize = 1024;

pub(crate) struct InodeLocks {
    stripes: Box<[RwLock<()>]>,
}

impl Default for InodeLocks {
    fn default() -> Self {
        InodeLocks {
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
        }
    }
}

impl InodeLocks {
    fn stripe(&self, ino: u32) -> &RwLock<()> {
        &self.stripes[ino as usize & (STRIPES - 1)]
    }

    /// Shared: reading the inode's data.
    pub fn read(&self, ino: u32) -> RwLockReadGuard<'_, ()> {
        self.stripe(ino).read()
    }

    /// Shared, if no writer holds it now (a front end that must not block).
    pub fn try_read(&self, ino: u32) -> Option<RwLockReadGuard<'_, ()>> {
        self.stripe(ino).try_read()
    }

    /// Exclusive: writing its data, or freeing/remapping its blocks.
    pub fn write(&self, ino: u32) -> RwLockWriteGuard<'_, ()> {
        self.stripe(ino).write()
    }
}
