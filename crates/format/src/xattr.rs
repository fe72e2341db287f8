//! Extended attributes (ext4-format.md §7): the in-inode area after
//! `128 + i_extra_isize` and the external xattr block named by `i_file_acl`.
//!
//! Both places share one entry format; they differ in the header (4-byte magic in the
//! inode, 32-byte header in a block), in what value offsets are relative to (the first
//! entry in the inode, the block start in a block), in entry order (a block's entries
//! are sorted so that identical sets produce identical blocks, which is what lets the
//! kernel share them) and in the hashes (0 in the inode, real hashes in a block).
//!
//! Choosing where a set of attributes lives is the file-system layer's job; this module
//! parses, validates, serialises and answers "does this set fit in N bytes".

use crate::bytes::*;
use crate::csum::{crc32c_raw, CsumCtx};
use crate::error::{FormatError, Result};

/// `h_magic` of a block and of the in-inode area.
pub const XATTR_MAGIC: u32 = 0xEA02_0000;
/// Size of the block header (`ext4_xattr_header`).
pub const BLOCK_HEADER_LEN: usize = 32;
/// Size of the in-inode header (just the magic).
pub const IBODY_HEADER_LEN: usize = 4;
/// Fixed part of an entry; the name follows, padded to 4 bytes.
pub const ENTRY_HEADER_LEN: usize = 16;
/// The 4-byte zero word that ends an entry list.
pub const LIST_END_LEN: usize = 4;
/// Longest name suffix (`e_name_len` is one byte).
pub const MAX_SUFFIX_LEN: usize = 255;
/// Longest full name the VFS accepts (`XATTR_NAME_MAX`).
pub const MAX_NAME_LEN: usize = 255;

// Block header fields (§7).
const H_MAGIC: usize = 0x00;
const H_REFCOUNT: usize = 0x04;
const H_BLOCKS: usize = 0x08;
const H_HASH: usize = 0x0C;
const H_CHECKSUM: usize = 0x10;

// Entry fields (§7).
const E_NAME_LEN: usize = 0x0;
const E_NAME_INDEX: usize = 0x1;
const E_VALUE_OFFS: usize = 0x2;
const E_VALUE_INUM: usize = 0x4;
const E_VALUE_SIZE: usize = 0x8;
const E_HASH: usize = 0xC;
const E_NAME: usize = 0x10;

const NAME_HASH_SHIFT: u32 = 5;
const VALUE_HASH_SHIFT: u32 = 16;
const BLOCK_HASH_SHIFT: u32 = 16;

/// `e_name_index` values (§7).
pub mod index {
    pub const USER: u8 = 1;
    pub const POSIX_ACL_ACCESS: u8 = 2;
    pub const POSIX_ACL_DEFAULT: u8 = 3;
    pub const TRUSTED: u8 = 4;
    pub const SECURITY: u8 = 6;
    pub const SYSTEM: u8 = 7;
}

/// Name prefixes and whether the prefix is the whole name (the two ACL names carry an
/// empty suffix on disk). Exact names are listed before `system.` so they win.
const PREFIXES: &[(u8, &[u8], bool)] = &[
    (index::USER, b"user.", false),
    (index::POSIX_ACL_ACCESS, b"system.posix_acl_access", true),
    (index::POSIX_ACL_DEFAULT, b"system.posix_acl_default", true),
    (index::TRUSTED, b"trusted.", false),
    (index::SECURITY, b"security.", false),
    (index::SYSTEM, b"system.", false),
];

/// Why a full attribute name cannot be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("unknown or unsupported xattr name prefix")]
    UnknownPrefix,
    #[error("xattr name has an empty suffix")]
    EmptySuffix,
    #[error("xattr name too long")]
    TooLong,
    #[error("xattr name contains a NUL byte")]
    ContainsNul,
}

/// Why a set of attributes cannot be serialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    #[error("xattrs need {needed} bytes, only {available} available")]
    NoSpace { needed: usize, available: usize },
    #[error("duplicate xattr name")]
    Duplicate,
    #[error("xattr name suffix longer than 255 bytes")]
    NameTooLong,
}

/// Prefix string of a name index, `None` for indexes this crate does not name.
pub fn prefix_of(index: u8) -> Option<&'static [u8]> {
    PREFIXES.iter().find(|p| p.0 == index).map(|p| p.1)
}

