//! Fuzz properties for every parser family of `commitfs-format`.
//!
//! Shared by the cargo-fuzz targets (`fuzz/fuzz_targets/*.rs`, nightly, on demand) and
//! by the stable proptest suite `crates/format/tests/parse_any.rs`, which includes this
//! file with `#[path]`. It depends on nothing but `commitfs_format` and `std`.
//!
//! The properties: parsers never panic on any bytes, and whatever parses re-serialises
//! to bytes that parse again to the same value. Each function panics (an assertion)
//! when a property is broken, which is what both harnesses detect.
//!
//! # Input layout
//!
//! Every input is a [`Header`] of [`HEADER_LEN`] bytes (missing bytes read as zero)
//! followed by the structure's bytes. The header carries what the surrounding file
//! system would know (block size, checksum seed, inode number, ...), so that seeds cut
//! from a real image keep valid checksums and mutations exercise the checks behind the
//! checksum. With [`FLAG_FIX_CSUM`] the harness recomputes the checksum after the
//! mutation, to reach the structural validation.
//!
//! Preconditions the format layer documents (lengths fixed by a validated superblock:
//! block size, descriptor size, inode size) are honoured: the structure is cut to such
//! a size unless the size selector asks for the raw length, which is only fed to entry
//! points that validate buffer lengths themselves.

use commitfs_format::bitmap;
use commitfs_format::csum::CsumCtx;
use commitfs_format::dirent::{self, LeafGeometry};
use commitfs_format::dirhash;
use commitfs_format::dx::{self, DxGeometry};
use commitfs_format::extent::{self, Entries, Extent, ExtentIdx, ExtentNode, NodeRef};
use commitfs_format::fast_commit::{self as fc, FcPacker, Tlv};
use commitfs_format::group_desc::{self, GroupDesc};
use commitfs_format::inode::{self, Inode, Timestamp};
use commitfs_format::jbd2::{self, JournalSuperblock};
use commitfs_format::jbd2_log::{self, LogFormat, Tag};
use commitfs_format::superblock::{FeatureKind, Superblock, SUPERBLOCK_SIZE};
use commitfs_format::xattr::{self, WriteError, Xattr};

/// Length of the control header in front of every input.
pub const HEADER_LEN: usize = 32;

/// metadata_csum is on.
pub const FLAG_CSUM: u8 = 0x01;
/// Recompute the structure's checksum before parsing.
pub const FLAG_FIX_CSUM: u8 = 0x02;
/// Family-specific mode bits start here (see each function).
pub const FLAG_MODE_SHIFT: u8 = 2;

/// Size selector meaning "use the structure bytes with their exact length".
pub const SIZE_EXACT: u8 = 0xFF;

/// What the file system around a structure would know. Encoded little-endian:
/// `flags u8, size u8, param u16, fs_seed u32, ino u32, generation u32, block u64,
/// aux u32, probe u32`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    pub flags: u8,
    /// Size selector (family-specific table index), or [`SIZE_EXACT`].
    pub size: u8,
    /// Family-specific small parameter (expected depth, bit count, ...).
    pub param: u16,
    pub fs_seed: u32,
    /// Owning inode (or group number for descriptors).
    pub ino: u32,
    pub generation: u32,
    /// Block the structure was read from.
    pub block: u64,
    /// Family-specific (inodes_count for directories).
    pub aux: u32,
    /// Free value used to probe lookups (hashes, logical blocks, name lengths).
    pub probe: u32,
}

impl Header {
    /// Split an input into its header and structure bytes.
    pub fn split(data: &[u8]) -> (Header, &[u8]) {
        let mut h = [0u8; HEADER_LEN];
        let n = data.len().min(HEADER_LEN);
        h[..n].copy_from_slice(&data[..n]);
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let hdr = Header {
            flags: h[0],
            size: h[1],
            param: u16::from_le_bytes([h[2], h[3]]),
            fs_seed: u32_at(4),
            ino: u32_at(8),
            generation: u32_at(12),
            block: u32_at(16) as u64 | (u32_at(20) as u64) << 32,
            aux: u32_at(24),
            probe: u32_at(28),
        };
        (hdr, &data[n..])
    }

    /// Encode for a seed file; `encode(h) ++ bytes` splits back into `(h, bytes)`.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0] = self.flags;
        h[1] = self.size;
        h[2..4].copy_from_slice(&self.param.to_le_bytes());
        h[4..8].copy_from_slice(&self.fs_seed.to_le_bytes());
        h[8..12].copy_from_slice(&self.ino.to_le_bytes());
        h[12..16].copy_from_slice(&self.generation.to_le_bytes());
        h[16..24].copy_from_slice(&self.block.to_le_bytes());
        h[24..28].copy_from_slice(&self.aux.to_le_bytes());
        h[28..32].copy_from_slice(&self.probe.to_le_bytes());
        h
    }

    /// A full input: header then structure.
    pub fn input(&self, structure: &[u8]) -> Vec<u8> {
        let mut v = self.encode().to_vec();
        v.extend_from_slice(structure);
        v
    }

    pub fn csum(&self) -> CsumCtx {
        CsumCtx {
            enabled: self.flags & FLAG_CSUM != 0,
            fs_seed: self.fs_seed,
        }
    }

    fn fix_csum(&self) -> bool {
        self.flags & FLAG_FIX_CSUM != 0
    }

    fn mode(&self) -> u8 {
        self.flags >> FLAG_MODE_SHIFT
    }

    /// Structure cut (or zero-padded) to `sizes[size]`; the raw bytes for
    /// [`SIZE_EXACT`]. Returns whether the length is a trusted geometry size.
    fn cut(&self, rest: &[u8], sizes: &[usize]) -> (Vec<u8>, bool) {
        if self.size == SIZE_EXACT || sizes.is_empty() {
            return (rest.to_vec(), false);
        }
        let len = sizes[self.size as usize % sizes.len()];
        let mut v = vec![0u8; len];
        let n = rest.len().min(len);
        v[..n].copy_from_slice(&rest[..n]);
        (v, true)
    }
}

/// Block sizes the fs layer supports, by size selector.
pub const BLOCK_SIZES: [usize; 4] = [1024, 2048, 4096, 65536];
/// Inode record sizes (powers of two the superblock validation admits).
pub const INODE_SIZES: [usize; 4] = [128, 256, 512, 1024];
/// Group descriptor sizes (32 without 64bit, else a power of two >= 32).
pub const DESC_SIZES: [usize; 4] = [32, 64, 128, 1024];

/// A small deterministic byte stream derived from the input, for choosing probes and
/// mutations without a dependency on `arbitrary`.
struct Stream {
    state: u64,
}

