//! FUSE adapter over [`commitfs_fs::Fs`].
//!
//! The fuser session loop reads requests from the kernel and hands each one, with
//! its reply object, to a small worker pool ([`pool`]); the worker calls the library
//! and replies. A slow request (an fsync) therefore never holds up unrelated ones.
//! Library errors become errnos only here ([`convert::errno_of`]).

pub mod convert;
mod ops;
mod pool;

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use commitfs_fs::{Fs, FsError};
use fuser::{Config, MountOption, SessionACL};
use parking_lot::Mutex;

pub use convert::{errno_of, ext4_ino, fuse_ino};
pub use ops::CommitFuse;

/// How to present the file system to the kernel.
#[derive(Debug, Clone)]
pub struct FuseConfig {
    /// Mount read-only (`-o ro`); the `Fs` should be opened read-only too.
    pub read_only: bool,
    /// Let the kernel cache writes (`-o writeback_cache`).
    pub writeback_cache: bool,
    /// Let other users in (`-o allow_other`).
    pub allow_other: bool,
    /// Shown as the mount source (`fsname=`), normally the image path.
    pub fsname: String,
    /// Worker threads serving requests.
    pub workers: usize,
    /// POSIX ACLs (`-o acl`, the default; `-o noacl`): the kernel checks them
    /// (FUSE_POSIX_ACL) and leaves the umask to us (FUSE_DONT_MASK), so a default
    /// ACL can replace it. Should match the `Fs`'s `MountOptions::acl`.
    pub acl: bool,
    /// Honour device nodes (`dev`, ext4's default; `-o nodev` clears it). Only a
    /// root mount can have it: fusermount3 always mounts `nodev` for others.
    pub dev: bool,
    /// Honour setuid/setgid bits on exec (`suid`, ext4's default; `-o nosuid`).
    pub suid: bool,
}

impl Default for FuseConfig {
    fn default() -> Self {
        FuseConfig {
            read_only: false,
            writeback_cache: false,
            allow_other: false,
            fsname: "commitfs".into(),
            workers: 4,
            acl: true,
            dev: true,
            suid: true,
        }
    }
}

impl FuseConfig {
    /// Attribute and entry cache lifetime: short, unless the kernel owns the
    /// page cache anyway (writeback cache).
    pub fn ttl(&self) -> Duration {
        if self.writeback_cache {
            Duration::from_secs(30)
        } else {
            Duration::from_secs(1)
        }
    }

    fn fuser_config(&self) -> Config {
        let mut c = Config::default();
        let mut o = vec![
            MountOption::FSName(self.fsname.clone()),
            // As a kernel option rather than `Subtype`: fuser drops `Subtype` when it
            // mounts directly (as root), and the kernel understands `subtype=` itself.
            MountOption::CUSTOM("subtype=commitfs".into()),
            MountOption::DefaultPermissions,
        ];
        o.push(if self.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        });
        // fuser mounts `nodev,nosuid` unless told otherwise; as root, mount as
        // the kernel's ext4 would (only root's mount(2) can grant them anyway).
        let root = euid_is_root();
        if self.dev && root {
            o.push(MountOption::Dev);
        }
        if self.suid && root {
            o.push(MountOption::Suid);
        }
        c.mount_options = o;
        c.acl = if self.allow_other {
            SessionACL::All
        } else {
            SessionACL::Owner
        };
        c.n_threads = Some(1);
        c
    }
}

/// Does this process run with root's effective uid?
fn euid_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Why a mount session ended badly.
#[derive(Debug)]
pub enum SessionError {
    /// The FUSE channel failed.
    Session(io::Error),
    /// The file system could not be written home at unmount.
    Unmount(FsError),
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Session(e) => write!(f, "FUSE session failed: {e}"),
            SessionError::Unmount(e) => write!(f, "unmount failed: {e}"),
        }
    }
}

impl std::error::Error for SessionError {}

/// Outcome of `Fs::unmount` at the end of a session (set by `destroy`).
pub(crate) type UnmountStatus = Arc<Mutex<Option<commitfs_fs::Result<()>>>>;

/// A mounted (kernel-side) FUSE session that is not yet serving requests.
pub struct FuseSession {
    session: fuser::Session<CommitFuse>,
    status: UnmountStatus,
}

/// Mount `fs` at `mountpoint`. When this returns the kernel has completed the FUSE
/// handshake, so the mount is usable as soon as [`FuseSession::run`] or
/// [`FuseSession::spawn`] starts serving.
pub fn mount(fs: Arc<Fs>, mountpoint: &Path, cfg: &FuseConfig) -> io::Result<FuseSession> {
    let status: UnmountStatus = Arc::new(Mutex::new(None));
    let fsys = CommitFuse::new(fs, cfg, status.clone())?;
    let session = fuser::Session::new(fsys, mountpoint, &cfg.fuser_config())?;
    Ok(FuseSession { session, status })
}

impl FuseSession {
    /// A handle that unmounts from another thread (e.g. a signal handler thread).
    pub fn unmounter(&mut self) -> fuser::SessionUnmounter {
        self.session.unmount_callable()
    }

    /// Serve requests until the file system is unmounted (`umount`,
    /// `fusermount3 -u`, or an unmounter), then write everything home.
    pub fn run(self) -> Result<(), SessionError> {
        let r = self.session.run();
        finish(r, &self.status)
    }

    /// Serve requests on a background thread.
    pub fn spawn(self) -> io::Result<BackgroundMount> {
        let status = self.status.clone();
        let bg = self.session.spawn()?;
        Ok(BackgroundMount {
            bg: Some(bg),
            status,
        })
    }
}

fn finish(r: io::Result<()>, status: &UnmountStatus) -> Result<(), SessionError> {
    let unmount = status.lock().take();
    r.map_err(SessionError::Session)?;
    match unmount {
        Some(Err(e)) => Err(SessionError::Unmount(e)),
        _ => Ok(()),
    }
}

/// A session served by a background thread; unmounted on [`BackgroundMount::unmount`]
/// or drop.
pub struct BackgroundMount {
    bg: Option<fuser::BackgroundSession>,
    status: UnmountStatus,
}

impl BackgroundMount {
    /// Unmount, wait for the session to end and for the file system to be written home.
    pub fn unmount(mut self) -> Result<(), SessionError> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<(), SessionError> {
        match self.bg.take() {
            Some(bg) => {
                let r = bg.umount_and_join();
                finish(r, &self.status)
            }
            None => Ok(()),
        }
    }
}

impl Drop for BackgroundMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            tracing::error!("{e}");
        }
    }
}
