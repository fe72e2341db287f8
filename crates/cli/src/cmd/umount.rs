//! `commitfs umount DIR`: unmount and wait until the image is written home.
//!
//! A plain `umount` of a FUSE mount (type `fuse`, not `fuseblk`) returns as soon as
//! the kernel has detached it; the daemon learns of it afterwards and only then
//! writes its caches and journal home. This command finds the daemon first (the
//! process that has both `/dev/fuse` and the image open), unmounts, and waits for
//! that process to exit. A mount whose daemon has died (ENOTCONN) is detached.

use std::collections::HashSet;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use commitfs_device::inuse::unescape;
use nix::errno::Errno;
use nix::mount::MntFlags;

/// What `commitfs umount` was asked.
#[derive(Debug, Clone)]
pub struct UmountRequest {
    pub dir: PathBuf,
    /// Give up waiting for the daemon after this long.
    pub timeout: Duration,
    /// Detach now even if busy; the daemon finishes when the last user leaves
    /// (and this command waits for that too).
    pub lazy: bool,
    /// Wait for the daemon to exit (`false`: return once unmounted or detached,
    /// as `umount -l` through the helper does).
    pub wait: bool,
    /// Run as umount(8)'s helper for every FUSE mount: a mount that is not
    /// commitfs goes to `umount` with these flags (`-i...`: no helper).
    pub other_fuse: Option<String>,
}

/// The FUSE device's number (misc major 10, minor 229).
const DEV_FUSE: (u64, u64) = (10, 229);

/// One line of /proc/self/mountinfo that matters here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fstype: String,
    pub source: String,
    /// `MAJ:MIN` of the mounted device (field 3).
    pub dev: String,
}

/// Parse mountinfo text (proc(5)): field 5 is the mount point; after the " - "
/// separator come the type and the source.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|l| {
            let (a, b) = l.split_once(" - ")?;
            let mp = a.split(' ').nth(4)?;
            let dev = a.split(' ').nth(2)?;
            let mut rest = b.split(' ');
            let fstype = rest.next()?;
            let source = rest.next()?;
            Some(MountEntry {
                mount_point: PathBuf::from(unescape(mp)),
                fstype: fstype.to_string(),
                source: unescape(source),
                dev: dev.to_string(),
            })
        })
        .collect()
}

/// The topmost mount at `dir`, if any.
pub fn find_mount(dir: &Path) -> Result<Option<MountEntry>> {
    let text =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    Ok(parse_mountinfo(&text)
        .into_iter()
        .rev()
        .find(|m| m.mount_point == dir))
}

/// `dir` made absolute without touching `dir` itself (a dead FUSE mount point
/// cannot be stat'ed).
fn absolute(dir: &Path) -> Result<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(dir) {
        return Ok(p);
    }
    let abs = if dir.is_relative() {
        std::env::current_dir()?.join(dir)
    } else {
        dir.to_path_buf()
    };
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => Ok(std::fs::canonicalize(parent)
            .with_context(|| format!("{}", parent.display()))?
            .join(name)),
        _ => Ok(abs),
    }
}

/// How a file is identified among open descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileId {
    Inode(u64, u64),
    Device(u64),
}

fn file_id(m: &std::fs::Metadata) -> FileId {
    if m.file_type().is_block_device() {
        FileId::Device(m.rdev())
    } else {
        FileId::Inode(m.dev(), m.ino())
    }
}

/// A process, told apart from a later one with the same pid by its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Proc {
    pub pid: u32,
    start: u64,
}

/// Field 22 of /proc/PID/stat (start time) and whether the process is gone
/// (no such pid, or a zombie).
fn proc_start(pid: u32) -> Option<(u64, bool)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: fields follow the last ')'.
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let state = *f.first()?;
    let start = f.get(19)?.parse().ok()?;
    Some((start, state == "Z" || state == "X"))
}

impl Proc {
    fn alive(&self) -> bool {
        matches!(proc_start(self.pid), Some((s, false)) if s == self.start)
    }
}

/// Processes that have both `/dev/fuse` and `image` open: the daemon serving it.
fn daemons_of(image: &Path) -> Result<Vec<Proc>> {
    let want =
        file_id(&std::fs::metadata(image).with_context(|| format!("image {}", image.display()))?);
    let me = std::process::id();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").context("reading /proc")? {
        let Ok(e) = e else { continue };
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
            continue;
        };
        let (mut image_open, mut fuse_open) = (false, false);
        for fd in fds.flatten() {
            // stat follows the magic link to the open file itself.
            let Ok(m) = std::fs::metadata(fd.path()) else {
                continue;
            };
            if file_id(&m) == want {
                image_open = true;
            }
            if m.file_type().is_char_device()
                && (
                    nix::sys::stat::major(m.rdev()),
                    nix::sys::stat::minor(m.rdev()),
                ) == DEV_FUSE
            {
                fuse_open = true;
            }
        }
        if image_open && fuse_open {
            if let Some((start, false)) = proc_start(pid) {
                found.push(Proc { pid, start });
            }
            // A root daemon's server is the sandboxed child of a privileged monitor
            // (crates/cli/src/sandbox.rs) that exits right after it: wait for both.
            if let Some(monitor) = monitor_of(pid) {
                if let Some((start, false)) = proc_start(monitor) {
                    found.push(Proc {
                        pid: monitor,
                        start,
                    });
                }
            }
        }
    }
    Ok(found)
}

