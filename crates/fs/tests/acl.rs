//! POSIX ACLs through the library, with ext4's semantics: an access ACL sets the
//! mode (and is not stored when the mode says it all), chmod rewrites the ACL,
//! default ACLs are inherited by new entries (mode and ACL, the umask ignored),
//! `-o noacl` refuses ACL names. The kernel then reads back the same modes and
//! ACLs from the image, and e2fsck finds it clean.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use commitfs_fs::testutil::mkfs;
use commitfs_fs::{FileType, Fs, FsError, MountOptions, SetAttr, XattrFlags, ROOT_INO};
use common::{assert_clean, is_root, KernelMount};

const ACCESS: &[u8] = b"system.posix_acl_access";
const DEFAULT: &[u8] = b"system.posix_acl_default";
const UNDEF: u32 = u32::MAX;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

/// A VFS-format ACL (what getxattr/setxattr carry): version 2, 8-byte entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend(tag.to_le_bytes());
        v.extend(perm.to_le_bytes());
        v.extend(id.to_le_bytes());
    }
    v
}

fn none() -> XattrFlags {
    XattrFlags::default()
}

fn perm(fs: &Fs, ino: u32) -> u16 {
    fs.getattr(ino).unwrap().perm
}

fn kernel_perm(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// The kernel's view of one ACL: `None` for ENODATA.
fn kernel_get(p: &Path, name: &[u8]) -> Option<Vec<u8>> {
    match commitfs_fs::testutil::kernel_xattr::get(p, name) {
        Ok(v) => Some(v),
        Err(libc::ENODATA) => None,
        Err(e) => panic!("lgetxattr {}: errno {e}", p.display()),
    }
}

fn open(img: &Path, acl_on: bool) -> Fs {
    Fs::open_path(
        img,
        MountOptions {
            acl: acl_on,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn access_acl_sets_mode_and_chmod_rewrites_it() {
    if !is_root() {
        eprintln!("skipped: needs root for the kernel mount");
        return;
    }
    let img = mkfs("acl_access", 32, &["-b", "4096"]);
    let fs = open(&img.path, true);
    let f = fs.create(ROOT_INO, b"f", 0o600, 0, 0).unwrap().ino;

    // What `cp -p` does for a 0644 file: an ACL equivalent to the mode. It
    // becomes the mode and is not stored.
    let equiv = acl(&[
        (USER_OBJ, 6, UNDEF),
        (GROUP_OBJ, 4, UNDEF),
        (OTHER, 4, UNDEF),
    ]);
    fs.setxattr(f, ACCESS, &equiv, none()).unwrap();
    assert_eq!(perm(&fs, f), 0o644, "the ACL must fold into the mode");
    assert!(matches!(fs.getxattr(f, ACCESS), Err(FsError::NoData)));
    assert!(fs.listxattr(f).unwrap().is_empty());

    // A real ACL: stored, and the mode's group bits are the mask.
    let named = acl(&[
        (USER_OBJ, 7, UNDEF),
        (USER, 7, 1000),
        (GROUP_OBJ, 4, UNDEF),
        (GROUP, 2, 1000),
        (MASK, 5, UNDEF),
        (OTHER, 1, UNDEF),
    ]);
    fs.setxattr(f, ACCESS, &named, none()).unwrap();
    assert_eq!(perm(&fs, f), 0o751);
    assert_eq!(fs.getxattr(f, ACCESS).unwrap(), named);

    // chmod rewrites owner, mask and other; named entries and the group entry stay.
    fs.setattr(
        f,
        &SetAttr {
            mode: Some(0o640),
            ..Default::default()
        },
    )
    .unwrap();
    let after_chmod = acl(&[
        (USER_OBJ, 6, UNDEF),
        (USER, 7, 1000),
        (GROUP_OBJ, 4, UNDEF),
        (GROUP, 2, 1000),
        (MASK, 4, UNDEF),
        (OTHER, 0, UNDEF),
    ]);
    assert_eq!(fs.getxattr(f, ACCESS).unwrap(), after_chmod);
    assert_eq!(perm(&fs, f), 0o640);

    // Errors as ext4: a default ACL on a file (EACCES), a bad version
    // (EOPNOTSUPP), a named entry without a mask (EINVAL).
    assert!(matches!(
        fs.setxattr(f, DEFAULT, &named, none()),
        Err(FsError::AccessDenied(_))
    ));
    fs.removexattr(f, DEFAULT).unwrap();
    let mut v1 = named.clone();
    v1[0] = 1;
    assert!(matches!(
        fs.setxattr(f, ACCESS, &v1, none()),
        Err(FsError::NotSupported(_))
    ));
    let no_mask = acl(&[
        (USER_OBJ, 7, UNDEF),
        (USER, 7, 1000),
        (GROUP_OBJ, 4, UNDEF),
        (OTHER, 1, UNDEF),
    ]);
    assert!(matches!(
        fs.setxattr(f, ACCESS, &no_mask, none()),
        Err(FsError::Invalid(_))
    ));
    assert_eq!(fs.getxattr(f, ACCESS).unwrap(), after_chmod, "unchanged");

    // A second file keeps its ACL; the first loses it (removing twice is fine).
    let g = fs.create(ROOT_INO, b"g", 0o600, 0, 0).unwrap().ino;
    fs.setxattr(g, ACCESS, &named, none()).unwrap();
    let d = fs.mkdir(ROOT_INO, b"d", 0o700, 0, 0).unwrap().ino;
    fs.setxattr(d, DEFAULT, &named, none()).unwrap();
    assert_eq!(perm(&fs, d), 0o700, "a default ACL leaves the mode alone");
    fs.removexattr(f, ACCESS).unwrap();
    fs.removexattr(f, ACCESS).unwrap();
    assert_eq!(perm(&fs, f), 0o640);
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, "after library ACL ops");

    // The kernel reads the same modes and ACLs.
    let km = KernelMount::new(&img.path, "acl");
    assert_eq!(kernel_perm(&km.dir.join("f")), 0o640);
    assert_eq!(kernel_get(&km.dir.join("f"), ACCESS), None);
    assert_eq!(kernel_perm(&km.dir.join("g")), 0o751);
    assert_eq!(kernel_get(&km.dir.join("g"), ACCESS), Some(named.clone()));
    assert_eq!(kernel_get(&km.dir.join("d"), DEFAULT), Some(named));
    drop(km);
    assert_clean(&img.path, "after the kernel mount");
}

#[test]
fn default_acl_is_inherited_and_replaces_the_umask() {
    if !is_root() {
        eprintln!("skipped: needs root for the kernel mount");
        return;
    }
    let img = mkfs("acl_default", 32, &["-b", "1024"]);
    let fs = open(&img.path, true);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let dacl = acl(&[
        (USER_OBJ, 7, UNDEF),
        (USER, 7, 1000),
        (GROUP_OBJ, 5, UNDEF),
        (MASK, 7, UNDEF),
        (OTHER, 0, UNDEF),
    ]);
    fs.setxattr(d, DEFAULT, &dacl, none()).unwrap();

    // open(O_CREAT, 0666) with umask 022: the default ACL, not the umask, decides.
    let f = fs.create_umask(d, b"f", 0o666, 0o022, 0, 0).unwrap();
    assert_eq!(f.perm, 0o660);
    let f_acl = acl(&[
        (USER_OBJ, 6, UNDEF),
        (USER, 7, 1000),
        (GROUP_OBJ, 5, UNDEF),
        (MASK, 6, UNDEF),
        (OTHER, 0, UNDEF),
    ]);
    assert_eq!(fs.getxattr(f.ino, ACCESS).unwrap(), f_acl);
    assert!(matches!(fs.getxattr(f.ino, DEFAULT), Err(FsError::NoData)));

    // mkdir(0777) with umask 077: both ACLs, mode from the ACL.
    let sub = fs.mkdir_umask(d, b"sub", 0o777, 0o077, 0, 0).unwrap();
    assert_eq!(sub.perm, 0o770);
    assert_eq!(fs.getxattr(sub.ino, DEFAULT).unwrap(), dacl);
    // 0777 leaves every entry as it is: the access ACL is the default one.
    assert_eq!(fs.getxattr(sub.ino, ACCESS).unwrap(), dacl);
    // ... and one level further down, inherited again.
    let deep = fs
        .create_umask(sub.ino, b"deep", 0o640, 0o777, 0, 0)
        .unwrap();
    assert_eq!(deep.perm, 0o640);

    // A fifo inherits too; a symlink never.
    let fifo = FileType::Fifo.mode_bits() | 0o644;
    let p = fs.mknod_umask(d, b"p", fifo, 0o022, 0, 0, 0).unwrap();
    assert_eq!(p.perm, 0o640);
    assert!(fs.getxattr(p.ino, ACCESS).is_ok());
    let l = fs.symlink(d, b"l", b"f", 0, 0).unwrap();
    assert_eq!(l.perm, 0o777);

    // Without a default ACL the umask applies and nothing is stored.
    let plain = fs
        .create_umask(ROOT_INO, b"plain", 0o666, 0o022, 0, 0)
        .unwrap();
    assert_eq!(plain.perm, 0o644);
    assert!(fs.listxattr(plain.ino).unwrap().is_empty());
    fs.unmount().unwrap();
    drop(fs);
    assert_clean(&img.path, "after inheritance");

    // -o noacl: ACL names refused and hidden, the umask applies, nothing inherited.
    let fs = open(&img.path, false);
    let d = fs.resolve("/d").unwrap();
    assert!(matches!(
        fs.getxattr(d, DEFAULT),
        Err(FsError::NotSupported(_))
    ));
    assert!(matches!(
        fs.setxattr(d, ACCESS, &dacl, none()),
        Err(FsError::NotSupported(_))
    ));
    assert!(fs.listxattr(d).unwrap().is_empty());
    let n = fs.create_umask(d, b"noacl", 0o666, 0o022, 0, 0).unwrap();
    assert_eq!(n.perm, 0o644);
    fs.unmount().unwrap();
    drop(fs);
    let fs = open(&img.path, true);
    let n = fs.resolve("/d/noacl").unwrap();
    assert!(fs.listxattr(n).unwrap().is_empty());
    fs.unmount().unwrap();
    drop(fs);

    // The kernel sees what the library wrote.
    let km = KernelMount::new(&img.path, "acl");
    let k = |p: &str| km.dir.join(p);
    assert_eq!(kernel_perm(&k("d/f")), 0o660);
    assert_eq!(kernel_get(&k("d/f"), ACCESS), Some(f_acl));
    assert_eq!(kernel_perm(&k("d/sub")), 0o770);
    assert_eq!(kernel_get(&k("d/sub"), DEFAULT), Some(dacl));
    assert_eq!(kernel_perm(&k("d/sub/deep")), 0o640);
    assert_eq!(kernel_perm(&k("d/p")), 0o640);
    assert_eq!(kernel_perm(&k("plain")), 0o644);
    assert_eq!(kernel_perm(&k("d/noacl")), 0o644);
    drop(km);
    assert_clean(&img.path, "after the kernel mount");
}