impl Stream {
    fn new(seed: &[u8]) -> Stream {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for (i, &b) in seed.iter().enumerate().take(256) {
            s = (s ^ b as u64 ^ (i as u64) << 8).wrapping_mul(0x100_0000_01B3);
        }
        Stream { state: s }
    }
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        if self.state == 0 {
            self.state = 1;
        }
        self.state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

// ---------------------------------------------------------------------------------
// Superblock
// ---------------------------------------------------------------------------------

/// Superblock: `Superblock::parse` on the raw bytes and on a 1024-byte cut (checksum
/// fixed first with [`FLAG_FIX_CSUM`]); an accepted superblock serialises to the same
/// bytes, re-parses equal, and survives the setters the fs layer uses.
pub fn superblock(data: &[u8]) {
    let (h, rest) = Header::split(data);
    // Any length: parse checks it.
    let _ = Superblock::parse(rest);
    let mut raw = [0u8; SUPERBLOCK_SIZE];
    let n = rest.len().min(SUPERBLOCK_SIZE);
    raw[..n].copy_from_slice(&rest[..n]);
    if h.fix_csum() {
        raw = Superblock::from_raw_unchecked(&raw).to_bytes();
    }
    let Ok(sb) = Superblock::parse(&raw) else {
        return;
    };
    exercise_superblock(&sb, h.probe);
    let out = sb.to_bytes();
    assert_eq!(
        &out[..],
        &raw[..],
        "an accepted superblock must serialise to its own bytes"
    );
    let again = Superblock::parse(&out).expect("re-parse of a serialised superblock");
    assert_eq!(again, sb);

    // The setters mount/sync/unmount use keep the superblock valid.
    let mut m = sb.clone();
    m.set_free_blocks_count(h.block % (sb.blocks_count() + 1));
    m.set_free_inodes_count(h.aux % (sb.inodes_count().saturating_add(1)).max(1));
    m.set_state(h.param);
    m.set_mnt_count(h.param.rotate_left(3));
    m.set_mtime(h.block);
    m.set_wtime(h.block.rotate_left(17));
    m.set_kbytes_written(h.block ^ 0x5555);
    m.set_last_orphan(h.ino);
    m.set_last_mounted(&rest[..rest.len().min(80)]);
    let mb = m.to_bytes();
    let back = Superblock::parse(&mb).expect("setters must keep a superblock valid");
    assert_eq!(back.free_blocks_count(), m.free_blocks_count());
    assert_eq!(back.free_inodes_count(), m.free_inodes_count());
    assert_eq!(back.last_orphan(), h.ino);
}

fn exercise_superblock(sb: &Superblock, probe: u32) {
    let groups = sb.group_count();
    assert!(groups > 0);
    let _ = sb.gdt_blocks();
    let _ = sb.csum_seed();
    let _ = sb.volume_name();
    let _ = sb.hash_seed();
    let _ = sb.desc_size();
    let _ = sb.uuid();
    for v in 0..=6u8 {
        let _ = sb.effective_hash_version(v);
    }
    for kind in [
        FeatureKind::Compat,
        FeatureKind::Incompat,
        FeatureKind::RoCompat,
    ] {
        let _ = commitfs_format::superblock::feature_names(kind, probe);
    }
    let _ = commitfs_format::superblock::feature_names(FeatureKind::Compat, sb.feature_compat());
    let _ =
        commitfs_format::superblock::feature_names(FeatureKind::Incompat, sb.feature_incompat());
    let _ =
        commitfs_format::superblock::feature_names(FeatureKind::RoCompat, sb.feature_ro_compat());
    let check = groups.min(64);
    for g in (0..check).chain([groups - 1, probe % groups]) {
        let _ = sb.group_has_super(g);
        let first = sb.group_first_block(g);
        let n = sb.blocks_in_group(g);
        assert!(n as u64 <= sb.blocks_per_group() as u64);
        assert!(first >= sb.first_data_block() as u64);
    }
    if check == groups {
        let total: u64 = (0..groups).map(|g| sb.blocks_in_group(g) as u64).sum();
        assert_eq!(
            total,
            sb.blocks_count() - sb.first_data_block() as u64,
            "groups must cover the block range"
        );
    }
}

// ---------------------------------------------------------------------------------
// Group descriptors and bitmaps
// ---------------------------------------------------------------------------------

/// Group descriptor (mode 0) or bitmap (mode 1).
///
/// Descriptor: parse any length; verify the checksum of `desc_size`-sized ones;
/// an accepted descriptor serialises (fresh checksum, which then verifies) and parses
/// back to the same fields. Bitmap: `param` bits; the bit helpers agree with a naive
/// scan and never index out of range.
pub fn group_desc(data: &[u8]) {
    let (h, rest) = Header::split(data);
    if h.mode() & 1 == 1 {
        bitmaps(&h, rest);
        return;
    }
    let csum = h.csum();
    let group = h.ino;
    let (mut raw, trusted) = h.cut(rest, &DESC_SIZES);
    let _ = GroupDesc::parse(&raw, group, h.block);
    if !trusted {
        return;
    }
    if h.fix_csum() {
        let c = group_desc::compute_checksum(&raw, group, &csum);
        raw[0x1E..0x20].copy_from_slice(&c.to_le_bytes());
    }
    let verified = group_desc::verify(&raw, group, &csum, h.block).is_ok();
    let Ok(gd) = GroupDesc::parse(&raw, group, h.block) else {
        return;
    };
    let _ = gd.has_flag(group_desc::BG_INODE_UNINIT);
    let mut out = raw.clone();
    gd.serialize(&mut out, group, &csum);
    if csum.enabled {
        group_desc::verify(&out, group, &csum, h.block)
            .expect("a freshly serialised descriptor must verify");
    } else {
        assert_eq!(out, raw, "serialise must keep a descriptor's bytes");
    }
    if verified {
        assert_eq!(
            out, raw,
            "a verified descriptor must serialise to its own bytes"
        );
    }
    let back = GroupDesc::parse(&out, group, h.block).expect("re-parse of a descriptor");
    assert_eq!(
        GroupDesc {
            checksum: gd.checksum,
            ..back
        },
        gd
    );

    // A descriptor made of fields taken from the input round-trips too (high halves
    // only exist in 64-byte and larger descriptors).
    let mut s = Stream::new(rest);
    let big = raw.len() >= 64;
    let m32 = |v: u64| if big { v } else { v & 0xFFFF_FFFF };
    let m16 = |v: u32| if big { v } else { v & 0xFFFF };
    let made = GroupDesc {
        block_bitmap: m32(s.next()),
        inode_bitmap: m32(s.next()),
        inode_table: m32(s.next()),
        free_blocks_count: m16(s.next() as u32),
        free_inodes_count: m16(s.next() as u32),
        used_dirs_count: m16(s.next() as u32),
        flags: s.next() as u16,
        exclude_bitmap: m32(s.next()),
        block_bitmap_csum: m16(s.next() as u32),
        inode_bitmap_csum: m16(s.next() as u32),
        itable_unused: m16(s.next() as u32),
        checksum: 0,
    };
    let mut buf = vec![0u8; raw.len()];
    made.serialize(&mut buf, group, &csum);
    let back = GroupDesc::parse(&buf, group, h.block).expect("parse of a made descriptor");
    assert_eq!(
        GroupDesc {
            checksum: 0,
            ..back
        },
        made
    );
}

fn bitmaps(h: &Header, rest: &[u8]) {
    let csum = h.csum();
    let b = rest;
    let nbits = b.len() * 8;
    let bits = if nbits == 0 {
        0
    } else {
        h.param as usize % (nbits + 1)
    };
    let _ = bitmap::checksum(b, h.param as u32, &csum);
    let _ = bitmap::checksum(b, bits as u32, &csum);
    let zeros = bitmap::count_zeros(b, bits);
    let naive = (0..bits).filter(|&n| !bitmap::test_bit(b, n)).count();
    assert_eq!(zeros, naive, "count_zeros disagrees with test_bit");
    if bits == 0 {
        return;
    }
    let start = h.probe as usize % bits;
    let found = bitmap::find_zero(b, start, bits);
    let naive = (start..bits).find(|&n| !bitmap::test_bit(b, n));
    assert_eq!(found, naive, "find_zero disagrees with test_bit");
    let max = h.aux as usize % (bits + 1);
    let run = bitmap::zero_run(b, start, bits, max);
    let naive = (start..bits.min(start + max))
        .take_while(|&n| !bitmap::test_bit(b, n))
        .count();
    assert_eq!(run, naive, "zero_run disagrees with test_bit");
    let mut m = b.to_vec();
    bitmap::set_padding(&mut m, bits);
    assert_eq!(bitmap::count_zeros(&m, nbits), bitmap::count_zeros(b, bits));
}

// ---------------------------------------------------------------------------------
// Inodes
// ---------------------------------------------------------------------------------

/// Store a fresh checksum into an inode record the way `Inode::serialize` does.
fn fix_inode_csum(b: &mut [u8], ino: u32, csum: &CsumCtx) {
    let generation = u32::from_le_bytes([b[0x64], b[0x65], b[0x66], b[0x67]]);
    let c = inode::compute_checksum(b, ino, generation, csum);
    b[0x7C..0x7E].copy_from_slice(&(c as u16).to_le_bytes());
    if b.len() > 128 && u16::from_le_bytes([b[0x80], b[0x81]]) >= 4 {
        b[0x82..0x84].copy_from_slice(&((c >> 16) as u16).to_le_bytes());
    }
}

/// Inode record: parse (checksum fixed first with [`FLAG_FIX_CSUM`]); an accepted
/// inode serialises and re-parses equal; its extent root, in-inode xattrs and
/// accessors are exercised. A record built from input values normalises in one
/// serialise/parse round.
pub fn inode(data: &[u8]) {
    let (h, rest) = Header::split(data);
    let csum = h.csum();
    let ino = h.ino;
    let (mut raw, trusted) = h.cut(rest, &INODE_SIZES);
    if !trusted {
        // Record sizes other than a power of two >= 128 cannot come from a validated
        // superblock; only the too-short case is a parser input.
        if raw.len() < 128 {
            let _ = Inode::parse(&raw, ino, &csum, h.block);
        }
        return;
    }
    if h.fix_csum() && csum.enabled {
        fix_inode_csum(&mut raw, ino, &csum);
    }
    if let Ok(i) = Inode::parse(&raw, ino, &csum, h.block) {
        exercise_inode(&i, ino, h.probe);
        let mut out = vec![0u8; raw.len()];
        i.serialize(&mut out, ino, &csum);
        let back = Inode::parse(&out, ino, &csum, h.block).expect("re-parse of an inode");
        assert_eq!(back, i, "inode round trip");
    }

    // An inode made from input values: the first round normalises, the second must
    // be a fixpoint.
    let mut s = Stream::new(rest);
    let isz = raw.len();
    let extra_isize = if isz > 128 {
        ((s.below(isz - 128 + 1)) & !3) as u16
    } else {
        0
    };
    let end = 128 + extra_isize as usize;
    let modelled_end = 0xA0.min(end).max(128);
    let ts = |s: &mut Stream| Timestamp::decode(s.next() as u32, Some(s.next() as u32));
    let made = Inode {
        mode: s.next() as u16,
        uid: s.next() as u32,
        gid: s.next() as u32,
        size: s.next(),
        atime: ts(&mut s),
        ctime: ts(&mut s),
        mtime: ts(&mut s),
        crtime: ts(&mut s),
        dtime: s.next() as u32,
        links_count: s.next() as u16,
        blocks_raw: s.next() & 0xFFFF_FFFF_FFFF,
        flags: s.next() as u32,
        version: s.next(),
        block: {
            let mut b = [0u8; 60];
            for x in b.iter_mut() {
                *x = s.next() as u8;
            }
            b
        },
        generation: s.next() as u32,
        file_acl: s.next() & 0xFFFF_FFFF_FFFF,
        faddr: s.next() as u32,
        extra_isize,
        projid: s.next() as u32,
        extra_fields: (modelled_end..end).map(|_| s.next() as u8).collect(),
        xattr_area: (end..isz)
            .map(|at| {
                // With i_extra_isize 0 the area starts at i_extra_isize itself, which
                // a parsed inode always has as zero.
                if at < 0x82 {
                    0
                } else {
                    s.next() as u8
                }
            })
            .collect(),
    };
    let mut b1 = vec![0u8; isz];
    made.serialize(&mut b1, ino, &csum);
    let i1 = Inode::parse(&b1, ino, &csum, 0).expect("parse of a serialised inode");
    let mut b2 = vec![0u8; isz];
    i1.serialize(&mut b2, ino, &csum);
    let i2 = Inode::parse(&b2, ino, &csum, 0).expect("parse of a re-serialised inode");
    assert_eq!(i1, i2, "inode serialise/parse is not a fixpoint");
    assert_eq!(b1, b2, "inode serialisation is not stable");
}

fn exercise_inode(i: &Inode, ino: u32, probe: u32) {
    let _ = i.file_type();
    let _ = (i.is_dir(), i.is_reg(), i.is_symlink(), i.is_fast_symlink());
    for bs in BLOCK_SIZES {
        let _ = i.blocks_512(bs);
    }
    let _ = i.rdev();
    let _ = inode::file_type_of_mode(i.mode);
    if let Ok(node) = NodeRef::parse_root(&i.block, ino) {
        exercise_node(&node, probe);
        round_trip_root(&node, ino);
    }
    ibody_round_trip(&i.xattr_area);
    let mut m = i.clone();
    m.set_rdev(probe);
    let _ = m.rdev();
    m.set_blocks_512(i.blocks_raw.wrapping_mul(probe as u64 | 1), 4096);
    let _ = m.blocks_512(4096);
}

// ---------------------------------------------------------------------------------
// Extent nodes
// ---------------------------------------------------------------------------------

fn exercise_node(node: &NodeRef<'_>, probe: u32) {
    let n = node.len();
    assert_eq!(node.is_empty(), n == 0);
    for i in 0..n + 1 {
        let _ = node.extent(i);
        let _ = node.index(i);
        let _ = node.entry_lblk(i);
    }
    let mut prev_end = 0u64;
    for e in node.extents() {
        assert!(e.len > 0);
        assert!(e.lblk as u64 >= prev_end, "extents out of order");
        prev_end = e.end();
        let _ = e.map(e.lblk);
        let _ = e.map(probe);
    }
    for probe in [0, probe, u32::MAX, probe.wrapping_add(1)] {
        if let Some(i) = node.search(probe) {
            let start = node.entry_lblk(i).expect("search returns a valid slot");
            assert!(start <= probe);
            if let Some(next) = node.entry_lblk(i + 1) {
                assert!(next > probe);
            }
        } else if let Some(first) = node.entry_lblk(0) {
            assert!(first > probe);
        }
    }
    let owned = node.to_node();
    assert_eq!(owned.len(), n);
    assert_eq!(owned.is_leaf(), node.is_leaf());
    let _ = owned.first_lblk();
}

fn round_trip_root(node: &NodeRef<'_>, ino: u32) {
    let owned = node.to_node();
    owned
        .validate_root(ino)
        .expect("an accepted root must validate");
    let mut out = [0u8; extent::ROOT_LEN];
    owned
        .write_root(&mut out, ino)
        .expect("an accepted root must serialise");
    let back = NodeRef::parse_root(&out, ino).expect("re-parse of a root");
    assert_eq!(back.to_node(), owned, "extent root round trip");
}

/// Extent nodes. Mode bit 0: the 60-byte inode root instead of a tree block. Mode
/// bit 1: `param` is the depth the parent implies. An accepted node serialises and
/// re-parses equal (tree blocks with a fresh checksum). A node built from input values
/// that validates is written, then bytes of it are flipped and re-parsed.
pub fn extent(data: &[u8]) {
    let (h, rest) = Header::split(data);
    let csum = h.csum();
    let (ino, gen) = (h.ino, h.generation);
    if h.mode() & 1 == 1 {
        let _ = NodeRef::parse_root(rest, ino);
        let mut root = [0u8; extent::ROOT_LEN];
        let n = rest.len().min(extent::ROOT_LEN);
        root[..n].copy_from_slice(&rest[..n]);
        if let Ok(node) = NodeRef::parse_root(&root, ino) {
            exercise_node(&node, h.probe);
            round_trip_root(&node, ino);
        }
        return;
    }
    let expect = (h.mode() & 2 != 0).then_some(h.param % 8);
    let (mut raw, trusted) = h.cut(rest, &BLOCK_SIZES);
    if h.fix_csum() && csum.enabled && raw.len() >= extent::HEADER_LEN + 16 {
        let cap = extent::block_capacity(raw.len());
        let max = u16::from_le_bytes([raw[4], raw[5]]);
        let max = if max == 0 || max > cap { cap } else { max };
        let off = extent::tail_offset(max);
        let c = extent::block_checksum(csum.inode_seed(ino, gen), &raw, max);
        raw[off..off + 4].copy_from_slice(&c.to_le_bytes());
    }
    if let Ok(node) = NodeRef::parse_block(&raw, h.block, expect, &csum, ino, gen) {
        exercise_node(&node, h.probe);
        let owned = node.to_node();
        let mut out = vec![0u8; raw.len()];
        owned
            .write_block(&mut out, h.block, &csum, ino, gen)
            .expect("an accepted extent block must serialise");
        let back = NodeRef::parse_block(&out, h.block, Some(owned.depth), &csum, ino, gen)
            .expect("re-parse of an extent block");
        assert_eq!(back.to_node(), owned, "extent block round trip");
    }
    if !trusted {
        return;
    }

    // Structure-aware: a node from input values; if it validates, write it, flip
    // bytes, parse again (must not panic).
    let mut s = Stream::new(rest);
    let cap = extent::block_capacity(raw.len()) as usize;
    let n = s.below(cap + 2);
    let depth = (s.below(3)) as u16;
    let mut lblk = s.below(64) as u64;
    let node = if depth == 0 {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let unwritten = s.next() & 1 == 1;
            let len = 1 + s.below(extent::max_len(unwritten) as usize) as u32;
            if lblk + len as u64 > extent::LBLK_SPACE_END {
                break;
            }
            v.push(Extent {
                lblk: lblk as u32,
                len,
                pblk: s.next() % (1 << 40),
                unwritten,
            });
            lblk += len as u64 + s.below(3) as u64;
        }
        ExtentNode::leaf(v)
    } else {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n.max(1) {
            if lblk >= extent::LBLK_SPACE_END {
                break;
            }
            v.push(ExtentIdx {
                lblk: lblk as u32,
                child: 1 + s.next() % (1 << 40),
            });
            lblk += 1 + s.below(1000) as u64;
        }
        ExtentNode::index(depth, v)
    };
    let mut out = vec![0u8; raw.len()];
    let written = node.write_block(&mut out, h.block, &csum, ino, gen).is_ok();
    assert_eq!(
        written,
        node.validate_block(h.block, raw.len()).is_ok(),
        "write_block and validate_block disagree"
    );
    if !written {
        return;
    }
    let back = NodeRef::parse_block(&out, h.block, Some(depth), &csum, ino, gen)
        .expect("parse of a written extent block");
    assert_eq!(back.to_node(), node);
    if let Entries::Leaf(v) = &node.entries {
        for e in v {
            let i = back.search(e.lblk).expect("search finds a written extent");
            assert_eq!(back.extent(i), Some(*e));
        }
    }
    let flips = 1 + s.below(8);
    for _ in 0..flips {
        let at = s.below(out.len());
        out[at] ^= 1 << s.below(8);
    }
    if let Ok(node) = NodeRef::parse_block(&out, h.block, None, &csum, ino, gen) {
        exercise_node(&node, h.probe);
    }
}

