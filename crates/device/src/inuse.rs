//! One user per image: who else uses an image file or a block device.
//!
//! Two writers of one ext4 image (two commitfs mounts, or commitfs beside the
//! kernel) silently destroy each other's work, so [`crate::FileDevice::open`]
//! refuses an image that is in use and names the other user:
//!
//! - block devices are opened with `O_EXCL` for writing, as the kernel and
//!   e2fsprogs do (the kernel then also refuses to mount them under us);
//! - image files get an OFD lock (`F_OFD_SETLK`) on the whole file for the life of
//!   the device: a write lock for read-write, a read lock for read-only opens, so
//!   read-only users can share. OFD rather than `flock`: OFD locks belong to the
//!   open file description (they survive a fork and are not dropped when some other
//!   descriptor of the file is closed, unlike classic POSIX locks), and they
//!   conflict with POSIX byte-range locks that other image users take (QEMU locks
//!   bytes of its images this way), which `flock` locks never see on Linux;
//! - and the check e2fsprogs makes (`ext2fs_check_mount_point`): mounts whose
//!   source is the image or a loop device backed by it, and loop devices backed by
//!   the image even when not mounted, since writing under a kernel mount corrupts it.

use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Another user of an image or device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OtherUser {
    /// Mounted (by the kernel, or by a FUSE file system) at `dir`; `via` is the
    /// loop device the mount uses when the image is a file.
    Mounted {
        dir: PathBuf,
        fstype: String,
        via: Option<PathBuf>,
        read_only: bool,
    },
    /// Attached to a loop device that is not mounted.
    LoopDevice { dev: PathBuf, read_only: bool },
    /// A process holding the image (its lock, or the device open exclusively);
    /// `pid` when it could be found.
    Process {
        pid: Option<u32>,
        name: Option<String>,
    },
    /// Claimed by another kernel block device (device mapper, md RAID, ...).
    Holder { name: String },
}

impl fmt::Display for OtherUser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OtherUser::Mounted {
                dir,
                fstype,
                via,
                read_only,
            } => {
                write!(f, "mounted at {} ({fstype}", dir.display())?;
                if *read_only {
                    write!(f, ", read-only")?;
                }
                if let Some(v) = via {
                    write!(f, ", through loop device {}", v.display())?;
                }
                write!(f, ")")
            }
            OtherUser::LoopDevice { dev, read_only } => write!(
                f,
                "attached to loop device {}{} (detach it with `losetup -d {}`)",
                dev.display(),
                if *read_only { " (read-only)" } else { "" },
                dev.display()
            ),
            OtherUser::Process { pid: Some(p), name } => {
                write!(f, "held by process {p}")?;
                if let Some(n) = name {
                    write!(f, " ({n})")?;
                }
                Ok(())
            }
            OtherUser::Process { pid: None, .. } => write!(f, "held by another process"),
            OtherUser::Holder { name } => write!(f, "claimed by kernel device {name}"),
        }
    }
}

/// The users, joined for an error message.
pub fn describe(users: &[OtherUser]) -> String {
    if users.is_empty() {
        return "held by another process".into();
    }
    users
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// What an open wants: writing conflicts with every other user; reading only with
/// writers (a read-write mount, a writable loop device's mount, a writer's lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Want {
    Read,
    Write,
}

/// Identity of a file: (st_dev, st_ino) for a file, st_rdev for a block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ident {
    File { dev: u64, ino: u64 },
    Block { rdev: u64 },
}

