//! Per-request counters of the FUSE front end: how many requests of each kind
//! were served and how long the file system took to answer them (from the
//! event loop's or fsync pool's start of the job to the reply). `commitfs
//! stats` prints them, so a benchmark can tell time spent in the daemon from
//! time spent queued in the kernel (e.g. on a directory's lock).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The request kinds counted; `Op::NAMES[op as usize]` names each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Op {
    Lookup,
    Forget,
    Getattr,
    Setattr,
    Readlink,
    Mknod,
    Mkdir,
    Unlink,
    Rmdir,
    Symlink,
    Rename,
    Link,
    Open,
    Read,
    Write,
    Flush,
    Release,
    Fsync,
    Opendir,
    Readdir,
    Readdirplus,
    Releasedir,
    Fsyncdir,
    Statfs,
    Setxattr,
    Getxattr,
    Listxattr,
    Removexattr,
    Create,
    Fallocate,
    Ioctl,
    Lseek,
    CopyFileRange,
    Other,
}

impl Op {
    pub const COUNT: usize = Op::Other as usize + 1;
    pub const NAMES: [&'static str; Op::COUNT] = [
        "lookup",
        "forget",
        "getattr",
        "setattr",
        "readlink",
        "mknod",
        "mkdir",
        "unlink",
        "rmdir",
        "symlink",
        "rename",
        "link",
        "open",
        "read",
        "write",
        "flush",
        "release",
        "fsync",
        "opendir",
        "readdir",
        "readdirplus",
        "releasedir",
        "fsyncdir",
        "statfs",
        "setxattr",
        "getxattr",
        "listxattr",
        "removexattr",
        "create",
        "fallocate",
        "ioctl",
        "lseek",
        "copy_file_range",
        "other",
    ];
}

/// Requests served and nanoseconds spent, per [`Op`].
#[derive(Debug)]
pub struct FuseStats {
    count: [AtomicU64; Op::COUNT],
    nanos: [AtomicU64; Op::COUNT],
    /// FUSE over io_uring: queues serving (0: `/dev/fuse` only) and the
    /// requests that came through them.
    pub(crate) ring_queues: AtomicU64,
    pub(crate) ring_requests: AtomicU64,
    /// The polling event loop's budget in µs (0: no loop polls) and what it
    /// found (`FuseConfig::poll_us`).
    pub(crate) poll_us: AtomicU64,
    pub(crate) poll: Arc<fuser::PollCounters>,
    /// READs the daemon's cache could not answer whole, served on the pool
    /// (they may wait for the device); how many were there at once, now and
    /// at most.
    reads_deferred: AtomicU64,
    reads_waiting: AtomicU64,
    reads_waiting_max: AtomicU64,
}

impl Default for FuseStats {
    fn default() -> Self {
        FuseStats {
            count: std::array::from_fn(|_| AtomicU64::new(0)),
            nanos: std::array::from_fn(|_| AtomicU64::new(0)),
            ring_queues: AtomicU64::new(0),
            ring_requests: AtomicU64::new(0),
            poll_us: AtomicU64::new(0),
            poll: Arc::default(),
            reads_deferred: AtomicU64::new(0),
            reads_waiting: AtomicU64::new(0),
            reads_waiting_max: AtomicU64::new(0),
        }
    }
}

/// One kind's totals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpTotals {
    pub name: &'static str,
    pub count: u64,
    pub nanos: u64,
}

impl FuseStats {
    /// Count one request of `op` that started at `t0`.
    pub(crate) fn record(&self, op: Op, t0: Instant) {
        let i = op as usize;
        self.count[i].fetch_add(1, Ordering::Relaxed);
        self.nanos[i].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// FUSE over io_uring: `(queues, requests served through them)`;
    /// `(0, 0)` when requests come through `/dev/fuse` only.
    pub fn ring(&self) -> (u64, u64) {
        (
            self.ring_queues.load(Ordering::Relaxed),
            self.ring_requests.load(Ordering::Relaxed),
        )
    }

    /// The polling event loop on `/dev/fuse`: `(budget in µs, requests it
    /// read while polling, times it went to sleep)`; `(0, 0, 0)` when no
    /// loop polls (`-o fuse_poll=0`, or requests come through the rings).
    pub fn poll(&self) -> (u64, u64, u64) {
        let polling = self.poll.loops.load(Ordering::Relaxed) > 0;
        (
            if polling {
                self.poll_us.load(Ordering::Relaxed)
            } else {
                0
            },
            self.poll.polled.load(Ordering::Relaxed),
            self.poll.slept.load(Ordering::Relaxed),
        )
    }

    /// A READ handed to the pool; [`Self::read_done`] when it is answered.
    pub(crate) fn read_deferred(&self) {
        self.reads_deferred.fetch_add(1, Ordering::Relaxed);
        let now = self.reads_waiting.fetch_add(1, Ordering::Relaxed) + 1;
        self.reads_waiting_max.fetch_max(now, Ordering::Relaxed);
    }

    pub(crate) fn read_done(&self) {
        self.reads_waiting.fetch_sub(1, Ordering::Relaxed);
    }

    /// `(READs served on the pool, most of them in the daemon at once)`.
    pub fn reads_deferred(&self) -> (u64, u64) {
        (
            self.reads_deferred.load(Ordering::Relaxed),
            self.reads_waiting_max.load(Ordering::Relaxed),
        )
    }

    /// The relief loop (`fuser::PollCounters`): `(times it took over from
    /// the polling loop held by one request, requests it served then)`.
    pub fn relief(&self) -> (u64, u64) {
        (
            self.poll.reliefs.load(Ordering::Relaxed),
            self.poll.relieved.load(Ordering::Relaxed),
        )
    }

    /// The kinds served at least once.
    pub fn snapshot(&self) -> Vec<OpTotals> {
        (0..Op::COUNT)
            .map(|i| OpTotals {
                name: Op::NAMES[i],
                count: self.count[i].load(Ordering::Relaxed),
                nanos: self.nanos[i].load(Ordering::Relaxed),
            })
            .filter(|t| t.count > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_per_kind() {
        let s = FuseStats::default();
        let t0 = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        s.record(Op::Create, t0);
        s.record(Op::Create, Instant::now());
        s.record(Op::Other, Instant::now());
        let v = s.snapshot();
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].name, v[0].count), ("create", 2));
        assert!(v[0].nanos >= 2_000_000, "{v:?}");
        assert_eq!((v[1].name, v[1].count), ("other", 1));
    }
}
