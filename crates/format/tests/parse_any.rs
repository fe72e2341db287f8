//! Every parser of `commitfs-format` on random and mutated bytes, under proptest, in
//! stable CI: no panics, and what parses re-serialises to something that parses again.
//!
//! The properties live in `fuzz/src/props.rs`, shared with the cargo-fuzz targets
//! (nightly, on demand: `scripts/fuzz.sh`). Seeds are real structures cut from images
//! made by `mkfs.ext4 -d` (1 KiB and 4 KiB blocks: files, a sparse file with a deep
//! extent tree, an htree directory with index nodes, xattrs in the inode and in a
//! block). They must all parse and round-trip; then they are mutated.
//!
//! With `COMMITFS_FUZZ_SEED_DIR=<dir>` the seed test also writes the seeds as a
//! cargo-fuzz corpus (`<dir>/<target>/<name>`); `scripts/fuzz.sh` uses that.
//!
//! The whole file is bounded to roughly ten seconds.

#[allow(dead_code)]
#[path = "../../../fuzz/src/props.rs"]
mod props;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use commitfs_format::csum::CsumCtx;
use commitfs_format::dirent::{self, LeafGeometry};
use commitfs_format::dx::{self, DxGeometry};
use commitfs_format::extent::{Extent, NodeRef};
use commitfs_format::group_desc::{self, GroupDesc};
use commitfs_format::inode::{self, Inode};
use commitfs_format::superblock::{self as sbf, Superblock};
use commitfs_format::xattr;
use props::{Header, FLAG_CSUM, FLAG_FIX_CSUM, FLAG_MODE_SHIFT, HEADER_LEN, SIZE_EXACT};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

// -------------------------------------------------------------------------------------
// Families
// -------------------------------------------------------------------------------------

/// One parser family = one fuzz target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Family {
    Superblock,
    GroupDesc,
    Inode,
    Extent,
    Dir,
    Xattr,
    Jbd2,
}

const FAMILIES: [Family; 7] = [
    Family::Superblock,
    Family::GroupDesc,
    Family::Inode,
    Family::Extent,
    Family::Dir,
    Family::Xattr,
    Family::Jbd2,
];

impl Family {
    fn target(self) -> &'static str {
        match self {
            Family::Superblock => "superblock",
            Family::GroupDesc => "group_desc",
            Family::Inode => "inode",
            Family::Extent => "extent",
            Family::Dir => "dir",
            Family::Xattr => "xattr",
            Family::Jbd2 => "jbd2",
        }
    }
    fn run(self, data: &[u8]) {
        match self {
            Family::Superblock => props::superblock(data),
            Family::GroupDesc => props::group_desc(data),
            Family::Inode => props::inode(data),
            Family::Extent => props::extent(data),
            Family::Dir => props::dir(data),
            Family::Xattr => props::xattr(data),
            Family::Jbd2 => props::jbd2(data),
        }
    }
}

#[derive(Debug, Clone)]
struct Seed {
    family: Family,
    name: String,
    input: Vec<u8>,
}

// -------------------------------------------------------------------------------------
// Real images
// -------------------------------------------------------------------------------------

/// A unique temporary directory, removed on drop (also when a test fails).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "commitfs-parse-any-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(cmd: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Deterministic filler bytes.
fn filler(n: usize, salt: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(salt).fill_bytes(&mut v);
    v
}

/// Source tree for `mkfs.ext4 -d`.
fn make_source(root: &Path) {
    use std::io::{Seek, SeekFrom, Write};
    let w = |p: &str, data: &[u8]| std::fs::write(root.join(p), data).expect("write source");
    w("small.txt", b"hello, commitfs\n");
    w("medium.bin", &filler(40_000, 1));
    w("empty", b"");
    std::fs::create_dir_all(root.join("dir/sub/deeper")).expect("mkdir");
    w("dir/sub/deeper/leaf.txt", b"deep\n");
    std::os::unix::fs::symlink("small.txt", root.join("fastlink")).expect("symlink");
    let long = "x/".repeat(60) + "target";
    std::os::unix::fs::symlink(long, root.join("slowlink")).expect("symlink");
    // Sparse file: 400 one-block extents (every other 4 KiB) gives a tree of depth 1
    // with 4 KiB blocks and depth 2 with 1 KiB blocks.
    let mut f = std::fs::File::create(root.join("sparse")).expect("create sparse");
    let chunk = filler(4096, 2);
    for i in 0..400u64 {
        f.seek(SeekFrom::Start(i * 8192)).expect("seek");
        f.write_all(&chunk).expect("write sparse");
    }
    drop(f);
    // A directory big enough for htree index nodes with 1 KiB blocks.
    std::fs::create_dir(root.join("bigdir")).expect("mkdir bigdir");
    for i in 0..2000 {
        let name = format!("entry-{i:05}-{}", "n".repeat(50));
        std::fs::File::create(root.join("bigdir").join(name)).expect("create entry");
    }
}

