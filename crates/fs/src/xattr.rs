//! Extended attributes (STUB by the lead: the xattr engineer replaces this file;
//! signatures are the contract used by ops.rs and lib.rs).

use commitfs_format::inode::Inode;
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::Inner;
use crate::types::XattrFlags;

impl Inner {
    pub fn xattr_get(&mut self, _ino: u32, _name: &[u8]) -> Result<Vec<u8>> {
        Err(FsError::NotSupported("xattr stub".into()))
    }
    pub fn xattr_list(&mut self, _ino: u32) -> Result<Vec<Vec<u8>>> {
        Err(FsError::NotSupported("xattr stub".into()))
    }
    pub fn xattr_set(&mut self, _h: &Handle, _ino: u32, _name: &[u8], _value: &[u8], _flags: XattrFlags) -> Result<()> {
        Err(FsError::NotSupported("xattr stub".into()))
    }
    pub fn xattr_remove(&mut self, _h: &Handle, _ino: u32, _name: &[u8]) -> Result<()> {
        Err(FsError::NotSupported("xattr stub".into()))
    }
    /// Release the xattr block of an inode being deleted (refcount-aware).
    pub fn xattr_free_inode(&mut self, _h: &Handle, _ino: u32, _inode: &mut Inode) -> Result<()> {
        Ok(())
    }
}
