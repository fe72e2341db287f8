//! Extended attributes (ext4-format.md §7, §10 "Xattrs").
//!
//! Placement follows the kernel: an attribute goes into the in-inode area when the
//! whole in-inode set still fits, otherwise into the inode's single xattr block (and
//! leaves the other place). A block shared by several inodes (`h_refcount > 1`, made
//! by the kernel's block sharing) is never modified in place: the inode gets a private
//! copy and the shared block loses one reference. The block is charged to `i_blocks`
//! of every inode that references it (§4.5).
//!
//! POSIX ACLs are converted between the VFS xattr format and ext4's compact on-disk
//! format, as the kernel does, so ACLs set here are the kernel's ACLs.

use commitfs_format::inode::Inode;
use commitfs_format::superblock as sbf;
use commitfs_format::xattr::{self as fx, acl, NameError, Xattr, XattrBlock};
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::{now, Inner};
use crate::types::XattrFlags;

/// The VFS limit on a value (`XATTR_SIZE_MAX`).
const XATTR_SIZE_MAX: usize = 65536;

/// An inode's attributes as found on disk.
struct Loaded {
    ibody: Vec<Xattr>,
    /// The xattr block (`i_file_acl`) and its content.
    block: Option<(u64, XattrBlock)>,
}

impl Loaded {
    fn find(&self, index: u8, suffix: &[u8]) -> Option<&Xattr> {
        let blk = self.block.iter().flat_map(|b| b.1.entries.iter());
        self.ibody
            .iter()
            .chain(blk)
            .find(|e| e.index == index && e.name == suffix)
    }
}

/// Map a full name to its on-disk (index, suffix), with the VFS's errors.
fn parse_name(name: &[u8]) -> Result<(u8, &[u8])> {
    if name.len() > fx::MAX_NAME_LEN {
        return Err(FsError::NameTooLong);
    }
    match fx::split_name(name) {
        // Plain `system.` names (e.g. inline data's `system.data`) are internal to
        // ext4: the kernel has no handler for them and neither lists nor sets them.
        Ok((fx::index::SYSTEM, _)) | Err(NameError::UnknownPrefix) => Err(
            FsError::NotSupported(format!("xattr name {}", String::from_utf8_lossy(name))),
        ),
        Ok(v) => Ok(v),
        Err(NameError::TooLong) => Err(FsError::NameTooLong),
        Err(NameError::EmptySuffix) | Err(NameError::ContainsNul) => {
            Err(FsError::Invalid("bad xattr name"))
        }
    }
}

fn is_acl(index: u8) -> bool {
    index == fx::index::POSIX_ACL_ACCESS || index == fx::index::POSIX_ACL_DEFAULT
}

/// Whether a name is one `xattr_list` reports.
fn listable(index: u8) -> bool {
    index != fx::index::SYSTEM && fx::prefix_of(index).is_some()
}

/// Insert or replace the entry with `e`'s key, keeping the position of an old one.
fn upsert(set: &mut Vec<Xattr>, e: Xattr) {
    match set
        .iter_mut()
        .find(|x| x.index == e.index && x.name == e.name)
    {
        Some(x) => x.value = e.value,
        None => set.push(e),
    }
}

/// Remove the entry with this key; whether one was there.
fn remove_key(set: &mut Vec<Xattr>, index: u8, suffix: &[u8]) -> bool {
    let before = set.len();
    set.retain(|x| !(x.index == index && x.name == suffix));
    set.len() != before
}

impl Inner {
    /// Read an inode's in-inode and block attributes.
    fn xattr_load(&mut self, ino: u32, inode: &Inode) -> Result<Loaded> {
        let (itb, _) = self.inode_location(ino)?;
        let ibody = fx::parse_ibody(&inode.xattr_area, itb)?;
        let block = if inode.file_acl != 0 {
            let blk = self.xattr_check_block_nr(ino, inode.file_acl)?;
            let buf = self.read_meta(blk)?;
            let parsed = fx::parse_block(&buf.data(), blk, &self.csum)?;
            Some((blk, parsed))
        } else {
            None
        };
        Ok(Loaded { ibody, block })
    }

    fn xattr_check_block_nr(&self, ino: u32, blk: u64) -> Result<u64> {
        if blk < self.sb.first_data_block() as u64 || blk >= self.sb.blocks_count() {
            return Err(FsError::corrupt(format!(
                "inode {ino}: xattr block {blk} outside the file system"
            )));
        }
        Ok(blk)
    }