/// Image with `bs`-byte blocks, populated, htree-indexed by `e2fsck -fyD`, xattrs
/// added with debugfs (one small in-inode attribute, one too big for the inode).
fn make_image(dir: &Path, src: &Path, bs: usize) -> PathBuf {
    let img = dir.join(format!("img{bs}"));
    let img_s = img.to_str().expect("utf-8 path");
    let bs_s = bs.to_string();
    let (rc, out) = run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-b",
            &bs_s,
            "-N",
            "4096",
            "-d",
            src.to_str().expect("utf-8 path"),
            img_s,
            "24M",
        ],
    );
    assert_eq!(rc, 0, "mkfs.ext4: {out}");
    let big = dir.join("bigvalue");
    std::fs::write(
        &big,
        filler(700, 3)
            .iter()
            .map(|b| b'a' + b % 26)
            .collect::<Vec<_>>(),
    )
    .expect("write value");
    let big_s = big.to_str().expect("utf-8 path");
    for cmd in [
        "ea_set /small.txt user.note hi".to_string(),
        format!("ea_set -f {big_s} /medium.bin user.big"),
        "ea_set /dir trusted.t 0123456789".to_string(),
    ] {
        let (rc, out) = run("debugfs", &["-w", "-R", &cmd, img_s]);
        assert_eq!(rc, 0, "debugfs {cmd}: {out}");
    }
    let (rc, out) = run("e2fsck", &["-fyD", img_s]);
    assert!(rc <= 1, "e2fsck -fyD rc {rc}: {out}");
    let (rc, out) = run("e2fsck", &["-fn", img_s]);
    assert_eq!(rc, 0, "e2fsck -fn: {out}");
    img
}

/// Cuts every kind of structure out of an image, using the parsers themselves to
/// navigate (each navigation step asserts that the real structure is accepted).
struct Cutter<'a> {
    img: &'a [u8],
    sb: Superblock,
    bs: usize,
    csum: CsumCtx,
    gds: Vec<GroupDesc>,
    seeds: Vec<Seed>,
    tag: String,
}

const PER_FAMILY_KIND: usize = 24;

impl<'a> Cutter<'a> {
    fn new(img: &'a [u8], tag: &str) -> Cutter<'a> {
        let sb = Superblock::parse(&img[1024..2048]).expect("real superblock parses");
        let bs = sb.block_size();
        let csum = CsumCtx {
            enabled: sb.metadata_csum(),
            fs_seed: sb.csum_seed(),
        };
        let mut c = Cutter {
            img,
            bs,
            csum,
            gds: Vec::new(),
            seeds: Vec::new(),
            tag: tag.to_string(),
            sb,
        };
        let ds = c.sb.desc_size();
        let gdt = c.sb.first_data_block() as u64 + 1;
        for g in 0..c.sb.group_count() {
            let off = gdt as usize * bs + g as usize * ds;
            let raw = &img[off..off + ds];
            let blk = gdt + (g as usize * ds / bs) as u64;
            group_desc::verify(raw, g, &csum, blk).expect("real descriptor verifies");
            let gd = GroupDesc::parse(raw, g, blk).expect("real descriptor parses");
            c.gds.push(gd);
        }
        c
    }

    fn flags(&self, mode: u8) -> u8 {
        (if self.csum.enabled { FLAG_CSUM } else { 0 }) | mode << FLAG_MODE_SHIFT
    }

    fn size_sel(&self) -> u8 {
        match self.bs {
            1024 => 0,
            2048 => 1,
            4096 => 2,
            _ => SIZE_EXACT,
        }
    }

    fn block(&self, blk: u64) -> &'a [u8] {
        let off = blk as usize * self.bs;
        &self.img[off..off + self.bs]
    }

