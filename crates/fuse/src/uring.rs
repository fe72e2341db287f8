//! FUSE over io_uring (Linux ≥ 6.14, `CONFIG_FUSE_IO_URING`, module parameter
//! `enable_uring`): one queue per possible CPU, each a ring served by a thread
//! pinned to that CPU. The kernel puts a request issued on CPU c into a free
//! entry of queue c, so the thread that serves it runs where the requester
//! just went to sleep: a direct switch instead of a wake-up of another CPU,
//! which on a 2-CPU machine made every round trip about three times dearer
//! (docs/ARCHITECTURE.md, "Measured: a FUSE round trip costs three times more
//! across CPUs", and "Implemented: FUSE over io_uring").
//!
//! Protocol (kernel `fs/fuse/dev_uring.c`, uapi `fuse.h` 7.42): every entry is
//! a header buffer (`fuse_uring_req_header`, 288 bytes: `in_out[128]` with the
//! `fuse_in_header` or on reply the `fuse_out_header`, `op_in[128]` with the
//! operation's header argument, `fuse_uring_ent_in_out`) and a payload buffer
//! (the other arguments; on reply every reply argument). REGISTER arms an
//! entry; its completion carries a request; COMMIT_AND_FETCH sends the reply
//! and re-arms it. The ring needs 128-byte SQEs. FORGET, INTERRUPT and
//! notifications stay on `/dev/fuse` (fuser's event loops keep serving it).
//!
//! Requests are rebuilt into the `/dev/fuse` layout and dispatched through
//! fuser's [`fuser::RawDispatcher`] (vendored fuser, vendor/fuser/COMMITFS.md),
//! so every operation is served by the same code as before; the reply goes
//! back through a sink that writes the entry's buffers and commits. Only the
//! queue's own thread submits (the kernel copies the next request into an
//! entry in the context of the thread that submitted its commit, so a commit
//! submitted by an fsync-pool thread would wake that thread, on any CPU, for
//! every later request of the entry): a reply from another thread queues its
//! commit and rings the queue's doorbell, an eventfd whose read is always
//! armed on the ring. The ring may operate only on its two registered files
//! (`/dev/fuse`, the doorbell) and only with FUSE commands and reads, since
//! io_uring operations bypass the daemon's seccomp filter. Ownership of an
//! entry's buffers: the kernel's while armed, the queue thread's from its
//! completion until the request is copied out, the reply's until it is
//! committed.

use std::cell::UnsafeCell;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use io_uring::{cqueue, opcode, register::Restriction, squeue, types, IoUring};
use parking_lot::Mutex;

use crate::CommitFuse;

/// `sizeof(struct fuse_uring_req_header)`.
const HDR_SZ: usize = 288;
/// Offsets in the header buffer.
const OP_IN: usize = 128;
const ENT_IN_OUT: usize = 256;
/// `sizeof(struct fuse_in_header)` / `fuse_out_header`.
const IN_HDR: usize = 40;
const OUT_HDR: usize = 16;
/// `enum fuse_uring_cmd`.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `user_data` of the doorbell's read.
const DOORBELL: u64 = u64::MAX;
/// Registered files: `/dev/fuse`, the doorbell.
const FILE_FUSE: u32 = 0;
const FILE_DOORBELL: u32 = 1;
/// `io_uring_enter` flag: wait for completions.
const IORING_ENTER_GETEVENTS: u32 = 1;
/// Serving threads over all CPUs together, at least: each has its own ring
/// with one entry, so a request only ever goes to an idle thread of its CPU
/// (with several entries per thread, a request could wait behind one that
/// blocks). Requests that wait for durability (fsync) are served inline and
/// hold their thread, and group commit needs many of them in the daemon at
/// once (16 writer threads, say, which the kernel does not spread evenly over
/// the CPUs).
/// Each holds a payload buffer of [`MAX_WRITE`] (touched only as far as its
/// largest request), so this also bounds the rings' memory: 32 MiB.
const THREADS_TOTAL: usize = 32;
/// Serving threads per CPU at least.
const THREADS_MIN: usize = 4;

