//! The ext4 superblock (ext4-format.md §2): 1024 bytes at byte 1024 of the device.
//!
//! We keep the raw 1024 bytes and expose typed accessors for the fields we use, so
//! that every field we do not understand is preserved bit for bit when we write the
//! superblock back (writer rule "P" in §2.2).

use crate::bytes::*;
use crate::csum::crc32c_raw;
use crate::error::{FormatError, Result};

pub const SUPERBLOCK_OFFSET: u64 = 1024;
pub const SUPERBLOCK_SIZE: usize = 1024;
pub const EXT4_MAGIC: u16 = 0xEF53;

// Field offsets (§2.2).
pub const S_INODES_COUNT: usize = 0x00;
pub const S_BLOCKS_COUNT_LO: usize = 0x04;
pub const S_R_BLOCKS_COUNT_LO: usize = 0x08;
pub const S_FREE_BLOCKS_COUNT_LO: usize = 0x0C;
pub const S_FREE_INODES_COUNT: usize = 0x10;
pub const S_FIRST_DATA_BLOCK: usize = 0x14;
pub const S_LOG_BLOCK_SIZE: usize = 0x18;
pub const S_LOG_CLUSTER_SIZE: usize = 0x1C;
pub const S_BLOCKS_PER_GROUP: usize = 0x20;
pub const S_CLUSTERS_PER_GROUP: usize = 0x24;
pub const S_INODES_PER_GROUP: usize = 0x28;
pub const S_MTIME: usize = 0x2C;
pub const S_WTIME: usize = 0x30;
pub const S_MNT_COUNT: usize = 0x34;
pub const S_MAGIC: usize = 0x38;
pub const S_STATE: usize = 0x3A;
pub const S_REV_LEVEL: usize = 0x4C;
pub const S_FIRST_INO: usize = 0x54;
pub const S_INODE_SIZE: usize = 0x58;
pub const S_BLOCK_GROUP_NR: usize = 0x5A;
pub const S_FEATURE_COMPAT: usize = 0x5C;
pub const S_FEATURE_INCOMPAT: usize = 0x60;
pub const S_FEATURE_RO_COMPAT: usize = 0x64;
pub const S_UUID: usize = 0x68;
pub const S_VOLUME_NAME: usize = 0x78;
pub const S_LAST_MOUNTED: usize = 0x88;
pub const S_RESERVED_GDT_BLOCKS: usize = 0xCE;
pub const S_JOURNAL_INUM: usize = 0xE0;
pub const S_LAST_ORPHAN: usize = 0xE8;
pub const S_HASH_SEED: usize = 0xEC;
pub const S_DEF_HASH_VERSION: usize = 0xFC;
pub const S_DESC_SIZE: usize = 0xFE;
pub const S_FIRST_META_BG: usize = 0x104;
pub const S_MKFS_TIME: usize = 0x108;
pub const S_BLOCKS_COUNT_HI: usize = 0x150;
pub const S_R_BLOCKS_COUNT_HI: usize = 0x154;
pub const S_FREE_BLOCKS_COUNT_HI: usize = 0x158;
pub const S_MIN_EXTRA_ISIZE: usize = 0x15C;
pub const S_WANT_EXTRA_ISIZE: usize = 0x15E;
pub const S_FLAGS: usize = 0x160;
pub const S_LOG_GROUPS_PER_FLEX: usize = 0x174;
pub const S_CHECKSUM_TYPE: usize = 0x175;
pub const S_KBYTES_WRITTEN: usize = 0x178;
pub const S_CHECKSUM_SEED: usize = 0x270;
pub const S_WTIME_HI: usize = 0x274;
pub const S_MTIME_HI: usize = 0x275;
pub const S_ORPHAN_FILE_INUM: usize = 0x280;
pub const S_CHECKSUM: usize = 0x3FC;
pub const S_ERRORS: usize = 0x3C;
pub const S_ERROR_COUNT: usize = 0x194;
pub const S_FIRST_ERROR_TIME: usize = 0x198;
pub const S_FIRST_ERROR_INO: usize = 0x19C;
pub const S_FIRST_ERROR_BLOCK: usize = 0x1A0;
pub const S_FIRST_ERROR_FUNC: usize = 0x1A8;
pub const S_FIRST_ERROR_LINE: usize = 0x1C8;
pub const S_LAST_ERROR_TIME: usize = 0x1CC;
pub const S_LAST_ERROR_INO: usize = 0x1D0;
pub const S_LAST_ERROR_LINE: usize = 0x1D4;
pub const S_LAST_ERROR_BLOCK: usize = 0x1D8;
pub const S_LAST_ERROR_FUNC: usize = 0x1E0;
/// End of the error record that starts at `s_error_count` (ext4's
/// `EXT4_S_ERR_END`, the offset of `s_mount_opts`).
pub const S_ERR_END: usize = 0x200;
pub const S_FIRST_ERROR_TIME_HI: usize = 0x278;
pub const S_LAST_ERROR_TIME_HI: usize = 0x279;
pub const S_FIRST_ERROR_ERRCODE: usize = 0x27A;
pub const S_LAST_ERROR_ERRCODE: usize = 0x27B;