    fn push(&mut self, family: Family, kind: &str, h: Header, bytes: &[u8]) {
        let n = self
            .seeds
            .iter()
            .filter(|s| s.family == family && s.name.starts_with(&format!("{}-{kind}-", self.tag)))
            .count();
        if n >= PER_FAMILY_KIND {
            return;
        }
        let name = format!("{}-{kind}-{n:03}", self.tag);
        self.seeds.push(Seed {
            family,
            name,
            input: h.input(bytes),
        });
    }

    fn cut_all(&mut self) {
        // Superblock.
        let h = Header {
            flags: self.flags(0),
            ..Default::default()
        };
        let sb = self.img[1024..2048].to_vec();
        self.push(Family::Superblock, "sb", h, &sb);
        // Descriptors and bitmaps.
        let ds = self.sb.desc_size();
        let gdt = self.sb.first_data_block() as u64 + 1;
        for g in 0..self.gds.len() as u32 {
            let off = gdt as usize * self.bs + g as usize * ds;
            let raw = self.img[off..off + ds].to_vec();
            let h = Header {
                flags: self.flags(0),
                size: match ds {
                    32 => 0,
                    64 => 1,
                    128 => 2,
                    _ => 3,
                },
                fs_seed: self.csum.fs_seed,
                ino: g,
                block: gdt + (g as usize * ds / self.bs) as u64,
                ..Default::default()
            };
            self.push(Family::GroupDesc, "gd", h, &raw);
            let gd = self.gds[g as usize];
            let bb = self.block(gd.block_bitmap).to_vec();
            let ib = self.block(gd.inode_bitmap).to_vec();
            let bits_b = self.sb.clusters_per_group().min(u16::MAX as u32) as u16;
            let bits_i = self.sb.inodes_per_group().min(u16::MAX as u32) as u16;
            for (kind, bytes, bits) in [("bbitmap", bb, bits_b), ("ibitmap", ib, bits_i)] {
                let h = Header {
                    flags: self.flags(1),
                    size: SIZE_EXACT,
                    param: bits,
                    fs_seed: self.csum.fs_seed,
                    probe: 17,
                    aux: 300,
                    ..Default::default()
                };
                self.push(Family::GroupDesc, kind, h, &bytes);
            }
        }
        // Inodes, from the root down.
        let mut seen = HashSet::new();
        self.fast_commit_seeds();
        self.walk(inode::ROOT_INO, &mut seen);
        self.walk(self.sb.journal_inum(), &mut seen);
    }

    fn read_inode(&self, ino: u32) -> (Inode, Vec<u8>, u64) {
        let ipg = self.sb.inodes_per_group();
        let isz = self.sb.inode_size() as usize;
        let g = ((ino - 1) / ipg) as usize;
        let byte = ((ino - 1) % ipg) as usize * isz;
        let blk = self.gds[g].inode_table + (byte / self.bs) as u64;
        let off = blk as usize * self.bs + byte % self.bs;
        let raw = self.img[off..off + isz].to_vec();
        let i = Inode::parse(&raw, ino, &self.csum, blk)
            .unwrap_or_else(|e| panic!("{}: real inode {ino} must parse: {e}", self.tag));
        (i, raw, blk)
    }

    /// Leaf extents of a file; records the tree blocks as seeds.
    fn extents(&mut self, ino: u32, i: &Inode) -> Vec<Extent> {
        let mut out = Vec::new();
        let root = NodeRef::parse_root(&i.block, ino)
            .unwrap_or_else(|e| panic!("{}: real extent root of {ino}: {e}", self.tag));
        let h = Header {
            flags: self.flags(1),
            ino,
            probe: 3,
            ..Default::default()
        };
        self.push(Family::Extent, "root", h, &i.block);
        let mut stack: Vec<(u64, u16)> = Vec::new();
        if root.is_leaf() {
            out.extend(root.extents());
        } else {
            stack.extend(root.indexes().map(|x| (x.child, root.depth() - 1)));
        }
        while let Some((blk, depth)) = stack.pop() {
            let bytes = self.block(blk);
            let node = NodeRef::parse_block(bytes, blk, Some(depth), &self.csum, ino, i.generation)
                .unwrap_or_else(|e| panic!("{}: real extent block {blk}: {e}", self.tag));
            let h = Header {
                flags: self.flags(2),
                size: self.size_sel(),
                param: depth,
                fs_seed: self.csum.fs_seed,
                ino,
                generation: i.generation,
                block: blk,
                probe: 40,
                ..Default::default()
            };
            self.push(Family::Extent, &format!("depth{depth}"), h, bytes);
            if node.is_leaf() {
                out.extend(node.extents());
            } else {
                stack.extend(node.indexes().map(|x| (x.child, depth - 1)));
            }
        }
        out.sort_by_key(|e| e.lblk);
        out
    }

