//! End-to-end tests of the FUSE mount through the real `commitfs` binary: every
//! FUSE operation via std::fs / libc, concurrency, read-only and writeback-cache
//! mounts, daemon mode, refusal of unsupported features, and `e2fsck -fn` after
//! every unmount. Needs root, /dev/fuse and fusermount3 (fuse3).

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use commitfs::cmd::fsck;
use commitfs::testutil::{mkfs, TempImage};
use common::UringSwitch;

const BIN: &str = env!("CARGO_BIN_EXE_commitfs");

fn unique(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "commitfs-fusetest-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn is_mounted(dir: &Path) -> bool {
    let t = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = dir.to_string_lossy();
    t.lines().any(|l| l.split(' ').nth(4) == Some(&*want))
}

fn mount_fstype(dir: &Path) -> Option<String> {
    let t = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = dir.to_string_lossy();
    t.lines()
        .find(|l| l.split(' ').nth(4) == Some(&*want))
        .and_then(|l| l.split(" - ").nth(1))
        .and_then(|r| r.split(' ').next())
        .map(str::to_string)
}

fn require_fuse() {
    assert!(
        Path::new("/dev/fuse").exists(),
        "these tests need /dev/fuse (modprobe fuse) and fusermount3 (apt-get install fuse3)"
    );
}

fn assert_fsck_clean(image: &Path) {
    let v = fsck::check(image).expect("run e2fsck");
    assert!(
        v.is_clean(),
        "e2fsck -fn reported problems (exit {}):\n{}",
        v.code,
        v.output
    );
}