/// `s_errors` values: what the kernel does on an error (ext4-format.md §2).
pub const ERRORS_CONTINUE: u16 = 1;
pub const ERRORS_RO: u16 = 2;
pub const ERRORS_PANIC: u16 = 3;
/// `s_first_error_errcode` / `s_last_error_errcode` for EIO (kernel EXT4_ERR_EIO).
pub const ERR_CODE_EIO: u8 = 2;

// s_state (§2.4).
pub const STATE_VALID_FS: u16 = 0x0001;
pub const STATE_ERROR_FS: u16 = 0x0002;
pub const STATE_ORPHAN_FS: u16 = 0x0004;

// s_flags (§2.5).
pub const FLAGS_SIGNED_HASH: u32 = 0x1;
pub const FLAGS_UNSIGNED_HASH: u32 = 0x2;

// Compat features (§2.3).
pub const COMPAT_DIR_PREALLOC: u32 = 0x0001;
pub const COMPAT_IMAGIC_INODES: u32 = 0x0002;
pub const COMPAT_HAS_JOURNAL: u32 = 0x0004;
pub const COMPAT_EXT_ATTR: u32 = 0x0008;
pub const COMPAT_RESIZE_INODE: u32 = 0x0010;
pub const COMPAT_DIR_INDEX: u32 = 0x0020;
pub const COMPAT_LAZY_BG: u32 = 0x0040;
pub const COMPAT_EXCLUDE_BITMAP: u32 = 0x0100;
pub const COMPAT_SPARSE_SUPER2: u32 = 0x0200;
pub const COMPAT_FAST_COMMIT: u32 = 0x0400;
pub const COMPAT_STABLE_INODES: u32 = 0x0800;
pub const COMPAT_ORPHAN_FILE: u32 = 0x1000;

// Incompat features.
pub const INCOMPAT_COMPRESSION: u32 = 0x0001;
pub const INCOMPAT_FILETYPE: u32 = 0x0002;
pub const INCOMPAT_RECOVER: u32 = 0x0004;
pub const INCOMPAT_JOURNAL_DEV: u32 = 0x0008;
pub const INCOMPAT_META_BG: u32 = 0x0010;
pub const INCOMPAT_EXTENTS: u32 = 0x0040;
pub const INCOMPAT_64BIT: u32 = 0x0080;
pub const INCOMPAT_MMP: u32 = 0x0100;
pub const INCOMPAT_FLEX_BG: u32 = 0x0200;
pub const INCOMPAT_EA_INODE: u32 = 0x0400;
pub const INCOMPAT_DIRDATA: u32 = 0x1000;
pub const INCOMPAT_CSUM_SEED: u32 = 0x2000;
pub const INCOMPAT_LARGEDIR: u32 = 0x4000;
pub const INCOMPAT_INLINE_DATA: u32 = 0x8000;
pub const INCOMPAT_ENCRYPT: u32 = 0x10000;
pub const INCOMPAT_CASEFOLD: u32 = 0x20000;
/// commitfs extension (docs/FORMAT.md): the fast-commit area may hold commits whose
/// data went out under the same flush as the log, guarded by DATA_CSUM records the
/// kernel does not know. Set while mounted with `-o fc_data_csum`, cleared by a clean
/// unmount, so the kernel and e2fsck refuse the image until commitfs has replayed it.
/// The top bit keeps clear of the kernel's allocations, which grow from the bottom.
pub const INCOMPAT_COMMITFS_FC_DATA_CSUM: u32 = 0x8000_0000;

// Read-only compat features.
pub const RO_COMPAT_SPARSE_SUPER: u32 = 0x0001;
pub const RO_COMPAT_LARGE_FILE: u32 = 0x0002;
pub const RO_COMPAT_BTREE_DIR: u32 = 0x0004;
pub const RO_COMPAT_HUGE_FILE: u32 = 0x0008;
pub const RO_COMPAT_GDT_CSUM: u32 = 0x0010;
pub const RO_COMPAT_DIR_NLINK: u32 = 0x0020;
pub const RO_COMPAT_EXTRA_ISIZE: u32 = 0x0040;
pub const RO_COMPAT_HAS_SNAPSHOT: u32 = 0x0080;
pub const RO_COMPAT_QUOTA: u32 = 0x0100;
pub const RO_COMPAT_BIGALLOC: u32 = 0x0200;
pub const RO_COMPAT_METADATA_CSUM: u32 = 0x0400;
pub const RO_COMPAT_REPLICA: u32 = 0x0800;
pub const RO_COMPAT_READONLY: u32 = 0x1000;
pub const RO_COMPAT_PROJECT: u32 = 0x2000;
pub const RO_COMPAT_SHARED_BLOCKS: u32 = 0x4000;
pub const RO_COMPAT_VERITY: u32 = 0x8000;
pub const RO_COMPAT_ORPHAN_PRESENT: u32 = 0x10000;