/// The parent of `pid` when it runs the same executable (the sandbox monitor).
fn monitor_of(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ppid: u32 = s
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let exe = |p: u32| std::fs::read_link(format!("/proc/{p}/exe")).ok();
    (ppid > 1 && exe(ppid).is_some() && exe(ppid) == exe(pid)).then_some(ppid)
}

/// Is `dir` a dead FUSE mount (its daemon gone: every access fails with ENOTCONN)?
fn is_dead(dir: &Path) -> bool {
    matches!(std::fs::metadata(dir), Err(e) if e.raw_os_error() == Some(libc::ENOTCONN))
}

/// Unmount `dir` (lazily if `lazy`): umount2 as root, fusermount3 otherwise.
fn unmount(dir: &Path, lazy: bool) -> Result<()> {
    let flags = if lazy {
        MntFlags::MNT_DETACH
    } else {
        MntFlags::empty()
    };
    match nix::mount::umount2(dir, flags) {
        Ok(()) => Ok(()),
        Err(Errno::EBUSY) => bail!(
            "{} is busy (a file is open there or a process's working directory is inside); \
             close them, or use `commitfs umount --lazy` to detach now and wait until they are \
             closed",
            dir.display()
        ),
        Err(Errno::EPERM) => {
            // Not root: the setuid helper may unmount the caller's own FUSE mounts.
            let out = Command::new("fusermount3")
                .arg(if lazy { "-uz" } else { "-u" })
                .arg(dir)
                .output()
                .context("running fusermount3")?;
            if out.status.success() {
                Ok(())
            } else {
                bail!(
                    "fusermount3 -u {}: {}",
                    dir.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            }
        }
        Err(e) => Err(anyhow!("unmounting {}: {e}", dir.display())),
    }
}

/// `commitfs umount`.
pub fn run(req: &UmountRequest) -> Result<()> {
    let dir = absolute(&req.dir)?;
    let Some(m) = find_mount(&dir)? else {
        bail!("{} is not a mount point", dir.display());
    };
    if let (Some(flags), true) = (&req.other_fuse, m.fstype != "fuse.commitfs") {
        let st = Command::new("umount")
            .arg(flags)
            .arg(&dir)
            .status()
            .context("running umount")?;
        if !st.success() {
            bail!("umount {flags} {}: {st}", dir.display());
        }
        return Ok(());
    }
    if m.fstype != "fuse.commitfs" {
        bail!(
            "{} is a {} mount, not commitfs: use umount",
            dir.display(),
            m.fstype
        );
    }
    let image = PathBuf::from(&m.source);
    if is_dead(&dir) {
        unmount(&dir, true)?;
        eprintln!(
            "commitfs: {}: its daemon had died; the dead mount is detached. {} was not \
             unmounted cleanly: the next `commitfs mount` recovers it from the journal (what \
             was fsynced is kept).",
            dir.display(),
            image.display()
        );
        return Ok(());
    }
    // Find the daemon before unmounting: afterwards it may already be gone.
    let daemons = if image.exists() {
        daemons_of(&image)?
    } else {
        Vec::new()
    };
    unmount(&dir, req.lazy)?;
    if !req.wait {
        return Ok(());
    }
    if daemons.is_empty() {
        bail!(
            "unmounted {}, but found no process serving {} to wait for (is the daemon in \
             another pid namespace?); check `commitfs info {}` before using the image",
            dir.display(),
            image.display(),
            image.display()
        );
    }
    wait_exit(&daemons, req.timeout, &image)
}

/// Wait until every process in `procs` has exited.
fn wait_exit(procs: &[Proc], timeout: Duration, image: &Path) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut left: HashSet<Proc> = procs.iter().copied().collect();
    loop {
        left.retain(Proc::alive);
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let pids: Vec<String> = left.iter().map(|p| p.pid.to_string()).collect();
            bail!(
                "unmounted, but the daemon (pid {}) is still writing {} home after {} s; it \
                 goes on in the background and the image is consistent once it exits (e.g. \
                 `tail --pid={} -f /dev/null`)",
                pids.join(", "),
                image.display(),
                timeout.as_secs(),
                pids[0]
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines() {
        let t = "36 35 98:0 / /mnt\\040x rw,noatime shared:1 - fuse.commitfs /img/a\\040b.img rw,user_id=0\n\
                 37 35 98:0 / /other rw - ext4 /dev/sda1 rw\n";
        let v = parse_mountinfo(t);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].mount_point, PathBuf::from("/mnt x"));
        assert_eq!(v[0].fstype, "fuse.commitfs");
        assert_eq!(v[0].source, "/img/a b.img");
        assert_eq!(v[1].fstype, "ext4");
        assert_eq!(unescape("a\\134b\\01"), "a\\b\\01");
    }

    #[test]
    fn own_process_is_alive_and_a_bad_start_time_is_not() {
        let me = std::process::id();
        let (start, gone) = proc_start(me).unwrap();
        assert!(!gone);
        assert!(Proc { pid: me, start }.alive());
        assert!(!Proc {
            pid: me,
            start: start + 1
        }
        .alive());
    }
}
