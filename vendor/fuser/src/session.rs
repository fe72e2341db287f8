//! Filesystem session
//!
//! A session runs a filesystem implementation while it is being mounted to a specific mount
//! point. A session begins by mounting the filesystem and ends by unmounting it. While the
//! filesystem is mounted, the session loop receives, dispatches and replies to kernel requests
//! for filesystem operations under its mount point.

use std::borrow::Cow;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::fd::BorrowedFd;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::thread::{self};

use log::debug;
use log::error;
use log::info;
use log::warn;
use nix::unistd::Uid;
use nix::unistd::geteuid;
use parking_lot::Mutex;

use crate::Errno;
use crate::Filesystem;
use crate::KernelConfig;
use crate::MountOption;
use crate::ReplyEmpty;
use crate::Request;
use crate::channel::Channel;
use crate::channel::ChannelSender;
use crate::dev_fuse::DevFuse;
use crate::ll;
use crate::ll::Operation;
use crate::ll::ResponseErrno;
use crate::ll::Version;
use crate::ll::flags::init_flags::InitFlags;
use crate::ll::fuse_abi as abi;
use crate::mnt::Mount;
use crate::mnt::mount_options::Config;
use crate::mnt::mount_options::check_option_conflicts;
use crate::notify::Notifier;
use crate::read_buf::FuseReadBuf;
use crate::reply::Reply;
use crate::reply::ReplyRaw;
use crate::reply::ReplySender;
use crate::request::RequestWithSender;

/// The max size of write requests from the kernel. The absolute minimum is 4k,
/// FUSE recommends at least 128k, max 16M. The FUSE default is 16M on macOS
/// and 128k on other systems.
pub(crate) const MAX_WRITE_SIZE: usize = 16 * 1024 * 1024;

#[derive(Default, Debug, Eq, PartialEq, Clone, Copy)]
/// How requests should be filtered based on the calling UID.
pub enum SessionACL {
    /// Allow requests from any user. Corresponds to the `allow_other` mount option.
    All,
    /// Allow requests from root. Corresponds to the `allow_root` mount option.
    RootAndOwner,
    /// Allow requests from the owning UID. This is FUSE's default mode of operation.
    #[default]
    Owner,
}

impl SessionACL {
    /// Returns the mount option string for kernel/fusermount/libfuse paths.
    /// Both `All` and `RootAndOwner` map to `allow_other` - the kernel only
    /// understands `allow_other`, and fuser enforces the root-only restriction internally.
    #[allow(dead_code)]
    pub(crate) fn to_mount_option(self) -> Option<&'static str> {
        match self {
            SessionACL::All | SessionACL::RootAndOwner => Some("allow_other"),
            SessionACL::Owner => None,
        }
    }
}

/// Calls `destroy` on drop.
#[derive(Debug)]
pub(crate) struct FilesystemHolder<FS: Filesystem> {
    pub(crate) fs: Option<FS>,
}

impl<FS: Filesystem> FilesystemHolder<FS> {
    fn destroy(&mut self) {
        if let Some(mut fs) = self.fs.take() {
            fs.destroy();
        }
    }
}

impl<FS: Filesystem> Drop for FilesystemHolder<FS> {
    fn drop(&mut self) {
        self.destroy();
    }
}

#[derive(Debug)]
struct UmountOnDrop {
    mount: Arc<Mutex<Option<Mount>>>,
}

impl UmountOnDrop {
    fn umount(&self) -> io::Result<()> {
        if let Some(mount) = self.mount.lock().take() {
            mount.umount()?;
        }
        Ok(())
    }
}

impl Drop for UmountOnDrop {
    fn drop(&mut self) {
        if let Err(e) = self.umount() {
            warn!("Failed to umount filesystem: {}", e);
        }
    }
}

