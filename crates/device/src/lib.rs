//! Block devices for commitfs: image files, raw block devices and memory, with exact
//! I/O accounting by category.
//!
//! Every layer above talks to a [`BlockDevice`]; the device counts each request so
//! that tests and benchmarks can assert on I/Os, bytes, FUA writes and flushes
//! (DEVELOPERS.md: "tests check behaviour and counts").

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

pub mod faulty;
pub mod inuse;
pub mod recording;
pub mod size;
#[doc(hidden)]
pub mod testutil;
mod uring;
pub use faulty::{Fault, FaultOps, FaultyDevice};
pub use inuse::OtherUser;
pub use recording::{CrashLog, CrashSpec, LogOp, Materializer, RecordingDevice};

/// Errors of the device layer.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("I/O error at byte {offset} ({len} bytes): {source}")]
    Io {
        offset: u64,
        len: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("access beyond end of device: byte {offset} + {len} > {size}")]
    OutOfRange { offset: u64, len: usize, size: u64 },
    #[error("device is read-only")]
    ReadOnly,
    /// Someone else uses the image: a second writer would destroy its work.
    #[error("{} is in use: {}", .path.display(), inuse::describe(.users))]
    InUse {
        path: PathBuf,
        users: Vec<OtherUser>,
    },
    /// Opening for writing failed with EPERM because of a file attribute.
    #[error(
        "{} is {flag} (chattr +{}), so it cannot be opened for writing: mount it \
         read-only with -o ro, or clear the flag with `chattr -{} {}`",
        .path.display(),
        if *.flag == "immutable" { "i" } else { "a" },
        if *.flag == "immutable" { "i" } else { "a" },
        .path.display()
    )]
    Attribute { path: PathBuf, flag: &'static str },
}

pub type Result<T> = std::result::Result<T, DeviceError>;

/// What an I/O is for. The journal issues count journal and fast-commit I/O
/// separately from in-place ("home") metadata and file data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoCategory {
    Data = 0,
    Metadata = 1,
    Journal = 2,
    FastCommit = 3,
}

impl IoCategory {
    pub const ALL: [IoCategory; 4] = [
        IoCategory::Data,
        IoCategory::Metadata,
        IoCategory::Journal,
        IoCategory::FastCommit,
    ];
    pub fn name(self) -> &'static str {
        match self {
            IoCategory::Data => "data",
            IoCategory::Metadata => "metadata",
            IoCategory::Journal => "journal",
            IoCategory::FastCommit => "fast_commit",
        }
    }
}

#[derive(Default, Debug)]
struct CatCounters {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    fua_writes: AtomicU64,
}

/// Lock-free I/O counters, one set per [`IoCategory`], plus flushes.
#[derive(Default, Debug)]
pub struct IoStats {
    cats: [CatCounters; 4],
    flushes: AtomicU64,
}

/// A point-in-time copy of one category's counters.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatSnapshot {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub fua_writes: u64,
}

/// A point-in-time copy of all counters.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub data: CatSnapshot,
    pub metadata: CatSnapshot,
    pub journal: CatSnapshot,
    pub fast_commit: CatSnapshot,
    pub flushes: u64,
}

impl StatsSnapshot {
    pub fn category(&self, c: IoCategory) -> &CatSnapshot {
        match c {
            IoCategory::Data => &self.data,
            IoCategory::Metadata => &self.metadata,
            IoCategory::Journal => &self.journal,
            IoCategory::FastCommit => &self.fast_commit,
        }
    }
    /// Total writes across categories.
    pub fn total_writes(&self) -> u64 {
        IoCategory::ALL
            .iter()
            .map(|c| self.category(*c).writes)
            .sum()
    }
    pub fn total_write_bytes(&self) -> u64 {
        IoCategory::ALL
            .iter()
            .map(|c| self.category(*c).write_bytes)
            .sum()
    }
    /// Counter differences `self - earlier` (for measuring one operation).
    pub fn since(&self, earlier: &StatsSnapshot) -> StatsSnapshot {
        fn d(a: &CatSnapshot, b: &CatSnapshot) -> CatSnapshot {
            CatSnapshot {
                reads: a.reads - b.reads,
                read_bytes: a.read_bytes - b.read_bytes,
                writes: a.writes - b.writes,
                write_bytes: a.write_bytes - b.write_bytes,
                fua_writes: a.fua_writes - b.fua_writes,
            }
        }
        StatsSnapshot {
            data: d(&self.data, &earlier.data),
            metadata: d(&self.metadata, &earlier.metadata),
            journal: d(&self.journal, &earlier.journal),
            fast_commit: d(&self.fast_commit, &earlier.fast_commit),
            flushes: self.flushes - earlier.flushes,
        }
    }
}