    /// Value of attribute `name` (full name, e.g. `user.foo`).
    pub fn xattr_get(&mut self, ino: u32, name: &[u8]) -> Result<Vec<u8>> {
        let (index, suffix) = parse_name(name)?;
        let inode = self.live_inode(ino)?;
        let l = self.xattr_load(ino, &inode)?;
        let e = l.find(index, suffix).ok_or(FsError::NoData)?;
        if is_acl(index) {
            return acl::from_disk(&e.value).ok_or_else(|| {
                FsError::corrupt(format!("inode {ino}: malformed POSIX ACL on disk"))
            });
        }
        Ok(e.value.clone())
    }

    /// Full names of all attributes, in-inode ones first (as the kernel lists them).
    pub fn xattr_list(&mut self, ino: u32) -> Result<Vec<Vec<u8>>> {
        let inode = self.live_inode(ino)?;
        let l = self.xattr_load(ino, &inode)?;
        let blk = l.block.iter().flat_map(|b| b.1.entries.iter());
        Ok(l
            .ibody
            .iter()
            .chain(blk)
            .filter(|e| listable(e.index))
            .filter_map(|e| e.full_name())
            .collect())
    }

    /// Set attribute `name`. `flags.create`: fail with `Exists` if present;
    /// `flags.replace`: fail with `NoData` if absent. A value that cannot fit even
    /// alone gives `XattrTooBig`; one that does not fit beside the others `NoSpace`.
    pub fn xattr_set(
        &mut self,
        h: &Handle,
        ino: u32,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
    ) -> Result<()> {
        let (index, suffix) = parse_name(name)?;
        if value.len() > XATTR_SIZE_MAX {
            return Err(FsError::XattrTooBig);
        }
        let stored = if is_acl(index) {
            if value.is_empty() {
                // An empty ACL value removes the ACL (the kernel's set_acl(NULL)).
                return self.xattr_change(h, ino, index, suffix, None, flags);
            }
            acl::to_disk(value).ok_or(FsError::Invalid("malformed POSIX ACL"))?
        } else {
            value.to_vec()
        };
        self.xattr_change(h, ino, index, suffix, Some(stored), flags)
    }

    /// Remove attribute `name` (`NoData` if absent).
    pub fn xattr_remove(&mut self, h: &Handle, ino: u32, name: &[u8]) -> Result<()> {
        let (index, suffix) = parse_name(name)?;
        let flags = XattrFlags {
            create: false,
            replace: true,
        };
        self.xattr_change(h, ino, index, suffix, None, flags)
    }

    /// Set (`Some`) or remove (`None`) one attribute; computes the new in-inode and
    /// block sets first, so a failure leaves everything untouched.
    fn xattr_change(
        &mut self,
        h: &Handle,
        ino: u32,
        index: u8,
        suffix: &[u8],
        value: Option<Vec<u8>>,
        flags: XattrFlags,
    ) -> Result<()> {
        if self.read_only {
            return Err(FsError::ReadOnly);
        }
        let mut inode = self.live_inode(ino)?;
        let old = self.xattr_load(ino, &inode)?;
        let existing = old.find(index, suffix);
        if flags.create && existing.is_some() {
            return Err(FsError::Exists);
        }
        if flags.replace && existing.is_none() {
            return Err(FsError::NoData);
        }
        let mut ibody = old.ibody.clone();
        let mut block: Vec<Xattr> = old
            .block
            .as_ref()
            .map(|b| b.1.entries.clone())
            .unwrap_or_default();
        let mut block_changed = false;
        match value {
            None => {
                if existing.is_none() {
                    return Ok(());
                }
                if !remove_key(&mut ibody, index, suffix) {
                    block_changed = remove_key(&mut block, index, suffix);
                }
            }
            Some(v) => {
                if existing.is_some_and(|e| e.value == v) {
                    // Unchanged: no write, no ctime update (as the kernel).
                    return Ok(());
                }
                let e = Xattr {
                    index,
                    name: suffix.to_vec(),
                    value: v,
                };
                let mut ib2 = ibody.clone();
                upsert(&mut ib2, e.clone());
                if fx::fits_ibody(&ib2, inode.xattr_area.len()) {
                    ibody = ib2;
                    block_changed = remove_key(&mut block, index, suffix);
                } else {
                    let alone = std::slice::from_ref(&e);
                    if !fx::fits_block(alone, self.bs)
                        && !fx::fits_ibody(alone, inode.xattr_area.len())
                    {
                        return Err(FsError::XattrTooBig);
                    }
                    upsert(&mut block, e);
                    if !fx::fits_block(&block, self.bs) {
                        return Err(FsError::NoSpace);
                    }
                    block_changed = true;
                    remove_key(&mut ibody, index, suffix);
                }
            }
        }
        if ibody != old.ibody {
            fx::write_ibody(&ibody, &mut inode.xattr_area)
                .map_err(|e| FsError::corrupt(format!("inode {ino}: in-inode xattrs: {e}")))?;
        }
        if block_changed {
            self.xattr_store_block(h, ino, &mut inode, old.block.as_ref(), &block)?;
        }
        if !self.sb.has_compat(sbf::COMPAT_EXT_ATTR) {
            let f = self.sb.feature_compat() | sbf::COMPAT_EXT_ATTR;
            self.sb.set_feature_compat(f);
            self.sb_dirty = true;
        }
        inode.ctime = now();
        self.write_inode(h, ino, &inode)
    }

