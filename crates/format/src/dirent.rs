//! Linear directory blocks: `ext4_dir_entry_2` records and the metadata_csum tail
//! (ext4-format.md §6.1–6.4).
//!
//! A leaf block is a chain of records, each `rec_len` bytes long, covering the
//! *usable area* `[0, usable)`: the whole block without metadata_csum, or the block
//! minus the 12-byte checksum tail with it. Every function here validates the chain
//! the way the kernel's `__ext4_check_dir_entry` does before trusting it, and returns
//! [`FormatError::Corrupt`] instead of panicking on bad data.

use crate::bytes::{le16, le32, put_le16, put_le32};
use crate::csum::crc32c_raw;
use crate::error::{FormatError, Result};

/// Size of the fixed part of a record (inode, rec_len, name_len, file_type).
pub const DIRENT_HEADER_LEN: usize = 8;
/// Longest name a record can hold.
pub const MAX_NAME_LEN: usize = 255;
/// Smallest possible record (`min_rec_len(1)`); also the minimum rec_len the kernel
/// accepts.
pub const MIN_REC_LEN: usize = 12;
/// Size of the checksum tail at the end of each leaf with metadata_csum (§6.4).
pub const TAIL_LEN: usize = 12;
/// `det_reserved_ft` of the checksum tail.
pub const FT_DIR_CSUM: u8 = 0xDE;

/// File type codes stored in `file_type` (§6.3).
pub const FT_UNKNOWN: u8 = 0;
pub const FT_REG_FILE: u8 = 1;
pub const FT_DIR: u8 = 2;
pub const FT_CHRDEV: u8 = 3;
pub const FT_BLKDEV: u8 = 4;
pub const FT_FIFO: u8 = 5;
pub const FT_SOCK: u8 = 6;
pub const FT_SYMLINK: u8 = 7;
/// Largest valid file type code.
pub const FT_MAX: u8 = FT_SYMLINK;

/// Block size from which rec_len needs the special encoding (§6.2).
const BIG_BLOCK: usize = 65536;
/// On-disk rec_len meaning "the whole 64 KiB block".
const MAX_REC_LEN_DISK: u16 = 0xFFFF;

const STRUCT: &str = "directory block";

/// Minimal record length for a name of `name_len` bytes: header plus name, rounded
/// up to 4 (§6.1).
#[inline]
pub const fn min_rec_len(name_len: usize) -> usize {
    (DIRENT_HEADER_LEN + name_len + 3) & !3
}

/// Decode an on-disk `rec_len` (§6.2). Below 64 KiB blocks the value is stored as is.
#[inline]
pub fn rec_len_from_disk(v: u16, block_size: usize) -> usize {
    if block_size < BIG_BLOCK {
        return usize::from(v);
    }
    if v == MAX_REC_LEN_DISK || v == 0 {
        return block_size;
    }
    usize::from(v & 0xFFFC) | (usize::from(v & 3) << 16)
}

/// Encode a record length for disk (§6.2).
#[inline]
pub fn rec_len_to_disk(len: usize, block_size: usize) -> u16 {
    if block_size < BIG_BLOCK {
        return len as u16;
    }
    if len == block_size {
        // 65536 has its own marker; larger blocks use 0 for "whole block".
        return if block_size == BIG_BLOCK {
            MAX_REC_LEN_DISK
        } else {
            0
        };
    }
    ((len & 0xFFFC) | ((len >> 16) & 3)) as u16
}

/// How leaf blocks of one file system are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafGeometry {
    /// File-system block size in bytes (1024 ..= 65536).
    pub block_size: usize,
    /// metadata_csum is on: every leaf ends with the 12-byte checksum tail.
    pub csum: bool,
    /// `s_inodes_count`; a record naming a larger inode is corrupt. 0 = do not check.
    pub inodes_count: u32,
}