// ---------------------------------------------------------------------------------
// Directory leaves and htree blocks
// ---------------------------------------------------------------------------------

/// Directory blocks. Mode bit 0 clear: linear leaf; set: htree root/node (dx). Mode
/// bit 1: `largedir`. `aux` is `s_inodes_count` (0 = unchecked); the checksum seed is
/// the inode seed of directory `ino`/`generation`.
pub fn dir(data: &[u8]) {
    let (h, rest) = Header::split(data);
    if h.mode() & 1 == 1 {
        dx_block(&h, rest);
    } else {
        dir_leaf(&h, rest);
    }
}

fn dir_leaf(h: &Header, rest: &[u8]) {
    let csum = h.csum();
    let seed = csum.inode_seed(h.ino, h.generation);
    let (mut block, trusted) = h.cut(rest, &BLOCK_SIZES);
    let bs = if trusted {
        block.len()
    } else {
        BLOCK_SIZES[h.param as usize % BLOCK_SIZES.len()]
    };
    let geo = LeafGeometry {
        block_size: bs,
        csum: csum.enabled,
        inodes_count: h.aux,
    };
    if h.fix_csum() && trusted && csum.enabled && dirent::tail_fields_ok(&block) {
        dirent::set_leaf_csum(&mut block, seed);
    }
    let blk = h.block;
    // Walks (any length: the iterator checks it).
    let mut names: Vec<Vec<u8>> = Vec::new();
    let mut walked = 0usize;
    for e in dirent::iter(&block, geo, blk) {
        let Ok(e) = e else { break };
        assert!(e.offset + e.rec_len <= geo.usable());
        assert!(e.rec_len >= e.used_len());
        walked += 1;
        if e.inode != 0 {
            names.push(e.name.to_vec());
        }
    }
    let valid = dirent::validate(&block, geo, blk).is_ok();
    let _ = dirent::has_tail(&block, bs);
    let _ = dirent::tail_fields_ok(&block);
    if csum.enabled && trusted {
        let _ = dirent::verify_leaf_csum(&block, seed, blk);
    }
    let name_len = h.probe as usize % 300;
    let _ = dirent::has_room(&block, geo, blk, name_len);
    let _ = dirent::used_bytes(&block, geo, blk);
    if !valid {
        // Mutators must refuse a corrupt block cleanly.
        let mut m = block.clone();
        let _ = dirent::insert(&mut m, geo, blk, b"fuzz", 11, 1);
        let mut m = block.clone();
        let _ = dirent::remove(&mut m, geo, blk, b"fuzz");
        let mut m = block.clone();
        let _ = dirent::remove_at(&mut m, geo, blk, 0, h.probe as usize % (bs + 16));
        return;
    }
    assert!(walked > 0 || geo.usable() == 0);
    // Every live name is found.
    for n in names.iter().take(16) {
        let e = dirent::find(&block, geo, blk, n)
            .expect("find on a valid block")
            .expect("a walked name must be found");
        assert_eq!(e.name, &n[..]);
    }
    // Pack the live entries into a fresh leaf: same entries back.
    let mut live = Vec::new();
    dirent::collect_live(&block, geo, blk, &mut live).expect("collect_live on a valid block");
    let mut packed = vec![0u8; bs];
    dirent::pack(
        &mut packed,
        geo,
        blk,
        live.iter().map(|e| (e.inode, e.file_type, &e.name[..])),
    )
    .expect("the live entries of a valid block fit in one block");
    dirent::validate(&packed, geo, blk).expect("a packed block must validate");
    let mut again = Vec::new();
    dirent::collect_live(&packed, geo, blk, &mut again).expect("collect_live on packed");
    assert_eq!(again, live, "pack round trip");
    if csum.enabled {
        assert!(dirent::has_tail(&packed, bs), "pack must write the tail");
        dirent::set_leaf_csum(&mut packed, seed);
        dirent::verify_leaf_csum(&packed, seed, blk).expect("fresh leaf checksum verifies");
    }
    let used = dirent::used_bytes(&block, geo, blk).expect("used_bytes on a valid block");
    assert!(used <= geo.usable());

    // Insert a name that is not there yet: has_room and insert agree, the result is
    // valid and the name is found.
    let mut s = Stream::new(rest);
    let nlen = 1 + s.below(255);
    let name: Vec<u8> = (0..nlen).map(|_| b'a' + (s.below(26) as u8)).collect();
    if dirent::find(&block, geo, blk, &name)
        .expect("find")
        .is_none()
    {
        let ino = if h.aux == 0 {
            1 + s.below(1 << 20) as u32
        } else {
            1 + s.below(h.aux as usize) as u32
        };
        let room = dirent::has_room(&block, geo, blk, nlen).expect("has_room");
        let mut m = block.clone();
        let r = dirent::insert(&mut m, geo, blk, &name, ino, dirent::FT_REG_FILE)
            .expect("insert into a valid block");
        assert_eq!(r.is_some(), room, "insert and has_room disagree");
        if r.is_some() {
            dirent::validate(&m, geo, blk).expect("block valid after insert");
            let e = dirent::find(&m, geo, blk, &name)
                .expect("find")
                .expect("inserted name is found");
            assert_eq!(e.inode, ino);
            // And remove it again.
            let got = dirent::remove(&mut m, geo, blk, &name).expect("remove");
            assert_eq!(got, Some(ino));
            dirent::validate(&m, geo, blk).expect("block valid after remove");
            assert!(dirent::find(&m, geo, blk, &name).expect("find").is_none());
        }
    }
    // Remove an existing name.
    if let Some(n) = names.get(s.below(names.len().max(1))) {
        let mut m = block.clone();
        let before = names.iter().filter(|x| *x == n).count();
        let got = dirent::remove(&mut m, geo, blk, n).expect("remove on a valid block");
        assert!(got.is_some());
        dirent::validate(&m, geo, blk).expect("block valid after remove");
        if before == 1 {
            assert!(dirent::find(&m, geo, blk, n).expect("find").is_none());
        }
    }
    // remove_at / set_entry_inode at arbitrary offsets: errors, not panics.
    let mut m = block.clone();
    if dirent::remove_at(&mut m, geo, blk, 0, s.below(bs + 16)).is_ok() {
        dirent::validate(&m, geo, blk).expect("block valid after remove_at");
    }
    let mut m = block.clone();
    let _ = dirent::set_entry_inode(&mut m, geo, blk, s.below(bs + 16), 5, 2);
}

