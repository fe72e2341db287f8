//! Pure parse/serialise of ext4 and JBD2 on-disk structures, with checksums.
//!
//! No I/O happens here: every function takes byte slices, so the whole crate can be
//! fuzzed. Layouts follow the kernel's `Documentation/filesystems/ext4` (`§N.M` marks
//! in comments: see the section map in docs/FORMAT.md); each module covers one
//! on-disk structure. ext4 structures are little-endian, JBD2 ones big-endian.

pub mod bytes;
pub mod csum;
pub mod error;

pub mod bitmap;
pub mod group_desc;
pub mod inode;
pub mod superblock;

pub mod dirent;
pub mod dirhash;
pub mod dx;
pub mod extent;
pub mod fast_commit;
pub mod jbd2;
pub mod jbd2_log;
pub mod xattr;

pub use csum::{crc32c_raw, CsumCtx};
pub use error::{FormatError, Result};
