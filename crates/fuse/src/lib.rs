//! FUSE adapter over [`commitfs_fs::Fs`].
//!
//! fuser's own multi-threaded session serves the mount: `threads` event-loop
//! threads, each reading its own clone of the `/dev/fuse` descriptor
//! (`FUSE_DEV_IOC_CLONE`), call the library inline and reply. Only requests that
//! wait for durability (fsync, fsyncdir) go to a separate pool ([`pool`]), so the
//! event loops are never all parked in a commit (docs/ARCHITECTURE.md, issue #10
//! design D). Library errors become errnos only here ([`convert::errno_of`]).

pub mod convert;
mod ops;
pub mod opstats;
mod pool;
pub mod uring;

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use commitfs_fs::{Fs, FsError};
use fuser::{Config, MountOption, SessionACL};
use parking_lot::{Condvar, Mutex};

pub use convert::{errno_of, ext4_ino, fuse_ino};
pub use ops::CommitFuse;
pub use opstats::{FuseStats, Op, OpTotals};

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
    /// Event-loop threads, each on its own cloned `/dev/fuse` descriptor
    /// (`-o threads=`; `None`: [`default_threads`], or [`polling_threads`]
    /// when one loop polls, see `poll_us`).
    pub threads: Option<usize>,
    /// Threads that serve fsync/fsyncdir, which wait for a commit, and the
    /// READs the daemon's cache cannot answer, which wait for the device
    /// (`-o fsync_threads=`; default 2 × `threads`, at least 32: waiting fsyncs
    /// are what group commit batches, so many may wait at once).
    pub fsync_threads: usize,
    /// POSIX ACLs (`-o acl`, the default; `-o noacl`): the kernel checks them
    /// (FUSE_POSIX_ACL) and leaves the umask to us (FUSE_DONT_MASK), so a default
    /// ACL can replace it. Should match the `Fs`'s `MountOptions::acl`.
    pub acl: bool,
    /// Honour device nodes (`dev`, ext4's default; `-o nodev` clears it). Only a
    /// root mount can have it: fusermount3 always mounts `nodev` for others.
    pub dev: bool,
    /// Honour setuid/setgid bits on exec (`suid`, ext4's default; `-o nosuid`).
    pub suid: bool,
    /// Answer READDIRPLUS (entries with their attributes, so `ls -l` and `find`
    /// need no LOOKUP per name), the kernel choosing when (`READDIRPLUS_AUTO`);
    /// `-o noreaddirplus` turns it off.
    pub readdirplus: bool,
    /// Serve requests through FUSE over io_uring when the kernel allows it
    /// (the default; `-o noio_uring` turns it off): one ring per CPU, served
    /// on that CPU ([`uring`]). Needs the kernel's `enable_uring` module
    /// parameter; without it the mount serves `/dev/fuse`.
    pub io_uring: bool,
    /// `-o io_uring` was given: say so when the kernel does not allow it.
    pub io_uring_asked: bool,
    /// Serving `/dev/fuse` (no rings), one event loop keeps reading for this
    /// many µs after each request before it sleeps (`-o fuse_poll=US`, default
    /// [`DEFAULT_POLL_US`]; 0: every loop sleeps at once). A single-threaded
    /// client's next request then finds a loop awake instead of waking a
    /// sleeping thread, often on the other CPU; the loop yields to any other
    /// runnable thread while it waits (docs/ARCHITECTURE.md, "A polling
    /// event loop").
    pub poll_us: u64,
}

/// Default of [`FuseConfig::poll_us`] (measured: postmark, `cp -a`, fs_mark).
pub const DEFAULT_POLL_US: u64 = 500;

impl Default for FuseConfig {
    fn default() -> Self {
        FuseConfig {
            read_only: false,
            writeback_cache: false,
            allow_other: false,
            fsname: "commitfs".into(),
            threads: None,
            fsync_threads: (2 * default_threads()).max(32),
            acl: true,
            dev: true,
            suid: true,
            readdirplus: true,
            io_uring: true,
            io_uring_asked: false,
            poll_us: DEFAULT_POLL_US,
        }
    }
}