fn dx_block(h: &Header, rest: &[u8]) {
    let csum = h.csum();
    let seed = csum.inode_seed(h.ino, h.generation);
    let geo_bs = |bs: usize| DxGeometry {
        block_size: bs,
        csum: csum.enabled,
        largedir: h.mode() & 2 != 0,
    };
    let (mut block, trusted) = h.cut(rest, &BLOCK_SIZES);
    let blk = h.block;
    // Any length.
    let bs_guess = BLOCK_SIZES[h.param as usize % BLOCK_SIZES.len()];
    let _ = dx::count_offset(&block, bs_guess);
    let _ = dx::parse_root(&block, &geo_bs(bs_guess), blk);
    let _ = dx::parse_node(&block, &geo_bs(bs_guess), blk);
    for co in [dx::ROOT_COUNT_OFFSET, dx::NODE_COUNT_OFFSET] {
        let _ = dx::verify_csum(&block, co, seed, blk);
    }
    let name_len = (h.probe as usize) % 256;
    let name = &rest[..rest.len().min(name_len)];
    for v in 0..=6u8 {
        let _ = dirhash::dx_hash(name, v, &[h.fs_seed, h.ino, h.generation, h.aux]);
        let _ = dirhash::effective_version(v, h.param & 1 == 1);
    }
    if !trusted {
        return;
    }
    let bs = block.len();
    let geo = geo_bs(bs);
    if h.fix_csum() && csum.enabled {
        if let Some(co) = dx::count_offset(&block, bs) {
            let _ = dx::set_csum(&mut block, co, seed);
        }
    }
    let co = dx::count_offset(&block, bs);
    if let Some(co) = co {
        let _ = dx::verify_csum(&block, co, seed, blk);
    }
    if let Ok(root) = dx::parse_root(&block, &geo, blk) {
        assert!(!root.entries.is_empty() && root.entries.len() <= geo.root_limit());
        assert_eq!(root.entries[0].hash, 0);
        exercise_dx_entries(&root.entries, h.probe);
        let mut out = vec![0u8; bs];
        dx::write_root(&mut out, &geo, &root).expect("an accepted root must serialise");
        assert_eq!(dx::count_offset(&out, bs), Some(dx::ROOT_COUNT_OFFSET));
        if csum.enabled {
            dx::set_csum(&mut out, dx::ROOT_COUNT_OFFSET, seed).expect("set_csum on a root");
            dx::verify_csum(&out, dx::ROOT_COUNT_OFFSET, seed, blk)
                .expect("fresh root checksum verifies");
        }
        let back = dx::parse_root(&out, &geo, blk).expect("re-parse of a root");
        assert_eq!(back, root, "dx root round trip");
    }
    if let Ok(node) = dx::parse_node(&block, &geo, blk) {
        assert!(!node.entries.is_empty() && node.entries.len() <= geo.node_limit());
        exercise_dx_entries(&node.entries, h.probe);
        let mut out = vec![0u8; bs];
        dx::write_node(&mut out, &geo, &node).expect("an accepted node must serialise");
        assert_eq!(dx::count_offset(&out, bs), Some(dx::NODE_COUNT_OFFSET));
        if csum.enabled {
            dx::set_csum(&mut out, dx::NODE_COUNT_OFFSET, seed).expect("set_csum on a node");
            dx::verify_csum(&out, dx::NODE_COUNT_OFFSET, seed, blk)
                .expect("fresh node checksum verifies");
        }
        let back = dx::parse_node(&out, &geo, blk).expect("re-parse of a node");
        assert_eq!(back, node, "dx node round trip");
    }
}

