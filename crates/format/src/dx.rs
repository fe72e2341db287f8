//! htree (hashed directory index) root and interior node blocks
//! (ext4-format.md §6.5, checksums §1.3).
//!
//! The root lives in directory block 0, hidden behind '.' and a '..' record that spans
//! the rest of the block; interior nodes are blocks holding one unused record that
//! spans the whole block. Both carry a `limit`/`count` pair followed by `{hash, block}`
//! entries; entry 0 has no hash (implicitly 0). With metadata_csum an 8-byte
//! `dx_tail` ends the entry array.

use crate::bytes::{le16, le32, put_le16, put_le32};
use crate::csum::crc32c_raw;
use crate::dirent::{self, FT_DIR};
use crate::dirhash::DX_HASH_TEA;
use crate::error::{FormatError, Result};

/// Size of one `{hash, block}` index entry.
pub const DX_ENTRY_LEN: usize = 8;
/// Size of `dx_tail` (`dt_reserved`, `dt_checksum`).
pub const DX_TAIL_LEN: usize = 8;
/// Offset of `dx_root_info` in the root block.
pub const ROOT_INFO_OFFSET: usize = 0x18;
/// `dx_root_info.info_length` written by every implementation.
pub const ROOT_INFO_LEN: u8 = 8;
/// Offset of `limit`/`count` in the root block.
pub const ROOT_COUNT_OFFSET: usize = 0x20;
/// Offset of `limit`/`count` in an interior node.
pub const NODE_COUNT_OFFSET: usize = 0x08;
/// Low bit of a stored hash: "this leaf continues the previous one's hash" (§6.5).
pub const HASH_CONTINUATION: u32 = 1;
/// `dx_entry.block` uses only the low 28 bits (§6.5).
pub const BLOCK_MASK: u32 = 0x0FFF_FFFF;
/// Maximum `indirect_levels` without / with the `largedir` feature.
pub const MAX_INDIRECT_LEVELS: u8 = 1;
pub const MAX_INDIRECT_LEVELS_LARGEDIR: u8 = 2;

const ROOT_STRUCT: &str = "htree root";
const NODE_STRUCT: &str = "htree node";

/// One index entry. For entry 0 of a root or node, `hash` is 0 (not stored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DxEntry {
    /// Lowest hash of the child (bit 0 = continuation flag).
    pub hash: u32,
    /// Directory-relative block of the child.
    pub block: u32,
}

/// How index blocks of one file system are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DxGeometry {
    pub block_size: usize,
    /// metadata_csum: index blocks end with `dx_tail`.
    pub csum: bool,
    /// `largedir` feature: one more index level allowed.
    pub largedir: bool,
}

impl DxGeometry {
    /// `limit` of the root (§6.5): the kernel and e2fsck demand exactly this.
    pub fn root_limit(&self) -> usize {
        (self.block_size - 12 - 12 - usize::from(ROOT_INFO_LEN) - self.tail_len()) / DX_ENTRY_LEN
    }
    /// `limit` of an interior node.
    pub fn node_limit(&self) -> usize {
        (self.block_size - 8 - self.tail_len()) / DX_ENTRY_LEN
    }
    /// Highest allowed `indirect_levels`.
    pub fn max_indirect_levels(&self) -> u8 {
        if self.largedir {
            MAX_INDIRECT_LEVELS_LARGEDIR
        } else {
            MAX_INDIRECT_LEVELS
        }
    }
    fn tail_len(&self) -> usize {
        if self.csum {
            DX_TAIL_LEN
        } else {
            0
        }
    }
}

/// Parsed `dx_root` (block 0 of an indexed directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DxRoot {
    /// '.' inode (the directory itself).
    pub dot_inode: u32,
    /// '..' inode (the parent).
    pub dotdot_inode: u32,
    /// On-disk hash version (0 legacy, 1 half_md4, 2 tea).
    pub hash_version: u8,
    /// 0: root entries point at leaves; 1 (or 2 with largedir): interior levels.
    pub indirect_levels: u8,
    /// Entries, `entries[0].hash == 0`; never empty.
    pub entries: Vec<DxEntry>,
}

/// Parsed interior node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DxNode {
    /// Entries, `entries[0].hash == 0`; never empty.
    pub entries: Vec<DxEntry>,
}

/// Where `limit`/`count` sit in this block if it looks like a dx root or node, as the
/// kernel's `get_dx_countlimit` decides; `None` if it looks like neither.
pub fn count_offset(block: &[u8], block_size: usize) -> Option<usize> {
    if block.len() != block_size || block_size < 64 {
        return None;
    }
    let r0 = dirent::rec_len_from_disk(le16(block, 4), block_size);
    if r0 == block_size {
        return Some(NODE_COUNT_OFFSET);
    }
    if r0 != 12 {
        return None;
    }
    let r1 = dirent::rec_len_from_disk(le16(block, 12 + 4), block_size);
    if r1 != block_size - 12 {
        return None;
    }
    if le32(block, ROOT_INFO_OFFSET) != 0 || block[ROOT_INFO_OFFSET + 5] != ROOT_INFO_LEN {
        return None;
    }
    Some(ROOT_COUNT_OFFSET)
}

