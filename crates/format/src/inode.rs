//! On-disk inodes (ext4-format.md §4).

use crate::bytes::*;
use crate::csum::{crc32c_raw, CsumCtx};
use crate::error::{FormatError, Result};

// i_mode file types (§4.3).
pub const S_IFMT: u16 = 0xF000;
pub const S_IFIFO: u16 = 0x1000;
pub const S_IFCHR: u16 = 0x2000;
pub const S_IFDIR: u16 = 0x4000;
pub const S_IFBLK: u16 = 0x6000;
pub const S_IFREG: u16 = 0x8000;
pub const S_IFLNK: u16 = 0xA000;
pub const S_IFSOCK: u16 = 0xC000;

// i_flags (§4.4).
pub const FL_SYNC: u32 = 0x0000_0008;
pub const FL_IMMUTABLE: u32 = 0x0000_0010;
pub const FL_APPEND: u32 = 0x0000_0020;
pub const FL_NOATIME: u32 = 0x0000_0080;
pub const FL_ENCRYPT: u32 = 0x0000_0800;
pub const FL_INDEX: u32 = 0x0000_1000;
pub const FL_JOURNAL_DATA: u32 = 0x0000_4000;
pub const FL_HUGE_FILE: u32 = 0x0004_0000;
pub const FL_EXTENTS: u32 = 0x0008_0000;
pub const FL_VERITY: u32 = 0x0010_0000;
pub const FL_EA_INODE: u32 = 0x0020_0000;
pub const FL_INLINE_DATA: u32 = 0x1000_0000;
pub const FL_CASEFOLD: u32 = 0x4000_0000;

/// Reserved inode numbers (§4.7).
pub const ROOT_INO: u32 = 2;
pub const RESIZE_INO: u32 = 7;
pub const JOURNAL_INO: u32 = 8;

pub const GOOD_OLD_INODE_SIZE: usize = 128;
const I_CHECKSUM_LO: usize = 0x7C;
const I_CHECKSUM_HI: usize = 0x82;

/// Directory entry file type codes (§6.3), derived from the mode.
pub fn file_type_of_mode(mode: u16) -> u8 {
    match mode & S_IFMT {
        S_IFREG => 1,
        S_IFDIR => 2,
        S_IFCHR => 3,
        S_IFBLK => 4,
        S_IFIFO => 5,
        S_IFSOCK => 6,
        S_IFLNK => 7,
        _ => 0,
    }
}

/// Seconds and nanoseconds since the epoch, as ext4 stores them (§4.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

impl Timestamp {
    pub fn new(sec: i64, nsec: u32) -> Self {
        Timestamp { sec, nsec }
    }
    /// Decode `base` + `extra` (epoch bits and nanoseconds).
    pub fn decode(base: u32, extra: Option<u32>) -> Self {
        let mut sec = base as i32 as i64;
        let mut nsec = 0;
        if let Some(e) = extra {
            sec += ((e & 3) as i64) << 32;
            nsec = (e >> 2).min(999_999_999);
        }
        Timestamp { sec, nsec }
    }
    /// Encode to (`base`, `extra`); clamps to the representable range.
    pub fn encode(&self) -> (u32, u32) {
        let sec = self
            .sec
            .clamp(-(1i64 << 31), (1i64 << 34) - 1 - (1i64 << 31));
        let epoch = (((sec - (sec as i32 as i64)) >> 32) & 3) as u32;
        (sec as u32, epoch | (self.nsec.min(999_999_999) << 2))
    }
}

/// A decoded inode. Fields beyond 128 bytes are kept only when `extra_isize` covers
/// them; `xattr_area` holds the raw in-inode xattr region (`128 + extra_isize ..
/// inode_size`) so that attributes are preserved untouched unless the xattr code
/// rewrites them. Unknown `extra_isize` fields are kept in `extra_fields`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inode {
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub atime: Timestamp,
    pub ctime: Timestamp,
    pub mtime: Timestamp,
    pub crtime: Timestamp,
    pub dtime: u32,
    pub links_count: u16,
    /// Raw 48-bit `i_blocks` (512-byte units unless `FL_HUGE_FILE`, §4.5).
    pub blocks_raw: u64,
    pub flags: u32,
    /// `l_i_version` (low) and `i_version_hi`.
    pub version: u64,
    /// `i_block[15]`: extent root, symlink target or device numbers.
    pub block: [u8; 60],
    pub generation: u32,
    pub file_acl: u64,
    pub faddr: u32,
    pub extra_isize: u16,
    pub projid: u32,
    /// Bytes of the extra area beyond the fields we model (0xA0 .. 128 + extra_isize).
    pub extra_fields: Vec<u8>,
    /// In-inode xattr region: bytes `128 + extra_isize .. inode_size`.
    pub xattr_area: Vec<u8>,
}

