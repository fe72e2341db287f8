//! Namespace operations: create, link, unlink, rename, setattr, inode eviction.

use commitfs_format::bytes::put_le16;
use commitfs_format::inode::{self as fi, Inode};
use commitfs_format::superblock as sbf;
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::fc::{DentryOp, FcReason};
use crate::inner::{now, Inner};
use crate::types::*;

/// `i_links_count` ceiling with dir_nlink; above it directories store 1 (§4.9).
const EXT4_LINK_MAX: u16 = 65000;

/// Reject names the directory format cannot hold.
pub(crate) fn check_name(name: &[u8]) -> Result<()> {
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(FsError::Invalid("bad file name"));
    }
    if name.len() > 255 {
        return Err(FsError::NameTooLong);
    }
    if name == b"." || name == b".." {
        return Err(FsError::Exists);
    }
    Ok(())
}

/// An empty extent root for `i_block` (§5.1, §4.10 step 2).
pub(crate) fn empty_extent_root() -> [u8; 60] {
    let mut b = [0u8; 60];
    put_le16(&mut b, 0, 0xF30A);
    put_le16(&mut b, 2, 0);
    put_le16(&mut b, 4, 4);
    put_le16(&mut b, 6, 0);
    b
}

/// A symlink's target as `Inner::readlink_begin` finds it.
pub(crate) enum LinkTarget {
    /// A fast symlink's, in the inode.
    Inline(Vec<u8>),
    /// A slow one's length and block, to read outside `Inner`.
    Block(usize, Vec<crate::dataio::Seg>),
}

impl Inner {
    pub fn attr_of(&self, ino: u32, i: &Inode) -> Result<Attr> {
        let mut a = attr_from(ino, i, self.bs)?;
        if let Some(pc) = &self.pc {
            pc.patch_attr(&mut a);
        }
        Ok(a)
    }
}

/// The attributes of inode `ino` (`bs`: block size).
pub(crate) fn attr_from(ino: u32, i: &Inode, bs: usize) -> Result<Attr> {
    {
        let kind = FileType::from_mode(i.mode)
            .ok_or_else(|| FsError::corrupt(format!("inode {ino}: bad mode {:o}", i.mode)))?;
        Ok(Attr {
            ino,
            kind,
            perm: i.mode & 0o7777,
            nlink: i.links_count as u32,
            uid: i.uid,
            gid: i.gid,
            size: i.size,
            blocks: i.blocks_512(bs),
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
            crtime: i.crtime,
            rdev: match kind {
                FileType::CharDevice | FileType::BlockDevice => i.rdev(),
                _ => 0,
            },
            generation: i.generation,
            flags: i.flags,
            blksize: bs as u32,
        })
    }
}

impl Inner {
    /// Read an inode that must be live (links > 0 or still open).
    pub fn live_inode(&mut self, ino: u32) -> Result<Inode> {
        let i = self.read_inode(ino)?;
        if i.mode == 0 || (i.links_count == 0 && !self.itable.is_open(ino)) {
            return Err(FsError::NotFound);
        }
        Ok(i)
    }

    /// `user.*` attributes exist only on regular files and directories (the VFS
    /// answers EPERM to writes and ENODATA to reads on other inodes).
    pub fn user_xattr_allowed(&mut self, ino: u32) -> Result<bool> {
        let i = self.live_inode(ino)?;
        Ok(i.is_reg() || i.is_dir())
    }

    pub fn getattr(&mut self, ino: u32) -> Result<Attr> {
        let i = self.live_inode(ino)?;
        self.attr_of(ino, &i)
    }

    /// The warm pass of an operation that adds `name` to `parent`
    /// (`Fs::lock_warm`): what its lookup reads, the parent's inode and
    /// directory blocks. Changes nothing; errors other than a deferred miss
    /// are the operation's own to report.
    pub fn warm_lookup(&mut self, parent: u32, name: &[u8]) -> Result<()> {
        let _ = crate::error::unless_miss(self.lookup_ino(parent, name))?;
        // The parent's times change: its inode-table block.
        crate::error::unless_miss(self.warm_inode(parent)).map(drop)
    }