thread_local! {
    /// Set in ring threads: requests that wait for durability are served
    /// inline there ([`in_ring_thread`]).
    static RING_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread serves a ring (then a request waiting for a
/// commit is served inline: its entry is held either way, and a reply from
/// another thread would cost a doorbell).
pub(crate) fn in_ring_thread() -> bool {
    RING_THREAD.with(|c| c.get())
}
/// The largest write the mount negotiates when the rings are on (a request's
/// data is bounded by `max_pages` anyway); the payload buffers are sized from
/// it and from `max_pages_limit`.
pub(crate) const MAX_WRITE: u32 = 1 << 20;

/// Whether the kernel lets FUSE servers use io_uring (root sets
/// `/sys/module/fuse/parameters/enable_uring`).
pub fn kernel_allows() -> bool {
    std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|s| s.trim() == "Y")
}

/// Queues the kernel expects: one per possible CPU (`num_possible_cpus`).
fn possible_cpus() -> io::Result<usize> {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let mut max = 0usize;
    for part in s.trim().split(',') {
        let hi = part.rsplit('-').next().unwrap_or(part);
        let n: usize = hi
            .parse()
            .map_err(|_| io::Error::other(format!("cpu/possible: {s:?}")))?;
        max = max.max(n + 1);
    }
    Ok(max.max(1))
}

/// The payload buffer the kernel requires, `max(8192, max_write, max_pages ×
/// page)`: [`MAX_WRITE`], since with the rings on INIT negotiates `max_write`
/// and `max_readahead` (from which fuser derives `max_pages`) no larger.
const PAYLOAD: usize = MAX_WRITE as usize;

/// One ring entry's buffers.
struct Slot {
    hdr: UnsafeCell<Box<[u8]>>,
    payload: UnsafeCell<Box<[u8]>>,
    iov: UnsafeCell<[libc::iovec; 2]>,
    /// A request reached it at least once (an `EAGAIN` then concerns a
    /// commit, not the registration).
    fetched: AtomicBool,
}

/// One queue: its ring, its entries, the CPU it serves.
struct Queue {
    qid: u16,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// The doorbell (eventfd) and the buffer its armed read fills.
    doorbell: OwnedFd,
    bell_buf: UnsafeCell<u64>,
    /// Serialises submissions (the SQ has one producer at a time).
    sq: Mutex<()>,
    slots: Vec<Slot>,
    stats: Arc<crate::FuseStats>,
    /// The queue's serving thread: its commits are submitted by its next
    /// wait, in the same system call (the requester is woken as the server
    /// goes to sleep, so the scheduler keeps both on this CPU).
    thread: std::sync::OnceLock<std::thread::ThreadId>,
}

// SAFETY: the slots' cells are accessed by one owner at a time (module doc);
// the ring's SQ under `sq`, its CQ by the queue thread only.
unsafe impl Sync for Queue {}
unsafe impl Send for Queue {}

impl Queue {
    fn new(qid: u16, payload: usize, depth: usize) -> io::Result<Queue> {
        // Enabled by `start`, once its files are registered and restricted.
        let ring: IoUring<squeue::Entry128, cqueue::Entry> = IoUring::builder()
            .setup_r_disabled()
            .build((2 * (depth + 2)) as u32)?;
        // SAFETY: plain eventfd(2).
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let doorbell = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(efd) };
        let slots = (0..depth)
            .map(|_| Slot {
                hdr: UnsafeCell::new(vec![0u8; HDR_SZ].into_boxed_slice()),
                payload: UnsafeCell::new(vec![0u8; payload].into_boxed_slice()),
                iov: UnsafeCell::new(
                    [libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    }; 2],
                ),
                fetched: AtomicBool::new(false),
            })
            .collect::<Vec<_>>();
        for s in &slots {
            // SAFETY: not shared yet.
            unsafe {
                let h = &mut *s.hdr.get();
                let p = &mut *s.payload.get();
                *s.iov.get() = [
                    libc::iovec {
                        iov_base: h.as_mut_ptr().cast(),
                        iov_len: h.len(),
                    },
                    libc::iovec {
                        iov_base: p.as_mut_ptr().cast(),
                        iov_len: p.len(),
                    },
                ];
            }
        }
        Ok(Queue {
            qid,
            ring,
            doorbell,
            bell_buf: UnsafeCell::new(0),
            sq: Mutex::new(()),
            slots,
            stats: Arc::default(),
            thread: std::sync::OnceLock::new(),
        })
    }

    /// The SQE of `cmd` for entry `idx`.
    fn sqe(&self, idx: usize, cmd: u32, commit_id: u64) -> squeue::Entry128 {
        let mut area = [0u8; 80];
        // struct fuse_uring_cmd_req { u64 flags; u64 commit_id; u16 qid; u8 pad[6]; }
        area[8..16].copy_from_slice(&commit_id.to_ne_bytes());
        area[16..18].copy_from_slice(&self.qid.to_ne_bytes());
        let e = opcode::UringCmd80::new(types::Fixed(FILE_FUSE), cmd)
            .cmd(area)
            .addr(Some(self.slots[idx].iov.get() as u64))
            .build()
            .user_data(idx as u64);
        // The kernel wants `len` = 2 (iovecs: header, payload), which the
        // builder has no setter for: byte 24 of the SQE (`struct io_uring_sqe`).
        // SAFETY: `Entry128` is `repr(C)`, 128 bytes (an `io_uring_sqe` and
        // its 64-byte extension).
        let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
        raw[24..28].copy_from_slice(&2u32.to_ne_bytes());
        // SAFETY: as above.
        unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
    }

    fn submit(&self, e: squeue::Entry128) -> io::Result<()> {
        let _g = self.sq.lock();
        // SAFETY: one producer at a time (`sq`); the entry's buffers outlive
        // the ring (both belong to `self`).
        unsafe {
            let mut sq = self.ring.submission_shared();
            sq.push(&e)
                .map_err(|_| io::Error::other("FUSE ring: submission queue full"))?;
        }
        drop(_g);
        if self.thread.get() != Some(&std::thread::current().id()) {
            // Ring the doorbell: the serving thread submits it.
            let one = 1u64.to_ne_bytes();
            // SAFETY: an 8-byte write to our eventfd.
            let r = unsafe { libc::write(self.doorbell.as_raw_fd(), one.as_ptr().cast(), 8) };
            if r != 8 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// The doorbell's read, armed again after each ring.
    fn arm_doorbell(&self) -> io::Result<()> {
        let e = opcode::Read::new(types::Fixed(FILE_DOORBELL), self.bell_buf.get().cast(), 8)
            .build()
            .user_data(DOORBELL);
        let _g = self.sq.lock();
        // SAFETY: as in `submit`; `bell_buf` lives as long as the ring.
        unsafe {
            self.ring
                .submission_shared()
                .push(&e.into())
                .map_err(|_| io::Error::other("FUSE ring: submission queue full"))
        }
    }

    /// Register the files, restrict the ring to what FUSE needs, enable it.
    fn enable(&self, fuse_fd: i32) -> io::Result<()> {
        let sub = self.ring.submitter();
        sub.register_files(&[fuse_fd, self.doorbell.as_raw_fd()])?;
        // Only FUSE's commands and the doorbell's read, only on the
        // registered files: io_uring operations bypass the daemon's seccomp
        // filter, so nothing else may be submitted here.
        let fixed = squeue::Flags::FIXED_FILE.bits();
        sub.register_restrictions(&mut [
            Restriction::sqe_op(opcode::UringCmd80::CODE),
            Restriction::sqe_op(opcode::Read::CODE),
            Restriction::sqe_flags_required(fixed),
            Restriction::sqe_flags_allowed(fixed),
        ])?;
        sub.register_enable_rings()
    }

    /// The reply of the request in entry `idx` (`data`: the out header, then
    /// the reply's arguments), then fetch the next request into it.
    fn reply(&self, idx: usize, commit_id: u64, data: &[IoSlice<'_>]) -> io::Result<()> {
        let s = &self.slots[idx];
        // SAFETY: the reply owns the entry until its commit (module doc).
        let (hdr, pl) = unsafe { (&mut *s.hdr.get(), &mut *s.payload.get()) };
        let total: usize = data.iter().map(|d| d.len()).sum();
        let mut too_big = total.saturating_sub(OUT_HDR) > pl.len();
        // The out header's bytes into the entry's header, the rest into the
        // payload: slice copies (a READ reply is up to `MAX_WRITE` bytes).
        let mut at = 0usize;
        for d in data {
            let mut d: &[u8] = d;
            if at < OUT_HDR {
                let n = d.len().min(OUT_HDR - at);
                hdr[at..at + n].copy_from_slice(&d[..n]);
                at += n;
                d = &d[n..];
            }
            if !d.is_empty() && !too_big {
                let o = at - OUT_HDR;
                pl[o..o + d.len()].copy_from_slice(d);
            }
            at += d.len();
        }
        if total < OUT_HDR {
            too_big = true;
        }
        let payload_sz = if too_big {
            // Cannot happen with the negotiated sizes; fail the request
            // rather than the ring.
            hdr[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            0
        } else {
            (total - OUT_HDR) as u32
        };
        hdr[ENT_IN_OUT + 16..ENT_IN_OUT + 20].copy_from_slice(&payload_sz.to_ne_bytes());
        self.submit(self.sqe(idx, CMD_COMMIT_AND_FETCH, commit_id))
    }
}

/// The rings, made before the FUSE handshake (so that the capability is asked
/// for only when they exist) and started after it.
pub(crate) struct Rings {
    queues: Vec<Arc<Queue>>,
}

impl Rings {
    /// For every possible CPU (a FUSE queue), [`THREADS_TOTAL`] / CPUs
    /// serving threads (at least [`THREADS_MIN`]), each with a ring of one
    /// entry. A payload buffer's pages are touched only as far as the
    /// requests that use it reach.
    pub(crate) fn prepare() -> io::Result<Rings> {
        let n = possible_cpus()?;
        let payload = PAYLOAD;
        let per = THREADS_TOTAL.div_ceil(n).max(THREADS_MIN);
        let mut queues = Vec::with_capacity(n * per);
        for q in 0..n {
            for _ in 0..per {
                queues.push(Arc::new(Queue::new(q as u16, payload, 1)?));
            }
        }
        Ok(Rings { queues })
    }

    /// Start serving: `fd` is the session's `/dev/fuse` descriptor (kept open
    /// by the threads), `disp` fuser's dispatcher.
    pub(crate) fn start(
        self,
        fd: OwnedFd,
        disp: fuser::RawDispatcher<CommitFuse>,
        stats: &Arc<crate::FuseStats>,
    ) -> io::Result<()> {
        let fd = Arc::new(fd);
        let disp = Arc::new(disp);
        let qids: std::collections::BTreeSet<u16> = self.queues.iter().map(|q| q.qid).collect();
        stats
            .ring_queues
            .store(qids.len() as u64, Ordering::Relaxed);
        for (i, mut q) in self.queues.into_iter().enumerate() {
            q.enable(fd.as_raw_fd())?;
            let qm = Arc::get_mut(&mut q).expect("queue not shared yet");
            qm.stats = stats.clone();
            let (fd, disp) = (fd.clone(), disp.clone());
            std::thread::Builder::new()
                .name(format!("commitfs-ring{}-{i}", q.qid))
                .spawn(move || serve(q, disp, fd))?;
        }
        Ok(())
    }
}

/// Pin the calling thread to `cpu` (best effort: the kernel routes by the
/// requester's CPU, the pinning only keeps the server there).
fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET stays in bounds for
    // cpu < CPU_SETSIZE, checked.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                tracing::debug!(
                    "FUSE ring {cpu}: not pinned: {}",
                    io::Error::last_os_error()
                );
            }
        }
    }
}