/// Names of feature bits, as e2fsprogs spells them: (kind, bit, name).
pub const FEATURE_NAMES: &[(FeatureKind, u32, &str)] = &[
    (FeatureKind::Compat, COMPAT_DIR_PREALLOC, "dir_prealloc"),
    (FeatureKind::Compat, COMPAT_IMAGIC_INODES, "imagic_inodes"),
    (FeatureKind::Compat, COMPAT_HAS_JOURNAL, "has_journal"),
    (FeatureKind::Compat, COMPAT_EXT_ATTR, "ext_attr"),
    (FeatureKind::Compat, COMPAT_RESIZE_INODE, "resize_inode"),
    (FeatureKind::Compat, COMPAT_DIR_INDEX, "dir_index"),
    (FeatureKind::Compat, COMPAT_LAZY_BG, "lazy_bg"),
    (
        FeatureKind::Compat,
        COMPAT_EXCLUDE_BITMAP,
        "snapshot_bitmap",
    ),
    (FeatureKind::Compat, COMPAT_SPARSE_SUPER2, "sparse_super2"),
    (FeatureKind::Compat, COMPAT_FAST_COMMIT, "fast_commit"),
    (FeatureKind::Compat, COMPAT_STABLE_INODES, "stable_inodes"),
    (FeatureKind::Compat, COMPAT_ORPHAN_FILE, "orphan_file"),
    (FeatureKind::Incompat, INCOMPAT_COMPRESSION, "compression"),
    (FeatureKind::Incompat, INCOMPAT_FILETYPE, "filetype"),
    (FeatureKind::Incompat, INCOMPAT_RECOVER, "needs_recovery"),
    (FeatureKind::Incompat, INCOMPAT_JOURNAL_DEV, "journal_dev"),
    (FeatureKind::Incompat, INCOMPAT_META_BG, "meta_bg"),
    (FeatureKind::Incompat, INCOMPAT_EXTENTS, "extent"),
    (FeatureKind::Incompat, INCOMPAT_64BIT, "64bit"),
    (FeatureKind::Incompat, INCOMPAT_MMP, "mmp"),
    (FeatureKind::Incompat, INCOMPAT_FLEX_BG, "flex_bg"),
    (FeatureKind::Incompat, INCOMPAT_EA_INODE, "ea_inode"),
    (FeatureKind::Incompat, INCOMPAT_DIRDATA, "dirdata"),
    (
        FeatureKind::Incompat,
        INCOMPAT_CSUM_SEED,
        "metadata_csum_seed",
    ),
    (FeatureKind::Incompat, INCOMPAT_LARGEDIR, "large_dir"),
    (FeatureKind::Incompat, INCOMPAT_INLINE_DATA, "inline_data"),
    (FeatureKind::Incompat, INCOMPAT_ENCRYPT, "encrypt"),
    (FeatureKind::Incompat, INCOMPAT_CASEFOLD, "casefold"),
    (
        FeatureKind::Incompat,
        INCOMPAT_COMMITFS_FC_DATA_CSUM,
        "commitfs_fc_data_csum",
    ),
    (
        FeatureKind::RoCompat,
        RO_COMPAT_SPARSE_SUPER,
        "sparse_super",
    ),
    (FeatureKind::RoCompat, RO_COMPAT_LARGE_FILE, "large_file"),
    (FeatureKind::RoCompat, RO_COMPAT_BTREE_DIR, "btree_dir"),
    (FeatureKind::RoCompat, RO_COMPAT_HUGE_FILE, "huge_file"),
    (FeatureKind::RoCompat, RO_COMPAT_GDT_CSUM, "uninit_bg"),
    (FeatureKind::RoCompat, RO_COMPAT_DIR_NLINK, "dir_nlink"),
    (FeatureKind::RoCompat, RO_COMPAT_EXTRA_ISIZE, "extra_isize"),
    (FeatureKind::RoCompat, RO_COMPAT_HAS_SNAPSHOT, "snapshot"),
    (FeatureKind::RoCompat, RO_COMPAT_QUOTA, "quota"),
    (FeatureKind::RoCompat, RO_COMPAT_BIGALLOC, "bigalloc"),
    (
        FeatureKind::RoCompat,
        RO_COMPAT_METADATA_CSUM,
        "metadata_csum",
    ),
    (FeatureKind::RoCompat, RO_COMPAT_REPLICA, "replica"),
    (FeatureKind::RoCompat, RO_COMPAT_READONLY, "read-only"),
    (FeatureKind::RoCompat, RO_COMPAT_PROJECT, "project"),
    (
        FeatureKind::RoCompat,
        RO_COMPAT_SHARED_BLOCKS,
        "shared_blocks",
    ),
    (FeatureKind::RoCompat, RO_COMPAT_VERITY, "verity"),
    (
        FeatureKind::RoCompat,
        RO_COMPAT_ORPHAN_PRESENT,
        "orphan_present",
    ),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureKind {
    Compat,
    Incompat,
    RoCompat,
}

/// Name of one feature bit ("FEATURE_I17" style for unknown bits, like e2fsprogs).
pub fn feature_name(kind: FeatureKind, bit: u32) -> String {
    FEATURE_NAMES
        .iter()
        .find(|(k, b, _)| *k == kind && *b == bit)
        .map(|(_, _, n)| n.to_string())
        .unwrap_or_else(|| {
            let p = match kind {
                FeatureKind::Compat => 'C',
                FeatureKind::Incompat => 'I',
                FeatureKind::RoCompat => 'R',
            };
            format!("FEATURE_{p}{}", bit.trailing_zeros())
        })
}

/// Names of every bit set in `mask`.
pub fn feature_names(kind: FeatureKind, mask: u32) -> Vec<String> {
    (0..32)
        .map(|i| 1u32 << i)
        .filter(|b| mask & b != 0)
        .map(|b| feature_name(kind, b))
        .collect()
}

/// The superblock's error record ([`Superblock::error_record`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorRecord {
    main: [u8; S_ERR_END - S_ERROR_COUNT],
    tail: [u8; 4],
    error_fs: bool,
}

