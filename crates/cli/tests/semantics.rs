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

/// Run `act` (system calls only; returns 0 or an errno) in a forked child as
/// `uid`/`gid` with supplementary `groups` (uid 0: as the test runs); the
/// child's answer.
fn as_user(uid: u32, gid: u32, groups: &[u32], act: impl FnOnce() -> i32) -> i32 {
    let groups: Vec<libc::gid_t> = groups.to_vec();
    // SAFETY: the child only makes system calls (async-signal-safe) and _exits.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            if uid != 0
                && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setresgid(gid, gid, gid) != 0
                    || libc::setresuid(uid, uid, uid) != 0)
            {
                libc::_exit(100);
            }
            libc::_exit(act());
        }
        let mut st = 0;
        assert_eq!(libc::waitpid(pid, &mut st, 0), pid);
        assert!(libc::WIFEXITED(st), "child died: {st}");
        let code = libc::WEXITSTATUS(st);
        assert_ne!(code, 100, "could not drop privileges");
        code
    }
}

/// The calling thread's errno.
fn errno_now() -> i32 {
    // SAFETY: reads this thread's errno.
    unsafe { *libc::__errno_location() }
}

/// Open `path` and change its data as `uid`/`gid` with supplementary `groups`
/// (uid 0: as the test runs), in a forked child; returns the child's errno (0:
/// success).
fn change_as(path: &Path, uid: u32, gid: u32, groups: &[u32], change: Change) -> i32 {
    let p = c(path);
    as_user(uid, gid, groups, || {
        // SAFETY: valid path and buffers; plain system calls.
        unsafe {
            let fd = libc::open(p.as_ptr(), libc::O_RDWR);
            if fd < 0 {
                return errno_now();
            }
            let r = match change {
                Change::Write => (libc::pwrite(fd, b"xy".as_ptr().cast(), 2, 100) == 2) as i32 - 1,
                Change::Truncate => libc::ftruncate(fd, 6000),
                Change::Fallocate(mode) => libc::fallocate(fd, mode, 4096, 8192),
            };
            if r == 0 {
                0
            } else {
                errno_now()
            }
        }
    })
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

/// lseek SEEK_DATA / SEEK_HOLE answers at many offsets of a sparse file (data
/// blocks, holes from sparse writes, a punched hole, a partial last data block,
/// a hole up to the end from truncate-up), then copy_file_range of the whole
/// file into a new file and of a part into the middle of a file full of other
/// data (a source hole must read as zeros there), compared with the copies'
/// contents. On commitfs the copies must be served by copy_file_range requests
/// (one request instead of reads and writes through the kernel).
type SeekCopy = (Vec<(u64, i64, i64)>, Vec<(i64, u64, u64)>, Option<u64>);

fn seek_and_copy(root: &Path) -> SeekCopy {
    use std::os::unix::fs::FileExt;
    use std::os::unix::io::AsRawFd;
    let p = root.join("sparse");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    f.write_all_at(&[b'a'; 4096], 0).unwrap();
    f.write_all_at(&[b'b'; 8192], 40960).unwrap();
    f.write_all_at(&[b'c'; 100], 200_000).unwrap();
    f.set_len(300_000).unwrap();
    let fd = f.as_raw_fd();
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(unsafe { libc::fallocate(fd, punch, 45056, 4096) }, 0);
    f.sync_all().unwrap();
    let seek = |off: u64, whence: i32| -> i64 {
        let r = unsafe { libc::lseek(fd, off as i64, whence) };
        if r < 0 {
            -(std::io::Error::last_os_error().raw_os_error().unwrap_or(0) as i64)
        } else {
            r
        }
    };
    let offsets = [
        0, 1, 4095, 4096, 5000, 40959, 40960, 45055, 45056, 49151, 49152, 100_000, 196_608,
        199_999, 200_000, 200_099, 200_100, 200_703, 200_704, 299_999, 300_000, 400_000,
    ];
    let seeks = offsets
        .iter()
        .map(|&o| (o, seek(o, libc::SEEK_DATA), seek(o, libc::SEEK_HOLE)))
        .collect();
    let hash = |path: &Path| -> (u64, u64) {
        let d = std::fs::read(path).unwrap();
        (d.len() as u64, content_hash_of(&d))
    };
    let copy = |src: &std::fs::File,
                soff: i64,
                dst: &std::fs::File,
                doff: i64,
                len: usize|
     -> i64 {
        let (mut so, mut dof, mut left, mut total) = (soff, doff, len, 0i64);
        while left > 0 {
            let n = unsafe {
                libc::copy_file_range(src.as_raw_fd(), &mut so, dst.as_raw_fd(), &mut dof, left, 0)
            };
            if n < 0 {
                return -(std::io::Error::last_os_error().raw_os_error().unwrap_or(0) as i64);
            }
            if n == 0 {
                break;
            }
            left -= n as usize;
            total += n as i64;
        }
        total
    };
    let mut copies = Vec::new();
    let whole = std::fs::File::create(root.join("copy")).unwrap();
    let n = copy(&f, 0, &whole, 0, 1 << 20);
    let (len, h) = hash(&root.join("copy"));
    copies.push((n, len, h));
    let mixed = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(root.join("mixed"))
        .unwrap();
    mixed.write_all_at(&[b'z'; 65536], 0).unwrap();
    let n = copy(&f, 3000, &mixed, 1000, 50_000);
    let (len, h) = hash(&root.join("mixed"));
    copies.push((n, len, h));
    // Overlapping ranges of one file: EINVAL on both.
    let n = copy(&f, 0, &f, 100, 1000);
    copies.push((n, 0, 0));
    // commitfs only: how many copy_file_range requests the daemon served.
    (seeks, copies, fuse_count(root, "copy_file_range"))
}

#[test]
fn seek_data_hole_and_copy_file_range_like_kernel() {
    let (k, f) = on_both("", &[], seek_and_copy);
    for (a, b) in k.0.iter().zip(&f.0) {
        assert_eq!(
            a, b,
            "lseek at offset {} (kernel, commitfs): SEEK_DATA, SEEK_HOLE",
            a.0
        );
    }
    assert_eq!(
        k.1, f.1,
        "copy_file_range: (copied, size, content hash) kernel vs commitfs"
    );
    assert_eq!(k.1[0].0, 300_000, "the whole file was copied");
    assert_eq!(k.1[2].0, -(libc::EINVAL as i64));
    // Both copies (and the refused one) reached the daemon as copy requests.
    assert!(
        f.2.is_some_and(|n| n >= 2),
        "copy_file_range requests served: {:?}",
        f.2
    );
}

/// `ls -l`-style listing (readdir, then lstat of every name) of a directory of
/// 300 files, then removal of them all: the same listing as the kernel's, and
/// every inode is free again once the kernel has dropped its cached entries
/// (the references readdirplus hands out are all forgotten, none twice). On
/// commitfs the listing is served by READDIRPLUS, so the lstats need no
/// LOOKUP per name.
type Listing = (Vec<(String, u32, u64, u64)>, bool, Option<(u64, u64)>);

fn list_and_remove(root: &Path) -> Listing {
    use std::os::unix::fs::PermissionsExt;
    let d = root.join("d");
    std::fs::create_dir(&d).unwrap();
    let free0 = statvfs_ffree(root);
    for i in 0..300u32 {
        let p = d.join(format!("file-{i:03}"));
        std::fs::write(&p, vec![b'x'; (i as usize * 37) % 9000]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600 + (i % 64))).unwrap();
    }
    std::fs::create_dir(d.join("sub")).unwrap();
    drop_dentries();
    let lookups0 = fuse_count(root, "lookup");
    let mut listing: Vec<(String, u32, u64, u64)> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                m.mode(),
                m.size(),
                m.nlink(),
            )
        })
        .collect();
    listing.sort();
    let lookups = fuse_count(root, "lookup").zip(lookups0).map(|(a, b)| a - b);
    let plus = fuse_count(root, "readdirplus");
    for i in 0..300u32 {
        std::fs::remove_file(d.join(format!("file-{i:03}"))).unwrap();
    }
    std::fs::remove_dir(d.join("sub")).unwrap();
    drop_dentries();
    // The kernel forgets asynchronously: give it a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut freed = statvfs_ffree(root) == free0;
    while !freed && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        drop_dentries();
        freed = statvfs_ffree(root) == free0;
    }
    (listing, freed, lookups.zip(plus))
}

