//! JBD2 log blocks: the common header, descriptor blocks with their tags, commit
//! blocks and revoke blocks (ext4-format.md §8.3–8.9). All big-endian.
//!
//! Builders produce exactly what the kernel writes (SAME_UUID on every tag but the
//! first, LAST_TAG on the last, zeroed tails, checksums per §1.3), so that the kernel
//! and e2fsck replay our log; parsers validate everything they index.

use crate::bytes::*;
use crate::csum::crc32c_raw;
use crate::error::{FormatError, Result};
use crate::jbd2::{
    BLOCKTYPE_COMMIT, BLOCKTYPE_DESCRIPTOR, BLOCKTYPE_REVOKE, INCOMPAT_64BIT, INCOMPAT_CSUM_V2,
    INCOMPAT_CSUM_V3, JBD2_MAGIC,
};

/// Tag flags (§8.5).
pub const TAG_ESCAPE: u16 = 0x1;
pub const TAG_SAME_UUID: u16 = 0x2;
pub const TAG_DELETED: u16 = 0x4;
pub const TAG_LAST: u16 = 0x8;

/// Size of the common header.
pub const HEADER_SIZE: usize = 12;
/// Size of a revoke block header (common header + `r_count`).
pub const REVOKE_HEADER_SIZE: usize = 16;
const COMMIT_SEC: usize = 0x30;
const COMMIT_NSEC: usize = 0x38;
const COMMIT_CSUM: usize = 0x10;
/// `sizeof(struct commit_header)`: the bytes of a commit block that carry
/// anything (§8.8); the rest of a plain commit block is zero.
pub const COMMIT_HEADER_SIZE: usize = 0x3C;

/// The journal features that shape log blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogFormat {
    pub block_size: usize,
    /// JBD2 incompat feature word.
    pub incompat: u32,
    /// `j_seed = crc32c(~0, journal uuid)` (§1.2).
    pub seed: u32,
}

impl LogFormat {
    pub fn csum_v3(&self) -> bool {
        self.incompat & INCOMPAT_CSUM_V3 != 0
    }
    pub fn csum_v2(&self) -> bool {
        self.incompat & INCOMPAT_CSUM_V2 != 0
    }
    /// Per-block checksums (v2 or v3) in use.
    pub fn has_csum(&self) -> bool {
        self.csum_v2() || self.csum_v3()
    }
    pub fn is_64bit(&self) -> bool {
        self.incompat & INCOMPAT_64BIT != 0
    }
    /// Bytes of one tag, without the optional UUID (`journal_tag_bytes`, §8.5).
    pub fn tag_bytes(&self) -> usize {
        if self.csum_v3() {
            return 16;
        }
        let mut n = 8;
        if self.csum_v2() {
            n += 2;
        }
        if self.is_64bit() {
            n += 4;
        }
        n
    }
    /// Tail bytes at the end of descriptor and revoke blocks.
    pub fn tail_bytes(&self) -> usize {
        if self.has_csum() {
            4
        } else {
            0
        }
    }
    /// How many tags one descriptor block can hold (the first tag carries a UUID).
    pub fn tags_per_descriptor(&self) -> usize {
        let avail = self.block_size - HEADER_SIZE - self.tail_bytes();
        let tb = self.tag_bytes();
        if avail < tb + 16 {
            return 0;
        }
        1 + (avail - tb - 16) / tb
    }
    /// Bytes per revoke record.
    pub fn revoke_record_bytes(&self) -> usize {
        if self.is_64bit() {
            8
        } else {
            4
        }
    }
    pub fn revokes_per_block(&self) -> usize {
        (self.block_size - REVOKE_HEADER_SIZE - self.tail_bytes()) / self.revoke_record_bytes()
    }
}

/// Parse the common header: `(blocktype, sequence)` if the magic matches.
pub fn parse_header(b: &[u8]) -> Option<(u32, u32)> {
    if b.len() < HEADER_SIZE || be32(b, 0) != JBD2_MAGIC {
        return None;
    }
    Some((be32(b, 4), be32(b, 8)))
}

fn put_header(b: &mut [u8], blocktype: u32, tid: u32) {
    put_be32(b, 0, JBD2_MAGIC);
    put_be32(b, 4, blocktype);
    put_be32(b, 8, tid);
}

