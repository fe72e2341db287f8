//! The `fuser::Filesystem` implementation: fuser's event-loop threads call the
//! library inline (names and data borrowed from the request buffer); fsync and
//! fsyncdir, which wait for a commit, are answered from the fsync pool.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use commitfs_fs::{Attr, FallocFlags, Fs, RenameFlags, SetAttr, SetTime, XattrFlags};
use fuser::{
    BsdFileFlags, CopyFileRangeFlags, Errno, FileHandle, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::convert::{ext4_ino, file_attr, fuse_ino, fuse_kind, request_timestamp, to_errno};
use crate::opstats::{FuseStats, Op};
use crate::pool::Pool;
use crate::{FuseConfig, Gate, UnmountStatus};

/// Counts a request when dropped (also when its handler panicked).
struct Count<'a>(&'a FuseStats, Op, Instant);

impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.record(self.1, self.2);
    }
}

/// Ends a deferred READ's wait in the counters when dropped (also on a panic).
struct ReadDone<'a>(&'a FuseStats);

impl Drop for ReadDone<'_> {
    fn drop(&mut self) {
        self.0.read_done();
    }
}

/// State the event loops and the fsync pool share.
pub(crate) struct Shared {
    fs: Arc<Fs>,
    stats: Arc<FuseStats>,
    ttl: Duration,
    next_fh: AtomicU64,
    /// Set once the session exists (`crate::mount`).
    pub(crate) notifier: std::sync::OnceLock<fuser::Notifier>,
}

impl Shared {
    fn fh(&self) -> FileHandle {
        FileHandle(self.next_fh.fetch_add(1, Ordering::Relaxed))
    }

    /// Tell the kernel to drop its cached attributes of files whose
    /// `st_blocks` the daemon changed on its own (write-back's extent blocks):
    /// before an fsync's reply, so a `stat` after it is exact. (A change made
    /// by a background write-back is seen when the attributes expire, within
    /// the entry lifetime, as before; listings no longer refresh them since
    /// the kernel caches them, see `opendir`.)
    fn invalidate_changed_attrs(&self) {
        let changed = self.fs.take_attr_changed();
        let Some(n) = self.notifier.get() else {
            return;
        };
        for ino in changed {
            // Offset -1: attributes only, the page cache stays.
            if let Err(e) = n.inval_inode(fuse_ino(ino), -1, 0) {
                tracing::debug!("attribute invalidation of inode {ino}: {e}");
            }
        }
    }
}

impl CommitFuse {
    /// The state shared with the request threads (the session's notifier
    /// goes in here once the session exists).
    pub(crate) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }
}

/// The FUSE file system: a thin, concurrent front end to [`Fs`].
pub struct CommitFuse {
    shared: Arc<Shared>,
    /// Serves the requests that wait for durability.
    pool: Pool<Shared>,
    gate: Arc<Gate>,
    writeback_cache: bool,
    acl: bool,
    readdirplus: bool,
    threads: usize,
    status: UnmountStatus,
    /// FUSE over io_uring: asked for (the rings exist), and granted by the
    /// kernel at INIT.
    uring_wanted: bool,
    pub(crate) uring_granted: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for CommitFuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommitFuse").finish_non_exhaustive()
    }
}

/// Bytes one copy_file_range request copies at most.
const COPY_MAX: u64 = 64 << 20;

// fallocate(2) modes (linux/falloc.h).
const FALLOC_FL_KEEP_SIZE: i32 = 0x01;
const FALLOC_FL_PUNCH_HOLE: i32 = 0x02;
const FALLOC_FL_ZERO_RANGE: i32 = 0x10;

/// Decode an inode number or answer the request with the error and return.
macro_rules! ino_or_reply {
    ($ino:expr, $reply:ident) => {
        match ext4_ino($ino) {
            Ok(i) => i,
            Err(e) => {
                $reply.error(e);
                return;
            }
        }
    };
}

fn gen(a: &Attr) -> Generation {
    Generation(a.generation as u64)
}