fn statvfs_ffree(p: &Path) -> u64 {
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c(p).as_ptr(), &mut s) }, 0);
    s.f_ffree as u64
}

/// Drop the kernel's dentry and inode caches (FUSE: FORGETs).
fn drop_dentries() {
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
}

/// A FUSE request count from `commitfs stats` (`None` on the kernel's mount).
fn fuse_count(root: &Path, op: &str) -> Option<u64> {
    let out = commitfs_stats_json(Path::new(BIN), root).ok()?;
    let v: serde_json::Value = serde_json::from_str(&out).ok()?;
    Some(v["fuse_requests"][op]["count"].as_u64().unwrap_or(0))
}

#[test]
fn listing_like_kernel_with_readdirplus_and_every_inode_freed() {
    let (k, f) = on_both("", &[], list_and_remove);
    assert_eq!(k.0.len(), 301);
    assert_eq!(
        k.0, f.0,
        "listing (name, mode, size, nlink): kernel vs commitfs"
    );
    assert!(k.1, "kernel: inodes not freed");
    assert!(
        f.1,
        "commitfs: inodes not freed after the kernel forgot them"
    );
    let (lookups, plus) = f.2.expect("commitfs stats");
    assert!(plus > 0, "no READDIRPLUS request");
    assert!(lookups < 30, "{lookups} LOOKUPs for a listing of 301 names");
}

/// Names looked up while absent, then made by every kind of operation (create,
/// mkdir, symlink, link, rename, mknod): each is visible at once, as on the
/// kernel; on commitfs the repeated lookups of an absent name are answered from
/// the kernel's negative entry (one LOOKUP, not three).
type Negative = (Vec<(String, bool)>, Option<u64>);

