//! A device that fails requests on command, for testing how the layers above
//! handle I/O errors (issue #9 item 9: `errors=`, journal abort, fsync EIO).
//!
//! [`FaultyDevice`] wraps any [`BlockDevice`]. Each armed [`Fault`] names which
//! requests it hits (reads, writes, flushes; an I/O category; a byte range), how
//! many matching requests to let through first, and how many to fail (once, N
//! times or persistently). A failed request never reaches the wrapped device and
//! returns [`DeviceError::Io`] with the fault's errno, so the wrapped device's
//! counters ([`BlockDevice::stats`], which this wrapper reports) stay exact: they
//! count only I/O that happened.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::{BlockDevice, DeviceError, DeviceRef, IoCategory, IoStats, Result};

/// Which request kinds a [`Fault`] hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultOps {
    pub read: bool,
    pub write: bool,
    pub flush: bool,
}

/// One armed fault (build with [`Fault::reads`], [`Fault::writes`],
/// [`Fault::flushes`] and the chained setters).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub ops: FaultOps,
    /// Only requests of this category (flushes have none and never match).
    pub category: Option<IoCategory>,
    /// Only requests overlapping these device bytes (flushes never match).
    pub bytes: Option<Range<u64>>,
    /// Matching requests let through before the first failure.
    pub after: u64,
    /// Failures to inject; `None`: every matching request from then on.
    pub times: Option<u64>,
    /// errno of the injected error (EIO by default).
    pub errno: i32,
}

impl Fault {
    fn new(ops: FaultOps) -> Fault {
        Fault {
            ops,
            category: None,
            bytes: None,
            after: 0,
            times: None,
            errno: libc::EIO,
        }
    }
    pub fn reads() -> Fault {
        Fault::new(FaultOps {
            read: true,
            write: false,
            flush: false,
        })
    }
    pub fn writes() -> Fault {
        Fault::new(FaultOps {
            read: false,
            write: true,
            flush: false,
        })
    }
    pub fn flushes() -> Fault {
        Fault::new(FaultOps {
            read: false,
            write: false,
            flush: true,
        })
    }
    /// Reads, writes and flushes: a dead device.
    pub fn everything() -> Fault {
        Fault::new(FaultOps {
            read: true,
            write: true,
            flush: true,
        })
    }
    pub fn category(mut self, c: IoCategory) -> Fault {
        self.category = Some(c);
        self
    }
    /// Only requests touching device bytes `r`.
    pub fn bytes(mut self, r: Range<u64>) -> Fault {
        self.bytes = Some(r);
        self
    }
    /// Let `n` matching requests through first.
    pub fn after(mut self, n: u64) -> Fault {
        self.after = n;
        self
    }
    /// Fail one matching request, then disarm.
    pub fn once(self) -> Fault {
        self.times(1)
    }
    pub fn times(mut self, n: u64) -> Fault {
        self.times = Some(n);
        self
    }
    pub fn errno(mut self, e: i32) -> Fault {
        self.errno = e;
        self
    }