/// Split a full name (`user.foo`) into its on-disk index and suffix (`1`, `foo`).
pub fn split_name(full: &[u8]) -> std::result::Result<(u8, &[u8]), NameError> {
    if full.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong);
    }
    if full.contains(&0) {
        return Err(NameError::ContainsNul);
    }
    for &(idx, prefix, exact) in PREFIXES {
        if exact {
            if full == prefix {
                return Ok((idx, &[]));
            }
        } else if let Some(suffix) = full.strip_prefix(prefix) {
            // The VFS rejects a bare prefix such as "user." (EINVAL).
            if suffix.is_empty() {
                return Err(NameError::EmptySuffix);
            }
            return Ok((idx, suffix));
        }
    }
    Err(NameError::UnknownPrefix)
}

/// Full name of an on-disk (index, suffix) pair; `None` for an unknown index.
pub fn full_name(index: u8, suffix: &[u8]) -> Option<Vec<u8>> {
    let prefix = prefix_of(index)?;
    let mut v = Vec::with_capacity(prefix.len() + suffix.len());
    v.extend_from_slice(prefix);
    v.extend_from_slice(suffix);
    Some(v)
}

/// One attribute in its on-disk form. Entries with an index this crate cannot name
/// (e.g. the encryption context, index 9) are parsed and preserved on rewrite, but
/// have no [`Xattr::full_name`], so callers should not list them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Xattr {
    pub index: u8,
    /// Name suffix after the prefix (`e_name`).
    pub name: Vec<u8>,
    pub value: Vec<u8>,
}

impl Xattr {
    /// Build from a full name such as `security.selinux`.
    pub fn new(full: &[u8], value: Vec<u8>) -> std::result::Result<Xattr, NameError> {
        let (index, suffix) = split_name(full)?;
        Ok(Xattr {
            index,
            name: suffix.to_vec(),
            value,
        })
    }

    /// Full name, `None` for an unknown index.
    pub fn full_name(&self) -> Option<Vec<u8>> {
        full_name(self.index, &self.name)
    }

    /// Whether this entry has the full name `full` (no allocation).
    pub fn has_full_name(&self, full: &[u8]) -> bool {
        match prefix_of(self.index) {
            Some(p) => {
                full.len() == p.len() + self.name.len()
                    && full.starts_with(p)
                    && full[p.len()..] == self.name[..]
            }
            None => false,
        }
    }

    /// Bytes the entry (header + padded name) takes in the entry table.
    pub fn entry_len(&self) -> usize {
        entry_len(self.name.len())
    }

    /// Bytes the value takes (padded to 4).
    pub fn value_len(&self) -> usize {
        pad4(self.value.len())
    }

    /// Block sort key: (index, name length, name) (§7).
    pub fn sort_key(&self) -> (u8, usize, &[u8]) {
        (self.index, self.name.len(), &self.name)
    }

    /// Entry hash as stored in a block (§7).
    pub fn hash(&self) -> u32 {
        entry_hash(&self.name, &self.value)
    }
}

#[inline]
fn pad4(n: usize) -> usize {
    (n + 3) & !3
}

/// Bytes an entry with a `name_len`-byte suffix takes in the entry table.
pub fn entry_len(name_len: usize) -> usize {
    pad4(ENTRY_HEADER_LEN + name_len)
}

/// Entry hash (§7): name bytes (unsigned), then the value as le32 words, zero padded.
pub fn entry_hash(name: &[u8], value: &[u8]) -> u32 {
    let mut h: u32 = 0;
    for &b in name {
        h = (h << NAME_HASH_SHIFT) ^ (h >> (32 - NAME_HASH_SHIFT)) ^ b as u32;
    }
    value_hash(h, value)
}

/// Entry hash as older kernels computed it, with name bytes as signed chars. Differs
/// from [`entry_hash`] only for names with bytes >= 0x80; e2fsck accepts both.
pub fn entry_hash_signed(name: &[u8], value: &[u8]) -> u32 {
    let mut h: u32 = 0;
    for &b in name {
        h = (h << NAME_HASH_SHIFT) ^ (h >> (32 - NAME_HASH_SHIFT)) ^ (b as i8 as i32 as u32);
    }
    value_hash(h, value)
}

fn value_hash(mut h: u32, value: &[u8]) -> u32 {
    let mut chunks = value.chunks_exact(4);
    for c in &mut chunks {
        let w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        h = (h << VALUE_HASH_SHIFT) ^ (h >> (32 - VALUE_HASH_SHIFT)) ^ w;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 4];
        w[..rest.len()].copy_from_slice(rest);
        let w = u32::from_le_bytes(w);
        h = (h << VALUE_HASH_SHIFT) ^ (h >> (32 - VALUE_HASH_SHIFT)) ^ w;
    }
    h
}