/// The superblock as raw bytes with typed accessors.
#[derive(Clone, PartialEq, Eq)]
pub struct Superblock {
    raw: Box<[u8; SUPERBLOCK_SIZE]>,
}

impl std::fmt::Debug for Superblock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Superblock")
            .field("blocks", &self.blocks_count())
            .field("inodes", &self.inodes_count())
            .field("block_size", &self.block_size())
            .finish_non_exhaustive()
    }
}

/// Block number used in errors about the primary superblock (it sits at byte 1024).
const SB_ERR_BLOCK: u64 = 0;

impl Superblock {
    /// Parse and validate the primary superblock from its 1024 bytes. Checks magic,
    /// geometry sanity (so that later arithmetic cannot divide by zero or overflow)
    /// and, with `metadata_csum`, the checksum (§1.3).
    pub fn parse(bytes: &[u8]) -> Result<Superblock> {
        let s = "superblock";
        if bytes.len() < SUPERBLOCK_SIZE {
            return Err(FormatError::corrupt(s, SB_ERR_BLOCK, "short read"));
        }
        let mut raw = Box::new([0u8; SUPERBLOCK_SIZE]);
        raw.copy_from_slice(&bytes[..SUPERBLOCK_SIZE]);
        let sb = Superblock { raw };
        let magic = le16(&sb.raw[..], S_MAGIC);
        if magic != EXT4_MAGIC {
            return Err(FormatError::BadMagic {
                structure: s,
                block: SB_ERR_BLOCK,
                found: magic as u32,
            });
        }
        if sb.has_ro_compat(RO_COMPAT_METADATA_CSUM) {
            let stored = sb.checksum();
            let computed = sb.compute_checksum();
            if stored != computed {
                return Err(FormatError::BadChecksum {
                    structure: s,
                    block: SB_ERR_BLOCK,
                    stored,
                    computed,
                });
            }
        }
        sb.validate_geometry()?;
        Ok(sb)
    }