impl LeafGeometry {
    /// End of the area records may occupy.
    #[inline]
    pub fn usable(&self) -> usize {
        if self.csum {
            self.block_size - TAIL_LEN
        } else {
            self.block_size
        }
    }
}

/// One record of a leaf block, borrowed from the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry<'a> {
    /// Byte offset of the record within the block.
    pub offset: usize,
    /// Inode number; 0 means the slot is unused.
    pub inode: u32,
    /// Decoded record length.
    pub rec_len: usize,
    /// File type code (§6.3).
    pub file_type: u8,
    /// Name bytes (`name_len` of them).
    pub name: &'a [u8],
}

impl DirEntry<'_> {
    /// Bytes this record needs for its own name (0 for an unused slot).
    #[inline]
    pub fn used_len(&self) -> usize {
        if self.inode == 0 {
            0
        } else {
            min_rec_len(self.name.len())
        }
    }
    /// Slack: bytes at the end of the record a new entry could take.
    #[inline]
    pub fn slack(&self) -> usize {
        self.rec_len - self.used_len()
    }
}

/// A live record copied out of a block (for leaf splits and htree conversion).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OwnedDirEntry {
    pub inode: u32,
    pub file_type: u8,
    pub name: Vec<u8>,
}

/// Iterator over the records of a leaf's usable area. Yields `Err` once (and then
/// stops) at the first record that fails validation.
#[derive(Debug, Clone)]
pub struct DirIter<'a> {
    block: &'a [u8],
    geo: LeafGeometry,
    blk: u64,
    pos: usize,
    end: usize,
    failed: bool,
}

/// Iterate over the records of `block` (which must be `geo.block_size` long; a shorter
/// slice yields an error). `blk` is only used in error messages.
pub fn iter(block: &[u8], geo: LeafGeometry, blk: u64) -> DirIter<'_> {
    iter_range(block, geo, blk, 0, geo.usable())
}

/// Iterate over records in `[start, end)` of `block`. Used for the part of a first
/// block after '.'/'..' or for whole-block walks of index blocks (`end` = block size).
pub fn iter_range(
    block: &[u8],
    geo: LeafGeometry,
    blk: u64,
    start: usize,
    end: usize,
) -> DirIter<'_> {
    DirIter {
        block,
        geo,
        blk,
        pos: start,
        end,
        failed: false,
    }
}

impl<'a> DirIter<'a> {
    fn fail(&mut self, off: usize, why: &str) -> Option<Result<DirEntry<'a>>> {
        self.failed = true;
        Some(Err(FormatError::corrupt(
            STRUCT,
            self.blk,
            format!("entry at offset {off}: {why}"),
        )))
    }
}

impl<'a> Iterator for DirIter<'a> {
    type Item = Result<DirEntry<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.end {
            return None;
        }
        let off = self.pos;
        if self.block.len() != self.geo.block_size || self.end > self.block.len() {
            return self.fail(off, "block buffer has the wrong size");
        }
        if off + DIRENT_HEADER_LEN > self.end {
            return self.fail(off, "directory entry overrun");
        }
        let b = self.block;
        let inode = le32(b, off);
        let rec_len = rec_len_from_disk(le16(b, off + 4), self.geo.block_size);
        let name_len = usize::from(b[off + 6]);
        let file_type = b[off + 7];
        // Same order of checks as the kernel (§6.1).
        if rec_len < MIN_REC_LEN {
            return self.fail(off, "rec_len is smaller than minimal");
        }
        if rec_len & 3 != 0 {
            return self.fail(off, "rec_len % 4 != 0");
        }
        if rec_len < min_rec_len(name_len) {
            return self.fail(off, "rec_len is too small for name_len");
        }
        let next = off + rec_len;
        if next > self.end {
            return self.fail(off, "directory entry overrun");
        }
        if next != self.end && next + MIN_REC_LEN > self.end {
            return self.fail(off, "directory entry too close to block end");
        }
        if self.geo.inodes_count != 0 && inode > self.geo.inodes_count {
            return self.fail(off, "inode out of bounds");
        }
        if inode != 0 && name_len == 0 {
            return self.fail(off, "live entry with empty name");
        }
        self.pos = next;
        Some(Ok(DirEntry {
            offset: off,
            inode,
            rec_len,
            file_type,
            name: &b[off + DIRENT_HEADER_LEN..off + DIRENT_HEADER_LEN + name_len],
        }))
    }
}