/// The session data structure
#[derive(Debug)]
pub struct Session<FS: Filesystem> {
    /// Filesystem operation implementations. None after `destroy` called.
    pub(crate) filesystem: FilesystemHolder<FS>,
    /// Communication channel to the kernel driver
    pub(crate) ch: Channel,
    /// Handle to the mount.  Dropping this unmounts.
    mount: UmountOnDrop,
    /// Whether to restrict access to owner, root + owner, or unrestricted
    /// Used to implement `allow_root` and `auto_unmount`
    pub(crate) allowed: SessionACL,
    /// User that launched the fuser process
    pub(crate) session_owner: Uid,
    /// FUSE protocol version, as reported by the kernel.
    /// The field is set to `Some` when the init message is received.
    pub(crate) proto_version: Option<Version>,
    pub(crate) config: Config,
    /// commitfs: the file system, shared with [`RawDispatcher`]s.
    pub(crate) shared_fs: Option<Arc<FilesystemHolder<FS>>>,
    /// commitfs: see [`Session::set_poll`].
    pub(crate) poll: Option<(std::time::Duration, Arc<PollCounters>)>,
}

/// commitfs: how the polling event loop found its requests.
#[derive(Debug, Default)]
pub struct PollCounters {
    /// Requests read while polling (no sleep in the kernel before them).
    pub polled: std::sync::atomic::AtomicU64,
    /// Times the loop stopped polling and slept until a request came.
    pub slept: std::sync::atomic::AtomicU64,
    /// Event loops polling (0 until the loop starts, or if its descriptor
    /// could not be made non-blocking).
    pub loops: std::sync::atomic::AtomicU64,
    /// Requests the relief loop served while the polling loop was held by
    /// one request (see [`Relief`]).
    pub relieved: std::sync::atomic::AtomicU64,
    /// Times the relief loop found the polling loop held and took over.
    pub reliefs: std::sync::atomic::AtomicU64,
}

/// commitfs: when the polling loop is the only event loop, a second loop
/// stands by without reading `/dev/fuse` (a loop blocked in read(2) is woken
/// by the kernel for requests the polling loop then takes, which measured
/// slower). Every [`RELIEF_TICK`] while the polling loop is awake, it looks
/// whether that loop has been inside one request for [`RELIEF_AFTER`] or
/// more (a write that writes back, a cold metadata read, a long truncate)
/// and if so serves the queue itself until that request ends: other
/// clients wait milliseconds, not for the whole request.
#[derive(Debug)]
pub(crate) struct Relief {
    epoch: std::time::Instant,
    /// Nanoseconds since `epoch` + 1 at which the polling loop started its
    /// current request; 0 while it is between requests.
    busy_since: std::sync::atomic::AtomicU64,
    /// The polling loop sleeps in `ppoll` (nothing to do).
    sleeping: std::sync::atomic::AtomicBool,
    /// The relief loop is parked until the polling loop wakes.
    parked: std::sync::atomic::AtomicBool,
    stop: std::sync::atomic::AtomicBool,
    thread: std::sync::OnceLock<thread::Thread>,
}

/// Stops the relief loop when dropped.
struct ReliefEnds<'a>(Option<&'a Relief>);

impl Drop for ReliefEnds<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.0 {
            r.finish();
        }
    }
}

/// How often the relief loop looks at the polling loop (measured, loop
/// device, 2 CPUs: a 1 ms tick cost postmark about 5%, 2 ms nothing
/// measurable; a client's stat during a 3 GiB write waited at most 5.7 ms,
/// 644 ms without relief).
const RELIEF_TICK: std::time::Duration = std::time::Duration::from_millis(2);
/// How long one request may hold the polling loop before relief serves.
const RELIEF_AFTER: std::time::Duration = std::time::Duration::from_millis(2);