impl IoStats {
    pub fn record_read(&self, cat: IoCategory, bytes: usize) {
        let c = &self.cats[cat as usize];
        c.reads.fetch_add(1, Ordering::Relaxed);
        c.read_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub fn record_write(&self, cat: IoCategory, bytes: usize, fua: bool) {
        let c = &self.cats[cat as usize];
        c.writes.fetch_add(1, Ordering::Relaxed);
        c.write_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if fua {
            c.fua_writes.fetch_add(1, Ordering::Relaxed);
        }
    }
    pub fn record_flush(&self) {
        self.flushes.fetch_add(1, Ordering::Relaxed);
    }
    pub fn snapshot(&self) -> StatsSnapshot {
        let s = |c: &CatCounters| CatSnapshot {
            reads: c.reads.load(Ordering::Relaxed),
            read_bytes: c.read_bytes.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            write_bytes: c.write_bytes.load(Ordering::Relaxed),
            fua_writes: c.fua_writes.load(Ordering::Relaxed),
        };
        StatsSnapshot {
            data: s(&self.cats[0]),
            metadata: s(&self.cats[1]),
            journal: s(&self.cats[2]),
            fast_commit: s(&self.cats[3]),
            flushes: self.flushes.load(Ordering::Relaxed),
        }
    }
}

/// A byte-addressed block device with a volatile write cache.
///
/// Offsets and lengths are multiples of 512 in practice; backends do not require it.
/// `write_at(.., fua = true)` must be durable when it returns; otherwise durability
/// needs a later [`BlockDevice::flush`].
pub trait BlockDevice: Send + Sync {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> Result<()>;
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> Result<()>;
    /// A write of whole 512-byte sectors shorter than a page that should reach
    /// the device as exactly these bytes, not as the page around them (block
    /// devices: `O_DIRECT`); durable after a later flush, like `write_at`
    /// without FUA.
    fn write_sectors(&self, offset: u64, buf: &[u8], cat: IoCategory) -> Result<()> {
        self.write_at(offset, buf, cat, false)
    }
    /// Independent writes (no FUA), each given as pieces written contiguously
    /// from its offset; devices that can submit them together do (a block
    /// device: the large ones in flight at once). Each counts as one write. On
    /// an error some of them may have been done.
    fn write_batch(&self, writes: &[(u64, &[&[u8]])], cat: IoCategory) -> Result<()> {
        let mut joined = Vec::new();
        for &(offset, pieces) in writes {
            self.write_at(offset, join(pieces, &mut joined), cat, false)?;
        }
        Ok(())
    }
    fn flush(&self) -> Result<()>;
    /// Size in bytes.
    fn size(&self) -> u64;
    fn is_read_only(&self) -> bool;
    fn stats(&self) -> &IoStats;
}

/// `pieces` as one slice: the piece itself when there is one, else joined in
/// `buf`.
fn join<'a>(pieces: &[&'a [u8]], buf: &'a mut Vec<u8>) -> &'a [u8] {
    if let [one] = pieces {
        return one;
    }
    buf.clear();
    for p in pieces {
        buf.extend_from_slice(p);
    }
    buf
}

fn check_range(offset: u64, len: usize, size: u64) -> Result<()> {
    if offset.checked_add(len as u64).is_none_or(|end| end > size) {
        return Err(DeviceError::OutOfRange { offset, len, size });
    }
    Ok(())
}

/// An image file or a raw block device (`/dev/loopN`, `/dev/nvme0n1p3`, ...).
pub struct FileDevice {
    file: File,
    /// An `O_DIRECT` handle on a block device, for writes shorter than a page
    /// (through the page cache a 512-byte write becomes a 4 KiB one on the
    /// device: the fast-commit area's zeroed first sector, `journal::log`) and
    /// for large page-aligned reads and writes (file data: one copy less, and
    /// the block device's page cache is not filled with data the file system
    /// caches itself). The kernel keeps the two handles coherent: a direct
    /// write writes back and drops cached pages of its range, a direct read
    /// writes back dirty ones first.
    direct: Option<File>,
    /// True FUA writes through [`Self::direct`] (uring.rs); `None` where
    /// io_uring is not available.
    fua: Option<uring::Ring>,
    /// Batches of direct writes in flight together (uring.rs).
    batch: Option<uring::Ring>,
    /// Byte ranges being written through a ring (asynchronous direct
    /// writes), with the buffered reads that may not run beside them: see
    /// [`RingWrites`].
    ring_writes: RingWrites,
    size: u64,
    read_only: bool,
    stats: IoStats,
}

/// Writes shorter than this go through [`FileDevice::direct`] when they are
/// sector-aligned.
const PAGE: usize = 4096;
const SECTOR: usize = 512;
/// Page-aligned writes at least this long use [`FileDevice::direct`].
const DIRECT_MIN: usize = 64 << 10;
/// Direct writes of one batch in flight at once ([`BlockDevice::write_batch`]).
const BATCH_DEPTH: u32 = 32;
/// Page-aligned reads at least this long use [`FileDevice::direct`]. Higher:
/// shorter reads (a FUSE read is 128 KiB) gain more from the block device's
/// readahead than they lose to the copy through its page cache (measured:
/// `commitfs bench --workloads seq-read` through the mount, 1,083 MiB/s
/// buffered, 810 with direct reads from 64 KiB).
const DIRECT_READ_MIN: usize = 512 << 10;

/// How [`FileDevice::open_with`] opens a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read-write, as the only user ([`inuse`]: exclusive open or write lock).
    ReadWrite,
    /// Read-only; shares with other readers, refused beside a writer.
    ReadOnly,
    /// Read-only beside any other user, without lock or check (`commitfs info`
    /// on a mounted image, which warns instead).
    Shared,
}

impl FileDevice {
    /// Open `path` as its only writer (`read_only`: as one of its readers); see
    /// [`inuse`] for what counts as another user.
    pub fn open(path: &Path, read_only: bool) -> Result<Self> {
        Self::open_with(
            path,
            if read_only {
                Access::ReadOnly
            } else {
                Access::ReadWrite
            },
        )
    }