    fn validate_geometry(&self) -> Result<()> {
        let bad = |r: String| Err(FormatError::corrupt("superblock", SB_ERR_BLOCK, r));
        let log = self.log_block_size();
        if log > 6 {
            return bad(format!("s_log_block_size {log} out of range"));
        }
        let bs = self.block_size() as u64;
        if self.rev_level() == 0 {
            return bad("revision 0 (ext2 good old rev) is not supported".into());
        }
        let bpg = self.blocks_per_group() as u64;
        if bpg == 0 || bpg > bs * 8 {
            return bad(format!("s_blocks_per_group {bpg} invalid"));
        }
        let ipg = self.inodes_per_group() as u64;
        if ipg == 0 || ipg > bs * 8 {
            return bad(format!("s_inodes_per_group {ipg} invalid"));
        }
        let isz = self.inode_size() as u64;
        if isz < 128 || !isz.is_power_of_two() || isz > bs {
            return bad(format!("s_inode_size {isz} invalid"));
        }
        if self.blocks_count() <= self.first_data_block() as u64 {
            return bad("block count smaller than first data block".into());
        }
        let fdb = self.first_data_block();
        if (bs == 1024 && fdb != 1) || (bs > 1024 && fdb != 0) {
            return bad(format!(
                "s_first_data_block {fdb} invalid for block size {bs}"
            ));
        }
        if self.has_incompat(INCOMPAT_64BIT) {
            let ds = self.desc_size_raw() as u64;
            if !(32..=1024).contains(&ds) || !ds.is_power_of_two() {
                return bad(format!("s_desc_size {ds} invalid"));
            }
        }
        let groups_wide = self
            .blocks_count()
            .saturating_sub(self.first_data_block() as u64)
            .div_ceil(bpg);
        if groups_wide > u32::MAX as u64 {
            return bad(format!(
                "{} blocks make more than 2^32 groups",
                self.blocks_count()
            ));
        }
        let groups = self.group_count() as u64;
        if groups == 0 || groups * ipg != self.inodes_count() as u64 {
            return bad(format!(
                "s_inodes_count {} != groups {groups} x inodes per group {ipg}",
                self.inodes_count()
            ));
        }
        if self.first_ino() < 11 || self.first_ino() as u64 > self.inodes_count() as u64 {
            return bad(format!("s_first_ino {} invalid", self.first_ino()));
        }
        if self.has_incompat(INCOMPAT_EXTENTS) || self.has_ro_compat(RO_COMPAT_EXTRA_ISIZE) {
            let want = self.want_extra_isize() as u64;
            if isz > 128 && (!want.is_multiple_of(4) || 128 + want > isz) {
                return bad(format!("s_want_extra_isize {want} invalid"));
            }
        }
        Ok(())
    }

    /// A superblock from raw bytes without any validation (for fuzzing and repair tools).
    pub fn from_raw_unchecked(bytes: &[u8; SUPERBLOCK_SIZE]) -> Superblock {
        Superblock {
            raw: Box::new(*bytes),
        }
    }

    pub fn as_bytes(&self) -> &[u8; SUPERBLOCK_SIZE] {
        &self.raw
    }

    /// Serialise with a fresh checksum (when `metadata_csum` is on).
    pub fn to_bytes(&self) -> [u8; SUPERBLOCK_SIZE] {
        let mut out = *self.raw;
        if self.has_ro_compat(RO_COMPAT_METADATA_CSUM) {
            let c = crc32c_raw(0xFFFF_FFFF, &out[..S_CHECKSUM]);
            put_le32(&mut out, S_CHECKSUM, c);
        }
        out
    }

    pub fn compute_checksum(&self) -> u32 {
        crc32c_raw(0xFFFF_FFFF, &self.raw[..S_CHECKSUM])
    }
    pub fn checksum(&self) -> u32 {
        le32(&self.raw[..], S_CHECKSUM)
    }

    fn r32(&self, off: usize) -> u32 {
        le32(&self.raw[..], off)
    }
    fn r16(&self, off: usize) -> u16 {
        le16(&self.raw[..], off)
    }
    fn w32(&mut self, off: usize, v: u32) {
        put_le32(&mut self.raw[..], off, v)
    }
    fn w16(&mut self, off: usize, v: u16) {
        put_le16(&mut self.raw[..], off, v)
    }

