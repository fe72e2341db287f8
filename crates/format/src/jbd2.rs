//! JBD2 journal superblock (`journal_superblock_t`, ext4-format.md §8.2).
//!
//! All JBD2 fields are big-endian. This module only parses and reports the
//! superblock (what `commitfs info` shows); the journal writer has its own needs.

use crate::bytes::{be32, put_be32};
use crate::csum::crc32c_raw;
use crate::error::{FormatError, Result};

/// `h_magic` of every JBD2 metadata block (§8.3).
pub const JBD2_MAGIC: u32 = 0xC03B_3998;
/// Size of the journal superblock in bytes.
pub const SUPERBLOCK_SIZE: usize = 1024;

/// Block types in `h_blocktype` (§8.3).
pub const BLOCKTYPE_DESCRIPTOR: u32 = 1;
pub const BLOCKTYPE_COMMIT: u32 = 2;
pub const BLOCKTYPE_SUPERBLOCK_V1: u32 = 3;
pub const BLOCKTYPE_SUPERBLOCK_V2: u32 = 4;
pub const BLOCKTYPE_REVOKE: u32 = 5;

// Field offsets (§8.2).
pub const H_MAGIC: usize = 0x000;
pub const H_BLOCKTYPE: usize = 0x004;
pub const H_SEQUENCE: usize = 0x008;
pub const S_BLOCKSIZE: usize = 0x00C;
pub const S_MAXLEN: usize = 0x010;
pub const S_FIRST: usize = 0x014;
pub const S_SEQUENCE: usize = 0x018;
pub const S_START: usize = 0x01C;
pub const S_ERRNO: usize = 0x020;
pub const S_FEATURE_COMPAT: usize = 0x024;
pub const S_FEATURE_INCOMPAT: usize = 0x028;
pub const S_FEATURE_RO_COMPAT: usize = 0x02C;
pub const S_UUID: usize = 0x030;
pub const S_NR_USERS: usize = 0x040;
pub const S_CHECKSUM_TYPE: usize = 0x050;
pub const S_NUM_FC_BLKS: usize = 0x054;
pub const S_HEAD: usize = 0x058;
pub const S_CHECKSUM: usize = 0x0FC;

// Feature bits (§8.4).
pub const COMPAT_CHECKSUM: u32 = 0x1;
pub const INCOMPAT_REVOKE: u32 = 0x01;
pub const INCOMPAT_64BIT: u32 = 0x02;
pub const INCOMPAT_ASYNC_COMMIT: u32 = 0x04;
pub const INCOMPAT_CSUM_V2: u32 = 0x08;
pub const INCOMPAT_CSUM_V3: u32 = 0x10;
pub const INCOMPAT_FAST_COMMIT: u32 = 0x20;
/// Incompat bits current kernels and e2fsprogs know.
pub const KNOWN_INCOMPAT: u32 = 0x3F;

/// `s_checksum_type` value for crc32c.
pub const CHECKSUM_TYPE_CRC32C: u8 = 4;

/// Fast-commit blocks assumed when `s_num_fc_blks` is 0 (§8.2).
pub const DEFAULT_FC_BLOCKS: u32 = 256;

const STRUCT: &str = "journal superblock";

/// Names of JBD2 compat feature bits.
pub const COMPAT_NAMES: &[(u32, &str)] = &[(COMPAT_CHECKSUM, "journal_checksum")];
/// Names of JBD2 incompat feature bits (e2fsprogs spelling where it has one).
pub const INCOMPAT_NAMES: &[(u32, &str)] = &[
    (INCOMPAT_REVOKE, "journal_incompat_revoke"),
    (INCOMPAT_64BIT, "journal_64bit"),
    (INCOMPAT_ASYNC_COMMIT, "journal_async_commit"),
    (INCOMPAT_CSUM_V2, "journal_checksum_v2"),
    (INCOMPAT_CSUM_V3, "journal_checksum_v3"),
    (INCOMPAT_FAST_COMMIT, "journal_fast_commit"),
];

fn names(table: &[(u32, &str)], mask: u32, prefix: &str) -> Vec<String> {
    (0..32)
        .map(|i| 1u32 << i)
        .filter(|b| mask & b != 0)
        .map(|b| {
            table
                .iter()
                .find(|(v, _)| *v == b)
                .map(|(_, n)| n.to_string())
                .unwrap_or_else(|| format!("{prefix}{}", b.trailing_zeros()))
        })
        .collect()
}