impl Relief {
    fn new() -> Relief {
        Relief {
            epoch: std::time::Instant::now(),
            busy_since: Default::default(),
            sleeping: Default::default(),
            parked: Default::default(),
            stop: Default::default(),
            thread: Default::default(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64 + 1
    }

    fn begin(&self) {
        self.busy_since
            .store(self.now(), std::sync::atomic::Ordering::SeqCst);
    }

    fn end(&self) {
        self.busy_since
            .store(0, std::sync::atomic::Ordering::SeqCst);
    }

    /// The polling loop goes to sleep (`true`) or woke up.
    pub(crate) fn set_sleeping(&self, sleeping: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        self.sleeping.store(sleeping, SeqCst);
        if !sleeping && self.parked.load(SeqCst) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    fn finish(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

impl<FS: Filesystem> AsFd for Session<FS> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ch.as_fd()
    }
}

impl<FS: Filesystem> Session<FS> {
    /// Create a new session by mounting the given filesystem to the given mountpoint
    /// # Errors
    /// Returns an error if the options are incorrect, or if the fuse device can't be mounted.
    pub fn new<P: AsRef<Path>>(
        filesystem: FS,
        mountpoint: P,
        options: &Config,
    ) -> io::Result<Session<FS>> {
        check_option_conflicts(options)?;

        let mountpoint = mountpoint.as_ref();
        info!("Mounting {}", mountpoint.display());
        // If AutoUnmount is requested, but not AllowRoot or AllowOther, return an error
        // because fusermount needs allow_root or allow_other to handle the auto_unmount option
        if options.mount_options.contains(&MountOption::AutoUnmount)
            && options.acl == SessionACL::Owner
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("auto_unmount requires acl != Owner, got: {:?}", options.acl),
            ));
        }
        let (file, mount) = Mount::new(mountpoint, &options.mount_options, options.acl)?;

        let ch = Channel::new(file);

        let mut session = Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(Some(mount))),
            },
            allowed: options.acl,
            session_owner: geteuid(),
            proto_version: None,
            config: options.clone(),
            shared_fs: None,
            poll: None,
        };

        session.handshake()?;

        Ok(session)
    }

    /// Wrap an existing /dev/fuse file descriptor. This doesn't mount the
    /// filesystem anywhere; that must be done separately.
    pub fn from_fd(
        filesystem: FS,
        fd: OwnedFd,
        acl: SessionACL,
        config: Config,
    ) -> io::Result<Self> {
        let ch = Channel::new(Arc::new(DevFuse(File::from(fd))));
        let mut session = Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(None)),
            },
            allowed: acl,
            session_owner: geteuid(),
            proto_version: None,
            config,
            shared_fs: None,
            poll: None,
        };

        session.handshake()?;

        Ok(session)
    }

    /// Run the session loop in a background thread. If the returned handle is dropped,
    /// the filesystem is unmounted and the given session ends.
    pub fn spawn(self) -> io::Result<BackgroundSession> {
        let sender = self.ch.sender();
        // Take the fuse_session, so that we can unmount it
        let mount = std::mem::take(&mut *self.mount.mount.lock());
        let guard = thread::Builder::new()
            .name("fuser-bg".to_string())
            .spawn(move || self.run())?;
        Ok(BackgroundSession {
            guard,
            sender,
            mount,
        })
    }

    /// Run the session loop that receives kernel requests and dispatches them to method
    /// calls into the filesystem. This read-dispatch-loop is non-concurrent to prevent
    /// having multiple buffers (which take up much memory), but the filesystem methods
    /// may run concurrent by spawning threads.
    /// # Errors
    /// Returns any final error when the session comes to an end.
    pub fn run(self) -> io::Result<()> {
        let Session {
            filesystem,
            ch,
            mount: _do_not_umount_yet,
            allowed,
            session_owner,
            proto_version: _,
            config,
            shared_fs,
            poll,
        } = self;

        let n_threads = config.n_threads.unwrap_or(1);

        if !cfg!(target_os = "linux") && n_threads != 1 {
            // TODO: check whether it works on macOS/FreeBSD and enable if it works.
            return Err(io::Error::other(
                "n_threads != 1 is only supported on Linux",
            ));
        }

        let Some(n_threads_minus_one) = n_threads.checked_sub(1) else {
            return Err(io::Error::other("n_threads"));
        };

        let mut filesystem = match shared_fs {
            Some(a) => a,
            None => Arc::new(filesystem),
        };

        let mut channels = Vec::with_capacity(n_threads);

        for _ in 0..n_threads_minus_one {
            if config.clone_fd {
                #[cfg(target_os = "linux")]
                {
                    channels.push(ch.clone_fd()?);
                    continue;
                }
                #[cfg(not(target_os = "linux"))]
                {
                    return Err(io::Error::other("clone_fd is only supported on Linux"));
                }
            } else {
                channels.push(ch.clone());
            }
        }
        // commitfs: the first loop may poll its own (cloned) descriptor for a
        // while after each request instead of sleeping at once (`set_poll`);
        // a single loop polls a clone too, the session's descriptor staying
        // as it is (replies, notifications).
        let spin = poll.filter(|(b, _)| !b.is_zero() && config.clone_fd);
        #[cfg(target_os = "linux")]
        let _session_ch = if spin.is_some() && n_threads == 1 {
            channels.push(ch.clone_fd()?);
            Some(ch)
        } else {
            channels.push(ch);
            None
        };
        #[cfg(not(target_os = "linux"))]
        channels.push(ch);

        // commitfs: a lone polling loop gets a relief loop (`Relief`).
        #[cfg(target_os = "linux")]
        let relief = match (&spin, &_session_ch) {
            (Some(_), Some(session_ch)) => Some((Arc::new(Relief::new()), session_ch.clone_fd()?)),
            _ => None,
        };
        #[cfg(not(target_os = "linux"))]
        let relief: Option<(Arc<Relief>, Channel)> = None;

        let mut threads = Vec::with_capacity(n_threads + 1);
        for (i, ch) in channels.into_iter().enumerate() {
            let thread_name = format!("fuser-{i}");
            let event_loop = SessionEventLoop {
                thread_name: thread_name.clone(),
                filesystem: filesystem.clone(),
                ch,
                allowed,
                session_owner,
                spin: if i == 0 { spin.clone() } else { None },
                relief: if i == 0 {
                    relief.as_ref().map(|r| r.0.clone())
                } else {
                    None
                },
            };
            threads.push(
                thread::Builder::new()
                    .name(thread_name)
                    .spawn(move || event_loop.event_loop())?,
            );
        }
        if let Some((relief, ch)) = relief {
            let counters = spin.as_ref().map(|s| s.1.clone()).unwrap_or_default();
            let event_loop = SessionEventLoop {
                thread_name: "fuser-relief".to_string(),
                filesystem: filesystem.clone(),
                ch,
                allowed,
                session_owner,
                spin: None,
                relief: None,
            };
            let spawned = thread::Builder::new()
                .name("fuser-relief".to_string())
                .spawn({
                    let relief = relief.clone();
                    move || event_loop.relief_loop(&relief, &counters)
                });
            match spawned {
                Ok(handle) => threads.push(handle),
                // The polling loop already serves: go on without relief.
                Err(e) => {
                    warn!("no relief loop for the polling event loop: {e}");
                    relief.finish();
                }
            }
        }

        let mut reply: io::Result<()> = Ok(());
        for thread in threads {
            let res = match thread.join() {
                Ok(res) => res,
                Err(_) => {
                    return Err(io::Error::other("event loop thread panicked"));
                }
            };
            if let Err(e) = res {
                if reply.is_ok() {
                    reply = Err(e);
                }
            }
        }

        // commitfs: raw dispatchers (io_uring queues) end with the
        // connection; give them a moment to drop their references.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while Arc::strong_count(&filesystem) > 1 && std::time::Instant::now() < deadline {
            thread::sleep(std::time::Duration::from_millis(1));
        }
        let Some(filesystem) = Arc::get_mut(&mut filesystem) else {
            return Err(io::Error::other(
                "BUG: must have one refcount for filesystem",
            ));
        };

        filesystem.destroy();

        reply
    }

    fn handshake(&mut self) -> io::Result<()> {
        let mut buf = FuseReadBuf::new();
        let buf = buf.as_mut();

        loop {
            // Read the init request from the kernel
            let size = match self.ch.receive_retrying(buf) {
                Ok(size) => size,
                Err(nix::errno::Errno::ENODEV) => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        "FUSE device disconnected during handshake",
                    ));
                }
                Err(err) => return Err(err.into()),
            };

            // Parse the request
            let request = match ll::AnyRequest::try_from(&buf[..size]) {
                Ok(request) => request,
                Err(err) => {
                    error!("{err}");
                    return Err(io::Error::new(io::ErrorKind::InvalidData, err.to_string()));
                }
            };

            // Extract the init operation
            let op = match request.operation() {
                Ok(op) => op,
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "Failed to parse FUSE operation",
                    ));
                }
            };

            let init = match op {
                ll::Operation::Init(init) => init,
                _ => {
                    error!("Received non-init FUSE operation before init: {}", request);
                    // Send error response and return error - non-init during handshake is invalid
                    <ReplyRaw as Reply>::new(
                        request.unique(),
                        ReplySender::Channel(self.ch.sender()),
                    )
                    .send_ll(&ResponseErrno(ll::Errno::EIO));
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "Received non-init FUSE operation during handshake",
                    ));
                }
            };

            let v = init.version();
            if v.0 > abi::FUSE_KERNEL_VERSION {
                // Kernel has a newer major version than we support.
                // Send our version and wait for a second INIT request with a compatible version.
                debug!(
                    "INIT: Kernel version {} > our version {}, sending our version and waiting for next init",
                    v.0,
                    abi::FUSE_KERNEL_VERSION
                );
                let response = init.reply_version_only();
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&response);
                continue;
            }

            // We don't support ABI versions before 7.6
            if v < Version(7, 6) {
                error!("Unsupported FUSE ABI version {v}");
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&ResponseErrno(ll::Errno::EPROTO));
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("Unsupported FUSE ABI version {v}"),
                ));
            }

            let mut config = KernelConfig::new(init.capabilities(), init.max_readahead(), v);

            // Call filesystem init method and give it a chance to return an error
            let Some(filesystem) = &mut self.filesystem.fs else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "Bug: filesystem must be initialized during handshake",
                ));
            };
            let res = filesystem.init(Request::ref_cast(request.header()), &mut config);
            if let Err(error) = res {
                let errno = Errno::from_i32(error.raw_os_error().unwrap_or(0));
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&ResponseErrno(errno));
                return Err(error);
            }

            // Remember the ABI version supported by kernel and mark the session initialized.
            self.proto_version = Some(v);

            // Log capability status for debugging
            for bit in 0..64 {
                let bitflags = InitFlags::from_bits_retain(1 << bit);
                if bitflags == InitFlags::FUSE_INIT_EXT {
                    continue;
                }
                let bitflag_is_known = InitFlags::all().contains(bitflags);
                let kernel_supports = init.capabilities().contains(bitflags);
                let we_requested = config.requested.contains(bitflags);
                // On macOS, there's a clash between linux and macOS constants,
                // so we pick macOS ones (last).
                let name = if let Some((name, _)) = bitflags.iter_names().last() {
                    Cow::Borrowed(name)
                } else {
                    Cow::Owned(format!("(1 << {bit})"))
                };
                if we_requested && kernel_supports {
                    debug!("capability {name} enabled")
                } else if we_requested {
                    debug!("capability {name} not supported by kernel")
                } else if kernel_supports {
                    debug!("capability {name} not requested by client")
                } else if bitflag_is_known {
                    debug!("capability {name} not supported nor requested")
                }
            }

            // Reply with our desired version and settings.
            debug!(
                "INIT response: ABI {}.{}, flags {:#x}, max readahead {}, max write {}",
                abi::FUSE_KERNEL_VERSION,
                abi::FUSE_KERNEL_MINOR_VERSION,
                init.capabilities() & config.requested,
                config.max_readahead,
                config.max_write
            );

            let response = init.reply(&config);
            <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                .send_ll(&response);

            return Ok(());
        }
    }

    /// Unmount the filesystem
    pub fn unmount(&mut self) -> io::Result<()> {
        self.mount.umount()
    }

    /// Returns a thread-safe object that can be used to unmount the Filesystem
    pub fn unmount_callable(&mut self) -> SessionUnmounter {
        SessionUnmounter {
            mount: self.mount.mount.clone(),
        }
    }

    /// Returns an object that can be used to send notifications to the kernel
    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.ch.sender())
    }

    /// commitfs: the first event loop reads its own cloned descriptor without
    /// blocking for up to `budget` after each request (yielding the CPU to
    /// any other runnable thread between reads), then sleeps in `ppoll`
    /// until a request is queued. A client that sends its next request
    /// within the budget finds a loop awake: no wake-up of a sleeping
    /// thread on the way in. Needs cloned descriptors (`clone_fd`; ignored
    /// otherwise); the other loops block as before. `loops` replaces the
    /// configured number of event loops.
    pub fn set_poll(
        &mut self,
        budget: std::time::Duration,
        counters: Arc<PollCounters>,
        loops: usize,
    ) {
        self.poll = Some((budget, counters));
        self.config.n_threads = Some(loops.max(1));
    }

    /// commitfs: a dispatcher for requests that arrive other than by read(2)
    /// on this session's descriptor (FUSE over io_uring). Call after the
    /// handshake ([`Session::new`]) and before [`Session::run`]; every
    /// dispatcher must be dropped for `run` to call `destroy`.
    pub fn raw_dispatcher(&mut self) -> RawDispatcher<FS> {
        let fs = match &self.shared_fs {
            Some(a) => a.clone(),
            None => {
                let holder = std::mem::replace(&mut self.filesystem, FilesystemHolder { fs: None });
                let a = Arc::new(holder);
                self.shared_fs = Some(a.clone());
                a
            }
        };
        RawDispatcher {
            el: SessionEventLoop {
                thread_name: "raw".to_string(),
                ch: self.ch.clone(),
                filesystem: fs,
                allowed: self.allowed,
                session_owner: self.session_owner,
                spin: None,
                relief: None,
            },
        }
    }
}