impl Default for Inode {
    fn default() -> Self {
        Inode {
            mode: 0,
            uid: 0,
            gid: 0,
            size: 0,
            atime: Timestamp::default(),
            ctime: Timestamp::default(),
            mtime: Timestamp::default(),
            crtime: Timestamp::default(),
            dtime: 0,
            links_count: 0,
            blocks_raw: 0,
            flags: 0,
            version: 0,
            block: [0; 60],
            generation: 0,
            file_acl: 0,
            faddr: 0,
            extra_isize: 0,
            projid: 0,
            extra_fields: Vec::new(),
            xattr_area: Vec::new(),
        }
    }
}

impl Inode {
    /// Parse an inode record of `inode_size` bytes, verifying its checksum (§1.3).
    /// `block` is the inode-table block it came from, for error messages.
    pub fn parse(b: &[u8], ino: u32, csum: &CsumCtx, block: u64) -> Result<Inode> {
        let s = "inode";
        // Records are 128 bytes or large enough to hold the extra fields' header.
        if b.len() < GOOD_OLD_INODE_SIZE || (b.len() > GOOD_OLD_INODE_SIZE && b.len() < 0x84) {
            return Err(FormatError::corrupt(
                s,
                block,
                format!("inode {ino}: record too small"),
            ));
        }
        let extra_isize = if b.len() > GOOD_OLD_INODE_SIZE {
            le16(b, 0x80)
        } else {
            0
        };
        if b.len() > GOOD_OLD_INODE_SIZE
            && (extra_isize % 4 != 0 || GOOD_OLD_INODE_SIZE + extra_isize as usize > b.len())
        {
            return Err(FormatError::corrupt(
                s,
                block,
                format!("inode {ino}: i_extra_isize {extra_isize} invalid"),
            ));
        }
        let generation = le32(b, 0x64);
        if csum.enabled && !b[..GOOD_OLD_INODE_SIZE].iter().all(|&x| x == 0) {
            let (stored, computed) = stored_and_computed(b, ino, generation, csum, extra_isize);
            if stored != computed {
                return Err(FormatError::BadChecksum {
                    structure: "inode",
                    block,
                    stored,
                    computed,
                });
            }
        }
        let end = GOOD_OLD_INODE_SIZE + extra_isize as usize;
        let has = |off: usize, len: usize| off + len <= end;
        let ex32 = |off: usize| {
            if has(off, 4) {
                Some(le32(b, off))
            } else {
                None
            }
        };
        let mut block_arr = [0u8; 60];
        block_arr.copy_from_slice(&b[0x28..0x28 + 60]);
        let modelled_end = 0xA0.min(end).max(GOOD_OLD_INODE_SIZE);
        Ok(Inode {
            mode: le16(b, 0x00),
            uid: le16(b, 0x02) as u32 | (le16(b, 0x78) as u32) << 16,
            gid: le16(b, 0x18) as u32 | (le16(b, 0x7A) as u32) << 16,
            size: le32(b, 0x04) as u64 | (le32(b, 0x6C) as u64) << 32,
            atime: Timestamp::decode(le32(b, 0x08), ex32(0x8C)),
            ctime: Timestamp::decode(le32(b, 0x0C), ex32(0x84)),
            mtime: Timestamp::decode(le32(b, 0x10), ex32(0x88)),
            crtime: match ex32(0x90) {
                Some(base) => Timestamp::decode(base, ex32(0x94)),
                None => Timestamp::default(),
            },
            dtime: le32(b, 0x14),
            links_count: le16(b, 0x1A),
            blocks_raw: le32(b, 0x1C) as u64 | (le16(b, 0x74) as u64) << 32,
            flags: le32(b, 0x20),
            version: le32(b, 0x24) as u64 | (ex32(0x98).unwrap_or(0) as u64) << 32,
            block: block_arr,
            generation,
            file_acl: le32(b, 0x68) as u64 | (le16(b, 0x76) as u64) << 32,
            faddr: le32(b, 0x70),
            extra_isize,
            projid: ex32(0x9C).unwrap_or(0),
            extra_fields: b[modelled_end..end].to_vec(),
            xattr_area: b[end..].to_vec(),
        })
    }