/// Validate every record of a leaf block.
pub fn validate(block: &[u8], geo: LeafGeometry, blk: u64) -> Result<()> {
    for e in iter(block, geo, blk) {
        e?;
    }
    Ok(())
}

/// Find the live record named `name`.
pub fn find<'a>(
    block: &'a [u8],
    geo: LeafGeometry,
    blk: u64,
    name: &[u8],
) -> Result<Option<DirEntry<'a>>> {
    for e in iter(block, geo, blk) {
        let e = e?;
        if e.inode != 0 && e.name == name {
            return Ok(Some(e));
        }
    }
    Ok(None)
}

/// Append all live records of `block` to `out`.
pub fn collect_live(
    block: &[u8],
    geo: LeafGeometry,
    blk: u64,
    out: &mut Vec<OwnedDirEntry>,
) -> Result<()> {
    for e in iter(block, geo, blk) {
        let e = e?;
        if e.inode != 0 {
            out.push(OwnedDirEntry {
                inode: e.inode,
                file_type: e.file_type,
                name: e.name.to_vec(),
            });
        }
    }
    Ok(())
}

/// Write a record header and name at `off` (no validation; callers ensure room).
fn write_record(
    block: &mut [u8],
    off: usize,
    inode: u32,
    rec_len: usize,
    name: &[u8],
    ft: u8,
    bs: usize,
) {
    put_le32(block, off, inode);
    put_le16(block, off + 4, rec_len_to_disk(rec_len, bs));
    block[off + 6] = name.len() as u8;
    block[off + 7] = ft;
    block[off + DIRENT_HEADER_LEN..off + DIRENT_HEADER_LEN + name.len()].copy_from_slice(name);
    // Zero the padding so blocks are deterministic.
    let padded = min_rec_len(name.len());
    block[off + DIRENT_HEADER_LEN + name.len()..off + padded].fill(0);
}

fn check_name(name: &[u8], blk: u64) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(FormatError::corrupt(
            STRUCT,
            blk,
            format!("name length {} out of range", name.len()),
        ));
    }
    Ok(())
}