/// A `commitfs mount --foreground` child. Drop unmounts (fusermount3 -u, then
/// `umount -l` as a last resort), reaps the child and removes the mount point,
/// also when the test panics.
struct Mount {
    dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

impl Mount {
    fn new(image: &Path, opts: &[&str]) -> Mount {
        require_fuse();
        let dir = unique("mnt");
        fs::create_dir_all(&dir).unwrap();
        let log = dir.with_extension("log");
        let lf = File::create(&log).unwrap();
        let child = Command::new(BIN)
            .arg("mount")
            .arg(image)
            .arg(&dir)
            .arg("--foreground")
            .args(opts)
            .env("COMMITFS_LOG", "info")
            .stdin(Stdio::null())
            .stdout(lf.try_clone().unwrap())
            .stderr(lf)
            .spawn()
            .expect("spawn commitfs mount");
        let mut m = Mount {
            dir,
            child: Some(child),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !is_mounted(&m.dir) {
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                m.child = None;
                panic!("commitfs mount exited with {st}:\n{}", m.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "not mounted after 20 s:\n{}",
                m.log_text()
            );
            // Short: a caller may act the moment the mount appears.
            std::thread::sleep(Duration::from_millis(1));
        }
        m
    }

    fn p(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// `commitfs stats DIR --json`, parsed; a failed call panics with its
    /// stderr.
    fn stats(&self) -> serde_json::Value {
        let s = Command::new(BIN)
            .arg("stats")
            .arg(&self.dir)
            .arg("--json")
            .output()
            .expect("commitfs stats");
        assert!(
            s.status.success(),
            "commitfs stats failed: {}",
            String::from_utf8_lossy(&s.stderr)
        );
        serde_json::from_slice(&s.stdout).expect("stats JSON")
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Unmount with fusermount3 and require the daemon to exit 0.
    fn unmount(&mut self) {
        let mut ok = false;
        for _ in 0..50 {
            if Command::new("fusermount3")
                .arg("-u")
                .arg(&self.dir)
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
            {
                ok = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(ok, "fusermount3 -u {} kept failing", self.dir.display());
        let mut c = self.child.take().expect("daemon running");
        let deadline = Instant::now() + Duration::from_secs(60);
        let st = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("daemon did not exit after unmount:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            st.success(),
            "daemon exited with {st}:\n{}",
            self.log_text()
        );
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.dir) {
            let ok = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.dir)
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
            }
        }
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = fs::remove_dir(&self.dir);
        let _ = fs::remove_file(&self.log);
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn err_of(r: std::io::Result<impl Sized>) -> i32 {
    match r {
        Ok(_) => 0,
        Err(e) => e.raw_os_error().unwrap_or(-1),
    }
}

fn renameat2(a: &Path, b: &Path, flags: u32) -> i32 {
    let (a, b) = (cpath(a), cpath(b));
    // SAFETY: valid NUL-terminated paths.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if r == 0 {
        0
    } else {
        errno()
    }
}

fn setxattr(p: &Path, name: &str, v: &[u8], flags: i32) -> i32 {
    let (c, n) = (cpath(p), CString::new(name).unwrap());
    // SAFETY: valid strings and value slice.
    let r = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), flags) };
    if r == 0 {
        0
    } else {
        errno()
    }
}

/// getxattr with a buffer of `size` bytes: Ok(bytes or size) / Err(errno).
fn getxattr(p: &Path, name: &str, size: usize) -> Result<Vec<u8>, i32> {
    let (c, n) = (cpath(p), CString::new(name).unwrap());
    let mut buf = vec![0u8; size];
    // SAFETY: buffer pointer/length describe `buf` (null for a size probe).
    let r = unsafe {
        libc::getxattr(
            c.as_ptr(),
            n.as_ptr(),
            if size == 0 {
                std::ptr::null_mut()
            } else {
                buf.as_mut_ptr().cast()
            },
            size,
        )
    };
    if r < 0 {
        return Err(errno());
    }
    if size == 0 {
        return Ok((r as u64).to_le_bytes().to_vec());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

fn listxattr(p: &Path) -> Vec<String> {
    let c = cpath(p);
    let mut buf = vec![0u8; 4096];
    // SAFETY: buffer pointer/length describe `buf`.
    let r = unsafe { libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(r >= 0, "listxattr: errno {}", errno());
    buf.truncate(r as usize);
    let mut v: Vec<String> = buf
        .split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    v.sort();
    v
}

fn removexattr(p: &Path, name: &str) -> i32 {
    let (c, n) = (cpath(p), CString::new(name).unwrap());
    // SAFETY: valid strings.
    if unsafe { libc::removexattr(c.as_ptr(), n.as_ptr()) } == 0 {
        0
    } else {
        errno()
    }
}

fn fallocate(f: &File, mode: i32, off: i64, len: i64) -> i32 {
    // SAFETY: fd is open for writing.
    if unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) } == 0 {
        0
    } else {
        errno()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed as u32) as u8
        })
        .collect()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn every_fuse_operation_end_to_end() {
    every_operation(&["-o", "noio_uring"], false);
}

/// The same through FUSE over io_uring (`-o io_uring`, the kernel's switch
/// turned on for the test): every request of the run but FORGET comes
/// through the rings. Other tests of this binary that mount meanwhile use
/// the rings too (both transports serve the same operations).
#[test]
fn every_fuse_operation_end_to_end_through_io_uring() {
    let _on = UringSwitch::on();
    every_operation(&["-o", "io_uring"], true);
}

fn every_operation(opts: &[&str], want_ring: bool) {
    let img = mkfs("fuse-ops", 64, &[]);
    let mut m = Mount::new(&img.path, opts);
    assert_eq!(mount_fstype(&m.dir).as_deref(), Some("fuse.commitfs"));

    // statfs
    let sv = nix_statvfs(&m.dir);
    assert_eq!(sv.f_bsize, 1024);
    assert_eq!(sv.f_blocks, 65536);
    assert!(sv.f_bfree > 0 && sv.f_bfree < sv.f_blocks);
    assert_eq!(sv.f_files, 16384);
    assert_eq!(sv.f_namemax, 255);

    // getattr of the root; lookup of lost+found
    let root = fs::metadata(&m.dir).unwrap();
    assert!(root.is_dir());
    assert_eq!(root.ino(), 1, "FUSE root is inode 1");
    let lf = fs::metadata(m.p("lost+found")).unwrap();
    assert_eq!(lf.ino(), 11);
    assert_eq!(lf.mode() & 0o7777, 0o700);

    // mkdir, create, write, read, append, overwrite, truncate
    fs::create_dir(m.p("d")).unwrap();
    fs::set_permissions(m.p("d"), fs::Permissions::from_mode(0o750)).unwrap();
    assert_eq!(fs::metadata(m.p("d")).unwrap().mode() & 0o7777, 0o750);
    assert_eq!(fs::metadata(m.p("d")).unwrap().nlink(), 2);
    assert_eq!(fs::metadata(&m.dir).unwrap().nlink(), 4);
    let a = pattern(200_000, 1);
    fs::write(m.p("d/a.bin"), &a).unwrap();
    assert_eq!(fs::read(m.p("d/a.bin")).unwrap(), a);
    let mut f = OpenOptions::new()
        .append(true)
        .open(m.p("d/a.bin"))
        .unwrap();
    f.write_all(b"tail").unwrap();
    drop(f);
    let f = OpenOptions::new().write(true).open(m.p("d/a.bin")).unwrap();
    f.write_all_at(b"MIDDLE", 70_000).unwrap();
    f.set_len(150_000).unwrap();
    f.set_len(160_000).unwrap();
    drop(f);
    let mut want = a.clone();
    want.extend_from_slice(b"tail");
    want[70_000..70_006].copy_from_slice(b"MIDDLE");
    want.truncate(150_000);
    want.resize(160_000, 0);
    assert_eq!(fs::read(m.p("d/a.bin")).unwrap(), want);
    assert_eq!(fs::metadata(m.p("d/a.bin")).unwrap().len(), 160_000);

    // Large reads from the daemon (the kernel's pages dropped first): READ
    // replies of up to max_write, which the rings copy into their payload.
    let big = pattern(3 << 20, 7);
    fs::write(m.p("d/big.bin"), &big).unwrap();
    let f = File::open(m.p("d/big.bin")).unwrap();
    f.sync_all().unwrap();
    // SAFETY: a valid descriptor; advice only.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "fadvise");
    let reads_before = m.stats()["fuse_requests"]["read"]["count"]
        .as_u64()
        .unwrap_or(0);
    let mut got = Vec::new();
    (&f).read_to_end(&mut got).unwrap();
    assert!(got == big, "3 MiB read back through the daemon differs");
    let reads = m.stats()["fuse_requests"]["read"]["count"]
        .as_u64()
        .unwrap_or(0)
        - reads_before;
    assert!(
        reads >= 3,
        "the kernel read from the daemon ({reads} READs)"
    );
    drop(f);
    fs::remove_file(m.p("d/big.bin")).unwrap();

    // setattr: chmod, chown, utimensat (explicit and UTIME_NOW), ctime moves
    let p = m.p("d/a.bin");
    fs::set_permissions(&p, fs::Permissions::from_mode(0o4640)).unwrap();
    std::os::unix::fs::chown(&p, Some(1234), Some(5678)).unwrap();
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.uid(), md.gid()), (1234, 5678));
    // chown clears setuid (the daemon does, under FUSE_HANDLE_KILLPRIV_V2).
    assert_eq!(md.mode() & 0o7777, 0o640);
    let ts = [
        libc::timespec {
            tv_sec: 1_000_000_000,
            tv_nsec: 123_456_789,
        },
        libc::timespec {
            tv_sec: 1_500_000_000,
            tv_nsec: 42,
        },
    ];
    let cp = cpath(&p);
    // SAFETY: valid path and two timespecs.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, cp.as_ptr(), ts.as_ptr(), 0) },
        0
    );
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.atime(), md.atime_nsec()), (1_000_000_000, 123_456_789));
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_500_000_000, 42));
    // Before 1970 with a fraction: (sec -1003886756, nsec 935574431) must come back
    // as the same pair (fuser 0.18 decodes such request times oddly; see convert.rs).
    let old = [
        libc::timespec {
            tv_sec: -1_003_886_756,
            tv_nsec: 935_574_431,
        },
        libc::timespec {
            tv_sec: -1,
            tv_nsec: 1,
        },
    ];
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, cp.as_ptr(), old.as_ptr(), 0) },
        0
    );
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.atime(), md.atime_nsec()), (-1_003_886_756, 935_574_431));
    assert_eq!((md.mtime(), md.mtime_nsec()), (-1, 1));
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, cp.as_ptr(), ts.as_ptr(), 0) },
        0
    );
    let before = now_secs();
    let now = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    ];
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, cp.as_ptr(), now.as_ptr(), 0) },
        0
    );
    let md = fs::metadata(&p).unwrap();
    assert!(
        md.atime() >= before && md.atime() <= now_secs() + 1,
        "atime {}",
        md.atime()
    );
    assert_eq!(md.mtime(), 1_500_000_000, "UTIME_OMIT left mtime alone");
    assert!(md.ctime() >= before);

    // mknod: fifo and character device; symlink and readlink
    let fifo = cpath(&m.p("d/fifo"));
    // SAFETY: valid path.
    assert_eq!(
        unsafe { libc::mknod(fifo.as_ptr(), libc::S_IFIFO | 0o644, 0) },
        0
    );
    assert!(fs::symlink_metadata(m.p("d/fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    let chr = cpath(&m.p("d/null"));
    let dev = libc::makedev(1, 3);
    // SAFETY: valid path.
    assert_eq!(
        unsafe { libc::mknod(chr.as_ptr(), libc::S_IFCHR | 0o666, dev) },
        0
    );
    let md = fs::symlink_metadata(m.p("d/null")).unwrap();
    assert_eq!(md.rdev(), dev);
    assert_eq!(md.mode() & libc::S_IFMT, libc::S_IFCHR);
    std::os::unix::fs::symlink("a.bin", m.p("d/short")).unwrap();
    let long_target = "t/".repeat(150);
    std::os::unix::fs::symlink(&long_target, m.p("d/long")).unwrap();
    assert_eq!(fs::read_link(m.p("d/short")).unwrap(), Path::new("a.bin"));
    assert_eq!(
        fs::read_link(m.p("d/long")).unwrap(),
        Path::new(&long_target)
    );
    assert_eq!(
        fs::read(m.p("d/short")).unwrap(),
        want,
        "follow the symlink"
    );

    // link
    fs::hard_link(m.p("d/a.bin"), m.p("hard")).unwrap();
    assert_eq!(fs::metadata(m.p("hard")).unwrap().nlink(), 2);
    assert_eq!(
        fs::metadata(m.p("hard")).unwrap().ino(),
        fs::metadata(m.p("d/a.bin")).unwrap().ino()
    );

    // rename, RENAME_NOREPLACE, RENAME_EXCHANGE
    fs::write(m.p("x"), b"xxx").unwrap();
    fs::write(m.p("y"), b"yyyy").unwrap();
    fs::rename(m.p("x"), m.p("d/x2")).unwrap();
    assert_eq!(fs::read(m.p("d/x2")).unwrap(), b"xxx");
    assert_eq!(
        renameat2(&m.p("d/x2"), &m.p("y"), libc::RENAME_NOREPLACE),
        libc::EEXIST
    );
    assert_eq!(
        renameat2(&m.p("d/x2"), &m.p("z"), libc::RENAME_NOREPLACE),
        0
    );
    assert_eq!(renameat2(&m.p("z"), &m.p("y"), libc::RENAME_EXCHANGE), 0);
    assert_eq!(fs::read(m.p("z")).unwrap(), b"yyyy");
    assert_eq!(fs::read(m.p("y")).unwrap(), b"xxx");
    fs::rename(m.p("y"), m.p("z")).unwrap(); // replace
    assert_eq!(fs::read(m.p("z")).unwrap(), b"xxx");
    assert_eq!(err_of(fs::metadata(m.p("y"))), libc::ENOENT);
    fs::create_dir(m.p("e")).unwrap();
    fs::rename(m.p("e"), m.p("d/e")).unwrap();
    assert_eq!(fs::metadata(&m.dir).unwrap().nlink(), 4);
    assert_eq!(fs::metadata(m.p("d")).unwrap().nlink(), 3);

    // readdir
    assert_eq!(
        names(&m.p("d")),
        ["a.bin", "e", "fifo", "long", "null", "short"]
    );
    for i in 0..300 {
        fs::write(m.p(&format!("d/e/f{i:03}")), [i as u8]).unwrap();
    }
    let listed = names(&m.p("d/e"));
    assert_eq!(listed.len(), 300, "readdir over several reply buffers");
    assert_eq!(listed[299], "f299");

    // unlink, rmdir and error mapping
    assert_eq!(err_of(fs::remove_dir(m.p("d/e"))), libc::ENOTEMPTY);
    for i in 0..300 {
        fs::remove_file(m.p(&format!("d/e/f{i:03}"))).unwrap();
    }
    fs::remove_dir(m.p("d/e")).unwrap();
    fs::remove_file(m.p("hard")).unwrap();
    assert_eq!(fs::metadata(m.p("d/a.bin")).unwrap().nlink(), 1);
    assert_eq!(err_of(fs::metadata(m.p("nope"))), libc::ENOENT);
    assert_eq!(err_of(fs::create_dir(m.p("d"))), libc::EEXIST);
    assert_eq!(err_of(fs::metadata(m.p("z/sub"))), libc::ENOTDIR);
    assert_eq!(err_of(fs::remove_dir(m.p("z"))), libc::ENOTDIR);
    assert_eq!(
        err_of(fs::write(m.p(&"n".repeat(256)), b"")),
        libc::ENAMETOOLONG
    );

    // xattrs: set, size probe, ERANGE, list, flags, remove
    let p = m.p("z");
    assert_eq!(setxattr(&p, "user.k", b"value-1", 0), 0);
    assert_eq!(setxattr(&p, "user.other", &[9u8; 300], 0), 0);
    let probe = getxattr(&p, "user.k", 0).unwrap();
    assert_eq!(u64::from_le_bytes(probe.try_into().unwrap()), 7);
    assert_eq!(getxattr(&p, "user.k", 3), Err(libc::ERANGE));
    assert_eq!(getxattr(&p, "user.k", 64).unwrap(), b"value-1");
    assert_eq!(listxattr(&p), ["user.k", "user.other"]);
    assert_eq!(
        setxattr(&p, "user.k", b"v2", libc::XATTR_CREATE),
        libc::EEXIST
    );
    assert_eq!(
        setxattr(&p, "user.none", b"v", libc::XATTR_REPLACE),
        libc::ENODATA
    );
    assert_eq!(setxattr(&p, "user.k", b"v2", libc::XATTR_REPLACE), 0);
    assert_eq!(getxattr(&p, "user.k", 64).unwrap(), b"v2");
    assert_eq!(removexattr(&p, "user.k"), 0);
    assert_eq!(getxattr(&p, "user.k", 64), Err(libc::ENODATA));
    assert_eq!(removexattr(&p, "user.k"), libc::ENODATA);
    assert_eq!(listxattr(&p), ["user.other"]);

    // fallocate: plain, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE, unsupported
    let fp = m.p("falloc");
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&fp)
        .unwrap();
    assert_eq!(fallocate(&f, 0, 0, 40_960), 0);
    assert_eq!(f.metadata().unwrap().len(), 40_960);
    let blocks0 = f.metadata().unwrap().blocks();
    assert!(blocks0 >= 80, "allocated {blocks0} sectors");
    assert_eq!(fallocate(&f, libc::FALLOC_FL_KEEP_SIZE, 40_960, 40_960), 0);
    assert_eq!(
        f.metadata().unwrap().len(),
        40_960,
        "KEEP_SIZE keeps the size"
    );
    assert!(f.metadata().unwrap().blocks() >= blocks0 + 80);
    f.write_all_at(&[0xAB; 40_960], 0).unwrap();
    assert_eq!(
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            4096,
            8192
        ),
        0
    );
    assert_eq!(fallocate(&f, libc::FALLOC_FL_ZERO_RANGE, 20_480, 1000), 0);
    let mut got = vec![0u8; 40_960];
    f.read_exact_at(&mut got, 0).unwrap();
    let mut want = vec![0xABu8; 40_960];
    want[4096..12_288].fill(0);
    want[20_480..21_480].fill(0);
    assert!(got == want, "punch/zero range contents wrong");
    assert_eq!(
        fallocate(&f, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 4096),
        libc::EOPNOTSUPP
    );
    drop(f);

    // open-unlinked file stays readable and writable until the last close
    let op = m.p("d/open-unlinked");
    let data = pattern(50_000, 7);
    fs::write(&op, &data).unwrap();
    let mut f = OpenOptions::new().read(true).write(true).open(&op).unwrap();
    fs::remove_file(&op).unwrap();
    assert_eq!(err_of(fs::metadata(&op)), libc::ENOENT);
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert_eq!(got, data);
    f.write_all_at(b"still here", 10).unwrap();
    let mut b = [0u8; 10];
    f.read_exact_at(&mut b, 10).unwrap();
    assert_eq!(&b, b"still here");
    assert_eq!(f.metadata().unwrap().nlink(), 0);
    drop(f);

    // fsync of a file and a directory, flush on close
    let mut f = File::create(m.p("synced")).unwrap();
    f.write_all(b"durable").unwrap();
    f.sync_all().unwrap();
    f.sync_data().unwrap();
    drop(f);
    File::open(m.p("d")).unwrap().sync_all().unwrap();
    let mut f = File::open(m.p("synced")).unwrap();
    f.seek(SeekFrom::Start(3)).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "able");
    drop(f);

    let sv2 = nix_statvfs(&m.dir);
    assert!(sv2.f_bfree < sv.f_bfree, "statfs sees the allocations");

    // Which transport served them.
    let st = m.stats();
    let served: u64 = st["fuse_requests"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.as_str() != "forget")
        .map(|(_, v)| v["count"].as_u64().unwrap())
        .sum();
    let ring = (
        st["fuse_ring"]["queues"].as_u64().unwrap(),
        st["fuse_ring"]["requests"].as_u64().unwrap(),
    );
    let human = Command::new(BIN)
        .arg("stats")
        .arg(&m.dir)
        .output()
        .expect("commitfs stats");
    let human = String::from_utf8_lossy(&human.stdout).to_string();
    let want_line = if want_ring {
        "FUSE transport: io_uring"
    } else {
        "FUSE transport: /dev/fuse"
    };
    assert!(
        human.contains(want_line),
        "stats lacks {want_line:?}:\n{human}"
    );
    if want_ring {
        let cpus = std::thread::available_parallelism().unwrap().get() as u64;
        assert!(ring.0 >= cpus, "one ring queue per CPU: {ring:?}");
        assert!(
            ring.1 >= served,
            "{served} requests served but only {} through the rings",
            ring.1
        );
    } else {
        assert_eq!(ring, (0, 0), "-o noio_uring served through rings");
    }

    m.unmount();
    assert_fsck_clean(&img.path);

    // What the FUSE mount wrote reads back through the library.
    let lib = commitfs::Fs::open_path(
        &img.path,
        commitfs::MountOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    let ino = lib.resolve("/synced").unwrap();
    let mut b = [0u8; 7];
    assert_eq!(lib.read(ino, 0, &mut b).unwrap(), 7);
    assert_eq!(&b, b"durable");
    assert!(lib.resolve("/d/open-unlinked").is_err());
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn nix_statvfs(p: &Path) -> libc::statvfs {
    let c = cpath(p);
    // SAFETY: zeroed POD filled by statvfs.
    let mut sv: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out pointer.
    assert_eq!(
        unsafe { libc::statvfs(c.as_ptr(), &mut sv) },
        0,
        "statvfs errno {}",
        errno()
    );
    sv
}

#[test]
fn fsync_loop_does_not_block_lookups() {
    let img = mkfs("fuse-conc", 64, &[]);
    let mut m = Mount::new(&img.path, &[]);
    for i in 0..50 {
        fs::write(m.p(&format!("f{i}")), format!("{i}")).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let syncs = Arc::new(AtomicU64::new(0));
    let dir = m.dir.clone();
    let (s2, st2) = (syncs.clone(), stop.clone());
    let syncer = std::thread::spawn(move || {
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("log"))
            .unwrap();
        let mut n = 0u64;
        while !st2.load(Ordering::SeqCst) && n < 2000 {
            f.write_all(&[b'x'; 512]).unwrap();
            f.sync_all().unwrap();
            n += 1;
            s2.store(n, Ordering::SeqCst);
        }
        n
    });
    let t0 = Instant::now();
    let mut lookups = 0u64;
    let mut worst = Duration::ZERO;
    // Runs until the lookups have overlapped a good stretch of the fsync loop
    // (counts, not a time budget; the 120 s cap only stops a hang).
    while (lookups < 500 || syncs.load(Ordering::SeqCst) < 10)
        && t0.elapsed() < Duration::from_secs(120)
    {
        for i in 0..50 {
            let t = Instant::now();
            // Fresh names defeat the dentry cache: each one is a FUSE lookup.
            assert_eq!(
                err_of(fs::metadata(m.p(&format!("missing{lookups}")))),
                libc::ENOENT
            );
            let md = fs::metadata(m.p(&format!("f{i}"))).unwrap();
            assert!(md.is_file());
            worst = worst.max(t.elapsed());
            lookups += 1;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let n = syncer.join().unwrap();
    assert!(n >= 10, "only {n} fsyncs while {lookups} lookups ran");
    assert!(
        lookups >= 500,
        "only {lookups} lookups ran alongside the fsync loop"
    );
    assert!(
        n < 2000,
        "the fsync loop ran to its end before {lookups} lookups were done"
    );
    assert!(worst < Duration::from_secs(2), "a lookup took {worst:?}");
    assert_eq!(fs::metadata(m.p("log")).unwrap().len(), n * 512);
    m.unmount();
    assert_fsck_clean(&img.path);
}

#[test]
fn read_only_mount_refuses_writes_and_leaves_the_image_alone() {
    let img = mkfs("fuse-ro", 64, &[]);
    {
        let mut m = Mount::new(&img.path, &[]);
        fs::create_dir(m.p("dir")).unwrap();
        fs::write(m.p("dir/file"), b"contents").unwrap();
        m.unmount();
    }
    let before = fs::read(&img.path).unwrap();
    let mut m = Mount::new(&img.path, &["-o", "ro"]);
    assert_eq!(fs::read(m.p("dir/file")).unwrap(), b"contents");
    assert_eq!(err_of(fs::write(m.p("new"), b"x")), libc::EROFS);
    assert_eq!(err_of(fs::create_dir(m.p("d2"))), libc::EROFS);
    assert_eq!(err_of(fs::remove_file(m.p("dir/file"))), libc::EROFS);
    assert_eq!(
        err_of(OpenOptions::new().write(true).open(m.p("dir/file"))),
        libc::EROFS
    );
    m.unmount();
    assert!(
        fs::read(&img.path).unwrap() == before,
        "a read-only mount changed the image"
    );
    assert_fsck_clean(&img.path);
}

#[test]
fn writeback_cache_mount_round_trips() {
    let img = mkfs("fuse-wb", 64, &["-b", "4096"]);
    let mut m = Mount::new(&img.path, &["-o", "writeback_cache,commit=1"]);
    let data = pattern(1 << 20, 3);
    {
        let mut f = File::create(m.p("wb.bin")).unwrap();
        for c in data.chunks(10_000) {
            f.write_all(c).unwrap();
        }
    }
    let mut f = OpenOptions::new().append(true).open(m.p("wb.bin")).unwrap();
    f.write_all(b"appended").unwrap();
    f.sync_all().unwrap();
    drop(f);
    let mut want = data.clone();
    want.extend_from_slice(b"appended");
    assert_eq!(fs::read(m.p("wb.bin")).unwrap(), want);
    m.unmount();
    assert_fsck_clean(&img.path);
    assert!(
        lib_read(&img.path, "/wb.bin") == want,
        "library reads what the writeback-cache mount wrote"
    );
}

/// A file of `image`, read whole through a read-only library mount.
fn lib_read(image: &Path, path: &str) -> Vec<u8> {
    let lib = commitfs::Fs::open_path(
        image,
        commitfs::MountOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    let ino = lib.resolve(path).unwrap();
    commitfs::testutil::read_all(&lib, ino)
}

/// Waits until a process that is not our child has exited (or is a zombie).
fn wait_gone(pid: i32, secs: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        match fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(s) => {
                let state = s
                    .rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next());
                if state == Some("Z") || state == Some("X") {
                    return true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

struct Cleanup(PathBuf);
impl Drop for Cleanup {
    fn drop(&mut self) {
        if is_mounted(&self.0) {
            let ok = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.0)
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.0).status();
            }
        }
        let _ = fs::remove_dir(&self.0);
        let _ = fs::remove_file(self.0.with_extension("pid"));
    }
}

#[test]
fn daemon_returns_once_mounted_and_umount_writes_home() {
    require_fuse();
    let img = mkfs("fuse-daemon", 64, &[]);
    let dir = unique("dmnt");
    fs::create_dir_all(&dir).unwrap();
    let guard = Cleanup(dir.clone());
    let pidf = dir.with_extension("pid");
    let out = Command::new(BIN)
        .arg("mount")
        .arg(&img.path)
        .arg(&dir)
        .arg("--pid-file")
        .arg(&pidf)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mount failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // No polling: the mount must be usable the moment the command returns.
    assert!(
        is_mounted(&dir),
        "not mounted when `commitfs mount` returned"
    );
    fs::write(dir.join("hello"), b"from the daemon").unwrap();
    assert_eq!(fs::read(dir.join("hello")).unwrap(), b"from the daemon");
    let pid: i32 = fs::read_to_string(&pidf).unwrap().trim().parse().unwrap();
    assert!(!wait_gone(pid, 0));
    let st = Command::new("umount").arg(&dir).status().unwrap();
    assert!(st.success());
    assert!(
        wait_gone(pid, 60),
        "daemon {pid} still running after umount"
    );
    drop(guard);
    assert_fsck_clean(&img.path);
    let info = Command::new(BIN)
        .arg("info")
        .arg(&img.path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(text.contains("State:            clean"), "{text}");
}

#[test]
fn unsupported_incompat_feature_is_refused_by_name() {
    require_fuse();
    let img: TempImage = mkfs("fuse-inline", 64, &["-O", "inline_data"]);
    let dir = unique("imnt");
    fs::create_dir_all(&dir).unwrap();
    let _guard = Cleanup(dir.clone());
    for fg in [false, true] {
        let mut c = Command::new(BIN);
        c.arg("mount").arg(&img.path).arg(&dir);
        if fg {
            c.arg("--foreground");
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "mount of an inline_data image succeeded"
        );
        assert!(
            err.contains("inline_data"),
            "error does not name the feature: {err}"
        );
        assert!(!is_mounted(&dir));
    }
    // Unknown option and missing mount point fail cleanly too.
    let out = Command::new(BIN)
        .args(["mount", "-o", "bogus"])
        .arg(&img.path)
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bogus"));
}

#[test]
fn sigterm_unmounts_and_writes_home() {
    let img = mkfs("fuse-term", 64, &[]);
    let mut m = Mount::new(&img.path, &[]);
    fs::write(m.p("kept"), b"written before SIGTERM").unwrap();
    // A file still open when the signal arrives: the mount is detached lazily and
    // the daemon finishes once the file is closed.
    let busy = File::open(m.p("kept")).unwrap();
    let mut child = m.child.take().unwrap();
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while is_mounted(&m.dir) {
        assert!(Instant::now() < deadline, "still mounted after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut s = String::new();
    (&busy).read_to_string(&mut s).unwrap();
    assert_eq!(
        s, "written before SIGTERM",
        "open file readable after detach"
    );
    drop(busy);
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "daemon still running:\n{}",
            m.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(st.success(), "daemon exited with {st}:\n{}", m.log_text());
    assert_fsck_clean(&img.path);
    let lib = commitfs::Fs::open_path(
        &img.path,
        commitfs::MountOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    let ino = lib.resolve("/kept").unwrap();
    assert_eq!(lib.getattr(ino).unwrap().size, 22);
}

#[test]
fn forget_releases_unlinked_inodes_and_cached_ones_stay_usable() {
    let img = mkfs("fuse-forget", 64, &[]);
    let mut m = Mount::new(&img.path, &[]);
    let free0 = nix_statvfs(&m.dir).f_ffree;
    for i in 0..20 {
        fs::write(m.p(&format!("f{i}")), pattern(5000, i as u8)).unwrap();
    }
    assert_eq!(nix_statvfs(&m.dir).f_ffree, free0 - 20);
    // Make the kernel forget every unused inode, then use them again.
    fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
    for i in 0..20 {
        assert_eq!(
            fs::read(m.p(&format!("f{i}"))).unwrap(),
            pattern(5000, i as u8)
        );
    }
    // An unlinked inode lives while the kernel still references it, and is freed
    // once it is forgotten.
    let held = File::open(m.p("f0")).unwrap();
    for i in 0..20 {
        fs::remove_file(m.p(&format!("f{i}"))).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while nix_statvfs(&m.dir).f_ffree != free0 - 1 {
        assert!(
            Instant::now() < deadline,
            "unlinked inodes not freed: {} free, expected {}",
            nix_statvfs(&m.dir).f_ffree,
            free0 - 1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut v = Vec::new();
    (&held).read_to_end(&mut v).unwrap();
    assert_eq!(v, pattern(5000, 0));
    drop(held);
    while nix_statvfs(&m.dir).f_ffree != free0 {
        assert!(
            Instant::now() < deadline,
            "open-unlinked inode not freed at close"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    m.unmount();
    assert_fsck_clean(&img.path);
}

/// `commitfs stats` answers the moment the mount is visible: the daemon binds
/// its socket before the kernel mount appears, and a signal reaching the
/// server thread (glibc's set*id broadcast when the sandbox drops root, at
/// the same moment) does not cut the request short. Either race once failed
/// a CI run at a test's first `stats` call.
#[test]
fn stats_answer_as_soon_as_the_mount_appears() {
    let img = mkfs("fuse-stats-at-once", 32, &["-b", "4096"]);
    for round in 0..8 {
        let mut m = Mount::new(&img.path, &[]);
        let v = m.stats();
        assert!(v["journal_mode"].is_string(), "round {round}: {v}");
        m.unmount();
    }
    assert_fsck_clean(&img.path);
}

/// Serving `/dev/fuse`, one event loop reads on for `fuse_poll` µs after each
/// request (default 500): a client's back-to-back requests are found by it
/// without a sleep; `-o fuse_poll=0` turns it off. With FUSE over io_uring
/// (the kernel's `enable_uring`) no loop polls. Requests found while
/// polling are required where the polling loop is the only loop: beside a
/// second loop (blocked in read(2), woken by the kernel for each request)
/// the other loop may take them all (seen once in CI under load).
#[test]
fn one_event_loop_polls_dev_fuse_unless_told_not_to() {
    let img = mkfs("fuse-poll", 32, &["-b", "4096"]);
    for (opts, want_us) in [
        ("threads=1", 500),
        ("commit=5", 500),
        ("threads=2", 500),
        ("threads=2,fuse_poll=0", 0),
    ] {
        let mut m = Mount::new(&img.path, &["-o", opts]);
        for k in 0..200 {
            fs::write(m.p(&format!("{opts}-{k}")), b"x").unwrap();
        }
        let v = m.stats();
        let rings = v["fuse_ring"]["queues"].as_u64().unwrap();
        let p = &v["fuse_poll"];
        let (budget, polled) = (
            p["budget_us"].as_u64().unwrap(),
            p["polled"].as_u64().unwrap(),
        );
        if rings > 0 {
            assert_eq!(
                (budget, polled),
                (0, 0),
                "{opts}: polling beside the rings: {p}"
            );
        } else if want_us > 0 {
            assert_eq!(budget, want_us, "{opts}: {p}");
            if opts == "threads=1" {
                assert!(
                    polled > 0,
                    "{opts}: no request was found while polling: {p}"
                );
            }
        } else {
            assert_eq!((budget, polled), (0, 0), "{opts}: {p}");
        }
        m.unmount();
    }
    assert_fsck_clean(&img.path);
}

/// Through the mount, cached writes reach the device only when written back,
/// an open and a close cost no request (no OPEN, FLUSH or RELEASE: nothing is
/// kept per handle), and what the daemon's cache held is on the image after
/// unmount.
#[test]
fn cached_writes_and_closes_through_the_mount() {
    let img = mkfs("fuse-cache", 64, &["-b", "4096"]);
    let mut m = Mount::new(&img.path, &["-o", "commit=60"]);
    let stats = || m.stats();
    let before = stats();
    let data = pattern(200_000, 9);
    for k in 0..20 {
        fs::write(m.p(&format!("f{k}")), &data).unwrap();
    }
    let after = stats();
    let data_bytes = |v: &serde_json::Value| v["data_bytes"].as_u64().unwrap();
    assert_eq!(
        data_bytes(&after),
        data_bytes(&before),
        "cached writes reached the device before any write-back"
    );
    let pc = &after["page_cache"];
    assert!(pc["dirty_bytes"].as_u64().unwrap() >= 20 * 200_000);
    assert_eq!(pc["data_order"], "prefix", "the default data_order");
    for k in 0..20 {
        assert_eq!(fs::read(m.p(&format!("f{k}"))).unwrap(), data);
        fs::OpenOptions::new()
            .append(true)
            .open(m.p(&format!("f{k}")))
            .unwrap();
        let listed = fs::read_dir(&m.dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with('f')
            })
            .count();
        assert_eq!(listed, 20);
    }
    // Zero-message opens: after the first OPEN (answered ENOSYS, not
    // counted), opens and closes of files and directories cost no request.
    let fr = &stats()["fuse_requests"];
    for op in ["open", "flush", "release", "opendir", "releasedir"] {
        assert!(fr.get(op).is_none(), "{op} requests were served: {fr}");
    }
    m.unmount();
    assert_fsck_clean(&img.path);
    for k in 0..20 {
        assert!(
            lib_read(&img.path, &format!("/f{k}")) == data,
            "f{k} after unmount"
        );
    }
}

/// `-o data_order=file` through the mount: an fsync writes back its own file
/// only (a 1 MiB file written before it stays cached), a file truncated to
/// zero by `O_TRUNC` and rewritten goes out with the next fsync's commit even
/// though its close sent no request (auto_da_alloc), and everything is on the
/// image after unmount.
#[test]
fn data_order_file_through_the_mount() {
    let img = mkfs("fuse-order", 64, &["-b", "4096", "-O", "fast_commit"]);
    let mut m = Mount::new(&img.path, &["-o", "data_order=file,commit=60"]);
    let stats = || m.stats();
    let data_bytes = |v: &serde_json::Value| v["data_bytes"].as_u64().unwrap();
    assert_eq!(stats()["page_cache"]["data_order"], "file");
    let big = pattern(1 << 20, 3);
    let small = pattern(8192, 4);
    fs::write(m.p("big"), &big).unwrap();
    let before = data_bytes(&stats());
    let f = File::create(m.p("small")).unwrap();
    (&f).write_all(&small).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let wrote = data_bytes(&stats()) - before;
    assert_eq!(
        wrote,
        small.len() as u64,
        "the fsync wrote other files' data"
    );

    // Truncate-and-rewrite without fsync, then another file's fsync.
    let cfg = pattern(12288, 5);
    let f = File::create(m.p("cfg")).unwrap();
    (&f).write_all(&pattern(4096, 6)).unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs::write(m.p("cfg"), &cfg).unwrap(); // O_TRUNC, write, close: no request
    let before = data_bytes(&stats());
    let f = File::create(m.p("other")).unwrap();
    (&f).write_all(&small).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let wrote = data_bytes(&stats()) - before;
    assert_eq!(
        wrote,
        (small.len() + cfg.len()) as u64,
        "the rewritten file did not go out with the commit carrying its truncate"
    );
    m.unmount();
    assert_fsck_clean(&img.path);
    assert!(lib_read(&img.path, "/big") == big, "big after unmount");
    assert!(lib_read(&img.path, "/cfg") == cfg, "cfg after unmount");
    assert!(
        lib_read(&img.path, "/other") == small,
        "other after unmount"
    );
}

/// sync(1) never reaches a FUSE daemon (the kernel passes syncfs on to
/// virtiofs only), so cached data waits for the next commit; `commitfs sync
/// DIR` makes it durable at once: a copy of the image taken right after it
/// (while still mounted) recovers with the file and its data, and e2fsck
/// finds the copy clean.
#[test]
fn commitfs_sync_makes_cached_data_durable() {
    let img = mkfs("fuse-sync", 64, &["-b", "4096", "-O", "fast_commit"]);
    let mut m = Mount::new(&img.path, &["-o", "data_order=file,commit=600"]);
    let data_bytes = |v: &serde_json::Value| v["data_bytes"].as_u64().unwrap();
    let data = pattern(300_000, 9);
    fs::write(m.p("kept"), &data).unwrap();
    // The kernel's sync: nothing reaches the daemon.
    assert!(Command::new("sync").status().unwrap().success());
    assert_eq!(data_bytes(&m.stats()), 0, "sync(1) reached the daemon");
    let out = Command::new(BIN).arg("sync").arg(&m.dir).output().unwrap();
    assert!(
        out.status.success(),
        "commitfs sync: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(data_bytes(&m.stats()) >= data.len() as u64);
    let copy = TempImage {
        path: img.path.with_extension("synced.img"),
    };
    fs::copy(&img.path, &copy.path).unwrap();
    m.unmount();
    // The copy needs recovery (it was taken mounted): a read-write library
    // mount replays its journal, then reads the file back.
    {
        let lib = commitfs::Fs::open_path(&copy.path, commitfs::MountOptions::default()).unwrap();
        let ino = lib.resolve("/kept").unwrap();
        assert!(
            commitfs::testutil::read_all(&lib, ino) == data,
            "kept after recovery"
        );
        lib.unmount().unwrap();
    }
    assert_fsck_clean(&copy.path);
    // Not mounted any more: a clear error, not a hang.
    let out = Command::new(BIN).arg("sync").arg(&m.dir).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no commitfs mount"));
}

/// mmap through the mount, interleaved with write, read, truncate and a
/// punched hole, all through the daemon's page cache: every view (read(2),
/// the mapping, the image after unmount) agrees with a model of the file.
#[test]
fn mmap_write_read_truncate_punch_through_the_cache() {
    let img = mkfs("fuse-mmap", 64, &["-b", "4096"]);
    let mut m = Mount::new(&img.path, &["-o", "commit=60"]);
    let path = m.p("mm.bin");
    let len = 64 * 1024;
    let mut model = pattern(len, 4);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    f.write_all_at(&model, 0).unwrap();
    // SAFETY: a shared mapping of `len` bytes of an open file that is at least
    // that long; unmapped below before the file is closed.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        map,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `map` is a live mapping of `len` bytes.
    let view = unsafe { std::slice::from_raw_parts_mut(map as *mut u8, len) };
    // Stores through the mapping, made durable with msync.
    for i in (100..30_000).step_by(7) {
        view[i] = 0xAB;
        model[i] = 0xAB;
    }
    // SAFETY: the same live mapping.
    assert_eq!(unsafe { libc::msync(map, len, libc::MS_SYNC) }, 0);
    let mut got = vec![0u8; len];
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == model, "read(2) after stores through the mapping");
    // A write(2) shows in the mapping.
    f.write_all_at(&[0x5A; 5000], 40_000).unwrap();
    model[40_000..45_000].fill(0x5A);
    assert!(
        view[40_000..45_000].iter().all(|&b| b == 0x5A),
        "write(2) seen through the mapping"
    );
    // SAFETY: the same live mapping, unmapped once.
    assert_eq!(unsafe { libc::munmap(map, len) }, 0);
    // A punched hole and a truncate, then an extension.
    assert_eq!(
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            8192,
            8192
        ),
        0
    );
    model[8192..16_384].fill(0);
    f.set_len(50_000).unwrap();
    model.truncate(50_000);
    f.write_all_at(b"tail", 60_000).unwrap();
    model.resize(60_000, 0);
    model.extend_from_slice(b"tail");
    f.sync_all().unwrap();
    drop(f);
    assert!(
        fs::read(&path).unwrap() == model,
        "read back through the mount"
    );
    m.unmount();
    assert_fsck_clean(&img.path);
    assert!(
        lib_read(&img.path, "/mm.bin") == model,
        "the image after unmount"
    );
}

/// A lone polling event loop held by one long request (here writes that
/// write the file back past the dirty limit) does not hold up the others:
/// the relief loop serves the queue meanwhile (`fuse_poll.reliefs`).
#[test]
fn a_long_request_does_not_hold_up_the_others() {
    let img = mkfs("fuse-relief", 512, &["-b", "4096"]);
    let mut m = Mount::new(
        &img.path,
        &["-o", "threads=1,noio_uring,cache_size=64,commit=60"],
    );
    fs::write(m.p("small"), b"small file").unwrap();
    let big = m.p("big");
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        let chunk = pattern(1 << 20, 7);
        let mut f = fs::File::create(big).unwrap();
        for _ in 0..256 {
            f.write_all(&chunk).unwrap();
        }
        f.sync_all().unwrap();
    });
    // statx with AT_STATX_FORCE_SYNC: every probe is a GETATTR the daemon
    // answers (a plain stat is mostly answered from the kernel's attribute
    // cache, and would rarely be queued while the write holds the loop).
    let small = std::ffi::CString::new(m.p("small").into_os_string().into_encoded_bytes()).unwrap();
    let mut asked = 0u64;
    while !writer.is_finished() {
        // SAFETY: a valid path and a zeroed statx buffer to fill.
        let mut stx: libc::statx = unsafe { std::mem::zeroed() };
        let rc = unsafe {
            libc::statx(
                libc::AT_FDCWD,
                small.as_ptr(),
                libc::AT_STATX_FORCE_SYNC,
                libc::STATX_SIZE,
                &mut stx,
            )
        };
        assert_eq!((rc, stx.stx_size), (0, 10));
        asked += 1;
    }
    writer.join().unwrap();
    let p = m.stats()["fuse_poll"].clone();
    let (reliefs, relieved) = (
        p["reliefs"].as_u64().unwrap(),
        p["relieved"].as_u64().unwrap(),
    );
    assert!(
        reliefs > 0 && relieved > 0,
        "no request was served while a write held the event loop ({asked} stats): {p}"
    );
    eprintln!("relief: {p} after {asked} probes");
    assert_eq!(fs::metadata(m.p("big")).unwrap().len(), 256 << 20);
    m.unmount();
    assert_fsck_clean(&img.path);
}

/// A READ the daemon's cache cannot answer whole (a file written home, then
/// the mount started again) is served on the pool, where it may wait for the
/// device while the event loop goes on (one polling loop used to read a file
/// one request at a time); a READ the cache answers stays on the loop.
#[test]
fn reads_that_miss_the_cache_leave_the_event_loop() {
    use std::os::fd::AsRawFd;
    let counts = |v: &serde_json::Value| {
        (
            v["fuse_requests"]["read"]["count"].as_u64().unwrap_or(0),
            v["fuse_reads_deferred"]["reads"].as_u64().unwrap(),
            v["fuse_reads_deferred"]["max_at_once"].as_u64().unwrap(),
        )
    };
    let img = mkfs("fuse-readpool", 64, &["-b", "4096"]);
    let data = pattern(6 << 20, 5);
    let mut m = Mount::new(&img.path, &[]);
    fs::write(m.p("big"), &data).unwrap();
    m.unmount();

    let mut m = Mount::new(&img.path, &[]);
    let (r0, d0, _) = counts(&m.stats());
    assert_eq!(fs::read(m.p("big")).unwrap(), data);
    let (r1, d1, most) = counts(&m.stats());
    assert!(r1 - r0 >= 6, "a 6 MiB file in {} READs", r1 - r0);
    assert_eq!(
        d1 - d0,
        r1 - r0,
        "every READ of a file the cache does not hold goes to the pool"
    );
    assert!(most >= 1);

    // Written through this mount: the daemon's cache holds it. Dropped from
    // the kernel's page cache, so that reading it again asks the daemon.
    let small = pattern(20_000, 6);
    fs::write(m.p("small"), &small).unwrap();
    let f = fs::File::open(m.p("small")).unwrap();
    // SAFETY: a valid descriptor; advice only.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0);
    drop(f);
    let (r2, d2, _) = counts(&m.stats());
    assert_eq!(fs::read(m.p("small")).unwrap(), small);
    let (r3, d3, _) = counts(&m.stats());
    assert!(
        r3 > r2,
        "the kernel kept the pages: no READ reached the daemon"
    );
    assert_eq!(d3, d2, "READs the cache answers stay on the event loop");
    m.unmount();
    assert_fsck_clean(&img.path);
}

/// The mount's readahead (`/sys/class/bdi/MAJ:MIN/read_ahead_kb`) is raised to
/// 1 MiB once the kernel has taken the FUSE INIT reply (which would lower it
/// again), so a sequential read is a request per MiB, not per 128 KiB;
/// `read_ahead_kb=0` leaves the kernel's value and `read_ahead_kb=N` sets N.
#[test]
fn readahead_of_the_mount_is_raised() {
    use std::os::unix::fs::MetadataExt;
    let knob = |dir: &Path, wait: Duration| {
        let dev = fs::metadata(dir).unwrap().dev();
        let p = format!(
            "/sys/class/bdi/{}:{}/read_ahead_kb",
            libc::major(dev),
            libc::minor(dev)
        );
        // Written by the daemon once INIT is done: poll briefly.
        let deadline = std::time::Instant::now() + wait;
        let mut last = String::new();
        while std::time::Instant::now() < deadline {
            last = fs::read_to_string(&p).unwrap().trim().to_string();
            if last != "128" {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        last
    };
    let img = mkfs("fuse-ra", 64, &["-b", "4096"]);
    for (opts, want) in [
        (&[][..], "1024"),
        (&["-o", "read_ahead_kb=2048"][..], "2048"),
        (&["-o", "read_ahead_kb=0"][..], "128"),
    ] {
        let mut m = Mount::new(&img.path, opts);
        // The kernel's own value: give the daemon time it would have used.
        let wait = Duration::from_millis(if want == "128" { 500 } else { 5000 });
        assert_eq!(knob(&m.dir, wait), want, "mount options {opts:?}");
        m.unmount();
    }
    assert_fsck_clean(&img.path);
}