    /// The warm pass of an operation on `name` in `parent` (`Fs::lock_warm`):
    /// what a lookup reads (the parent's inode and directory blocks) and the
    /// inode the name holds. Changes nothing; errors other than a deferred
    /// miss are the operation's own to report.
    pub fn warm_name(&mut self, parent: u32, name: &[u8]) -> Result<()> {
        let r = self
            .lookup_ino(parent, name)
            .and_then(|ino| self.warm_inode(ino));
        let _ = crate::error::unless_miss(r)?;
        crate::error::unless_miss(self.warm_inode(parent)).map(drop)
    }

    pub fn lookup_ino(&mut self, parent: u32, name: &[u8]) -> Result<u32> {
        if name.len() > 255 {
            return Err(FsError::NameTooLong);
        }
        let p = self.live_inode(parent)?;
        if !p.is_dir() {
            return Err(FsError::NotDir);
        }
        match self.dir_lookup(parent, name)? {
            Some((ino, _)) => Ok(ino),
            None => Err(FsError::NotFound),
        }
    }

    /// A live directory that can receive entries.
    fn dir_for_update(&mut self, ino: u32) -> Result<Inode> {
        let d = self.live_inode(ino)?;
        if !d.is_dir() {
            return Err(FsError::NotDir);
        }
        if d.links_count == 0 {
            return Err(FsError::NotFound);
        }
        Ok(d)
    }

    /// Touch a directory's mtime/ctime and adjust its link count by `dlinks`.
    fn touch_dir(&mut self, h: &Handle, dir: u32, dlinks: i32) -> Result<()> {
        let mut d = self.read_inode(dir)?;
        let t = now();
        d.mtime = t;
        d.ctime = t;
        if dlinks > 0 {
            d.links_count = if d.links_count >= EXT4_LINK_MAX - 1 || d.links_count == 1 {
                1
            } else {
                d.links_count + 1
            };
            if d.links_count == 1 {
                let f = self.sb.feature_ro_compat() | sbf::RO_COMPAT_DIR_NLINK;
                if f != self.sb.feature_ro_compat() {
                    self.sb.set_feature_ro_compat(f);
                    self.sb_dirty = true;
                }
            }
        } else if dlinks < 0 && d.links_count > 2 {
            d.links_count -= 1;
        }
        self.write_inode(h, dir, &d)
    }

    /// Create a regular file, directory, device, fifo, socket or symlink.
    #[allow(clippy::too_many_arguments)]
    pub fn create_node(
        &mut self,
        parent: u32,
        name: &[u8],
        mode: u16,
        rdev: u32,
        uid: u32,
        gid: u32,
        symlink: Option<&[u8]>,
    ) -> Result<Attr> {
        self.create_node_umask(parent, name, mode, 0, rdev, uid, gid, symlink)
    }