    /// Make the inode's xattr block hold `entries` (none: drop the block). Writes a
    /// private block in place, copies a shared one, allocates one if needed, and
    /// keeps `i_file_acl` / `i_blocks` of the in-memory `inode` in step.
    fn xattr_store_block(
        &mut self,
        h: &Handle,
        ino: u32,
        inode: &mut Inode,
        old: Option<&(u64, XattrBlock)>,
        entries: &[Xattr],
    ) -> Result<()> {
        let per_block = self.bs as u64 / 512;
        let csum = self.csum;
        let write_err = |e: fx::WriteError| FsError::corrupt(format!("xattr block: {e}"));
        if entries.is_empty() {
            if let Some((blk, _)) = old {
                self.xattr_release_block(h, *blk)?;
                inode.file_acl = 0;
                let b = inode.blocks_512(self.bs).saturating_sub(per_block);
                inode.set_blocks_512(b, self.bs);
            }
            return Ok(());
        }
        match old {
            Some((blk, b)) if b.refcount <= 1 => {
                let blk = *blk;
                self.modify_meta(h, blk, |d| fx::write_block(entries, 1, blk, &csum, d))?
                    .map_err(write_err)?;
            }
            _ => {
                // Allocate before touching anything else: NoSpace leaves all as it was.
                let (nb, _) = self.alloc_blocks(h, self.inode_goal(ino), 1)?;
                self.new_meta(h, nb, |d| fx::write_block(entries, 1, nb, &csum, d))?
                    .map_err(write_err)?;
                match old {
                    // Copy-on-write of a shared block: still one block charged.
                    Some((blk, _)) => self.xattr_release_block(h, *blk)?,
                    None => {
                        let b = inode.blocks_512(self.bs) + per_block;
                        inode.set_blocks_512(b, self.bs);
                    }
                }
                inode.file_acl = nb;
            }
        }
        Ok(())
    }

    /// Drop one reference to xattr block `blk`: free it at the last one, otherwise
    /// decrement `h_refcount` (and re-checksum).
    fn xattr_release_block(&mut self, h: &Handle, blk: u64) -> Result<()> {
        let buf = self.read_meta(blk)?;
        let refcount = fx::parse_block(&buf.data(), blk, &self.csum)?.refcount;
        drop(buf);
        if refcount <= 1 {
            self.free_blocks(h, blk, 1)
        } else {
            let csum = self.csum;
            self.modify_meta(h, blk, |d| {
                fx::set_block_refcount(d, refcount - 1, blk, &csum)
            })
        }
    }

    /// Release the xattr block of an inode being deleted (refcount-aware) and take it
    /// out of the inode's `i_file_acl` and `i_blocks`. The caller writes the inode.
    pub fn xattr_free_inode(&mut self, h: &Handle, ino: u32, inode: &mut Inode) -> Result<()> {
        if inode.file_acl == 0 {
            return Ok(());
        }
        let blk = self.xattr_check_block_nr(ino, inode.file_acl)?;
        self.xattr_release_block(h, blk)?;
        inode.file_acl = 0;
        let b = inode
            .blocks_512(self.bs)
            .saturating_sub(self.bs as u64 / 512);
        inode.set_blocks_512(b, self.bs);
        Ok(())
    }
}
