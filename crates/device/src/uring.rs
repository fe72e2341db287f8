//! io_uring submission for a block device: true FUA writes, and batches of
//! independent direct writes in flight together.
//!
//! A direct write with `RWF_DSYNC` carries REQ_FUA (`dio_bio_write_op` in the
//! kernel's block/fops.c), but when issued synchronously `blkdev_write_iter`
//! follows it with `generic_write_sync`, i.e. a whole device cache flush: a
//! FUA write then costs a flush as well (measured on the emulated SATA SSD:
//! 3 flushes per JBD2 fsync against the kernel's 2). Submitted asynchronously,
//! the write completes through the bio alone, so its durability is the FUA
//! bit's (on a device without FUA the block layer adds one post-flush). An
//! `io_uring` is the maintained way to submit one from user space.
//!
//! A batch of direct writes (a cut's or a write-back's runs of 64 KiB and
//! more) is submitted at once, so the device has them all in its queue
//! instead of one synchronous write at a time.
//!
//! Each ring is restricted to write operations before it is enabled
//! (`IORING_REGISTER_RESTRICTIONS`): io_uring operations do not pass the mount
//! daemon's seccomp filter, so a ring that could open or read files would be
//! a way around it.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, register::Restriction, types, IoUring};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

/// A ring and its depth. FUA writes (commit blocks, journal superblocks) use a
/// small one of their own, so that they never wait behind a batch.
pub(crate) struct Ring {
    ring: Mutex<IoUring>,
    depth: usize,
    /// Set after an error of the ring itself (not of a write): entries may
    /// still be queued or in flight, so the ring is never used again and
    /// their buffers are leaked; callers take the synchronous path.
    broken: AtomicBool,
}

/// Aligned buffers of a batch still referenced by submitted operations.
pub(crate) type Owned = Vec<crate::AlignedBuf>;

/// `io_uring_enter` retries on EINTR/EAGAIN/EBUSY before the ring is given up.
const ENTER_RETRIES: u32 = 1000;

impl Ring {
    /// A ring of `depth` entries restricted to `IORING_OP_WRITE`; `Err` where
    /// io_uring is unavailable (disabled by `kernel.io_uring_disabled`, a
    /// seccomp filter, an old kernel): the caller then uses the synchronous
    /// path.
    pub(crate) fn new(depth: u32) -> io::Result<Ring> {
        let ring: IoUring = IoUring::builder().setup_r_disabled().build(depth)?;
        let sub = ring.submitter();
        sub.register_restrictions(&mut [
            Restriction::sqe_op(opcode::Write::CODE),
            Restriction::sqe_flags_allowed(0),
        ])?;
        sub.register_enable_rings()?;
        Ok(Ring {
            ring: Mutex::new(ring),
            depth: depth as usize,
            broken: AtomicBool::new(false),
        })
    }

    /// Whether the ring may be used (see [`Ring::broken`]).
    pub(crate) fn usable(&self) -> bool {
        !self.broken.load(Ordering::Acquire)
    }

    /// Submit what is queued and wait for one completion, retrying transient
    /// errors; `Err` (and the ring marked broken) on any other.
    fn enter(&self, ring: &mut IoUring) -> io::Result<()> {
        let mut tries = 0;
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => return Ok(()),
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) && tries < ENTER_RETRIES =>
                {
                    tries += 1;
                    if e.raw_os_error() != Some(libc::EINTR) {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                }
                Err(e) => {
                    self.broken.store(true, Ordering::Release);
                    return Err(e);
                }
            }
        }
    }

    /// Write each `(offset, buffer)` of `bufs` (owned, aligned for `fd`'s
    /// `O_DIRECT`) with up to the ring's depth in flight; the result of each
    /// write (bytes written or `-errno`), in order. On an error of the ring
    /// itself the buffers are leaked rather than freed (an operation may still
    /// read them) and the ring is not used again.
    pub(crate) fn write_batch(
        &self,
        fd: RawFd,
        bufs: Owned,
        offsets: &[u64],
    ) -> io::Result<(Owned, Vec<i32>)> {
        let mut ring = self.ring.lock();
        if !self.usable() {
            return Err(io::Error::other("io_uring unusable after an earlier error"));
        }
        let mut res = vec![0i32; bufs.len()];
        let (mut next, mut inflight) = (0usize, 0usize);
        while next < bufs.len() || inflight > 0 {
            while next < bufs.len() && inflight < self.depth {
                let b = bufs[next].as_ref();
                let Ok(len) = u32::try_from(b.len()) else {
                    res[next] = -libc::EINVAL;
                    next += 1;
                    continue;
                };
                let sqe = opcode::Write::new(types::Fd(fd), b.as_ptr(), len)
                    .offset(offsets[next])
                    .build()
                    .user_data(next as u64);
                // SAFETY: the buffer is owned here and outlives the operation:
                // it is returned only after every completion was reaped, and
                // leaked if the ring fails.
                if unsafe { ring.submission().push(&sqe) }.is_err() {
                    break;
                }
                next += 1;
                inflight += 1;
            }
            if inflight == 0 {
                continue;
            }
            if let Err(e) = self.enter(&mut ring) {
                std::mem::forget(bufs);
                return Err(e);
            }
            for c in ring.completion() {
                if let Some(r) = res.get_mut(c.user_data() as usize) {
                    *r = c.result();
                    inflight = inflight.saturating_sub(1);
                }
            }
        }
        Ok((bufs, res))
    }

    /// Write all of `buf` (owned, aligned for `fd`'s `O_DIRECT`) at `offset`
    /// of `fd` with REQ_FUA; the buffer is leaked if the ring fails with the
    /// write possibly still queued.
    pub(crate) fn write_fua(
        &self,
        fd: RawFd,
        buf: crate::AlignedBuf,
        offset: u64,
    ) -> io::Result<()> {
        let mut ring = self.ring.lock();
        if !self.usable() {
            return Err(io::Error::other("io_uring unusable after an earlier error"));
        }
        let mut done = 0usize;
        let len_all = buf.as_ref().len();
        while done < len_all {
            let rest = &buf.as_ref()[done..];
            // At most 4 GiB - 4 KiB per operation, page-aligned.
            let len = u32::try_from(rest.len()).unwrap_or(!4095);
            let sqe = opcode::Write::new(types::Fd(fd), rest.as_ptr(), len)
                .offset(offset + done as u64)
                .rw_flags(libc::RWF_DSYNC)
                .build()
                .user_data(1);
            // SAFETY: the buffer is owned here: freed only after the
            // completion was reaped, leaked if the ring fails.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                self.broken.store(true, Ordering::Release);
                return Err(io::Error::other("FUA ring: submission queue full"));
            }
            let res = loop {
                if let Err(e) = self.enter(&mut ring) {
                    std::mem::forget(buf);
                    return Err(e);
                }
                if let Some(c) = ring.completion().next() {
                    break c.result();
                }
            };
            match res {
                n if n > 0 => done += n as usize,
                0 => return Err(io::ErrorKind::WriteZero.into()),
                e if e == -libc::EINTR || e == -libc::EAGAIN => {}
                e => return Err(io::Error::from_raw_os_error(-e)),
            }
        }
        Ok(())
    }
}