    fn matches(&self, kind: Kind, cat: Option<IoCategory>, span: Option<Range<u64>>) -> bool {
        let op = match kind {
            Kind::Read => self.ops.read,
            Kind::Write => self.ops.write,
            Kind::Flush => self.ops.flush,
        };
        if !op {
            return false;
        }
        if self.category.is_some() && self.category != cat {
            return false;
        }
        match (&self.bytes, span) {
            (None, _) => true,
            (Some(r), Some(s)) => r.start < s.end && s.start < r.end,
            (Some(_), None) => false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Read,
    Write,
    Flush,
}

struct Armed {
    fault: Fault,
    /// Matching requests seen so far.
    seen: u64,
    /// Failures injected so far.
    failed: u64,
}

/// A [`BlockDevice`] that fails requests on command (see the module docs).
pub struct FaultyDevice {
    inner: DeviceRef,
    armed: Mutex<Vec<Armed>>,
    injected: AtomicU64,
}

impl FaultyDevice {
    pub fn new(inner: DeviceRef) -> FaultyDevice {
        FaultyDevice {
            inner,
            armed: Mutex::new(Vec::new()),
            injected: AtomicU64::new(0),
        }
    }

    /// Arm a fault; it applies to requests issued from now on.
    pub fn inject(&self, f: Fault) {
        self.armed.lock().push(Armed {
            fault: f,
            seen: 0,
            failed: 0,
        });
    }

    /// Disarm every fault (the device works again).
    pub fn heal(&self) {
        self.armed.lock().clear();
    }

    /// Requests failed so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// The wrapped device.
    pub fn inner(&self) -> &DeviceRef {
        &self.inner
    }

    /// `Err` when an armed fault hits this request.
    fn check(&self, kind: Kind, cat: Option<IoCategory>, offset: u64, len: usize) -> Result<()> {
        let span = cat.map(|_| offset..offset.saturating_add(len as u64));
        let mut armed = self.armed.lock();
        let mut hit = None;
        for a in armed.iter_mut() {
            if !a.fault.matches(kind, cat, span.clone()) {
                continue;
            }
            a.seen += 1;
            let due = a.seen > a.fault.after && a.fault.times.is_none_or(|t| a.failed < t);
            if due && hit.is_none() {
                a.failed += 1;
                hit = Some(a.fault.errno);
            }
        }
        armed.retain(|a| a.fault.times.is_none_or(|t| a.failed < t));
        drop(armed);
        match hit {
            None => Ok(()),
            Some(errno) => {
                self.injected.fetch_add(1, Ordering::Relaxed);
                Err(DeviceError::Io {
                    offset,
                    len,
                    source: std::io::Error::from_raw_os_error(errno),
                })
            }
        }
    }
}

impl BlockDevice for FaultyDevice {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> Result<()> {
        self.check(Kind::Read, Some(cat), offset, buf.len())?;
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> Result<()> {
        self.check(Kind::Write, Some(cat), offset, buf.len())?;
        self.inner.write_at(offset, buf, cat, fua)
    }
    fn write_sectors(&self, offset: u64, buf: &[u8], cat: IoCategory) -> Result<()> {
        self.check(Kind::Write, Some(cat), offset, buf.len())?;
        self.inner.write_sectors(offset, buf, cat)
    }
    fn flush(&self) -> Result<()> {
        self.check(Kind::Flush, None, 0, 0)?;
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;
    use std::sync::Arc;

    fn dev() -> (Arc<MemDevice>, FaultyDevice) {
        let m = Arc::new(MemDevice::new(64 * 1024));
        (m.clone(), FaultyDevice::new(m))
    }

    fn is_eio(r: Result<()>) -> bool {
        matches!(r, Err(DeviceError::Io { source, .. }) if source.raw_os_error() == Some(libc::EIO))
    }

    #[test]
    fn category_after_and_once() {
        let (m, d) = dev();
        d.inject(
            Fault::writes()
                .category(IoCategory::Journal)
                .after(2)
                .once(),
        );
        let b = [1u8; 512];
        // Other categories and reads pass.
        d.write_at(0, &b, IoCategory::Data, false).unwrap();
        d.write_at(0, &b, IoCategory::Journal, false).unwrap();
        d.write_at(512, &b, IoCategory::Journal, false).unwrap();
        assert!(is_eio(d.write_at(1024, &b, IoCategory::Journal, true)));
        // Once: the next one works again.
        d.write_at(1024, &b, IoCategory::Journal, true).unwrap();
        assert_eq!(d.injected(), 1);
        // The failed write never happened: not applied, not counted.
        let s = m.stats().snapshot();
        assert_eq!(s.journal.writes, 3);
        assert_eq!(s.journal.fua_writes, 1);
        assert_eq!(s.data.writes, 1);
    }

    #[test]
    fn byte_range_persistent_flush_and_heal() {
        let (m, d) = dev();
        d.inject(Fault::writes().bytes(8192..12288));
        d.inject(Fault::flushes());
        let b = [2u8; 4096];
        d.write_at(4096, &b, IoCategory::Metadata, false).unwrap();
        for _ in 0..3 {
            assert!(is_eio(d.write_at(8192, &b, IoCategory::Data, false)));
            assert!(is_eio(d.write_sectors(
                12288 - 512,
                &b[..512],
                IoCategory::Data
            )));
        }
        assert!(is_eio(d.flush()));
        let mut r = [0u8; 4096];
        d.read_at(8192, &mut r, IoCategory::Data).unwrap();
        assert_eq!(r, [0u8; 4096], "a failed write must not reach the media");
        assert_eq!(d.injected(), 7);
        d.heal();
        d.write_at(8192, &b, IoCategory::Data, false).unwrap();
        d.flush().unwrap();
        let s = m.stats().snapshot();
        assert_eq!((s.metadata.writes, s.data.writes, s.flushes), (1, 1, 1));
        d.inject(Fault::reads().times(2));
        assert!(d.read_at(0, &mut r, IoCategory::Metadata).is_err());
        assert!(d.read_at(0, &mut r, IoCategory::Metadata).is_err());
        d.read_at(0, &mut r, IoCategory::Metadata).unwrap();
    }
}
