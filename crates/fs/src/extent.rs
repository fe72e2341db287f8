//! Extent tree operations (STUB by the lead: the extent engineer replaces the bodies;
//! signatures are the contract used by file.rs, dir.rs and ops.rs).
//!
//! i_blocks rule (the contract between this module and its callers): extent *tree*
//! blocks are charged/uncharged here (`ext_insert` charges a new tree block,
//! `ext_remove` uncharges freed tree blocks); *data* blocks are charged by the caller
//! that allocated them and uncharged by the caller of `ext_remove`, using its
//! return value (the number of data blocks freed). Data blocks are allocated by the
//! caller (`alloc_blocks`) and freed here (`free_blocks`) when unmapped.

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

impl Inner {
    /// The extent piece covering `lblk` (from `lblk` to the end of its extent), or
    /// `None` for a hole.
    pub fn ext_map(&mut self, _ino: u32, _inode: &Inode, _lblk: u32) -> Result<Option<Mapping>> {
        Err(FsError::NotSupported("extent stub".into()))
    }
    /// First mapped logical block >= `lblk`.
    pub fn ext_next_mapped(&mut self, _ino: u32, _inode: &Inode, _lblk: u32) -> Result<Option<u32>> {
        Err(FsError::NotSupported("extent stub".into()))
    }
    /// Map a range that is currently a hole. Caller writes the inode afterwards.
    #[allow(clippy::too_many_arguments)]
    pub fn ext_insert(
        &mut self,
        _h: &Handle,
        _ino: u32,
        _inode: &mut Inode,
        _lblk: u32,
        _pblk: u64,
        _len: u32,
        _unwritten: bool,
    ) -> Result<()> {
        Err(FsError::NotSupported("extent stub".into()))
    }
    /// Unmap `[start, end)`, freeing data and tree blocks. Returns blocks freed.
    pub fn ext_remove(
        &mut self,
        _h: &Handle,
        _ino: u32,
        _inode: &mut Inode,
        _start: u32,
        _end: u64,
    ) -> Result<u64> {
        Err(FsError::NotSupported("extent stub".into()))
    }
    /// Mark `[lblk, lblk+len)` written inside unwritten extents.
    pub fn ext_convert_written(
        &mut self,
        _h: &Handle,
        _ino: u32,
        _inode: &mut Inode,
        _lblk: u32,
        _len: u32,
    ) -> Result<()> {
        Err(FsError::NotSupported("extent stub".into()))
    }
    /// All leaf extents in order.
    pub fn ext_list(&mut self, _ino: u32, _inode: &Inode) -> Result<Vec<Mapping>> {
        Err(FsError::NotSupported("extent stub".into()))
    }
}