/// Answer an entry request. Every entry the kernel receives is a reference it
/// keeps until FORGET; it is held in the library like an open handle, so an inode
/// whose last link goes away is only freed once the kernel has forgotten it (as
/// the kernel's own ext4 keeps an unlinked inode until its last `iput`).
fn reply_entry(s: &Shared, op: &str, reply: ReplyEntry, r: commitfs_fs::Result<Attr>) {
    match r.and_then(|a| s.fs.open_inode(a.ino).map(|()| a)) {
        Ok(a) => reply.entry(&s.ttl, &file_attr(&a), gen(&a)),
        Err(e) => reply.error(to_errno(op, &e)),
    }
}

fn reply_empty(op: &str, reply: ReplyEmpty, r: commitfs_fs::Result<()>) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(to_errno(op, &e)),
    }
}

fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(t) => SetTime::At(request_timestamp(t)),
    }
}

/// Answer an xattr read: the size for a probe (`size == 0`), ERANGE when the
/// caller's buffer is too small, else the bytes.
fn reply_xattr_bytes(reply: ReplyXattr, size: u32, bytes: &[u8]) {
    if size == 0 {
        match u32::try_from(bytes.len()) {
            Ok(n) => reply.size(n),
            Err(_) => reply.error(Errno::E2BIG),
        }
    } else if bytes.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(bytes);
    }
}

impl CommitFuse {
    pub(crate) fn new(
        fs: Arc<Fs>,
        cfg: &FuseConfig,
        status: UnmountStatus,
        gate: Arc<Gate>,
    ) -> io::Result<Self> {
        // Write-back's st_blocks changes, invalidated after fsyncs.
        fs.watch_attr_changes();
        let shared = Arc::new(Shared {
            fs,
            stats: Arc::default(),
            ttl: cfg.ttl(),
            next_fh: AtomicU64::new(1),
            notifier: Default::default(),
        });
        let pool = Pool::new(shared.clone(), cfg.fsync_threads)?;
        Ok(CommitFuse {
            shared,
            pool,
            gate,
            writeback_cache: cfg.writeback_cache,
            acl: cfg.acl,
            readdirplus: cfg.readdirplus,
            threads: cfg.threads.unwrap_or_else(crate::default_threads).max(1),
            status,
            uring_wanted: false,
            uring_granted: Arc::default(),
        })
    }

    /// Ask the kernel for FUSE over io_uring at INIT (the rings are ready).
    pub(crate) fn want_uring(&mut self) {
        self.uring_wanted = true;
    }

    /// The per-request counters of this front end.
    pub fn stats(&self) -> Arc<FuseStats> {
        self.shared.stats.clone()
    }

    /// Serve a request on this event-loop thread. A panic is logged and the
    /// dropped reply answers EIO, as on the pool.
    fn run(&self, op: Op, job: impl FnOnce(&Shared)) {
        self.run_unless(op, |s| {
            job(s);
            None::<()>
        });
    }

    /// Serve a request on this event loop if `job` can (it answers and
    /// returns `None`); `Some(rest)` is what it gives back, uncounted, when
    /// the request must wait (for the device) elsewhere. A panic is logged
    /// and the dropped reply answers EIO, as in [`Self::run`].
    fn run_unless<R>(&self, op: Op, job: impl FnOnce(&Shared) -> Option<R>) -> Option<R> {
        self.gate.pass();
        let t0 = Instant::now();
        let count = Count(&self.shared.stats, op, t0);
        match catch_unwind(AssertUnwindSafe(|| job(&self.shared))) {
            Ok(Some(rest)) => {
                // Counted where it is answered.
                std::mem::forget(count);
                Some(rest)
            }
            Ok(None) => None,
            Err(_) => {
                tracing::error!("FUSE request handler panicked (answered EIO)");
                None
            }
        }
    }

    /// Serve a request that waits for durability on the fsync pool, so that the
    /// event loops keep serving while commits are in flight (with `threads`
    /// concurrent fsyncs inline, every event loop would sleep in a commit).
    fn run_durable(&self, op: Op, job: impl FnOnce(&Shared) + Send + 'static) {
        if crate::uring::in_ring_thread() {
            // FUSE over io_uring: one thread per ring entry, enough of them
            // for group commit; the entry is held until the reply anyway.
            return self.run(op, job);
        }
        self.gate.pass();
        let t0 = Instant::now();
        self.pool.submit(Box::new(move |s: &Shared| {
            let _count = Count(&s.stats, op, t0);
            job(s)
        }));
    }
}

