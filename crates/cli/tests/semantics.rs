//! Semantics the Linux file-system regression suite checks (issue #9, item 14),
//! through the FUSE mount of the real `commitfs` binary, with kernel ext4 on a
//! loop device as the oracle: every scenario runs on both and the observations
//! must agree (and match the kernel's documented rule). Images are judged by
//! `e2fsck -fn` after every unmount. Needs root, /dev/fuse, fusermount3.
//!
//! * setuid/setgid bits cleared when an unprivileged user writes, truncates or
//!   fallocates (every mode) a 4666/2666/6766/2676 file, kept for root;
//! * device nodes usable on a root mount, refused with `-o nodev`;
//! * `fstat` of an open directory that `rename()` replaced (or `rmdir` removed)
//!   succeeds with nlink 0;
//! * atime: relatime (the default), strictatime and noatime on read and readdir.

mod common;

use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use common::*;

const BIN: &str = env!("CARGO_BIN_EXE_commitfs");
/// The unprivileged user of the tests ("nobody").
const NOBODY: u32 = 65534;

/// Run `scenario` on kernel ext4 (mounted with `kopts`) and on a FUSE mount
/// (with `fopts`) of fresh images; both images must pass `e2fsck -fn`.
fn on_both<T>(kopts: &str, fopts: &[&str], scenario: impl Fn(&Path) -> T) -> (T, T) {
    assert!(
        unsafe { libc::geteuid() } == 0,
        "these tests need root (mount, mknod, setuid)"
    );
    umask0();
    let kimg = mkfs("sem-k", 64, &["-b", "4096"]);
    let k = {
        let mut km = KernelMount::mount(&kimg.path, kopts).expect("kernel mount");
        let r = scenario(km.path());
        km.unmount().expect("kernel unmount");
        r
    };
    check_fsck(&kimg.path, "the kernel's image").unwrap();
    let fimg = mkfs("sem-f", 64, &["-b", "4096"]);
    let f = {
        let mut fm = FuseMount::mount(Path::new(BIN), &fimg.path, fopts).expect("FUSE mount");
        let _wd = Watchdog::new("semantics".into(), 300, fm.pid(), Some(fm.dir.clone()));
        let r = scenario(fm.path());
        fm.unmount().expect("FUSE unmount");
        r
    };
    check_fsck(&fimg.path, "commitfs's image").unwrap();
    (k, f)
}

fn c(p: &Path) -> CString {
    cpath(p)
}

fn mode_of(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().mode() & 0o7777
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Write,
    Truncate,
    Fallocate(i32),
}

/// Open `path` and change its data as `uid`/`gid` with supplementary `groups`
/// (uid 0: as the test runs), in a forked child; returns the child's errno (0:
/// success).
fn change_as(path: &Path, uid: u32, gid: u32, groups: &[u32], change: Change) -> i32 {
    let p = c(path);
    let groups: Vec<libc::gid_t> = groups.to_vec();
    // SAFETY: the child only makes system calls (async-signal-safe) and _exits.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let fail = || *libc::__errno_location();
            if uid != 0
                && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setresgid(gid, gid, gid) != 0
                    || libc::setresuid(uid, uid, uid) != 0)
            {
                libc::_exit(100);
            }
            let fd = libc::open(p.as_ptr(), libc::O_RDWR);
            if fd < 0 {
                libc::_exit(fail());
            }
            let r = match change {
                Change::Write => (libc::pwrite(fd, b"xy".as_ptr().cast(), 2, 100) == 2) as i32 - 1,
                Change::Truncate => libc::ftruncate(fd, 6000),
                Change::Fallocate(mode) => libc::fallocate(fd, mode, 4096, 8192),
            };
            libc::_exit(if r == 0 { 0 } else { fail() });
        }
        let mut st = 0;
        assert_eq!(libc::waitpid(pid, &mut st, 0), pid);
        assert!(libc::WIFEXITED(st), "child died: {st}");
        let code = libc::WEXITSTATUS(st);
        assert_ne!(code, 100, "could not drop privileges");
        code
    }
}