    pub fn inodes_count(&self) -> u32 {
        self.r32(S_INODES_COUNT)
    }
    pub fn blocks_count(&self) -> u64 {
        let hi = if self.is_64bit() {
            self.r32(S_BLOCKS_COUNT_HI) as u64
        } else {
            0
        };
        self.r32(S_BLOCKS_COUNT_LO) as u64 | hi << 32
    }
    pub fn r_blocks_count(&self) -> u64 {
        let hi = if self.is_64bit() {
            self.r32(S_R_BLOCKS_COUNT_HI) as u64
        } else {
            0
        };
        self.r32(S_R_BLOCKS_COUNT_LO) as u64 | hi << 32
    }
    pub fn free_blocks_count(&self) -> u64 {
        let hi = if self.is_64bit() {
            self.r32(S_FREE_BLOCKS_COUNT_HI) as u64
        } else {
            0
        };
        self.r32(S_FREE_BLOCKS_COUNT_LO) as u64 | hi << 32
    }
    pub fn set_free_blocks_count(&mut self, v: u64) {
        self.w32(S_FREE_BLOCKS_COUNT_LO, v as u32);
        if self.is_64bit() {
            self.w32(S_FREE_BLOCKS_COUNT_HI, (v >> 32) as u32);
        }
    }
    pub fn free_inodes_count(&self) -> u32 {
        self.r32(S_FREE_INODES_COUNT)
    }
    pub fn set_free_inodes_count(&mut self, v: u32) {
        self.w32(S_FREE_INODES_COUNT, v)
    }
    pub fn first_data_block(&self) -> u32 {
        self.r32(S_FIRST_DATA_BLOCK)
    }
    pub fn log_block_size(&self) -> u32 {
        self.r32(S_LOG_BLOCK_SIZE)
    }
    pub fn block_size(&self) -> usize {
        1024usize << self.log_block_size().min(6)
    }
    pub fn blocks_per_group(&self) -> u32 {
        self.r32(S_BLOCKS_PER_GROUP)
    }
    pub fn clusters_per_group(&self) -> u32 {
        self.r32(S_CLUSTERS_PER_GROUP)
    }
    pub fn inodes_per_group(&self) -> u32 {
        self.r32(S_INODES_PER_GROUP)
    }
    pub fn mtime(&self) -> u32 {
        self.r32(S_MTIME)
    }
    pub fn set_mtime(&mut self, t: u64) {
        self.w32(S_MTIME, t as u32);
        self.raw[S_MTIME_HI] = (t >> 32) as u8;
    }
    pub fn set_wtime(&mut self, t: u64) {
        self.w32(S_WTIME, t as u32);
        self.raw[S_WTIME_HI] = (t >> 32) as u8;
    }
    pub fn mnt_count(&self) -> u16 {
        self.r16(S_MNT_COUNT)
    }
    pub fn set_mnt_count(&mut self, v: u16) {
        self.w16(S_MNT_COUNT, v)
    }
    pub fn magic(&self) -> u16 {
        self.r16(S_MAGIC)
    }
    pub fn state(&self) -> u16 {
        self.r16(S_STATE)
    }
    /// `s_errors`: the behaviour on errors mkfs/tune2fs chose (`ERRORS_*`).
    pub fn errors_behavior(&self) -> u16 {
        self.r16(S_ERRORS)
    }
    pub fn error_count(&self) -> u32 {
        self.r32(S_ERROR_COUNT)
    }
    pub fn last_error_func(&self) -> String {
        let f = &self.raw[S_LAST_ERROR_FUNC..S_LAST_ERROR_FUNC + 32];
        let n = f.iter().position(|&b| b == 0).unwrap_or(32);
        String::from_utf8_lossy(&f[..n]).into_owned()
    }
    /// The error record (`s_error_count` .. `s_last_error_func`, the time high
    /// bytes and error codes) and the ERROR_FS state bit, to carry across a
    /// journal replay that rewrites the superblock (as the kernel does in
    /// `ext4_load_journal`).
    pub fn error_record(&self) -> ErrorRecord {
        let mut r = ErrorRecord {
            main: [0; S_ERR_END - S_ERROR_COUNT],
            tail: [0; 4],
            error_fs: self.state() & STATE_ERROR_FS != 0,
        };
        r.main.copy_from_slice(&self.raw[S_ERROR_COUNT..S_ERR_END]);
        r.tail
            .copy_from_slice(&self.raw[S_FIRST_ERROR_TIME_HI..S_LAST_ERROR_ERRCODE + 1]);
        r
    }
    /// Put back a record taken with [`Self::error_record`] (ERROR_FS is only
    /// ever added, never cleared: e2fsck clears it).
    pub fn set_error_record(&mut self, r: &ErrorRecord) {
        self.raw[S_ERROR_COUNT..S_ERR_END].copy_from_slice(&r.main);
        self.raw[S_FIRST_ERROR_TIME_HI..S_LAST_ERROR_ERRCODE + 1].copy_from_slice(&r.tail);
        if r.error_fs {
            self.set_state(self.state() | STATE_ERROR_FS);
        }
    }
    /// Record one error as ext4's `save_error_info` + `ext4_update_super` do:
    /// ERROR_FS set, the count bumped, the first-error fields filled once and
    /// the last-error fields every time.
    pub fn note_error(&mut self, time: u64, ino: u32, block: u64, func: &str, line: u32, code: u8) {
        self.set_state(self.state() | STATE_ERROR_FS);
        let mut name = [0u8; 32];
        let n = func.len().min(32);
        name[..n].copy_from_slice(&func.as_bytes()[..n]);
        if self.r32(S_FIRST_ERROR_TIME) == 0 && self.raw[S_FIRST_ERROR_TIME_HI] == 0 {
            self.w32(S_FIRST_ERROR_TIME, time as u32);
            self.raw[S_FIRST_ERROR_TIME_HI] = (time >> 32) as u8;
            self.w32(S_FIRST_ERROR_INO, ino);
            put_le64(&mut self.raw[..], S_FIRST_ERROR_BLOCK, block);
            self.raw[S_FIRST_ERROR_FUNC..S_FIRST_ERROR_FUNC + 32].copy_from_slice(&name);
            self.w32(S_FIRST_ERROR_LINE, line);
            self.raw[S_FIRST_ERROR_ERRCODE] = code;
        }
        self.w32(S_LAST_ERROR_TIME, time as u32);
        self.raw[S_LAST_ERROR_TIME_HI] = (time >> 32) as u8;
        self.w32(S_LAST_ERROR_INO, ino);
        put_le64(&mut self.raw[..], S_LAST_ERROR_BLOCK, block);
        self.raw[S_LAST_ERROR_FUNC..S_LAST_ERROR_FUNC + 32].copy_from_slice(&name);
        self.w32(S_LAST_ERROR_LINE, line);
        self.raw[S_LAST_ERROR_ERRCODE] = code;
        self.w32(S_ERROR_COUNT, self.error_count().saturating_add(1));
    }
    pub fn set_state(&mut self, v: u16) {
        self.w16(S_STATE, v)
    }
    pub fn rev_level(&self) -> u32 {
        self.r32(S_REV_LEVEL)
    }
    pub fn first_ino(&self) -> u32 {
        self.r32(S_FIRST_INO)
    }
    pub fn inode_size(&self) -> u16 {
        self.r16(S_INODE_SIZE)
    }
    pub fn block_group_nr(&self) -> u16 {
        self.r16(S_BLOCK_GROUP_NR)
    }
    pub fn feature_compat(&self) -> u32 {
        self.r32(S_FEATURE_COMPAT)
    }
    pub fn feature_incompat(&self) -> u32 {
        self.r32(S_FEATURE_INCOMPAT)
    }
    pub fn feature_ro_compat(&self) -> u32 {
        self.r32(S_FEATURE_RO_COMPAT)
    }
    pub fn set_feature_incompat(&mut self, v: u32) {
        self.w32(S_FEATURE_INCOMPAT, v)
    }
    pub fn set_feature_ro_compat(&mut self, v: u32) {
        self.w32(S_FEATURE_RO_COMPAT, v)
    }
    pub fn set_feature_compat(&mut self, v: u32) {
        self.w32(S_FEATURE_COMPAT, v)
    }
    pub fn has_compat(&self, f: u32) -> bool {
        self.feature_compat() & f != 0
    }
    pub fn has_incompat(&self, f: u32) -> bool {
        self.feature_incompat() & f != 0
    }
    pub fn has_ro_compat(&self, f: u32) -> bool {
        self.feature_ro_compat() & f != 0
    }
    pub fn is_64bit(&self) -> bool {
        self.has_incompat(INCOMPAT_64BIT)
    }
    pub fn metadata_csum(&self) -> bool {
        self.has_ro_compat(RO_COMPAT_METADATA_CSUM)
    }
    pub fn uuid(&self) -> [u8; 16] {
        self.raw[S_UUID..S_UUID + 16].try_into().unwrap()
    }
    pub fn volume_name(&self) -> String {
        let v = &self.raw[S_VOLUME_NAME..S_VOLUME_NAME + 16];
        let end = v.iter().position(|&b| b == 0).unwrap_or(16);
        String::from_utf8_lossy(&v[..end]).into_owned()
    }
    pub fn set_last_mounted(&mut self, path: &[u8]) {
        let dst = &mut self.raw[S_LAST_MOUNTED..S_LAST_MOUNTED + 64];
        dst.fill(0);
        let n = path.len().min(63);
        dst[..n].copy_from_slice(&path[..n]);
    }
    pub fn reserved_gdt_blocks(&self) -> u16 {
        self.r16(S_RESERVED_GDT_BLOCKS)
    }
    pub fn journal_inum(&self) -> u32 {
        self.r32(S_JOURNAL_INUM)
    }
    pub fn last_orphan(&self) -> u32 {
        self.r32(S_LAST_ORPHAN)
    }
    pub fn set_last_orphan(&mut self, v: u32) {
        self.w32(S_LAST_ORPHAN, v)
    }
    pub fn hash_seed(&self) -> [u32; 4] {
        [0, 1, 2, 3].map(|i| self.r32(S_HASH_SEED + 4 * i))
    }
    pub fn def_hash_version(&self) -> u8 {
        self.raw[S_DEF_HASH_VERSION]
    }
    fn desc_size_raw(&self) -> u16 {
        self.r16(S_DESC_SIZE)
    }
    /// Group descriptor size: `s_desc_size` with 64bit, else 32 (§3.1).
    pub fn desc_size(&self) -> usize {
        if self.is_64bit() {
            self.desc_size_raw() as usize
        } else {
            32
        }
    }
    pub fn min_extra_isize(&self) -> u16 {
        self.r16(S_MIN_EXTRA_ISIZE)
    }
    pub fn want_extra_isize(&self) -> u16 {
        self.r16(S_WANT_EXTRA_ISIZE)
    }
    pub fn flags(&self) -> u32 {
        self.r32(S_FLAGS)
    }
    pub fn log_groups_per_flex(&self) -> u8 {
        self.raw[S_LOG_GROUPS_PER_FLEX]
    }
    pub fn checksum_type(&self) -> u8 {
        self.raw[S_CHECKSUM_TYPE]
    }
    pub fn kbytes_written(&self) -> u64 {
        le64(&self.raw[..], S_KBYTES_WRITTEN)
    }
    pub fn set_kbytes_written(&mut self, v: u64) {
        put_le64(&mut self.raw[..], S_KBYTES_WRITTEN, v)
    }
    pub fn checksum_seed(&self) -> u32 {
        self.r32(S_CHECKSUM_SEED)
    }
    pub fn orphan_file_inum(&self) -> u32 {
        self.r32(S_ORPHAN_FILE_INUM)
    }
    pub fn mkfs_time(&self) -> u32 {
        self.r32(S_MKFS_TIME)
    }