/// A parsed JBD2 superblock (the fields `info` and a journal replay need).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalSuperblock {
    pub blocktype: u32,
    pub blocksize: u32,
    /// Total journal blocks, including the fast-commit area.
    pub maxlen: u32,
    /// First log block (1 for an internal journal).
    pub first: u32,
    /// Tid expected at `start`.
    pub sequence: u32,
    /// Log block of the oldest live transaction; 0 = journal empty (§8.11).
    pub start: u32,
    pub errno: i32,
    pub feature_compat: u32,
    pub feature_incompat: u32,
    pub feature_ro_compat: u32,
    pub uuid: [u8; 16],
    pub nr_users: u32,
    pub checksum_type: u8,
    /// Raw `s_num_fc_blks` (0 means [`DEFAULT_FC_BLOCKS`] when fast commits are on).
    pub num_fc_blks: u32,
    pub checksum: u32,
}

impl JournalSuperblock {
    /// Parse and validate the first 1024 bytes of journal block 0. `block` is the
    /// file-system block it was read from (for error messages). Checks the magic, the
    /// block type, the block size and `s_first`; with CSUM_V2/V3 also the checksum.
    pub fn parse(b: &[u8], block: u64) -> Result<JournalSuperblock> {
        if b.len() < SUPERBLOCK_SIZE {
            return Err(FormatError::corrupt(
                STRUCT,
                block,
                format!("short read ({} bytes)", b.len()),
            ));
        }
        let magic = be32(b, H_MAGIC);
        if magic != JBD2_MAGIC {
            return Err(FormatError::BadMagic {
                structure: STRUCT,
                block,
                found: magic,
            });
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[S_UUID..S_UUID + 16]);
        let sb = JournalSuperblock {
            blocktype: be32(b, H_BLOCKTYPE),
            blocksize: be32(b, S_BLOCKSIZE),
            maxlen: be32(b, S_MAXLEN),
            first: be32(b, S_FIRST),
            sequence: be32(b, S_SEQUENCE),
            start: be32(b, S_START),
            errno: be32(b, S_ERRNO) as i32,
            feature_compat: be32(b, S_FEATURE_COMPAT),
            feature_incompat: be32(b, S_FEATURE_INCOMPAT),
            feature_ro_compat: be32(b, S_FEATURE_RO_COMPAT),
            uuid,
            nr_users: be32(b, S_NR_USERS),
            checksum_type: b[S_CHECKSUM_TYPE],
            num_fc_blks: be32(b, S_NUM_FC_BLKS),
            checksum: be32(b, S_CHECKSUM),
        };
        let bad = |r: String| Err(FormatError::corrupt(STRUCT, block, r));
        if sb.blocktype != BLOCKTYPE_SUPERBLOCK_V1 && sb.blocktype != BLOCKTYPE_SUPERBLOCK_V2 {
            return bad(format!("block type {} is not a superblock", sb.blocktype));
        }
        if !(1024..=65536).contains(&sb.blocksize) || !sb.blocksize.is_power_of_two() {
            return bad(format!("s_blocksize {} invalid", sb.blocksize));
        }
        if sb.first == 0 || sb.first >= sb.maxlen {
            return bad(format!(
                "s_first {} outside the journal of {} blocks",
                sb.first, sb.maxlen
            ));
        }
        if sb.start != 0 && (sb.start < sb.first || sb.start >= sb.maxlen) {
            return bad(format!(
                "s_start {} outside the log [{}, {})",
                sb.start, sb.first, sb.maxlen
            ));
        }
        if sb.has_csum_v2or3() {
            let computed = compute_checksum(b);
            if computed != sb.checksum {
                return Err(FormatError::BadChecksum {
                    structure: STRUCT,
                    block,
                    stored: sb.checksum,
                    computed,
                });
            }
        }
        Ok(sb)
    }

    /// Whether per-block checksums (v2 or v3) are on.
    pub fn has_csum_v2or3(&self) -> bool {
        self.feature_incompat & (INCOMPAT_CSUM_V2 | INCOMPAT_CSUM_V3) != 0
    }

    /// The log holds transactions that must be replayed (§8.11: `s_start != 0`).
    pub fn has_live_log(&self) -> bool {
        self.start != 0
    }

    /// Fast-commit blocks at the end of the journal, given whether the file system
    /// has the `fast_commit` feature (0 in `s_num_fc_blks` means 256 then).
    pub fn fc_blocks(&self, fs_fast_commit: bool) -> u32 {
        if !fs_fast_commit && self.feature_incompat & INCOMPAT_FAST_COMMIT == 0 {
            return 0;
        }
        if self.num_fc_blks == 0 {
            DEFAULT_FC_BLOCKS
        } else {
            self.num_fc_blks
        }
    }