/// Checksum of a descriptor or revoke block: whole block with its tail zeroed.
fn tail_checksum(b: &[u8], seed: u32) -> u32 {
    let n = b.len() - 4;
    crc32c_raw(crc32c_raw(seed, &b[..n]), &[0; 4])
}

/// Verify the tail checksum of a descriptor or revoke block (no-op without csums).
pub fn verify_tail(b: &[u8], f: &LogFormat) -> bool {
    if !f.has_csum() {
        return true;
    }
    if b.len() < 4 {
        return false;
    }
    be32(b, b.len() - 4) == tail_checksum(b, f.seed)
}

/// Checksum of a journaled data block as stored in the log (after escaping):
/// `crc32c(j_seed, be32(tid) ++ data)` (§1.3). v2 keeps the low 16 bits.
pub fn data_checksum(f: &LogFormat, tid: u32, data: &[u8]) -> u32 {
    let c = crc32c_raw(crc32c_raw(f.seed, &tid.to_be_bytes()), data);
    if f.csum_v3() {
        c
    } else {
        c & 0xFFFF
    }
}

/// Whether a block must be escaped before logging (starts with the magic, §8.6).
pub fn needs_escape(data: &[u8]) -> bool {
    data.len() >= 4 && be32(data, 0) == JBD2_MAGIC
}

/// One descriptor tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// Home block number.
    pub blocknr: u64,
    /// ESCAPE / DELETED flags (SAME_UUID and LAST_TAG are managed by the builder).
    pub flags: u16,
    /// Checksum of the logged copy (0 without csums).
    pub checksum: u32,
}

/// Build a descriptor block for `tags` (at most `tags_per_descriptor`).
pub fn build_descriptor(f: &LogFormat, tid: u32, tags: &[Tag]) -> Vec<u8> {
    let mut b = vec![0u8; f.block_size];
    put_header(&mut b, BLOCKTYPE_DESCRIPTOR, tid);
    let tb = f.tag_bytes();
    let mut off = HEADER_SIZE;
    for (i, t) in tags.iter().enumerate() {
        let mut flags = t.flags & (TAG_ESCAPE | TAG_DELETED);
        if i > 0 {
            flags |= TAG_SAME_UUID;
        }
        if i + 1 == tags.len() {
            flags |= TAG_LAST;
        }
        put_be32(&mut b, off, t.blocknr as u32);
        if f.csum_v3() {
            put_be32(&mut b, off + 4, flags as u32);
            put_be32(&mut b, off + 8, (t.blocknr >> 32) as u32);
            put_be32(&mut b, off + 12, t.checksum);
        } else {
            if f.csum_v2() {
                put_be16(&mut b, off + 4, t.checksum as u16);
            }
            put_be16(&mut b, off + 6, flags);
            if f.is_64bit() {
                put_be32(&mut b, off + 8, (t.blocknr >> 32) as u32);
            }
        }
        off += tb;
        if i == 0 {
            off += 16; // UUID, zero for an internal journal (recovery ignores it)
        }
    }
    if f.has_csum() {
        let c = tail_checksum(&b, f.seed);
        let n = b.len() - 4;
        put_be32(&mut b, n, c);
    }
    b
}

/// Parse the tags of a descriptor block. `jblk` names the journal block in errors.
pub fn parse_descriptor(b: &[u8], f: &LogFormat, jblk: u64) -> Result<Vec<Tag>> {
    if b.len() != f.block_size || parse_header(b).map(|h| h.0) != Some(BLOCKTYPE_DESCRIPTOR) {
        return Err(FormatError::corrupt(
            "journal descriptor block",
            jblk,
            "not a descriptor block",
        ));
    }
    let tb = f.tag_bytes();
    let end = f.block_size - f.tail_bytes();
    let mut off = HEADER_SIZE;
    let mut tags = Vec::new();
    while off + tb <= end {
        let blocknr_lo = be32(b, off) as u64;
        let (flags, hi, checksum) = if f.csum_v3() {
            (
                be32(b, off + 4) as u16,
                be32(b, off + 8) as u64,
                be32(b, off + 12),
            )
        } else {
            let c = if f.csum_v2() {
                be16(b, off + 4) as u32
            } else {
                0
            };
            let hi = if f.is_64bit() {
                be32(b, off + 8) as u64
            } else {
                0
            };
            (be16(b, off + 6), hi, c)
        };
        let blocknr = if f.is_64bit() {
            blocknr_lo | hi << 32
        } else {
            blocknr_lo
        };
        tags.push(Tag {
            blocknr,
            flags,
            checksum,
        });
        off += tb;
        if flags & TAG_SAME_UUID == 0 {
            off += 16;
        }
        if flags & TAG_LAST != 0 {
            return Ok(tags);
        }
    }
    // The kernel tolerates a descriptor without LAST_TAG that is simply full.
    Ok(tags)
}

