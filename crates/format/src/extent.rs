//! Extent tree nodes (ext4-format.md §5): the 60-byte root in `i_block` and whole tree
//! blocks with their tail checksum.
//!
//! Two representations:
//! * [`NodeRef`] is a validated, zero-copy view over on-disk bytes, for lookups on the
//!   hot path (no allocation; binary search over the entries).
//! * [`ExtentNode`] is an owned node for writers: edit the entry vector, then serialise
//!   with [`ExtentNode::write_root`] / [`ExtentNode::write_block`], which validate first
//!   so that a bug in a writer can never put an invalid node on disk.
//!
//! Everything read from disk is validated before it is indexed: a bad node gives a
//! [`FormatError`], never a panic. Checks that need file-system context (physical
//! blocks inside the device, index ranges against the parent) belong to the caller.

use crate::bytes::{le16, le32, put_le16, put_le32};
use crate::csum::{crc32c_raw, CsumCtx};
use crate::error::{FormatError, Result};

/// `eh_magic` (§5.1).
pub const EXT_MAGIC: u16 = 0xF30A;
/// Size of the header and of every entry (index or leaf) (§5.1).
pub const HEADER_LEN: usize = 12;
/// Size of one index or leaf entry (§5.1).
pub const ENTRY_LEN: usize = 12;
/// Size of the checksum tail after the last slot of a tree block (§5.1).
pub const TAIL_LEN: usize = 4;
/// Size of the root node stored in the inode's `i_block` (§5.1).
pub const ROOT_LEN: usize = 60;
/// Slots in the inode root: `(60 - 12) / 12` (§5.1).
pub const ROOT_CAPACITY: u16 = 4;
/// Deepest tree the kernel accepts (`EXT4_MAX_EXTENT_DEPTH`, §5.1).
pub const MAX_DEPTH: u16 = 5;
/// `ee_len` values above this mean "unwritten" (§5.2).
pub const INIT_MAX_LEN: u32 = 0x8000;
/// Longest unwritten extent: `0xFFFF - 0x8000` (§5.2).
pub const UNWRITTEN_MAX_LEN: u32 = 0x7FFF;
/// Exclusive end of the logical block space: logical numbers are 32 bits (§5.1).
pub const LBLK_SPACE_END: u64 = 1 << 32;
/// Physical block numbers are 48 bits (`lo | hi << 32`, §5.1).
pub const PBLK_LIMIT: u64 = 1 << 48;

const EH_MAGIC: usize = 0x0;
const EH_ENTRIES: usize = 0x2;
const EH_MAX: usize = 0x4;
const EH_DEPTH: usize = 0x6;
const EH_GENERATION: usize = 0x8;

const EI_BLOCK: usize = 0x0;
const EI_LEAF_LO: usize = 0x4;
const EI_LEAF_HI: usize = 0x8;
const EI_UNUSED: usize = 0xA;

const EE_BLOCK: usize = 0x0;
const EE_LEN: usize = 0x4;
const EE_START_HI: usize = 0x6;
const EE_START_LO: usize = 0x8;

/// Structure names used in errors. For the root, the error's `block` field carries the
/// inode number (the root has no block of its own).
pub const ROOT_STRUCT: &str = "extent tree root (block = inode number)";
/// Structure name for errors in a tree block.
pub const BLOCK_STRUCT: &str = "extent tree block";

/// Slots in a tree block: `(bs - 12) / 12` (84 for 1 KiB, 340 for 4 KiB; §5.1). Computed
/// as `(bs - 12 - 4) / 12`, which is the same for every power-of-two block size and
/// guarantees the tail fits for any buffer length.
pub const fn block_capacity(block_size: usize) -> u16 {
    let n = block_size.saturating_sub(HEADER_LEN + TAIL_LEN) / ENTRY_LEN;
    if n > u16::MAX as usize {
        u16::MAX
    } else {
        n as u16
    }
}

/// Offset of `et_checksum` for a node with `max` slots (§5.1).
pub const fn tail_offset(max: u16) -> usize {
    HEADER_LEN + ENTRY_LEN * max as usize
}

/// Largest length of one extent in the given state (§5.2).
pub const fn max_len(unwritten: bool) -> u32 {
    if unwritten {
        UNWRITTEN_MAX_LEN
    } else {
        INIT_MAX_LEN
    }
}

/// Decode `ee_len` into (length, unwritten) (§5.2). `0` decodes to length 0, which
/// validation rejects.
#[inline]
pub const fn decode_len(raw: u16) -> (u32, bool) {
    if raw as u32 <= INIT_MAX_LEN {
        (raw as u32, false)
    } else {
        (raw as u32 - INIT_MAX_LEN, true)
    }
}

/// Encode a length for `ee_len`; `None` when it is zero or too long for the state (§5.2).
#[inline]
pub const fn encode_len(len: u32, unwritten: bool) -> Option<u16> {
    if len == 0 || len > max_len(unwritten) {
        None
    } else if unwritten {
        Some((len + INIT_MAX_LEN) as u16)
    } else {
        Some(len as u16)
    }
}

/// Extent tree block checksum: raw CRC32C seeded with the owning inode's seed over
/// `[0, 12 + 12 * max)` (§1.3). `block` must be at least that long.
pub fn block_checksum(seed: u32, block: &[u8], max: u16) -> u32 {
    crc32c_raw(seed, &block[..tail_offset(max)])
}

/// `ext4_extent_header` (§5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtentHeader {
    pub magic: u16,
    pub entries: u16,
    pub max: u16,
    pub depth: u16,
    /// `eh_generation`: Lustre only, written as 0.
    pub generation: u32,
}

impl ExtentHeader {
    /// Read a header; `None` if `b` is shorter than [`HEADER_LEN`].
    pub fn parse(b: &[u8]) -> Option<Self> {
        if b.len() < HEADER_LEN {
            return None;
        }
        Some(ExtentHeader {
            magic: le16(b, EH_MAGIC),
            entries: le16(b, EH_ENTRIES),
            max: le16(b, EH_MAX),
            depth: le16(b, EH_DEPTH),
            generation: le32(b, EH_GENERATION),
        })
    }

    /// Write the header into the first 12 bytes of `b` (caller guarantees the length).
    pub fn write(&self, b: &mut [u8]) {
        put_le16(b, EH_MAGIC, self.magic);
        put_le16(b, EH_ENTRIES, self.entries);
        put_le16(b, EH_MAX, self.max);
        put_le16(b, EH_DEPTH, self.depth);
        put_le32(b, EH_GENERATION, self.generation);
    }
}