/// `min(16, ncpu)`: beyond the CPU count extra event loops only help while
/// requests block, which the fsync pool already absorbs; 16 is where the
/// benchmarks stop (issue #10's 16 threads).
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 16)
}

/// Event loops when one of them polls `/dev/fuse` and `-o threads=` was not
/// given: a quarter of the CPUs, at least one. Every request the polling
/// loop takes still wakes a loop sleeping in `read(2)` (the kernel wakes one
/// waiter per queued request), which then finds nothing: on 2 CPUs one
/// polling loop alone beat two loops everywhere measured (docs/ARCHITECTURE.md,
/// "A polling event loop"); more CPUs keep a few loops for requests that
/// wait on the device.
pub fn polling_threads() -> usize {
    (default_threads() / 4).max(1)
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
        c.n_threads = Some(self.threads.unwrap_or_else(default_threads).max(1));
        // One descriptor per event loop: replies and reads do not contend on one
        // file, and each clone keeps its own processing list in the kernel.
        // Cloning opens /dev/fuse itself: a user mount (fusermount3 opened the
        // device for us) that may not open it shares one descriptor instead.
        c.clone_fd = root || may_open_dev_fuse();
        c
    }
}

/// Can this process open `/dev/fuse` read-write (needed to clone descriptors)?
fn may_open_dev_fuse() -> bool {
    // SAFETY: access with a NUL-terminated path has no other preconditions.
    unsafe { libc::access(c"/dev/fuse".as_ptr(), libc::R_OK | libc::W_OK) == 0 }
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
    /// The step to run before serving (entering the sandbox) failed.
    Prepare(Box<dyn std::error::Error + Send + Sync>),
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Session(e) => write!(f, "FUSE session failed: {e}"),
            SessionError::Unmount(e) => write!(f, "unmount failed: {e}"),
            SessionError::Prepare(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SessionError {}

/// Outcome of `Fs::unmount` at the end of a session (set by `destroy`).
pub(crate) type UnmountStatus = Arc<Mutex<Option<commitfs_fs::Result<()>>>>;

/// Holds requests until the process is ready to serve them. A root daemon must
/// let fuser clone its `/dev/fuse` descriptors (open + ioctl, which the sandbox's
/// seccomp filter refuses) before it drops privileges, yet serve no request as
/// root: the event loops start, wait here, and are let go once the sandbox is on.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    open: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Gate {
    fn opened() -> Gate {
        Gate {
            open: AtomicBool::new(true),
            ..Gate::default()
        }
    }

    /// Wait until open (one atomic load once it is).
    #[inline]
    pub(crate) fn pass(&self) {
        if !self.open.load(Ordering::Acquire) {
            let mut g = self.lock.lock();
            while !self.open.load(Ordering::Acquire) {
                self.cv.wait(&mut g);
            }
        }
    }

    fn open(&self) {
        let _g = self.lock.lock();
        self.open.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

/// A mounted (kernel-side) FUSE session that is not yet serving requests.
pub struct FuseSession {
    session: fuser::Session<CommitFuse>,
    stats: Arc<FuseStats>,
    status: UnmountStatus,
    gate: Arc<Gate>,
    threads: usize,
}

/// Mount `fs` at `mountpoint`. When this returns the kernel has completed the FUSE
/// handshake, so the mount is usable as soon as [`FuseSession::run`] or
/// [`FuseSession::spawn`] starts serving.
pub fn mount(fs: Arc<Fs>, mountpoint: &Path, cfg: &FuseConfig) -> io::Result<FuseSession> {
    let status: UnmountStatus = Arc::new(Mutex::new(None));
    let gate = Arc::new(Gate::opened());
    let mut fsys = CommitFuse::new(fs, cfg, status.clone(), gate.clone())?;
    let stats = fsys.stats();
    let shared = fsys.shared();
    // The rings first: the capability is asked for only when they exist,
    // since once granted the kernel holds requests until every queue is
    // registered.
    let rings = if !cfg.io_uring {
        None
    } else if !uring::kernel_allows() {
        if cfg.io_uring_asked {
            tracing::warn!(
                "-o io_uring: the kernel does not allow FUSE over io_uring \
                 (/sys/module/fuse/parameters/enable_uring is not Y); serving /dev/fuse"
            );
        }
        None
    } else {
        match uring::Rings::prepare() {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!("-o io_uring: cannot set up the rings ({e}); serving /dev/fuse");
                None
            }
        }
    };
    if rings.is_some() {
        fsys.want_uring();
    }
    let granted = fsys.uring_granted.clone();
    let fcfg = cfg.fuser_config();
    let mut loops = fcfg.n_threads.unwrap_or(1);
    let mut session = fuser::Session::new(fsys, mountpoint, &fcfg)?;
    let _ = shared.notifier.set(session.notifier());
    if let Some(rings) = rings.filter(|_| granted.load(Ordering::Acquire)) {
        use std::os::fd::AsFd;
        let started = session
            .as_fd()
            .try_clone_to_owned()
            .and_then(|fd| rings.start(fd, session.raw_dispatcher(), &stats));
        if let Err(e) = started {
            // The kernel holds requests until the queues are registered:
            // nothing could be served.
            let _ = session.unmount();
            return Err(io::Error::other(format!("FUSE over io_uring: {e}")));
        }
        tracing::info!("serving through FUSE over io_uring, one ring per CPU");
    } else if cfg.poll_us > 0 && fcfg.clone_fd {
        // Serving /dev/fuse (no rings, or the kernel did not grant them):
        // the first loop polls its own clone.
        loops = cfg.threads.unwrap_or_else(polling_threads).max(1);
        stats.poll_us.store(cfg.poll_us, Ordering::Relaxed);
        session.set_poll(
            std::time::Duration::from_micros(cfg.poll_us),
            stats.poll.clone(),
            loops,
        );
    }
    Ok(FuseSession {
        session,
        stats,
        status,
        gate,
        threads: loops,
    })
}

/// Names of fuser's event-loop threads (`session.rs`: `fuser-{i}`), spawned only
/// after every descriptor was cloned.
const EVENT_LOOP_PREFIX: &str = "fuser-";

/// How many of this process's threads are fuser event loops.
fn event_loops_running() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.starts_with(EVENT_LOOP_PREFIX))
        })
        .count()
}