/// Build a commit block (§8.8).
pub fn build_commit(f: &LogFormat, tid: u32, sec: u64, nsec: u32) -> Vec<u8> {
    let mut b = vec![0u8; f.block_size];
    put_header(&mut b, BLOCKTYPE_COMMIT, tid);
    put_be64(&mut b, COMMIT_SEC, sec);
    put_be32(&mut b, COMMIT_NSEC, nsec);
    if f.has_csum() {
        let c = crc32c_raw(f.seed, &b);
        put_be32(&mut b, COMMIT_CSUM, c);
    }
    b
}

/// commitfs single-flush commit extension (docs/FORMAT.md, Extensions): placed in
/// the unused space of a commit block after the standard header, covered by the
/// commit block checksum (which spans the whole block). Big-endian like JBD2.
pub const COMMIT_EXT_OFFSET: usize = 0x40;
/// Magic of the extension header ("CFSX").
pub const COMMIT_EXT_MAGIC: u32 = 0x4346_5358;
/// Extension header: magic u32, count u32.
const COMMIT_EXT_HEADER: usize = 8;
/// One entry: pblk u64, len u32, crc u32.
const COMMIT_EXT_ENTRY: usize = 16;

/// Data-range entries one commit block can carry.
pub fn commit_ext_capacity(block_size: usize) -> usize {
    block_size.saturating_sub(COMMIT_EXT_OFFSET + COMMIT_EXT_HEADER) / COMMIT_EXT_ENTRY
}

/// [`build_commit`] carrying the single-flush extension: `ranges` are
/// `(pblk, len, crc32c)` of data blocks the commit makes reachable. `None` when
/// they do not fit the block.
pub fn build_commit_ext(
    f: &LogFormat,
    tid: u32,
    sec: u64,
    nsec: u32,
    ranges: &[(u64, u32, u32)],
) -> Option<Vec<u8>> {
    if ranges.len() > commit_ext_capacity(f.block_size) {
        return None;
    }
    let mut b = vec![0u8; f.block_size];
    put_header(&mut b, BLOCKTYPE_COMMIT, tid);
    put_be64(&mut b, COMMIT_SEC, sec);
    put_be32(&mut b, COMMIT_NSEC, nsec);
    put_be32(&mut b, COMMIT_EXT_OFFSET, COMMIT_EXT_MAGIC);
    put_be32(&mut b, COMMIT_EXT_OFFSET + 4, ranges.len() as u32);
    let mut off = COMMIT_EXT_OFFSET + COMMIT_EXT_HEADER;
    for &(pblk, len, crc) in ranges {
        put_be64(&mut b, off, pblk);
        put_be32(&mut b, off + 8, len);
        put_be32(&mut b, off + 12, crc);
        off += COMMIT_EXT_ENTRY;
    }
    if f.has_csum() {
        let c = crc32c_raw(f.seed, &b);
        put_be32(&mut b, COMMIT_CSUM, c);
    }
    Some(b)
}

/// The single-flush extension of a commit block, if it has one (an empty list
/// for a single-flush commit without data ranges). Call only on a commit block
/// whose checksum verified.
pub fn parse_commit_ext(b: &[u8]) -> Option<Vec<(u64, u32, u32)>> {
    if b.len() < COMMIT_EXT_OFFSET + COMMIT_EXT_HEADER
        || be32(b, COMMIT_EXT_OFFSET) != COMMIT_EXT_MAGIC
    {
        return None;
    }
    let n = be32(b, COMMIT_EXT_OFFSET + 4) as usize;
    if n > commit_ext_capacity(b.len()) {
        return None;
    }
    let base = COMMIT_EXT_OFFSET + COMMIT_EXT_HEADER;
    Some(
        (0..n)
            .map(|i| {
                let o = base + i * COMMIT_EXT_ENTRY;
                (be64(b, o), be32(b, o + 8), be32(b, o + 12))
            })
            .collect(),
    )
}