fn ident(meta: &std::fs::Metadata) -> Ident {
    if meta.file_type().is_block_device() {
        Ident::Block { rdev: meta.rdev() }
    } else {
        Ident::File {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

fn ident_of(path: &Path) -> Option<Ident> {
    std::fs::metadata(path).ok().map(|m| ident(&m))
}

/// Take the whole-file OFD lock on an image file: `Ok(true)` taken, `Ok(false)`
/// held by someone else, `Err` for other failures. File systems without lock
/// support (`ENOLCK`, `EINVAL`, `EOPNOTSUPP`) count as taken: the mount and loop
/// checks still apply there.
pub(crate) fn lock_file(file: &File, want: Want) -> std::io::Result<bool> {
    // SAFETY: an all-zero flock is a valid value; fields are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match want {
        Want::Read => libc::F_RDLCK,
        Want::Write => libc::F_WRLCK,
    } as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = 0;
    fl.l_len = 0; // to the end, however the file grows
    fl.l_pid = 0; // required for OFD locks
                  // SAFETY: F_OFD_SETLK with a valid flock on a descriptor we own.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        Some(libc::ENOLCK) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(true),
        _ => Err(e),
    }
}

/// Retry `f` for up to 200 ms while it says `false` (the lock is taken). A
/// conflicting lock with no process behind it is often a copy of a descriptor in a
/// child between fork and exec (ours, or the previous holder's): gone in moments.
pub(crate) fn retry_briefly(mut f: impl FnMut() -> std::io::Result<bool>) -> std::io::Result<bool> {
    for _ in 0..20 {
        if f()? {
            return Ok(true);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    f()
}

/// Whether a lock conflicting with `want` is held on the file (`F_OFD_GETLK`: a
/// probe that takes nothing, and works on a read-only descriptor).
pub(crate) fn lock_conflicts(file: &File, want: Want) -> std::io::Result<bool> {
    // SAFETY: an all-zero flock is a valid value; fields are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = match want {
        Want::Read => libc::F_RDLCK,
        Want::Write => libc::F_WRLCK,
    } as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: F_OFD_GETLK with a valid flock on a descriptor we own.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r == 0 {
        return Ok(fl.l_type != libc::F_UNLCK as libc::c_short);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOLCK) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(e),
    }
}

/// One `/proc/self/mounts` line.
struct MountEntry {
    source: String,
    dir: PathBuf,
    fstype: String,
    read_only: bool,
}

/// Undo the octal escapes of `/proc/mounts` and mountinfo fields (`\040` for a
/// space, `\011`, `\012`, `\134`); one home for both readers of the mount table.
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mounts() -> Vec<MountEntry> {
    let Ok(text) = std::fs::read_to_string("/proc/self/mounts") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| {
            let mut it = l.split(' ');
            let source = unescape(it.next()?);
            let dir = PathBuf::from(unescape(it.next()?));
            let fstype = unescape(it.next()?);
            let opts = it.next()?;
            Some(MountEntry {
                source,
                dir,
                fstype,
                read_only: opts.split(',').any(|o| o == "ro"),
            })
        })
        .collect()
}

/// commitfs's own FUSE mounts: the lock, not the mount table, says whether their
/// daemon still holds the image (a dead daemon's mount holds nothing).
fn is_commitfs_mount(fstype: &str) -> bool {
    fstype == "fuse.commitfs" || fstype == "fuseblk.commitfs"
}

/// Loop devices whose backing file is `id`, with their read-only flag.
fn loop_devices_backed_by(id: Ident) -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    let Ident::File { dev, ino } = id else {
        return out;
    };
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let sys = e.path();
        // Compare by device and inode: the backing path may have been renamed.
        let (Ok(bdev), Ok(bino)) = (
            std::fs::read_to_string(sys.join("loop/backing_dev")),
            std::fs::read_to_string(sys.join("loop/backing_inode")),
        ) else {
            // Older kernels: only the path.
            if let Ok(p) = std::fs::read_to_string(sys.join("loop/backing_file")) {
                if ident_of(Path::new(p.trim_end())) == Some(id) {
                    out.push((PathBuf::from("/dev").join(&name), loop_ro(&sys)));
                }
            }
            continue;
        };
        if bdev.trim().parse::<u64>().ok() == Some(dev)
            && bino.trim().parse::<u64>().ok() == Some(ino)
        {
            out.push((PathBuf::from("/dev").join(&name), loop_ro(&sys)));
        }
    }
    out.sort();
    out
}

fn loop_autoclear(dev: &Path) -> bool {
    let Some(name) = dev.file_name() else {
        return false;
    };
    std::fs::read_to_string(Path::new("/sys/block").join(name).join("loop/autoclear"))
        .is_ok_and(|s| s.trim() == "1")
}

fn loop_ro(sys: &Path) -> bool {
    std::fs::read_to_string(sys.join("ro")).is_ok_and(|s| s.trim() == "1")
}

/// Processes with `id` open that hold a lock on it (from `/proc/PID/fdinfo`, which
/// also lists OFD locks, whose `/proc/locks` pid is -1). This process counts
/// too: the descriptor that just failed to lock holds none.
fn lock_holders(id: Ident) -> Vec<OtherUser> {
    let mut out = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            ident_of(&fd.path()) == Some(id)
                && std::fs::read_to_string(p.path().join("fdinfo").join(fd.file_name()))
                    .is_ok_and(|t| t.lines().any(|l| l.starts_with("lock:")))
        });
        if holds {
            let name = std::fs::read_to_string(p.path().join("comm"))
                .ok()
                .map(|s| s.trim_end().to_string());
            out.push(OtherUser::Process {
                pid: Some(pid),
                name,
            });
        }
    }
    out
}