impl FuseSession {
    /// Per-request counters (`commitfs stats`).
    pub fn stats(&self) -> Arc<FuseStats> {
        self.stats.clone()
    }

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

    /// Serve requests, but first run `prepare` (entering the sandbox): after fuser
    /// has cloned its descriptors (it clones them all before it starts any event
    /// loop) and before any request is served ([`Gate`]). If `prepare` fails the
    /// mount is detached and the error returned; the held event loops serve
    /// nothing and end with the process.
    pub fn run_with<E>(self, prepare: impl FnOnce() -> Result<(), E>) -> Result<(), SessionError>
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let FuseSession {
            mut session,
            status,
            gate,
            threads,
            ..
        } = self;
        gate.open.store(false, Ordering::Release);
        let mut unmounter = session.unmount_callable();
        let before = event_loops_running();
        let runner = std::thread::Builder::new()
            .name("commitfs-fuse".into())
            .spawn(move || session.run())
            .map_err(SessionError::Session)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while event_loops_running() < before + threads {
            if runner.is_finished() {
                let r = runner
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("FUSE session thread panicked")));
                return finish(r, &status);
            }
            if Instant::now() > deadline {
                let _ = unmounter.unmount();
                return Err(SessionError::Session(io::Error::other(
                    "FUSE event loops did not start within 30 s",
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if let Err(e) = prepare() {
            let _ = unmounter.unmount();
            return Err(SessionError::Prepare(e.into()));
        }
        gate.open();
        let r = runner
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("FUSE session thread panicked")));
        finish(r, &status)
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