    /// The journal superblock, and log blocks made by the builders for this journal's
    /// format (a fresh mkfs journal holds no log blocks).
    fn journal_seeds(&mut self, jsb_blk: u64) {
        use commitfs_format::jbd2::{self, JournalSuperblock};
        use commitfs_format::jbd2_log::{self, LogFormat, Tag};
        let bytes = self.block(jsb_blk);
        let jsb = JournalSuperblock::parse(bytes, jsb_blk).expect("real journal superblock");
        let h = Header {
            flags: 0,
            size: SIZE_EXACT,
            block: jsb_blk,
            ..Default::default()
        };
        self.push(Family::Jbd2, "jsb", h, &bytes[..jbd2::SUPERBLOCK_SIZE]);
        let seed = commitfs_format::crc32c_raw(!0, &jsb.uuid);
        for incompat in [
            jsb.feature_incompat,
            jbd2::INCOMPAT_64BIT | jbd2::INCOMPAT_CSUM_V3,
            jbd2::INCOMPAT_CSUM_V2,
            0,
        ] {
            let f = LogFormat {
                block_size: self.bs,
                incompat,
                seed,
            };
            let tags: Vec<Tag> = (0..5)
                .map(|i| Tag {
                    blocknr: 100 + i * 7,
                    flags: if i == 2 { jbd2_log::TAG_ESCAPE } else { 0 },
                    checksum: 0x1234_5678 * i as u32,
                })
                .collect();
            let tid = 77;
            let blocks = [
                (1u8, jbd2_log::build_descriptor(&f, tid, &tags)),
                (2, jbd2_log::build_commit(&f, tid, 1_700_000_000, 5)),
                (
                    3,
                    jbd2_log::build_revokes(&f, tid, &[9, 1 << 20, 33]).remove(0),
                ),
            ];
            for (mode, b) in blocks {
                let h = Header {
                    flags: mode << FLAG_MODE_SHIFT,
                    size: self.size_sel(),
                    fs_seed: seed,
                    generation: tid,
                    block: 3,
                    aux: incompat,
                    ..Default::default()
                };
                let kind = ["", "jdesc", "jcommit", "jrevoke"][mode as usize];
                self.push(Family::Jbd2, kind, h, &b);
            }
        }
    }

    /// Fast-commit areas made by the packer, with real inode records inside.
    fn fast_commit_seeds(&mut self) {
        use commitfs_format::fast_commit::{Dentry, FcPacker, Tlv};
        use std::borrow::Cow;
        let (_, raw, _) = self.read_inode(inode::ROOT_INO);
        let isz = raw.len();
        let tid = 1234;
        for n_inodes in [1usize, 3, 40] {
            let mut p = FcPacker::new(self.bs, tid, true).expect("packer");
            let recs = [
                Tlv::AddRange {
                    ino: 12,
                    lblk: 5,
                    len: 9,
                    pblk: 4000,
                    unwritten: false,
                },
                Tlv::Creat(Dentry {
                    parent: 2,
                    ino: 12,
                    name: Cow::Borrowed(b"created"),
                }),
                Tlv::Link(Dentry {
                    parent: 11,
                    ino: 12,
                    name: Cow::Borrowed(b"linked"),
                }),
                Tlv::DelRange {
                    ino: 13,
                    lblk: 0,
                    len: 100,
                },
                Tlv::Unlink(Dentry {
                    parent: 2,
                    ino: 14,
                    name: Cow::Borrowed(b"gone"),
                }),
            ];
            for r in &recs {
                p.push(r).expect("push");
            }
            for i in 0..n_inodes {
                p.push(&Tlv::Inode {
                    ino: 20 + i as u32,
                    raw: Cow::Borrowed(&raw[..isz.min(128 + 32)]),
                })
                .expect("push inode");
            }
            let packed = p.finish();
            let h = Header {
                flags: 4 << FLAG_MODE_SHIFT,
                size: self.size_sel(),
                param: match isz {
                    128 => 0,
                    256 => 1,
                    512 => 2,
                    _ => 3,
                },
                generation: tid,
                ..Default::default()
            };
            self.push(Family::Jbd2, "fcommit", h, &packed.blocks);
        }
    }