    pub fn open_with(path: &Path, access: Access) -> Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let read_only = access != Access::ReadWrite;
        let open_err = |source| DeviceError::Open {
            path: path.to_owned(),
            source,
        };
        let is_blk = std::fs::metadata(path)
            .map(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
            .unwrap_or(false);
        let mut oo = OpenOptions::new();
        oo.read(true).write(!read_only);
        if is_blk && access == Access::ReadWrite {
            // As the kernel and e2fsprogs: EBUSY while mounted or claimed.
            oo.custom_flags(libc::O_EXCL);
        }
        let file = match oo.open(path) {
            Ok(f) => f,
            Err(e) if is_blk && e.raw_os_error() == Some(libc::EBUSY) => {
                let users = File::open(path)
                    .map(|f| inuse::other_users(&f, inuse::Want::Write, false))
                    .unwrap_or_default();
                return Err(DeviceError::InUse {
                    path: path.to_owned(),
                    users,
                });
            }
            Err(e) if !read_only && e.raw_os_error() == Some(libc::EPERM) => {
                return Err(match inuse::write_blocking_attribute(path) {
                    Some(flag) => DeviceError::Attribute {
                        path: path.to_owned(),
                        flag,
                    },
                    None => open_err(e),
                });
            }
            Err(e) => return Err(open_err(e)),
        };
        if access != Access::Shared {
            let want = if read_only {
                inuse::Want::Read
            } else {
                inuse::Want::Write
            };
            let taken = if !is_blk {
                inuse::retry_briefly(|| inuse::lock_file(&file, want)).map_err(open_err)?
            } else if read_only {
                // A reader does not claim the device; the probe tells whether
                // someone (a mount, a commitfs writer) has.
                exclusive_probe(path).map_err(open_err)?
            } else {
                true // opened with O_EXCL above
            };
            let users = inuse::other_users(&file, want, taken);
            if !users.is_empty() {
                return Err(DeviceError::InUse {
                    path: path.to_owned(),
                    users,
                });
            }
        }
        let size = device_size(&file).map_err(open_err)?;
        let direct = if read_only || !is_block_device(&file) {
            None
        } else {
            // Optional: without it sub-page writes still work, only larger.
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        };
        let ra_window = direct.as_ref().map_or(0, |_| readahead_window(&file));
        // Still correct without it: a FUA write then costs a flush as well.
        let fua = direct.as_ref().and_then(|_| uring::Ring::new(4).ok());
        let batch = direct
            .as_ref()
            .and_then(|_| uring::Ring::new(BATCH_DEPTH).ok());
        Ok(FileDevice {
            file,
            direct,
            fua,
            batch,
            ring_writes: RingWrites::new(ra_window),
            size,
            read_only,
            stats: IoStats::default(),
        })
    }

    /// Who else uses `path` (an image file or a block device), found without
    /// holding anything: what [`FileDevice::open`] for writing would refuse over.
    /// For `commitfs info` (which warns) and `commitfs mkfs` on a block device
    /// (mkfs.ext4 then opens it exclusively itself).
    pub fn users(path: &Path) -> Result<Vec<OtherUser>> {
        let open_err = |source| DeviceError::Open {
            path: path.to_owned(),
            source,
        };
        let is_blk = std::fs::metadata(path)
            .map(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
            .map_err(open_err)?;
        if is_blk {
            let taken = exclusive_probe(path).map_err(open_err)?;
            let f = File::open(path).map_err(open_err)?;
            return Ok(inuse::other_users(&f, inuse::Want::Write, taken));
        }
        let f = File::open(path).map_err(open_err)?;
        let locked =
            !inuse::retry_briefly(|| inuse::lock_conflicts(&f, inuse::Want::Write).map(|c| !c))
                .map_err(open_err)?;
        Ok(inuse::other_users(&f, inuse::Want::Write, !locked))
    }

    /// Whether FUA writes are single REQ_FUA requests (a block device with
    /// io_uring, uring.rs) rather than a write followed by a device flush.
    pub fn has_true_fua(&self) -> bool {
        self.fua.is_some()
    }

    /// Resize an image file (`commitfs mkfs --size`) while holding it.
    pub fn set_file_len(&mut self, len: u64) -> Result<()> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        self.file.set_len(len).map_err(|source| DeviceError::Io {
            offset: len,
            len: 0,
            source,
        })?;
        self.size = len;
        Ok(())
    }

