//! POSIX ACLs through the FUSE mount, with kernel ext4 as the oracle (issue #9,
//! item 1): `cp -a` of a tree with ACLs and modes 644/755/2775 keeps every mode,
//! owner and ACL as it does onto ext4 (before the fix group and other bits were
//! lost: 644 became 600); new entries under default ACLs get the same modes and
//! ACLs as on ext4 whatever the umask; the kernel enforces ACLs for an
//! unprivileged uid as it does on ext4; an ACL set by the owner outside the
//! file's group clears setgid as on ext4; `-o noacl` refuses ACL names.
//! `e2fsck -fn` must be clean after every unmount. Needs root, /dev/fuse, losetup
//! and coreutils' `cp` built with ACL support (Debian's is).

mod common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_commitfs");
const ACCESS: &str = "system.posix_acl_access";
const DEFAULT: &str = "system.posix_acl_default";
const UNDEF: u32 = u32::MAX;
/// The unprivileged user of the permission checks (no such account needed).
const USER: u32 = 4242;

/// A VFS-format ACL (version 2, 8-byte entries) from (tag, perm, id) triples.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for &(tag, perm, id) in entries {
        v.extend(tag.to_le_bytes());
        v.extend(perm.to_le_bytes());
        v.extend(id.to_le_bytes());
    }
    v
}

/// user::rwx user:USER:r-x group::r-x mask::r-x other::---
fn dir_default_acl() -> Vec<u8> {
    acl(&[
        (0x01, 7, UNDEF),
        (0x02, 5, USER),
        (0x04, 5, UNDEF),
        (0x10, 5, UNDEF),
        (0x20, 0, UNDEF),
    ])
}

/// `lgetxattr`; `None` for ENODATA.
fn get(p: &Path, name: &str) -> Result<Option<Vec<u8>>, i32> {
    match posix_get_xattr(p, name.as_bytes()) {
        Ok(v) => Ok(Some(v)),
        Err(libc::ENODATA) => Ok(None),
        Err(e) => Err(e),
    }
}

fn chmod(p: &Path, mode: u32) {
    let c = cpath(p);
    // SAFETY: valid NUL-terminated path.
    assert_eq!(
        unsafe { libc::chmod(c.as_ptr(), mode) },
        0,
        "chmod {}",
        p.display()
    );
}

fn chown(p: &Path, uid: u32, gid: u32) {
    let c = cpath(p);
    // SAFETY: valid NUL-terminated path.
    assert_eq!(unsafe { libc::lchown(c.as_ptr(), uid, gid) }, 0);
}

/// Per path below `root`: mode, uid, gid, size of regular files, access and
/// default ACL. lost+found is left out (mkfs makes it, cp does not copy it).
type Fields = (u32, u32, u32, u64, Option<Vec<u8>>, Option<Vec<u8>>);

fn fields(root: &Path) -> BTreeMap<String, Fields> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(root.to_path_buf(), ".".to_string())];
    while let Some((p, rel)) = stack.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        let ft = m.file_type();
        let acls = if ft.is_symlink() {
            (None, None)
        } else {
            (get(&p, ACCESS).unwrap(), get(&p, DEFAULT).unwrap())
        };
        let size = if ft.is_file() { m.len() } else { 0 };
        out.insert(
            rel.clone(),
            (m.mode(), m.uid(), m.gid(), size, acls.0, acls.1),
        );
        if ft.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                if rel == "." && name == "lost+found" {
                    continue;
                }
                stack.push((e.path(), format!("{rel}/{name}")));
            }
        }
    }
    out
}

fn diff(a: &BTreeMap<String, Fields>, b: &BTreeMap<String, Fields>) -> String {
    let mut s = String::new();
    for k in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
        if a.get(k) != b.get(k) {
            s += &format!(
                "{k}:\n  ext4     {:?}\n  commitfs {:?}\n",
                a.get(k),
                b.get(k)
            );
        }
    }
    s
}