    fn walk(&mut self, ino: u32, seen: &mut HashSet<u32>) {
        if !seen.insert(ino) {
            return;
        }
        let (i, raw, itable_blk) = self.read_inode(ino);
        let h = Header {
            flags: self.flags(0),
            size: match raw.len() {
                128 => 0,
                256 => 1,
                512 => 2,
                _ => 3,
            },
            fs_seed: self.csum.fs_seed,
            ino,
            block: itable_blk,
            probe: 5,
            ..Default::default()
        };
        let kind = if i.is_dir() {
            "idir"
        } else if i.is_symlink() {
            "ilink"
        } else {
            "ifile"
        };
        self.push(Family::Inode, kind, h, &raw);
        if xattr::ibody_has_magic(&i.xattr_area) {
            let got = xattr::parse_ibody(&i.xattr_area, itable_blk)
                .unwrap_or_else(|e| panic!("{}: real in-inode xattrs of {ino}: {e}", self.tag));
            let kind = if got.is_empty() { "ibody0" } else { "ibody" };
            let h = Header {
                flags: self.flags(1),
                size: SIZE_EXACT,
                param: i.xattr_area.len() as u16,
                probe: 9,
                ..Default::default()
            };
            self.push(Family::Xattr, kind, h, &i.xattr_area.clone());
        }
        if i.file_acl != 0 {
            let bytes = self.block(i.file_acl);
            let xb = xattr::parse_block(bytes, i.file_acl, &self.csum)
                .unwrap_or_else(|e| panic!("{}: real xattr block of {ino}: {e}", self.tag));
            assert!(!xb.entries.is_empty());
            let h = Header {
                flags: self.flags(0),
                size: self.size_sel(),
                fs_seed: self.csum.fs_seed,
                block: i.file_acl,
                aux: 2,
                probe: 12,
                ..Default::default()
            };
            self.push(Family::Xattr, "block", h, bytes);
        }
        if !i.has_flag(inode::FL_EXTENTS) {
            return;
        }
        let exts = self.extents(ino, &i);
        if ino == self.sb.journal_inum() {
            let first = exts.first().expect("journal has blocks");
            assert_eq!(first.lblk, 0);
            self.journal_seeds(first.pblk);
        }
        if !i.is_dir() {
            return;
        }
        let map = |l: u32| {
            exts.iter()
                .find_map(|e| e.map(l))
                .unwrap_or_else(|| panic!("directory {ino} has a hole at {l}"))
        };
        let nblocks = (i.size / self.bs as u64) as u32;
        let mut index_blocks = HashSet::new();
        let seed = self.csum.inode_seed(ino, i.generation);
        let dir_header = |mode: u8, blk: u64, me: &Self| Header {
            flags: me.flags(mode),
            size: me.size_sel(),
            fs_seed: me.csum.fs_seed,
            ino,
            generation: i.generation,
            block: blk,
            aux: me.sb.inodes_count(),
            probe: 0x1234_5678,
            ..Default::default()
        };
        if i.has_flag(inode::FL_INDEX) {
            index_blocks.insert(0u32);
            let geo = DxGeometry {
                block_size: self.bs,
                csum: self.csum.enabled,
                largedir: self.sb.has_incompat(sbf::INCOMPAT_LARGEDIR),
            };
            let pblk = map(0);
            let bytes = self.block(pblk);
            let root = dx::parse_root(bytes, &geo, pblk)
                .unwrap_or_else(|e| panic!("{}: real htree root of {ino}: {e}", self.tag));
            if self.csum.enabled {
                dx::verify_csum(bytes, dx::ROOT_COUNT_OFFSET, seed, pblk)
                    .expect("real htree root checksum");
            }
            self.push(Family::Dir, "dxroot", dir_header(1, pblk, self), bytes);
            let mut level = root.entries.clone();
            for _ in 0..root.indirect_levels {
                let mut next = Vec::new();
                for e in &level {
                    index_blocks.insert(e.block);
                    let pblk = map(e.block);
                    let bytes = self.block(pblk);
                    let node = dx::parse_node(bytes, &geo, pblk)
                        .unwrap_or_else(|err| panic!("{}: real htree node: {err}", self.tag));
                    if self.csum.enabled {
                        dx::verify_csum(bytes, dx::NODE_COUNT_OFFSET, seed, pblk)
                            .expect("real htree node checksum");
                    }
                    self.push(Family::Dir, "dxnode", dir_header(1, pblk, self), bytes);
                    next.extend(node.entries);
                }
                level = next;
            }
        }
        let geo = LeafGeometry {
            block_size: self.bs,
            csum: self.csum.enabled,
            inodes_count: self.sb.inodes_count(),
        };
        let mut children = Vec::new();
        for l in 0..nblocks {
            if index_blocks.contains(&l) {
                continue;
            }
            let pblk = map(l);
            let bytes = self.block(pblk);
            dirent::validate(bytes, geo, pblk)
                .unwrap_or_else(|e| panic!("{}: real directory leaf of {ino}: {e}", self.tag));
            if self.csum.enabled {
                dirent::verify_leaf_csum(bytes, seed, pblk).expect("real leaf checksum");
            }
            self.push(Family::Dir, "leaf", dir_header(0, pblk, self), bytes);
            for e in dirent::iter(bytes, geo, pblk) {
                let e = e.expect("validated");
                if e.inode != 0 && e.name != b"." && e.name != b".." {
                    children.push(e.inode);
                }
            }
        }
        // Visit a bounded number of children of huge directories.
        for c in children.into_iter().take(64) {
            self.walk(c, seen);
        }
    }
}