fn exercise_dx_entries(entries: &[dx::DxEntry], probe: u32) {
    for hash in [
        0,
        probe,
        probe | 1,
        u32::MAX,
        entries[entries.len() - 1].hash,
    ] {
        // Entries are only ordered ignoring the continuation bit, so all lookup
        // promises on any accepted array is an index in range.
        let i = dx::lookup(entries, hash);
        assert!(i < entries.len());
        let _ = dx::continues_into(entries, i, hash);
        let (lo, _hi) = dx::entry_range(entries, i, 0, u32::MAX);
        let _ = lo;
    }
}

// ---------------------------------------------------------------------------------
// Extended attributes
// ---------------------------------------------------------------------------------

fn has_duplicates(v: &[Xattr]) -> bool {
    v.iter().enumerate().any(|(i, a)| {
        v[i + 1..]
            .iter()
            .any(|b| a.index == b.index && a.name == b.name)
    })
}

/// In-inode area round trip: parse, write back into an area of the same size (no
/// room problem is possible for what parsed), re-parse equal (order kept).
fn ibody_round_trip(area: &[u8]) {
    let _ = xattr::ibody_has_magic(area);
    let Ok(v) = xattr::parse_ibody(area, 0) else {
        return;
    };
    exercise_xattrs(&v);
    let mut out = vec![0u8; area.len()];
    match xattr::write_ibody(&v, &mut out) {
        Ok(()) => {
            let back = xattr::parse_ibody(&out, 0).expect("re-parse of in-inode xattrs");
            assert_eq!(back, v, "in-inode xattr round trip");
        }
        Err(WriteError::Duplicate) => assert!(has_duplicates(&v)),
        Err(e) => panic!("parsed in-inode xattrs cannot be written back: {e:?}"),
    }
}