fn negative_entries(root: &Path) -> Negative {
    let exists = |n: &str| std::fs::symlink_metadata(root.join(n)).is_ok();
    std::fs::write(root.join("src"), b"x").unwrap();
    std::fs::write(root.join("lnk-src"), b"y").unwrap();
    let l0 = fuse_count(root, "lookup");
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(("ghost".to_string(), exists("ghost")));
    }
    let repeated = fuse_count(root, "lookup").zip(l0).map(|(a, b)| a - b);
    let names = [
        "n-create",
        "n-mkdir",
        "n-symlink",
        "n-link",
        "n-rename",
        "n-fifo",
    ];
    for n in names {
        seen.push((format!("{n} before"), exists(n)));
    }
    std::fs::write(root.join("n-create"), b"z").unwrap();
    std::fs::create_dir(root.join("n-mkdir")).unwrap();
    std::os::unix::fs::symlink("src", root.join("n-symlink")).unwrap();
    std::fs::hard_link(root.join("lnk-src"), root.join("n-link")).unwrap();
    std::fs::rename(root.join("src"), root.join("n-rename")).unwrap();
    let fifo = c(&root.join("n-fifo"));
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    for n in names {
        seen.push((format!("{n} after"), exists(n)));
    }
    seen.push(("src after rename".into(), exists("src")));
    (seen, repeated)
}

#[test]
fn negative_entries_are_cached_and_turn_positive() {
    let (k, f) = on_both("", &[], negative_entries);
    assert_eq!(k.0, f.0, "existence (kernel, commitfs)");
    assert!(k
        .0
        .iter()
        .filter(|(n, _)| n.ends_with("after"))
        .all(|x| x.1));
    assert_eq!(f.1, Some(1), "LOOKUPs for three stats of one absent name");
}

/// chown(2) as `uid` (with `gid` and `groups`) in a forked child: errno (0: done).
fn chown_as(path: &Path, uid: u32, gid: u32, groups: &[u32], to: (u32, u32)) -> i32 {
    let p = c(path);
    as_user(uid, gid, groups, || {
        // SAFETY: valid path; a plain system call.
        if unsafe { libc::chown(p.as_ptr(), to.0, to.1) } == 0 {
            0
        } else {
            errno_now()
        }
    })
}

/// Owner and group changes clear setuid/setgid as on the kernel (the daemon
/// decides under FUSE_HANDLE_KILLPRIV_V2: root's chown clears setuid, and
/// setgid of a group-executable file; an owner's chgrp to a group of theirs
/// the same), and a file's writes ask the daemon for `security.capability`
/// once, not at every write (SB_NOSEC under KILLPRIV_V2).
#[test]
fn chown_clears_setuid_setgid_like_kernel_and_writes_skip_capability_checks() {
    let modes = [0o4755u32, 0o2755, 0o2745, 0o6745, 0o0755];
    let scenario = |root: &Path| {
        let mut out = Vec::new();
        for (j, &m) in modes.iter().enumerate() {
            // Root changes the owner of a root file; nobody (in group 0 as a
            // supplementary group) gives its own file to group 0; a directory.
            for k in 0..3 {
                let p = root.join(format!("c{j}-{k}"));
                if k == 2 {
                    std::fs::create_dir(&p).unwrap();
                } else {
                    std::fs::write(&p, b"x").unwrap();
                }
                if k == 1 {
                    std::os::unix::fs::chown(&p, Some(NOBODY), Some(NOBODY)).unwrap();
                }
                std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(m))
                    .unwrap();
                let err = match k {
                    1 => chown_as(&p, NOBODY, NOBODY, &[0], (u32::MAX, 0)),
                    _ => chown_as(&p, 0, 0, &[], (1000, 1000)),
                };
                out.push((m, k, err, mode_of(&p)));
            }
        }
        // 20 files, three writes each through one descriptor.
        let before = fuse_count(root, "getxattr");
        for i in 0..20 {
            let mut f = std::fs::File::create(root.join(format!("w{i}"))).unwrap();
            for _ in 0..3 {
                std::io::Write::write_all(&mut f, &[1u8; 1000]).unwrap();
                f.sync_data().unwrap();
            }
        }
        let getxattrs = fuse_count(root, "getxattr").map(|n| n - before.unwrap_or(0));
        (out, getxattrs)
    };
    let (k, f) = on_both("rw", &["-o", "allow_other"], scenario);
    assert_eq!(
        k.0, f.0,
        "kernel ext4 vs commitfs (mode, caller, errno, mode after)"
    );
    for &(m, k, err, after) in &f.0 {
        assert_eq!(err, 0, "chown of {m:o} by caller {k}");
        let want = match k {
            2 => m,
            _ if m & 0o010 != 0 => m & !0o6000,
            _ => m & !0o4000,
        };
        assert_eq!(after, want, "chown of {m:o} by caller {k}: {after:o}");
    }
    let n = f.1.expect("commitfs stats");
    assert!(
        n <= 20,
        "{n} GETXATTR requests for 60 writes to 20 files (at most one per file)"
    );
}