    /// Number of block groups (§2.2 derived quantities).
    pub fn group_count(&self) -> u32 {
        let bpg = self.blocks_per_group().max(1) as u64;
        let data = self
            .blocks_count()
            .saturating_sub(self.first_data_block() as u64);
        data.div_ceil(bpg) as u32
    }

    /// Blocks occupied by the primary group descriptor table.
    pub fn gdt_blocks(&self) -> u64 {
        (self.group_count() as u64 * self.desc_size() as u64).div_ceil(self.block_size() as u64)
    }

    /// `fs_seed` for metadata checksums (§1.2).
    pub fn csum_seed(&self) -> u32 {
        if self.has_incompat(INCOMPAT_CSUM_SEED) {
            self.checksum_seed()
        } else {
            crc32c_raw(0xFFFF_FFFF, &self.uuid())
        }
    }

    /// Effective directory hash version for an htree root's `hash_version` (§2.5).
    pub fn effective_hash_version(&self, root_version: u8) -> u8 {
        if self.flags() & FLAGS_UNSIGNED_HASH != 0 && root_version <= 2 {
            root_version + 3
        } else {
            root_version
        }
    }

    /// Whether group `g` holds a superblock backup and a GDT copy (§2.1).
    pub fn group_has_super(&self, g: u32) -> bool {
        if g == 0 {
            return true;
        }
        if self.has_compat(COMPAT_SPARSE_SUPER2) {
            let b0 = self.r32(0x24C);
            let b1 = self.r32(0x250);
            return g == b0 || g == b1;
        }
        if !self.has_ro_compat(RO_COMPAT_SPARSE_SUPER) || g == 1 {
            return true;
        }
        if g.is_multiple_of(2) {
            return false;
        }
        [3u32, 5, 7].iter().any(|&p| is_power_of(g, p))
    }