fn seeds() -> &'static Vec<Seed> {
    static SEEDS: OnceLock<Vec<Seed>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let tmp = TempDir::new("seeds");
        let src = tmp.0.join("src");
        std::fs::create_dir(&src).expect("mkdir src");
        make_source(&src);
        let mut all = Vec::new();
        for bs in [1024usize, 4096] {
            let img = make_image(&tmp.0, &src, bs);
            let bytes = std::fs::read(&img).expect("read image");
            let mut c = Cutter::new(&bytes, &format!("{}k", bs / 1024));
            c.cut_all();
            all.extend(c.seeds);
        }
        all
    })
}

// -------------------------------------------------------------------------------------
// Tests
// -------------------------------------------------------------------------------------

/// The seeds cover every family and every kind of structure the brief names; each is
/// accepted by the properties (round trips included). Optionally written out as the
/// cargo-fuzz seed corpus.
#[test]
fn real_structures_parse_and_round_trip() {
    let seeds = seeds();
    let kinds: HashSet<String> = seeds
        .iter()
        .map(|s| s.name.split('-').nth(1).unwrap_or("").to_string())
        .collect();
    for want in [
        "sb", "gd", "bbitmap", "ibitmap", "idir", "ifile", "ilink", "root", "depth0", "depth1",
        "leaf", "dxroot", "dxnode", "ibody", "block", "jsb", "jdesc", "jcommit", "jrevoke",
        "fcommit",
    ] {
        assert!(kinds.contains(want), "no seed of kind {want}: {kinds:?}");
    }
    // Depth 2 exists with 1 KiB blocks only.
    assert!(seeds.iter().any(|s| s.name.starts_with("1k-depth1")));
    // Written before they are checked, so that a failing property still leaves a
    // corpus for the fuzzers.
    if let Some(dir) = std::env::var_os("COMMITFS_FUZZ_SEED_DIR") {
        let dir = PathBuf::from(dir);
        for s in seeds {
            let d = dir.join(s.family.target());
            std::fs::create_dir_all(&d).expect("create corpus dir");
            std::fs::write(d.join(&s.name), &s.input).expect("write seed");
        }
    }
    for s in seeds {
        if let Err(e) = check(s.family, &s.input) {
            panic!("real structure {}: {e}", s.name);
        }
    }
}

/// The header of a random input: flags, size selector biased to real block sizes.
fn header_strategy() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<u8>(),
        prop_oneof![
            Just(0u8),
            Just(2u8),
            Just(1u8),
            Just(SIZE_EXACT),
            any::<u8>()
        ],
        proptest::collection::vec(any::<u8>(), HEADER_LEN - 2),
    )
        .prop_map(|(flags, size, rest)| {
            let mut h = vec![flags, size];
            h.extend(rest);
            h
        })
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

fn check(family: Family, data: &[u8]) -> Result<(), TestCaseError> {
    let r = std::panic::catch_unwind(|| family.run(data));
    match r {
        Ok(()) => Ok(()),
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(TestCaseError::fail(format!(
                "{} panicked: {msg}\ninput ({} bytes): {:02x?}",
                family.target(),
                data.len(),
                &data[..data.len().min(256)]
            )))
        }
    }
}