    pub fn compat_names(&self) -> Vec<String> {
        names(COMPAT_NAMES, self.feature_compat, "FEATURE_C")
    }
    pub fn incompat_names(&self) -> Vec<String> {
        names(INCOMPAT_NAMES, self.feature_incompat, "FEATURE_I")
    }
    pub fn ro_compat_names(&self) -> Vec<String> {
        names(&[], self.feature_ro_compat, "FEATURE_R")
    }
}

/// JBD2 superblock checksum: crc32c over the 1024 bytes with `s_checksum` zeroed
/// (§1.3). `b` must hold at least [`SUPERBLOCK_SIZE`] bytes.
pub fn compute_checksum(b: &[u8]) -> u32 {
    let mut copy = [0u8; SUPERBLOCK_SIZE];
    copy.copy_from_slice(&b[..SUPERBLOCK_SIZE]);
    put_be32(&mut copy, S_CHECKSUM, 0);
    crc32c_raw(0xFFFF_FFFF, &copy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::put_be32;

    fn mkfs_like() -> [u8; SUPERBLOCK_SIZE] {
        let mut b = [0u8; SUPERBLOCK_SIZE];
        put_be32(&mut b, H_MAGIC, JBD2_MAGIC);
        put_be32(&mut b, H_BLOCKTYPE, BLOCKTYPE_SUPERBLOCK_V2);
        put_be32(&mut b, S_BLOCKSIZE, 1024);
        put_be32(&mut b, S_MAXLEN, 4160);
        put_be32(&mut b, S_FIRST, 1);
        put_be32(&mut b, S_SEQUENCE, 1);
        put_be32(&mut b, S_NR_USERS, 1);
        put_be32(&mut b, S_NUM_FC_BLKS, 64);
        b
    }

    #[test]
    fn parses_fresh_mkfs_superblock() {
        let b = mkfs_like();
        let sb = JournalSuperblock::parse(&b, 7).unwrap();
        assert_eq!(sb.blocksize, 1024);
        assert_eq!(sb.maxlen, 4160);
        assert_eq!(sb.first, 1);
        assert_eq!(sb.sequence, 1);
        assert_eq!(sb.start, 0);
        assert!(!sb.has_live_log());
        assert_eq!(sb.fc_blocks(true), 64);
        assert_eq!(sb.fc_blocks(false), 0);
        assert!(sb.incompat_names().is_empty());
    }

    #[test]
    fn rejects_bad_magic_type_and_geometry() {
        let mut b = mkfs_like();
        b[0] ^= 1;
        assert!(matches!(
            JournalSuperblock::parse(&b, 3),
            Err(FormatError::BadMagic { block: 3, .. })
        ));
        let mut b = mkfs_like();
        put_be32(&mut b, H_BLOCKTYPE, BLOCKTYPE_COMMIT);
        assert!(JournalSuperblock::parse(&b, 3).is_err());
        let mut b = mkfs_like();
        put_be32(&mut b, S_FIRST, 5000);
        assert!(JournalSuperblock::parse(&b, 3).is_err());
        let mut b = mkfs_like();
        put_be32(&mut b, S_START, 9999);
        assert!(JournalSuperblock::parse(&b, 3).is_err());
        assert!(JournalSuperblock::parse(&b[..100], 3).is_err());
    }

    #[test]
    fn verifies_checksum_with_csum_v3() {
        let mut b = mkfs_like();
        put_be32(
            &mut b,
            S_FEATURE_INCOMPAT,
            INCOMPAT_CSUM_V3 | INCOMPAT_64BIT,
        );
        b[S_CHECKSUM_TYPE] = CHECKSUM_TYPE_CRC32C;
        let c = compute_checksum(&b);
        put_be32(&mut b, S_CHECKSUM, c);
        let sb = JournalSuperblock::parse(&b, 0).unwrap();
        assert_eq!(
            sb.incompat_names(),
            vec![
                "journal_64bit".to_string(),
                "journal_checksum_v3".to_string()
            ]
        );
        put_be32(&mut b, S_SEQUENCE, 2);
        assert!(matches!(
            JournalSuperblock::parse(&b, 0),
            Err(FormatError::BadChecksum { .. })
        ));
    }

    #[test]
    fn unknown_bits_are_numbered() {
        let mut b = mkfs_like();
        put_be32(&mut b, S_FEATURE_INCOMPAT, 0x40 | INCOMPAT_REVOKE);
        let sb = JournalSuperblock::parse(&b, 0).unwrap();
        assert_eq!(
            sb.incompat_names(),
            vec![
                "journal_incompat_revoke".to_string(),
                "FEATURE_I6".to_string()
            ]
        );
    }
}