    /// Serialise into `b` (`inode_size` bytes) and store the checksum.
    pub fn serialize(&self, b: &mut [u8], ino: u32, csum: &CsumCtx) {
        b.fill(0);
        put_le16(b, 0x00, self.mode);
        put_le16(b, 0x02, self.uid as u16);
        put_le32(b, 0x04, self.size as u32);
        let (a, ax) = self.atime.encode();
        let (c, cx) = self.ctime.encode();
        let (m, mx) = self.mtime.encode();
        let (cr, crx) = self.crtime.encode();
        put_le32(b, 0x08, a);
        put_le32(b, 0x0C, c);
        put_le32(b, 0x10, m);
        put_le32(b, 0x14, self.dtime);
        put_le16(b, 0x18, self.gid as u16);
        put_le16(b, 0x1A, self.links_count);
        put_le32(b, 0x1C, self.blocks_raw as u32);
        put_le32(b, 0x20, self.flags);
        put_le32(b, 0x24, self.version as u32);
        b[0x28..0x28 + 60].copy_from_slice(&self.block);
        put_le32(b, 0x64, self.generation);
        put_le32(b, 0x68, self.file_acl as u32);
        put_le32(b, 0x6C, (self.size >> 32) as u32);
        put_le32(b, 0x70, self.faddr);
        put_le16(b, 0x74, (self.blocks_raw >> 32) as u16);
        put_le16(b, 0x76, (self.file_acl >> 32) as u16);
        put_le16(b, 0x78, (self.uid >> 16) as u16);
        put_le16(b, 0x7A, (self.gid >> 16) as u16);
        if b.len() > GOOD_OLD_INODE_SIZE {
            let end = GOOD_OLD_INODE_SIZE + self.extra_isize as usize;
            put_le16(b, 0x80, self.extra_isize);
            let mut put = |off: usize, v: u32| {
                if off + 4 <= end {
                    put_le32(b, off, v)
                }
            };
            put(0x84, cx);
            put(0x88, mx);
            put(0x8C, ax);
            put(0x90, cr);
            put(0x94, crx);
            put(0x98, (self.version >> 32) as u32);
            put(0x9C, self.projid);
            let modelled_end = 0xA0.min(end).max(GOOD_OLD_INODE_SIZE);
            let n = self.extra_fields.len().min(end - modelled_end);
            b[modelled_end..modelled_end + n].copy_from_slice(&self.extra_fields[..n]);
            let n = self.xattr_area.len().min(b.len() - end);
            b[end..end + n].copy_from_slice(&self.xattr_area[..n]);
        }
        if csum.enabled {
            let c = compute_checksum(b, ino, self.generation, csum);
            put_le16(b, I_CHECKSUM_LO, c as u16);
            if b.len() > GOOD_OLD_INODE_SIZE && self.extra_isize >= 4 {
                put_le16(b, I_CHECKSUM_HI, (c >> 16) as u16);
            }
        }
    }

    pub fn file_type(&self) -> u16 {
        self.mode & S_IFMT
    }
    pub fn is_dir(&self) -> bool {
        self.file_type() == S_IFDIR
    }
    pub fn is_reg(&self) -> bool {
        self.file_type() == S_IFREG
    }
    pub fn is_symlink(&self) -> bool {
        self.file_type() == S_IFLNK
    }
    pub fn has_flag(&self, f: u32) -> bool {
        self.flags & f != 0
    }
    /// `i_blocks` in 512-byte sectors (§4.5).
    pub fn blocks_512(&self, block_size: usize) -> u64 {
        if self.has_flag(FL_HUGE_FILE) {
            self.blocks_raw * (block_size as u64 / 512)
        } else {
            self.blocks_raw
        }
    }
    /// Store a 512-byte sector count, switching to block units only when needed.
    pub fn set_blocks_512(&mut self, v: u64, block_size: usize) {
        if v < (1u64 << 48) {
            self.flags &= !FL_HUGE_FILE;
            self.blocks_raw = v;
        } else {
            self.flags |= FL_HUGE_FILE;
            self.blocks_raw = v / (block_size as u64 / 512);
        }
    }
    /// Fast symlink: target stored in `i_block` (§4.8).
    pub fn is_fast_symlink(&self) -> bool {
        self.is_symlink()
            && !self.has_flag(FL_EXTENTS)
            && !self.has_flag(FL_INLINE_DATA)
            && self.size > 0
            && self.size < 60
    }
    /// Device number for char/block devices (§4.8), in the Linux "new" encoding that
    /// is also user space's 32-bit `dev_t` and the FUSE `rdev`:
    /// `(minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)`. The old encoding in
    /// `i_block[0]` is numerically identical for 8-bit major/minor.
    pub fn rdev(&self) -> u32 {
        let w0 = le32(&self.block, 0);
        if w0 != 0 {
            w0 & 0xFFFF
        } else {
            le32(&self.block, 4)
        }
    }
    /// Store a device number (new encoding), old form when it fits like the kernel.
    pub fn set_rdev(&mut self, rdev: u32) {
        self.block = [0; 60];
        let major = (rdev >> 8) & 0xFFF;
        let minor = (rdev & 0xFF) | ((rdev >> 12) & 0xFFF00);
        if major < 256 && minor < 256 {
            put_le32(&mut self.block, 0, (major << 8) | minor);
        } else {
            put_le32(&mut self.block, 4, rdev);
        }
    }
}