/// Block hash `h_hash` (§7): fold of the entry hashes in block order, 0 if any is 0.
pub fn block_hash<I: IntoIterator<Item = u32>>(entry_hashes: I) -> u32 {
    let mut h: u32 = 0;
    for e in entry_hashes {
        if e == 0 {
            return 0;
        }
        h = (h << BLOCK_HASH_SHIFT) ^ (h >> (32 - BLOCK_HASH_SHIFT)) ^ e;
    }
    h
}

fn table_and_values(entries: &[Xattr]) -> usize {
    entries
        .iter()
        .map(|e| e.entry_len() + e.value_len())
        .sum::<usize>()
        + LIST_END_LEN
}

/// Bytes a set needs in the in-inode area (0 for an empty set: no magic is written).
pub fn ibody_space(entries: &[Xattr]) -> usize {
    if entries.is_empty() {
        0
    } else {
        IBODY_HEADER_LEN + table_and_values(entries)
    }
}

/// Bytes a set needs in an xattr block.
pub fn block_space(entries: &[Xattr]) -> usize {
    BLOCK_HEADER_LEN + table_and_values(entries)
}

/// Whether a set fits in an in-inode area of `area_len` bytes.
pub fn fits_ibody(entries: &[Xattr], area_len: usize) -> bool {
    ibody_space(entries) <= area_len
}

/// Whether a set fits in one xattr block of `block_size` bytes.
pub fn fits_block(entries: &[Xattr], block_size: usize) -> bool {
    block_space(entries) <= block_size
}

/// Walk an entry table starting at `first` inside `buf[..end]`; values are at
/// `value_base + e_value_offs`. Validates like the kernel's `check_xattrs` plus
/// e2fsck's overlap check. `hashes` receives each entry's stored `e_hash`.
fn parse_entries(
    buf: &[u8],
    first: usize,
    value_base: usize,
    structure: &'static str,
    block: u64,
    mut hashes: Option<&mut Vec<u32>>,
) -> Result<Vec<Xattr>> {
    let end = buf.len();
    let corrupt = |reason: String| FormatError::corrupt(structure, block, reason);
    // Pass 1: the entry table, up to its terminating zero word.
    let mut pos = first;
    let mut count = 0usize;
    loop {
        if pos + LIST_END_LEN > end {
            return Err(corrupt(format!(
                "xattr entry list not terminated before end (at offset {pos})"
            )));
        }
        if le32(buf, pos) == 0 {
            break;
        }
        if pos + ENTRY_HEADER_LEN > end {
            return Err(corrupt(format!("xattr entry at offset {pos} out of bounds")));
        }
        let name_len = buf[pos + E_NAME_LEN] as usize;
        let next = pos + entry_len(name_len);
        if next + LIST_END_LEN > end {
            return Err(corrupt(format!("xattr name at offset {pos} out of bounds")));
        }
        if buf[pos + E_NAME..pos + E_NAME + name_len].contains(&0) {
            return Err(corrupt(format!("xattr name at offset {pos} contains NUL")));
        }
        pos = next;
        count += 1;
    }
    let table_end = pos + LIST_END_LEN;

    // Pass 2: values.
    let mut out = Vec::with_capacity(count);
    let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(count);
    let mut pos = first;
    for _ in 0..count {
        let name_len = buf[pos + E_NAME_LEN] as usize;
        let idx = buf[pos + E_NAME_INDEX];
        let offs = le16(buf, pos + E_VALUE_OFFS) as usize;
        let inum = le32(buf, pos + E_VALUE_INUM);
        let size = le32(buf, pos + E_VALUE_SIZE) as usize;
        let name = &buf[pos + E_NAME..pos + E_NAME + name_len];
        if inum != 0 {
            return Err(corrupt(format!(
                "xattr {:?} stores its value in EA inode {inum}: ea_inode is unsupported",
                String::from_utf8_lossy(name)
            )));
        }
        let value = if size == 0 {
            Vec::new()
        } else {
            let start = value_base + offs;
            let padded_end = start.checked_add(pad4(size));
            match padded_end {
                Some(pe) if start >= table_end && pe <= end => {}
                _ => {
                    return Err(corrupt(format!(
                        "xattr value at offset {offs} size {size} outside the value area"
                    )))
                }
            }
            ranges.push((start, start + pad4(size)));
            buf[start..start + size].to_vec()
        };
        if let Some(h) = hashes.as_deref_mut() {
            h.push(le32(buf, pos + E_HASH));
        }
        out.push(Xattr {
            index: idx,
            name: name.to_vec(),
            value,
        });
        pos += entry_len(name_len);
    }
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(corrupt("overlapping xattr values".to_string()));
    }
    Ok(out)
}