fn exercise_xattrs(v: &[Xattr]) {
    for x in v {
        let _ = x.entry_len();
        let _ = x.value_len();
        let _ = x.hash();
        let _ = x.sort_key();
        let _ = xattr::entry_hash_signed(&x.name, &x.value);
        if let Some(full) = x.full_name() {
            assert!(x.has_full_name(&full));
            if let Ok(y) = Xattr::new(&full, x.value.clone()) {
                // Exact names (ACLs) and prefixed names map back to one index.
                assert_eq!(y.full_name(), Some(full.clone()));
            }
        }
        if x.index == xattr::index::POSIX_ACL_ACCESS || x.index == xattr::index::POSIX_ACL_DEFAULT {
            acl_round_trip(&x.value);
        }
    }
    let _ = xattr::block_hash(v.iter().map(|x| x.hash()));
    let _ = xattr::ibody_space(v);
    let _ = xattr::block_space(v);
}

fn acl_round_trip(disk: &[u8]) {
    if let Some(vfs) = xattr::acl::from_disk(disk) {
        if let Some(d2) = xattr::acl::to_disk(&vfs) {
            assert_eq!(d2, disk, "ACL disk -> vfs -> disk round trip");
        }
    }
    if let Some(d) = xattr::acl::to_disk(disk) {
        let vfs = xattr::acl::from_disk(&d).expect("a converted ACL must convert back");
        assert_eq!(xattr::acl::to_disk(&vfs), Some(d));
    }
}