/// The source tree (on a kernel ext4 mount): files 644 and 755, a setgid 2775
/// directory with a default ACL and an entry that inherited it, a file with a
/// named-user ACL, a file owned by USER, a symlink.
fn build_source(root: &Path) {
    let w = |p: &str, data: &[u8], mode: u32| {
        let path = root.join(p);
        std::fs::write(&path, data).unwrap();
        chmod(&path, mode);
    };
    w("f644", b"six four four", 0o644);
    w("f755", b"#!/bin/sh\n", 0o755);
    w("acl_file", b"acl", 0o640);
    set_xattr(
        &root.join("acl_file"),
        ACCESS,
        &acl(&[
            (0x01, 6, UNDEF),
            (0x02, 6, USER),
            (0x04, 4, UNDEF),
            (0x10, 6, UNDEF),
            (0x20, 0, UNDEF),
        ]),
    );
    w("owned", b"mine", 0o600);
    chown(&root.join("owned"), USER, USER);
    let d = root.join("d2775");
    std::fs::create_dir(&d).unwrap();
    chown(&d, 0, 100);
    chmod(&d, 0o2775);
    set_xattr(&d, DEFAULT, &dir_default_acl());
    std::fs::write(d.join("inherited"), b"x").unwrap();
    std::fs::create_dir(d.join("subdir")).unwrap();
    let d755 = root.join("d755");
    std::fs::create_dir(&d755).unwrap();
    chmod(&d755, 0o755);
    std::os::unix::fs::symlink("f644", root.join("link")).unwrap();
}

/// Run `sh -c script` in `dir`.
fn sh(dir: &Path, script: &str) {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sh -c {script:?} in {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Run `f` in a forked child as uid/gid `id` without supplementary groups; its
/// result (an errno, 0 for success) comes back as the exit status. `f` may only
/// make system calls (the parent is multi-threaded).
fn as_user(id: u32, f: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only makes async-signal-safe system calls and _exits.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = libc::setgroups(0, std::ptr::null()) == 0
                && libc::setresgid(id, id, id) == 0
                && libc::setresuid(id, id, id) == 0;
            libc::_exit(if ok { f() } else { 255 });
        }
        let mut status = 0;
        assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        assert!(libc::WIFEXITED(status), "child died: {status:#x}");
        libc::WEXITSTATUS(status)
    }
}

/// `open(path, flags)` as USER: 0 or the errno.
fn open_as_user(path: &Path, flags: i32) -> i32 {
    let c = cpath(path);
    as_user(USER, || {
        // SAFETY: valid NUL-terminated path; only system calls in the child.
        unsafe {
            let fd = libc::open(c.as_ptr(), flags);
            if fd < 0 {
                *libc::__errno_location()
            } else {
                libc::close(fd);
                0
            }
        }
    })
}

/// `setxattr(path, system.posix_acl_access, value)` as USER: 0 or the errno.
fn set_acl_as_user(path: &Path, value: &[u8]) -> i32 {
    let c = cpath(path);
    let n = CString::new(ACCESS).unwrap();
    as_user(USER, || {
        // SAFETY: valid strings and buffer; only system calls in the child.
        unsafe {
            let r = libc::setxattr(
                c.as_ptr(),
                n.as_ptr(),
                value.as_ptr() as *const libc::c_void,
                value.len(),
                0,
            );
            if r < 0 {
                *libc::__errno_location()
            } else {
                0
            }
        }
    })
}