/// Parse the in-inode area (`inode[128 + i_extra_isize ..]`). An area without the
/// magic holds no attributes (the kernel only looks at it when the magic is present).
/// `block` is the inode-table block, for error messages.
pub fn parse_ibody(area: &[u8], block: u64) -> Result<Vec<Xattr>> {
    if area.len() < IBODY_HEADER_LEN || le32(area, 0) != XATTR_MAGIC {
        return Ok(Vec::new());
    }
    parse_entries(
        area,
        IBODY_HEADER_LEN,
        IBODY_HEADER_LEN,
        "in-inode xattrs",
        block,
        None,
    )
}

/// Whether the in-inode area carries the xattr magic.
pub fn ibody_has_magic(area: &[u8]) -> bool {
    area.len() >= IBODY_HEADER_LEN && le32(area, 0) == XATTR_MAGIC
}

fn check_unique_and_names(entries: &[Xattr]) -> std::result::Result<(), WriteError> {
    if entries.iter().any(|e| e.name.len() > MAX_SUFFIX_LEN) {
        return Err(WriteError::NameTooLong);
    }
    for (i, a) in entries.iter().enumerate() {
        if entries[i + 1..]
            .iter()
            .any(|b| a.index == b.index && a.name == b.name)
        {
            return Err(WriteError::Duplicate);
        }
    }
    Ok(())
}

/// Write entries (in the given order) at `first`, values packed downwards from the
/// end of `buf`, offsets relative to `value_base`. The caller checked the fit and
/// zeroed `buf`.
fn write_entries<'a, I: Iterator<Item = &'a Xattr>>(
    buf: &mut [u8],
    first: usize,
    value_base: usize,
    entries: I,
    with_hash: bool,
) {
    let mut pos = first;
    let mut vend = buf.len();
    for e in entries {
        let size = e.value.len();
        let offs = if size == 0 {
            0
        } else {
            vend -= pad4(size);
            buf[vend..vend + size].copy_from_slice(&e.value);
            vend - value_base
        };
        buf[pos + E_NAME_LEN] = e.name.len() as u8;
        buf[pos + E_NAME_INDEX] = e.index;
        put_le16(buf, pos + E_VALUE_OFFS, offs as u16);
        put_le32(buf, pos + E_VALUE_INUM, 0);
        put_le32(buf, pos + E_VALUE_SIZE, size as u32);
        put_le32(buf, pos + E_HASH, if with_hash { e.hash() } else { 0 });
        buf[pos + E_NAME..pos + E_NAME + e.name.len()].copy_from_slice(&e.name);
        pos += e.entry_len();
    }
}

/// Serialise a set into the in-inode area, in the given order, with zero hashes. An
/// empty set zeroes the area (no magic), as the kernel does.
pub fn write_ibody(entries: &[Xattr], area: &mut [u8]) -> std::result::Result<(), WriteError> {
    check_unique_and_names(entries)?;
    let needed = ibody_space(entries);
    if needed > area.len() {
        return Err(WriteError::NoSpace {
            needed,
            available: area.len(),
        });
    }
    area.fill(0);
    if entries.is_empty() {
        return Ok(());
    }
    put_le32(area, 0, XATTR_MAGIC);
    write_entries(area, IBODY_HEADER_LEN, IBODY_HEADER_LEN, entries.iter(), false);
    Ok(())
}

/// A parsed xattr block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XattrBlock {
    /// Number of inodes whose `i_file_acl` names this block.
    pub refcount: u32,
    /// Stored `h_hash`.
    pub hash: u32,
    /// Entries in on-disk order (sorted, for blocks written by the kernel or us).
    pub entries: Vec<Xattr>,
}

/// `h_checksum` of an xattr block at physical block `block` (§1.3).
pub fn block_checksum(buf: &[u8], block: u64, fs_seed: u32) -> u32 {
    let s = crc32c_raw(fs_seed, &block.to_le_bytes());
    let s = crc32c_raw(s, &buf[..H_CHECKSUM]);
    let s = crc32c_raw(s, &[0u8; 4]);
    crc32c_raw(s, &buf[H_CHECKSUM + 4..])
}