/// The thread of one queue.
fn serve(q: Arc<Queue>, disp: Arc<fuser::RawDispatcher<CommitFuse>>, _fd: Arc<OwnedFd>) {
    pin(q.qid as usize);
    RING_THREAD.with(|c| c.set(true));
    let _ = q.thread.set(std::thread::current().id());
    if let Err(e) = q.arm_doorbell() {
        tracing::error!("FUSE ring {}: doorbell: {e}", q.qid);
    }
    for i in 0..q.slots.len() {
        if let Err(e) = q.submit(q.sqe(i, CMD_REGISTER, 0)) {
            tracing::error!("FUSE ring {}: register: {e}", q.qid);
        }
    }
    let mut dead = 0usize;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        // Submit this thread's commits (and registrations) and wait, in
        // one call. Other threads push under `sq` and submit at once; the
        // kernel consumes each entry once whoever enters first.
        // SAFETY: no signal mask; the SQ tail is published by the pushes.
        // Exactly the entries pushed: the kernel skips the wait when it
        // submits fewer than asked.
        let pending = {
            let _g = q.sq.lock();
            // SAFETY: read under `sq`, the producers' lock.
            unsafe { q.ring.submission_shared().len() as u32 }
        };
        let r = unsafe {
            q.ring
                .submitter()
                .enter::<libc::sigset_t>(pending, 1, IORING_ENTER_GETEVENTS, None)
        };
        if let Err(e) = r {
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            tracing::error!("FUSE ring {}: {e}", q.qid);
            return;
        }
        // SAFETY: only this thread reads the completion queue.
        let done: Vec<(usize, i32)> = unsafe { q.ring.completion_shared() }
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (idx, res) in done {
            if idx as u64 == DOORBELL {
                // Commits queued by other threads go out with the next wait.
                if res >= 0 || res == -libc::EINTR {
                    if let Err(e) = q.arm_doorbell() {
                        tracing::error!("FUSE ring {}: doorbell: {e}", q.qid);
                    }
                }
                continue;
            }
            if idx >= q.slots.len() {
                continue;
            }
            if res == -libc::EAGAIN || res == -libc::EINTR {
                // The handshake not yet processed (REGISTER), or interrupted:
                // arm the entry again.
                let s = &q.slots[idx];
                if !s.fetched.load(Ordering::Acquire) {
                    if let Err(e) = q.submit(q.sqe(idx, CMD_REGISTER, 0)) {
                        tracing::error!("FUSE ring {}: register again: {e}", q.qid);
                    }
                    continue;
                }
            }
            if res < 0 {
                // ENOTCONN / ECONNABORTED / ECANCELED: the connection ended
                // (unmount); anything else: this entry is lost.
                if ![libc::ENOTCONN, libc::ECONNABORTED, libc::ECANCELED].contains(&-res) {
                    tracing::error!(
                        "FUSE ring {}: entry {idx}: {}",
                        q.qid,
                        io::Error::from_raw_os_error(-res)
                    );
                }
                dead += 1;
                if dead >= q.slots.len() {
                    return;
                }
                continue;
            }
            q.slots[idx].fetched.store(true, Ordering::Release);
            q.stats.ring_requests.fetch_add(1, Ordering::Relaxed);
            handle(&q, &disp, idx, &mut buf);
        }
    }
}