/// Read the entry array at `co` (count offset), validating limit and count.
fn parse_entries(
    block: &[u8],
    geo: &DxGeometry,
    co: usize,
    want_limit: usize,
    structure: &'static str,
    blk: u64,
) -> Result<Vec<DxEntry>> {
    let limit = usize::from(le16(block, co));
    let count = usize::from(le16(block, co + 2));
    if limit != want_limit {
        return Err(FormatError::corrupt(
            structure,
            blk,
            format!("limit {limit}, expected {want_limit}"),
        ));
    }
    if count == 0 || count > limit {
        return Err(FormatError::corrupt(
            structure,
            blk,
            format!("count {count} not in 1..={limit}"),
        ));
    }
    // limit was checked against the formula, so the array (and tail) fit the block.
    debug_assert!(co + DX_ENTRY_LEN * limit + geo.tail_len() <= geo.block_size);
    let mut out = Vec::with_capacity(count);
    let mut prev = 0u32;
    for i in 0..count {
        let off = co + DX_ENTRY_LEN * i;
        let hash = if i == 0 { 0 } else { le32(block, off) };
        let block_nr = le32(block, off + 4) & BLOCK_MASK;
        if hash & !HASH_CONTINUATION < prev {
            return Err(FormatError::corrupt(
                structure,
                blk,
                format!("entry {i}: hash {hash:#x} below previous {prev:#x}"),
            ));
        }
        prev = hash & !HASH_CONTINUATION;
        out.push(DxEntry {
            hash,
            block: block_nr,
        });
    }
    Ok(out)
}

/// Parse and validate a root block (the checksum is checked separately, see
/// [`verify_csum`]). `blk` only names the block in errors.
pub fn parse_root(block: &[u8], geo: &DxGeometry, blk: u64) -> Result<DxRoot> {
    let bs = geo.block_size;
    if block.len() != bs {
        return Err(FormatError::corrupt(
            ROOT_STRUCT,
            blk,
            "block buffer has the wrong size",
        ));
    }
    let dot_len = dirent::rec_len_from_disk(le16(block, 4), bs);
    if dot_len != 12 || block[6] != 1 || block[8] != b'.' {
        return Err(FormatError::corrupt(ROOT_STRUCT, blk, "bad '.' entry"));
    }
    let dd_len = dirent::rec_len_from_disk(le16(block, 16), bs);
    if dd_len != bs - 12 || block[18] != 2 || &block[20..22] != b".." {
        return Err(FormatError::corrupt(ROOT_STRUCT, blk, "bad '..' entry"));
    }
    let i = ROOT_INFO_OFFSET;
    let reserved = le32(block, i);
    let hash_version = block[i + 4];
    let info_length = block[i + 5];
    let indirect_levels = block[i + 6];
    let unused_flags = block[i + 7];
    if reserved != 0 || info_length != ROOT_INFO_LEN {
        return Err(FormatError::corrupt(ROOT_STRUCT, blk, "bad dx_root_info"));
    }
    if hash_version > DX_HASH_TEA {
        return Err(FormatError::corrupt(
            ROOT_STRUCT,
            blk,
            format!("unrecognised hash version {hash_version}"),
        ));
    }
    if unused_flags & 1 != 0 {
        return Err(FormatError::corrupt(
            ROOT_STRUCT,
            blk,
            "unimplemented hash flags",
        ));
    }
    if indirect_levels > geo.max_indirect_levels() {
        return Err(FormatError::corrupt(
            ROOT_STRUCT,
            blk,
            format!(
                "indirect_levels {indirect_levels} over maximum {}",
                geo.max_indirect_levels()
            ),
        ));
    }
    let entries = parse_entries(
        block,
        geo,
        ROOT_COUNT_OFFSET,
        geo.root_limit(),
        ROOT_STRUCT,
        blk,
    )?;
    Ok(DxRoot {
        dot_inode: le32(block, 0),
        dotdot_inode: le32(block, 12),
        hash_version,
        indirect_levels,
        entries,
    })
}

/// Parse and validate an interior node block (checksum checked separately).
pub fn parse_node(block: &[u8], geo: &DxGeometry, blk: u64) -> Result<DxNode> {
    let bs = geo.block_size;
    if block.len() != bs {
        return Err(FormatError::corrupt(
            NODE_STRUCT,
            blk,
            "block buffer has the wrong size",
        ));
    }
    if le32(block, 0) != 0 || dirent::rec_len_from_disk(le16(block, 4), bs) != bs || block[6] != 0 {
        return Err(FormatError::corrupt(
            NODE_STRUCT,
            blk,
            "bad fake directory entry",
        ));
    }
    let entries = parse_entries(
        block,
        geo,
        NODE_COUNT_OFFSET,
        geo.node_limit(),
        NODE_STRUCT,
        blk,
    )?;
    Ok(DxNode { entries })
}