impl Filesystem for CommitFuse {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        if self.writeback_cache {
            if let Err(missing) = config.add_capabilities(InitFlags::FUSE_WRITEBACK_CACHE) {
                tracing::warn!(
                    "kernel lacks writeback cache support ({missing:?}); continuing without it"
                );
            }
        }
        if self.acl {
            // The kernel checks ACLs (with default_permissions) and caches them;
            // it passes the umask unapplied so a default ACL can take its place.
            let want = InitFlags::FUSE_POSIX_ACL | InitFlags::FUSE_DONT_MASK;
            if let Err(missing) = config.add_capabilities(want) {
                tracing::warn!(
                    "kernel lacks POSIX ACL support ({missing:?}); ACLs are stored but not enforced"
                );
            }
        }
        if self.readdirplus {
            let want = InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO;
            if let Err(missing) = config.add_capabilities(want) {
                tracing::warn!("kernel lacks readdirplus ({missing:?})");
            }
        }
        // The daemon clears setuid/setgid itself on write, truncate, fallocate
        // and chown (Fs::write_by, setattr_by; the caller's CAP_FSETID from
        // /proc). With this the kernel stops asking for `security.capability`
        // (a GETXATTR) before every write: it sets SB_NOSEC, so an inode
        // without setuid/setgid bits is checked once, and it no longer sends
        // the cleared mode with a chown.
        if let Err(missing) = config.add_capabilities(InitFlags::FUSE_HANDLE_KILLPRIV_V2) {
            tracing::warn!("kernel lacks FUSE_HANDLE_KILLPRIV_V2 ({missing:?})");
        }
        // Lookups and readdirs in one directory may run in parallel (without it
        // the kernel holds the directory's i_rwsem exclusively across each).
        if let Err(missing) = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS) {
            tracing::warn!("kernel lacks parallel directory operations ({missing:?})");
        }
        // Background requests (readahead, writeback-cache writes, async direct
        // I/O) may use every event loop; the kernel's default is 12 (fuser: 16).
        let bg = u16::try_from(self.threads.max(16)).unwrap_or(u16::MAX);
        let _ = config.set_max_background(bg);
        let _ = config.set_congestion_threshold(bg);
        if self.uring_wanted {
            // Ring entries hold a whole request: no larger than a request
            // can be anyway (max_pages), and the buffers are sized for it
            // (`uring::PAYLOAD`; fuser derives max_pages from both).
            let _ = config.set_max_write(crate::uring::MAX_WRITE);
            let _ = config.set_max_readahead(crate::uring::MAX_WRITE);
            match config.add_capabilities(InitFlags::FUSE_OVER_IO_URING) {
                Ok(()) => self
                    .uring_granted
                    .store(true, std::sync::atomic::Ordering::Release),
                Err(missing) => tracing::warn!(
                    "kernel does not offer FUSE over io_uring ({missing:?}); serving /dev/fuse"
                ),
            }
        }
        tracing::info!("FUSE session initialised");
        Ok(())
    }

    fn destroy(&mut self) {
        // The event loops have ended; finish queued fsyncs before writing
        // everything home.
        self.pool.shutdown();
        let r = self.shared.fs.unmount();
        match &r {
            Ok(()) => tracing::info!("file system unmounted cleanly"),
            Err(e) => tracing::error!("unmount failed: {e}"),
        }
        *self.status.lock() = Some(r);
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let parent = ino_or_reply!(parent, reply);
        let name = name.as_bytes();
        self.run(Op::Lookup, move |s| match s.fs.lookup(parent, name) {
            // A negative entry: the kernel caches the name's absence for the
            // entry lifetime. Every change reaches the image through this mount
            // (one user per image), and the kernel turns the cached negative
            // entry positive itself when a create or rename makes the name.
            Err(commitfs_fs::FsError::NotFound) => {
                reply.entry(&s.ttl, &crate::convert::negative_attr(), Generation(0))
            }
            r => reply_entry(s, "lookup", reply, r),
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        // Drop the references taken in `reply_entry` (and `create`).
        let Ok(ino) = ext4_ino(ino) else {
            return;
        };
        self.run(Op::Forget, move |s| {
            for _ in 0..nlookup.min(u32::MAX as u64) {
                if let Err(e) = s.fs.release(ino) {
                    tracing::error!("forget of inode {ino}: {e}");
                    break;
                }
            }
        });
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let ino = ino_or_reply!(ino, reply);
        self.run(Op::Getattr, move |s| match s.fs.getattr(ino) {
            Ok(a) => reply.attr(&s.ttl, &file_attr(&a)),
            Err(e) => reply.error(to_errno("getattr", &e)),
        });
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let ino = ino_or_reply!(ino, reply);
        let set = SetAttr {
            mode: mode.map(|m| (m & 0o7777) as u16),
            uid,
            gid,
            size,
            atime: atime.map(set_time),
            mtime: mtime.map(set_time),
            ctime: ctime.map(request_timestamp),
            crtime: crtime.map(request_timestamp),
        };
        let (uid, gid, pid) = (req.uid(), req.gid(), req.pid());
        self.run(Op::Setattr, move |s| {
            // A truncate (incl. open with O_TRUNC) clears privileges as a write does.
            let caller = move || crate::convert::caller_of(uid, gid, pid);
            let r = if set == SetAttr::default() {
                s.fs.getattr(ino)
            } else {
                s.fs.setattr_by(ino, &set, Some(&caller))
            };
            match r {
                Ok(a) => reply.attr(&s.ttl, &file_attr(&a)),
                Err(e) => reply.error(to_errno("setattr", &e)),
            }
        });
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let ino = ino_or_reply!(ino, reply);
        self.run(Op::Readlink, move |s| match s.fs.readlink(ino) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(to_errno("readlink", &e)),
        });
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let parent = ino_or_reply!(parent, reply);
        let name = name.as_bytes();
        let (uid, gid) = (req.uid(), req.gid());
        // The library applies the umask unless the directory has a default ACL.
        let (mode, umask) = (mode as u16, (umask & 0o777) as u16);
        self.run(Op::Mknod, move |s| {
            let r = s.fs.mknod_umask(parent, name, mode, umask, rdev, uid, gid);
            reply_entry(s, "mknod", reply, r)
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let parent = ino_or_reply!(parent, reply);
        let name = name.as_bytes();
        let (uid, gid) = (req.uid(), req.gid());
        let (perm, umask) = ((mode & 0o7777) as u16, (umask & 0o777) as u16);
        self.run(Op::Mkdir, move |s| {
            let r = s.fs.mkdir_umask(parent, name, perm, umask, uid, gid);
            reply_entry(s, "mkdir", reply, r)
        });
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let parent = ino_or_reply!(parent, reply);
        let name = name.as_bytes();
        self.run(Op::Unlink, move |s| {
            reply_empty("unlink", reply, s.fs.unlink(parent, name))
        });
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let parent = ino_or_reply!(parent, reply);
        let name = name.as_bytes();
        self.run(Op::Rmdir, move |s| {
            reply_empty("rmdir", reply, s.fs.rmdir(parent, name))
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let parent = ino_or_reply!(parent, reply);
        let name = link_name.as_bytes();
        let target = target.as_os_str().as_bytes();
        let (uid, gid) = (req.uid(), req.gid());
        self.run(Op::Symlink, move |s| {
            let r = s.fs.symlink(parent, name, target, uid, gid);
            reply_entry(s, "symlink", reply, r)
        });
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let parent = ino_or_reply!(parent, reply);
        let newparent = ino_or_reply!(newparent, reply);
        let known = fuser::RenameFlags::RENAME_NOREPLACE | fuser::RenameFlags::RENAME_EXCHANGE;
        if !known.contains(flags) {
            // RENAME_WHITEOUT (overlayfs) and unknown bits.
            reply.error(Errno::EINVAL);
            return;
        }
        let rf = RenameFlags {
            noreplace: flags.contains(fuser::RenameFlags::RENAME_NOREPLACE),
            exchange: flags.contains(fuser::RenameFlags::RENAME_EXCHANGE),
        };
        let name = name.as_bytes();
        let newname = newname.as_bytes();
        self.run(Op::Rename, move |s| {
            let r = s.fs.rename(parent, name, newparent, newname, rf);
            reply_empty("rename", reply, r)
        });
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let ino = ino_or_reply!(ino, reply);
        let newparent = ino_or_reply!(newparent, reply);
        let newname = newname.as_bytes();
        self.run(Op::Link, move |s| {
            let r = s.fs.link(ino, newparent, newname);
            reply_entry(s, "link", reply, r)
        });
    }

    /// Zero-message opens (the kernel's `no_open`): the first OPEN is answered
    /// ENOSYS and the kernel then opens files without asking, with
    /// FOPEN_KEEP_CACHE, and closes them without RELEASE (nor FLUSH, see
    /// [`Self::flush`]). Nothing is kept per handle (reads and writes name the
    /// inode), and an open file's inode stays alive through the kernel's lookup
    /// count alone: the kernel cannot forget an inode it has open, so an
    /// unlinked open file is freed at the FORGET after its last close. Saves
    /// two requests per open of an existing file (postmark: 50,000 of 212,000).
    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.error(Errno::ENOSYS);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let ino = ino_or_reply!(ino, reply);
        // Page-aligned: a large read from the device goes straight into it
        // (O_DIRECT), with no bounce buffer and no second copy.
        let mut buf = commitfs_fs::AlignedBuf::new(size as usize);
        // What the daemon's cache holds is answered on this loop; the rest
        // may wait for the device and goes to the pool, so that the loop
        // keeps serving and readahead's concurrent reads reach the device
        // together (one polling loop serialised them: sequential reads at
        // half the kernel's MiB/s).
        let miss = self.run_unless(Op::Read, |s| {
            match s.fs.read_if_cached(ino, offset, &mut buf) {
                Ok(Some(n)) => reply.data(&buf[..n.min(buf.len())]),
                Ok(None) => return Some((reply, buf)),
                Err(e) => reply.error(to_errno("read", &e)),
            }
            None
        });
        if let Some((reply, mut buf)) = miss {
            if !crate::uring::in_ring_thread() {
                // (A ring thread serves it itself, below.)
                self.shared.stats.read_deferred();
            }
            let in_pool = !crate::uring::in_ring_thread();
            self.run_durable(Op::Read, move |s| {
                let _done = in_pool.then_some(ReadDone(&s.stats));
                match s.fs.read(ino, offset, &mut buf) {
                    Ok(n) => reply.data(&buf[..n.min(buf.len())]),
                    Err(e) => reply.error(to_errno("read", &e)),
                }
            });
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let ino = ino_or_reply!(ino, reply);
        // Under FUSE_HANDLE_KILLPRIV_V2 the whole setuid/setgid rule is ours
        // (`Caller`): the kernel sends no SETATTR before the write, only the
        // FUSE_WRITE_KILL_SUIDGID hint, which the caller's lookup replaces.
        let (uid, gid, pid) = (req.uid(), req.gid(), req.pid());
        self.run(Op::Write, move |s| {
            let caller = move || crate::convert::caller_of(uid, gid, pid);
            match s.fs.write_by(ino, offset, data, Some(&caller)) {
                Ok(n) => reply.written(n as u32),
                Err(e) => reply.error(to_errno("write", &e)),
            }
        });
    }

    /// Only SEEK_DATA and SEEK_HOLE reach the file system (the kernel answers
    /// the others itself).
    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let ino = ino_or_reply!(ino, reply);
        let data = match whence {
            libc::SEEK_DATA => true,
            libc::SEEK_HOLE => false,
            _ => return reply.error(Errno::EINVAL),
        };
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(Errno::ENXIO);
        };
        self.run(Op::Lseek, move |s| {
            match s.fs.seek_data_hole(ino, offset, data) {
                Ok(o) => reply.offset(o as i64),
                Err(e) => reply.error(to_errno("lseek", &e)),
            }
        });
    }

    /// A plain copy in the daemon: one request instead of a read and a write
    /// per 128 KiB through the kernel. At most [`COPY_MAX`] per request (the
    /// reply's count is 32 bits; callers loop on a short count).
    #[allow(clippy::too_many_arguments)]
    fn copy_file_range(
        &self,
        req: &Request,
        ino_in: INodeNo,
        _fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        _fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let src = ino_or_reply!(ino_in, reply);
        let dst = ino_or_reply!(ino_out, reply);
        let (uid, gid, pid) = (req.uid(), req.gid(), req.pid());
        self.run(Op::CopyFileRange, move |s| {
            let caller = move || crate::convert::caller_of(uid, gid, pid);
            let len = len.min(COPY_MAX);
            match s
                .fs
                .copy_file_range(src, offset_in, dst, offset_out, len, Some(&caller))
            {
                Ok(n) => reply.written(n as u32),
                Err(e) => reply.error(to_errno("copy_file_range", &e)),
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing is buffered per handle: ENOSYS makes the kernel stop sending
        // FLUSH (`no_flush`), which zero-message opens would otherwise bring
        // back at every close (their open flags cannot say FOPEN_NOFLUSH).
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Handles hold no reference (see `open`), and with CREATE answered
        // ENOSYS every open is a zero-message one: the kernel sends no RELEASE.
        // Answered for a kernel that does anyway.
        let _ = ino;
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let ino = ino_or_reply!(ino, reply);
        self.run_durable(Op::Fsync, move |s| {
            let r = s.fs.fsync(ino, datasync);
            s.invalidate_changed_attrs();
            reply_empty("fsync", reply, r)
        });
    }

    /// Zero-message directory opens (`no_opendir`, as [`Self::open`]): no
    /// OPENDIR or RELEASEDIR per `opendir(3)`, and the kernel caches listings
    /// (FOPEN_CACHE_DIR, dropped when the directory changes through this
    /// mount, the only way it can change). dbench: 242,000 of 1,000,000
    /// requests. Not under `strictatime`: a listing the kernel answers from
    /// its cache never reaches the daemon, so it could not update atime
    /// (under relatime only the once-a-day update of an unchanged directory
    /// listed again while cached is missed; noatime and nodiratime lose nothing).
    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let o = self.shared.fs.options();
        if o.atime != commitfs_fs::AtimeMode::Strict || o.nodiratime {
            return reply.error(Errno::ENOSYS);
        }
        let ino = ino_or_reply!(ino, reply);
        self.run(Op::Opendir, move |s| match s.fs.getattr(ino) {
            Ok(a) if a.kind == commitfs_fs::FileType::Directory => {
                reply.opened(s.fh(), FopenFlags::empty())
            }
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(to_errno("opendir", &e)),
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let ino = ino_or_reply!(ino, reply);
        self.run(Op::Readdir, move |s| {
            let r = s.fs.readdir(ino, offset, |e| {
                let name = OsStr::from_bytes(&e.name);
                // `add` answers true when the buffer is full (entry not added).
                !reply.add(fuse_ino(e.ino), e.next_offset, fuse_kind(e.kind), name)
            });
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(to_errno("readdir", &e)),
            }
        });
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let ino = ino_or_reply!(ino, reply);
        self.run(Op::Readdirplus, move |s| {
            let r = s.fs.readdir_plus(ino, offset, |e, a| {
                let name = OsStr::from_bytes(&e.name);
                // `add` answers true when the buffer is full (entry not added).
                !reply.add(
                    fuse_ino(e.ino),
                    e.next_offset,
                    name,
                    &s.ttl,
                    &file_attr(a),
                    gen(a),
                )
            });
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(to_errno("readdirplus", &e)),
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.run(Op::Releasedir, move |_| reply.ok());
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let ino = ino_or_reply!(ino, reply);
        self.run_durable(Op::Fsyncdir, move |s| {
            let r = s.fs.fsyncdir(ino);
            s.invalidate_changed_attrs();
            reply_empty("fsyncdir", reply, r)
        });
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.run(Op::Statfs, move |s| match s.fs.statfs() {
            Ok(st) => reply.statfs(
                st.blocks,
                st.blocks_free,
                st.blocks_avail,
                st.files,
                st.files_free,
                st.block_size,
                st.name_max,
                st.block_size,
            ),
            Err(e) => reply.error(to_errno("statfs", &e)),
        });
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let ino = ino_or_reply!(ino, reply);
        if flags & !(libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
            reply.error(Errno::EINVAL);
            return;
        }
        let xf = XattrFlags {
            create: flags & libc::XATTR_CREATE != 0,
            replace: flags & libc::XATTR_REPLACE != 0,
        };
        let name = name.as_bytes();
        let (uid, gid, pid) = (req.uid(), req.gid(), req.pid());
        self.run(Op::Setxattr, move |s| {
            let r = if name == b"system.posix_acl_access" {
                // fuser cannot receive FUSE_SETXATTR_ACL_KILL_SGID (it needs
                // FUSE_SETXATTR_EXT), so decide as the kernel would
                // (`in_group_or_capable`); /proc is read only for setgid files.
                s.fs.getattr(ino).and_then(|a| {
                    let kill = a.perm & 0o2000 != 0 && {
                        let c = crate::convert::caller_of(uid, gid, pid);
                        !(c.cap_fsetid || c.in_group(a.gid))
                    };
                    s.fs.setxattr_ext(ino, name, value, xf, kill)
                })
            } else {
                s.fs.setxattr(ino, name, value, xf)
            };
            reply_empty("setxattr", reply, r)
        });
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let ino = ino_or_reply!(ino, reply);
        let name = name.as_bytes();
        self.run(Op::Getxattr, move |s| match s.fs.getxattr(ino, name) {
            Ok(v) => reply_xattr_bytes(reply, size, &v),
            Err(e) => reply.error(to_errno("getxattr", &e)),
        });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let ino = ino_or_reply!(ino, reply);
        self.run(Op::Listxattr, move |s| match s.fs.listxattr(ino) {
            Ok(names) => {
                let mut buf = Vec::with_capacity(names.iter().map(|n| n.len() + 1).sum());
                for n in names {
                    buf.extend_from_slice(&n);
                    buf.push(0);
                }
                reply_xattr_bytes(reply, size, &buf)
            }
            Err(e) => reply.error(to_errno("listxattr", &e)),
        });
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let ino = ino_or_reply!(ino, reply);
        let name = name.as_bytes();
        self.run(Op::Removexattr, move |s| {
            reply_empty("removexattr", reply, s.fs.removexattr(ino, name))
        });
    }

    /// Answered ENOSYS (the kernel's `no_create`, set at the first answer):
    /// the kernel then creates regular files with MKNOD and opens them without
    /// a message (see [`Self::open`]), so a created file costs one request
    /// instead of CREATE and, at its close, RELEASE (which zero-message opens
    /// drop only once an OPEN has been answered, and a copy into an empty
    /// mount never opens). `O_CREAT|O_EXCL` stays exclusive (the kernel looks
    /// the name up under the directory's lock), and the creator may write
    /// through a descriptor whose mode forbids it, as POSIX asks
    /// (`FMODE_CREATED` survives the split).
    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let ino = ino_or_reply!(ino, reply);
        let keep = FALLOC_FL_KEEP_SIZE;
        let flags = match mode {
            0 => FallocFlags::default(),
            m if m == keep => FallocFlags {
                keep_size: true,
                ..Default::default()
            },
            m if m == FALLOC_FL_PUNCH_HOLE | keep => FallocFlags {
                keep_size: true,
                punch_hole: true,
                ..Default::default()
            },
            m if m == FALLOC_FL_ZERO_RANGE || m == FALLOC_FL_ZERO_RANGE | keep => FallocFlags {
                keep_size: m & keep != 0,
                zero_range: true,
                ..Default::default()
            },
            _ => {
                reply.error(Errno::EOPNOTSUPP);
                return;
            }
        };
        let (uid, gid, pid) = (req.uid(), req.gid(), req.pid());
        self.run(Op::Fallocate, move |s| {
            let caller = move || crate::convert::caller_of(uid, gid, pid);
            let r = s.fs.fallocate_by(ino, offset, length, flags, Some(&caller));
            reply_empty("fallocate", reply, r)
        });
    }

    /// No ioctls are supported. Programs probe them routinely (`lsattr`, terminal
    /// checks such as TCGETS), so this is a quiet ENOTTY ("not for this file"),
    /// not fuser's default warning per call.
    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        tracing::debug!("ioctl {cmd:#x} on inode {ino:?}: not supported");
        reply.error(Errno::ENOTTY);
    }
}
