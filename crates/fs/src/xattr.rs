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

use crate::acl::AclKind;
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
        Ok((fx::index::SYSTEM, _)) | Err(NameError::UnknownPrefix) => Err(FsError::NotSupported(
            format!("xattr name {}", String::from_utf8_lossy(name)),
        )),
        Ok(v) => Ok(v),
        Err(NameError::TooLong) => Err(FsError::NameTooLong),
        Err(NameError::EmptySuffix) | Err(NameError::ContainsNul) => {
            Err(FsError::Invalid("bad xattr name"))
        }
    }
}

/// The (index, suffix) of a name [`Inner::xattr_get`] would look up as it
/// is, without the file-system lock: `None` for names it rejects and for
/// ACLs (which depend on the mount's `acl` option and are converted).
pub(crate) fn split_for_get(name: &[u8]) -> Option<(u8, &[u8])> {
    parse_name(name).ok().filter(|(index, _)| !is_acl(*index))
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
        if is_acl(index) {
            self.acl_check_enabled()?;
        }
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
        // Under -o noacl ext4 does not list ACLs (posix_acl_xattr_list).
        let acl_on = self.acl_on();
        Ok(l.ibody
            .iter()
            .chain(blk)
            .filter(|e| listable(e.index) && (acl_on || !is_acl(e.index)))
            .filter_map(|e| e.full_name())
            .collect())
    }

    /// Set attribute `name`. `flags.create`: fail with `Exists` if present;
    /// `flags.replace`: fail with `NoData` if absent. A value that cannot fit even
    /// alone, or beside the others, gives `NoSpace` (ENOSPC, as the kernel);
    /// `XattrTooBig` (E2BIG) is for values over the 64 KiB VFS limit.
    /// `kill_sgid` applies to POSIX ACLs only (see `Inner::acl_set`).
    pub fn xattr_set_ext(
        &mut self,
        h: &Handle,
        ino: u32,
        name: &[u8],
        value: &[u8],
        flags: XattrFlags,
        kill_sgid: bool,
    ) -> Result<()> {
        let (index, suffix) = parse_name(name)?;
        if value.len() > XATTR_SIZE_MAX {
            return Err(FsError::XattrTooBig);
        }
        if let Some(kind) = AclKind::of_index(index) {
            // ACLs have ext4's semantics (mode folding); the kernel ignores
            // XATTR_CREATE/XATTR_REPLACE for them. An empty value removes.
            return self.acl_set(h, ino, kind, value, kill_sgid);
        }
        self.xattr_change(h, ino, index, suffix, Some(value.to_vec()), flags)
    }

    /// Remove attribute `name` (`NoData` if absent; an absent ACL is no error,
    /// as in ext4).
    pub fn xattr_remove(&mut self, h: &Handle, ino: u32, name: &[u8]) -> Result<()> {
        let (index, suffix) = parse_name(name)?;
        if let Some(kind) = AclKind::of_index(index) {
            return self.acl_set(h, ino, kind, b"", false);
        }
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
        self.xattr_change_mode(h, ino, index, suffix, value, flags, None)
    }

    /// [`Inner::xattr_change`] that also sets the mode to `mode` in the same inode
    /// write (an access ACL changes both). Removing an absent attribute or storing
    /// an unchanged value writes nothing unless the mode changes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn xattr_change_mode(
        &mut self,
        h: &Handle,
        ino: u32,
        index: u8,
        suffix: &[u8],
        value: Option<Vec<u8>>,
        flags: XattrFlags,
        mode: Option<u16>,
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
        let mode = mode.filter(|&m| m != inode.mode);
        let mut ibody = old.ibody.clone();
        let mut block: Vec<Xattr> = old
            .block
            .as_ref()
            .map(|b| b.1.entries.clone())
            .unwrap_or_default();
        let mut block_changed = false;
        match value {
            None if existing.is_none() => {
                if mode.is_none() {
                    return Ok(());
                }
            }
            None => {
                if !remove_key(&mut ibody, index, suffix) {
                    block_changed = remove_key(&mut block, index, suffix);
                }
            }
            Some(v) if existing.is_some_and(|e| e.value == v) => {
                if mode.is_none() {
                    // Unchanged: no write, no ctime update (as the kernel).
                    return Ok(());
                }
            }
            Some(v) => {
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
                        // The kernel answers ENOSPC here; E2BIG is only for
                        // values over the VFS limit.
                        return Err(FsError::NoSpace);
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
        if let Some(m) = mode {
            inode.mode = m;
        }
        if (ibody != old.ibody || block_changed) && !self.sb.has_compat(sbf::COMPAT_EXT_ATTR) {
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

/// Tests on real images: random sequences against a model, e2fsck -fn, and the kernel
/// (loop mount + llistxattr/lgetxattr) as judges. Need root, e2fsprogs and losetup.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{self, TempImage};
    use crate::types::MountOptions;
    use crate::Fs;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::{BTreeMap, HashMap};
    use std::path::{Path, PathBuf};
    use std::process::Command;

    type AttrMap = BTreeMap<Vec<u8>, Vec<u8>>;

    fn run(cmd: &str, args: &[&str]) -> String {
        let out = Command::new(cmd)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{cmd}: {e}"));
        assert!(
            out.status.success(),
            "{cmd} {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// e2fsck -fn must exit 0 and print nothing but pass banners and the summary.
    fn assert_clean(img: &Path) {
        // The core stamps s_wtime from the precise clock; e2fsck compares it with
        // time(), the coarse clock, which can lag by a tick across a second boundary
        // and then reports "last write time is in the future". Let the tick pass.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let r = testutil::fsck(img);
        let problems: Vec<&str> = r
            .output
            .lines()
            .map(str::trim)
            .filter(|l| {
                !(l.is_empty()
                    || l.starts_with("Pass ")
                    || l.starts_with("e2fsck ")
                    || (l.contains(" files (") && l.ends_with(" blocks")))
            })
            .collect();
        assert!(
            r.code == 0 && problems.is_empty(),
            "e2fsck -fn reported problems (exit {}):\n{}",
            r.code,
            r.output
        );
    }

    fn image(bs: u32) -> TempImage {
        testutil::mkfs("xattr", 64, &["-b", &bs.to_string()])
    }

    /// Create empty files and directories with debugfs; returns their inode numbers.
    fn populate(img: &Path, files: &[&str], dirs: &[&str]) -> Vec<u32> {
        let empty = PathBuf::from(format!("{}.empty", img.display()));
        std::fs::write(&empty, b"").unwrap();
        let mut script = String::new();
        for f in files {
            script.push_str(&format!("write {} {f}\n", empty.display()));
        }
        for d in dirs {
            script.push_str(&format!("mkdir {d}\n"));
        }
        let sf = PathBuf::from(format!("{}.script", img.display()));
        std::fs::write(&sf, script).unwrap();
        run(
            "debugfs",
            &["-w", "-f", sf.to_str().unwrap(), img.to_str().unwrap()],
        );
        let _ = std::fs::remove_file(&empty);
        let _ = std::fs::remove_file(&sf);
        files.iter().chain(dirs).map(|n| ino_of(img, n)).collect()
    }

    fn ino_of(img: &Path, name: &str) -> u32 {
        let out = run(
            "debugfs",
            &["-R", &format!("imap /{name}"), img.to_str().unwrap()],
        );
        out.split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("imap output: {out}"))
    }

    fn open(img: &Path) -> Fs {
        Fs::open_path(img, MountOptions::default()).unwrap()
    }

    /// Loop device + mount, torn down on drop (also when a test fails).
    struct KernelMount {
        dir: PathBuf,
        loopdev: String,
        mounted: bool,
    }
    impl KernelMount {
        fn new(img: &Path) -> KernelMount {
            let dir = PathBuf::from(format!("{}.mnt", img.display()));
            std::fs::create_dir_all(&dir).unwrap();
            let loopdev = run("losetup", &["-f", "--show", img.to_str().unwrap()])
                .trim()
                .to_string();
            let mut m = KernelMount {
                dir,
                loopdev,
                mounted: false,
            };
            run("mount", &[&m.loopdev, m.dir.to_str().unwrap()]);
            m.mounted = true;
            m
        }
        fn unmount(&mut self) {
            if self.mounted {
                run("umount", &[self.dir.to_str().unwrap()]);
                self.mounted = false;
            }
        }
    }
    impl Drop for KernelMount {
        fn drop(&mut self) {
            if self.mounted {
                let _ = Command::new("umount").arg(&self.dir).status();
            }
            let _ = Command::new("losetup").args(["-d", &self.loopdev]).status();
            let _ = std::fs::remove_dir(&self.dir);
        }
    }

    /// Attributes as the kernel reports them (the system calls, crate::testutil).
    fn getfattr(path: &Path) -> AttrMap {
        crate::testutil::kernel_xattr::list(path)
            .unwrap_or_else(|e| panic!("listing xattrs of {}: errno {e}", path.display()))
    }

    fn setfattr(path: &Path, name: &str, value: &[u8]) {
        crate::testutil::kernel_xattr::set(path, name.as_bytes(), value)
            .unwrap_or_else(|e| panic!("lsetxattr {} {name}: errno {e}", path.display()));
    }

    fn show(m: &AttrMap) -> BTreeMap<String, String> {
        m.iter()
            .map(|(k, v)| {
                let hex: String = v.iter().map(|b| format!("{b:02x}")).collect();
                (String::from_utf8_lossy(k).into_owned(), hex)
            })
            .collect()
    }

    /// Everything our fs reports for an inode.
    fn ours(fs: &Fs, ino: u32) -> AttrMap {
        let mut m = AttrMap::new();
        for n in fs.listxattr(ino).unwrap() {
            let v = fs.getxattr(ino, &n).unwrap();
            assert!(m.insert(n, v).is_none(), "duplicate name in list");
        }
        m
    }

    /// A valid VFS-format POSIX ACL (sorted, with a mask when named entries exist).
    /// Always with a named user: an ACL the mode can express would become the mode
    /// instead of an attribute (see acl.rs and tests/acl.rs), which this model of
    /// plain attribute storage does not follow.
    fn random_acl(rng: &mut StdRng) -> Vec<u8> {
        let mut v = acl::VFS_VERSION.to_le_bytes().to_vec();
        let mut push = |tag: u16, perm: u16, id: u32| {
            v.extend(tag.to_le_bytes());
            v.extend(perm.to_le_bytes());
            v.extend(id.to_le_bytes());
        };
        push(acl::USER_OBJ, rng.gen_range(0..8), acl::UNDEFINED_ID);
        let users = rng.gen_range(1..3u32);
        for u in 0..users {
            push(acl::USER, rng.gen_range(0..8), 1000 + u * 7);
        }
        push(acl::GROUP_OBJ, rng.gen_range(0..8), acl::UNDEFINED_ID);
        if users > 0 {
            push(acl::MASK, rng.gen_range(0..8), acl::UNDEFINED_ID);
        }
        push(acl::OTHER, rng.gen_range(0..8), acl::UNDEFINED_ID);
        v
    }

    fn random_value(rng: &mut StdRng, bs: usize) -> Vec<u8> {
        let len = match rng.gen_range(0..10) {
            0..=3 => rng.gen_range(0..16),
            4..=6 => rng.gen_range(16..100),
            7..=8 => rng.gen_range(100..bs / 2),
            _ => rng.gen_range(bs / 2..bs + 100),
        };
        (0..len).map(|_| rng.gen()).collect()
    }

    const NAMES: &[&str] = &[
        "user.a",
        "user.b",
        "user.mime_type",
        "user.a_rather_long_attribute_name_to_use_up_entry_space_0123456789",
        "trusted.t",
        "trusted.overlay.origin",
        "security.selinux",
        "security.ima",
        "system.posix_acl_access",
    ];

    fn model_run(bs: u32, seed: u64, steps: usize) {
        let img = image(bs);
        let files = ["f0", "f1", "f2", "f3"];
        let inos = populate(&img.path, &files, &["d0"]);
        let paths: Vec<&str> = files.iter().copied().chain(["d0"]).collect();
        let dir_ino = *inos.last().unwrap();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut model: HashMap<u32, AttrMap> = inos.iter().map(|&i| (i, AttrMap::new())).collect();
        let fs = open(&img.path);
        let (mut sets, mut removes, mut too_big) = (0, 0, 0);
        for step in 0..steps {
            let ino = inos[rng.gen_range(0..inos.len())];
            let mut name = NAMES[rng.gen_range(0..NAMES.len())].as_bytes().to_vec();
            if ino == dir_ino && rng.gen_bool(0.2) {
                name = b"system.posix_acl_default".to_vec();
            }
            let is_acl = name.starts_with(b"system.posix_acl");
            let m = model.get_mut(&ino).unwrap();
            let present = m.contains_key(&name);
            match rng.gen_range(0..10) {
                0..=5 => {
                    let value = if is_acl {
                        random_acl(&mut rng)
                    } else {
                        random_value(&mut rng, bs as usize)
                    };
                    let flags = match rng.gen_range(0..4) {
                        0 => XattrFlags {
                            create: true,
                            replace: false,
                        },
                        1 => XattrFlags {
                            create: false,
                            replace: true,
                        },
                        _ => XattrFlags::default(),
                    };
                    let r = fs.setxattr(ino, &name, &value, flags);
                    // The kernel ignores XATTR_CREATE/XATTR_REPLACE for ACLs.
                    let flags = if is_acl { XattrFlags::default() } else { flags };
                    if flags.create && present {
                        assert!(matches!(r, Err(FsError::Exists)), "step {step}: {r:?}");
                    } else if flags.replace && !present {
                        assert!(matches!(r, Err(FsError::NoData)), "step {step}: {r:?}");
                    } else {
                        let mut after = m.clone();
                        after.insert(name.clone(), value.clone());
                        match r {
                            Ok(()) => {
                                sets += 1;
                                *m = after;
                            }
                            Err(FsError::NoSpace) | Err(FsError::XattrTooBig) => {
                                too_big += 1;
                                // Only allowed when the whole set could not fit in
                                // one block, however it is placed.
                                let set: Vec<Xattr> = after
                                    .iter()
                                    .map(|(k, v)| Xattr::new(k, v.clone()).unwrap())
                                    .collect();
                                assert!(
                                    !fx::fits_block(&set, bs as usize),
                                    "step {step}: refused a set that fits a block"
                                );
                            }
                            Err(e) => panic!("step {step}: set failed: {e}"),
                        }
                    }
                }
                6..=8 => {
                    let r = fs.removexattr(ino, &name);
                    if present || is_acl {
                        assert!(r.is_ok(), "step {step}: {r:?}");
                        m.remove(&name);
                        removes += 1;
                    } else {
                        assert!(matches!(r, Err(FsError::NoData)), "step {step}: {r:?}");
                    }
                }
                _ => {}
            }
            // The touched name always reads back as in the model.
            let got = fs.getxattr(ino, &name);
            match m.get(&name) {
                Some(v) => assert_eq!(&got.unwrap(), v, "step {step}"),
                None => assert!(matches!(got, Err(FsError::NoData)), "step {step}"),
            }
            if step % 50 == 0 {
                for &i in &inos {
                    assert_eq!(show(&ours(&fs, i)), show(&model[&i]), "step {step}");
                }
            }
        }
        assert!(sets > steps / 4 && removes > steps / 20, "{sets} {removes}");
        assert!(too_big > 0, "no value ever forced NoSpace/XattrTooBig");
        // Some inode must have ended with a block (values up to bs force one).
        {
            let mut g = fs.inner.lock();
            let with_block = inos
                .iter()
                .filter(|&&i| g.read_inode(i).unwrap().file_acl != 0)
                .count();
            assert!(with_block > 0);
        }
        fs.unmount().unwrap();
        drop(fs);
        assert_clean(&img.path);

        // Persisted: a fresh mount sees the model.
        let fs = open(&img.path);
        for &i in &inos {
            assert_eq!(show(&ours(&fs, i)), show(&model[&i]));
        }
        fs.unmount().unwrap();
        drop(fs);

        // The kernel sees the same attributes.
        let mut km = KernelMount::new(&img.path);
        for (p, i) in paths.iter().zip(&inos) {
            assert_eq!(
                show(&getfattr(&km.dir.join(p))),
                show(&model[i]),
                "kernel view of {p}"
            );
        }
        km.unmount();
        assert_clean(&img.path);
    }

    #[test]
    fn model_random_1k() {
        model_run(1024, 1, 500);
        model_run(1024, 2, 500);
    }

    #[test]
    fn model_random_4k() {
        model_run(4096, 3, 500);
        model_run(4096, 4, 500);
    }

    #[test]
    fn errors_flags_and_ctime() {
        let img = image(4096);
        let ino = populate(&img.path, &["f"], &[])[0];
        let fs = open(&img.path);
        let none = XattrFlags::default();
        let create = XattrFlags {
            create: true,
            replace: false,
        };
        let replace = XattrFlags {
            create: false,
            replace: true,
        };
        assert!(fs.listxattr(ino).unwrap().is_empty());
        assert!(matches!(fs.getxattr(ino, b"user.x"), Err(FsError::NoData)));
        assert!(matches!(
            fs.setxattr(ino, b"user.x", b"1", replace),
            Err(FsError::NoData)
        ));
        assert!(matches!(
            fs.removexattr(ino, b"user.x"),
            Err(FsError::NoData)
        ));
        let c0 = fs.getattr(ino).unwrap().ctime;
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs.setxattr(ino, b"user.x", b"1", create).unwrap();
        let c1 = fs.getattr(ino).unwrap().ctime;
        assert!(c1 > c0, "ctime must move on set");
        assert!(matches!(
            fs.setxattr(ino, b"user.x", b"2", create),
            Err(FsError::Exists)
        ));
        fs.setxattr(ino, b"user.x", b"2", replace).unwrap();
        assert_eq!(fs.getxattr(ino, b"user.x").unwrap(), b"2");
        // Setting the same value again changes nothing.
        let c2 = fs.getattr(ino).unwrap().ctime;
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs.setxattr(ino, b"user.x", b"2", none).unwrap();
        assert_eq!(fs.getattr(ino).unwrap().ctime, c2);
        // Names.
        let long = [b"user.".as_slice(), &[b'n'; 251]].concat();
        assert!(matches!(
            fs.setxattr(ino, &long, b"", none),
            Err(FsError::NameTooLong)
        ));
        assert!(matches!(fs.getxattr(ino, &long), Err(FsError::NameTooLong)));
        let max = [b"user.".as_slice(), &[b'n'; 250]].concat();
        fs.setxattr(ino, &max, b"v", none).unwrap();
        assert_eq!(fs.getxattr(ino, &max).unwrap(), b"v");
        assert!(matches!(
            fs.setxattr(ino, b"os2.x", b"", none),
            Err(FsError::NotSupported(_))
        ));
        assert!(matches!(
            fs.setxattr(ino, b"system.data", b"", none),
            Err(FsError::NotSupported(_))
        ));
        assert!(matches!(
            fs.setxattr(ino, b"user.", b"", none),
            Err(FsError::Invalid(_))
        ));
        // Not version 2: EOPNOTSUPP, as posix_acl_from_xattr answers.
        assert!(matches!(
            fs.setxattr(ino, b"system.posix_acl_access", b"junk", none),
            Err(FsError::NotSupported(_))
        ));
        assert!(matches!(
            fs.setxattr(ino, b"system.posix_acl_access", b"\x02\0\0\0junk", none),
            Err(FsError::Invalid(_))
        ));
        // A 250-byte name does not fit in the 96-byte in-inode area: it is in the block.
        assert_ne!(fs.inner.lock().read_inode(ino).unwrap().file_acl, 0);
        fs.removexattr(ino, &max).unwrap();
        assert_eq!(fs.inner.lock().read_inode(ino).unwrap().file_acl, 0);
        // Sizes: over the VFS limit, and too big for any place.
        assert!(matches!(
            fs.setxattr(ino, b"user.big", &vec![1; 70000], none),
            Err(FsError::XattrTooBig)
        ));
        assert!(matches!(
            fs.setxattr(ino, b"user.big", &vec![1; 4096], none),
            Err(FsError::NoSpace)
        ));
        // The largest value that fits a 4 KiB block alone.
        let v = vec![7u8; 4096 - 32 - 20 - 4];
        fs.setxattr(ino, b"user.big", &v, none).unwrap();
        assert_eq!(fs.getxattr(ino, b"user.big").unwrap(), v);
        // Now the block is full: another block-sized value does not fit beside it.
        assert!(matches!(
            fs.setxattr(ino, b"user.big2", &v, none),
            Err(FsError::NoSpace)
        ));
        let blocks_with = fs.getattr(ino).unwrap().blocks;
        fs.removexattr(ino, b"user.big").unwrap();
        assert_eq!(fs.getattr(ino).unwrap().blocks, blocks_with - 8);
        assert_eq!(fs.inner.lock().read_inode(ino).unwrap().file_acl, 0);
        assert_eq!(fs.listxattr(ino).unwrap(), vec![b"user.x".to_vec()]);
        fs.unmount().unwrap();
        drop(fs);
        assert_clean(&img.path);
    }

    fn file_acl(fs: &Fs, ino: u32) -> u64 {
        fs.inner.lock().read_inode(ino).unwrap().file_acl
    }

    fn refcount(fs: &Fs, blk: u64) -> u32 {
        let g = fs.inner.lock();
        let b = g.read_meta(blk).unwrap();
        let r = fx::parse_block(&b.data(), blk, &g.csum).unwrap().refcount;
        r
    }

    /// Free an inode the way eviction does, without needing directory code: release
    /// its xattr block, mark it deleted and free its number. The caller removes the
    /// name (debugfs unlink) afterwards.
    fn delete_inode(fs: &Fs, ino: u32) {
        let mut g = fs.inner.lock();
        let h = g.start(16).unwrap();
        let mut i = g.read_inode(ino).unwrap();
        let bs = g.bs;
        g.xattr_free_inode(&h, ino, &mut i).unwrap();
        assert_eq!(i.file_acl, 0);
        assert_eq!(i.blocks_512(bs), 0, "empty file: only the xattr block");
        i.links_count = 0;
        i.dtime = (now().sec as u32).max(1);
        g.write_inode(&h, ino, &i).unwrap();
        g.free_inode(&h, ino, false).unwrap();
        g.stop(h).unwrap();
    }

    /// Blocks shared by the kernel: copy-on-write on change, refcounts on removal
    /// and deletion, block freed with the last reference.
    fn shared_blocks(bs: u32) {
        let img = image(bs);
        let names = ["s1", "s2", "s3", "s4", "s5"];
        let big = vec![0x5Au8; bs as usize / 2];
        {
            let mut km = KernelMount::new(&img.path);
            for n in names {
                let p = km.dir.join(n);
                std::fs::write(&p, b"").unwrap();
                setfattr(&p, "user.big", &big);
                setfattr(&p, "user.small", b"s");
            }
            km.unmount();
        }
        let inos: Vec<u32> = names.iter().map(|n| ino_of(&img.path, n)).collect();
        let fs = open(&img.path);
        let shared = file_acl(&fs, inos[0]);
        assert_ne!(shared, 0);
        for &i in &inos {
            assert_eq!(file_acl(&fs, i), shared, "kernel shares identical blocks");
            assert_eq!(fs.getxattr(i, b"user.big").unwrap(), big);
        }
        assert_eq!(refcount(&fs, shared), 5);
        let blocks0 = fs.getattr(inos[0]).unwrap().blocks;
        let free0 = fs.statfs().unwrap().blocks_free;

        // Change a block attribute of s1: it gets a private copy.
        let big2 = vec![0xA5u8; bs as usize / 2];
        fs.setxattr(inos[0], b"user.big", &big2, XattrFlags::default())
            .unwrap();
        let own = file_acl(&fs, inos[0]);
        assert_ne!(own, shared);
        assert_eq!(refcount(&fs, own), 1);
        assert_eq!(refcount(&fs, shared), 4);
        assert_eq!(fs.getattr(inos[0]).unwrap().blocks, blocks0);
        assert_eq!(fs.statfs().unwrap().blocks_free, free0 - 1);
        assert_eq!(fs.getxattr(inos[1], b"user.big").unwrap(), big);
        // In-place change of the now-private block keeps its number.
        fs.setxattr(inos[0], b"user.more", &[3u8; 100], XattrFlags::default())
            .unwrap();

        // s2 drops its block attributes entirely: reference released, i_blocks down.
        fs.removexattr(inos[1], b"user.big").unwrap();
        if file_acl(&fs, inos[1]) != 0 {
            fs.removexattr(inos[1], b"user.small").unwrap();
        }
        assert_eq!(file_acl(&fs, inos[1]), 0);
        assert_eq!(
            fs.getattr(inos[1]).unwrap().blocks,
            blocks0 - bs as u64 / 512
        );
        assert_eq!(refcount(&fs, shared), 3);

        // s3 and s4 are deleted; s5 keeps the block, now with refcount 1.
        delete_inode(&fs, inos[2]);
        assert_eq!(refcount(&fs, shared), 2);
        delete_inode(&fs, inos[3]);
        assert_eq!(refcount(&fs, shared), 1);
        // Changing s5 now rewrites the block in place (no longer shared).
        fs.setxattr(inos[4], b"user.small", b"t", XattrFlags::default())
            .unwrap();
        let s5_block = file_acl(&fs, inos[4]);
        // s5's small attribute may live in the inode; the block stays while user.big does.
        assert_eq!(s5_block, shared);
        // Deleting s5 frees the block.
        let free1 = fs.statfs().unwrap().blocks_free;
        delete_inode(&fs, inos[4]);
        assert_eq!(fs.statfs().unwrap().blocks_free, free1 + 1);
        fs.unmount().unwrap();
        drop(fs);
        for n in ["s3", "s4", "s5"] {
            run(
                "debugfs",
                &[
                    "-w",
                    "-R",
                    &format!("unlink /{n}"),
                    img.path.to_str().unwrap(),
                ],
            );
        }
        assert_clean(&img.path);

        let mut expect1 = AttrMap::new();
        expect1.insert(b"user.big".to_vec(), big2);
        expect1.insert(b"user.small".to_vec(), b"s".to_vec());
        expect1.insert(b"user.more".to_vec(), vec![3u8; 100]);
        let mut expect2 = AttrMap::new();
        if let Ok(fs) = Fs::open_path(&img.path, MountOptions::default()) {
            if fs.getxattr(inos[1], b"user.small").is_ok() {
                expect2.insert(b"user.small".to_vec(), b"s".to_vec());
            }
            fs.unmount().unwrap();
        }
        let mut km = KernelMount::new(&img.path);
        assert_eq!(show(&getfattr(&km.dir.join("s1"))), show(&expect1));
        assert_eq!(show(&getfattr(&km.dir.join("s2"))), show(&expect2));
        km.unmount();
        assert_clean(&img.path);
    }

    #[test]
    fn shared_blocks_1k() {
        shared_blocks(1024);
    }

    #[test]
    fn shared_blocks_4k() {
        shared_blocks(4096);
    }
}