fn write_entries(block: &mut [u8], co: usize, limit: usize, entries: &[DxEntry]) {
    put_le16(block, co, limit as u16);
    put_le16(block, co + 2, entries.len() as u16);
    for (i, e) in entries.iter().enumerate() {
        let off = co + DX_ENTRY_LEN * i;
        if i > 0 {
            put_le32(block, off, e.hash);
        }
        put_le32(block, off + 4, e.block & BLOCK_MASK);
    }
}

fn check_count(n: usize, limit: usize, structure: &'static str) -> Result<()> {
    if n == 0 || n > limit {
        return Err(FormatError::corrupt(
            structure,
            0,
            format!("cannot write {n} entries (limit {limit})"),
        ));
    }
    Ok(())
}

/// Serialise a root into `block` (whole block rewritten; `dx_tail` zeroed, checksum
/// not yet computed).
pub fn write_root(block: &mut [u8], geo: &DxGeometry, root: &DxRoot) -> Result<()> {
    write_root_parts(
        block,
        geo,
        RootHeader {
            dot_inode: root.dot_inode,
            dotdot_inode: root.dotdot_inode,
            hash_version: root.hash_version,
            indirect_levels: root.indirect_levels,
        },
        &root.entries,
    )
}

/// The fixed part of a root, for [`write_root_parts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootHeader {
    pub dot_inode: u32,
    pub dotdot_inode: u32,
    pub hash_version: u8,
    pub indirect_levels: u8,
}

/// [`write_root`] from borrowed parts (no entry vector needs to be built).
pub fn write_root_parts(
    block: &mut [u8],
    geo: &DxGeometry,
    hdr: RootHeader,
    entries: &[DxEntry],
) -> Result<()> {
    let bs = geo.block_size;
    check_count(entries.len(), geo.root_limit(), ROOT_STRUCT)?;
    block.fill(0);
    put_le32(block, 0, hdr.dot_inode);
    put_le16(block, 4, dirent::rec_len_to_disk(12, bs));
    block[6] = 1;
    block[7] = FT_DIR;
    block[8] = b'.';
    put_le32(block, 12, hdr.dotdot_inode);
    put_le16(block, 16, dirent::rec_len_to_disk(bs - 12, bs));
    block[18] = 2;
    block[19] = FT_DIR;
    block[20] = b'.';
    block[21] = b'.';
    let i = ROOT_INFO_OFFSET;
    block[i + 4] = hdr.hash_version;
    block[i + 5] = ROOT_INFO_LEN;
    block[i + 6] = hdr.indirect_levels;
    write_entries(block, ROOT_COUNT_OFFSET, geo.root_limit(), entries);
    Ok(())
}

/// Serialise an interior node into `block` (checksum not yet computed).
pub fn write_node(block: &mut [u8], geo: &DxGeometry, node: &DxNode) -> Result<()> {
    write_node_entries(block, geo, &node.entries)
}

/// [`write_node`] from a borrowed entry slice.
pub fn write_node_entries(block: &mut [u8], geo: &DxGeometry, entries: &[DxEntry]) -> Result<()> {
    let bs = geo.block_size;
    check_count(entries.len(), geo.node_limit(), NODE_STRUCT)?;
    block.fill(0);
    put_le16(block, 4, dirent::rec_len_to_disk(bs, bs));
    write_entries(block, NODE_COUNT_OFFSET, geo.node_limit(), entries);
    Ok(())
}

/// Update only the '..' inode of a root block (rename across parents). Checksum
/// must be recomputed afterwards.
pub fn set_root_dotdot(block: &mut [u8], inode: u32) {
    put_le32(block, 12, inode);
}

/// Checksum of an index block whose count sits at `co` (§1.3): the block up to the
/// used entries, then `dt_reserved`, then four zero bytes for `dt_checksum`.
fn csum_at(
    block: &[u8],
    co: usize,
    inode_seed: u32,
    structure: &'static str,
    blk: u64,
) -> Result<(u32, usize)> {
    let bs = block.len();
    if co + 4 > bs {
        return Err(FormatError::corrupt(structure, blk, "block too small"));
    }
    let limit = usize::from(le16(block, co));
    let count = usize::from(le16(block, co + 2));
    let tail = co + DX_ENTRY_LEN * limit;
    if tail + DX_TAIL_LEN > bs {
        return Err(FormatError::corrupt(
            structure,
            blk,
            "no space for htree checksum",
        ));
    }
    if count > limit {
        return Err(FormatError::corrupt(
            structure,
            blk,
            format!("count {count} > limit {limit}"),
        ));
    }
    let used = co + DX_ENTRY_LEN * count;
    let c = crc32c_raw(inode_seed, &block[..used]);
    let c = crc32c_raw(c, &block[tail..tail + 4]);
    let c = crc32c_raw(c, &[0u8; 4]);
    Ok((c, tail + 4))
}