/// Random headers and random bytes, every family.
#[test]
fn random_bytes_never_panic() {
    for family in FAMILIES {
        let mut runner = TestRunner::new(config(160));
        let strat = (
            header_strategy(),
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..200),
                proptest::collection::vec(any::<u8>(), 1000..4200),
            ],
        );
        runner
            .run(&strat, |(h, body)| {
                let mut data = h;
                data.extend(body);
                check(family, &data)
            })
            .unwrap_or_else(|e| panic!("{}: {e}", family.target()));
    }
}

/// One mutation of a seed.
#[derive(Debug, Clone)]
enum Mutation {
    /// XOR a byte of the structure.
    Flip(usize, u8),
    /// Overwrite a run of the structure with random bytes.
    Splat(usize, Vec<u8>),
    /// Set a little-endian u16/u32 field to an edge value.
    Edge(usize, u32),
    /// Cut the input to this fraction (per mille) of its length.
    Truncate(u16),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 1u8..).prop_map(|(at, x)| Mutation::Flip(at, x)),
        2 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..48))
            .prop_map(|(at, v)| Mutation::Splat(at, v)),
        2 => (any::<usize>(), prop_oneof![
                Just(0u32), Just(1), Just(0xFFFF), Just(0xFFFF_FFFF), Just(0x8000),
                Just(12), Just(4), Just(0x7FFF_FFFF)
            ]).prop_map(|(at, v)| Mutation::Edge(at, v)),
        1 => (0u16..1000).prop_map(Mutation::Truncate),
    ]
}

fn apply(seed: &[u8], muts: &[Mutation], fix: bool) -> Vec<u8> {
    let mut d = seed.to_vec();
    if fix {
        d[0] |= FLAG_FIX_CSUM;
    }
    let body = HEADER_LEN;
    for m in muts {
        let n = d.len() - body;
        if n == 0 {
            break;
        }
        match m {
            Mutation::Flip(at, x) => d[body + at % n] ^= x,
            Mutation::Splat(at, v) => {
                let at = at % n;
                let k = v.len().min(n - at);
                d[body + at..body + at + k].copy_from_slice(&v[..k]);
            }
            Mutation::Edge(at, v) => {
                let at = (at % n) & !1;
                let bytes = v.to_le_bytes();
                let k = if *v > 0xFFFF { 4 } else { 2 }.min(n - at);
                d[body + at..body + at + k].copy_from_slice(&bytes[..k]);
            }
            Mutation::Truncate(pm) => {
                let keep = n * *pm as usize / 1000;
                d.truncate(body + keep);
            }
        }
    }
    d
}

/// Real structures with a few mutations, checksums left stale or recomputed.
#[test]
fn mutated_real_structures_never_panic() {
    let seeds = seeds();
    for family in FAMILIES {
        let fam: Vec<&Seed> = seeds.iter().filter(|s| s.family == family).collect();
        assert!(!fam.is_empty(), "no seeds for {}", family.target());
        let mut runner = TestRunner::new(config(300));
        let strat = (
            0..fam.len(),
            proptest::collection::vec(mutation(), 1..5),
            any::<bool>(),
        );
        runner
            .run(&strat, |(i, muts, fix)| {
                let data = apply(&fam[i].input, &muts, fix);
                check(family, &data)
            })
            .unwrap_or_else(|e| panic!("{}: {e}", family.target()));
    }
}

/// Every seed with every single bit of its structure flipped once (bounded per seed):
/// a systematic sweep, checksums recomputed so the structural checks are reached.
#[test]
fn single_bit_flips_with_fixed_checksums() {
    let seeds = seeds();
    let mut per_family = std::collections::HashMap::new();
    for s in seeds {
        // A few seeds of each kind suffice for the sweep.
        let kind = s.name.split('-').nth(1).unwrap_or("").to_string();
        let n = per_family.entry(kind).or_insert(0usize);
        if *n >= 2 {
            continue;
        }
        *n += 1;
        let body = s.input.len() - HEADER_LEN;
        // Header-relevant prefix of big blocks (where the structure's fields are).
        let span = body.min(160);
        for byte in 0..span {
            for bit in [0u8, 3, 7] {
                let mut d = s.input.clone();
                d[0] |= FLAG_FIX_CSUM;
                d[HEADER_LEN + byte] ^= 1 << bit;
                if let Err(e) = check(s.family, &d) {
                    panic!("{}: byte {byte} bit {bit}: {e}", s.name);
                }
            }
        }
    }
}

