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