fn structure_for(co: usize) -> &'static str {
    if co == ROOT_COUNT_OFFSET {
        ROOT_STRUCT
    } else {
        NODE_STRUCT
    }
}

/// Compute and store the `dx_tail` checksum of a root (`co` = [`ROOT_COUNT_OFFSET`]) or
/// node (`co` = [`NODE_COUNT_OFFSET`]) block. Needs metadata_csum limits.
pub fn set_csum(block: &mut [u8], co: usize, inode_seed: u32) -> Result<()> {
    let (c, at) = csum_at(block, co, inode_seed, structure_for(co), 0)?;
    put_le32(block, at, c);
    Ok(())
}

/// Verify the `dx_tail` checksum of a root or node block.
pub fn verify_csum(block: &[u8], co: usize, inode_seed: u32, blk: u64) -> Result<()> {
    let structure = structure_for(co);
    let (computed, at) = csum_at(block, co, inode_seed, structure, blk)?;
    let stored = le32(block, at);
    if stored != computed {
        return Err(FormatError::BadChecksum {
            structure,
            block: blk,
            stored,
            computed,
        });
    }
    Ok(())
}

/// Index of the entry whose subtree holds `hash`: the last entry whose stored hash is
/// `<= hash` (entry 0 always qualifies). Stored hashes keep their continuation bit, so
/// a target equal to a continued hash lands on the leaf *before* it, from where the
/// continuation is followed (see [`continues_into`]) — the kernel's `dx_probe` rule.
pub fn lookup(entries: &[DxEntry], hash: u32) -> usize {
    if entries.len() <= 1 {
        return 0;
    }
    // partition_point over entries[1..]: count of entries with hash <= target.
    entries[1..].partition_point(|e| e.hash <= hash)
}

/// Whether a search for `hash` that finished the child at `idx` must go on into the
/// child at `idx + 1`: the kernel (`ext4_htree_next_block`) continues whenever the next
/// entry's hash, continuation bit ignored, equals `hash`. Writers set the bit on such
/// entries, so in practice this is "continuation bit set and same hash".
pub fn continues_into(entries: &[DxEntry], idx: usize, hash: u32) -> bool {
    match entries.get(idx + 1) {
        Some(e) => e.hash & !HASH_CONTINUATION == hash & !HASH_CONTINUATION,
        None => false,
    }
}

