//! True FUA writes on a block device.
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
//! The ring is restricted to write operations before it is enabled
//! (`IORING_REGISTER_RESTRICTIONS`): io_uring operations do not pass the mount
//! daemon's seccomp filter, so a ring that could open or read files would be
//! a way around it.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, register::Restriction, types, IoUring};
use parking_lot::Mutex;

/// One small ring; FUA writes (commit blocks, journal superblocks) are rare
/// enough that one at a time is no limit.
pub(crate) struct FuaRing {
    ring: Mutex<IoUring>,
}

impl FuaRing {
    /// A ring restricted to `IORING_OP_WRITE`; `Err` where io_uring is
    /// unavailable (disabled by `kernel.io_uring_disabled`, a seccomp filter,
    /// an old kernel): the caller then uses the synchronous path.
    pub(crate) fn new() -> io::Result<FuaRing> {
        let ring: IoUring = IoUring::builder().setup_r_disabled().build(4)?;
        let sub = ring.submitter();
        sub.register_restrictions(&mut [
            Restriction::sqe_op(opcode::Write::CODE),
            Restriction::sqe_flags_allowed(0),
        ])?;
        sub.register_enable_rings()?;
        Ok(FuaRing {
            ring: Mutex::new(ring),
        })
    }

    /// Write all of `buf` at `offset` of `fd` (an `O_DIRECT` descriptor; `buf`
    /// aligned as direct I/O needs) with REQ_FUA.
    pub(crate) fn write(&self, fd: RawFd, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut ring = self.ring.lock();
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &buf[done..];
            // At most 4 GiB - 4 KiB per operation, page-aligned.
            let len = u32::try_from(rest.len()).unwrap_or(!4095);
            let sqe = opcode::Write::new(types::Fd(fd), rest.as_ptr(), len)
                .offset(offset + done as u64)
                .rw_flags(libc::RWF_DSYNC)
                .build();
            // SAFETY: `rest` outlives the operation: we wait for its completion
            // below, holding the ring, before returning.
            unsafe { ring.submission().push(&sqe) }
                .map_err(|_| io::Error::other("FUA ring: submission queue full"))?;
            let res = loop {
                match ring.submit_and_wait(1) {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
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