/// A parsed commit block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    pub sec: u64,
    pub nsec: u32,
    /// Checksum verifies (always true without csums).
    pub checksum_ok: bool,
    /// The stored checksum is that of the commit header followed by zeros: a
    /// plain commit block whose later sectors were not written (a torn write).
    /// The kernel accepts such a block as a complete commit
    /// (`jbd2_commit_block_csum_verify_partial`, "Find incomplete commit block"):
    /// its header sector alone proves the commit, since the block was issued only
    /// after the transaction's log blocks were durable. Always true with
    /// `checksum_ok`, false with a commit-block extension.
    pub header_ok: bool,
}

pub fn parse_commit(b: &[u8], f: &LogFormat) -> Option<Commit> {
    if b.len() != f.block_size || parse_header(b)?.0 != BLOCKTYPE_COMMIT {
        return None;
    }
    let (checksum_ok, header_ok) = if f.has_csum() {
        let stored = be32(b, COMMIT_CSUM);
        let mut head = crc32c_raw(f.seed, &b[..COMMIT_CSUM]);
        head = crc32c_raw(head, &[0; 4]);
        let full = crc32c_raw(head, &b[COMMIT_CSUM + 4..]);
        let ok = stored == full;
        let header_ok = ok || {
            let mut c = crc32c_raw(head, &b[COMMIT_CSUM + 4..COMMIT_HEADER_SIZE]);
            const ZEROS: [u8; 512] = [0; 512];
            let mut left = b.len() - COMMIT_HEADER_SIZE;
            while left > 0 {
                let n = left.min(ZEROS.len());
                c = crc32c_raw(c, &ZEROS[..n]);
                left -= n;
            }
            stored == c
        };
        (ok, header_ok)
    } else {
        (true, true)
    };
    Some(Commit {
        sec: be64(b, COMMIT_SEC),
        nsec: be32(b, COMMIT_NSEC),
        checksum_ok,
        header_ok,
    })
}

/// Build revoke blocks for `blocks` (as many blocks as needed).
pub fn build_revokes(f: &LogFormat, tid: u32, blocks: &[u64]) -> Vec<Vec<u8>> {
    let per = f.revokes_per_block().max(1);
    let rb = f.revoke_record_bytes();
    blocks
        .chunks(per)
        .map(|chunk| {
            let mut b = vec![0u8; f.block_size];
            put_header(&mut b, BLOCKTYPE_REVOKE, tid);
            let mut off = REVOKE_HEADER_SIZE;
            for &blk in chunk {
                if rb == 8 {
                    put_be64(&mut b, off, blk);
                } else {
                    put_be32(&mut b, off, blk as u32);
                }
                off += rb;
            }
            put_be32(&mut b, HEADER_SIZE, off as u32);
            if f.has_csum() {
                let c = tail_checksum(&b, f.seed);
                let n = b.len() - 4;
                put_be32(&mut b, n, c);
            }
            b
        })
        .collect()
}

