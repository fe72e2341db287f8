//! Block group descriptors (ext4-format.md §3.1–3.2).

use crate::bytes::*;
use crate::csum::{crc32c_raw, CsumCtx};
use crate::error::{FormatError, Result};

pub const BG_INODE_UNINIT: u16 = 0x0001;
pub const BG_BLOCK_UNINIT: u16 = 0x0002;
pub const BG_INODE_ZEROED: u16 = 0x0004;

const BG_CHECKSUM: usize = 0x1E;

/// One group descriptor, decoded. `desc_size` is 32 or 64 (with `64bit`); the high
/// halves are only stored when the descriptor is large enough to hold them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupDesc {
    pub block_bitmap: u64,
    pub inode_bitmap: u64,
    pub inode_table: u64,
    pub free_blocks_count: u32,
    pub free_inodes_count: u32,
    pub used_dirs_count: u32,
    pub flags: u16,
    pub exclude_bitmap: u64,
    pub block_bitmap_csum: u32,
    pub inode_bitmap_csum: u32,
    pub itable_unused: u32,
    pub checksum: u16,
}

impl GroupDesc {
    /// Decode descriptor `group` from `b` (exactly `desc_size` bytes).
    pub fn parse(b: &[u8], group: u32, gdt_block: u64) -> Result<GroupDesc> {
        if b.len() != 32 && b.len() < 64 {
            return Err(FormatError::corrupt(
                "group descriptor",
                gdt_block,
                format!("group {group}: descriptor size {} unsupported", b.len()),
            ));
        }
        let big = b.len() >= 64;
        let hi32 = |off: usize| if big { le32(b, off) as u64 } else { 0 };
        let hi16 = |off: usize| if big { le16(b, off) as u32 } else { 0 };
        Ok(GroupDesc {
            block_bitmap: le32(b, 0x00) as u64 | hi32(0x20) << 32,
            inode_bitmap: le32(b, 0x04) as u64 | hi32(0x24) << 32,
            inode_table: le32(b, 0x08) as u64 | hi32(0x28) << 32,
            free_blocks_count: le16(b, 0x0C) as u32 | hi16(0x2C) << 16,
            free_inodes_count: le16(b, 0x0E) as u32 | hi16(0x2E) << 16,
            used_dirs_count: le16(b, 0x10) as u32 | hi16(0x30) << 16,
            flags: le16(b, 0x12),
            exclude_bitmap: le32(b, 0x14) as u64 | hi32(0x34) << 32,
            block_bitmap_csum: le16(b, 0x18) as u32 | hi16(0x38) << 16,
            inode_bitmap_csum: le16(b, 0x1A) as u32 | hi16(0x3A) << 16,
            itable_unused: le16(b, 0x1C) as u32 | hi16(0x32) << 16,
            checksum: le16(b, BG_CHECKSUM),
        })
    }

    /// Encode into `b` (`desc_size` bytes), keeping bytes we do not model, and store
    /// a fresh descriptor checksum when `metadata_csum` is on (§1.3).
    pub fn serialize(&self, b: &mut [u8], group: u32, csum: &CsumCtx) {
        let big = b.len() >= 64;
        put_le32(b, 0x00, self.block_bitmap as u32);
        put_le32(b, 0x04, self.inode_bitmap as u32);
        put_le32(b, 0x08, self.inode_table as u32);
        put_le16(b, 0x0C, self.free_blocks_count as u16);
        put_le16(b, 0x0E, self.free_inodes_count as u16);
        put_le16(b, 0x10, self.used_dirs_count as u16);
        put_le16(b, 0x12, self.flags);
        put_le32(b, 0x14, self.exclude_bitmap as u32);
        put_le16(b, 0x18, self.block_bitmap_csum as u16);
        put_le16(b, 0x1A, self.inode_bitmap_csum as u16);
        put_le16(b, 0x1C, self.itable_unused as u16);
        if big {
            put_le32(b, 0x20, (self.block_bitmap >> 32) as u32);
            put_le32(b, 0x24, (self.inode_bitmap >> 32) as u32);
            put_le32(b, 0x28, (self.inode_table >> 32) as u32);
            put_le16(b, 0x2C, (self.free_blocks_count >> 16) as u16);
            put_le16(b, 0x2E, (self.free_inodes_count >> 16) as u16);
            put_le16(b, 0x30, (self.used_dirs_count >> 16) as u16);
            put_le16(b, 0x32, (self.itable_unused >> 16) as u16);
            put_le32(b, 0x34, (self.exclude_bitmap >> 32) as u32);
            put_le16(b, 0x38, (self.block_bitmap_csum >> 16) as u16);
            put_le16(b, 0x3A, (self.inode_bitmap_csum >> 16) as u16);
        }
        let c = if csum.enabled {
            compute_checksum(b, group, csum)
        } else {
            self.checksum
        };
        put_le16(b, BG_CHECKSUM, c);
    }

    pub fn has_flag(&self, f: u16) -> bool {
        self.flags & f != 0
    }
}

/// Descriptor checksum: crc32c(fs_seed, le32(group) ++ desc with bg_checksum zeroed),
/// low 16 bits (§1.3).
pub fn compute_checksum(b: &[u8], group: u32, csum: &CsumCtx) -> u16 {
    if b.len() < BG_CHECKSUM + 2 {
        return 0;
    }
    let mut c = crc32c_raw(csum.fs_seed, &group.to_le_bytes());
    c = crc32c_raw(c, &b[..BG_CHECKSUM]);
    c = crc32c_raw(c, &[0, 0]);
    c = crc32c_raw(c, &b[BG_CHECKSUM + 2..]);
    (c & 0xFFFF) as u16
}

/// Verify the checksum of a raw descriptor.
pub fn verify(b: &[u8], group: u32, csum: &CsumCtx, gdt_block: u64) -> Result<()> {
    if !csum.enabled {
        return Ok(());
    }
    if b.len() < 32 {
        return Err(FormatError::corrupt(
            "group descriptor",
            gdt_block,
            format!("group {group}: descriptor of {} bytes", b.len()),
        ));
    }
    let stored = le16(b, BG_CHECKSUM);
    let computed = compute_checksum(b, group, csum);
    if stored != computed {
        return Err(FormatError::BadChecksum {
            structure: "group descriptor",
            block: gdt_block,
            stored: stored as u32,
            computed: computed as u32,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_64_byte_descriptor() {
        let d = GroupDesc {
            block_bitmap: 0x1_0000_0081,
            inode_bitmap: 137,
            inode_table: 145,
            free_blocks_count: 70000,
            free_inodes_count: 8181,
            used_dirs_count: 2,
            flags: BG_INODE_ZEROED,
            exclude_bitmap: 0,
            block_bitmap_csum: 0xDEADBEEF,
            inode_bitmap_csum: 0x12345678,
            itable_unused: 8000,
            checksum: 0,
        };
        let ctx = CsumCtx {
            enabled: true,
            fs_seed: 0x5D5D0A96,
        };
        let mut b = [0u8; 64];
        d.serialize(&mut b, 3, &ctx);
        let back = GroupDesc::parse(&b, 3, 1).unwrap();
        assert_eq!(back.block_bitmap, d.block_bitmap);
        assert_eq!(back.free_blocks_count, 70000);
        assert_eq!(back.block_bitmap_csum, 0xDEADBEEF);
        verify(&b, 3, &ctx, 1).unwrap();
        assert!(verify(&b, 4, &ctx, 1).is_err());
    }
}