/// `ext4_extent_idx`: an interior entry pointing at a child node (§5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExtentIdx {
    /// `ei_block`: first logical block covered by the child.
    pub lblk: u32,
    /// Physical block of the child node (48 bits).
    pub child: u64,
}

impl ExtentIdx {
    fn parse(e: &[u8]) -> Self {
        ExtentIdx {
            lblk: le32(e, EI_BLOCK),
            child: le32(e, EI_LEAF_LO) as u64 | ((le16(e, EI_LEAF_HI) as u64) << 32),
        }
    }

    fn write(&self, e: &mut [u8]) {
        put_le32(e, EI_BLOCK, self.lblk);
        put_le32(e, EI_LEAF_LO, self.child as u32);
        put_le16(e, EI_LEAF_HI, (self.child >> 32) as u16);
        put_le16(e, EI_UNUSED, 0);
    }
}

/// `ext4_extent`: a leaf entry mapping `len` logical blocks to physical blocks (§5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// `ee_block`: first logical block.
    pub lblk: u32,
    /// Decoded length, 1..=32768 (initialized) or 1..=32767 (unwritten) (§5.2).
    pub len: u32,
    /// First physical block (48 bits).
    pub pblk: u64,
    /// Preallocated, reads as zeros (§5.2).
    pub unwritten: bool,
}

impl Extent {
    /// Exclusive logical end; u64 because an extent may end exactly at 2^32.
    #[inline]
    pub fn end(&self) -> u64 {
        self.lblk as u64 + self.len as u64
    }

    /// Exclusive physical end.
    #[inline]
    pub fn pend(&self) -> u64 {
        self.pblk + self.len as u64
    }

    /// Physical block for `lblk`, if this extent covers it.
    #[inline]
    pub fn map(&self, lblk: u32) -> Option<u64> {
        if lblk >= self.lblk && (lblk as u64) < self.end() {
            Some(self.pblk + (lblk - self.lblk) as u64)
        } else {
            None
        }
    }

    /// `next` continues this extent logically and physically in the same state, and the
    /// union stays within the §5.2 length limit.
    pub fn can_merge(&self, next: &Extent) -> bool {
        self.unwritten == next.unwritten
            && self.end() == next.lblk as u64
            && self.pend() == next.pblk
            && self.len as u64 + next.len as u64 <= max_len(self.unwritten) as u64
    }

    fn parse(e: &[u8]) -> Self {
        let (len, unwritten) = decode_len(le16(e, EE_LEN));
        Extent {
            lblk: le32(e, EE_BLOCK),
            len,
            pblk: le32(e, EE_START_LO) as u64 | ((le16(e, EE_START_HI) as u64) << 32),
            unwritten,
        }
    }

    /// Caller has validated the extent (length encodable).
    fn write(&self, e: &mut [u8]) {
        put_le32(e, EE_BLOCK, self.lblk);
        put_le16(e, EE_LEN, encode_len(self.len, self.unwritten).unwrap_or(0));
        put_le16(e, EE_START_HI, (self.pblk >> 32) as u16);
        put_le32(e, EE_START_LO, self.pblk as u32);
    }
}

/// Where a node lives, for capacity and error reporting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    /// Inode root; carries the inode number for errors.
    Root(u32),
    /// Tree block number and its size.
    Block(u64, usize),
}

impl Loc {
    fn capacity(self) -> u16 {
        match self {
            Loc::Root(_) => ROOT_CAPACITY,
            Loc::Block(_, bs) => block_capacity(bs),
        }
    }
    fn err(self, reason: impl Into<String>) -> FormatError {
        match self {
            Loc::Root(ino) => FormatError::corrupt(ROOT_STRUCT, ino as u64, reason),
            Loc::Block(nr, _) => FormatError::corrupt(BLOCK_STRUCT, nr, reason),
        }
    }
    fn bad_magic(self, found: u16) -> FormatError {
        let (structure, block) = match self {
            Loc::Root(ino) => (ROOT_STRUCT, ino as u64),
            Loc::Block(nr, _) => (BLOCK_STRUCT, nr),
        };
        FormatError::BadMagic {
            structure,
            block,
            found: found as u32,
        }
    }
}

/// Header checks shared by readers (§5.3; the kernel's `__ext4_ext_check`).
///
/// `eh_max` is accepted in `[cap - 2, cap]` like e2fsprogs' `ext2fs_extent_header_verify`
/// (the kernel only rejects values above `cap`); our writers always store `cap`.
fn check_header(h: &ExtentHeader, loc: Loc, expect_depth: Option<u16>) -> Result<()> {
    if h.magic != EXT_MAGIC {
        return Err(loc.bad_magic(h.magic));
    }
    if h.depth > MAX_DEPTH {
        return Err(loc.err(format!("depth {} > {}", h.depth, MAX_DEPTH)));
    }
    if let Some(d) = expect_depth {
        if h.depth != d {
            return Err(loc.err(format!("depth {} where {} expected", h.depth, d)));
        }
    }
    let cap = loc.capacity();
    if h.max == 0 || h.max > cap || h.max < cap.saturating_sub(2) {
        return Err(loc.err(format!("eh_max {} invalid (capacity {})", h.max, cap)));
    }
    if h.entries > h.max {
        return Err(loc.err(format!("eh_entries {} > eh_max {}", h.entries, h.max)));
    }
    if h.depth > 0 && h.entries == 0 {
        return Err(loc.err("index node with no entries"));
    }
    Ok(())
}

/// Order/length checks on leaf entries, fed one by one (§5.2, §5.3).
fn check_extent(prev_end: Option<u64>, e: &Extent, i: usize, loc: Loc) -> Result<()> {
    if e.len == 0 {
        return Err(loc.err(format!("extent {i} has zero length")));
    }
    if e.end() > LBLK_SPACE_END {
        return Err(loc.err(format!("extent {i} runs past the logical block space")));
    }
    if e.pend() > PBLK_LIMIT {
        return Err(loc.err(format!("extent {i} runs past 2^48 physical blocks")));
    }
    if let Some(pe) = prev_end {
        if (e.lblk as u64) < pe {
            return Err(loc.err(format!(
                "extent {i} at lblk {} overlaps or precedes the previous one (ending {pe})",
                e.lblk
            )));
        }
    }
    Ok(())
}

