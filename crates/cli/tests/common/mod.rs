//! Shared helpers for commitfs's integration tests (differential.rs, kernel_images.rs)
//! and the bench example: images, loop devices, kernel and FUSE mounts (all cleaned
//! up by Drop guards, also on panic), and tree snapshots that compare a directory
//! tree field by field whoever serves it (kernel ext4, the FUSE mount, the library).
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use commitfs_fs::{FileType, Fs, FsError, Ino, ROOT_INO};

#[allow(unused_imports)]
pub use commitfs_fs::testutil::{fsck, mkfs, problem_lines, FsckResult, TempImage};

// ---------------------------------------------------------------- temp paths

/// A unique path under the temp dir (pid + counter + clock, so parallel tests and
/// parallel test binaries never collide).
pub fn unique_path(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!("commitfs-{tag}-{}-{n}-{t}", std::process::id()))
}

/// A file removed on drop.
pub struct TempFile {
    pub path: PathBuf,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// An empty directory removed on drop. Only `remove_dir` (never recursive): if
/// something is still mounted on it, the removal fails harmlessly instead of
/// deleting the mounted file system's contents.
pub struct TempDir {
    pub path: PathBuf,
}

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let path = unique_path(tag);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// `cp --sparse=always src <new temp file>`: an identical copy of a fresh image.
pub fn copy_sparse(src: &Path, tag: &str) -> TempFile {
    let dst = unique_path(tag).with_extension("img");
    let out = Command::new("cp")
        .arg("--sparse=always")
        .arg(src)
        .arg(&dst)
        .output()
        .expect("run cp");
    let f = TempFile { path: dst };
    assert!(
        out.status.success(),
        "cp --sparse=always failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    f
}

/// Run a command; Ok(stdout+stderr) on success, Err(description) otherwise.
pub fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{cmd:?} exited with {}: {text}", out.status))
    }
}

/// Problem lines of e2fsck output: testutil's filter, minus the summary line in
/// its "N/M files (x% non-contiguous), B/C blocks" form (testutil only knows the
/// form without the percentage).
pub fn fsck_problems(out: &str) -> Vec<String> {
    problem_lines(out)
        .into_iter()
        .filter(|l| {
            !(l.contains(" files (") && l.contains("non-contiguous), ") && l.ends_with(" blocks"))
        })
        // Optimisation hints, not damage: the kernel itself never collapses extent
        // trees, so its own images get these too.
        .filter(|l| {
            !(l.contains("extent tree (at level")
                && (l.contains("could be shorter") || l.contains("could be narrower")))
        })
        .collect()
}

/// `e2fsck -fn` must be clean: exit code 0 and no problem lines.
pub fn check_fsck(path: &Path, what: &str) -> Result<(), String> {
    let r = fsck(path);
    if r.code == 0 && fsck_problems(&r.output).is_empty() {
        Ok(())
    } else {
        Err(format!(
            "e2fsck -fn on {what} ({}) reported problems (exit {}):\n{}",
            path.display(),
            r.code,
            r.output
        ))
    }
}

/// Make the test process's file-creation mask 0 so that create/mkdir/mknod modes
/// arrive unchanged at every target (the library takes modes verbatim).
pub fn umask0() {
    // SAFETY: umask has no memory-safety preconditions.
    unsafe {
        libc::umask(0);
    }
}

// ---------------------------------------------------------------- loop devices

/// A loop device attached with `losetup -f --show`, detached on drop.
pub struct LoopDev {
    pub dev: String,
}

