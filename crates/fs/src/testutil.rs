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
