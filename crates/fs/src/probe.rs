//! Reading the primary superblock, and saying clearly why an image cannot be
//! opened at all: empty, unformatted, a damaged superblock that e2fsck can restore
//! from a backup, or an incompat feature commitfs cannot read.

use std::path::{Path, PathBuf};

use commitfs_device::{BlockDevice, IoCategory};
use commitfs_format::superblock::{self as sbf, Superblock};

use crate::error::{FsError, Result};

/// Why an image cannot be opened at all (not even read-only).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "the image is empty ({size} bytes): there is no file system on it yet \
         (make one with `commitfs mkfs IMAGE --size 1G`)"
    )]
    Empty { size: u64 },
    #[error(
        "there is no file system on the image: it holds only zeros where the ext4 \
         superblock belongs (make one with `commitfs mkfs`)"
    )]
    Unformatted,
    #[error(
        "the primary superblock is damaged ({reason}), but the backup at block \
         {backup} is intact: `e2fsck -b {backup} -B {block_size} {}` can restore it \
         from the backup",
        .image.as_deref().map_or("IMAGE".into(), |p| p.display().to_string())
    )]
    DamagedSuperblock {
        reason: String,
        backup: u64,
        block_size: u32,
        image: Option<PathBuf>,
    },
    #[error(
        "unsupported ext4 feature {0}: commitfs cannot read this file system, not even \
         read-only (-o ro); the Linux kernel can mount it"
    )]
    UnsupportedIncompat(String),
}

impl FsError {
    /// Name the image in messages that suggest a command to run on it.
    pub fn with_image(self, image: &Path) -> FsError {
        match self {
            FsError::Open(OpenError::DamagedSuperblock {
                reason,
                backup,
                block_size,
                image: None,
            }) => FsError::Open(OpenError::DamagedSuperblock {
                reason,
                backup,
                block_size,
                image: Some(image.to_owned()),
            }),
            e => e,
        }
    }
}

/// The first backup superblock: group 1 of a file system made with the default
/// `blocks_per_group` (8 × block size), for each possible block size, as e2fsck's
/// `-b` takes it. `(block number, block size)`.
fn backup_superblock(dev: &dyn BlockDevice) -> Option<(u64, u32)> {
    let mut raw = [0u8; sbf::SUPERBLOCK_SIZE];
    for bs in [1024u64, 2048, 4096, 8192, 16384, 32768, 65536] {
        let block = 8 * bs + u64::from(bs == 1024);
        let off = block * bs;
        if off + sbf::SUPERBLOCK_SIZE as u64 > dev.size() {
            continue;
        }
        if dev.read_at(off, &mut raw, IoCategory::Metadata).is_err() {
            continue;
        }
        match Superblock::parse(&raw) {
            Ok(sb) if sb.block_size() as u64 == bs && sb.block_group_nr() == 1 => {
                return Some((block, bs as u32))
            }
            _ => {}
        }
    }
    None
}

/// Read and parse the primary superblock; on failure, an error that says what is
/// there instead.
pub(crate) fn read_superblock(dev: &dyn BlockDevice) -> Result<Superblock> {
    let end = sbf::SUPERBLOCK_OFFSET + sbf::SUPERBLOCK_SIZE as u64;
    if dev.size() < end {
        return Err(OpenError::Empty { size: dev.size() }.into());
    }
    let mut raw = [0u8; sbf::SUPERBLOCK_SIZE];
    dev.read_at(sbf::SUPERBLOCK_OFFSET, &mut raw, IoCategory::Metadata)?;
    let err = match Superblock::parse(&raw) {
        Ok(sb) => return Ok(sb),
        Err(e) => e,
    };
    if let Some((backup, block_size)) = backup_superblock(dev) {
        return Err(OpenError::DamagedSuperblock {
            reason: err.to_string(),
            backup,
            block_size,
            image: None,
        }
        .into());
    }
    if raw.iter().all(|&b| b == 0) {
        return Err(OpenError::Unformatted.into());
    }
    Err(err.into())
}

/// What a tool should report about an image that cannot be opened: the same
/// diagnosis [`crate::Fs::open`] makes (for `commitfs info`).
pub fn check_superblock(dev: &dyn BlockDevice) -> Result<Superblock> {
    read_superblock(dev)
}