/// Everything done to one destination (kernel ext4 or commitfs), so both get
/// exactly the same treatment. Returns the permission-check outcomes.
fn exercise(src: &Path, dst: &Path) -> Vec<(String, i32)> {
    // cp -a of the whole tree (root included: its mode and ACLs too).
    let out = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(dst)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cp -a into {}: {}",
        dst.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    // New entries under the default ACL, with an umask it must override, and
    // without one (umask applies).
    sh(
        &dst.join("d2775"),
        "umask 077; echo > new_file; mkdir new_dir; mkfifo new_fifo; \
         mkdir -m 0700 new_dir/deeper; echo > new_dir/deeper/f",
    );
    sh(dst, "umask 027; echo > plain_new; mkdir plain_dir");
    // chmod of a file with an ACL rewrites it.
    chmod(&dst.join("acl_file"), 0o604);

    // Permission checks for an unprivileged uid, decided by ACLs.
    let grant = dst.join("grant");
    std::fs::write(&grant, b"g").unwrap();
    chmod(&grant, 0o600);
    set_xattr(
        &grant,
        ACCESS,
        &acl(&[
            (0x01, 6, UNDEF),
            (0x02, 6, USER),
            (0x04, 0, UNDEF),
            (0x10, 6, UNDEF),
            (0x20, 0, UNDEF),
        ]),
    );
    let deny = dst.join("deny");
    std::fs::write(&deny, b"d").unwrap();
    chmod(&deny, 0o644);
    set_xattr(
        &deny,
        ACCESS,
        &acl(&[
            (0x01, 6, UNDEF),
            (0x02, 0, USER),
            (0x04, 4, UNDEF),
            (0x10, 4, UNDEF),
            (0x20, 4, UNDEF),
        ]),
    );
    // The mask limits a named entry: rw- for USER, but mask r--.
    let masked = dst.join("masked");
    std::fs::write(&masked, b"m").unwrap();
    set_xattr(
        &masked,
        ACCESS,
        &acl(&[
            (0x01, 6, UNDEF),
            (0x02, 6, USER),
            (0x04, 0, UNDEF),
            (0x10, 4, UNDEF),
            (0x20, 0, UNDEF),
        ]),
    );
    // USER owns a setgid file of a group it is not in, and sets an ACL on it.
    let sgid = dst.join("sgid_owned");
    std::fs::write(&sgid, b"s").unwrap();
    chown(&sgid, USER, 100);
    chmod(&sgid, 0o2770);
    let user_acl = acl(&[
        (0x01, 7, UNDEF),
        (0x02, 5, 0),
        (0x04, 7, UNDEF),
        (0x10, 7, UNDEF),
        (0x20, 0, UNDEF),
    ]);
    let (rd, wr) = (libc::O_RDONLY, libc::O_WRONLY);
    vec![
        ("grant read".into(), open_as_user(&grant, rd)),
        ("grant write".into(), open_as_user(&grant, wr)),
        ("deny read".into(), open_as_user(&deny, rd)),
        ("masked read".into(), open_as_user(&masked, rd)),
        ("masked write".into(), open_as_user(&masked, wr)),
        (
            "inherited read".into(),
            open_as_user(&dst.join("d2775/new_file"), rd),
        ),
        ("f644 read".into(), open_as_user(&dst.join("f644"), rd)),
        ("f644 write".into(), open_as_user(&dst.join("f644"), wr)),
        ("sgid setfacl".into(), set_acl_as_user(&sgid, &user_acl)),
        (
            "not owner setfacl".into(),
            set_acl_as_user(&grant, &user_acl),
        ),
    ]
}

