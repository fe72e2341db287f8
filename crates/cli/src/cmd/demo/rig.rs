//! What the demo sets up around the file systems: images, loop devices, kernel
//! mounts, FUSE mounts, device counters; and a guard that undoes all of it, also
//! when the demo fails half way.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use commitfs_fs::Fs;
use commitfs_fuse::{BackgroundMount, FuseConfig};

/// One thing to undo.
enum Undo {
    /// A kernel mount point.
    Umount(PathBuf),
    /// A loop device (`/dev/loopN`).
    Detach(String),
    RemoveFile(PathBuf),
    RemoveDir(PathBuf),
}

/// Undoes everything registered, newest first, on [`Guard::undo`] or on drop.
#[derive(Default)]
pub struct Guard {
    undo: Vec<Undo>,
    /// Keep files and directories (`--keep`); mounts and loop devices still go.
    pub keep: bool,
}

impl Guard {
    pub fn remove_file(&mut self, p: &Path) {
        self.undo.push(Undo::RemoveFile(p.to_path_buf()));
    }
    pub fn remove_dir(&mut self, p: &Path) {
        self.undo.push(Undo::RemoveDir(p.to_path_buf()));
    }

    /// Attach `image` to a free loop device; detached again by the guard.
    pub fn losetup(&mut self, image: &Path) -> Result<String> {
        let mut last = String::new();
        // Another process may take the device `-f` found first: retry.
        for _ in 0..20 {
            match run(Command::new("losetup").arg("-f").arg("--show").arg(image)) {
                Ok(out) if out.trim().starts_with("/dev/loop") => {
                    let dev = out.trim().to_string();
                    self.undo.push(Undo::Detach(dev.clone()));
                    return Ok(dev);
                }
                Ok(out) => last = format!("unexpected output {out:?}"),
                Err(e) => last = format!("{e:#}"),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("losetup -f --show {}: {last}", image.display())
    }

    /// Kernel mount of `dev` (ext4) on `mnt`; unmounted by [`Guard::umount`] or the guard.
    pub fn mount_kernel(&mut self, dev: &Path, mnt: &Path, opts: &str) -> Result<()> {
        run(Command::new("mount")
            .args(["-t", "ext4", "-o", opts])
            .arg(dev)
            .arg(mnt))?;
        self.undo.push(Undo::Umount(mnt.to_path_buf()));
        Ok(())
    }

    /// Unmount a kernel mount made by [`Guard::mount_kernel`] now.
    pub fn umount(&mut self, mnt: &Path) -> Result<()> {
        umount(mnt)?;
        self.undo
            .retain(|u| !matches!(u, Undo::Umount(p) if p == mnt));
        Ok(())
    }

    /// Detach a loop device made by [`Guard::losetup`] now.
    pub fn detach(&mut self, dev: &str) -> Result<()> {
        run(Command::new("losetup").arg("-d").arg(dev))?;
        self.undo
            .retain(|u| !matches!(u, Undo::Detach(d) if d == dev));
        Ok(())
    }

    fn undo_all(&mut self) {
        while let Some(u) = self.undo.pop() {
            match u {
                Undo::Umount(m) if umount(&m).is_err() => {
                    let _ = Command::new("umount").arg("-l").arg(&m).status();
                }
                Undo::Detach(d) => {
                    let _ = Command::new("losetup").arg("-d").arg(&d).status();
                }
                Undo::RemoveFile(p) if !self.keep => {
                    let _ = std::fs::remove_file(p);
                }
                Undo::RemoveDir(p) if !self.keep => {
                    let _ = std::fs::remove_dir(p);
                }
                _ => {}
            }
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.undo_all();
    }
}

fn umount(mnt: &Path) -> Result<()> {
    // A just-closed file may keep the mount busy for a moment.
    let mut last = anyhow!("not tried");
    for _ in 0..50 {
        match run(Command::new("umount").arg(mnt)) {
            Ok(_) => return Ok(()),
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(last)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// On SIGINT, SIGTERM or SIGHUP the demo stops after the current fsync and its
/// [`Guard`] undoes the mounts and loop devices; a second signal exits at once.
/// Call before any thread is started: the signals are blocked in every thread and
/// taken by one `sigwait` thread.
pub fn install_interrupt() {
    // SAFETY: sigemptyset/sigaddset fill a local set; pthread_sigmask changes this
    // thread's mask with it.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let _ = std::thread::Builder::new()
        .name("demo-signals".into())
        .spawn(move || loop {
            let mut sig = 0;
            // SAFETY: waits on a valid, initialised set.
            if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                return;
            }
            if INTERRUPTED.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
            eprintln!("demo: interrupted; cleaning up (again to exit at once)");
        });
}

/// `Err` once a termination signal arrived.
pub fn interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

/// Run a command; its stdout, or an error with its output.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}{}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether `tool` is on the PATH.
pub fn have_tool(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Why FUSE cannot be used here, if it cannot.
pub fn fuse_unavailable() -> Option<String> {
    if std::env::var_os("COMMITFS_DEMO_NO_FUSE").is_some() {
        return Some("COMMITFS_DEMO_NO_FUSE is set".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse is missing (load the fuse module)".into());
    }
    if !is_root() && !have_tool("fusermount3") {
        return Some("fusermount3 is missing (apt-get install fuse3)".into());
    }
    None
}

/// Why kernel ext4 cannot be run beside commitfs here, if it cannot.
pub fn kernel_unavailable() -> Option<String> {
    if std::env::var_os("COMMITFS_DEMO_NO_KERNEL").is_some() {
        return Some("COMMITFS_DEMO_NO_KERNEL is set".into());
    }
    if !is_root() {
        return Some("needs root for loop devices and mount".into());
    }
    for t in ["losetup", "mount", "umount"] {
        if !have_tool(t) {
            return Some(format!("{t} not found (util-linux)"));
        }
    }
    let ext4 = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !ext4.lines().any(|l| l.trim_end().ends_with("\text4")) {
        return Some("the kernel has no ext4 (/proc/filesystems)".into());
    }
    None
}

/// `mkfs.ext4` on an image file (made or resized to `mib` MiB) or a block device,
/// with everything initialised now so that no lazy-init thread writes during a
/// measurement.
pub fn mkfs(target: &Path, mib: u64, fast_commit: bool) -> Result<()> {
    let is_dev = std::fs::metadata(target)
        .map(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
        .unwrap_or(false);
    if !is_dev {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(target)
            .with_context(|| format!("creating {}", target.display()))?;
        f.set_len(mib << 20)?;
    }
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args([
        "-F",
        "-q",
        "-b",
        "4096",
        "-E",
        "lazy_itable_init=0,lazy_journal_init=0",
    ]);
    if fast_commit {
        cmd.args(["-O", "fast_commit"]);
    }
    run(cmd.arg(target))?;
    Ok(())
}

/// Block-layer counters of `/sys/block/NAME/stat` (Documentation/block/stat.rst).
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    pub writes: u64,
    pub bytes: u64,
    pub flushes: u64,
}

impl Counts {
    pub fn since(self, a: Counts) -> Counts {
        Counts {
            writes: self.writes - a.writes,
            bytes: self.bytes - a.bytes,
            flushes: self.flushes - a.flushes,
        }
    }
}

/// Counters of a loop device: writes completed, sectors written, flushes completed.
pub fn disk_counts(dev: &str) -> Result<Counts> {
    let name = dev.trim_start_matches("/dev/");
    let p = format!("/sys/block/{name}/stat");
    let s = std::fs::read_to_string(&p).with_context(|| format!("reading {p}"))?;
    let v: Vec<u64> = s
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    if v.len() < 17 {
        bail!(
            "{p} has {} fields; the flush counter needs Linux 5.5+",
            v.len()
        );
    }
    Ok(Counts {
        writes: v[4],
        bytes: v[6] * 512,
        flushes: v[15],
    })
}

/// The device crate's counters of `fs`: a FUA write counts as a flush, which is
/// what [`commitfs_device::FileDevice`] makes of it on an image file.
pub fn fs_counts(fs: &Fs) -> Counts {
    let s = fs.io_stats();
    let fua: u64 = commitfs_device::IoCategory::ALL
        .iter()
        .map(|c| s.category(*c).fua_writes)
        .sum();
    Counts {
        writes: s.total_writes(),
        bytes: s.total_write_bytes(),
        flushes: s.flushes + fua,
    }
}

/// An in-process FUSE mount of `fs` on `mnt`.
pub fn mount_fuse(fs: Arc<Fs>, mnt: &Path, name: &str) -> Result<BackgroundMount> {
    let cfg = FuseConfig {
        fsname: name.to_string(),
        ..FuseConfig::default()
    };
    let session = commitfs_fuse::mount(fs, mnt, &cfg)
        .map_err(|e| anyhow!("FUSE mount at {} failed: {e}", mnt.display()))?;
    Ok(session.spawn()?)
}

/// Why a FUSE mount fails here, if it does: mounts and unmounts a small scratch
/// image on `mnt` (e.g. `/dev/fuse` or `fusermount3` not usable by this user).
pub fn probe_fuse(dir: &Path, mnt: &Path) -> Result<std::result::Result<(), String>> {
    let img = dir.join("fuse-probe.img");
    mkfs(&img, 16, false)?;
    let r = (|| -> Result<()> {
        let fs = Arc::new(
            Fs::open_path(&img, commitfs_fs::MountOptions::default())
                .map_err(|e| anyhow!("opening {}: {e}", img.display()))?,
        );
        let m = mount_fuse(fs, mnt, "commitfs-probe")?;
        unmount_fuse(m)
    })();
    let _ = std::fs::remove_file(&img);
    Ok(r.map_err(|e| format!("{e:#}")))
}

/// Unmount a FUSE mount and write the file system home.
pub fn unmount_fuse(m: BackgroundMount) -> Result<()> {
    m.unmount().map_err(|e| anyhow!("unmount: {e}"))
}

/// The `e2fsck -fn` verdict: `Ok(())` when clean, else its problem lines.
pub fn fsck(image: &Path) -> Result<std::result::Result<(), String>> {
    let v = crate::cmd::fsck::check(image).context("running e2fsck -fn")?;
    if v.is_clean() {
        Ok(Ok(()))
    } else {
        Ok(Err(format!(
            "e2fsck -fn {} (exit {}):\n{}",
            image.display(),
            v.code,
            v.output
        )))
    }
}
