//! POSIX ACLs with ext4's semantics (the kernel's fs/posix_acl.c and fs/ext4/acl.c).
//!
//! An ACL is more than an attribute: setting an access ACL folds its owner, group
//! (or mask) and other entries into `i_mode`, and one equivalent to the mode is not
//! stored at all; `chmod` rewrites those entries of a stored ACL; new entries of a
//! directory with a default ACL inherit it (mode and ACL) and ignore the umask.
//! Without this, `cp -p` (which sets the mode through the ACL) leaves group and
//! other bits at zero.

use commitfs_format::inode::{self as fi, Inode};
use commitfs_format::xattr::{acl as fa, index};
use commitfs_journal::Handle;

use crate::error::{FsError, Result};
use crate::inner::Inner;
use crate::types::XattrFlags;

/// Which of an inode's two ACLs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AclKind {
    /// `system.posix_acl_access`: checked on access, mirrored in the mode.
    Access,
    /// `system.posix_acl_default`: directories only, inherited by new entries.
    Default,
}

impl AclKind {
    /// The kind an xattr index names, if it is an ACL index.
    pub(crate) fn of_index(i: u8) -> Option<AclKind> {
        match i {
            index::POSIX_ACL_ACCESS => Some(AclKind::Access),
            index::POSIX_ACL_DEFAULT => Some(AclKind::Default),
            _ => None,
        }
    }

    fn index(self) -> u8 {
        match self {
            AclKind::Access => index::POSIX_ACL_ACCESS,
            AclKind::Default => index::POSIX_ACL_DEFAULT,
        }
    }
}

/// One ACL entry: tag (`fa::USER_OBJ`...), rwx bits, and the id for named entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AclEntry {
    pub tag: u16,
    pub perm: u16,
    pub id: u32,
}

/// A validated POSIX ACL in the kernel's entry order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl {
    pub entries: Vec<AclEntry>,
}

const S_IRWXU: u16 = 0o700;
const S_IRWXG: u16 = 0o070;
const S_IRWXO: u16 = 0o007;

impl Acl {
    /// Parse the VFS xattr format (`posix_acl_from_xattr` + `posix_acl_valid`),
    /// with the kernel's errors: a short value or bad entries are EINVAL, a wrong
    /// version EOPNOTSUPP. `Ok(None)` for an ACL without entries, which the kernel
    /// treats as removal.
    pub fn from_vfs(v: &[u8]) -> Result<Option<Acl>> {
        const BAD: FsError = FsError::Invalid("malformed POSIX ACL");
        if v.len() < 4 {
            return Err(BAD);
        }
        if u32::from_le_bytes([v[0], v[1], v[2], v[3]]) != fa::VFS_VERSION {
            return Err(FsError::NotSupported("POSIX ACL version".into()));
        }
        if !(v.len() - 4).is_multiple_of(8) {
            return Err(BAD);
        }
        let entries: Vec<AclEntry> = v[4..]
            .chunks_exact(8)
            .map(|e| AclEntry {
                tag: u16::from_le_bytes([e[0], e[1]]),
                perm: u16::from_le_bytes([e[2], e[3]]),
                id: u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
            })
            .collect();
        if entries.is_empty() {
            return Ok(None);
        }
        let acl = Acl { entries };
        if !acl.valid() {
            return Err(BAD);
        }
        Ok(Some(acl))
    }