// -------------------------------------------------------------------------------------
// Regressions: minimal inputs for problems the fuzzers found
// -------------------------------------------------------------------------------------

/// An xattr entry whose first word is non-zero only through `e_value_offs` (name
/// index 0, name length 0, empty value) is accepted by the parser, but the writer then
/// emits a header that reads as the end-of-list marker, so the entry and every entry
/// after it vanish on the next read.
#[test]
fn regression_xattr_entry_with_empty_name_and_index_zero_round_trips() {
    let mut block = vec![0u8; 1024];
    block[0..4].copy_from_slice(&xattr::XATTR_MAGIC.to_le_bytes());
    block[4..8].copy_from_slice(&1u32.to_le_bytes()); // h_refcount
    block[8..12].copy_from_slice(&1u32.to_le_bytes()); // h_blocks
                                                       // Entry at 32: e_name_len 0, e_name_index 0, e_value_offs 16, inum 0, size 0.
    block[32 + 2..32 + 4].copy_from_slice(&16u16.to_le_bytes());
    // A second, ordinary entry "user.a" = "v" after it.
    let e2 = 32 + 16;
    block[e2] = 1;
    block[e2 + 1] = xattr::index::USER;
    block[e2 + 2..e2 + 4].copy_from_slice(&1000u16.to_le_bytes());
    block[e2 + 8..e2 + 12].copy_from_slice(&1u32.to_le_bytes());
    block[e2 + 16] = b'a';
    block[1000] = b'v';
    let csum = CsumCtx {
        enabled: false,
        fs_seed: 0,
    };
    let parsed = xattr::parse_block(&block, 7, &csum);
    let Ok(xb) = parsed else {
        return; // Rejecting such an entry is a fine fix too.
    };
    let mut out = vec![0u8; 1024];
    // Refusing to write it is acceptable as well.
    if xattr::write_block(&xb.entries, xb.refcount, 7, &csum, &mut out).is_ok() {
        let back = xattr::parse_block(&out, 7, &csum).expect("re-parse");
        assert_eq!(
            back.entries.len(),
            xb.entries.len(),
            "entries lost in a write/parse round trip: {:?} became {:?}",
            xb.entries,
            back.entries
        );
    }
    // The in-inode area has the same shape.
    let mut area = vec![0u8; 96];
    area[0..4].copy_from_slice(&xattr::XATTR_MAGIC.to_le_bytes());
    area[4 + 2..4 + 4].copy_from_slice(&16u16.to_le_bytes());
    let h = Header {
        flags: 1 << FLAG_MODE_SHIFT,
        size: SIZE_EXACT,
        param: area.len() as u16,
        ..Default::default()
    };
    props::xattr(&h.input(&area));
}

/// A superblock whose `s_blocks_count` (with the 64bit high half) makes the group
/// count overflow u32 must be rejected: `group_count()` truncates, so the
/// inodes-per-group cross-check passes with the wrapped count, and the fs layer's
/// `blocks_count * block_size` overflows on mount.
#[test]
fn regression_superblock_group_count_overflow_is_rejected() {
    let seeds = seeds();
    let s = seeds
        .iter()
        .find(|s| s.family == Family::Superblock && s.name.starts_with("4k"))
        .expect("4k superblock seed");
    let mut raw = s.input[HEADER_LEN..].to_vec();
    let sb = Superblock::parse(&raw).expect("seed parses");
    assert!(sb.is_64bit());
    let bpg = sb.blocks_per_group() as u64;
    // Add 2^32 groups' worth of blocks: the wrapped group count is unchanged.
    let extra = bpg << 32;
    let hi = u32::from_le_bytes(raw[0x150..0x154].try_into().expect("4 bytes")) as u64;
    let new_hi = hi + (extra >> 32) * 32;
    raw[0x150..0x154].copy_from_slice(&(new_hi as u32).to_le_bytes());
    let fixed =
        Superblock::from_raw_unchecked(&raw[..1024].try_into().expect("1024 bytes")).to_bytes();
    match Superblock::parse(&fixed) {
        Err(_) => {}
        Ok(sb) => panic!(
            "accepted s_blocks_count {} with {} blocks per group: group_count() = {} (wrapped)",
            sb.blocks_count(),
            bpg,
            sb.group_count()
        ),
    }
}