/// Hash range `[lo, hi]` (inclusive, continuation bits cleared) names under entry
/// `idx` may have, given the range `[parent_lo, parent_hi]` of the whole block — e2fsck's
/// rule (§6.5).
pub fn entry_range(entries: &[DxEntry], idx: usize, parent_lo: u32, parent_hi: u32) -> (u32, u32) {
    let lo = if idx == 0 {
        parent_lo
    } else {
        entries[idx].hash & !HASH_CONTINUATION
    };
    let hi = match entries.get(idx + 1) {
        Some(e) => e.hash & !HASH_CONTINUATION,
        None => parent_hi,
    };
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dirhash::dx_hash;
    use proptest::prelude::*;

    fn geo(bs: usize, csum: bool) -> DxGeometry {
        DxGeometry {
            block_size: bs,
            csum,
            largedir: false,
        }
    }

    fn sample_root(n: usize) -> DxRoot {
        let mut entries = vec![DxEntry { hash: 0, block: 1 }];
        for i in 1..n {
            entries.push(DxEntry {
                hash: (i as u32) * 0x0100_0000,
                block: i as u32 + 1,
            });
        }
        DxRoot {
            dot_inode: 12,
            dotdot_inode: 2,
            hash_version: 1,
            indirect_levels: 0,
            entries,
        }
    }

    #[test]
    fn limits_match_reference_table() {
        assert_eq!(geo(1024, true).root_limit(), 123);
        assert_eq!(geo(1024, true).node_limit(), 126);
        assert_eq!(geo(4096, true).root_limit(), 507);
        assert_eq!(geo(4096, true).node_limit(), 510);
        assert_eq!(geo(1024, false).root_limit(), 124);
        assert_eq!(geo(1024, false).node_limit(), 127);
        assert_eq!(geo(4096, false).root_limit(), 508);
        assert_eq!(geo(4096, false).node_limit(), 511);
    }

    #[test]
    fn root_roundtrip_and_checksum() {
        for (bs, csum) in [(1024, true), (4096, true), (4096, false)] {
            let g = geo(bs, csum);
            let root = sample_root(5);
            let mut b = vec![0u8; bs];
            write_root(&mut b, &g, &root).unwrap();
            assert_eq!(count_offset(&b, bs), Some(ROOT_COUNT_OFFSET));
            assert_eq!(parse_root(&b, &g, 0).unwrap(), root);
            if csum {
                set_csum(&mut b, ROOT_COUNT_OFFSET, 77).unwrap();
                verify_csum(&b, ROOT_COUNT_OFFSET, 77, 0).unwrap();
                assert!(verify_csum(&b, ROOT_COUNT_OFFSET, 78, 0).is_err());
                // Bytes beyond the used entries (before the tail) are not covered.
                let mut c = b.clone();
                c[ROOT_COUNT_OFFSET + 8 * 6] ^= 0xFF;
                verify_csum(&c, ROOT_COUNT_OFFSET, 77, 0).unwrap();
                c[ROOT_COUNT_OFFSET + 8 * 4] ^= 0xFF;
                assert!(verify_csum(&c, ROOT_COUNT_OFFSET, 77, 0).is_err());
                // Tail checksum at bs - 4.
                assert_eq!(
                    le32(&b, bs - 4),
                    csum_at(&b, ROOT_COUNT_OFFSET, 77, "", 0).unwrap().0
                );
            }
            // A root block reads as a valid linear block: '.' and a '..' up to the end.
            let lg = dirent::LeafGeometry {
                block_size: bs,
                csum: false,
                inodes_count: 0,
            };
            let names: Vec<_> = dirent::iter(&b, lg, 0)
                .map(|e| e.unwrap().name.to_vec())
                .collect();
            assert_eq!(names, vec![b".".to_vec(), b"..".to_vec()]);
        }
    }

    #[test]
    fn node_roundtrip() {
        let g = geo(1024, true);
        let node = DxNode {
            entries: sample_root(126).entries,
        };
        let mut b = vec![0u8; 1024];
        write_node(&mut b, &g, &node).unwrap();
        assert_eq!(count_offset(&b, 1024), Some(NODE_COUNT_OFFSET));
        assert_eq!(parse_node(&b, &g, 0).unwrap(), node);
        set_csum(&mut b, NODE_COUNT_OFFSET, 5).unwrap();
        verify_csum(&b, NODE_COUNT_OFFSET, 5, 0).unwrap();
        let too_many = DxNode {
            entries: sample_root(127).entries,
        };
        assert!(write_node(&mut b, &g, &too_many).is_err());
    }

    #[test]
    fn validation_errors() {
        let g = geo(1024, true);
        let mut base = vec![0u8; 1024];
        write_root(&mut base, &g, &sample_root(4)).unwrap();
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = base.clone();
            f(&mut b);
            parse_root(&b, &g, 9).unwrap_err()
        };
        bad(&|b| put_le16(b, ROOT_COUNT_OFFSET, 124)); // wrong limit
        bad(&|b| put_le16(b, ROOT_COUNT_OFFSET + 2, 124)); // count > limit
        bad(&|b| put_le16(b, ROOT_COUNT_OFFSET + 2, 0)); // count 0
        bad(&|b| put_le32(b, ROOT_COUNT_OFFSET + 16, 0xFFFF_0000)); // unsorted
        bad(&|b| b[ROOT_INFO_OFFSET + 6] = 2); // too many levels
        bad(&|b| b[ROOT_INFO_OFFSET + 4] = 3); // bad hash version
        bad(&|b| b[ROOT_INFO_OFFSET + 7] = 1); // unused flags
        bad(&|b| b[ROOT_INFO_OFFSET + 5] = 16); // info length
        let e = bad(&|b| put_le16(b, 16, 12)); // '..' rec_len
        assert!(e.to_string().contains("block 9"));
        let mut ok = base.clone();
        ok[ROOT_INFO_OFFSET + 6] = 2;
        let lg = DxGeometry {
            largedir: true,
            ..g
        };
        parse_root(&ok, &lg, 0).unwrap();
        // Equal hashes with continuation are sorted.
        let mut r = sample_root(3);
        r.entries[2].hash = r.entries[1].hash | 1;
        let mut b = vec![0u8; 1024];
        write_root(&mut b, &g, &r).unwrap();
        parse_root(&b, &g, 0).unwrap();
        assert!(parse_node(&base, &g, 0).is_err());
    }

    #[test]
    fn lookup_follows_kernel_rule() {
        let e = [
            DxEntry { hash: 0, block: 1 },
            DxEntry {
                hash: 100,
                block: 2,
            },
            DxEntry {
                hash: 200,
                block: 3,
            },
            DxEntry {
                hash: 201,
                block: 4,
            }, // continuation of hash 200
            DxEntry {
                hash: 300,
                block: 5,
            },
        ];
        assert_eq!(lookup(&e, 0), 0);
        assert_eq!(lookup(&e, 98), 0);
        assert_eq!(lookup(&e, 100), 1);
        assert_eq!(lookup(&e, 200), 2);
        assert!(continues_into(&e, 2, 200));
        assert!(!continues_into(&e, 3, 200));
        assert!(!continues_into(&e, 1, 100));
        assert_eq!(lookup(&e, 202), 3);
        assert_eq!(lookup(&e, 0xFFFF_FFFC), 4);
        assert_eq!(entry_range(&e, 2, 0, u32::MAX), (200, 200));
        assert_eq!(entry_range(&e, 4, 0, 0xFFFF_FFFF), (300, 0xFFFF_FFFF));
    }

    /// Name used for file `i` of the real-image tests: varied lengths, some with
    /// bytes >= 0x80 (signed vs unsigned hashing differs on those).
    fn image_name(i: usize) -> String {
        match i % 4 {
            0 => format!("f{i}"),
            1 => format!("file-{i}-{}", "x".repeat(i % 60)),
            2 => format!("caf\u{e9}-{i}-\u{fc}ber"),
            _ => format!("{i:08}.dat"),
        }
    }

    struct DirCheck<'a> {
        img: &'a [u8],
        sb: testimg::SbInfo,
        blocks: Vec<u64>,
        seed: u32,
        version: u8,
        refs: Vec<u32>,
        leaves: std::collections::HashMap<u32, Vec<Vec<u8>>>,
    }

    impl DirCheck<'_> {
        fn block(&self, logical: u32) -> &[u8] {
            let bs = self.sb.block_size;
            let p = self.blocks[logical as usize] as usize * bs;
            &self.img[p..p + bs]
        }

        fn leaf_geo(&self) -> dirent::LeafGeometry {
            dirent::LeafGeometry {
                block_size: self.sb.block_size,
                csum: self.sb.csum.enabled,
                inodes_count: self.sb.inodes_count,
            }
        }

        /// Walk the subtree at `logical`, checking checksums and hash ranges.
        fn visit(&mut self, logical: u32, level: u8, lo: u32, hi: u32) {
            self.refs[logical as usize] += 1;
            let g = DxGeometry {
                block_size: self.sb.block_size,
                csum: self.sb.csum.enabled,
                largedir: false,
            };
            let b = self.block(logical).to_vec();
            if level > 0 {
                assert_eq!(count_offset(&b, g.block_size), Some(NODE_COUNT_OFFSET));
                let node = parse_node(&b, &g, logical.into()).unwrap();
                verify_csum(&b, NODE_COUNT_OFFSET, self.seed, logical.into()).unwrap();
                // Byte-exact re-serialisation of the covered bytes.
                let mut w = vec![0u8; g.block_size];
                write_node(&mut w, &g, &node).unwrap();
                set_csum(&mut w, NODE_COUNT_OFFSET, self.seed).unwrap();
                let used = NODE_COUNT_OFFSET + DX_ENTRY_LEN * node.entries.len();
                assert_eq!(&w[..used], &b[..used]);
                assert_eq!(&w[g.block_size - 8..], &b[g.block_size - 8..]);
                for i in 0..node.entries.len() {
                    let (l, h) = entry_range(&node.entries, i, lo, hi);
                    self.visit(node.entries[i].block, level - 1, l, h);
                }
                return;
            }
            let lg = self.leaf_geo();
            assert!(dirent::has_tail(&b, lg.block_size));
            dirent::verify_leaf_csum(&b, self.seed, logical.into()).unwrap();
            let mut names = Vec::new();
            for e in dirent::iter(&b, lg, logical.into()) {
                let e = e.unwrap();
                if e.inode == 0 {
                    continue;
                }
                let (h, _) = dx_hash(e.name, self.version, &self.sb.hash_seed);
                assert!(
                    lo <= h && h <= hi,
                    "{:?} hash {h:#x} outside [{lo:#x}, {hi:#x}]",
                    String::from_utf8_lossy(e.name)
                );
                names.push(e.name.to_vec());
            }
            self.leaves.insert(logical, names);
        }
    }

    fn check_image_dirs(bs: usize, n: usize) {
        let tmp = testimg::TempDir::new("dx");
        let src = tmp.0.join("src");
        std::fs::create_dir_all(src.join("big")).unwrap();
        std::fs::create_dir_all(src.join("small")).unwrap();
        let mut want = std::collections::HashSet::new();
        for i in 0..n {
            let name = image_name(i);
            std::fs::write(src.join("big").join(&name), b"").unwrap();
            want.insert(name.into_bytes());
        }
        for i in 0..5 {
            std::fs::write(src.join("small").join(image_name(i)), b"").unwrap();
        }
        let img_path = testimg::make_indexed_image(&tmp.0, bs, &src, &[]);
        let sb = testimg::read_sb(&img_path);
        assert_eq!(sb.block_size, bs);
        assert!(sb.csum.enabled);
        let img = std::fs::read(&img_path).unwrap();

        // The big directory: an htree whose every block we verify.
        let (ino, generation, blocks) = testimg::dir_info(&img_path, "/big");
        assert_eq!(generation, 0x1234_5678);
        let nblocks = blocks.len();
        let mut c = DirCheck {
            img: &img,
            sb,
            blocks,
            seed: sb.csum.inode_seed(ino, generation),
            version: 0,
            refs: vec![0; nblocks],
            leaves: Default::default(),
        };
        let g = DxGeometry {
            block_size: bs,
            csum: true,
            largedir: false,
        };
        let b0 = c.block(0).to_vec();
        assert_eq!(count_offset(&b0, bs), Some(ROOT_COUNT_OFFSET));
        let root = parse_root(&b0, &g, 0).unwrap();
        verify_csum(&b0, ROOT_COUNT_OFFSET, c.seed, 0).unwrap();
        assert_eq!(root.dot_inode, ino);
        assert_eq!(root.dotdot_inode, 2);
        assert_eq!(root.hash_version, sb.def_hash_version);
        if bs == 1024 {
            assert_eq!(
                root.indirect_levels, 1,
                "test should exercise interior nodes"
            );
        }
        let mut w = vec![0u8; bs];
        write_root(&mut w, &g, &root).unwrap();
        set_csum(&mut w, ROOT_COUNT_OFFSET, c.seed).unwrap();
        let used = ROOT_COUNT_OFFSET + DX_ENTRY_LEN * root.entries.len();
        assert_eq!(&w[..used], &b0[..used]);
        assert_eq!(&w[bs - 8..], &b0[bs - 8..]);

        c.version = crate::dirhash::effective_version(root.hash_version, sb.unsigned_hash);
        c.refs[0] = 1;
        for i in 0..root.entries.len() {
            let (l, h) = entry_range(&root.entries, i, 0, u32::MAX);
            c.visit(root.entries[i].block, root.indirect_levels, l, h);
        }
        assert!(
            c.refs.iter().all(|&r| r == 1),
            "every block referenced once: {:?}",
            c.refs
        );
        let got: std::collections::HashSet<Vec<u8>> =
            c.leaves.values().flatten().cloned().collect();
        assert_eq!(got.len(), n);
        assert_eq!(got, want);

        // Index lookup from the root finds every name (following continuations).
        let nodes: std::collections::HashMap<u32, DxNode> = if root.indirect_levels == 1 {
            root.entries
                .iter()
                .map(|e| (e.block, parse_node(c.block(e.block), &g, 0).unwrap()))
                .collect()
        } else {
            Default::default()
        };
        for name in &want {
            let (h, _) = dx_hash(name, c.version, &sb.hash_seed);
            let mut entries = &root.entries;
            let mut idx = lookup(entries, h);
            if root.indirect_levels == 1 {
                entries = &nodes[&entries[idx].block].entries;
                idx = lookup(entries, h);
            }
            let mut found = false;
            loop {
                if c.leaves[&entries[idx].block].contains(name) {
                    found = true;
                    break;
                }
                if !continues_into(entries, idx, h) {
                    break;
                }
                idx += 1;
            }
            assert!(found, "lookup of {:?}", String::from_utf8_lossy(name));
        }

        // The small directory: linear or indexed by e2fsck, checksums verify either way.
        let (ino, generation, blocks) = testimg::dir_info(&img_path, "/small");
        assert_eq!(generation, 0xCAFE_BABE);
        let seed = sb.csum.inode_seed(ino, generation);
        let lg = c.leaf_geo();
        let mut names = Vec::new();
        for (i, &pb) in blocks.iter().enumerate() {
            let b = &img[pb as usize * bs..(pb as usize + 1) * bs];
            if i == 0 && count_offset(b, bs) == Some(ROOT_COUNT_OFFSET) {
                verify_csum(b, ROOT_COUNT_OFFSET, seed, 0).unwrap();
                continue;
            }
            dirent::verify_leaf_csum(b, seed, pb).unwrap();
            assert!(dirent::verify_leaf_csum(b, seed ^ 1, pb).is_err());
            let mut out = Vec::new();
            dirent::collect_live(b, lg, pb, &mut out).unwrap();
            names.extend(out.into_iter().map(|e| e.name));
        }
        names.retain(|n| n != b"." && n != b"..");
        names.sort();
        let mut want_small: Vec<Vec<u8>> = (0..5).map(|i| image_name(i).into_bytes()).collect();
        want_small.sort();
        assert_eq!(names, want_small);
    }

    #[test]
    fn real_image_htree_1k_blocks() {
        check_image_dirs(1024, 12000);
    }

    #[test]
    fn real_image_htree_4k_blocks() {
        check_image_dirs(4096, 4000);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 1024)) {
            let g = geo(1024, true);
            let _ = parse_root(&data, &g, 0);
            let _ = parse_node(&data, &g, 0);
            let _ = count_offset(&data, 1024);
            let _ = verify_csum(&data, ROOT_COUNT_OFFSET, 0, 0);
            let _ = verify_csum(&data, NODE_COUNT_OFFSET, 0, 0);
        }

        #[test]
        fn lookup_matches_linear_scan(mut hashes in proptest::collection::vec(any::<u32>(), 0..50), target in any::<u32>()) {
            hashes.sort_unstable();
            let mut e = vec![DxEntry { hash: 0, block: 0 }];
            e.extend(hashes.iter().map(|&h| DxEntry { hash: h, block: 0 }));
            let mut want = 0;
            for (i, x) in e.iter().enumerate().skip(1) {
                if x.hash <= target { want = i; }
            }
            prop_assert_eq!(lookup(&e, target), want);
        }
    }
}