    /// `write_at`; with `sectors`, [`BlockDevice::write_sectors`] (direct I/O
    /// where it applies).
    fn write(
        &self,
        offset: u64,
        buf: &[u8],
        cat: IoCategory,
        fua: bool,
        sectors: bool,
    ) -> Result<()> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        check_range(offset, buf.len(), self.size)?;
        let io = |source| DeviceError::Io {
            offset,
            len: buf.len(),
            source,
        };
        if fua {
            self.write_fua(offset, buf).map_err(io)?;
        } else {
            let direct = if sectors {
                self.write_direct(offset, buf).map_err(io)?
            } else {
                self.write_direct_large(offset, buf).map_err(io)?
            };
            if !direct {
                self.write_buffered(offset, buf).map_err(io)?;
            }
        }
        self.stats.record_write(cat, buf.len(), fua);
        Ok(())
    }

    /// A FUA write: these bytes are durable when it returns, and only these
    /// (earlier writes need a flush, which every caller issues first: the
    /// crash harness's recording device keeps exactly this rule). On a block
    /// device, an asynchronous direct write with `RWF_DSYNC`: one request
    /// with REQ_FUA (uring.rs). Elsewhere, and where that is refused,
    /// `RWF_DSYNC` on the buffered handle writes this range and flushes the
    /// device (`generic_write_sync` over the range), never the image's other
    /// dirty pages, which a whole-file fdatasync would write back as well.
    fn write_fua(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        if let (Some(d), Some(ring)) = (&self.direct, &self.fua) {
            if ring.usable()
                && !buf.is_empty()
                && buf.len().is_multiple_of(SECTOR)
                && offset.is_multiple_of(SECTOR as u64)
            {
                use std::os::fd::AsRawFd;
                let mut a = AlignedBuf::new(buf.len());
                a.as_mut().copy_from_slice(buf);
                let _in_flight = self.ring_writes.begin(&[(offset, buf.len())]);
                match ring.write_fua(d.as_raw_fd(), a, offset) {
                    Ok(()) => {
                        self.drop_cached(offset, buf.len());
                        return Ok(());
                    }
                    // The ring itself failed (and is not used again): the
                    // synchronous write below writes the same bytes.
                    Err(_) if !ring.usable() => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        let _writing = self
            .direct
            .as_ref()
            .and_then(|_| self.ring_writes.write(offset, buf.len()));
        match pwrite_all_flags(&self.file, buf, offset, libc::RWF_DSYNC) {
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) => {
                // A kernel without per-write flags (before 4.7).
                self.file.write_all_at(buf, offset)?;
                self.file.sync_data()
            }
            r => r,
        }
    }

    /// Drop the block device's cached pages of a range just written through
    /// a ring. A synchronous direct write invalidates them after the write
    /// (`kiocb_invalidate_post_direct_write`); an asynchronous one does not,
    /// so a readahead that ran meanwhile could have left the old bytes there.
    fn drop_cached(&self, offset: u64, len: usize) {
        use std::os::fd::AsRawFd;
        // Whole pages (DONTNEED keeps a page it covers only in part).
        let (start, end) = (
            page_down(offset),
            page_up(offset.saturating_add(len as u64)),
        );
        if end <= start {
            // (A length of 0 would mean "to the end of the device".)
            return;
        }
        let (Ok(off), Ok(len)) = (
            libc::off_t::try_from(start),
            libc::off_t::try_from(end - start),
        ) else {
            return;
        };
        // SAFETY: plain system call on our descriptor.
        unsafe {
            libc::posix_fadvise(self.file.as_raw_fd(), off, len, libc::POSIX_FADV_DONTNEED);
        }
    }

    /// A read through the page cache, unless a ring write is in flight within
    /// its readahead's reach: then directly (whole pages around it, through
    /// an aligned buffer), so that no page of that range is read from the
    /// device, and kept, before the write lands (see [`RingWrites`]).
    fn read_buffered(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let Some(d) = &self.direct else {
            return self.file.read_exact_at(buf, offset);
        };
        if let Some(_reading) = self.ring_writes.read(offset, buf.len()) {
            return self.file.read_exact_at(buf, offset);
        }
        // The device's size is a whole number of its logical blocks.
        let start = page_down(offset);
        let end = page_up(offset + buf.len() as u64).min(self.size);
        let mut a = AlignedBuf::new((end - start) as usize);
        d.read_exact_at(a.as_mut(), start)?;
        let at = (offset - start) as usize;
        buf.copy_from_slice(&a.as_ref()[at..at + buf.len()]);
        Ok(())
    }

    /// A write through the page cache (see [`RingWrites::write`]).
    fn write_buffered(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        let _writing = self
            .direct
            .as_ref()
            .and_then(|_| self.ring_writes.write(offset, buf.len()));
        self.file.write_all_at(buf, offset)
    }

    /// The direct handle, when a transfer of `len` bytes at `offset` may use
    /// it: page-aligned and at least `min` long.
    fn direct_for(&self, offset: u64, len: usize, min: usize) -> Option<&File> {
        let d = self.direct.as_ref()?;
        (len >= min && len.is_multiple_of(PAGE) && offset.is_multiple_of(PAGE as u64)).then_some(d)
    }

    /// A large page-aligned write straight to the device (`Ok(false)`: not
    /// applicable, write through the page cache).
    fn write_direct_large(&self, offset: u64, buf: &[u8]) -> std::io::Result<bool> {
        match self.direct_for(offset, buf.len(), DIRECT_MIN) {
            Some(d) => direct_done(direct_write(d, offset, buf)),
            None => Ok(false),
        }
    }

    /// A large page-aligned read straight from the device (`Ok(false)`: not
    /// applicable, read through the page cache).
    fn read_direct_large(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<bool> {
        let Some(d) = self.direct_for(offset, buf.len(), DIRECT_READ_MIN) else {
            return Ok(false);
        };
        let r = if (buf.as_ptr() as usize).is_multiple_of(PAGE) {
            d.read_exact_at(buf, offset)
        } else {
            let mut a = AlignedBuf::new(buf.len());
            d.read_exact_at(a.as_mut(), offset)
                .map(|()| buf.copy_from_slice(a.as_ref()))
        };
        direct_done(r)
    }

    /// A sector-aligned write shorter than a page, as exactly that many bytes on
    /// the device. `Ok(false)`: not applicable here, write through the page cache.
    fn write_direct(&self, offset: u64, buf: &[u8]) -> std::io::Result<bool> {
        let Some(d) = &self.direct else {
            return Ok(false);
        };
        if buf.is_empty()
            || buf.len() >= PAGE
            || !buf.len().is_multiple_of(SECTOR)
            || !offset.is_multiple_of(SECTOR as u64)
        {
            return Ok(false);
        }
        direct_done(direct_write(d, offset, buf))
    }
}

/// Write `buf` through an `O_DIRECT` handle, from page-aligned memory (the
/// caller's when it is, a copy otherwise).
fn direct_write(d: &File, offset: u64, buf: &[u8]) -> std::io::Result<()> {
    if (buf.as_ptr() as usize).is_multiple_of(PAGE) {
        return d.write_all_at(buf, offset);
    }
    let mut a = AlignedBuf::new(buf.len());
    a.as_mut().copy_from_slice(buf);
    d.write_all_at(a.as_ref(), offset)
}

/// `pwritev2` of all of `buf` at `offset` with per-write `flags` (RWF_*),
/// continuing after short writes.
fn pwrite_all_flags(f: &File, buf: &[u8], offset: u64, flags: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0usize;
    while done < buf.len() {
        let rest = &buf[done..];
        let iov = libc::iovec {
            iov_base: rest.as_ptr() as *mut libc::c_void,
            iov_len: rest.len(),
        };
        let off = libc::off_t::try_from(offset + done as u64)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `iov` points into `buf`, which outlives the call; the
        // kernel only reads from it.
        let n = unsafe { libc::pwritev2(f.as_raw_fd(), &iov, 1, off, flags) };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(std::io::ErrorKind::WriteZero.into()),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// The outcome of a direct transfer: done, or not applicable (`Ok(false)`)
/// when the device refuses it (EINVAL: larger logical sectors than the
/// alignment), so the caller uses the page cache.
fn direct_done(r: std::io::Result<()>) -> std::io::Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether a block device could be opened exclusively now (closed again at once).
fn exclusive_probe(path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(path)
    {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(false),
        Err(e) => Err(e),
    }
}

fn is_block_device(file: &File) -> bool {
    use std::os::unix::fs::FileTypeExt;
    file.metadata()
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false)
}

/// Asynchronous direct writes (the batch and FUA rings) against the block
/// device's page cache. Linux drops a block device's cached pages of a
/// range before any direct write (waiting for pages locked for reading:
/// readahead inserts and locks its pages inside the `pread` that starts it)
/// and again after a *synchronous* one, but not after an asynchronous one. A
/// buffered read running meanwhile, or its readahead, which reaches past it,
/// could read old bytes of the range from the device and keep them, for a
/// later small read, or a partial block's read-modify-write, to return; the
/// device drops the range itself when the write is done
/// (`posix_fadvise(DONTNEED)`), which skips locked pages. And a buffered
/// write of part of a page reads the rest of the page from the device
/// first: beside a write in flight to another part of that page, the page
/// would go back to the device with that part's old bytes.
///
/// So, in whole pages: a ring write registers its ranges, then waits for the
/// buffered reads and partial-page writes already under way that touch them;
/// while it is in flight, a buffered read within readahead reach of it reads
/// directly instead, and a buffered partial-page write of one of its pages
/// waits for it to end.
struct RingWrites {
    state: parking_lot::Mutex<RingState>,
    /// Signalled when a ring write or a buffered access ends.
    changed: parking_lot::Condvar,
    /// How far past its end a buffered read may read ahead (twice the
    /// device's readahead, the asynchronous window included).
    window: u64,
}

#[derive(Default)]
struct RingState {
    next: u64,
    /// Ring writes in flight: (id, first byte, end), rounded out to pages.
    writes: Vec<(u64, u64, u64)>,
    /// Buffered reads (with their readahead reach) and partial-page writes
    /// under way: (id, first byte, end).
    buffered: Vec<(u64, u64, u64)>,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn page_down(x: u64) -> u64 {
    x / PAGE as u64 * PAGE as u64
}

fn page_up(x: u64) -> u64 {
    x.div_ceil(PAGE as u64).saturating_mul(PAGE as u64)
}

/// A ring write's ranges, unregistered when dropped.
struct InFlight<'a> {
    w: &'a RingWrites,
    id: u64,
}

/// A buffered access registered with [`RingWrites`], unregistered when dropped.
struct Buffered<'a> {
    w: &'a RingWrites,
    id: u64,
}

impl RingWrites {
    fn new(window: u64) -> RingWrites {
        RingWrites {
            state: parking_lot::Mutex::new(RingState::default()),
            changed: parking_lot::Condvar::new(),
            window,
        }
    }

    /// Register `(offset, len)` ranges about to be written through a ring
    /// and wait for the buffered accesses under way that touch their pages.
    fn begin(&self, ranges: &[(u64, usize)]) -> InFlight<'_> {
        let pages: Vec<(u64, u64)> = ranges
            .iter()
            .map(|&(o, l)| (page_down(o), page_up(o.saturating_add(l as u64))))
            .collect();
        let mut st = self.state.lock();
        st.next += 1;
        let id = st.next;
        for &(s, e) in &pages {
            st.writes.push((id, s, e));
        }
        // Only for accesses registered before it: a partial-page write
        // registers before it waits for older ring writes, and is served
        // before any ring write that comes after it (first come, first
        // served; the waits follow ids, so they cannot form a cycle).
        while st
            .buffered
            .iter()
            .any(|&(b, s, e)| b < id && pages.iter().any(|&p| overlaps(p, (s, e))))
        {
            self.changed.wait(&mut st);
        }
        InFlight { w: self, id }
    }

    /// A buffered read of `len` bytes at `offset`: registered (`Some`) when
    /// no ring write is in flight within its reach, `None` when it must read
    /// directly. Its reach is the readahead window past it, or twice its
    /// length if larger (a large read raises the readahead it starts).
    fn read(&self, offset: u64, len: usize) -> Option<Buffered<'_>> {
        let end = offset.saturating_add(len as u64);
        let reach = (
            page_down(offset),
            end.saturating_add(self.window.max(2 * len as u64)),
        );
        let mut st = self.state.lock();
        if st.writes.iter().any(|&(_, s, e)| overlaps(reach, (s, e))) {
            return None;
        }
        st.next += 1;
        let id = st.next;
        st.buffered.push((id, reach.0, reach.1));
        Some(Buffered { w: self, id })
    }

    /// A buffered write of `len` bytes at `offset`: when it covers part of a
    /// page, waits until no ring write in flight touches its pages, and is
    /// registered until it is done (the kernel reads the rest of the page).
    fn write(&self, offset: u64, len: usize) -> Option<Buffered<'_>> {
        let end = offset.saturating_add(len as u64);
        if offset.is_multiple_of(PAGE as u64) && end.is_multiple_of(PAGE as u64) {
            return None;
        }
        let pages = (page_down(offset), page_up(end));
        let mut st = self.state.lock();
        st.next += 1;
        let id = st.next;
        st.buffered.push((id, pages.0, pages.1));
        while st
            .writes
            .iter()
            .any(|&(w, s, e)| w < id && overlaps(pages, (s, e)))
        {
            self.changed.wait(&mut st);
        }
        Some(Buffered { w: self, id })
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.w.state.lock().writes.retain(|x| x.0 != self.id);
        self.w.changed.notify_all();
    }
}

