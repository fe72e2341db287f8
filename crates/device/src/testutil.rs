//! Test helpers for block-device tests (this crate's and its integration
//! tests): an image file removed on drop, a loop device detached on drop
//! (both retried: loop devices come and go while other tests run). Need
//! root and losetup, as those tests do. Not for production use.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// A fresh path in the temporary directory, unique in this process.
pub fn unique(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "commitfs-devtest-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// An image file of `len` zero bytes, removed on drop (after clearing chattr flags).
pub struct Image(pub PathBuf);
impl Image {
    pub fn new(tag: &str, len: u64) -> Image {
        let p = unique(tag).with_extension("img");
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        Image(p)
    }
}
impl Drop for Image {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).output();
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `losetup -f --show`, detached on drop.
pub struct Loop(pub String);
impl Loop {
    pub fn attach(img: &Path, read_only: bool) -> Loop {
        for _ in 0..20 {
            let mut c = Command::new("losetup");
            if read_only {
                c.arg("-r");
            }
            let out = c.arg("-f").arg("--show").arg(img).output().unwrap();
            let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if out.status.success() && dev.starts_with("/dev/") {
                return Loop(dev);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("losetup -f --show {} failed", img.display());
    }
}
impl Drop for Loop {
    fn drop(&mut self) {
        for _ in 0..50 {
            if Command::new("losetup")
                .arg("-d")
                .arg(&self.0)
                .status()
                .is_ok_and(|s| s.success())
            {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}