    /// The VFS xattr format; ids of unnamed entries are `ACL_UNDEFINED_ID`.
    pub fn to_vfs(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(4 + 8 * self.entries.len());
        v.extend_from_slice(&fa::VFS_VERSION.to_le_bytes());
        for e in &self.entries {
            v.extend_from_slice(&e.tag.to_le_bytes());
            v.extend_from_slice(&e.perm.to_le_bytes());
            let id = match e.tag {
                fa::USER | fa::GROUP => e.id,
                _ => fa::UNDEFINED_ID,
            };
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    /// `posix_acl_valid`: owner, named users, group, named groups, mask, other in
    /// that order, each unnamed tag once, a mask whenever named entries exist,
    /// perms within rwx, and mappable ids (-1 is not).
    fn valid(&self) -> bool {
        #[derive(PartialEq)]
        enum S {
            UserObj,
            User,
            Group,
            Other,
            Done,
        }
        let mut state = S::UserObj;
        let mut needs_mask = false;
        for e in &self.entries {
            if e.perm & !7 != 0 {
                return false;
            }
            match e.tag {
                fa::USER_OBJ if state == S::UserObj => state = S::User,
                fa::USER if state == S::User && e.id != fa::UNDEFINED_ID => needs_mask = true,
                fa::GROUP_OBJ if state == S::User => state = S::Group,
                fa::GROUP if state == S::Group && e.id != fa::UNDEFINED_ID => needs_mask = true,
                fa::MASK if state == S::Group => state = S::Other,
                fa::OTHER if state == S::Other || (state == S::Group && !needs_mask) => {
                    state = S::Done
                }
                _ => return false,
            }
        }
        state == S::Done
    }

    /// `posix_acl_equiv_mode`: the mode this ACL implies (file type and
    /// setuid/setgid/sticky bits kept from `mode`), and whether the ACL says more
    /// than the mode can (named entries or a mask).
    pub fn equiv_mode(&self, mode: u16) -> (u16, bool) {
        let mut m = 0u16;
        let mut not_equiv = false;
        for e in &self.entries {
            match e.tag {
                fa::USER_OBJ => m |= (e.perm & S_IRWXO) << 6,
                fa::GROUP_OBJ => m |= (e.perm & S_IRWXO) << 3,
                fa::OTHER => m |= e.perm & S_IRWXO,
                fa::MASK => {
                    m = (m & !S_IRWXG) | ((e.perm & S_IRWXO) << 3);
                    not_equiv = true;
                }
                _ => not_equiv = true,
            }
        }
        ((mode & !0o777) | m, not_equiv)
    }

    /// `posix_acl_create_masq`: restrict an inherited ACL by the requested mode
    /// and the mode by the ACL. Returns the new mode and whether the ACL must be
    /// stored (it says more than the mode).
    pub fn create_masq(&mut self, mode: u16) -> (u16, bool) {
        let mut m = mode;
        let mut not_equiv = false;
        let (mut group_obj, mut mask_obj) = (None, None);
        for (i, e) in self.entries.iter_mut().enumerate() {
            match e.tag {
                fa::USER_OBJ => {
                    e.perm &= (m >> 6) | !S_IRWXO;
                    m &= (e.perm << 6) | !S_IRWXU;
                }
                fa::USER | fa::GROUP => not_equiv = true,
                fa::GROUP_OBJ => group_obj = Some(i),
                fa::OTHER => {
                    e.perm &= m | !S_IRWXO;
                    m &= e.perm | !S_IRWXO;
                }
                fa::MASK => {
                    mask_obj = Some(i);
                    not_equiv = true;
                }
                _ => {}
            }
        }
        // A valid ACL always has a group entry; `valid` ran when it was parsed.
        if let Some(i) = mask_obj.or(group_obj) {
            let e = &mut self.entries[i];
            e.perm &= (m >> 3) | !S_IRWXO;
            m &= (e.perm << 3) | !S_IRWXG;
        }
        for e in &mut self.entries {
            e.perm &= 7;
        }
        ((mode & !0o777) | (m & 0o777), not_equiv)
    }

    /// `__posix_acl_chmod`: make the owner, group-class (mask if present) and
    /// other entries say what the new mode says.
    pub fn chmod(&mut self, mode: u16) {
        let (mut group_obj, mut mask_obj) = (None, None);
        for (i, e) in self.entries.iter_mut().enumerate() {
            match e.tag {
                fa::USER_OBJ => e.perm = (mode & S_IRWXU) >> 6,
                fa::GROUP_OBJ => group_obj = Some(i),
                fa::MASK => mask_obj = Some(i),
                fa::OTHER => e.perm = mode & S_IRWXO,
                _ => {}
            }
        }
        if let Some(i) = mask_obj.or(group_obj) {
            self.entries[i].perm = (mode & S_IRWXG) >> 3;
        }
    }

    fn to_disk(&self) -> Result<Vec<u8>> {
        fa::to_disk(&self.to_vfs()).ok_or(FsError::Invalid("malformed POSIX ACL"))
    }
}

/// What a new inode gets from its directory: its mode and the ACLs to store.
pub(crate) struct Inherited {
    pub mode: u16,
    pub default: Option<Acl>,
    pub access: Option<Acl>,
}

impl Inner {
    /// Whether ACLs are on (`-o acl`, the default, as ext4).
    pub(crate) fn acl_on(&self) -> bool {
        self.opts.acl
    }

    /// Refuse ACL names under `-o noacl` (ext4 has no handler then: EOPNOTSUPP).
    pub(crate) fn acl_check_enabled(&self) -> Result<()> {
        if self.acl_on() {
            Ok(())
        } else {
            Err(FsError::NotSupported(
                "POSIX ACLs (mounted with -o noacl)".into(),
            ))
        }
    }

    /// The stored ACL of this kind, if any.
    pub fn acl_get(&mut self, ino: u32, kind: AclKind) -> Result<Option<Acl>> {
        let name: &[u8] = match kind {
            AclKind::Access => b"system.posix_acl_access",
            AclKind::Default => b"system.posix_acl_default",
        };
        match self.xattr_get(ino, name) {
            Ok(v) => Acl::from_vfs(&v)
                .map_err(|_| FsError::corrupt(format!("inode {ino}: invalid POSIX ACL on disk"))),
            Err(FsError::NoData) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `ext4_set_acl`: store (`value` non-empty) or remove an ACL given in the VFS
    /// format. An access ACL updates the mode and is dropped when the mode says it
    /// all; `kill_sgid` clears S_ISGID with it (the caller is neither in the file's
    /// group nor privileged). A default ACL on a non-directory is refused (EACCES).
    /// Removing an absent ACL succeeds, as in ext4.
    pub(crate) fn acl_set(
        &mut self,
        h: &Handle,
        ino: u32,
        kind: AclKind,
        value: &[u8],
        kill_sgid: bool,
    ) -> Result<()> {
        self.acl_check_enabled()?;
        // Parsed first, as the VFS does before it looks at the inode.
        let mut acl = if value.is_empty() {
            None
        } else {
            Acl::from_vfs(value)?
        };
        let inode = self.live_inode(ino)?;
        if inode.is_symlink() {
            return Err(FsError::NotSupported("POSIX ACLs on symlinks".into()));
        }
        let mut mode = None;
        match kind {
            AclKind::Default if !inode.is_dir() => {
                return match acl {
                    Some(_) => Err(FsError::AccessDenied(
                        "default ACLs exist only on directories",
                    )),
                    None => Ok(()),
                };
            }
            AclKind::Access => {
                if let Some(a) = &acl {
                    let (mut m, not_equiv) = a.equiv_mode(inode.mode);
                    if !not_equiv {
                        acl = None;
                    }
                    if kill_sgid {
                        m &= !0o2000;
                    }
                    if m != inode.mode {
                        mode = Some(m);
                    }
                }
            }
            AclKind::Default => {}
        }
        let stored = acl.as_ref().map(Acl::to_disk).transpose()?;
        self.xattr_change_mode(
            h,
            ino,
            kind.index(),
            b"",
            stored,
            XattrFlags::default(),
            mode,
        )
    }

    /// `posix_acl_chmod`: after a mode change, rewrite the stored access ACL to
    /// match. Returns whether an ACL was rewritten.
    pub(crate) fn acl_chmod(&mut self, h: &Handle, ino: u32, inode: &Inode) -> Result<bool> {
        if !self.acl_on() || inode.is_symlink() {
            return Ok(false);
        }
        let Some(mut acl) = self.acl_get(ino, AclKind::Access)? else {
            return Ok(false);
        };
        acl.chmod(inode.mode);
        let stored = acl.to_disk()?;
        self.xattr_change_mode(
            h,
            ino,
            index::POSIX_ACL_ACCESS,
            b"",
            Some(stored),
            XattrFlags::default(),
            None,
        )?;
        Ok(true)
    }

    /// `posix_acl_create`: the mode and ACLs of a new inode in directory `parent`.
    /// With a default ACL the umask is ignored and the ACL masks the mode; without
    /// one (or with `-o noacl`) the umask applies. Symlinks get neither.
    pub(crate) fn acl_inherit(&mut self, parent: u32, mode: u16, umask: u16) -> Result<Inherited> {
        let plain = Inherited {
            mode: mode & !(umask & 0o777),
            default: None,
            access: None,
        };
        if !self.acl_on() || mode & fi::S_IFMT == fi::S_IFLNK {
            return Ok(plain);
        }
        let Some(dacl) = self.acl_get(parent, AclKind::Default)? else {
            return Ok(plain);
        };
        let mut access = dacl.clone();
        let (mode, not_equiv) = access.create_masq(mode);
        Ok(Inherited {
            mode,
            default: (mode & fi::S_IFMT == fi::S_IFDIR).then_some(dacl),
            access: not_equiv.then_some(access),
        })
    }

    /// Store inherited ACLs on a new inode: the default one first, as ext4.
    pub(crate) fn acl_store_inherited(
        &mut self,
        h: &Handle,
        ino: u32,
        inh: &Inherited,
    ) -> Result<()> {
        for (kind, acl) in [
            (AclKind::Default, &inh.default),
            (AclKind::Access, &inh.access),
        ] {
            if let Some(a) = acl {
                let stored = a.to_disk()?;
                self.xattr_change_mode(
                    h,
                    ino,
                    kind.index(),
                    b"",
                    Some(stored),
                    XattrFlags::default(),
                    None,
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(e: &[(u16, u16, u32)]) -> Acl {
        Acl {
            entries: e
                .iter()
                .map(|&(tag, perm, id)| AclEntry { tag, perm, id })
                .collect(),
        }
    }
    const U: u32 = fa::UNDEFINED_ID;

    #[test]
    fn validity() {
        let ok = acl(&[
            (fa::USER_OBJ, 6, U),
            (fa::GROUP_OBJ, 4, U),
            (fa::OTHER, 4, U),
        ]);
        assert!(ok.valid());
        let named = acl(&[
            (fa::USER_OBJ, 6, U),
            (fa::USER, 7, 1000),
            (fa::GROUP_OBJ, 4, U),
            (fa::MASK, 7, U),
            (fa::OTHER, 4, U),
        ]);
        assert!(named.valid());
        let mut no_mask = named.clone();
        no_mask.entries.remove(3);
        assert!(!no_mask.valid());
        let mut order = ok.clone();
        order.entries.swap(0, 1);
        assert!(!order.valid());
        let mut perm = ok.clone();
        perm.entries[0].perm = 8;
        assert!(!perm.valid());
        let mut bad_id = named.clone();
        bad_id.entries[1].id = U;
        assert!(!bad_id.valid());
        assert!(!acl(&[(fa::USER_OBJ, 6, U), (fa::OTHER, 4, U)]).valid());
        // Round trip and the header-only ACL (= removal).
        assert_eq!(Acl::from_vfs(&named.to_vfs()).unwrap(), Some(named));
        assert_eq!(Acl::from_vfs(&2u32.to_le_bytes()).unwrap(), None);
        assert!(matches!(
            Acl::from_vfs(&1u32.to_le_bytes()),
            Err(FsError::NotSupported(_))
        ));
        assert!(matches!(
            Acl::from_vfs(&[2, 0, 0, 0, 1]),
            Err(FsError::Invalid(_))
        ));
    }

    #[test]
    fn equiv_create_chmod() {
        let plain = acl(&[
            (fa::USER_OBJ, 7, U),
            (fa::GROUP_OBJ, 5, U),
            (fa::OTHER, 1, U),
        ]);
        assert_eq!(plain.equiv_mode(0o100000 | 0o4000), (0o104751, false));
        let mut named = acl(&[
            (fa::USER_OBJ, 7, U),
            (fa::USER, 7, 1000),
            (fa::GROUP_OBJ, 5, U),
            (fa::MASK, 6, U),
            (fa::OTHER, 0, U),
        ]);
        assert_eq!(named.equiv_mode(0o100644), (0o100760, true));
        // Creating with 0666 under this default ACL: the mask entry limits the group.
        let mut c = named.clone();
        assert_eq!(c.create_masq(0o100666), (0o100660, true));
        assert_eq!(c.entries[0].perm, 6);
        assert_eq!(c.entries[3].perm, 6);
        assert_eq!(c.entries[4].perm, 0);
        // chmod sets owner, mask (not the group entry) and other.
        named.chmod(0o751);
        let perms: Vec<u16> = named.entries.iter().map(|e| e.perm).collect();
        assert_eq!(perms, vec![7, 7, 5, 5, 1]);
    }
}
