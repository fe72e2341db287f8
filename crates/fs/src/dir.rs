//! Directory operations (STUB by the lead: the directory engineer replaces this file;
//! signatures are the contract used by ops.rs).

use commitfs_format::inode::Inode;
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::Inner;

/// In-memory directory state (indexes), owned by this module.
#[derive(Default)]
pub struct DirCache {}

impl Inner {
    pub fn dir_lookup(&mut self, _dir: u32, _name: &[u8]) -> Result<Option<(u32, u8)>> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_add_entry(&mut self, _h: &Handle, _dir: u32, _name: &[u8], _ino: u32, _ft: u8) -> Result<()> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_remove_entry(&mut self, _h: &Handle, _dir: u32, _name: &[u8]) -> Result<u32> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_replace_entry(&mut self, _h: &Handle, _dir: u32, _name: &[u8], _ino: u32, _ft: u8) -> Result<u32> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_init(&mut self, _h: &Handle, _dir: u32, _dir_inode: &mut Inode, _parent: u32) -> Result<()> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_set_dotdot(&mut self, _h: &Handle, _dir: u32, _parent: u32) -> Result<()> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_is_empty(&mut self, _dir: u32) -> Result<bool> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_readdir(&mut self, _dir: u32, _offset: u64, _f: &mut dyn FnMut(u32, u8, &[u8], u64) -> bool) -> Result<()> {
        Err(FsError::NotSupported("dir stub".into()))
    }
    pub fn dir_forget(&mut self, _dir: u32) {}
}