/// Order checks on index entries (§5.3).
fn check_index(prev: Option<u32>, x: &ExtentIdx, i: usize, loc: Loc) -> Result<()> {
    if x.child == 0 || x.child >= PBLK_LIMIT {
        return Err(loc.err(format!("index {i} points at invalid block {}", x.child)));
    }
    if let Some(p) = prev {
        if x.lblk <= p {
            return Err(loc.err(format!(
                "index {i} at lblk {} not after the previous one ({p})",
                x.lblk
            )));
        }
    }
    Ok(())
}

/// A validated, zero-copy view of one extent node.
#[derive(Debug, Clone, Copy)]
pub struct NodeRef<'a> {
    /// Header plus `entries` slots (the node's bytes, trimmed to the valid entries).
    data: &'a [u8],
    header: ExtentHeader,
}

impl<'a> NodeRef<'a> {
    /// Parse and validate the root in `i_block` (at least 60 bytes) of inode `ino`.
    pub fn parse_root(i_block: &'a [u8], ino: u32) -> Result<Self> {
        let loc = Loc::Root(ino);
        if i_block.len() < ROOT_LEN {
            return Err(loc.err(format!("i_block is {} bytes", i_block.len())));
        }
        Self::parse_at(&i_block[..ROOT_LEN], loc, None)
    }

    /// Parse and validate tree block `blocknr` (the whole block) owned by inode `ino`
    /// with generation `generation`. `expect_depth` is the depth the parent implies.
    /// The tail checksum is verified when `csum.enabled`.
    pub fn parse_block(
        block: &'a [u8],
        blocknr: u64,
        expect_depth: Option<u16>,
        csum: &CsumCtx,
        ino: u32,
        generation: u32,
    ) -> Result<Self> {
        let loc = Loc::Block(blocknr, block.len());
        if block.len() < HEADER_LEN + ENTRY_LEN + TAIL_LEN {
            return Err(loc.err(format!("block is only {} bytes", block.len())));
        }
        let node = Self::parse_at(block, loc, expect_depth)?;
        if csum.enabled {
            // check_header guarantees max <= capacity, so the tail lies inside `block`.
            let off = tail_offset(node.header.max);
            let stored = le32(block, off);
            let computed = block_checksum(csum.inode_seed(ino, generation), block, node.header.max);
            if stored != computed {
                return Err(FormatError::BadChecksum {
                    structure: BLOCK_STRUCT,
                    block: blocknr,
                    stored,
                    computed,
                });
            }
        }
        Ok(node)
    }

    fn parse_at(buf: &'a [u8], loc: Loc, expect_depth: Option<u16>) -> Result<Self> {
        let header = ExtentHeader::parse(buf).ok_or_else(|| loc.err("short header"))?;
        check_header(&header, loc, expect_depth)?;
        let n = header.entries as usize;
        let end = HEADER_LEN + ENTRY_LEN * n;
        let data = buf
            .get(..end)
            .ok_or_else(|| loc.err("entries run past the node"))?;
        let node = NodeRef { data, header };
        if header.depth == 0 {
            let mut prev = None;
            for i in 0..n {
                let e = node.raw_extent(i);
                check_extent(prev, &e, i, loc)?;
                prev = Some(e.end());
            }
        } else {
            let mut prev = None;
            for i in 0..n {
                let x = node.raw_index(i);
                check_index(prev, &x, i, loc)?;
                prev = Some(x.lblk);
            }
        }
        Ok(node)
    }

    #[inline]
    fn slot(&self, i: usize) -> &'a [u8] {
        let off = HEADER_LEN + ENTRY_LEN * i;
        &self.data[off..off + ENTRY_LEN]
    }
    #[inline]
    fn raw_extent(&self, i: usize) -> Extent {
        Extent::parse(self.slot(i))
    }
    #[inline]
    fn raw_index(&self, i: usize) -> ExtentIdx {
        ExtentIdx::parse(self.slot(i))
    }
    #[inline]
    fn start_of(&self, i: usize) -> u32 {
        // ee_block and ei_block are both at offset 0.
        le32(self.slot(i), 0)
    }

    pub fn header(&self) -> &ExtentHeader {
        &self.header
    }
    pub fn depth(&self) -> u16 {
        self.header.depth
    }
    pub fn is_leaf(&self) -> bool {
        self.header.depth == 0
    }
    /// Number of valid entries.
    pub fn len(&self) -> usize {
        self.header.entries as usize
    }
    pub fn is_empty(&self) -> bool {
        self.header.entries == 0
    }

    /// Leaf entry `i`; `None` for an index node or `i` out of range.
    pub fn extent(&self, i: usize) -> Option<Extent> {
        (self.is_leaf() && i < self.len()).then(|| self.raw_extent(i))
    }

    /// Index entry `i`; `None` for a leaf or `i` out of range.
    pub fn index(&self, i: usize) -> Option<ExtentIdx> {
        (!self.is_leaf() && i < self.len()).then(|| self.raw_index(i))
    }

    /// Logical start of entry `i` (leaf or index).
    pub fn entry_lblk(&self, i: usize) -> Option<u32> {
        (i < self.len()).then(|| self.start_of(i))
    }

    /// Position of the last entry starting at or before `lblk` (§5.4 lookup), by binary
    /// search; `None` when every entry starts after `lblk` (or the node is empty).
    pub fn search(&self, lblk: u32) -> Option<usize> {
        // Entries are sorted (validated), so partition_point applies.
        let (mut lo, mut hi) = (0usize, self.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.start_of(mid) <= lblk {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo.checked_sub(1)
    }

    /// Leaf entries in order (empty for an index node).
    pub fn extents(&self) -> impl Iterator<Item = Extent> + '_ {
        let n = if self.is_leaf() { self.len() } else { 0 };
        (0..n).map(move |i| self.raw_extent(i))
    }

    /// Index entries in order (empty for a leaf).
    pub fn indexes(&self) -> impl Iterator<Item = ExtentIdx> + '_ {
        let n = if self.is_leaf() { 0 } else { self.len() };
        (0..n).map(move |i| self.raw_index(i))
    }

    /// Owned copy for editing.
    pub fn to_node(&self) -> ExtentNode {
        let entries = if self.is_leaf() {
            Entries::Leaf(self.extents().collect())
        } else {
            Entries::Index(self.indexes().collect())
        };
        ExtentNode {
            depth: self.header.depth,
            entries,
        }
    }
}

/// Entries of an owned node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entries {
    Leaf(Vec<Extent>),
    Index(Vec<ExtentIdx>),
}