/// commitfs: dispatches one request given as bytes in /dev/fuse layout
/// (`fuse_in_header` then the arguments), replying through a sink.
pub struct RawDispatcher<FS: Filesystem> {
    el: SessionEventLoop<FS>,
}

impl<FS: Filesystem> std::fmt::Debug for RawDispatcher<FS> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RawDispatcher")
    }
}

impl<FS: Filesystem> RawDispatcher<FS> {
    /// Dispatch `data` (one whole request); the reply goes to `sink`, from
    /// this thread or, for requests the file system answers later, another.
    /// Returns `false` when `data` is not a request.
    pub fn dispatch(&self, data: &[u8], sink: crate::reply::ReplySink) -> bool {
        match RequestWithSender::new(self.el.ch.sender(), data) {
            Some(req) => {
                let req = req.with_sink(sink);
                if let Ok(Operation::Destroy(_)) = req.request.operation() {
                    req.reply::<ReplyEmpty>().ok();
                } else {
                    req.dispatch(&self.el);
                }
                true
            }
            None => false,
        }
    }
}

#[derive(Debug)]
/// A thread-safe object that can be used to unmount a Filesystem
pub struct SessionUnmounter {
    mount: Arc<Mutex<Option<Mount>>>,
}

impl SessionUnmounter {
    /// Unmount the filesystem
    pub fn unmount(&mut self) -> io::Result<()> {
        if let Some(mount) = std::mem::take(&mut *self.mount.lock()) {
            mount.umount()?;
        }
        Ok(())
    }
}