#[test]
fn setuid_setgid_cleared_by_unprivileged_data_changes() {
    let changes = [
        Change::Write,
        Change::Truncate,
        Change::Fallocate(0),
        Change::Fallocate(libc::FALLOC_FL_KEEP_SIZE),
        Change::Fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE),
        Change::Fallocate(libc::FALLOC_FL_ZERO_RANGE),
        Change::Fallocate(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE),
    ];
    let modes = [0o4666u32, 0o2666, 0o6766, 0o2676, 0o0666];
    // (uid, gid, supplementary groups): nobody; nobody in root's group as primary
    // and as supplementary group (the files are root:root); root.
    let callers: [(u32, u32, &[u32]); 4] = [
        (NOBODY, NOBODY, &[]),
        (NOBODY, 0, &[]),
        (NOBODY, NOBODY, &[0]),
        (0, 0, &[]),
    ];
    let scenario = |root: &Path| {
        let mut out = Vec::new();
        for (i, ch) in changes.iter().enumerate() {
            for (j, &m) in modes.iter().enumerate() {
                for (k, &(uid, gid, groups)) in callers.iter().enumerate() {
                    let p = root.join(format!("f{i}-{j}-{k}"));
                    std::fs::write(&p, vec![7u8; 20_000]).unwrap();
                    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(m))
                        .unwrap();
                    assert_eq!(mode_of(&p), m);
                    let err = change_as(&p, uid, gid, groups, *ch);
                    out.push((*ch, m, k, err, mode_of(&p)));
                }
            }
        }
        out
    };
    let (k, f) = on_both("rw", &["-o", "allow_other"], scenario);
    for (kr, fr) in k.iter().zip(&f) {
        assert_eq!(
            kr, fr,
            "kernel ext4 vs commitfs (change, mode, caller, errno, mode after)"
        );
        let (ch, m, k, err, after) = *fr;
        assert_eq!(err, 0, "{ch:?} on {m:o} by caller {k}");
        // The kernel's rule: without CAP_FSETID, setuid always goes; setgid goes
        // too when group-executable or the caller is not in the file's group;
        // root keeps both.
        let want = match k {
            3 => m,
            0 => m & !0o6000,
            _ if m & 0o010 != 0 => m & !0o6000,
            _ => m & !0o4000,
        };
        assert_eq!(after, want, "{ch:?} on {m:o} by caller {k}: {after:o}");
    }
}

/// statvfs flags of the mount, and what using a /dev/null-like node gives.
fn device_node(root: &Path) -> (bool, bool, Result<(isize, isize), i32>) {
    let p = c(&root.join("null"));
    // SAFETY: valid path; statvfs writes into the struct we pass.
    unsafe {
        assert_eq!(
            libc::mknod(p.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)),
            0,
            "mknod: {}",
            last_errno()
        );
        let mut sv: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(p.as_ptr(), &mut sv), 0);
        let nodev = sv.f_flag & libc::ST_NODEV != 0;
        let nosuid = sv.f_flag & libc::ST_NOSUID != 0;
        let fd = libc::open(p.as_ptr(), libc::O_RDWR);
        if fd < 0 {
            return (nodev, nosuid, Err(last_errno()));
        }
        let w = libc::write(fd, b"abc".as_ptr().cast(), 3);
        let mut buf = [1u8; 8];
        let r = libc::read(fd, buf.as_mut_ptr().cast(), 8);
        libc::close(fd);
        (nodev, nosuid, Ok((w, r)))
    }
}

#[test]
fn device_nodes_on_root_mounts_and_nodev() {
    let (k, f) = on_both("rw", &[], device_node);
    assert_eq!(k, f, "default mount: kernel ext4 vs commitfs");
    assert_eq!(f, (false, false, Ok((3, 0))), "a root mount is dev,suid");
    let (k, f) = on_both("nodev,nosuid", &["-o", "nodev,nosuid"], device_node);
    assert_eq!(k, f, "nodev,nosuid: kernel ext4 vs commitfs");
    assert_eq!(f, (true, true, Err(libc::EACCES)));
}