/// Xattrs. Mode bit 0 clear: xattr block at `block` (checksum fixed first with
/// [`FLAG_FIX_CSUM`]); set: in-inode area of the raw length. An accepted block
/// rewrites (sorted, fresh hashes and checksum) and re-parses to the same set. Also
/// name splitting and ACL conversion on the raw bytes.
pub fn xattr(data: &[u8]) {
    let (h, rest) = Header::split(data);
    let csum = h.csum();
    acl_round_trip(rest);
    let nlen = (h.probe as usize) % 300;
    let name = &rest[..rest.len().min(nlen)];
    if let Ok((idx, suffix)) = xattr::split_name(name) {
        assert_eq!(xattr::full_name(idx, suffix).as_deref(), Some(name));
    }
    if h.mode() & 1 == 1 {
        let len = rest.len().min(h.param as usize);
        ibody_round_trip(&rest[..len]);
        return;
    }
    let (mut buf, _) = h.cut(rest, &BLOCK_SIZES);
    let blk = h.block;
    if h.fix_csum() {
        xattr::update_block_checksum(&mut buf, blk, &csum);
    }
    let _ = xattr::block_refcount(&buf);
    let _ = xattr::block_entry_hashes(&buf, blk);
    let Ok(xb) = xattr::parse_block(&buf, blk, &csum) else {
        return;
    };
    exercise_xattrs(&xb.entries);
    let hashes = xattr::block_entry_hashes(&buf, blk).expect("hashes of an accepted block");
    assert_eq!(hashes.len(), xb.entries.len());
    let mut out = vec![0u8; buf.len()];
    match xattr::write_block(&xb.entries, xb.refcount, blk, &csum, &mut out) {
        Ok(()) => {
            let back = xattr::parse_block(&out, blk, &csum).expect("re-parse of an xattr block");
            assert_eq!(back.refcount, xb.refcount);
            let mut want = xb.entries.clone();
            want.sort_by(|a, b| a.sort_key().cmp(&b.sort_key()));
            assert_eq!(back.entries, want, "xattr block round trip");
            let stored = xattr::block_entry_hashes(&out, blk).expect("hashes");
            let fresh: Vec<u32> = want.iter().map(|x| x.hash()).collect();
            assert_eq!(stored, fresh);
            assert_eq!(back.hash, xattr::block_hash(fresh));
            // Refcount changes keep the block valid.
            let mut m = out.clone();
            xattr::set_block_refcount(&mut m, h.aux, blk, &csum);
            let r = xattr::parse_block(&m, blk, &csum).expect("after set_block_refcount");
            assert_eq!(r.refcount, h.aux);
        }
        Err(WriteError::Duplicate) => assert!(has_duplicates(&xb.entries)),
        Err(e) => panic!("an accepted xattr block cannot be written back: {e:?}"),
    }
}

// ---------------------------------------------------------------------------------
// JBD2 journal superblock and log blocks
// ---------------------------------------------------------------------------------

/// JBD2 structures (big-endian). Mode 0: journal superblock (checksum fixed first
/// with [`FLAG_FIX_CSUM`]). Modes 1/2/3: descriptor / commit / revoke block of a log
/// whose incompat word is `aux` and checksum seed `fs_seed`, transaction `generation`.
/// Accepted log blocks rebuild with the builders and parse back to the same contents.
/// Mode bit 2: the fast-commit area (little-endian TLVs, see [`fast_commit`]).
pub fn jbd2(data: &[u8]) {
    let (h, rest) = Header::split(data);
    let _ = jbd2_log::parse_header(rest);
    let _ = jbd2_log::needs_escape(rest);
    if h.mode() & 4 != 0 {
        fast_commit(&h, rest);
        return;
    }
    match h.mode() & 3 {
        0 => journal_superblock(&h, rest),
        mode => {
            let (mut b, trusted) = h.cut(rest, &BLOCK_SIZES);
            let bs = if trusted {
                b.len()
            } else {
                BLOCK_SIZES[h.param as usize % BLOCK_SIZES.len()]
            };
            let f = LogFormat {
                block_size: bs,
                incompat: h.aux,
                seed: h.fs_seed,
            };
            let _ = (
                f.tag_bytes(),
                f.tags_per_descriptor(),
                f.revokes_per_block(),
            );
            let _ = jbd2_log::data_checksum(&f, h.generation, rest);
            if h.fix_csum() && trusted && f.has_csum() {
                fix_log_csum(&mut b, &f, mode);
            }
            match mode {
                1 => log_descriptor(&h, &f, &b, trusted),
                2 => log_commit(&h, &f, &b),
                _ => log_revoke(&h, &f, &b),
            }
        }
    }
}

fn journal_superblock(h: &Header, rest: &[u8]) {
    let _ = JournalSuperblock::parse(rest, h.block);
    let mut raw = [0u8; jbd2::SUPERBLOCK_SIZE];
    let n = rest.len().min(raw.len());
    raw[..n].copy_from_slice(&rest[..n]);
    if h.fix_csum() {
        let c = jbd2::compute_checksum(&raw);
        raw[jbd2::S_CHECKSUM..jbd2::S_CHECKSUM + 4].copy_from_slice(&c.to_be_bytes());
    }
    if let Ok(jsb) = JournalSuperblock::parse(&raw, h.block) {
        assert!(jsb.first > 0 && jsb.first < jsb.maxlen);
        assert!(jsb.start == 0 || (jsb.first..jsb.maxlen).contains(&jsb.start));
        let _ = (jsb.has_csum_v2or3(), jsb.has_live_log());
        let _ = (jsb.fc_blocks(false), jsb.fc_blocks(true));
        let _ = (
            jsb.compat_names(),
            jsb.incompat_names(),
            jsb.ro_compat_names(),
        );
    }
}

/// Store a fresh tail / commit checksum the way the builders do.
fn fix_log_csum(b: &mut [u8], f: &LogFormat, mode: u8) {
    let n = b.len();
    if mode == 2 {
        if n >= 0x14 {
            b[0x10..0x14].fill(0);
            let c = commitfs_format::crc32c_raw(f.seed, b);
            b[0x10..0x14].copy_from_slice(&c.to_be_bytes());
        }
    } else if n >= 4 {
        b[n - 4..].fill(0);
        let c = commitfs_format::crc32c_raw(f.seed, b);
        b[n - 4..].copy_from_slice(&c.to_be_bytes());
    }
}