/// Mounts of the file or device `target` (directly, or through a loop device
/// backed by it), and loop devices backed by it that are not mounted: the
/// e2fsprogs check. commitfs FUSE mounts only when `with_commitfs` (to name the
/// mount point of a lock holder).
fn mount_users(target: Ident, with_commitfs: bool) -> Vec<OtherUser> {
    let loops = loop_devices_backed_by(target);
    let loop_ids: Vec<(Ident, &PathBuf)> = loops
        .iter()
        .filter_map(|(p, _)| ident_of(p).map(|i| (i, p)))
        .collect();
    let mut out = Vec::new();
    let mut mounted_loops = Vec::new();
    for m in mounts() {
        if !m.source.starts_with('/') || (is_commitfs_mount(&m.fstype) && !with_commitfs) {
            continue;
        }
        let Some(src) = ident_of(Path::new(&m.source)) else {
            continue;
        };
        let via = if src == target {
            None
        } else if let Some((_, p)) = loop_ids.iter().find(|(i, _)| *i == src) {
            mounted_loops.push((*p).clone());
            Some((*p).clone())
        } else {
            continue;
        };
        out.push(OtherUser::Mounted {
            dir: m.dir,
            fstype: m.fstype,
            via,
            read_only: m.read_only,
        });
    }
    for (dev, ro) in &loops {
        // Unmounted with autoclear: detached (`losetup -d` while something
        // still had it open, or the loop of an unmounted `mount -o loop`),
        // gone at its last close.
        if !mounted_loops.contains(dev) && !loop_autoclear(dev) {
            out.push(OtherUser::LoopDevice {
                dev: dev.clone(),
                read_only: *ro,
            });
        }
    }
    out
}

/// Whether `u` keeps an opener that wants `want` out: a reader shares with
/// read-only mounts and with loop devices nobody mounted.
fn conflicts(u: &OtherUser, want: Want) -> bool {
    match (want, u) {
        (Want::Write, _) => true,
        (Want::Read, OtherUser::Mounted { read_only, .. }) => !read_only,
        (Want::Read, OtherUser::LoopDevice { .. }) => false,
        (Want::Read, _) => true,
    }
}

/// Kernel holders of a block device (`/sys/dev/block/M:m/holders`).
fn block_holders(rdev: u64) -> Vec<OtherUser> {
    let (maj, min) = (libc::major(rdev), libc::minor(rdev));
    let Ok(rd) = std::fs::read_dir(format!("/sys/dev/block/{maj}:{min}/holders")) else {
        return Vec::new();
    };
    rd.flatten()
        .map(|e| OtherUser::Holder {
            name: e.file_name().to_string_lossy().into_owned(),
        })
        .collect()
}

/// Who else uses the just-opened `file`, as far as it keeps an opener that wants
/// `want` out (`lock_taken`: whether our lock on an image file, or an exclusive
/// open of a block device, succeeded).
pub(crate) fn other_users(file: &File, want: Want, lock_taken: bool) -> Vec<OtherUser> {
    let Ok(meta) = file.metadata() else {
        return Vec::new();
    };
    let id = ident(&meta);
    let unknown = || OtherUser::Process {
        pid: None,
        name: None,
    };
    match id {
        Ident::File { .. } => {
            let mut users = Vec::new();
            if !lock_taken {
                users.extend(lock_holders(id));
                // A commitfs FUSE mount shows the image as its source: name it.
                users.extend(mount_users(id, true).into_iter().filter(
                    |u| matches!(u, OtherUser::Mounted { fstype, .. } if is_commitfs_mount(fstype)),
                ));
                if users.is_empty() {
                    users.push(unknown());
                }
            }
            users.extend(
                mount_users(id, false)
                    .into_iter()
                    .filter(|u| conflicts(u, want)),
            );
            users
        }
        Ident::Block { rdev } => {
            let all = mount_users(id, !lock_taken);
            let mut users: Vec<OtherUser> =
                all.iter().filter(|u| conflicts(u, want)).cloned().collect();
            // Claimed exclusively, and by no mount: by a kernel device or a process.
            if !lock_taken && all.is_empty() {
                users.extend(block_holders(rdev));
                if users.is_empty() {
                    users.push(unknown());
                }
            }
            users
        }
    }
}

/// `"immutable"` or `"append-only"` when that inode flag keeps `path` from being
/// opened for writing (EPERM even for root).
pub(crate) fn write_blocking_attribute(path: &Path) -> Option<&'static str> {
    const FS_IMMUTABLE_FL: libc::c_int = 0x10;
    const FS_APPEND_FL: libc::c_int = 0x20;
    let f = File::open(path).ok()?;
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int (as e2fsprogs' lsattr reads it).
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
    if r != 0 {
        return None;
    }
    if flags & FS_IMMUTABLE_FL != 0 {
        Some("immutable")
    } else if flags & FS_APPEND_FL != 0 {
        Some("append-only")
    } else {
        None
    }
}