/// Parse the records of a revoke block.
pub fn parse_revoke(b: &[u8], f: &LogFormat, jblk: u64) -> Result<Vec<u64>> {
    let s = "journal revoke block";
    if b.len() != f.block_size || parse_header(b).map(|h| h.0) != Some(BLOCKTYPE_REVOKE) {
        return Err(FormatError::corrupt(s, jblk, "not a revoke block"));
    }
    let count = be32(b, HEADER_SIZE) as usize;
    let rb = f.revoke_record_bytes();
    if count < REVOKE_HEADER_SIZE || count > f.block_size - f.tail_bytes() {
        return Err(FormatError::corrupt(
            s,
            jblk,
            format!("r_count {count} out of range"),
        ));
    }
    let mut out = Vec::with_capacity((count - REVOKE_HEADER_SIZE) / rb);
    let mut off = REVOKE_HEADER_SIZE;
    while off + rb <= count {
        out.push(if rb == 8 {
            be64(b, off)
        } else {
            be32(b, off) as u64
        });
        off += rb;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jbd2::INCOMPAT_REVOKE;

    fn fmt(incompat: u32, bs: usize) -> LogFormat {
        LogFormat {
            block_size: bs,
            incompat,
            seed: 0xABCD_1234,
        }
    }

    #[test]
    fn descriptor_round_trip_all_formats() {
        for incompat in [
            0,
            INCOMPAT_64BIT,
            INCOMPAT_64BIT | INCOMPAT_CSUM_V2,
            INCOMPAT_64BIT | INCOMPAT_CSUM_V3,
            INCOMPAT_CSUM_V3,
        ] {
            for bs in [1024, 4096] {
                let f = fmt(incompat, bs);
                let n = f.tags_per_descriptor();
                assert!(n > 10);
                let tags: Vec<Tag> = (0..n)
                    .map(|i| Tag {
                        blocknr: if f.is_64bit() {
                            (7u64 << 32) | i as u64
                        } else {
                            i as u64 + 9
                        },
                        flags: if i % 3 == 0 { TAG_ESCAPE } else { 0 },
                        checksum: if f.has_csum() {
                            (i as u32 * 77) & if f.csum_v3() { u32::MAX } else { 0xFFFF }
                        } else {
                            0
                        },
                    })
                    .collect();
                let b = build_descriptor(&f, 42, &tags);
                assert!(verify_tail(&b, &f));
                let back = parse_descriptor(&b, &f, 1).unwrap();
                assert_eq!(back.len(), n);
                for (a, t) in back.iter().zip(&tags) {
                    assert_eq!(a.blocknr, t.blocknr);
                    assert_eq!(a.checksum, t.checksum);
                    assert_eq!(a.flags & TAG_ESCAPE, t.flags & TAG_ESCAPE);
                }
                assert_eq!(back[0].flags & TAG_SAME_UUID, 0);
                assert_ne!(back[1].flags & TAG_SAME_UUID, 0);
                assert_ne!(back[n - 1].flags & TAG_LAST, 0);
                let mut bad = b.clone();
                bad[20] ^= 1;
                assert_eq!(verify_tail(&bad, &f), !f.has_csum());
            }
        }
    }

    #[test]
    fn commit_and_revoke_round_trip() {
        let f = fmt(INCOMPAT_64BIT | INCOMPAT_CSUM_V3 | INCOMPAT_REVOKE, 1024);
        let c = build_commit(&f, 9, 1_700_000_000, 5);
        let p = parse_commit(&c, &f).unwrap();
        assert!(p.checksum_ok);
        assert_eq!((p.sec, p.nsec), (1_700_000_000, 5));
        let mut bad = c.clone();
        bad[0x40] = 1;
        let p = parse_commit(&bad, &f).unwrap();
        // Bytes past the header torn: the full checksum fails, the header's holds.
        assert!(!p.checksum_ok && p.header_ok);
        bad[0x20] ^= 1;
        let p = parse_commit(&bad, &f).unwrap();
        assert!(!p.checksum_ok && !p.header_ok);
        // A commit block with the single-flush extension is never "header only".
        let ext = build_commit_ext(&f, 9, 1_700_000_000, 5, &[(100, 4, 7)]).unwrap();
        let p = parse_commit(&ext, &f).unwrap();
        assert!(p.checksum_ok && p.header_ok);
        let mut torn = ext.clone();
        torn[f.block_size - 1] = 0xff;
        let p = parse_commit(&torn, &f).unwrap();
        assert!(!p.checksum_ok && !p.header_ok);

        let blocks: Vec<u64> = (0..300).map(|i| i * 3 + (1 << 33)).collect();
        let rs = build_revokes(&f, 9, &blocks);
        assert_eq!(rs.len(), 300usize.div_ceil(f.revokes_per_block()));
        let mut all = Vec::new();
        for (i, r) in rs.iter().enumerate() {
            assert!(verify_tail(r, &f));
            all.extend(parse_revoke(r, &f, i as u64).unwrap());
        }
        assert_eq!(all, blocks);
        // r_count covers header + records: two 64-bit records -> 32 (§8.7).
        let two = build_revokes(&f, 1, &[5, 6]);
        assert_eq!(be32(&two[0], HEADER_SIZE), 32);
    }

    #[test]
    fn data_checksum_and_escape() {
        let f = fmt(INCOMPAT_CSUM_V3, 1024);
        let mut d = vec![0u8; 1024];
        assert!(!needs_escape(&d));
        put_be32(&mut d, 0, JBD2_MAGIC);
        assert!(needs_escape(&d));
        assert_ne!(data_checksum(&f, 1, &d), data_checksum(&f, 2, &d));
    }
}