impl Drop for Buffered<'_> {
    fn drop(&mut self) {
        self.w.state.lock().buffered.retain(|x| x.0 != self.id);
        self.w.changed.notify_all();
    }
}

/// Twice the block device's readahead (`BLKRAGET`, in 512-byte sectors),
/// at least 1 MiB; 8 MiB when it cannot be read.
fn readahead_window(f: &File) -> u64 {
    use std::os::fd::AsRawFd;
    const BLKRAGET: libc::c_ulong = 0x1263;
    let mut sectors: libc::c_long = 0;
    // SAFETY: BLKRAGET writes one long through the pointer.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), BLKRAGET as _, &mut sectors) };
    if rc != 0 || sectors < 0 {
        return 8 << 20;
    }
    (sectors as u64).saturating_mul(1024).max(1 << 20)
}

/// A page-aligned, zeroed heap buffer (O_DIRECT needs aligned memory): a
/// caller that reads large ranges into one of these spares the device a
/// bounce buffer and a copy.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation; nothing else points into it.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(1), PAGE).expect("valid layout")
    }
    pub fn new(len: usize) -> AlignedBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }
    pub(crate) fn as_ref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with the same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

/// Size of a regular file or a block device (whose metadata length is 0).
fn device_size(file: &File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    let mut f = file;
    let end = f.seek(SeekFrom::End(0))?;
    f.seek(SeekFrom::Start(0))?;
    Ok(end)
}

