//! Helpers for tests (also used by other crates' tests): making ext4 images with
//! the real `mkfs.ext4`, and judging them with `e2fsck -fn`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A temporary image file, deleted on drop.
pub struct TempImage {
    pub path: PathBuf,
}

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn unique_path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "commitfs-{tag}-{}-{n}-{}.img",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ))
}

/// Make an image of `size_mib` MiB with `mkfs.ext4 -q -F` plus `extra` options
/// (e.g. `["-b", "1024"]`, `["-O", "fast_commit"]`).
pub fn mkfs(tag: &str, size_mib: u64, extra: &[&str]) -> TempImage {
    let path = unique_path(tag);
    let f = std::fs::File::create(&path).expect("create image");
    f.set_len(size_mib << 20).expect("size image");
    drop(f);
    let out = Command::new("mkfs.ext4")
        .arg("-q")
        .arg("-F")
        .args(extra)
        .arg(&path)
        .output()
        .expect("run mkfs.ext4");
    assert!(
        out.status.success(),
        "mkfs.ext4 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    TempImage { path }
}

/// Outcome of `e2fsck -fn`.
#[derive(Debug)]
pub struct FsckResult {
    pub code: i32,
    pub output: String,
}

impl FsckResult {
    /// Clean means exit code 0 *and* no problem printed: e2fsck can exit 0 while
    /// reporting e.g. wrong free counts.
    pub fn is_clean(&self) -> bool {
        self.code == 0 && problem_lines(&self.output).is_empty()
    }
}

/// Lines of e2fsck output that are not the usual pass banners and summary.
pub fn problem_lines(out: &str) -> Vec<String> {
    out.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .filter(|l| {
            !(l.starts_with("Pass ")
                || l.starts_with("e2fsck ")
                || (l.contains(" files") && l.ends_with(" blocks"))
                || l.starts_with("Checking ")
                || l.starts_with("Warning: skipping journal recovery")
                || *l == "Journal checksum v3"
                || l.ends_with("is mounted.")
                || l.starts_with("Backing up journal inode block information"))
        })
        .map(str::to_owned)
        .collect()
}

/// Run `e2fsck -fn` on an image. A loop device detaches asynchronously after
/// `umount`, and e2fsck matches loop devices by inode number, so right after a
/// kernel mount (of this or of another test's image) it can wrongly report the
/// image as mounted and skip journal recovery: such runs are retried.
pub fn fsck(path: &Path) -> FsckResult {
    let mut last = None;
    for _ in 0..50 {
        let out = Command::new("e2fsck")
            .arg("-fn")
            .arg(path)
            .output()
            .expect("run e2fsck");
        let r = FsckResult {
            code: out.status.code().unwrap_or(-1),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        if !r.output.contains(" is mounted.") {
            return r;
        }
        last = Some(r);
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    last.expect("at least one e2fsck run")
}

/// Assert that `e2fsck -fn` finds nothing to report.
pub fn assert_fsck_clean(path: &Path) {
    let r = fsck(path);
    assert!(
        r.is_clean(),
        "e2fsck -fn reported problems (exit {}):\n{}",
        r.code,
        r.output
    );
}

/// Extended attributes as the kernel shows them, through the system calls (the
/// `attr` tools are not installed on a fresh machine). One home for every test
/// crate above this one; errors are errnos.
pub mod kernel_xattr {
    use std::collections::BTreeMap;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    fn cstr(b: &[u8]) -> Result<CString, i32> {
        CString::new(b).map_err(|_| libc::EINVAL)
    }

    fn errno() -> i32 {
        std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    }

    /// `lgetxattr` of `name` (up to 64 KiB, the VFS limit).
    pub fn get(p: &Path, name: &[u8]) -> Result<Vec<u8>, i32> {
        let (c, n) = (cstr(p.as_os_str().as_bytes())?, cstr(name)?);
        let mut v = vec![0u8; 65536];
        // SAFETY: NUL-terminated strings; the buffer is valid for its length.
        let r = unsafe { libc::lgetxattr(c.as_ptr(), n.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        if r < 0 {
            return Err(errno());
        }
        v.truncate(r as usize);
        Ok(v)
    }

    /// Every attribute: `llistxattr`, then `lgetxattr` of each name.
    pub fn list(p: &Path) -> Result<BTreeMap<Vec<u8>, Vec<u8>>, i32> {
        let c = cstr(p.as_os_str().as_bytes())?;
        let mut names = vec![0u8; 65536];
        // SAFETY: NUL-terminated path; the buffer is valid for its length.
        let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if n < 0 {
            return Err(errno());
        }
        names[..n as usize]
            .split(|&b| b == 0)
            .filter(|n| !n.is_empty())
            .map(|name| Ok((name.to_vec(), get(p, name)?)))
            .collect()
    }

    /// `lsetxattr` of `name` (flags 0: create or replace).
    pub fn set(p: &Path, name: &[u8], value: &[u8]) -> Result<(), i32> {
        let (c, n) = (cstr(p.as_os_str().as_bytes())?, cstr(name)?);
        // SAFETY: NUL-terminated strings; the value is valid for its length.
        let r = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                n.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if r < 0 {
            return Err(errno());
        }
        Ok(())
    }
}

/// All of a file's bytes, by its size, read through `fs`.
pub fn read_all(fs: &crate::Fs, ino: crate::Ino) -> Vec<u8> {
    let size = fs.getattr(ino).expect("getattr").size as usize;
    let mut buf = vec![0u8; size];
    let mut off = 0;
    while off < size {
        let n = fs.read(ino, off as u64, &mut buf[off..]).expect("read");
        assert!(n > 0, "short read at {off} of {size}");
        off += n;
    }
    buf
}

// ---- a device that holds one request ------------------------------------------

use commitfs_device::{BlockDevice, DeviceRef, IoCategory, IoStats, Result as DevResult};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long [`Hold::wait_holding`] and [`Hold::while_held`] wait.
pub const HOLD_TIMEOUT: Duration = Duration::from_secs(5);

/// Which request a [`Hold`] device holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HoldOn {
    MetadataRead,
    DataRead,
    Flush,
    /// A write to the fast-commit area.
    FastCommitWrite,
}

/// A device that, once armed, holds the next request of one kind until
/// released (or 2 × HOLD_TIMEOUT pass).
pub struct Hold {
    inner: DeviceRef,
    on: HoldOn,
    /// (armed, holding, released)
    st: Mutex<(bool, bool, bool)>,
    cv: Condvar,
}

impl Hold {
    pub fn new(inner: DeviceRef, on: HoldOn) -> Hold {
        Hold {
            inner,
            on,
            st: Mutex::new((false, false, false)),
            cv: Condvar::new(),
        }
    }
    /// Hold the next request of the kind.
    pub fn arm(&self) {
        // Not released: a Hold can be armed again after a release.
        *self.st.lock().unwrap() = (true, false, false);
    }
    /// Whether a request is held now.
    pub fn holding(&self) -> bool {
        self.st.lock().unwrap().1
    }
    /// Wait (at most [`HOLD_TIMEOUT`]) until a request is held.
    pub fn wait_holding(&self) -> bool {
        let deadline = Instant::now() + HOLD_TIMEOUT;
        let mut st = self.st.lock().unwrap();
        while !st.1 {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self.cv.wait_timeout(st, deadline - now).unwrap().0;
        }
        true
    }
    /// Let the held request (and any later one) through.
    pub fn release(&self) {
        self.st.lock().unwrap().2 = true;
        self.cv.notify_all();
    }
    /// Run `holder` on a thread until its next request of kind `on` is held,
    /// then `op` on another: `holder`'s result, and what `op` returned within
    /// [`HOLD_TIMEOUT`] (`None`: it did not return while the request was
    /// held). Checks that the request came, and was still held when `op`
    /// ended.
    pub fn while_held<H: Send, T: Send>(
        &self,
        holder: impl FnOnce() -> H + Send,
        op: impl FnOnce() -> T + Send,
    ) -> (H, Option<T>) {
        self.arm();
        std::thread::scope(|s| {
            let a = s.spawn(holder);
            let held = self.wait_holding();
            let (tx, rx) = std::sync::mpsc::channel();
            s.spawn(move || {
                let _ = tx.send(op());
            });
            let got = rx.recv_timeout(HOLD_TIMEOUT).ok();
            let still_held = self.holding();
            self.release();
            assert!(held, "the held request never came");
            if got.is_some() {
                assert!(still_held, "the request was released early");
            }
            (a.join().unwrap(), got)
        })
    }
    /// Called before a request of kind `on`: holds it when armed.
    fn maybe_hold(&self, on: HoldOn) {
        if on != self.on {
            return;
        }
        let mut st = self.st.lock().unwrap();
        if st.0 {
            st.0 = false;
            st.1 = true;
            self.cv.notify_all();
            let deadline = Instant::now() + 2 * HOLD_TIMEOUT;
            while !st.2 && Instant::now() < deadline {
                st = self
                    .cv
                    .wait_timeout(st, Duration::from_millis(50))
                    .unwrap()
                    .0;
            }
            st.1 = false;
        }
    }
}

impl BlockDevice for Hold {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> DevResult<()> {
        match cat {
            IoCategory::Metadata => self.maybe_hold(HoldOn::MetadataRead),
            IoCategory::Data => self.maybe_hold(HoldOn::DataRead),
            _ => {}
        }
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> DevResult<()> {
        if cat == IoCategory::FastCommit {
            self.maybe_hold(HoldOn::FastCommitWrite);
        }
        self.inner.write_at(offset, buf, cat, fua)
    }
    fn write_sectors(&self, offset: u64, buf: &[u8], cat: IoCategory) -> DevResult<()> {
        self.inner.write_sectors(offset, buf, cat)
    }
    fn flush(&self) -> DevResult<()> {
        self.maybe_hold(HoldOn::Flush);
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.inner.stats()
    }
}

/// A device that notes every metadata or data read made while `probe()`
/// says the file-system lock is held ([`crate::Fs::fs_lock_probe`]): tests that an
/// operation reads no metadata under it (ARCHITECTURE.md C.2). Only
/// meaningful while nothing else runs: the lock held by another thread
/// counts too. With `PROBE_BT` set in the environment, each such read
/// prints its backtrace (to find the caller).
pub struct LockProbe {
    inner: DeviceRef,
    probe: std::sync::OnceLock<Box<dyn Fn() -> bool + Send + Sync>>,
    /// Reads under the lock, in order: category and 4 KiB block.
    under: Mutex<Vec<(IoCategory, u64)>>,
    /// Metadata reads in all.
    reads: std::sync::atomic::AtomicU64,
}

impl LockProbe {
    pub fn new(inner: DeviceRef) -> LockProbe {
        LockProbe {
            inner,
            probe: Default::default(),
            under: Default::default(),
            reads: Default::default(),
        }
    }
    /// Start noting reads under the lock `probe` reports.
    pub fn watch(&self, probe: impl Fn() -> bool + Send + Sync + 'static) {
        let _ = self.probe.set(Box::new(probe));
    }
    /// The reads under the lock so far, and how many metadata reads there
    /// were in all; both counts start again.
    pub fn take(&self) -> (Vec<(IoCategory, u64)>, u64) {
        let under = std::mem::take(&mut *self.under.lock().unwrap());
        let n = self.reads.swap(0, std::sync::atomic::Ordering::Relaxed);
        (under, n)
    }
}

impl BlockDevice for LockProbe {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> DevResult<()> {
        if cat == IoCategory::Metadata {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if matches!(cat, IoCategory::Metadata | IoCategory::Data)
            && self.probe.get().is_some_and(|p| p())
        {
            self.under.lock().unwrap().push((cat, offset / 4096));
            if std::env::var_os("PROBE_BT").is_some() {
                eprintln!("{}", std::backtrace::Backtrace::force_capture());
            }
        }
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> DevResult<()> {
        self.inner.write_at(offset, buf, cat, fua)
    }
    fn write_sectors(&self, offset: u64, buf: &[u8], cat: IoCategory) -> DevResult<()> {
        self.inner.write_sectors(offset, buf, cat)
    }
    fn flush(&self) -> DevResult<()> {
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.inner.stats()
    }
}