/// An owned extent node. Its capacity follows from where it is written: the root
/// always holds [`ROOT_CAPACITY`] slots and a block [`block_capacity`] slots; `eh_max`
/// is written as that capacity (normalising nodes read with a smaller tolerated max).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentNode {
    pub depth: u16,
    pub entries: Entries,
}

impl ExtentNode {
    /// Empty leaf (the root of a new, empty file).
    pub fn empty_leaf() -> Self {
        ExtentNode {
            depth: 0,
            entries: Entries::Leaf(Vec::new()),
        }
    }

    /// Leaf node with the given extents.
    pub fn leaf(extents: Vec<Extent>) -> Self {
        ExtentNode {
            depth: 0,
            entries: Entries::Leaf(extents),
        }
    }

    /// Index node at `depth` (>= 1) with the given entries.
    pub fn index(depth: u16, idx: Vec<ExtentIdx>) -> Self {
        ExtentNode {
            depth,
            entries: Entries::Index(idx),
        }
    }

    pub fn is_leaf(&self) -> bool {
        matches!(self.entries, Entries::Leaf(_))
    }

    pub fn len(&self) -> usize {
        match &self.entries {
            Entries::Leaf(v) => v.len(),
            Entries::Index(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Logical start of the first entry.
    pub fn first_lblk(&self) -> Option<u32> {
        match &self.entries {
            Entries::Leaf(v) => v.first().map(|e| e.lblk),
            Entries::Index(v) => v.first().map(|x| x.lblk),
        }
    }

    /// Validate as a node to be stored in the inode root.
    pub fn validate_root(&self, ino: u32) -> Result<()> {
        self.validate_at(Loc::Root(ino))
    }

    /// Validate as tree block `blocknr` of `block_size` bytes.
    pub fn validate_block(&self, blocknr: u64, block_size: usize) -> Result<()> {
        self.validate_at(Loc::Block(blocknr, block_size))
    }

    fn validate_at(&self, loc: Loc) -> Result<()> {
        let cap = loc.capacity();
        let n = self.len();
        if n > cap as usize {
            return Err(loc.err(format!("{n} entries exceed capacity {cap}")));
        }
        let header = self.header(cap);
        // Leaf/index kind must agree with the depth.
        if self.is_leaf() != (self.depth == 0) {
            return Err(loc.err(format!("entry kind does not match depth {}", self.depth)));
        }
        check_header(&header, loc, None)?;
        match &self.entries {
            Entries::Leaf(v) => {
                let mut prev = None;
                for (i, e) in v.iter().enumerate() {
                    if e.len > max_len(e.unwritten) {
                        return Err(loc.err(format!("extent {i} too long ({})", e.len)));
                    }
                    check_extent(prev, e, i, loc)?;
                    prev = Some(e.end());
                }
            }
            Entries::Index(v) => {
                let mut prev = None;
                for (i, x) in v.iter().enumerate() {
                    check_index(prev, x, i, loc)?;
                    prev = Some(x.lblk);
                }
            }
        }
        Ok(())
    }

    fn header(&self, cap: u16) -> ExtentHeader {
        ExtentHeader {
            magic: EXT_MAGIC,
            entries: self.len().min(u16::MAX as usize) as u16,
            max: cap,
            depth: self.depth,
            generation: 0,
        }
    }

    fn write_entries(&self, out: &mut [u8]) {
        match &self.entries {
            Entries::Leaf(v) => {
                for (i, e) in v.iter().enumerate() {
                    let off = HEADER_LEN + ENTRY_LEN * i;
                    e.write(&mut out[off..off + ENTRY_LEN]);
                }
            }
            Entries::Index(v) => {
                for (i, x) in v.iter().enumerate() {
                    let off = HEADER_LEN + ENTRY_LEN * i;
                    x.write(&mut out[off..off + ENTRY_LEN]);
                }
            }
        }
    }

    /// Validate and serialise into the inode's 60-byte `i_block` (unused slots zeroed).
    pub fn write_root(&self, i_block: &mut [u8], ino: u32) -> Result<()> {
        let loc = Loc::Root(ino);
        if i_block.len() < ROOT_LEN {
            return Err(loc.err(format!("i_block is {} bytes", i_block.len())));
        }
        self.validate_at(loc)?;
        let out = &mut i_block[..ROOT_LEN];
        out.fill(0);
        self.header(ROOT_CAPACITY).write(out);
        self.write_entries(out);
        Ok(())
    }

    /// Validate and serialise into a whole tree block (`block.len()` is the block size),
    /// zeroing unused slots and storing the tail checksum (when `csum.enabled`) with the
    /// seed of inode `ino`/`generation`.
    pub fn write_block(
        &self,
        block: &mut [u8],
        blocknr: u64,
        csum: &CsumCtx,
        ino: u32,
        generation: u32,
    ) -> Result<()> {
        let loc = Loc::Block(blocknr, block.len());
        if block.len() < HEADER_LEN + ENTRY_LEN + TAIL_LEN {
            return Err(loc.err(format!("block is only {} bytes", block.len())));
        }
        self.validate_at(loc)?;
        let cap = block_capacity(block.len());
        block.fill(0);
        self.header(cap).write(block);
        self.write_entries(block);
        if csum.enabled {
            let c = block_checksum(csum.inode_seed(ino, generation), block, cap);
            put_le32(block, tail_offset(cap), c);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CSUM: CsumCtx = CsumCtx {
        enabled: true,
        fs_seed: 0x5D5D_0A96,
    };

    fn ext(lblk: u32, len: u32, pblk: u64, unwritten: bool) -> Extent {
        Extent {
            lblk,
            len,
            pblk,
            unwritten,
        }
    }

    #[test]
    fn capacities_match_the_format_doc() {
        assert_eq!(block_capacity(1024), 84);
        assert_eq!(block_capacity(4096), 340);
        assert_eq!(block_capacity(65536), 5460);
        assert_eq!(tail_offset(84), 1020);
        // The tail always fits (bs mod 12 >= 4).
        for bs in [1024usize, 2048, 4096, 8192, 65536] {
            assert!(tail_offset(block_capacity(bs)) + TAIL_LEN <= bs);
        }
    }

    #[test]
    fn length_encoding() {
        assert_eq!(decode_len(1), (1, false));
        assert_eq!(decode_len(0x8000), (32768, false));
        assert_eq!(decode_len(0x8001), (1, true));
        assert_eq!(decode_len(0xFFFF), (32767, true));
        assert_eq!(encode_len(32768, false), Some(0x8000));
        assert_eq!(encode_len(32768, true), None);
        assert_eq!(encode_len(32767, true), Some(0xFFFF));
        assert_eq!(encode_len(0, false), None);
        assert_eq!(encode_len(0, true), None);
        assert_eq!(encode_len(5, true), Some(0x8005));
    }

    #[test]
    fn root_round_trip_and_layout() {
        let n = ExtentNode::leaf(vec![ext(0, 8, 0x1_0000_0100, false), ext(10, 3, 500, true)]);
        let mut ib = [0xAAu8; 60];
        n.write_root(&mut ib, 12).unwrap();
        assert_eq!(le16(&ib, 0), EXT_MAGIC);
        assert_eq!(le16(&ib, 2), 2);
        assert_eq!(le16(&ib, 4), 4);
        assert_eq!(le16(&ib, 6), 0);
        assert_eq!(le32(&ib, 12), 0);
        assert_eq!(le16(&ib, 16), 8);
        assert_eq!(le16(&ib, 18), 1); // start_hi
        assert_eq!(le32(&ib, 20), 0x100);
        assert_eq!(le16(&ib, 28), 0x8003);
        assert!(ib[36..].iter().all(|&b| b == 0));
        let r = NodeRef::parse_root(&ib, 12).unwrap();
        assert_eq!(r.to_node(), n);
        assert_eq!(r.search(9), Some(0));
        assert_eq!(r.extent(0).unwrap().map(7), Some(0x1_0000_0107));
        assert_eq!(r.extent(0).unwrap().map(8), None);
        assert_eq!(r.index(0), None);
        assert_eq!(r.extent(2), None);
    }

    #[test]
    fn block_checksum_is_written_and_verified() {
        let n = ExtentNode::index(
            1,
            vec![
                ExtentIdx {
                    lblk: 0,
                    child: 100,
                },
                ExtentIdx {
                    lblk: 50,
                    child: 0x2_0000_0000,
                },
            ],
        );
        let mut b = vec![0u8; 1024];
        n.write_block(&mut b, 77, &CSUM, 12, 99).unwrap();
        let seed = CSUM.inode_seed(12, 99);
        assert_eq!(le32(&b, 1020), crc32c_raw(seed, &b[..1020]));
        let r = NodeRef::parse_block(&b, 77, Some(1), &CSUM, 12, 99).unwrap();
        assert_eq!(r.to_node(), n);
        assert_eq!(r.index(1).unwrap().child, 0x2_0000_0000);
        // Wrong owner (generation) -> checksum error.
        assert!(matches!(
            NodeRef::parse_block(&b, 77, Some(1), &CSUM, 12, 98),
            Err(FormatError::BadChecksum { block: 77, .. })
        ));
        // Wrong expected depth.
        assert!(NodeRef::parse_block(&b, 77, Some(0), &CSUM, 12, 99).is_err());
        // A flipped bit in an unused slot is still covered by the checksum.
        b[500] ^= 1;
        assert!(matches!(
            NodeRef::parse_block(&b, 77, Some(1), &CSUM, 12, 99),
            Err(FormatError::BadChecksum { .. })
        ));
        // ... but ignored without metadata_csum.
        let off = CsumCtx {
            enabled: false,
            fs_seed: 0,
        };
        assert!(NodeRef::parse_block(&b, 77, Some(1), &off, 12, 99).is_ok());
    }

    fn root_bytes(h: ExtentHeader, entries: &[[u8; 12]]) -> [u8; 60] {
        let mut b = [0u8; 60];
        h.write(&mut b);
        for (i, e) in entries.iter().enumerate().take(4) {
            b[12 + 12 * i..24 + 12 * i].copy_from_slice(e);
        }
        b
    }

    fn raw_ext(lblk: u32, raw_len: u16, pblk: u32) -> [u8; 12] {
        let mut e = [0u8; 12];
        put_le32(&mut e, 0, lblk);
        put_le16(&mut e, 4, raw_len);
        put_le32(&mut e, 8, pblk);
        e
    }

    fn hdr(entries: u16, max: u16, depth: u16) -> ExtentHeader {
        ExtentHeader {
            magic: EXT_MAGIC,
            entries,
            max,
            depth,
            generation: 0,
        }
    }

    #[test]
    fn validation_rejects_bad_nodes() {
        let good = raw_ext(0, 4, 100);
        assert!(NodeRef::parse_root(&root_bytes(hdr(1, 4, 0), &[good]), 1).is_ok());
        // Bad magic.
        let mut h = hdr(1, 4, 0);
        h.magic = 0x1234;
        assert!(matches!(
            NodeRef::parse_root(&root_bytes(h, &[good]), 1),
            Err(FormatError::BadMagic { found: 0x1234, .. })
        ));
        // Entries > max.
        assert!(NodeRef::parse_root(&root_bytes(hdr(4, 3, 0), &[good; 4]), 1).is_err());
        // Max larger than the root capacity, or 0.
        assert!(NodeRef::parse_root(&root_bytes(hdr(1, 5, 0), &[good]), 1).is_err());
        assert!(NodeRef::parse_root(&root_bytes(hdr(0, 0, 0), &[]), 1).is_err());
        // Block-sized max in a root.
        assert!(NodeRef::parse_root(&root_bytes(hdr(1, 84, 0), &[good]), 1).is_err());
        // Depth > 5.
        let idx = {
            let mut e = [0u8; 12];
            put_le32(&mut e, 4, 9);
            e
        };
        assert!(NodeRef::parse_root(&root_bytes(hdr(1, 4, 6), &[idx]), 1).is_err());
        assert!(NodeRef::parse_root(&root_bytes(hdr(1, 4, 5), &[idx]), 1).is_ok());
        // Index node with no entries; index pointing at block 0.
        assert!(NodeRef::parse_root(&root_bytes(hdr(0, 4, 1), &[]), 1).is_err());
        assert!(NodeRef::parse_root(&root_bytes(hdr(1, 4, 1), &[[0u8; 12]]), 1).is_err());
        // Zero length.
        assert!(NodeRef::parse_root(&root_bytes(hdr(1, 4, 0), &[raw_ext(0, 0, 5)]), 1).is_err());
        // Unsorted and overlapping leaves.
        let a = raw_ext(10, 5, 100);
        assert!(NodeRef::parse_root(&root_bytes(hdr(2, 4, 0), &[a, raw_ext(0, 2, 9)]), 1).is_err());
        assert!(
            NodeRef::parse_root(&root_bytes(hdr(2, 4, 0), &[a, raw_ext(14, 2, 9)]), 1).is_err()
        );
        assert!(NodeRef::parse_root(&root_bytes(hdr(2, 4, 0), &[a, raw_ext(15, 2, 9)]), 1).is_ok());
        // Duplicate index starts.
        let mut i2 = idx;
        put_le32(&mut i2, 4, 10);
        assert!(NodeRef::parse_root(&root_bytes(hdr(2, 4, 1), &[idx, i2]), 1).is_err());
        // Extent past 2^32.
        assert!(
            NodeRef::parse_root(&root_bytes(hdr(1, 4, 0), &[raw_ext(u32::MAX, 2, 9)]), 1).is_err()
        );
        assert!(
            NodeRef::parse_root(&root_bytes(hdr(1, 4, 0), &[raw_ext(u32::MAX, 1, 9)]), 1).is_ok()
        );
        // Short buffers.
        assert!(NodeRef::parse_root(&[0u8; 59], 1).is_err());
        assert!(NodeRef::parse_block(&[0u8; 20], 3, None, &CSUM, 1, 0).is_err());
    }

    #[test]
    fn block_max_tolerance() {
        // e2fsprogs accepts eh_max in [cap-2, cap]; the checksum sits after eh_max slots.
        for (max, ok) in [
            (84u16, true),
            (83, true),
            (82, true),
            (81, false),
            (85, false),
        ] {
            let mut b = vec![0u8; 1024];
            hdr(1, max, 0).write(&mut b);
            b[12..24].copy_from_slice(&raw_ext(3, 1, 50));
            let off = tail_offset(max.min(84));
            let c = block_checksum(CSUM.inode_seed(5, 6), &b, max.min(84));
            put_le32(&mut b, off, c);
            assert_eq!(
                NodeRef::parse_block(&b, 9, Some(0), &CSUM, 5, 6).is_ok(),
                ok,
                "max {max}"
            );
        }
    }

    #[test]
    fn writers_refuse_invalid_nodes() {
        let mut ib = [0u8; 60];
        let too_many = ExtentNode::leaf((0..5).map(|i| ext(i * 2, 1, 100, false)).collect());
        assert!(too_many.write_root(&mut ib, 1).is_err());
        let long_unwritten = ExtentNode::leaf(vec![ext(0, 32768, 100, true)]);
        assert!(long_unwritten.write_root(&mut ib, 1).is_err());
        let long = ExtentNode::leaf(vec![ext(0, 32769, 100, false)]);
        assert!(long.write_root(&mut ib, 1).is_err());
        let overlap = ExtentNode::leaf(vec![ext(0, 3, 100, false), ext(2, 1, 200, false)]);
        assert!(overlap.write_root(&mut ib, 1).is_err());
        let kind = ExtentNode {
            depth: 1,
            entries: Entries::Leaf(vec![]),
        };
        assert!(kind.write_root(&mut ib, 1).is_err());
        let mut blk = vec![0u8; 1024];
        let full = ExtentNode::leaf(
            (0..84)
                .map(|i| ext(i * 2, 1, 100 + i as u64, false))
                .collect(),
        );
        assert!(full.write_block(&mut blk, 5, &CSUM, 1, 0).is_ok());
        let over = ExtentNode::leaf((0..85).map(|i| ext(i * 2, 1, 100, false)).collect());
        assert!(over.write_block(&mut blk, 5, &CSUM, 1, 0).is_err());
        assert_eq!(ExtentNode::empty_leaf().write_root(&mut ib, 1), Ok(()));
        assert!(NodeRef::parse_root(&ib, 1).unwrap().is_empty());
    }

    #[test]
    fn merge_rules() {
        let a = ext(0, 10, 100, false);
        assert!(a.can_merge(&ext(10, 5, 110, false)));
        assert!(!a.can_merge(&ext(10, 5, 111, false)));
        assert!(!a.can_merge(&ext(11, 5, 110, false)));
        assert!(!a.can_merge(&ext(10, 5, 110, true)));
        assert!(!a.can_merge(&ext(10, 32759, 110, false)));
        assert!(a.can_merge(&ext(10, 32758, 110, false)));
        let u = ext(0, 10, 100, true);
        assert!(!u.can_merge(&ext(10, 32758, 110, true)));
        assert!(u.can_merge(&ext(10, 32757, 110, true)));
    }

    /// Sorted, non-overlapping extents (gaps >= 0) from arbitrary pieces.
    fn extents_strategy(max: usize) -> impl Strategy<Value = Vec<Extent>> {
        prop::collection::vec(
            (
                0u32..1000,
                1u32..=32768,
                any::<bool>(),
                0u64..(1 << 48) - 40000,
            ),
            0..=max,
        )
        .prop_map(|v| {
            let mut out = Vec::new();
            let mut next: u64 = 0;
            for (gap, len, unw, pblk) in v {
                let len = len.min(max_len(unw));
                let lblk = next + gap as u64;
                if lblk + len as u64 > LBLK_SPACE_END {
                    break;
                }
                out.push(ext(lblk as u32, len, pblk, unw));
                next = lblk + len as u64;
            }
            out
        })
    }

    fn index_strategy(max: usize) -> impl Strategy<Value = Vec<ExtentIdx>> {
        prop::collection::vec((1u32..100_000, 1u64..(1 << 48)), 1..=max).prop_map(|v| {
            let mut out = Vec::new();
            let mut at: u64 = 0;
            for (step, child) in v {
                if at > u32::MAX as u64 {
                    break;
                }
                out.push(ExtentIdx {
                    lblk: at as u32,
                    child,
                });
                at += step as u64;
            }
            out
        })
    }

    proptest! {
        #[test]
        fn leaf_block_round_trip(v in extents_strategy(84), ino in any::<u32>(), gen in any::<u32>(), nr in 1u64..1<<40) {
            let n = ExtentNode::leaf(v);
            let mut b = vec![0u8; 1024];
            n.write_block(&mut b, nr, &CSUM, ino, gen).unwrap();
            let r = NodeRef::parse_block(&b, nr, Some(0), &CSUM, ino, gen).unwrap();
            prop_assert_eq!(r.to_node(), n.clone());
            // search() agrees with a linear scan.
            if let Entries::Leaf(v) = &n.entries {
                for probe in v.iter().flat_map(|e| [e.lblk.saturating_sub(1), e.lblk, (e.end() - 1) as u32]) {
                    let lin = v.iter().rposition(|e| e.lblk <= probe);
                    prop_assert_eq!(r.search(probe), lin);
                }
            }
        }

        #[test]
        fn index_block_round_trip(v in index_strategy(340), depth in 1u16..=5, gen in any::<u32>()) {
            let n = ExtentNode::index(depth, v);
            let mut b = vec![0u8; 4096];
            n.write_block(&mut b, 1234, &CSUM, 42, gen).unwrap();
            let r = NodeRef::parse_block(&b, 1234, Some(depth), &CSUM, 42, gen).unwrap();
            prop_assert_eq!(r.to_node(), n);
        }

        #[test]
        fn root_round_trip(v in extents_strategy(4)) {
            let n = ExtentNode::leaf(v);
            let mut ib = [0u8; 60];
            n.write_root(&mut ib, 7).unwrap();
            prop_assert_eq!(NodeRef::parse_root(&ib, 7).unwrap().to_node(), n);
        }

        #[test]
        fn arbitrary_bytes_never_panic(
            b in prop::collection::vec(any::<u8>(), 0..1100),
            plausible in 0u8..3,
            entries in 0u16..90,
            depth in 0u16..7,
        ) {
            let mut b = b;
            // Two thirds of the cases get a plausible header (root- or block-sized max)
            // and ascending starts, so that entry validation and success paths are hit.
            if plausible > 0 && b.len() >= 60 {
                let max = if plausible == 1 { 4 } else { block_capacity(b.len()) };
                let n = entries.min(max);
                hdr(n, max, depth).write(&mut b);
                for i in 0..n as usize {
                    let off = 12 + 12 * i;
                    if off + 12 <= b.len() && b[off + 1] != 0 {
                        put_le32(&mut b, off, i as u32 * 0x10000);
                        let len = 1 + b[off + 5] as u16;
                        put_le16(&mut b, off + 4, len);
                    }
                }
            }
            if let Ok(r) = NodeRef::parse_root(&b, 3) {
                let _ = r.to_node();
                let _ = r.search(12345);
            }
            if let Ok(r) = NodeRef::parse_block(&b, 3, None, &CsumCtx { enabled: false, fs_seed: 0 }, 3, 0) {
                let n = r.to_node();
                let _ = r.search(u32::MAX);
                // A node that parsed re-serialises and parses back identically.
                let mut out = vec![0u8; b.len()];
                n.write_block(&mut out, 3, &CSUM, 3, 0).unwrap();
                prop_assert_eq!(NodeRef::parse_block(&out, 3, None, &CSUM, 3, 0).unwrap().to_node(), n);
            }
        }
    }

    /// Tests against images made by mkfs.ext4/debugfs and by the kernel (§5, §1.3).
    mod image {
        use super::*;
        use std::io::{Read, Seek, SeekFrom, Write};
        use std::path::{Path, PathBuf};
        use std::process::Command;
        use std::sync::atomic::{AtomicU32, Ordering};

        /// Unique scratch directory, removed on drop (also when a test fails).
        struct Scratch(PathBuf);
        impl Scratch {
            fn new(tag: &str) -> Self {
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "commitfs-extent-{tag}-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Scratch(p)
            }
        }
        impl Drop for Scratch {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }

        /// Loop mount, unmounted (and its loop device detached) on drop.
        struct Mount(PathBuf);
        impl Drop for Mount {
            fn drop(&mut self) {
                let _ = Command::new("umount").arg("-d").arg(&self.0).status();
            }
        }

        fn run(cmd: &str, args: &[&str]) -> String {
            let out = Command::new(cmd).args(args).output().unwrap();
            assert!(
                out.status.success(),
                "{cmd} {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }

        struct Image {
            file: std::fs::File,
            bs: usize,
            csum: CsumCtx,
        }

        impl Image {
            fn open(path: &Path) -> Self {
                let mut file = std::fs::File::open(path).unwrap();
                let mut sb = vec![0u8; 1024];
                file.seek(SeekFrom::Start(1024)).unwrap();
                file.read_exact(&mut sb).unwrap();
                assert_eq!(le16(&sb, 0x38), 0xEF53);
                let bs = 1024usize << le32(&sb, 0x18);
                let metadata_csum = le32(&sb, 0x64) & 0x400 != 0;
                let fs_seed = if le32(&sb, 0x60) & 0x2000 != 0 {
                    le32(&sb, 0x270)
                } else {
                    crc32c_raw(!0, &sb[0x68..0x78])
                };
                assert!(metadata_csum, "mkfs default should have metadata_csum");
                Image {
                    file,
                    bs,
                    csum: CsumCtx {
                        enabled: true,
                        fs_seed,
                    },
                }
            }
            fn read(&mut self, off: u64, len: usize) -> Vec<u8> {
                let mut b = vec![0u8; len];
                self.file.seek(SeekFrom::Start(off)).unwrap();
                self.file.read_exact(&mut b).unwrap();
                b
            }
        }

        /// Inode location from `debugfs imap`, then (i_block, generation).
        fn read_inode(img: &Path, im: &mut Image, name: &str) -> (u32, [u8; 60], u32) {
            let stat = run(
                "debugfs",
                &["-R", &format!("stat {name}"), img.to_str().unwrap()],
            );
            let ino: u32 = stat
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .expect("inode number");
            let imap = run(
                "debugfs",
                &["-R", &format!("imap {name}"), img.to_str().unwrap()],
            );
            let loc = imap.split("located at block ").nth(1).expect("imap output");
            let blk: u64 = loc.split(',').next().unwrap().trim().parse().unwrap();
            let off =
                u64::from_str_radix(loc.split("offset 0x").nth(1).unwrap().trim(), 16).unwrap();
            let raw = im.read(blk * im.bs as u64 + off, 128);
            let mut ib = [0u8; 60];
            ib.copy_from_slice(&raw[0x28..0x28 + 60]);
            (ino, ib, le32(&raw, 0x64))
        }

        /// Walk the tree, checking every block, index starts and re-serialisation.
        /// Returns (leaf extents, max depth, tree blocks).
        fn walk(im: &mut Image, ino: u32, gen: u32, ib: &[u8; 60]) -> (Vec<Extent>, u16, usize) {
            let root = NodeRef::parse_root(ib, ino).unwrap();
            let mut out = Vec::new();
            let mut blocks = 0;
            fn rec(
                im: &mut Image,
                ino: u32,
                gen: u32,
                node: &ExtentNode,
                out: &mut Vec<Extent>,
                blocks: &mut usize,
            ) {
                match &node.entries {
                    Entries::Leaf(v) => out.extend_from_slice(v),
                    Entries::Index(v) => {
                        for x in v {
                            let buf = im.read(x.child * im.bs as u64, im.bs);
                            let csum = im.csum;
                            let r = NodeRef::parse_block(
                                &buf,
                                x.child,
                                Some(node.depth - 1),
                                &csum,
                                ino,
                                gen,
                            )
                            .unwrap();
                            *blocks += 1;
                            // ei_block equals the first entry of the child (§5.3).
                            assert_eq!(r.entry_lblk(0), Some(x.lblk));
                            let child = r.to_node();
                            // Re-serialising gives the same header, entries and checksum.
                            let mut again = vec![0u8; im.bs];
                            child
                                .write_block(&mut again, x.child, &csum, ino, gen)
                                .unwrap();
                            let n = 12 + 12 * child.len();
                            assert_eq!(again[..n], buf[..n]);
                            let cap = block_capacity(im.bs);
                            assert_eq!(le16(&buf, 4), cap);
                            if buf[n..tail_offset(cap)].iter().all(|&b| b == 0) {
                                assert_eq!(again, buf);
                            }
                            rec(im, ino, gen, &child, out, blocks);
                        }
                    }
                }
            }
            let depth = root.depth();
            rec(im, ino, gen, &root.to_node(), &mut out, &mut blocks);
            (out, depth, blocks)
        }

        /// Leaf lines of `debugfs -R "ex"`: (lblk, pblk, len, unwritten).
        fn debugfs_extents(img: &Path, name: &str) -> Vec<Extent> {
            let txt = run(
                "debugfs",
                &["-R", &format!("ex {name}"), img.to_str().unwrap()],
            );
            let mut v = Vec::new();
            for line in txt.lines().skip(1) {
                let t: Vec<&str> = line
                    .split(|c: char| c.is_whitespace() || c == '/' || c == '-')
                    .filter(|s| !s.is_empty())
                    .collect();
                if t.len() < 9 || t[0] != t[1] {
                    continue; // index line
                }
                let p = |i: usize| t[i].parse::<u64>().unwrap();
                v.push(Extent {
                    lblk: p(4) as u32,
                    len: p(8) as u32,
                    pblk: p(6),
                    unwritten: t.get(9) == Some(&"Uninit"),
                });
                assert_eq!(p(5) - p(4) + 1, p(8));
                assert_eq!(p(7) - p(6) + 1, p(8));
            }
            v
        }

        /// Images written through the kernel carry random generations (seed coverage).
        fn name_gen_nonzero(img: &Path) -> bool {
            img.parent()
                .is_some_and(|d| d.to_string_lossy().contains("-krn-"))
        }

        fn check_file(img: &Path, name: &str, min_depth: u16) -> Vec<Extent> {
            let mut im = Image::open(img);
            let (ino, ib, gen) = read_inode(img, &mut im, name);
            if name_gen_nonzero(img) {
                assert_ne!(
                    gen, 0,
                    "kernel-created inode should have a random generation"
                );
            }
            let (ours, depth, blocks) = walk(&mut im, ino, gen, &ib);
            assert!(depth >= min_depth, "depth {depth} < {min_depth}");
            assert!(blocks > 0);
            assert_eq!(ours, debugfs_extents(img, name));
            // A corrupted tree block must be rejected, not panic: flip one byte.
            let first = NodeRef::parse_root(&ib, ino).unwrap().index(0).unwrap();
            let mut buf = im.read(first.child * im.bs as u64, im.bs);
            let csum = im.csum;
            buf[13] ^= 0x40;
            assert!(NodeRef::parse_block(&buf, first.child, None, &csum, ino, gen).is_err());
            ours
        }

        #[test]
        fn debugfs_punched_file_parses_and_verifies() {
            let dir = Scratch::new("dbg");
            let src = dir.0.join("src");
            std::fs::create_dir(&src).unwrap();
            let nblocks = 1200u64;
            let data: Vec<u8> = (0..nblocks * 1024).map(|i| (i * 7 % 251) as u8).collect();
            std::fs::write(src.join("file"), &data).unwrap();
            let img = dir.0.join("img");
            let img_s = img.to_str().unwrap();
            run(
                "mkfs.ext4",
                &[
                    "-q",
                    "-F",
                    "-b",
                    "1024",
                    "-d",
                    src.to_str().unwrap(),
                    img_s,
                    "8M",
                ],
            );
            let mut script = String::new();
            for b in (1..nblocks).step_by(2) {
                script.push_str(&format!("punch /file {b} {b}\n"));
            }
            script.push_str("fallocate /file 1300 1340\n");
            let sp = dir.0.join("cmds");
            std::fs::write(&sp, script).unwrap();
            run("debugfs", &["-w", "-f", sp.to_str().unwrap(), img_s]);
            let ext = check_file(&img, "/file", 2);
            assert_eq!(ext.iter().filter(|e| !e.unwritten).count(), 600);
            assert!(ext.iter().any(|e| e.unwritten && e.lblk == 1300));
        }

        #[test]
        fn kernel_fragmented_file_parses_and_verifies() {
            let dir = Scratch::new("krn");
            let img = dir.0.join("img");
            let img_s = img.to_str().unwrap();
            run("mkfs.ext4", &["-q", "-F", "-b", "1024", img_s, "8M"]);
            let mnt = dir.0.join("mnt");
            std::fs::create_dir(&mnt).unwrap();
            run("mount", &["-o", "loop", img_s, mnt.to_str().unwrap()]);
            let guard = Mount(mnt.clone());
            {
                let mut f = std::fs::File::create(mnt.join("file")).unwrap();
                for b in (0..1400u64).step_by(2) {
                    f.seek(SeekFrom::Start(b * 1024)).unwrap();
                    f.write_all(&[b as u8; 1024]).unwrap();
                }
                f.sync_all().unwrap();
            }
            let f = mnt.join("file");
            run(
                "fallocate",
                &[
                    "-n",
                    "-o",
                    &(1500 * 1024).to_string(),
                    "-l",
                    "20480",
                    f.to_str().unwrap(),
                ],
            );
            drop(guard);
            let ext = check_file(&img, "/file", 2);
            assert_eq!(ext.iter().filter(|e| !e.unwritten).count(), 700);
            assert!(ext
                .iter()
                .any(|e| e.unwritten && e.lblk == 1500 && e.len == 20));
        }
    }
}