/// Serve the request in entry `idx`.
fn handle(q: &Arc<Queue>, disp: &fuser::RawDispatcher<CommitFuse>, idx: usize, buf: &mut Vec<u8>) {
    let s = &q.slots[idx];
    // SAFETY: the queue thread owns the entry from its completion until the
    // request is copied out (module doc).
    let (hdr, pl) = unsafe { (&*s.hdr.get(), &*s.payload.get()) };
    let u32_at = |b: &[u8], o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |b: &[u8], o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    let len = u32_at(hdr, 0) as usize;
    let unique = u64_at(hdr, 8);
    let commit_id = u64_at(hdr, ENT_IN_OUT + 8);
    let payload_sz = u32_at(hdr, ENT_IN_OUT + 16) as usize;
    let op_sz = len.checked_sub(IN_HDR + payload_sz);
    let ok = match op_sz {
        Some(op) if op <= OP_IN && payload_sz <= pl.len() => {
            buf.clear();
            buf.extend_from_slice(&hdr[..IN_HDR]);
            buf.extend_from_slice(&hdr[OP_IN..OP_IN + op]);
            buf.extend_from_slice(&pl[..payload_sz]);
            let q2 = q.clone();
            let sink: fuser::ReplySink =
                Arc::new(move |data: &[IoSlice<'_>]| q2.reply(idx, commit_id, data));
            disp.dispatch(buf, sink)
        }
        _ => false,
    };
    if !ok {
        // Not a request we can read: fail it (the entry must be committed to
        // be reused).
        tracing::error!(
            "FUSE ring {}: malformed request (len {len}, payload {payload_sz})",
            q.qid
        );
        let mut out = [0u8; OUT_HDR];
        out[0..4].copy_from_slice(&(OUT_HDR as u32).to_ne_bytes());
        out[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
        out[8..16].copy_from_slice(&unique.to_ne_bytes());
        if let Err(e) = q.reply(idx, commit_id, &[IoSlice::new(&out)]) {
            tracing::error!("FUSE ring {}: commit: {e}", q.qid);
        }
    }
}