/// Whether a record for a name of `name_len` bytes would fit somewhere in `block`.
pub fn has_room(block: &[u8], geo: LeafGeometry, blk: u64, name_len: usize) -> Result<bool> {
    let need = min_rec_len(name_len);
    for e in iter(block, geo, blk) {
        if e?.slack() >= need {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Largest record (as a [`min_rec_len`]) that [`insert`] could place in `block`: the
/// biggest slack of any record. Callers cache it per block to pick a leaf quickly.
pub fn max_slack(block: &[u8], geo: LeafGeometry, blk: u64) -> Result<usize> {
    let mut best = 0;
    for e in iter(block, geo, blk) {
        best = best.max(e?.slack());
    }
    Ok(best)
}

/// Check that a linear first block starts with '.' and '..' (§6.4) and return their
/// inode numbers.
pub fn dot_dotdot(block: &[u8], geo: LeafGeometry, blk: u64) -> Result<(u32, u32)> {
    let mut it = iter(block, geo, blk);
    let dot = it.next().transpose()?;
    let dotdot = it.next().transpose()?;
    match (dot, dotdot) {
        (Some(d), Some(dd)) if d.name == b"." && dd.name == b".." && d.offset == 0 => {
            Ok((d.inode, dd.inode))
        }
        _ => Err(FormatError::corrupt(
            STRUCT,
            blk,
            "first directory block does not start with '.' and '..'",
        )),
    }
}

/// Total bytes needed by the live records (sum of their minimal record lengths).
pub fn used_bytes(block: &[u8], geo: LeafGeometry, blk: u64) -> Result<usize> {
    let mut n = 0;
    for e in iter(block, geo, blk) {
        n += e?.used_len();
    }
    Ok(n)
}

/// Insert a record, like the kernel's `ext4_find_dest_de` + `ext4_insert_dentry`:
/// reuse the first unused slot that is big enough, else split the first record whose
/// slack can hold the new one. Returns the offset of the new record, or `None` when the
/// block has no room (the caller then splits the leaf or allocates a block).
///
/// The caller guarantees `name` is not present; the checksum tail is not updated.
pub fn insert(
    block: &mut [u8],
    geo: LeafGeometry,
    blk: u64,
    name: &[u8],
    inode: u32,
    ft: u8,
) -> Result<Option<usize>> {
    check_name(name, blk)?;
    let need = min_rec_len(name.len());
    let mut found = None;
    for e in iter(block, geo, blk) {
        let e = e?;
        if e.slack() >= need {
            found = Some((e.offset, e.inode, e.rec_len, e.used_len()));
            break;
        }
    }
    let Some((off, cur_ino, rec_len, used)) = found else {
        return Ok(None);
    };
    let bs = geo.block_size;
    if cur_ino == 0 {
        write_record(block, off, inode, rec_len, name, ft, bs);
        Ok(Some(off))
    } else {
        put_le16(block, off + 4, rec_len_to_disk(used, bs));
        let new_off = off + used;
        write_record(block, new_off, inode, rec_len - used, name, ft, bs);
        Ok(Some(new_off))
    }
}

/// Remove the live record at `offset` (as returned by [`find`]/[`iter`]), like the
/// kernel's `ext4_generic_delete_entry`: merge it into the previous record, or mark it
/// unused (inode 0) when it is the first one. `start` is where the walk begins (0 for
/// ordinary leaves). The checksum tail is not updated.
pub fn remove_at(
    block: &mut [u8],
    geo: LeafGeometry,
    blk: u64,
    start: usize,
    offset: usize,
) -> Result<()> {
    let mut prev: Option<(usize, usize)> = None;
    let mut target = None;
    for e in iter_range(block, geo, blk, start, geo.usable()) {
        let e = e?;
        if e.offset == offset {
            target = Some((e.rec_len, e.name.len(), e.inode));
            break;
        }
        if e.offset > offset {
            break;
        }
        prev = Some((e.offset, e.rec_len));
    }
    let Some((rec_len, name_len, inode)) = target else {
        return Err(FormatError::corrupt(
            STRUCT,
            blk,
            format!("no entry starts at offset {offset}"),
        ));
    };
    if inode == 0 {
        return Err(FormatError::corrupt(
            STRUCT,
            blk,
            format!("entry at offset {offset} is not in use"),
        ));
    }
    let bs = geo.block_size;
    match prev {
        Some((poff, plen)) => {
            put_le16(block, poff + 4, rec_len_to_disk(plen + rec_len, bs));
            // Scrub the dead record so removed names do not linger on disk.
            block[offset..offset + DIRENT_HEADER_LEN + name_len].fill(0);
        }
        None => {
            put_le32(block, offset, 0);
        }
    }
    Ok(())
}

/// Remove the live record named `name`; returns its inode, or `None` if absent.
pub fn remove(block: &mut [u8], geo: LeafGeometry, blk: u64, name: &[u8]) -> Result<Option<u32>> {
    let Some(e) = find(block, geo, blk, name)? else {
        return Ok(None);
    };
    let (off, ino) = (e.offset, e.inode);
    remove_at(block, geo, blk, 0, off)?;
    Ok(Some(ino))
}

/// Change the inode and file type of the live record at `offset` in place.
pub fn set_entry_inode(
    block: &mut [u8],
    geo: LeafGeometry,
    blk: u64,
    offset: usize,
    inode: u32,
    ft: u8,
) -> Result<()> {
    if offset + DIRENT_HEADER_LEN > geo.usable() || block.len() != geo.block_size {
        return Err(FormatError::corrupt(
            STRUCT,
            blk,
            format!("entry offset {offset} out of range"),
        ));
    }
    put_le32(block, offset, inode);
    block[offset + 7] = ft;
    Ok(())
}

/// Initialise an empty leaf: one unused record over the usable area, plus the tail
/// (checksum not yet computed) when `geo.csum`.
pub fn init_empty(block: &mut [u8], geo: LeafGeometry) {
    block.fill(0);
    let usable = geo.usable();
    put_le32(block, 0, 0);
    put_le16(block, 4, rec_len_to_disk(usable, geo.block_size));
    if geo.csum {
        init_tail(block);
    }
}

/// Initialise the first block of a new linear directory: '.' (rec_len 12), '..' up to
/// the end of the usable area, and the tail (§6.4).
pub fn init_first(block: &mut [u8], geo: LeafGeometry, self_ino: u32, parent_ino: u32) {
    block.fill(0);
    let bs = geo.block_size;
    write_record(block, 0, self_ino, MIN_REC_LEN, b".", FT_DIR, bs);
    write_record(
        block,
        MIN_REC_LEN,
        parent_ino,
        geo.usable() - MIN_REC_LEN,
        b"..",
        FT_DIR,
        bs,
    );
    if geo.csum {
        init_tail(block);
    }
}

/// Pack `entries` into a fresh leaf (each at its minimal length, the last one
/// extended to the end of the usable area), writing the tail when `geo.csum`.
/// Returns an error if they do not fit. An empty list gives an empty leaf.
pub fn pack<'n, I>(block: &mut [u8], geo: LeafGeometry, blk: u64, entries: I) -> Result<()>
where
    I: IntoIterator<Item = (u32, u8, &'n [u8])>,
{
    init_empty(block, geo);
    let usable = geo.usable();
    let mut off = 0;
    let mut last: Option<usize> = None;
    for (ino, ft, name) in entries {
        check_name(name, blk)?;
        let len = min_rec_len(name.len());
        if off + len > usable {
            return Err(FormatError::corrupt(
                STRUCT,
                blk,
                "entries do not fit in one block",
            ));
        }
        write_record(block, off, ino, len, name, ft, geo.block_size);
        last = Some(off);
        off += len;
    }
    if let Some(l) = last {
        put_le16(block, l + 4, rec_len_to_disk(usable - l, geo.block_size));
    }
    Ok(())
}

/// Write the 12-byte tail fields (checksum 0) at the end of the block (§6.4).
pub fn init_tail(block: &mut [u8]) {
    let t = block.len() - TAIL_LEN;
    block[t..].fill(0);
    put_le16(block, t + 4, TAIL_LEN as u16);
    block[t + 7] = FT_DIR_CSUM;
}

/// Whether the tail fields sit at the end of the block (the kernel's check).
pub fn tail_fields_ok(block: &[u8]) -> bool {
    if block.len() < TAIL_LEN + MIN_REC_LEN {
        return false;
    }
    let t = block.len() - TAIL_LEN;
    le32(block, t) == 0
        && le16(block, t + 4) == TAIL_LEN as u16
        && block[t + 6] == 0
        && block[t + 7] == FT_DIR_CSUM
}

/// Whether the block has a checksum tail as e2fsck sees it: the rec_len chain from
/// offset 0 lands exactly on `bs - 12`, and the tail fields are right (§6.4).
pub fn has_tail(block: &[u8], block_size: usize) -> bool {
    if block.len() != block_size || !tail_fields_ok(block) {
        return false;
    }
    let top = block_size - TAIL_LEN;
    let mut off = 0;
    while off < top {
        if off + DIRENT_HEADER_LEN > block_size {
            return false;
        }
        let r = rec_len_from_disk(le16(block, off + 4), block_size);
        if r < MIN_REC_LEN || r & 3 != 0 {
            return false;
        }
        off += r;
    }
    off == top
}

/// Leaf checksum: CRC32C of everything before the tail, seeded with the directory's
/// inode seed (`CsumCtx::inode_seed(dir_ino, generation)`, §1.3).
pub fn leaf_csum(block: &[u8], inode_seed: u32) -> u32 {
    crc32c_raw(inode_seed, &block[..block.len().saturating_sub(TAIL_LEN)])
}

/// Recompute and store the tail checksum. The tail fields must already be there.
pub fn set_leaf_csum(block: &mut [u8], inode_seed: u32) {
    let c = leaf_csum(block, inode_seed);
    let n = block.len();
    put_le32(block, n - 4, c);
}

/// Verify the tail checksum; a missing tail is a corruption ("no space for checksum").
pub fn verify_leaf_csum(block: &[u8], inode_seed: u32, blk: u64) -> Result<()> {
    if !tail_fields_ok(block) {
        return Err(FormatError::corrupt(
            STRUCT,
            blk,
            "no space for directory leaf checksum",
        ));
    }
    let stored = le32(block, block.len() - 4);
    let computed = leaf_csum(block, inode_seed);
    if stored != computed {
        return Err(FormatError::BadChecksum {
            structure: STRUCT,
            block: blk,
            stored,
            computed,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn geo(bs: usize, csum: bool) -> LeafGeometry {
        LeafGeometry {
            block_size: bs,
            csum,
            inodes_count: 1 << 20,
        }
    }

    fn names(block: &[u8], g: LeafGeometry) -> BTreeMap<Vec<u8>, (u32, u8)> {
        iter(block, g, 0)
            .map(|e| e.unwrap())
            .filter(|e| e.inode != 0)
            .map(|e| (e.name.to_vec(), (e.inode, e.file_type)))
            .collect()
    }

    #[test]
    fn rec_len_encoding_roundtrips_for_all_block_sizes() {
        for bs in [1024usize, 4096, 65536, 131072] {
            for len in (12..=bs).step_by(4) {
                let d = rec_len_to_disk(len, bs);
                assert_eq!(rec_len_from_disk(d, bs), len, "bs {bs} len {len}");
            }
        }
        assert_eq!(rec_len_to_disk(65536, 65536), 0xFFFF);
        assert_eq!(rec_len_from_disk(0, 65536), 65536);
        assert_eq!(rec_len_from_disk(0, 4096), 0);
    }

    #[test]
    fn min_rec_len_values() {
        assert_eq!(min_rec_len(1), 12);
        assert_eq!(min_rec_len(4), 12);
        assert_eq!(min_rec_len(5), 16);
        assert_eq!(min_rec_len(255), 264);
    }

    #[test]
    fn first_block_layout() {
        for (bs, csum) in [(1024, true), (4096, false), (65536, true)] {
            let g = geo(bs, csum);
            let mut b = vec![0xAAu8; bs];
            init_first(&mut b, g, 12, 2);
            let es: Vec<_> = iter(&b, g, 0).map(|e| e.unwrap()).collect();
            assert_eq!(es.len(), 2);
            assert_eq!(
                (es[0].name, es[0].inode, es[0].rec_len),
                (&b"."[..], 12, 12)
            );
            assert_eq!((es[1].name, es[1].inode), (&b".."[..], 2));
            assert_eq!(es[1].offset + es[1].rec_len, g.usable());
            assert_eq!(has_tail(&b, bs), csum);
            assert_eq!(dot_dotdot(&b, g, 0).unwrap(), (12, 2));
            assert_eq!(max_slack(&b, g, 0).unwrap(), g.usable() - 24);
        }
        let g = geo(1024, true);
        let mut b = vec![0u8; 1024];
        init_empty(&mut b, g);
        assert!(dot_dotdot(&b, g, 0).is_err());
    }

    #[test]
    fn checksum_verifies_and_detects_changes() {
        let g = geo(1024, true);
        let mut b = vec![0u8; 1024];
        init_first(&mut b, g, 12, 2);
        insert(&mut b, g, 0, b"hello", 13, FT_REG_FILE)
            .unwrap()
            .unwrap();
        set_leaf_csum(&mut b, 0xDEAD_BEEF);
        verify_leaf_csum(&b, 0xDEAD_BEEF, 0).unwrap();
        assert!(matches!(
            verify_leaf_csum(&b, 0xDEAD_BEEE, 0),
            Err(FormatError::BadChecksum { .. })
        ));
        b[30] ^= 1;
        assert!(verify_leaf_csum(&b, 0xDEAD_BEEF, 0).is_err());
        let mut nt = vec![0u8; 1024];
        init_empty(&mut nt, geo(1024, false));
        assert!(!has_tail(&nt, 1024));
        assert!(matches!(
            verify_leaf_csum(&nt, 1, 0),
            Err(FormatError::Corrupt { .. })
        ));
    }

    #[test]
    fn insert_fills_then_reports_no_room() {
        let g = geo(1024, true);
        let mut b = vec![0u8; 1024];
        init_empty(&mut b, g);
        let mut n = 0;
        while insert(&mut b, g, 0, format!("f{n:06}").as_bytes(), 100 + n, 1)
            .unwrap()
            .is_some()
        {
            n += 1;
        }
        // 16-byte records in 1012 usable bytes.
        assert_eq!(n as usize, (1024 - 12) / 16);
        assert_eq!(names(&b, g).len(), n as usize);
        assert!(has_tail(&b, 1024));
        assert!(!has_room(&b, g, 0, 7).unwrap());
        // Removing one makes room again, and the slot is reused.
        assert_eq!(remove(&mut b, g, 0, b"f000010").unwrap(), Some(110));
        assert!(has_room(&b, g, 0, 7).unwrap());
        assert!(insert(&mut b, g, 0, b"g000010", 5, 1).unwrap().is_some());
        assert_eq!(remove(&mut b, g, 0, b"nope").unwrap(), None);
    }

    #[test]
    fn remove_first_entry_clears_inode_only() {
        let g = geo(4096, true);
        let mut b = vec![0u8; 4096];
        init_empty(&mut b, g);
        insert(&mut b, g, 0, b"a", 20, 1).unwrap().unwrap();
        insert(&mut b, g, 0, b"b", 21, 1).unwrap().unwrap();
        assert_eq!(remove(&mut b, g, 0, b"a").unwrap(), Some(20));
        let es: Vec<_> = iter(&b, g, 0).map(|e| e.unwrap()).collect();
        assert_eq!(es[0].inode, 0);
        assert_eq!(es[0].rec_len, 12);
        assert_eq!(es[1].name, b"b");
        // The unused first slot is reused by a short name.
        assert_eq!(insert(&mut b, g, 0, b"c", 22, 1).unwrap(), Some(0));
    }

    #[test]
    fn validation_rejects_bad_records_without_panicking() {
        let g = geo(1024, true);
        let mut base = vec![0u8; 1024];
        init_first(&mut base, g, 12, 2);
        // rec_len too small
        let mut b = base.clone();
        put_le16(&mut b, 4, 8);
        assert!(validate(&b, g, 7).is_err());
        // not multiple of 4
        let mut b = base.clone();
        put_le16(&mut b, 4, 14);
        assert!(validate(&b, g, 7).is_err());
        // name_len larger than rec_len allows
        let mut b = base.clone();
        b[6] = 20;
        assert!(validate(&b, g, 7).is_err());
        // overrun
        let mut b = base.clone();
        put_le16(&mut b, 16, 2000);
        assert!(validate(&b, g, 7).is_err());
        // too close to end
        let mut b = base.clone();
        put_le16(&mut b, 16, (1012 - 12 - 8) as u16);
        assert!(validate(&b, g, 7).is_err());
        // inode out of bounds
        let mut b = base.clone();
        put_le32(&mut b, 12, u32::MAX);
        assert!(validate(&b, g, 7).is_err());
        // wrong buffer size
        assert!(validate(&base[..512], g, 7).is_err());
        let err = validate(
            &{
                let mut b = base.clone();
                put_le16(&mut b, 4, 0);
                b
            },
            g,
            7,
        )
        .unwrap_err();
        assert!(err.to_string().contains("block 7"), "{err}");
    }

    #[test]
    fn pack_then_collect() {
        let g = geo(1024, true);
        let mut b = vec![0u8; 1024];
        let src: Vec<(u32, u8, Vec<u8>)> = (0..20)
            .map(|i| (i + 11, 1, format!("name{i}").into_bytes()))
            .collect();
        pack(
            &mut b,
            g,
            0,
            src.iter().map(|(i, f, n)| (*i, *f, n.as_slice())),
        )
        .unwrap();
        let mut out = Vec::new();
        collect_live(&b, g, 0, &mut out).unwrap();
        assert_eq!(out.len(), 20);
        assert_eq!(out[3].name, b"name3");
        assert!(has_tail(&b, 1024));
        let too_many: Vec<Vec<u8>> = (0..100)
            .map(|i| format!("name{i:04}").into_bytes())
            .collect();
        assert!(pack(&mut b, g, 0, too_many.iter().map(|n| (1, 1, n.as_slice()))).is_err());
    }

    proptest! {
        #[test]
        fn random_insert_remove_keeps_block_valid(
            ops in proptest::collection::vec((any::<bool>(), 0usize..64, 1usize..40), 1..300),
            bs_sel in 0usize..3,
            csum in any::<bool>(),
        ) {
            let bs = [1024usize, 4096, 65536][bs_sel];
            let g = geo(bs, csum);
            let seed = 0x1234_5678;
            let mut b = vec![0u8; bs];
            init_first(&mut b, g, 2, 2);
            let mut model: BTreeMap<Vec<u8>, (u32, u8)> = BTreeMap::new();
            model.insert(b".".to_vec(), (2, FT_DIR));
            model.insert(b"..".to_vec(), (2, FT_DIR));
            for (add, k, len) in ops {
                let name: Vec<u8> = format!("{k}-{}", "x".repeat(len)).into_bytes();
                if add {
                    if model.contains_key(&name) { continue; }
                    let ino = 100 + k as u32;
                    if insert(&mut b, g, 0, &name, ino, FT_REG_FILE).unwrap().is_some() {
                        model.insert(name, (ino, FT_REG_FILE));
                    } else {
                        prop_assert!(!has_room(&b, g, 0, name.len()).unwrap());
                    }
                } else {
                    let got = remove(&mut b, g, 0, &name).unwrap();
                    prop_assert_eq!(got, model.remove(&name).map(|v| v.0));
                }
                validate(&b, g, 0).unwrap();
                prop_assert_eq!(has_tail(&b, bs), csum);
                if csum {
                    set_leaf_csum(&mut b, seed);
                    verify_leaf_csum(&b, seed, 0).unwrap();
                }
                prop_assert_eq!(names(&b, g), model.clone());
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 1024), csum in any::<bool>()) {
            let g = geo(1024, csum);
            let _ = validate(&data, g, 0);
            let _ = has_tail(&data, 1024);
            let _ = find(&data, g, 0, b"x");
            let mut d = data.clone();
            let _ = insert(&mut d, g, 0, b"abc", 5, 1);
            let mut d = data.clone();
            let _ = remove(&mut d, g, 0, b"abc");
            let _ = verify_leaf_csum(&data, 0, 0);
        }
    }
}