/// fstat of open directories removed by rename-over and rmdir:
/// (errno or nlink, is a directory, getdents errno).
fn removed_open_dirs(root: &Path) -> Vec<(Result<u64, i32>, bool, i32)> {
    let mut out = Vec::new();
    for how in ["rename", "rmdir"] {
        let a = root.join(format!("{how}-a"));
        let b = root.join(format!("{how}-b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(b.join("inside"), b"x").unwrap();
        let ca = c(&a);
        // SAFETY: valid paths and buffers; the descriptor is closed below.
        unsafe {
            let fd = libc::open(ca.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY);
            assert!(fd >= 0);
            if how == "rename" {
                assert_eq!(libc::rename(c(&b).as_ptr(), ca.as_ptr()), 0);
            } else {
                assert_eq!(libc::rmdir(ca.as_ptr()), 0);
            }
            let mut st: libc::stat = std::mem::zeroed();
            let r = if libc::fstat(fd, &mut st) == 0 {
                Ok(st.st_nlink)
            } else {
                Err(last_errno())
            };
            let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
            let mut buf = [0u8; 1024];
            let n = libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len());
            let gd = if n < 0 { last_errno() } else { 0 };
            libc::close(fd);
            out.push((r, is_dir, gd));
        }
    }
    // The replacing directory kept its content.
    assert!(root.join("rename-a/inside").exists());
    out
}

#[test]
fn fstat_of_removed_open_directory() {
    let (k, f) = on_both("rw", &[], removed_open_dirs);
    assert_eq!(k, f, "kernel ext4 vs commitfs");
    for r in &f {
        assert_eq!(r.0, Ok(0), "fstat of a removed open directory: {f:?}");
        assert!(r.1);
    }
}

fn atime_of(p: &Path) -> (i64, i64) {
    let m = std::fs::metadata(p).unwrap();
    (m.atime(), m.atime_nsec())
}

/// Read all of `p` after dropping its cached pages (so a FUSE read reaches the
/// daemon, as every read reaches kernel ext4's atime code).
fn read_uncached(p: &Path) {
    let f = std::fs::File::open(p).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: valid descriptor.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
    let mut v = Vec::new();
    std::io::Read::read_to_end(&mut &f, &mut v).unwrap();
    assert_eq!(v.len(), 10_000);
}

/// Did each access change atime? (file read 1, read 2, dir listing 1, listing 2).
fn atime_accesses(root: &Path) -> [bool; 4] {
    let f = root.join("f");
    std::fs::write(&f, vec![5u8; 10_000]).unwrap();
    let d = root.join("d");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("e"), b"e").unwrap();
    let pause = || std::thread::sleep(Duration::from_millis(30));
    let mut out = [false; 4];
    pause();
    let a0 = atime_of(&f);
    read_uncached(&f);
    let a1 = atime_of(&f);
    out[0] = a1 != a0;
    pause();
    read_uncached(&f);
    out[1] = atime_of(&f) != a1;
    pause();
    let d0 = atime_of(&d);
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
    let d1 = atime_of(&d);
    out[2] = d1 != d0;
    pause();
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
    out[3] = atime_of(&d) != d1;
    out
}

#[test]
fn atime_policies_like_kernel() {
    // relatime (both defaults): the first access after a change, not the next.
    let (k, f) = on_both("rw", &[], atime_accesses);
    assert_eq!(k, f, "relatime: kernel ext4 vs commitfs");
    assert_eq!(f, [true, false, true, false]);
    let (k, f) = on_both("strictatime", &["-o", "strictatime"], atime_accesses);
    assert_eq!(k, f, "strictatime: kernel ext4 vs commitfs");
    assert_eq!(f, [true, true, true, true]);
    let (k, f) = on_both("noatime", &["-o", "noatime"], atime_accesses);
    assert_eq!(k, f, "noatime: kernel ext4 vs commitfs");
    assert_eq!(f, [false; 4]);
    let (k, f) = on_both("nodiratime", &["-o", "nodiratime"], atime_accesses);
    assert_eq!(k, f, "nodiratime: kernel ext4 vs commitfs");
    assert_eq!(f, [true, false, false, false]);
}