impl BlockDevice for FileDevice {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> Result<()> {
        check_range(offset, buf.len(), self.size)?;
        let len = buf.len();
        let io = |source| DeviceError::Io {
            offset,
            len,
            source,
        };
        if !self.read_direct_large(offset, buf).map_err(io)? {
            self.read_buffered(offset, buf).map_err(io)?;
        }
        self.stats.record_read(cat, buf.len());
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> Result<()> {
        self.write(offset, buf, cat, fua, false)
    }
    fn write_sectors(&self, offset: u64, buf: &[u8], cat: IoCategory) -> Result<()> {
        self.write(offset, buf, cat, false, true)
    }
    /// The large page-aligned writes go to the device together through the
    /// batch ring ([`uring::Ring::write_batch`]), up to [`BATCH_DEPTH`] in
    /// flight, instead of one synchronous direct write after another; the
    /// others through the page cache as `write_at` would.
    fn write_batch(&self, writes: &[(u64, &[&[u8]])], cat: IoCategory) -> Result<()> {
        use std::os::fd::AsRawFd;
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        let ring = self.batch.as_ref().filter(|r| r.usable());
        let (mut bufs, mut offs, mut idx) = (Vec::new(), Vec::new(), Vec::new());
        let mut joined = Vec::new();
        for (k, &(offset, pieces)) in writes.iter().enumerate() {
            let len: usize = pieces.iter().map(|p| p.len()).sum();
            check_range(offset, len, self.size)?;
            if ring.is_some() && self.direct_for(offset, len, DIRECT_MIN).is_some() {
                let mut a = AlignedBuf::new(len);
                let mut at = 0;
                for p in pieces {
                    a.as_mut()[at..at + p.len()].copy_from_slice(p);
                    at += p.len();
                }
                bufs.push(a);
                offs.push(offset);
                idx.push(k);
            } else {
                self.write(offset, join(pieces, &mut joined), cat, false, false)?;
            }
        }
        let (Some(ring), Some(d)) = (ring, &self.direct) else {
            return Ok(());
        };
        if bufs.is_empty() {
            return Ok(());
        }
        let io = |offset: u64, len: usize, source| DeviceError::Io {
            offset,
            len,
            source,
        };
        let ranges: Vec<(u64, usize)> =
            offs.iter().zip(&bufs).map(|(&o, b)| (o, b.len())).collect();
        let in_flight = self.ring_writes.begin(&ranges);
        let done = ring.write_batch(d.as_raw_fd(), bufs, &offs);
        // Every write of the batch has completed (or the ring failed: then
        // an entry may still be queued, and land later with these same
        // bytes, which are written again below). What they wrote leaves the
        // page cache before the partial-page writes waiting for them go on;
        // the fallbacks below must not wait for their own batch.
        if let Ok((bufs, res)) = &done {
            for ((b, r), &off) in bufs.iter().zip(res).zip(&offs) {
                let written = if *r >= 0 {
                    (*r as usize).min(b.as_ref().len())
                } else {
                    0
                };
                self.drop_cached(off, written);
            }
        }
        drop(in_flight);
        let (bufs, res) = match done {
            Ok(r) => r,
            Err(_) => {
                // The ring itself failed (it is not used again; its buffers
                // are leaked): write them all synchronously, the same bytes.
                for &k in &idx {
                    let (offset, pieces) = writes[k];
                    self.write(offset, join(pieces, &mut joined), cat, false, false)?;
                }
                return Ok(());
            }
        };
        for ((b, r), &off) in bufs.iter().zip(res).zip(&offs) {
            let b = b.as_ref();
            match r {
                // Written, and dropped from the page cache above.
                n if n >= 0 && n as usize == b.len() => {}
                // Refused (alignment), or short: the rest through the page cache.
                n if n == -libc::EINVAL || n >= 0 => {
                    let done = n.max(0) as usize;
                    self.write_buffered(off + done as u64, &b[done..])
                        .map_err(|e| io(off, b.len(), e))?;
                }
                // Anything else (EAGAIN, ECANCELED, an I/O error): once more,
                // synchronously; its error is the answer.
                _ => d.write_all_at(b, off).map_err(|e| io(off, b.len(), e))?,
            }
            self.stats.record_write(cat, b.len(), false);
        }
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data().map_err(|source| DeviceError::Io {
            offset: 0,
            len: 0,
            source,
        })?;
        self.stats.record_flush();
        Ok(())
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

/// A device held in memory; used by unit tests and the crash harness.
pub struct MemDevice {
    data: RwLock<Vec<u8>>,
    read_only: bool,
    stats: IoStats,
}

impl MemDevice {
    pub fn new(size: usize) -> Self {
        Self::from_vec(vec![0; size])
    }
    pub fn from_vec(data: Vec<u8>) -> Self {
        MemDevice {
            data: RwLock::new(data),
            read_only: false,
            stats: IoStats::default(),
        }
    }
    /// Load a whole image file into memory.
    pub fn from_file(path: &Path) -> Result<Self> {
        let data = std::fs::read(path).map_err(|source| DeviceError::Open {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self::from_vec(data))
    }
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }
    /// A copy of the whole device content.
    pub fn contents(&self) -> Vec<u8> {
        self.data.read().clone()
    }
}

impl BlockDevice for MemDevice {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> Result<()> {
        let d = self.data.read();
        check_range(offset, buf.len(), d.len() as u64)?;
        let o = offset as usize;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        self.stats.record_read(cat, buf.len());
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8], cat: IoCategory, fua: bool) -> Result<()> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        let mut d = self.data.write();
        check_range(offset, buf.len(), d.len() as u64)?;
        let o = offset as usize;
        d[o..o + buf.len()].copy_from_slice(buf);
        self.stats.record_write(cat, buf.len(), fua);
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        self.stats.record_flush();
        Ok(())
    }
    fn size(&self) -> u64 {
        self.data.read().len() as u64
    }
    fn is_read_only(&self) -> bool {
        self.read_only
    }
    fn stats(&self) -> &IoStats {
        &self.stats
    }
}

/// Shared handle to a device.
pub type DeviceRef = Arc<dyn BlockDevice>;

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `dev` (a block device) cached in `[at, at + span)`, as page
    /// indexes from `at` (mincore(2) on a mapping of the device).
    fn cached_pages(dev: &Path, at: u64, span: usize) -> Vec<usize> {
        use std::os::fd::AsRawFd;
        let f = File::open(dev).unwrap();
        // SAFETY: a read-only mapping of `span` bytes of an open device,
        // unmapped before returning; mincore fills one byte per page.
        unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                at as libc::off_t,
            );
            assert_ne!(map, libc::MAP_FAILED);
            let mut pages = vec![0u8; span / PAGE];
            assert_eq!(libc::mincore(map, span, pages.as_mut_ptr()), 0);
            libc::munmap(map, span);
            pages
                .iter()
                .enumerate()
                .filter(|(_, v)| **v & 1 != 0)
                .map(|(i, _)| i)
                .collect()
        }
    }

    /// While a ring write is in flight, buffered reads within readahead
    /// reach of its range read directly: no page of the device is cached by
    /// them (a readahead there could keep bytes older than the write, which
    /// the kernel does not drop after an asynchronous direct write). Before
    /// and after, reads go through the page cache and read ahead. Needs root
    /// (losetup), as the crate's other block-device tests.
    #[test]
    fn buffered_reads_near_a_ring_write_cache_nothing() {
        use std::os::fd::AsRawFd;
        const MIB: u64 = 1 << 20;
        let img = crate::testutil::Image::new("ringra", 16 * MIB);
        let attached = crate::testutil::Loop::attach(&img.0, false);
        let lo = attached.0.clone();
        let dev = FileDevice::open(Path::new(&lo), false).unwrap();
        assert!(dev.direct.is_some(), "a block device has a direct handle");
        let drop_all = || {
            let f = File::open(&lo).unwrap();
            // SAFETY: a valid descriptor; advice only.
            assert_eq!(
                unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) },
                0
            );
        };
        // Two 64 KiB reads one after the other, 1 MiB before the write's
        // range: a sequential stream the kernel reads ahead of.
        let two_reads = || {
            let mut b = vec![0u8; 64 << 10];
            dev.read_at(4 * MIB, &mut b, IoCategory::Data).unwrap();
            dev.read_at(4 * MIB + (64 << 10), &mut b, IoCategory::Data)
                .unwrap();
        };
        drop_all();
        let in_flight = dev.ring_writes.begin(&[(5 * MIB, 256 << 10)]);
        two_reads();
        let during = cached_pages(Path::new(&lo), 4 * MIB, 4 * MIB as usize);
        drop(in_flight);
        drop_all();
        two_reads();
        let after = cached_pages(Path::new(&lo), 4 * MIB, 4 * MIB as usize);
        assert!(during.is_empty(), "cached during the write: {during:?}");
        assert!(
            after.len() > 32,
            "the reads after it went through the page cache and read ahead: {after:?}"
        );
        // A write of one 512-byte sector: its whole page is off limits, and
        // a buffered write of another part of that page (which reads the
        // page first) waits for it.
        drop_all();
        let in_flight = dev.ring_writes.begin(&[(8 * MIB, 512)]);
        let mut b = vec![0u8; 512];
        dev.read_at(8 * MIB + 1024, &mut b, IoCategory::Metadata)
            .unwrap();
        let during = cached_pages(Path::new(&lo), 8 * MIB, PAGE);
        assert!(
            during.is_empty(),
            "the sector's page cached during its write"
        );
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                dev.write_at(8 * MIB + 1024, &[7u8; 1024], IoCategory::Journal, false)
                    .unwrap();
                tx.send(()).unwrap();
            });
            assert!(
                rx.recv_timeout(std::time::Duration::from_millis(300))
                    .is_err(),
                "a partial-page buffered write went ahead beside a write of its page"
            );
            drop(in_flight);
            rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
        });
        let st = dev.ring_writes.state.lock();
        assert!(st.writes.is_empty() && st.buffered.is_empty());
    }

    /// What a caller hands to a direct read: page-aligned and zeroed, of
    /// every size (an unaligned buffer costs the device a bounce copy).
    #[test]
    fn aligned_buf_is_page_aligned_and_zeroed() {
        for len in [0usize, 1, 4096, 4097, 1 << 20] {
            let mut b = AlignedBuf::new(len);
            assert_eq!(b.len(), len);
            assert!((b.as_ptr() as usize).is_multiple_of(PAGE), "len {len}");
            assert!(b.iter().all(|&x| x == 0), "len {len}");
            b.fill(9);
            let moved = std::thread::spawn(move || b.iter().map(|&x| x as usize).sum::<usize>())
                .join()
                .unwrap();
            assert_eq!(moved, 9 * len);
        }
    }

    #[test]
    fn mem_device_counts_every_io() {
        let d = MemDevice::new(8192);
        d.write_at(4096, &[7u8; 4096], IoCategory::Metadata, false)
            .unwrap();
        d.write_at(0, &[1u8; 512], IoCategory::Journal, true)
            .unwrap();
        d.flush().unwrap();
        let mut b = [0u8; 4096];
        d.read_at(4096, &mut b, IoCategory::Data).unwrap();
        assert_eq!(b, [7u8; 4096]);
        let s = d.stats().snapshot();
        assert_eq!(s.metadata.writes, 1);
        assert_eq!(s.metadata.write_bytes, 4096);
        assert_eq!(s.journal.fua_writes, 1);
        assert_eq!(s.data.reads, 1);
        assert_eq!(s.flushes, 1);
        assert_eq!(s.total_writes(), 2);
        assert!(d.read_at(8000, &mut b, IoCategory::Data).is_err());
    }

    #[test]
    fn file_device_round_trip_and_read_only() {
        let dir = std::env::temp_dir().join(format!("commitfs-dev-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 65536]).unwrap();
        {
            let d = FileDevice::open(&dir, false).unwrap();
            assert_eq!(d.size(), 65536);
            d.write_at(1024, b"hello", IoCategory::Data, true).unwrap();
            let mut b = [0u8; 5];
            d.read_at(1024, &mut b, IoCategory::Data).unwrap();
            assert_eq!(&b, b"hello");
            assert_eq!(d.stats().snapshot().data.fua_writes, 1);
        }
        let ro = FileDevice::open(&dir, true).unwrap();
        assert!(matches!(
            ro.write_at(0, b"x", IoCategory::Data, false),
            Err(DeviceError::ReadOnly)
        ));
        std::fs::remove_file(&dir).unwrap();
    }
}