fn stored_and_computed(
    b: &[u8],
    ino: u32,
    generation: u32,
    csum: &CsumCtx,
    extra_isize: u16,
) -> (u32, u32) {
    let lo = le16(b, I_CHECKSUM_LO) as u32;
    let has_hi = b.len() > GOOD_OLD_INODE_SIZE && extra_isize >= 4;
    let stored = if has_hi {
        lo | (le16(b, I_CHECKSUM_HI) as u32) << 16
    } else {
        lo
    };
    let mut computed = compute_checksum(b, ino, generation, csum);
    if !has_hi {
        computed &= 0xFFFF;
    }
    (stored, computed)
}

/// Inode checksum over the whole record with both checksum halves zeroed (§1.3).
pub fn compute_checksum(b: &[u8], ino: u32, generation: u32, csum: &CsumCtx) -> u32 {
    let seed = csum.inode_seed(ino, generation);
    let mut c = crc32c_raw(seed, &b[..I_CHECKSUM_LO]);
    c = crc32c_raw(c, &[0, 0]);
    c = crc32c_raw(c, &b[I_CHECKSUM_LO + 2..GOOD_OLD_INODE_SIZE]);
    if b.len() > GOOD_OLD_INODE_SIZE {
        c = crc32c_raw(c, &b[GOOD_OLD_INODE_SIZE..I_CHECKSUM_HI]);
        let extra_isize = le16(b, 0x80) as usize;
        if extra_isize >= 4 {
            c = crc32c_raw(c, &[0, 0]);
        } else {
            c = crc32c_raw(c, &b[I_CHECKSUM_HI..I_CHECKSUM_HI + 2]);
        }
        c = crc32c_raw(c, &b[I_CHECKSUM_HI + 2..]);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_including_epoch_bits() {
        for (s, n) in [
            (0i64, 0u32),
            (1_700_000_000, 123_456_789),
            (-1, 5),
            (-(1 << 31), 0),
            (3_000_000_000, 999_999_999),
            ((1 << 34) - 1 - (1 << 31), 1),
        ] {
            let t = Timestamp::new(s, n);
            let (b, e) = t.encode();
            assert_eq!(Timestamp::decode(b, Some(e)), t, "{s}");
        }
    }

    #[test]
    fn inode_round_trip_and_checksum() {
        let ctx = CsumCtx {
            enabled: true,
            fs_seed: 0x1234_5678,
        };
        let mut i = Inode {
            mode: S_IFREG | 0o644,
            uid: 70000,
            gid: 5,
            size: 5 << 32,
            links_count: 1,
            generation: 42,
            extra_isize: 32,
            mtime: Timestamp::new(1_600_000_000, 7),
            crtime: Timestamp::new(1_500_000_000, 9),
            xattr_area: vec![0; 96],
            ..Default::default()
        };
        i.set_blocks_512(80, 4096);
        let mut b = vec![0u8; 256];
        i.serialize(&mut b, 12, &ctx);
        let back = Inode::parse(&b, 12, &ctx, 0).unwrap();
        assert_eq!(back, i);
        b[0x30] ^= 1;
        assert!(matches!(
            Inode::parse(&b, 12, &ctx, 0),
            Err(FormatError::BadChecksum { .. })
        ));
        // Wrong inode number => wrong seed.
        b[0x30] ^= 1;
        assert!(Inode::parse(&b, 13, &ctx, 0).is_err());
    }

    #[test]
    fn device_numbers() {
        let mut i = Inode::default();
        i.set_rdev((8 << 8) | 1);
        assert_eq!(le32(&i.block, 0), (8 << 8) | 1);
        assert_eq!(i.rdev(), (8 << 8) | 1);
        let big = (70000 & 0xFF) | (259 << 8) | ((70000 & !0xFF) << 12);
        i.set_rdev(big);
        assert_eq!(le32(&i.block, 0), 0);
        assert_eq!(i.rdev(), big);
    }
}