#[test]
fn cp_a_inheritance_and_permissions_match_kernel_ext4() {
    assert!(Path::new("/dev/fuse").exists(), "needs /dev/fuse");
    let src_img = mkfs("acl_src", 32, &[]);
    let k_img = mkfs("acl_kdst", 32, &[]);
    let f_img = mkfs("acl_fdst", 32, &[]);
    let mut src = KernelMount::mount(&src_img.path, "acl").unwrap();
    build_source(src.path());
    let src_fields = fields(src.path());

    let mut kdst = KernelMount::mount(&k_img.path, "acl").unwrap();
    let k_checks = exercise(src.path(), kdst.path());
    let k_fields = fields(kdst.path());

    let mut fdst = FuseMount::mount(Path::new(BIN), &f_img.path, &["-o", "allow_other"]).unwrap();
    let f_checks = exercise(src.path(), fdst.path());
    let f_fields = fields(fdst.path());

    // The symptom first, plainly.
    let f644 = &f_fields["./f644"];
    assert_eq!(f644.0 & 0o7777, 0o644, "cp -a lost permission bits of f644");
    assert_eq!(f_fields["./f755"].0 & 0o7777, 0o755);
    assert_eq!(f_fields["./d2775"].0 & 0o7777, 0o2775);
    assert_eq!(f_fields["./d2775"].5, Some(dir_default_acl()));
    // The copied part equals the source (cp -a preserves everything here).
    for (k, v) in &src_fields {
        let kv = &k_fields[k];
        if k != "./acl_file" && k != "." {
            assert_eq!(kv, v, "kernel ext4 copy of {k} differs from the source");
        }
    }
    // Field by field against kernel ext4.
    let d = diff(&k_fields, &f_fields);
    assert!(d.is_empty(), "commitfs differs from kernel ext4:\n{d}");
    assert_eq!(k_checks, f_checks, "permission checks differ (errnos)");
    // And the expected outcomes, so the kernel is not trusted blindly.
    let expect = [
        0,
        0,
        libc::EACCES,
        0,
        libc::EACCES,
        0,
        0,
        libc::EACCES,
        0,
        libc::EPERM,
    ];
    let got: Vec<i32> = f_checks.iter().map(|c| c.1).collect();
    assert_eq!(got, expect, "{f_checks:?}");
    let sgid_mode = std::fs::metadata(fdst.path().join("sgid_owned"))
        .unwrap()
        .mode();
    assert_eq!(
        sgid_mode & 0o7777,
        0o0770,
        "ACL by a non-member clears setgid"
    );

    fdst.unmount().unwrap();
    kdst.unmount().unwrap();
    src.unmount().unwrap();
    check_fsck(&f_img.path, "commitfs destination").unwrap();
    check_fsck(&k_img.path, "kernel destination").unwrap();

    // What commitfs wrote reads back the same through kernel ext4.
    let mut again = KernelMount::mount(&f_img.path, "acl").unwrap();
    let d = diff(&k_fields, &fields(again.path()));
    assert!(
        d.is_empty(),
        "kernel view of commitfs's image differs:\n{d}"
    );
    again.unmount().unwrap();
    check_fsck(&f_img.path, "commitfs destination after kernel mount").unwrap();
}

#[test]
fn noacl_refuses_acls() {
    assert!(Path::new("/dev/fuse").exists(), "needs /dev/fuse");
    let img = mkfs("acl_noacl", 16, &[]);
    let mut m = FuseMount::mount(Path::new(BIN), &img.path, &["-o", "noacl"]).unwrap();
    let f = m.path().join("f");
    std::fs::write(&f, b"x").unwrap();
    let value = acl(&[(0x01, 6, UNDEF), (0x04, 4, UNDEF), (0x20, 4, UNDEF)]);
    let c = cpath(&f);
    let n = CString::new(ACCESS).unwrap();
    // SAFETY: valid strings and buffer.
    let r = unsafe {
        libc::setxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr() as *const libc::c_void,
            value.len(),
            0,
        )
    };
    assert_eq!((r, last_errno()), (-1, libc::EOPNOTSUPP));
    assert_eq!(get(&f, ACCESS), Err(libc::EOPNOTSUPP));
    // Plain umask semantics: the process umask applies.
    sh(m.path(), "umask 027; echo > masked; mkdir dir");
    let mode = |p: &str| std::fs::metadata(m.path().join(p)).unwrap().mode() & 0o7777;
    assert_eq!(mode("masked"), 0o640);
    assert_eq!(mode("dir"), 0o750);
    m.unmount().unwrap();
    check_fsck(&img.path, "noacl mount").unwrap();
}