pub(crate) struct SessionEventLoop<FS: Filesystem> {
    /// Cache thread name for faster `debug!`.
    pub(crate) thread_name: String,
    pub(crate) ch: Channel,
    pub(crate) filesystem: Arc<FilesystemHolder<FS>>,
    pub(crate) allowed: SessionACL,
    pub(crate) session_owner: Uid,
    /// commitfs: poll this loop's own descriptor for up to this long after
    /// each request before sleeping in the kernel (`Session::set_poll`).
    pub(crate) spin: Option<(std::time::Duration, Arc<PollCounters>)>,
    /// commitfs: the relief loop standing by for this (polling) loop.
    pub(crate) relief: Option<Arc<Relief>>,
}

impl<FS: Filesystem> SessionEventLoop<FS> {
    fn event_loop(&self) -> io::Result<()> {
        // Buffer for receiving requests from the kernel. Only one is allocated and
        // it is reused immediately after dispatching to conserve memory and allocations.
        let mut buf = FuseReadBuf::new();
        let buf = buf.as_mut();
        let spin = self
            .spin
            .as_ref()
            .filter(|_| self.ch.set_nonblocking().is_ok());
        if let Some((_, counters)) = spin {
            counters
                .loops
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // The relief loop ends with this loop, however it ends (a panic
        // included), and is not needed by a loop that cannot poll.
        let _relief_ends = ReliefEnds(self.relief.as_deref());
        if spin.is_none() {
            if let Some(r) = &self.relief {
                r.finish();
            }
        }
        loop {
            // Read the next request from the given channel to kernel driver
            // The kernel driver makes sure that we get exactly one request per read
            let got = match spin {
                Some((budget, counters)) => {
                    self.ch
                        .receive_spinning(buf, *budget, counters, self.relief.as_deref())
                }
                None => self.ch.receive_retrying(buf),
            };
            let served = match got {
                Ok(size) => self.serve(&buf[..size]),
                Err(nix::errno::Errno::ENODEV) => Ok(false),
                Err(err) => Err(err.into()),
            };
            match served {
                Ok(true) => {}
                done => return done.map(|_| ()),
            }
        }
    }

    /// Dispatch one request read from the kernel; `Ok(false)` after DESTROY
    /// (this loop ends).
    fn serve(&self, buf: &[u8]) -> io::Result<bool> {
        match RequestWithSender::new(self.ch.sender(), buf) {
            Some(req) => {
                if let Ok(Operation::Destroy(_)) = req.request.operation() {
                    req.reply::<ReplyEmpty>().ok();
                    Ok(false)
                } else {
                    if let Some(r) = &self.relief {
                        r.begin();
                    }
                    req.dispatch(self);
                    if let Some(r) = &self.relief {
                        r.end();
                    }
                    Ok(true)
                }
            }
            // Quit loop on illegal request
            None => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "Invalid request",
            )),
        }
    }

    /// commitfs: the relief loop ([`Relief`]): reads its own descriptor
    /// only while the polling loop is held by one request.
    fn relief_loop(&self, relief: &Relief, counters: &PollCounters) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering::{Relaxed, SeqCst};
        let _ = relief.thread.set(thread::current());
        self.ch.set_nonblocking()?;
        let mut buf = FuseReadBuf::new();
        let buf = buf.as_mut();
        let stuck_after = RELIEF_AFTER.as_nanos() as u64;
        loop {
            if relief.stop.load(SeqCst) {
                return Ok(());
            }
            if relief.sleeping.load(SeqCst) {
                // Nothing to do until the polling loop wakes; it unparks us
                // (the timeout only bounds a missed wake-up).
                relief.parked.store(true, SeqCst);
                if relief.sleeping.load(SeqCst) && !relief.stop.load(SeqCst) {
                    thread::park_timeout(std::time::Duration::from_millis(100));
                }
                relief.parked.store(false, SeqCst);
                continue;
            }
            thread::sleep(RELIEF_TICK);
            let since = relief.busy_since.load(SeqCst);
            if since == 0 || relief.now().saturating_sub(since) < stuck_after {
                continue;
            }
            counters.reliefs.fetch_add(1, Relaxed);
            // Serve whatever is queued until that request ends.
            while relief.busy_since.load(SeqCst) == since && !relief.stop.load(SeqCst) {
                match self.ch.receive(buf) {
                    Ok(size) => {
                        counters.relieved.fetch_add(1, Relaxed);
                        if !self.serve(&buf[..size])? {
                            return Ok(());
                        }
                    }
                    Err(nix::errno::Errno::EAGAIN) => {
                        let mut pfd = libc::pollfd {
                            fd: self.ch.as_fd().as_raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        let ts = libc::timespec {
                            tv_sec: 0,
                            tv_nsec: RELIEF_TICK.as_nanos() as libc::c_long,
                        };
                        // SAFETY: one valid pollfd, a valid timeout, no signal mask.
                        unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
                    }
                    Err(nix::errno::Errno::ENOENT | nix::errno::Errno::EINTR) => {}
                    Err(nix::errno::Errno::ENODEV) => return Ok(()),
                    Err(err) => return Err(err.into()),
                }
            }
        }
    }
}

/// The background session data structure
#[derive(Debug)]
pub struct BackgroundSession {
    /// Thread guard of the background session
    pub guard: JoinHandle<io::Result<()>>,
    /// Object for creating Notifiers for client use
    sender: ChannelSender,
    /// Ensures the filesystem is unmounted when the session ends
    mount: Option<Mount>,
}

impl BackgroundSession {
    /// Unmount the filesystem and join the background thread.
    pub fn umount_and_join(mut self) -> io::Result<()> {
        if let Some(mount) = self.mount.take() {
            mount.umount()?;
        }
        self.join()
    }

    /// Returns an object that can be used to send notifications to the kernel
    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.sender.clone())
    }

    /// Join the filesystem thread.
    pub fn join(self) -> io::Result<()> {
        self.guard
            .join()
            .map_err(|_panic: Box<dyn std::any::Any + Send>| {
                io::Error::new(
                    io::ErrorKind::Other,
                    "filesystem background thread panicked",
                )
            })?
    }
}