fn check_block_len(buf: &[u8], block: u64) -> Result<()> {
    if buf.len() < BLOCK_HEADER_LEN + LIST_END_LEN || buf.len() > 65536 {
        return Err(FormatError::corrupt(
            "xattr block",
            block,
            format!("bad block length {}", buf.len()),
        ));
    }
    Ok(())
}

/// Parse and validate an xattr block: magic, `h_blocks == 1`, checksum (when
/// `metadata_csum` is on), entry table and value bounds.
pub fn parse_block(buf: &[u8], block: u64, csum: &CsumCtx) -> Result<XattrBlock> {
    check_block_len(buf, block)?;
    let magic = le32(buf, H_MAGIC);
    if magic != XATTR_MAGIC {
        return Err(FormatError::BadMagic {
            structure: "xattr block",
            block,
            found: magic,
        });
    }
    let blocks = le32(buf, H_BLOCKS);
    if blocks != 1 {
        return Err(FormatError::corrupt(
            "xattr block",
            block,
            format!("h_blocks is {blocks}, must be 1"),
        ));
    }
    if csum.enabled {
        let stored = le32(buf, H_CHECKSUM);
        let computed = block_checksum(buf, block, csum.fs_seed);
        if stored != computed {
            return Err(FormatError::BadChecksum {
                structure: "xattr block",
                block,
                stored,
                computed,
            });
        }
    }
    let entries = parse_entries(buf, BLOCK_HEADER_LEN, 0, "xattr block", block, None)?;
    Ok(XattrBlock {
        refcount: le32(buf, H_REFCOUNT),
        hash: le32(buf, H_HASH),
        entries,
    })
}

/// Stored entry hashes of a block, in on-disk order (for consistency checks; parsing
/// does not verify them, as the kernel does not).
pub fn block_entry_hashes(buf: &[u8], block: u64) -> Result<Vec<u32>> {
    check_block_len(buf, block)?;
    let mut h = Vec::new();
    parse_entries(buf, BLOCK_HEADER_LEN, 0, "xattr block", block, Some(&mut h))?;
    Ok(h)
}

/// Serialise a set into a whole xattr block at physical block `block`: entries sorted
/// by (index, name length, name), values packed from the end, entry and block hashes,
/// `h_blocks = 1`, and the checksum when `metadata_csum` is on.
pub fn write_block(
    entries: &[Xattr],
    refcount: u32,
    block: u64,
    csum: &CsumCtx,
    buf: &mut [u8],
) -> std::result::Result<(), WriteError> {
    check_unique_and_names(entries)?;
    let needed = block_space(entries);
    if needed > buf.len() || buf.len() > 65536 {
        return Err(WriteError::NoSpace {
            needed,
            available: buf.len(),
        });
    }
    let mut sorted: Vec<&Xattr> = entries.iter().collect();
    sorted.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
    buf.fill(0);
    put_le32(buf, H_MAGIC, XATTR_MAGIC);
    put_le32(buf, H_REFCOUNT, refcount);
    put_le32(buf, H_BLOCKS, 1);
    put_le32(buf, H_HASH, block_hash(sorted.iter().map(|e| e.hash())));
    write_entries(buf, BLOCK_HEADER_LEN, 0, sorted.into_iter(), true);
    update_block_checksum(buf, block, csum);
    Ok(())
}

/// Stored `h_refcount` of a block buffer (0 if the buffer is too short to hold one).
pub fn block_refcount(buf: &[u8]) -> u32 {
    if buf.len() < BLOCK_HEADER_LEN {
        0
    } else {
        le32(buf, H_REFCOUNT)
    }
}

/// Change `h_refcount` in place and re-checksum (e.g. when an inode drops a shared
/// block). The buffer must be a whole, already validated block.
pub fn set_block_refcount(buf: &mut [u8], refcount: u32, block: u64, csum: &CsumCtx) {
    if buf.len() < BLOCK_HEADER_LEN {
        return;
    }
    put_le32(buf, H_REFCOUNT, refcount);
    update_block_checksum(buf, block, csum);
}

/// Recompute `h_checksum` for the block's current location (0 without metadata_csum).
pub fn update_block_checksum(buf: &mut [u8], block: u64, csum: &CsumCtx) {
    if buf.len() < BLOCK_HEADER_LEN {
        return;
    }
    let c = if csum.enabled {
        block_checksum(buf, block, csum.fs_seed)
    } else {
        0
    };
    put_le32(buf, H_CHECKSUM, c);
}