impl LoopDev {
    pub fn attach(image: &Path) -> Result<LoopDev, String> {
        let mut last = String::new();
        // `losetup -f` can race with a parallel test grabbing the same free device.
        for _ in 0..20 {
            match run(Command::new("losetup").arg("-f").arg("--show").arg(image)) {
                Ok(out) => {
                    let dev = out.trim().to_string();
                    if dev.starts_with("/dev/") {
                        return Ok(LoopDev { dev });
                    }
                    last = format!("unexpected losetup output {out:?}");
                }
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!("losetup -f --show {}: {last}", image.display()))
    }

    pub fn detach(&mut self) -> Result<(), String> {
        if self.dev.is_empty() {
            return Ok(());
        }
        let mut last = String::new();
        for _ in 0..50 {
            match run(Command::new("losetup").arg("-d").arg(&self.dev)) {
                Ok(_) => {
                    self.dev.clear();
                    return Ok(());
                }
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last)
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        if let Err(e) = self.detach() {
            eprintln!("warning: could not detach loop device: {e}");
        }
    }
}

// ---------------------------------------------------------------- kernel mounts

/// Kernel ext4 mounted from an image through a loop device. Drop unmounts and
/// detaches (lazily if it must), also during a panic.
pub struct KernelMount {
    pub dir: PathBuf,
    loopdev: Option<LoopDev>,
    mounted: bool,
    _dir_guard: Option<TempDir>,
}

impl KernelMount {
    /// `opts` e.g. "noatime" or "ro,noatime".
    pub fn mount(image: &Path, opts: &str) -> Result<KernelMount, String> {
        let dir = TempDir::new("kmnt");
        let loopdev = LoopDev::attach(image)?;
        run(Command::new("mount")
            .arg("-t")
            .arg("ext4")
            .arg("-o")
            .arg(opts)
            .arg(&loopdev.dev)
            .arg(&dir.path))?;
        Ok(KernelMount {
            dir: dir.path.clone(),
            loopdev: Some(loopdev),
            mounted: true,
            _dir_guard: Some(dir),
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Unmount and detach; errors are returned (the caller asserts on them).
    pub fn unmount(&mut self) -> Result<(), String> {
        if self.mounted {
            let mut last = String::new();
            let mut ok = false;
            for _ in 0..50 {
                match run(Command::new("umount").arg(&self.dir)) {
                    Ok(_) => {
                        ok = true;
                        break;
                    }
                    Err(e) => last = e,
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if !ok {
                return Err(last);
            }
            self.mounted = false;
        }
        if let Some(mut l) = self.loopdev.take() {
            l.detach()?;
        }
        Ok(())
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            eprintln!(
                "warning: kernel unmount of {} failed: {e}; lazy unmount",
                self.dir.display()
            );
            let _ = run(Command::new("umount").arg("-l").arg(&self.dir));
            self.mounted = false;
            if let Some(mut l) = self.loopdev.take() {
                let _ = l.detach();
            }
        }
    }
}

// ---------------------------------------------------------------- FUSE mounts

/// Is `dir` a mount point of type starting with `fstype_prefix`?
pub fn is_mounted(dir: &Path, fstype_prefix: &str) -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = dir.to_string_lossy();
    text.lines().any(|l| {
        let mut parts = l.split(" - ");
        let (Some(a), Some(b)) = (parts.next(), parts.next()) else {
            return false;
        };
        a.split(' ').nth(4) == Some(&*want) && b.starts_with(fstype_prefix)
    })
}

/// A `commitfs mount IMAGE DIR --foreground` child process. Drop unmounts with
/// `fusermount3 -u` (lazily if needed) and reaps the child (killing it if it hangs).
pub struct FuseMount {
    pub dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
    mounted: bool,
    _dir_guard: Option<TempDir>,
}

impl FuseMount {
    pub fn mount(bin: &Path, image: &Path, extra: &[&str]) -> Result<FuseMount, String> {
        let dir = TempDir::new("fmnt");
        let log = unique_path("fuse-log").with_extension("log");
        let logf = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let logf2 = logf.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new(bin)
            .arg("mount")
            .arg(image)
            .arg(&dir.path)
            .arg("--foreground")
            .args(extra)
            .stdin(Stdio::null())
            .stdout(logf)
            .stderr(logf2)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
        let mut m = FuseMount {
            dir: dir.path.clone(),
            child: Some(child),
            log,
            mounted: false,
            _dir_guard: Some(dir),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if is_mounted(&m.dir, "fuse") {
                m.mounted = true;
                return Ok(m);
            }
            if let Some(c) = m.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    m.child = None;
                    return Err(format!(
                        "commitfs mount exited with {st} before mounting; log:\n{}",
                        m.log_text()
                    ));
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "commitfs mount did not mount within 30 s; log:\n{}",
                    m.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Unmount and wait for the daemon to finish writing; the daemon must exit 0.
    pub fn unmount(&mut self) -> Result<(), String> {
        if self.mounted {
            let mut last = String::new();
            let mut ok = false;
            for _ in 0..50 {
                match run(Command::new("fusermount3").arg("-u").arg(&self.dir)) {
                    Ok(_) => {
                        ok = true;
                        break;
                    }
                    Err(e) => last = e,
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if !ok {
                return Err(last);
            }
            self.mounted = false;
        }
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                match c.try_wait() {
                    Ok(Some(st)) if st.success() => break,
                    Ok(Some(st)) => {
                        return Err(format!(
                            "commitfs mount exited with {st}; log:\n{}",
                            self.log_text()
                        ))
                    }
                    Ok(None) if Instant::now() > deadline => {
                        let _ = c.kill();
                        let _ = c.wait();
                        return Err(format!(
                            "commitfs mount did not exit within 120 s after unmount; log:\n{}",
                            self.log_text()
                        ));
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                    Err(e) => return Err(e.to_string()),
                }
            }
        }
        Ok(())
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if self.mounted {
            if run(Command::new("fusermount3").arg("-u").arg(&self.dir)).is_err() {
                let _ = run(Command::new("fusermount3").arg("-uz").arg(&self.dir));
            }
            self.mounted = false;
        }
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Aborts a hung FUSE mount after a deadline (kills the daemon and lazily unmounts,
/// so blocked system calls fail and the test reports instead of hanging forever).
pub struct Watchdog {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    pub fn new(what: String, secs: u64, pid: Option<u32>, dir: Option<PathBuf>) -> Watchdog {
        let (tx, rx) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_secs(secs))
            {
                eprintln!("WATCHDOG: {what} still running after {secs} s: aborting the FUSE mount");
                if let Some(p) = pid {
                    // SAFETY: sending a signal to our own child process.
                    unsafe {
                        libc::kill(p as i32, libc::SIGKILL);
                    }
                }
                if let Some(d) = dir {
                    let _ = run(Command::new("fusermount3").arg("-uz").arg(&d));
                }
            }
        });
        Watchdog {
            stop: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------- errno mapping

/// The errno a POSIX caller should see for a library error (the FUSE layer must
/// use the same mapping).
pub fn errno_of(e: &FsError) -> i32 {
    match e {
        FsError::NotFound => libc::ENOENT,
        FsError::Exists => libc::EEXIST,
        FsError::NotDir => libc::ENOTDIR,
        FsError::IsDir => libc::EISDIR,
        FsError::NotEmpty => libc::ENOTEMPTY,
        FsError::NoSpace => libc::ENOSPC,
        FsError::NameTooLong => libc::ENAMETOOLONG,
        FsError::Invalid(_) => libc::EINVAL,
        FsError::ReadOnly => libc::EROFS,
        FsError::TooManyLinks => libc::EMLINK,
        FsError::NoData => libc::ENODATA,
        FsError::XattrTooBig => libc::E2BIG,
        FsError::FileTooBig => libc::EFBIG,
        FsError::Permission(_) => libc::EPERM,
        FsError::AccessDenied(_) => libc::EACCES,
        FsError::NotSupported(_) => libc::EOPNOTSUPP,
        _ => libc::EIO,
    }
}

pub fn errno_name(e: i32) -> String {
    let n = match e {
        libc::ENOENT => "ENOENT",
        libc::EEXIST => "EEXIST",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ENOSPC => "ENOSPC",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::EINVAL => "EINVAL",
        libc::EROFS => "EROFS",
        libc::EMLINK => "EMLINK",
        libc::ENODATA => "ENODATA",
        libc::E2BIG => "E2BIG",
        libc::ERANGE => "ERANGE",
        libc::EFBIG => "EFBIG",
        libc::EPERM => "EPERM",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EIO => "EIO",
        libc::EXDEV => "EXDEV",
        libc::EBADF => "EBADF",
        libc::ENOTCONN => "ENOTCONN",
        libc::EUCLEAN => "EUCLEAN",
        libc::ENOSYS => "ENOSYS",
        libc::EACCES => "EACCES",
        _ => return format!("errno {e}"),
    };
    n.to_string()
}

pub fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

/// `lsetxattr(2)`, panicking on failure.
pub fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    if let Err(e) = commitfs_fs::testutil::kernel_xattr::set(p, name.as_bytes(), value) {
        panic!("lsetxattr {} {name}: {}", p.display(), errno_name(e));
    }
}

// ---------------------------------------------------------------- hashing

/// 64-bit word hash: xor-multiply-rotate over little-endian words. Any single-word
/// change always changes the result (each step is a bijection of the state); we
/// only need to detect differences, not resist adversaries, so no crypto crate.
pub fn hash_words(seed: u64, data: &[u8]) -> u64 {
    const P: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = seed ^ 0xCBF2_9CE4_8422_2325 ^ (data.len() as u64).wrapping_mul(P);
    let mut it = data.chunks_exact(8);
    for w in &mut it {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        h = (h ^ u64::from_le_bytes(b)).wrapping_mul(P).rotate_left(31);
    }
    for &b in it.remainder() {
        h = (h ^ b as u64).wrapping_mul(P).rotate_left(31);
    }
    h ^ (h >> 29)
}

const CHUNK: usize = 4096;
static ZEROS: [u8; CHUNK] = [0; CHUNK];

pub fn is_zero(s: &[u8]) -> bool {
    s.chunks(CHUNK).all(|c| c == &ZEROS[..c.len()])
}

/// Hash of a file's content that does not depend on how it was read: the mix of
/// (chunk index, chunk hash) over all non-zero 4 KiB chunks, plus the size. Data
/// may be fed at any ascending offsets; bytes never fed count as zeros (holes).
pub struct ContentHasher {
    idx: u64,
    buf: Vec<u8>,
    have: bool,
    acc: u64,
}

impl Default for ContentHasher {
    fn default() -> Self {
        ContentHasher {
            idx: 0,
            buf: vec![0; CHUNK],
            have: false,
            acc: 0x1234_5678,
        }
    }
}

impl ContentHasher {
    pub fn feed(&mut self, mut off: u64, mut data: &[u8]) {
        while !data.is_empty() {
            let idx = off / CHUNK as u64;
            let in_c = (off % CHUNK as u64) as usize;
            let n = (CHUNK - in_c).min(data.len());
            let piece = &data[..n];
            if !is_zero(piece) {
                if !self.have || self.idx != idx {
                    self.flush();
                    self.idx = idx;
                    self.buf.fill(0);
                    self.have = true;
                }
                self.buf[in_c..in_c + n].copy_from_slice(piece);
            }
            off += n as u64;
            data = &data[n..];
        }
    }

    fn flush(&mut self) {
        if self.have {
            let h = hash_words(self.idx, &self.buf);
            self.acc = hash_words(
                self.acc,
                &[self.idx.to_le_bytes(), h.to_le_bytes()].concat(),
            );
            self.have = false;
        }
    }

    pub fn finish(mut self, size: u64) -> u64 {
        self.flush();
        hash_words(self.acc, &size.to_le_bytes())
    }
}

/// Turns the kernel's FUSE-over-io_uring switch on while alive (root), and
/// back to what it was after (tests of `-o io_uring`; the switch only
/// matters when a mount is made).
pub struct UringSwitch(String);

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

impl UringSwitch {
    pub fn on() -> UringSwitch {
        let old = std::fs::read_to_string(URING_PARAM).unwrap_or_else(|e| {
            panic!("{URING_PARAM}: {e} (a kernel without CONFIG_FUSE_IO_URING?)")
        });
        std::fs::write(URING_PARAM, "Y")
            .unwrap_or_else(|e| panic!("cannot turn on FUSE over io_uring ({URING_PARAM}): {e}"));
        UringSwitch(old.trim().to_string())
    }
}

impl Drop for UringSwitch {
    fn drop(&mut self) {
        let _ = std::fs::write(URING_PARAM, &self.0);
    }
}

/// The output of `commitfs stats DIR --json` for a commitfs mount (`bin`: the
/// commitfs binary); an error for anything else (a kernel mount has no stats
/// socket). Text, not parsed: not every crate sharing this module has a JSON
/// parser.
pub fn commitfs_stats_json(bin: &Path, dir: &Path) -> Result<String, String> {
    run(Command::new(bin).arg("stats").arg(dir).arg("--json"))
}

/// Hash of a byte string as a content hash (same function as for files).
pub fn content_hash_of(data: &[u8]) -> u64 {
    let mut h = ContentHasher::default();
    h.feed(0, data);
    h.finish(data.len() as u64)
}

// ---------------------------------------------------------------- snapshots

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Chr,
    Blk,
    Fifo,
    Sock,
}

impl Kind {
    pub fn from_mode(mode: u32) -> Option<Kind> {
        Some(match mode & libc::S_IFMT {
            libc::S_IFREG => Kind::File,
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFCHR => Kind::Chr,
            libc::S_IFBLK => Kind::Blk,
            libc::S_IFIFO => Kind::Fifo,
            libc::S_IFSOCK => Kind::Sock,
            _ => return None,
        })
    }
    pub fn of(ft: FileType) -> Kind {
        match ft {
            FileType::Regular => Kind::File,
            FileType::Directory => Kind::Dir,
            FileType::Symlink => Kind::Symlink,
            FileType::CharDevice => Kind::Chr,
            FileType::BlockDevice => Kind::Blk,
            FileType::Fifo => Kind::Fifo,
            FileType::Socket => Kind::Sock,
        }
    }
}

/// (seconds, nanoseconds).
pub type Ts = (i64, u32);

/// Everything we compare about one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub kind: Kind,
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u64,
    pub size: u64,
    /// 512-byte sectors.
    pub blocks: u64,
    /// (major, minor) for device nodes.
    pub rdev: (u32, u32),
    pub atime: Ts,
    pub mtime: Ts,
    pub ctime: Ts,
    pub btime: Option<Ts>,
    pub content: Option<u64>,
    pub target: Option<Vec<u8>>,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Inode number on the system that made the snapshot (never compared).
    pub ino: u64,
    /// Smallest path naming the same inode (compares hard-link structure).
    pub link_group: String,
}

#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    pub entries: BTreeMap<String, Entry>,
    /// Internal inconsistencies seen while walking ("." / ".." / d_type / read errors).
    pub problems: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
pub struct SnapOpts {
    pub content: bool,
    pub xattrs: bool,
}

impl Default for SnapOpts {
    fn default() -> Self {
        SnapOpts {
            content: true,
            xattrs: true,
        }
    }
}

/// Decode a user-space 32-bit dev_t (new_encode_dev layout).
pub fn split_dev32(d: u32) -> (u32, u32) {
    ((d >> 8) & 0xfff, (d & 0xff) | ((d >> 12) & 0xfff00))
}

pub fn join_path(parent: &str, name: &str) -> String {
    if parent == "/" {
        format!("/{name}")
    } else {
        format!("{parent}/{name}")
    }
}

fn name_str(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok(s) => s.to_string(),
        Err(_) => format!("{b:?}"),
    }
}

fn finish_link_groups(s: &mut Snapshot) {
    let mut first: HashMap<u64, String> = HashMap::new();
    for (p, e) in &s.entries {
        first.entry(e.ino).or_insert_with(|| p.clone());
    }
    for e in s.entries.values_mut() {
        e.link_group = first[&e.ino].clone();
    }
}

// --- POSIX side (kernel mount or FUSE mount)

pub fn statx(p: &Path) -> std::io::Result<libc::statx> {
    let c = cpath(p);
    // SAFETY: zeroed statx is a valid out-parameter; c is NUL-terminated.
    unsafe {
        let mut st: libc::statx = std::mem::zeroed();
        let r = libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            &mut st,
        );
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st)
    }
}

pub fn posix_list_xattrs(p: &Path) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, i32> {
    commitfs_fs::testutil::kernel_xattr::list(p)
}

pub fn posix_get_xattr(p: &Path, name: &[u8]) -> Result<Vec<u8>, i32> {
    commitfs_fs::testutil::kernel_xattr::get(p, name)
}

/// Content hash of a regular file through the POSIX API. Holes are skipped with
/// SEEK_DATA/SEEK_HOLE (a file system without them reports all data; fine).
pub fn posix_content_hash(p: &Path) -> Result<u64, String> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(p)
        .map_err(|e| format!("open {}: {e}", p.display()))?;
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    let fd = std::os::unix::io::AsRawFd::as_raw_fd(&f);
    let mut h = ContentHasher::default();
    let mut buf = vec![0u8; 1 << 20];
    let mut pos: u64 = 0;
    while pos < size {
        // SAFETY: plain lseek on an open fd.
        let d = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
        if d < 0 {
            let e = last_errno();
            if e == libc::ENXIO {
                break;
            }
            return Err(format!("SEEK_DATA {}: {}", p.display(), errno_name(e)));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, d, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(format!(
                "SEEK_HOLE {}: {}",
                p.display(),
                errno_name(last_errno())
            ));
        }
        let (d, hole) = (d as u64, (hole as u64).min(size));
        if d >= size {
            // Preallocated blocks past EOF can make SEEK_DATA answer at EOF.
            break;
        }
        let hole = if hole <= d { size } else { hole };
        let mut at = d;
        while at < hole {
            let want = ((hole - at) as usize).min(buf.len());
            let n = f
                .read_at(&mut buf[..want], at)
                .map_err(|e| format!("read {} at {at}: {e}", p.display()))?;
            if n == 0 {
                return Err(format!(
                    "short read of {} at {at} (size {size})",
                    p.display()
                ));
            }
            h.feed(at, &buf[..n]);
            at += n as u64;
        }
        pos = hole;
    }
    Ok(h.finish(size))
}

fn ts(sec: i64, nsec: u32) -> Ts {
    (sec, nsec)
}

fn posix_entry(p: &Path, opts: SnapOpts, problems: &mut Vec<String>, shown: &str) -> Option<Entry> {
    let st = match statx(p) {
        Ok(s) => s,
        Err(e) => {
            problems.push(format!("{shown}: lstat: {e}"));
            return None;
        }
    };
    let mode = st.stx_mode as u32;
    let Some(kind) = Kind::from_mode(mode) else {
        problems.push(format!("{shown}: unknown mode {mode:o}"));
        return None;
    };
    let content = if kind == Kind::File && opts.content {
        match posix_content_hash(p) {
            Ok(h) => Some(h),
            Err(e) => {
                problems.push(format!("{shown}: {e}"));
                None
            }
        }
    } else {
        None
    };
    let target = if kind == Kind::Symlink {
        match std::fs::read_link(p) {
            Ok(t) => Some(t.as_os_str().as_bytes().to_vec()),
            Err(e) => {
                problems.push(format!("{shown}: readlink: {e}"));
                None
            }
        }
    } else {
        None
    };
    let xattrs = if opts.xattrs {
        match posix_list_xattrs(p) {
            Ok(x) => x,
            Err(e) => {
                problems.push(format!("{shown}: listxattr: {}", errno_name(e)));
                BTreeMap::new()
            }
        }
    } else {
        BTreeMap::new()
    };
    let btime = if st.stx_mask & libc::STATX_BTIME != 0 {
        Some(ts(st.stx_btime.tv_sec, st.stx_btime.tv_nsec))
    } else {
        None
    };
    Some(Entry {
        kind,
        perm: mode & 0o7777,
        uid: st.stx_uid,
        gid: st.stx_gid,
        nlink: st.stx_nlink as u64,
        size: st.stx_size,
        blocks: st.stx_blocks,
        rdev: match kind {
            Kind::Chr | Kind::Blk => (st.stx_rdev_major, st.stx_rdev_minor),
            _ => (0, 0),
        },
        atime: ts(st.stx_atime.tv_sec, st.stx_atime.tv_nsec),
        mtime: ts(st.stx_mtime.tv_sec, st.stx_mtime.tv_nsec),
        ctime: ts(st.stx_ctime.tv_sec, st.stx_ctime.tv_nsec),
        btime,
        content,
        target,
        xattrs,
        ino: st.stx_ino,
        link_group: String::new(),
    })
}

/// Snapshot the tree under `root` (a mount point) through the POSIX API.
pub fn snapshot_posix(root: &Path, opts: SnapOpts) -> Snapshot {
    let mut s = Snapshot::default();
    let mut stack: Vec<(PathBuf, String)> = vec![(root.to_path_buf(), "/".to_string())];
    while let Some((real, shown)) = stack.pop() {
        let Some(e) = posix_entry(&real, opts, &mut s.problems, &shown) else {
            continue;
        };
        let is_dir = e.kind == Kind::Dir;
        let my_ino = e.ino;
        s.entries.insert(shown.clone(), e);
        if !is_dir {
            continue;
        }
        if shown != "/" {
            // ".." must lead back to the parent we came from.
            if let (Ok(dd), Some(parent)) = (statx(&real.join("..")), real.parent()) {
                if let Ok(pst) = statx(parent) {
                    if dd.stx_ino != pst.stx_ino {
                        s.problems.push(format!(
                            "{shown}: '..' is inode {} not the parent {}",
                            dd.stx_ino, pst.stx_ino
                        ));
                    }
                }
            }
            if let Ok(d) = statx(&real.join(".")) {
                if d.stx_ino != my_ino {
                    s.problems
                        .push(format!("{shown}: '.' is not the directory itself"));
                }
            }
        }
        let rd = match std::fs::read_dir(&real) {
            Ok(r) => r,
            Err(e) => {
                s.problems.push(format!("{shown}: readdir: {e}"));
                continue;
            }
        };
        let mut seen = std::collections::HashSet::new();
        for de in rd {
            let de = match de {
                Ok(d) => d,
                Err(e) => {
                    s.problems.push(format!("{shown}: readdir: {e}"));
                    break;
                }
            };
            let name = de.file_name();
            let nb = name.as_bytes().to_vec();
            if !seen.insert(nb.clone()) {
                s.problems
                    .push(format!("{shown}: duplicate entry {}", name_str(&nb)));
            }
            let child_shown = join_path(&shown, &name_str(&nb));
            let child_real = real.join(&name);
            // d_type from readdir must agree with the inode's type.
            if let (Ok(ft), Ok(st)) = (de.file_type(), statx(&child_real)) {
                use std::os::unix::fs::FileTypeExt;
                let dk = if ft.is_dir() {
                    Kind::Dir
                } else if ft.is_symlink() {
                    Kind::Symlink
                } else if ft.is_file() {
                    Kind::File
                } else if ft.is_char_device() {
                    Kind::Chr
                } else if ft.is_block_device() {
                    Kind::Blk
                } else if ft.is_fifo() {
                    Kind::Fifo
                } else {
                    Kind::Sock
                };
                if Some(dk) != Kind::from_mode(st.stx_mode as u32) {
                    s.problems.push(format!(
                        "{child_shown}: readdir type {dk:?} but inode mode {:o}",
                        st.stx_mode
                    ));
                }
            }
            stack.push((child_real, child_shown));
        }
    }
    finish_link_groups(&mut s);
    s
}

// --- library side

pub fn lib_content_hash(fs: &Fs, ino: Ino, size: u64) -> Result<u64, String> {
    let mut h = ContentHasher::default();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < size {
        let want = ((size - at) as usize).min(buf.len());
        let n = fs
            .read(ino, at, &mut buf[..want])
            .map_err(|e| format!("read inode {ino} at {at}: {e}"))?;
        if n == 0 {
            return Err(format!("short read of inode {ino} at {at} (size {size})"));
        }
        h.feed(at, &buf[..n]);
        at += n as u64;
    }
    // Reading past the end must return 0 bytes.
    let n = fs
        .read(ino, size, &mut buf[..16])
        .map_err(|e| format!("read at EOF: {e}"))?;
    if n != 0 {
        return Err(format!("read at EOF of inode {ino} returned {n} bytes"));
    }
    Ok(h.finish(size))
}

fn lib_entry(
    fs: &Fs,
    ino: Ino,
    opts: SnapOpts,
    problems: &mut Vec<String>,
    shown: &str,
) -> Option<Entry> {
    let a = match fs.getattr(ino) {
        Ok(a) => a,
        Err(e) => {
            problems.push(format!("{shown}: getattr({ino}): {e}"));
            return None;
        }
    };
    let kind = Kind::of(a.kind);
    let content = if kind == Kind::File && opts.content {
        match lib_content_hash(fs, ino, a.size) {
            Ok(h) => Some(h),
            Err(e) => {
                problems.push(format!("{shown}: {e}"));
                None
            }
        }
    } else {
        None
    };
    let target = if kind == Kind::Symlink {
        match fs.readlink(ino) {
            Ok(t) => Some(t),
            Err(e) => {
                problems.push(format!("{shown}: readlink: {e}"));
                None
            }
        }
    } else {
        None
    };
    let mut xattrs = BTreeMap::new();
    if opts.xattrs {
        match fs.listxattr(ino) {
            Ok(names) => {
                for n in names {
                    match fs.getxattr(ino, &n) {
                        Ok(v) => {
                            xattrs.insert(n, v);
                        }
                        Err(e) => problems.push(format!("{shown}: getxattr {}: {e}", name_str(&n))),
                    }
                }
            }
            Err(e) => problems.push(format!("{shown}: listxattr: {e}")),
        }
    }
    Some(Entry {
        kind,
        perm: a.perm as u32,
        uid: a.uid,
        gid: a.gid,
        nlink: a.nlink as u64,
        size: a.size,
        blocks: a.blocks,
        rdev: match kind {
            Kind::Chr | Kind::Blk => split_dev32(a.rdev),
            _ => (0, 0),
        },
        atime: ts(a.atime.sec, a.atime.nsec),
        mtime: ts(a.mtime.sec, a.mtime.nsec),
        ctime: ts(a.ctime.sec, a.ctime.nsec),
        btime: Some(ts(a.crtime.sec, a.crtime.nsec)),
        content,
        target,
        xattrs,
        ino: ino as u64,
        link_group: String::new(),
    })
}

/// Snapshot the whole tree through the library API.
pub fn snapshot_lib(fs: &Fs, opts: SnapOpts) -> Snapshot {
    let mut s = Snapshot::default();
    let mut stack: Vec<(Ino, Ino, String)> = vec![(ROOT_INO, ROOT_INO, "/".to_string())];
    while let Some((ino, parent, shown)) = stack.pop() {
        let Some(e) = lib_entry(fs, ino, opts, &mut s.problems, &shown) else {
            continue;
        };
        let is_dir = e.kind == Kind::Dir;
        s.entries.insert(shown.clone(), e);
        if !is_dir {
            continue;
        }
        let ents = match fs.readdir_all(ino) {
            Ok(v) => v,
            Err(err) => {
                s.problems.push(format!("{shown}: readdir: {err}"));
                continue;
            }
        };
        let (mut dot, mut dotdot) = (0, 0);
        let mut seen = std::collections::HashSet::new();
        for de in ents {
            if de.name == b"." {
                dot += 1;
                if de.ino != ino {
                    s.problems
                        .push(format!("{shown}: '.' is inode {} not {ino}", de.ino));
                }
                continue;
            }
            if de.name == b".." {
                dotdot += 1;
                if de.ino != parent {
                    s.problems.push(format!(
                        "{shown}: '..' is inode {} not the parent {parent}",
                        de.ino
                    ));
                }
                continue;
            }
            if !seen.insert(de.name.clone()) {
                s.problems
                    .push(format!("{shown}: duplicate entry {}", name_str(&de.name)));
            }
            let child_shown = join_path(&shown, &name_str(&de.name));
            match fs.lookup(ino, &de.name) {
                Ok(a) if a.ino != de.ino => s.problems.push(format!(
                    "{child_shown}: lookup gives inode {} but readdir {}",
                    a.ino, de.ino
                )),
                Ok(a) if a.kind != de.kind => s.problems.push(format!(
                    "{child_shown}: readdir type {:?} but inode type {:?}",
                    de.kind, a.kind
                )),
                Ok(_) => {}
                Err(e) => s.problems.push(format!("{child_shown}: lookup: {e}")),
            }
            stack.push((de.ino, ino, child_shown));
        }
        if dot != 1 || dotdot != 1 {
            s.problems.push(format!(
                "{shown}: readdir gave {dot} '.' and {dotdot} '..' entries"
            ));
        }
    }
    finish_link_groups(&mut s);
    s
}

// --- comparison

/// How to compare times.
#[derive(Debug, Clone, Copy)]
pub enum TimeMode {
    /// Same on-disk image read twice: every time (atime, mtime, ctime, crtime) and
    /// block counts must be identical.
    Exact,
    /// Independent runs of the same operations: a time must either be an explicitly
    /// set value (outside the window, then equal on both sides) or "recent" (inside
    /// `[lo, hi]` seconds) on both sides. ctime and crtime must be recent.
    Recent { lo: i64, hi: i64 },
}

#[derive(Debug, Clone, Copy)]
pub struct CompareOpts {
    pub times: TimeMode,
    /// Compare directory sizes (depend on the entry layout).
    pub dir_sizes: bool,
    /// Compare atime at all (only meaningful without atime updates, e.g. noatime).
    pub atime: bool,
}

fn class(t: Ts, lo: i64, hi: i64) -> Result<(), Ts> {
    if t.0 >= lo && t.0 <= hi {
        Ok(())
    } else {
        Err(t)
    }
}

fn fmt_ts(t: Ts) -> String {
    format!("{}.{:09}", t.0, t.1)
}

fn fmt_xattrs(x: &BTreeMap<Vec<u8>, Vec<u8>>) -> String {
    let parts: Vec<String> = x
        .iter()
        .map(|(k, v)| format!("{}({}B,{:016x})", name_str(k), v.len(), content_hash_of(v)))
        .collect();
    format!("[{}]", parts.join(" "))
}

/// Field-by-field differences between two snapshots (`an`/`bn` name the sides).
pub fn compare(a: &Snapshot, an: &str, b: &Snapshot, bn: &str, o: CompareOpts) -> Vec<String> {
    let mut d = Vec::new();
    for p in &a.problems {
        d.push(format!("[{an}] {p}"));
    }
    for p in &b.problems {
        d.push(format!("[{bn}] {p}"));
    }
    for (path, x) in &a.entries {
        let Some(y) = b.entries.get(path) else {
            d.push(format!("{path}: only in {an} ({:?})", x.kind));
            continue;
        };
        let mut f = |field: &str, xs: String, ys: String| {
            if xs != ys {
                d.push(format!("{path}: {field}: {an}={xs} {bn}={ys}"));
            }
        };
        f("kind", format!("{:?}", x.kind), format!("{:?}", y.kind));
        if x.kind != y.kind {
            continue;
        }
        f("perm", format!("{:o}", x.perm), format!("{:o}", y.perm));
        f("uid", x.uid.to_string(), y.uid.to_string());
        f("gid", x.gid.to_string(), y.gid.to_string());
        f("nlink", x.nlink.to_string(), y.nlink.to_string());
        if x.kind != Kind::Dir || o.dir_sizes {
            f("size", x.size.to_string(), y.size.to_string());
        }
        f("rdev", format!("{:?}", x.rdev), format!("{:?}", y.rdev));
        f(
            "content",
            format!("{:?}", x.content.map(|h| format!("{h:016x}"))),
            format!("{:?}", y.content.map(|h| format!("{h:016x}"))),
        );
        f(
            "target",
            format!(
                "{:?}",
                x.target
                    .as_ref()
                    .map(|t| String::from_utf8_lossy(t).into_owned())
            ),
            format!(
                "{:?}",
                y.target
                    .as_ref()
                    .map(|t| String::from_utf8_lossy(t).into_owned())
            ),
        );
        f("xattrs", fmt_xattrs(&x.xattrs), fmt_xattrs(&y.xattrs));
        f("hard links", x.link_group.clone(), y.link_group.clone());
        match o.times {
            TimeMode::Exact => {
                f("blocks", x.blocks.to_string(), y.blocks.to_string());
                if o.atime {
                    f("atime", fmt_ts(x.atime), fmt_ts(y.atime));
                }
                f("mtime", fmt_ts(x.mtime), fmt_ts(y.mtime));
                f("ctime", fmt_ts(x.ctime), fmt_ts(y.ctime));
                if let (Some(xb), Some(yb)) = (x.btime, y.btime) {
                    f("crtime", fmt_ts(xb), fmt_ts(yb));
                }
            }
            TimeMode::Recent { lo, hi } => {
                let cls = |t: Ts| match class(t, lo, hi) {
                    Ok(()) => "recent".to_string(),
                    Err(t) => fmt_ts(t),
                };
                if o.atime {
                    f("atime", cls(x.atime), cls(y.atime));
                }
                f("mtime", cls(x.mtime), cls(y.mtime));
                f("ctime", cls(x.ctime), "recent".into());
                f("ctime", "recent".into(), cls(y.ctime));
                if let Some(t) = x.btime {
                    f("crtime", cls(t), "recent".into());
                }
                if let Some(t) = y.btime {
                    f("crtime", "recent".into(), cls(t));
                }
            }
        }
    }
    for (path, y) in &b.entries {
        if !a.entries.contains_key(path) {
            d.push(format!("{path}: only in {bn} ({:?})", y.kind));
        }
    }
    d
}

/// Panic with a readable list if the snapshots differ.
pub fn assert_same(a: &Snapshot, an: &str, b: &Snapshot, bn: &str, o: CompareOpts, ctx: &str) {
    let d = compare(a, an, b, bn, o);
    if !d.is_empty() {
        let shown: Vec<&String> = d.iter().take(60).collect();
        panic!(
            "{ctx}: trees differ ({} differences, {} entries in {an}, {} in {bn}):\n  {}",
            d.len(),
            a.entries.len(),
            b.entries.len(),
            shown
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
}

pub fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// The library's file-system handle for an image (read-write unless `ro`);
/// `noatime`, like the kernel mounts it is compared with.
pub fn open_lib(image: &Path, ro: bool) -> Result<Fs, FsError> {
    Fs::open_path(
        image,
        commitfs_fs::MountOptions {
            read_only: ro,
            atime: commitfs_fs::AtimeMode::Never,
            ..Default::default()
        },
    )
}

/// Resolve `/a/b` through the library, mapping errors to errno.
pub fn lib_resolve(fs: &Fs, path: &str) -> Result<Ino, i32> {
    fs.resolve(path).map_err(|e| errno_of(&e))
}