    /// First block of group `g`.
    pub fn group_first_block(&self, g: u32) -> u64 {
        self.first_data_block() as u64 + g as u64 * self.blocks_per_group() as u64
    }

    /// Number of blocks in group `g` (the last group may be short).
    pub fn blocks_in_group(&self, g: u32) -> u32 {
        let first = self.group_first_block(g);
        let end = (first + self.blocks_per_group() as u64).min(self.blocks_count());
        end.saturating_sub(first) as u32
    }
}

fn is_power_of(mut n: u32, p: u32) -> bool {
    while n > 1 && n.is_multiple_of(p) {
        n /= p;
    }
    n == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_super_groups() {
        let mut raw = [0u8; SUPERBLOCK_SIZE];
        put_le32(&mut raw, S_FEATURE_RO_COMPAT, RO_COMPAT_SPARSE_SUPER);
        let sb = Superblock::from_raw_unchecked(&raw);
        let have: Vec<u32> = (0..130).filter(|&g| sb.group_has_super(g)).collect();
        assert_eq!(have, vec![0, 1, 3, 5, 7, 9, 25, 27, 49, 81, 125]);
    }

    #[test]
    fn rejects_bad_magic_and_short_input() {
        assert!(matches!(
            Superblock::parse(&[0u8; 100]),
            Err(FormatError::Corrupt { .. })
        ));
        assert!(matches!(
            Superblock::parse(&[0u8; 1024]),
            Err(FormatError::BadMagic { .. })
        ));
    }

    #[test]
    fn unknown_feature_names_are_numbered() {
        assert_eq!(feature_name(FeatureKind::Incompat, 0x40000), "FEATURE_I18");
        assert_eq!(
            feature_name(FeatureKind::RoCompat, RO_COMPAT_METADATA_CSUM),
            "metadata_csum"
        );
    }
}
