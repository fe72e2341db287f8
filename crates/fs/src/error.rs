//! File-system errors. Semantic variants only; the FUSE layer maps them to errno.

use commitfs_device::DeviceError;
use commitfs_format::FormatError;
use commitfs_journal::JournalError;

pub type Result<T> = std::result::Result<T, FsError>;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("no space left on device")]
    NoSpace,
    #[error("file name too long")]
    NameTooLong,
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("read-only file system")]
    ReadOnly,
    #[error("too many links")]
    TooManyLinks,
    #[error("no such attribute")]
    NoData,
    #[error("attribute value too large")]
    XattrTooBig,
    #[error("file too large")]
    FileTooBig,
    /// lseek SEEK_DATA/SEEK_HOLE at or past the end of the file, or SEEK_DATA
    /// with no data after the offset (ENXIO).
    #[error("no data or hole at or after this offset")]
    NoSuchOffset,
    #[error("operation not permitted: {0}")]
    Permission(&'static str),
    /// EACCES, e.g. a default ACL on a non-directory.
    #[error("permission denied: {0}")]
    AccessDenied(&'static str),
    #[error("operation not supported: {0}")]
    NotSupported(String),
    #[error("cannot mount read-write: unsupported ext4 feature {0}")]
    UnsupportedFeature(String),
    #[error(
        "the journal needs recovery: mount it once with the kernel or run `e2fsck -fy`, then retry"
    )]
    NeedsRecovery,
    #[error("file system corrupt: {0}")]
    Corrupt(#[from] FormatError),
    #[error("file system corrupt: {0}")]
    CorruptMsg(String),
    /// A write of this file's data failed since its last fsync: the data is not
    /// on the device (reported once, by the next fsync; EIO).
    #[error("I/O error: an earlier write of this file's data failed")]
    DataWriteFailed,
    /// `sync` found cached data it could not write back after repeated
    /// commits (no space to map it, or the cache stayed busy); EIO.
    #[error("I/O error: cached data could not be written back")]
    WritebackIncomplete,
    /// Internal: metadata blocks missing from the cache while reads are
    /// deferred ([`crate::Fs`]'s `lock_warm`): the caller reads them without
    /// the file-system lock and runs the operation again. Never returned by
    /// the public API (EIO if it ever were).
    #[error("internal: metadata blocks {0:?} not cached")]
    MetadataMiss(Vec<u64>),
    /// `errors=panic` after an I/O error: the file system serves nothing more.
    #[error("I/O error: file system stopped after a device error (errors=panic)")]
    Shutdown,
    /// The image cannot be opened at all (see [`crate::probe`]).
    #[error(transparent)]
    Open(#[from] crate::probe::OpenError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Journal(#[from] JournalError),
}

/// A warm pass's view of an outcome (`Fs::lock_warm`): a deferred miss ends
/// the pass (`Err`); anything else, error or not, is handed back for the
/// operation itself to act on or report.
pub(crate) fn unless_miss<T>(r: Result<T>) -> Result<Result<T>> {
    match r {
        Err(FsError::MetadataMiss(b)) => Err(FsError::MetadataMiss(b)),
        r => Ok(r),
    }
}

impl FsError {
    /// Corruption found outside a parser (e.g. an inconsistent pointer).
    pub fn corrupt(msg: impl Into<String>) -> Self {
        FsError::CorruptMsg(msg.into())
    }
    /// Whether this error means on-disk corruption (EUCLEAN at the FUSE boundary).
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            FsError::Corrupt(_)
                | FsError::CorruptMsg(_)
                | FsError::Journal(JournalError::Format(_))
                | FsError::Journal(JournalError::BadJournal(_))
                | FsError::Open(crate::probe::OpenError::DamagedSuperblock { .. })
        )
    }
}