/// Helpers for tests against images made by mkfs.ext4 / e2fsck / debugfs.
#[cfg(test)]
pub(crate) mod testimg {
    use crate::bytes::{le16, le32};
    use crate::csum::{crc32c_raw, CsumCtx};
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A unique temp directory, removed on drop (also when a test fails).
    pub struct TempDir(pub PathBuf);

    impl TempDir {
        pub fn new(tag: &str) -> TempDir {
            static N: AtomicU32 = AtomicU32::new(0);
            let p = std::env::temp_dir().join(format!(
                "commitfs-format-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Run a command, panicking with its output if it cannot start. Returns
    /// (exit code, stdout, stderr).
    pub fn run(cmd: &str, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(cmd)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The superblock fields directory code needs.
    #[derive(Debug, Clone, Copy)]
    pub struct SbInfo {
        pub block_size: usize,
        pub inodes_count: u32,
        pub hash_seed: [u32; 4],
        pub def_hash_version: u8,
        pub unsigned_hash: bool,
        pub csum: CsumCtx,
    }

    pub fn read_sb(img: &Path) -> SbInfo {
        let data = std::fs::read(img).unwrap();
        let sb = &data[1024..2048];
        assert_eq!(le16(sb, 0x38), 0xEF53);
        let incompat = le32(sb, 0x60);
        let ro_compat = le32(sb, 0x64);
        let enabled = ro_compat & 0x400 != 0;
        let fs_seed = if incompat & 0x2000 != 0 {
            le32(sb, 0x270)
        } else {
            crc32c_raw(!0, &sb[0x68..0x78])
        };
        SbInfo {
            block_size: 1024 << le32(sb, 0x18),
            inodes_count: le32(sb, 0),
            hash_seed: [
                le32(sb, 0xEC),
                le32(sb, 0xF0),
                le32(sb, 0xF4),
                le32(sb, 0xF8),
            ],
            def_hash_version: sb[0xFC],
            unsigned_hash: le32(sb, 0x160) & 2 != 0,
            csum: CsumCtx { enabled, fs_seed },
        }
    }

    /// Inode number, generation and physical blocks (logical order) of `path`.
    pub fn dir_info(img: &Path, path: &str) -> (u32, u32, Vec<u64>) {
        let img = img.to_str().unwrap();
        let (_, stat, _) = run("debugfs", &["-R", &format!("stat {path}"), img]);
        let field = |key: &str| -> u32 {
            let rest = stat
                .split(key)
                .nth(1)
                .unwrap_or_else(|| panic!("no {key} in {stat}"));
            rest.split_whitespace().next().unwrap().parse().unwrap()
        };
        let ino = field("Inode:");
        let generation = field("Generation:");
        let (_, blocks, _) = run("debugfs", &["-R", &format!("blocks {path}"), img]);
        let blocks = blocks
            .split_whitespace()
            .map(|b| b.parse().unwrap())
            .collect();
        (ino, generation, blocks)
    }

    /// Make an image with `mkfs.ext4 -b bs -d src`, then `e2fsck -fyD` to index
    /// every directory; checks `e2fsck -fn` is silent afterwards.
    pub fn make_indexed_image(dir: &Path, bs: usize, src: &Path, extra: &[&str]) -> PathBuf {
        let img = dir.join("img");
        let bs_s = bs.to_string();
        let src_s = src.to_str().unwrap();
        let img_s = img.to_str().unwrap();
        let mut args = vec!["-q", "-F", "-b", &bs_s, "-N", "40000", "-d", src_s];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[img_s, "96M"]);
        let (rc, o, e) = run("mkfs.ext4", &args);
        assert_eq!(rc, 0, "mkfs: {o}{e}");
        for (path, gen) in [("/big", "0x12345678"), ("/small", "0xCAFEBABE")] {
            let (rc, o, e) = run(
                "debugfs",
                &[
                    "-w",
                    "-R",
                    &format!("set_inode_field {path} generation {gen}"),
                    img_s,
                ],
            );
            assert_eq!(rc, 0, "debugfs: {o}{e}");
        }
        let (rc, o, e) = run("e2fsck", &["-fyD", img_s]);
        assert!(rc <= 1, "e2fsck -fyD rc {rc}: {o}{e}");
        let (rc, o, e) = run("e2fsck", &["-fn", img_s]);
        assert_eq!(rc, 0, "e2fsck -fn: {o}{e}");
        img
    }
}