    /// [`Inner::create_node`] with the caller's umask, which applies unless the
    /// directory has a default ACL (then the ACL masks the mode instead).
    #[allow(clippy::too_many_arguments)]
    pub fn create_node_umask(
        &mut self,
        parent: u32,
        name: &[u8],
        mode: u16,
        umask: u16,
        rdev: u32,
        uid: u32,
        gid: u32,
        symlink: Option<&[u8]>,
    ) -> Result<Attr> {
        // Errors in the kernel's order: empty target, parent walk, name length,
        // existing name, then the target length.
        if symlink.is_some_and(|t| t.is_empty()) {
            return Err(FsError::NotFound);
        }
        let pdir = self.dir_for_update(parent)?;
        check_name(name)?;
        if self.dir_lookup(parent, name)?.is_some() {
            return Err(FsError::Exists);
        }
        if self.read_only {
            return Err(FsError::ReadOnly);
        }
        if let Some(t) = symlink {
            if t.len() >= self.bs || t.len() > 4095 {
                return Err(FsError::NameTooLong);
            }
        }
        let is_dir = mode & fi::S_IFMT == fi::S_IFDIR;
        let inherited = self.acl_inherit(parent, mode, umask)?;
        // Inherited ACLs may need an xattr block (block, bitmap, group, sb).
        let credits = if inherited.access.is_some() || inherited.default.is_some() {
            40
        } else {
            32
        };
        let h = self.start(credits)?;
        let r = self.create_node_in(
            &h, parent, &pdir, name, &inherited, rdev, uid, gid, symlink, is_dir,
        );
        self.stop(h)?;
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn create_node_in(
        &mut self,
        h: &Handle,
        parent: u32,
        pdir: &Inode,
        name: &[u8],
        inherited: &crate::acl::Inherited,
        rdev: u32,
        uid: u32,
        gid: u32,
        symlink: Option<&[u8]>,
        is_dir: bool,
    ) -> Result<Attr> {
        let mode = inherited.mode;
        let ino = self.alloc_inode(h, parent, is_dir)?;
        let t = now();
        let extra = self
            .sb
            .want_extra_isize()
            .max(32)
            .min(self.inode_size as u16 - 128);
        let mut inode = Inode {
            mode,
            uid,
            gid,
            atime: t,
            ctime: t,
            mtime: t,
            crtime: t,
            links_count: if is_dir { 2 } else { 1 },
            generation: self.new_generation(),
            extra_isize: if self.inode_size > 128 { extra } else { 0 },
            xattr_area: vec![0; self.inode_size.saturating_sub(128 + extra as usize)],
            ..Default::default()
        };
        // setgid directories pass their group (and the bit, for directories) on.
        if pdir.mode & 0o2000 != 0 {
            inode.gid = pdir.gid;
            if is_dir {
                inode.mode |= 0o2000;
            }
        }
        let kind = FileType::from_mode(mode).ok_or(FsError::Invalid("bad mode"))?;
        let built: Result<()> = (|| {
            match kind {
                FileType::Regular | FileType::Directory => {
                    inode.flags |= fi::FL_EXTENTS;
                    inode.block = empty_extent_root();
                }
                FileType::CharDevice | FileType::BlockDevice => inode.set_rdev(rdev),
                FileType::Symlink => {
                    self.init_symlink(h, ino, &mut inode, symlink.unwrap_or(b""))?
                }
                FileType::Fifo | FileType::Socket => {}
            }
            if is_dir {
                self.dir_init(h, ino, &mut inode, parent)?;
            }
            self.write_inode(h, ino, &inode)?;
            if inherited.access.is_some() || inherited.default.is_some() {
                self.fc_ineligible(FcReason::Xattr, h.tid());
                self.acl_store_inherited(h, ino, inherited)?;
                inode = self.read_inode(ino)?;
            }
            self.dir_add_entry(h, parent, name, ino, fi::file_type_of_mode(mode))
        })();
        if let Err(e) = built {
            // Roll back: release what the new inode got and leave its record
            // deleted (links 0, dtime set), then free the number.
            inode.links_count = 0;
            let _ = self.evict_with(h, ino, inode);
            return Err(e);
        }
        self.touch_dir(h, parent, if is_dir { 1 } else { 0 })?;
        match kind {
            FileType::Regular => {
                self.fc_track_dentry(
                    DentryOp::Creat {
                        parent,
                        ino,
                        name: name.to_vec(),
                    },
                    h.tid(),
                );
                self.fc_track_inode(ino, h.tid(), None);
            }
            FileType::Directory => self.fc_ineligible(FcReason::DirCreateRemove, h.tid()),
            _ => self.fc_ineligible(FcReason::SpecialInode, h.tid()),
        }
        self.attr_of(ino, &inode)
    }

    /// The metadata step of `readlink`: a fast symlink's target, or a slow
    /// one's length and where its block is (read by the caller outside
    /// `Inner`, under the inode's lock).
    pub fn readlink_begin(&mut self, ino: u32) -> Result<LinkTarget> {
        let i = self.live_inode(ino)?;
        if !i.is_symlink() {
            return Err(FsError::Invalid("not a symlink"));
        }
        if i.is_fast_symlink() {
            return Ok(LinkTarget::Inline(i.block[..i.size as usize].to_vec()));
        }
        if i.size as usize >= self.bs || i.size == 0 {
            return Err(FsError::corrupt(format!(
                "symlink {ino}: bad size {}",
                i.size
            )));
        }
        let n = i.size as usize;
        Ok(LinkTarget::Block(n, self.read_plan(ino, &i, 0, n)?))
    }

    pub fn link(&mut self, ino: u32, new_parent: u32, new_name: &[u8]) -> Result<Attr> {
        self.dir_for_update(new_parent)?;
        check_name(new_name)?;
        if self.dir_lookup(new_parent, new_name)?.is_some() {
            return Err(FsError::Exists);
        }
        let mut i = self.live_inode(ino)?;
        if i.is_dir() {
            return Err(FsError::Permission("hard link to a directory"));
        }
        if i.links_count == 0 {
            return Err(FsError::NotFound);
        }
        if i.links_count >= EXT4_LINK_MAX {
            return Err(FsError::TooManyLinks);
        }
        let h = self.start(16)?;
        let r = (|| {
            self.dir_add_entry(&h, new_parent, new_name, ino, fi::file_type_of_mode(i.mode))?;
            self.fc_link_ops(&h, new_parent, ino, new_name, true, &i);
            i.links_count += 1;
            i.ctime = now();
            self.write_inode(&h, ino, &i)?;
            self.touch_dir(&h, new_parent, 0)?;
            self.attr_of(ino, &i)
        })();
        self.stop(h)?;
        r
    }

    pub fn unlink(&mut self, parent: u32, name: &[u8]) -> Result<()> {
        let ino = self.lookup_ino(parent, name)?;
        let i = self.read_inode(ino)?;
        if i.is_dir() {
            return Err(FsError::IsDir);
        }
        let h = self.start(16)?;
        let r = (|| {
            self.dir_remove_entry(&h, parent, name)?;
            self.fc_link_ops(&h, parent, ino, name, false, &i);
            self.touch_dir(&h, parent, 0)?;
            self.drop_link(&h, ino)
        })();
        self.stop(h)?;
        r
    }

    /// Remove one link of `ino`; free it when none remain and nobody has it open.
    fn drop_link(&mut self, h: &Handle, ino: u32) -> Result<()> {
        let mut i = self.read_inode(ino)?;
        i.links_count = i.links_count.saturating_sub(1);
        i.ctime = now();
        if i.links_count == 0 {
            let xattrs = i.file_acl != 0 || commitfs_format::xattr::ibody_has_magic(&i.xattr_area);
            if xattrs && self.fc_other_replayers() && !self.fc_creat_pending(ino, h.tid()) {
                // Replay knows this inode, and e2fsck would keep it for its xattrs
                // (fc.rs, FcReason::UnlinkLast).
                self.fc_ineligible(FcReason::UnlinkLast, h.tid());
            }
            if self.itable.mark_unlinked_if_open(ino) {
                // Still open: keep it, on the orphan list so a crash frees it. A
                // fast commit stays possible, as in the kernel: it carries the
                // UNLINK of the last name (the caller tracked it), whose replay
                // drops the last link and frees the inode; the orphan list only
                // matters to full commits. `fc_plan` logs no INODE or range of an
                // inode without links (the kernel's replay refuses such an INODE).
                // Marked first: a close from now on releases it under `Inner`,
                // after this (`InodeTable::release_unless_last_unlinked`).
                let r = self
                    .write_inode(h, ino, &i)
                    .and_then(|()| self.orphan_add(h, ino));
                if r.is_err() {
                    self.itable.unmark_unlinked_open(ino);
                }
                return r;
            }
            self.fc_track_inode(ino, h.tid(), Some((0, 1u64 << 32)));
            return self.evict_with(h, ino, i);
        }
        self.fc_track_inode(ino, h.tid(), None);
        self.write_inode(h, ino, &i)
    }

    /// A directory lost its name (rmdir, or replaced by rename): free it, or,
    /// while still referenced (open, or known to the kernel), keep it without
    /// links on the orphan list until the last reference goes, as ext4 does: an
    /// `fstat` of an open removed directory answers with nlink 0.
    fn drop_dir(&mut self, h: &Handle, ino: u32, mut i: Inode) -> Result<()> {
        i.links_count = 0;
        i.ctime = now();
        if !self.itable.mark_unlinked_if_open(ino) {
            return self.evict_with(h, ino, i);
        }
        let r = self
            .write_inode(h, ino, &i)
            .and_then(|()| self.orphan_add(h, ino));
        if r.is_err() {
            self.itable.unmark_unlinked_open(ino);
        }
        r
    }

    pub fn rmdir(&mut self, parent: u32, name: &[u8]) -> Result<()> {
        if name == b"." {
            return Err(FsError::Invalid("rmdir ."));
        }
        if name == b".." {
            return Err(FsError::NotEmpty);
        }
        let ino = self.lookup_ino(parent, name)?;
        let i = self.read_inode(ino)?;
        if !i.is_dir() {
            return Err(FsError::NotDir);
        }
        if !self.dir_is_empty(ino)? {
            return Err(FsError::NotEmpty);
        }
        let h = self.start(16)?;
        let r = (|| {
            self.fc_ineligible(FcReason::DirCreateRemove, h.tid());
            self.dir_remove_entry(&h, parent, name)?;
            self.touch_dir(&h, parent, -1)?;
            let i = self.read_inode(ino)?;
            self.drop_dir(&h, ino, i)
        })();
        self.stop(h)?;
        r
    }

    /// Is `dir` equal to or below `ancestor`? (walks "..").
    pub(crate) fn is_descendant(&mut self, mut dir: u32, ancestor: u32) -> Result<bool> {
        for _ in 0..65536 {
            if dir == ancestor {
                return Ok(true);
            }
            if dir == ROOT_INO {
                return Ok(false);
            }
            dir = match self.dir_lookup(dir, b"..")? {
                Some((p, _)) => p,
                None => return Err(FsError::corrupt(format!("directory {dir} has no '..'"))),
            };
        }
        Err(FsError::corrupt("directory loop"))
    }

    pub fn rename(
        &mut self,
        parent: u32,
        name: &[u8],
        new_parent: u32,
        new_name: &[u8],
        flags: RenameFlags,
    ) -> Result<()> {
        if flags.exchange && flags.noreplace {
            return Err(FsError::Invalid("RENAME_EXCHANGE with RENAME_NOREPLACE"));
        }
        // Its directory steps are separate (remove here, add there): lookups
        // without the file-system lock stand aside until all are done.
        let _renaming = crate::dir::Renaming::start(&self.dirs);
        if name == b"." || name == b".." {
            return Err(FsError::Invalid("rename of . or .."));
        }
        let src = self.lookup_ino(parent, name)?;
        self.dir_for_update(new_parent)?;
        check_name(new_name)?;
        let src_i = self.read_inode(src)?;
        let dst = self.dir_lookup(new_parent, new_name)?.map(|x| x.0);
        if flags.noreplace && dst.is_some() {
            // Checked before "same name": the kernel answers EEXIST even then.
            return Err(FsError::Exists);
        }
        if flags.exchange && dst.is_none() {
            return Err(FsError::NotFound);
        }
        if parent == new_parent && name == new_name {
            return Ok(());
        }
        // The kernel's lock_rename traps: the source may not be an ancestor of the
        // target (EINVAL), nor the target an ancestor of the source (ENOTEMPTY).
        if src_i.is_dir() && parent != new_parent && self.is_descendant(new_parent, src)? {
            return Err(FsError::Invalid("rename into own subdirectory"));
        }
        if let Some(d) = dst {
            if !flags.exchange
                && d != src
                && self.read_inode(d)?.is_dir()
                && self.is_descendant(parent, d)?
            {
                return Err(FsError::NotEmpty);
            }
        }
        if flags.exchange {
            let Some(dst) = dst else {
                return Err(FsError::NotFound);
            };
            let dst_i = self.read_inode(dst)?;
            if src_i.is_dir() && parent != new_parent && self.is_descendant(new_parent, src)? {
                return Err(FsError::Invalid("rename into own subdirectory"));
            }
            if dst_i.is_dir() && parent != new_parent && self.is_descendant(parent, dst)? {
                return Err(FsError::Invalid("rename into own subdirectory"));
            }
            let h = self.start(32)?;
            self.fc_ineligible(FcReason::CrossRename, h.tid());
            let r = self.exchange_in(
                &h, parent, name, src, &src_i, new_parent, new_name, dst, &dst_i,
            );
            self.stop(h)?;
            return r;
        }
        if flags.noreplace && dst.is_some() {
            return Err(FsError::Exists);
        }
        if src_i.is_dir() && self.is_descendant(new_parent, src)? {
            return Err(FsError::Invalid("rename into own subdirectory"));
        }
        if let Some(d) = dst {
            if d == src {
                return Ok(()); // two links to one inode: POSIX says do nothing
            }
            let di = self.read_inode(d)?;
            if src_i.is_dir() {
                if !di.is_dir() {
                    return Err(FsError::NotDir);
                }
                if !self.dir_is_empty(d)? {
                    return Err(FsError::NotEmpty);
                }
            } else if di.is_dir() {
                return Err(FsError::IsDir);
            }
        }
        let h = self.start(32)?;
        let r = self.rename_in(&h, parent, name, src, &src_i, new_parent, new_name, dst);
        self.stop(h)?;
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn rename_in(
        &mut self,
        h: &Handle,
        parent: u32,
        name: &[u8],
        src: u32,
        src_i: &Inode,
        new_parent: u32,
        new_name: &[u8],
        dst: Option<u32>,
    ) -> Result<()> {
        let ft = fi::file_type_of_mode(src_i.mode);
        let is_dir = src_i.is_dir();
        if is_dir || !src_i.is_reg() {
            self.fc_ineligible(
                if is_dir {
                    FcReason::RenameDir
                } else {
                    FcReason::SpecialInode
                },
                h.tid(),
            );
        } else {
            // Kernel order: the replaced target goes first, then the new name, then
            // the old name disappears.
            if let Some(d) = dst {
                let di = self.read_inode(d)?;
                self.fc_link_ops(h, new_parent, d, new_name, false, &di);
            }
            self.fc_link_ops(h, new_parent, src, new_name, true, src_i);
            self.fc_link_ops(h, parent, src, name, false, src_i);
            self.fc_track_inode(src, h.tid(), None);
        }
        match dst {
            Some(d) => {
                self.dir_replace_entry(h, new_parent, new_name, src, ft)?;
                let di = self.read_inode(d)?;
                if di.is_dir() {
                    // The replaced directory loses both its links; its parent loses
                    // the ".." reference.
                    self.touch_dir(h, new_parent, -1)?;
                    self.drop_dir(h, d, di)?;
                } else {
                    self.drop_link(h, d)?;
                }
            }
            None => self.dir_add_entry(h, new_parent, new_name, src, ft)?,
        }
        self.dir_remove_entry(h, parent, name)?;
        if is_dir && parent != new_parent {
            self.dir_set_dotdot(h, src, new_parent)?;
            self.touch_dir(h, parent, -1)?;
            self.touch_dir(h, new_parent, 1)?;
        } else {
            self.touch_dir(h, parent, 0)?;
            if parent != new_parent {
                self.touch_dir(h, new_parent, 0)?;
            }
        }
        let mut si = self.read_inode(src)?;
        si.ctime = now();
        self.write_inode(h, src, &si)
    }

    #[allow(clippy::too_many_arguments)]
    fn exchange_in(
        &mut self,
        h: &Handle,
        parent: u32,
        name: &[u8],
        src: u32,
        src_i: &Inode,
        new_parent: u32,
        new_name: &[u8],
        dst: u32,
        dst_i: &Inode,
    ) -> Result<()> {
        self.dir_replace_entry(h, parent, name, dst, fi::file_type_of_mode(dst_i.mode))?;
        self.dir_replace_entry(
            h,
            new_parent,
            new_name,
            src,
            fi::file_type_of_mode(src_i.mode),
        )?;
        if parent != new_parent {
            if src_i.is_dir() {
                self.dir_set_dotdot(h, src, new_parent)?;
            }
            if dst_i.is_dir() {
                self.dir_set_dotdot(h, dst, parent)?;
            }
            let delta = src_i.is_dir() as i32 - dst_i.is_dir() as i32;
            self.touch_dir(h, parent, -delta)?;
            self.touch_dir(h, new_parent, delta)?;
        } else {
            self.touch_dir(h, parent, 0)?;
        }
        for ino in [src, dst] {
            let mut i = self.read_inode(ino)?;
            i.ctime = now();
            self.write_inode(h, ino, &i)?;
        }
        Ok(())
    }

    /// Change attributes; a size change by `caller` also clears setuid/setgid
    /// as the kernel's truncate does.
    pub fn setattr(&mut self, ino: u32, set: &SetAttr, caller: CallerOf<'_>) -> Result<Attr> {
        // Times of cached writes first: an explicit mtime must win over them.
        self.fold_cached_times(ino)?;
        let mut i = self.live_inode(ino)?;
        if self.read_only {
            return Err(FsError::ReadOnly);
        }
        if let Some(size) = set.size {
            if i.is_dir() {
                return Err(FsError::IsDir);
            }
            if !i.is_reg() {
                return Err(FsError::Invalid("truncate of a non-regular file"));
            }
            self.set_size(ino, size)?;
            i = self.read_inode(ino)?;
        }
        let t = now();
        if let Some(m) = set.mode {
            i.mode = (i.mode & fi::S_IFMT) | (m & 0o7777);
        }
        if set.size.is_some() {
            // After any mode in the same call: the kernel's FUSE sends its own
            // (partial) privilege kill as a mode with the size.
            Self::drop_privs(&mut i, caller);
        }
        if (set.uid.is_some() || set.gid.is_some()) && set.mode.is_none() {
            Self::drop_privs_on_chown(&mut i, caller);
        }
        if let Some(u) = set.uid {
            i.uid = u;
        }
        if let Some(g) = set.gid {
            i.gid = g;
        }
        let pick = |s: SetTime| match s {
            SetTime::Now => t,
            SetTime::At(x) => x,
        };
        if let Some(a) = set.atime {
            i.atime = pick(a);
        }
        if let Some(m) = set.mtime {
            i.mtime = pick(m);
        }
        if let Some(c) = set.crtime {
            i.crtime = c;
        }
        i.ctime = set.ctime.unwrap_or(t);
        // A mode change may rewrite the access ACL (xattr block copy included).
        let h = self.start(if set.mode.is_some() { 12 } else { 4 })?;
        if i.is_reg() {
            self.fc_track_inode(ino, h.tid(), None);
        } else {
            self.fc_ineligible(FcReason::NonRegularSetattr, h.tid());
        }
        let mut r = self.write_inode(&h, ino, &i).map(|()| false);
        if r.is_ok() && set.mode.is_some() {
            // chmod rewrites a stored access ACL (posix_acl_chmod).
            r = self.acl_chmod(&h, ino, &i);
            if r.as_ref().is_ok_and(|&rewritten| rewritten) {
                self.fc_ineligible(FcReason::Xattr, h.tid());
            }
        }
        self.stop(h)?;
        if r? {
            // The ACL may have moved to (or out of) an xattr block: i_blocks.
            i = self.read_inode(ino)?;
        }
        self.attr_of(ino, &i)
    }

    pub fn release(&mut self, ino: u32) -> Result<()> {
        if self.itable.release(ino) && !self.read_only {
            return self.evict_inode(ino);
        }
        Ok(())
    }

    /// Track a LINK or UNLINK of a regular file for fast commits; other inode
    /// types make the transaction ineligible.
    fn fc_link_ops(
        &mut self,
        h: &Handle,
        parent: u32,
        ino: u32,
        name: &[u8],
        link: bool,
        i: &Inode,
    ) {
        if !i.is_reg() {
            self.fc_ineligible(FcReason::SpecialInode, h.tid());
            return;
        }
        let name = name.to_vec();
        let op = if link {
            DentryOp::Link { parent, ino, name }
        } else {
            DentryOp::Unlink { parent, ino, name }
        };
        self.fc_track_dentry(op, h.tid());
        self.fc_track_inode(ino, h.tid(), None);
    }

    /// Free an open-unlinked inode at its last close (or at unmount): off the
    /// orphan list and freed in one transaction.
    pub fn evict_inode(&mut self, ino: u32) -> Result<()> {
        let i = self.read_inode(ino)?;
        if i.links_count != 0 {
            return Ok(());
        }
        let h = self.start(64)?;
        // Freeing it needs no record: replay of the UNLINK already frees it, or it
        // is on the committed orphan list, whose cleanup at mount frees it (its
        // number is not reused before this transaction commits: alloc.rs). Taking
        // it off the list rewrites its predecessor's `i_dtime`; if that
        // predecessor is on the committed list, a later INODE record of it would
        // carry the shortened chain into replay and leak this inode there, so
        // then this transaction must be fully committed. The superblock and
        // orphans added by this transaction are no such risk (neither is
        // replayed from a fast commit onto the committed list).
        let pred = self.orphan_pred(ino)?;
        let eligible = match pred {
            None | Some(0) => true,
            Some(p) => self.orphans_added.get(&p) == Some(&h.tid()),
        };
        if !eligible {
            self.fc_ineligible(FcReason::Orphan, h.tid());
        }
        let r = self
            .orphan_unlink(&h, ino, pred)
            .and_then(|_| self.read_inode(ino))
            .and_then(|i| self.evict_with(&h, ino, i));
        self.stop(h)?;
        r
    }

    /// Free an inode found on the orphan list at mount (already unlinked from it).
    pub fn evict_orphan(&mut self, h: &Handle, ino: u32) -> Result<()> {
        let i = self.read_inode(ino)?;
        self.evict_with(h, ino, i)
    }

    /// Free blocks past `i_size` (an interrupted truncate found at mount).
    pub fn truncate_blocks_past_size(&mut self, h: &Handle, ino: u32) -> Result<()> {
        let mut i = self.read_inode(ino)?;
        if !i.has_flag(fi::FL_EXTENTS) {
            return Ok(());
        }
        let first = i.size.div_ceil(self.bs as u64);
        if first >= 1u64 << 32 {
            return Ok(());
        }
        let freed = self.ext_remove(h, ino, &mut i, first as u32, 1u64 << 32)?;
        let b = i
            .blocks_512(self.bs)
            .saturating_sub(freed * (self.bs as u64 / 512));
        i.set_blocks_512(b, self.bs);
        self.write_inode(h, ino, &i)
    }

    /// Release everything an inode owns (data, tree and xattr blocks).
    fn release_inode_storage(&mut self, h: &Handle, ino: u32, i: &mut Inode) -> Result<()> {
        if i.has_flag(fi::FL_EXTENTS) {
            let freed = self.ext_remove(h, ino, i, 0, 1u64 << 32)?;
            let b = i
                .blocks_512(self.bs)
                .saturating_sub(freed * (self.bs as u64 / 512));
            i.set_blocks_512(b, self.bs);
        }
        self.xattr_free_inode(h, ino, i)
    }

    fn evict_with(&mut self, h: &Handle, ino: u32, mut i: Inode) -> Result<()> {
        let was_dir = i.is_dir();
        // Its cached data goes with it, unwritten (freed after `Inner`).
        if let Some(pc) = &self.pc {
            pc.discard_deferred(ino);
        }
        self.release_inode_storage(h, ino, &mut i)?;
        i.links_count = 0;
        i.size = 0;
        i.set_blocks_512(0, self.bs);
        // A deleted inode needs a non-zero dtime (§4.9).
        i.dtime = (now().sec as u32).max(1);
        self.write_inode(h, ino, &i)?;
        self.free_inode(h, ino, was_dir)?;
        if was_dir {
            self.dir_forget(ino);
        }
        self.itable.forget_open(ino);
        Ok(())
    }
}