/// What a tag keeps through build/parse: 32-bit block numbers without 64bit, the
/// checksum width of the format, ESCAPE/DELETED flags.
fn norm_tag(f: &LogFormat, t: &Tag) -> Tag {
    Tag {
        blocknr: if f.is_64bit() {
            t.blocknr
        } else {
            t.blocknr & 0xFFFF_FFFF
        },
        flags: t.flags & (jbd2_log::TAG_ESCAPE | jbd2_log::TAG_DELETED),
        checksum: if f.csum_v3() {
            t.checksum
        } else if f.csum_v2() {
            t.checksum & 0xFFFF
        } else {
            0
        },
    }
}

fn log_descriptor(h: &Header, f: &LogFormat, b: &[u8], trusted: bool) {
    let r = jbd2_log::parse_descriptor(b, f, h.block);
    if trusted {
        let _ = jbd2_log::verify_tail(b, f);
    }
    let Ok(tags) = r else { return };
    let max = f.tags_per_descriptor();
    if tags.is_empty() || max == 0 {
        return;
    }
    let tags: Vec<Tag> = tags.iter().take(max).map(|t| norm_tag(f, t)).collect();
    let built = jbd2_log::build_descriptor(f, h.generation, &tags);
    assert_eq!(built.len(), f.block_size);
    assert!(
        jbd2_log::verify_tail(&built, f),
        "fresh descriptor tail verifies"
    );
    assert_eq!(
        jbd2_log::parse_header(&built),
        Some((jbd2::BLOCKTYPE_DESCRIPTOR, h.generation))
    );
    let back = jbd2_log::parse_descriptor(&built, f, h.block).expect("re-parse of a descriptor");
    let back: Vec<Tag> = back.iter().map(|t| norm_tag(f, t)).collect();
    assert_eq!(back, tags, "descriptor round trip");
}

fn log_commit(h: &Header, f: &LogFormat, b: &[u8]) {
    let Some(c) = jbd2_log::parse_commit(b, f) else {
        return;
    };
    let built = jbd2_log::build_commit(f, h.generation, c.sec, c.nsec);
    let back = jbd2_log::parse_commit(&built, f).expect("re-parse of a commit block");
    assert!(back.checksum_ok, "fresh commit checksum verifies");
    assert_eq!((back.sec, back.nsec), (c.sec, c.nsec), "commit round trip");
}

fn log_revoke(h: &Header, f: &LogFormat, b: &[u8]) {
    let Ok(v) = jbd2_log::parse_revoke(b, f, h.block) else {
        return;
    };
    let _ = jbd2_log::verify_tail(b, f);
    let per = f.revokes_per_block();
    if v.is_empty() || per == 0 {
        return;
    }
    let v: Vec<u64> = v.into_iter().take(per).collect();
    let blocks = jbd2_log::build_revokes(f, h.generation, &v);
    assert_eq!(blocks.len(), 1, "{} records fit one revoke block", v.len());
    assert!(
        jbd2_log::verify_tail(&blocks[0], f),
        "fresh revoke tail verifies"
    );
    let back = jbd2_log::parse_revoke(&blocks[0], f, h.block).expect("re-parse of a revoke");
    assert_eq!(back, v, "revoke round trip");
}

/// Fast-commit area: the input as consecutive blocks of the selected size, scanned
/// with `s_inode_size` = 128 << (`param` % 4) and expected tid `generation`. Every
/// TLV that decodes re-encodes to itself; the TLVs are packed into a fresh commit,
/// which must scan back as exactly one valid commit with the same records.
fn fast_commit(h: &Header, rest: &[u8]) {
    let isz = INODE_SIZES[h.param as usize % INODE_SIZES.len()];
    let bs = if h.size == SIZE_EXACT {
        BLOCK_SIZES[0]
    } else {
        BLOCK_SIZES[h.size as usize % BLOCK_SIZES.len()]
    };
    let tid = h.generation;
    // Scan as the area.
    let scan = fc::scan_blocks(rest.chunks(bs), isz, tid);
    let tails = scan
        .tags
        .iter()
        .filter(|t| matches!(t, Tlv::Tail { .. }))
        .count();
    assert_eq!(tails as u32, scan.commits, "one TAIL per valid commit");
    let _ = scan.kernel_error();
    let _ = scan.replayable().count();

    // Every decodable TLV (walking the input TLV by TLV) round-trips.
    let mut decoded = Vec::new();
    let mut cur = 0usize;
    while cur < rest.len() && decoded.len() < 64 {
        let end = (cur / bs + 1) * bs;
        let Ok((tlv, total)) = fc::decode(&rest[cur..end.min(rest.len())], isz) else {
            break;
        };
        assert!(total >= fc::TL_LEN && cur + total <= rest.len());
        assert_eq!(tlv.total_len(), total);
        assert_eq!(tlv.ino(), tlv.ino());
        if tlv.validate().is_ok() {
            let mut out = vec![0u8; total];
            let n = tlv.encode(&mut out).expect("a valid TLV encodes");
            assert_eq!(n, total);
            let (back, n2) = fc::decode(&out, isz).expect("an encoded TLV decodes");
            assert_eq!(n2, total);
            assert_eq!(back, tlv, "fast-commit TLV round trip");
            decoded.push(tlv.into_owned());
        }
        cur += total;
    }

    // Pack what decoded (HEAD/TAIL are the packer's own) and scan it back.
    let Ok(mut p) = FcPacker::new(bs, tid, true) else {
        return;
    };
    let mut pushed = Vec::new();
    for t in decoded {
        if matches!(t, Tlv::Head { .. } | Tlv::Tail { .. }) {
            continue;
        }
        // The scanner bounds INODE records by the inode size.
        if let Tlv::Inode { raw, .. } = &t {
            if raw.len() > isz {
                continue;
            }
        }
        let before = p.blocks_when_finished();
        match p.push(&t) {
            Ok(()) => {
                assert!(p.blocks_when_finished() >= before);
                if !matches!(t, Tlv::Pad { .. }) {
                    pushed.push(t);
                }
            }
            Err(fc::FcError::TooLarge { .. }) => {}
            Err(e) => panic!("push of a valid TLV: {e}"),
        }
    }
    let want_blocks = p.blocks_when_finished();
    let packed = p.finish();
    assert_eq!(packed.nblocks, want_blocks);
    assert_eq!(packed.blocks.len(), packed.nblocks * bs);
    let back = fc::scan_blocks(packed.blocks.chunks(bs), isz, tid);
    assert_eq!(
        back.commits, 1,
        "a packed commit scans as one commit: {:?}",
        back.end
    );
    let got: Vec<&Tlv<'static>> = back
        .replayable()
        .filter(|t| !matches!(t, Tlv::Pad { .. }))
        .collect();
    let want: Vec<&Tlv<'static>> = pushed.iter().collect();
    assert_eq!(got, want, "fast-commit pack/scan round trip");
}
