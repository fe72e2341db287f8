//! Corrupted metadata never panics the file system, and checksummed metadata is
//! detected.
//!
//! Real images (1 KiB and 4 KiB blocks) are made by `mkfs.ext4 -d` from a source tree
//! (files, a sparse file with a deep extent tree, an htree directory with index nodes
//! on 1 KiB blocks, symlinks), get xattrs with debugfs (in-inode and in a block) and
//! are htree-indexed by `e2fsck -fyD`. Metadata block numbers come from `dumpe2fs`
//! and `debugfs` (`imap`, `stat`, `blocks`, `ex`), not from our own parsers.
//!
//! For every kind of metadata block (superblock, group descriptors, block and inode
//! bitmaps, inode table, directory leaf, htree root and node, extent tree block,
//! xattr block) copies of the image get bit flips, random bytes, a zeroed or random
//! block, or field edits with the checksum recomputed. Each copy is mounted in memory,
//! the whole tree is walked (lookup, readdir, getattr, read, readlink, listxattr,
//! getxattr) and some writes are made. Every call must return `Ok` or a clean error;
//! a panic on any thread, or a run that does not finish, fails the test. Flips and
//! random bytes inside the checksummed part of a structure must be reported as
//! corruption (`FsError::Corrupt`/`CorruptMsg`) at a minimum rate per kind.
//!
//! Corrupted images mounted read-only (from a file) must stay byte-identical with
//! zero device writes.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use commitfs_device::{DeviceRef, MemDevice};
use commitfs_format::csum::CsumCtx;
use commitfs_format::superblock::Superblock;
use commitfs_format::{dirent, dx, extent, group_desc, inode, xattr};
use commitfs_fs::testutil::{fsck, problem_lines};
use commitfs_fs::{
    FileType, Fs, FsError, MountOptions, RenameFlags, SetAttr, XattrFlags, ROOT_INO,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

// -------------------------------------------------------------------------------------
// Panic accounting (panics on any thread, e.g. a background commit thread)
// -------------------------------------------------------------------------------------

static PANIC_MSGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn install_panic_counter() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current()
                .name()
                .unwrap_or("<unnamed>")
                .to_string();
            if let Ok(mut m) = PANIC_MSGS.lock() {
                m.push(format!("[{thread}] {info}"));
            }
            prev(info);
        }));
    });
}

// -------------------------------------------------------------------------------------
// Images
// -------------------------------------------------------------------------------------

/// Temporary directory removed on drop (also when the test fails).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "commitfs-corruption-{tag}-{}-{}",
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

fn debugfs(img: &Path, req: &str) -> String {
    let (rc, out) = run("debugfs", &["-R", req, img.to_str().expect("utf-8 path")]);
    assert_eq!(rc, 0, "debugfs {req}: {out}");
    out
}

fn filler(n: usize, salt: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(salt).fill_bytes(&mut v);
    v
}

fn make_source(root: &Path) {
    use std::io::{Seek, SeekFrom, Write};
    let w = |p: &str, data: &[u8]| std::fs::write(root.join(p), data).expect("write source");
    w("small.txt", b"hello, commitfs\n");
    w("medium.bin", &filler(60_000, 1));
    w("empty", b"");
    std::fs::create_dir_all(root.join("dir/sub/deeper")).expect("mkdir");
    w("dir/a.txt", b"a\n");
    w("dir/sub/deeper/leaf.txt", b"deep\n");
    std::os::unix::fs::symlink("small.txt", root.join("fastlink")).expect("symlink");
    let long = "y/".repeat(70) + "target";
    std::os::unix::fs::symlink(long, root.join("slowlink")).expect("symlink");
    // 400 one-block extents: depth 2 with 1 KiB blocks, depth 1 with 4 KiB.
    let mut f = std::fs::File::create(root.join("sparse")).expect("create sparse");
    let chunk = filler(4096, 2);
    for i in 0..400u64 {
        f.seek(SeekFrom::Start(i * 8192)).expect("seek");
        f.write_all(&chunk).expect("write sparse");
    }
    drop(f);
    std::fs::create_dir(root.join("bigdir")).expect("mkdir bigdir");
    for i in 0..2000 {
        let name = format!("entry-{i:05}-{}", "n".repeat(50));
        let data = if i % 100 == 0 { &b"x"[..] } else { &b""[..] };
        std::fs::write(root.join("bigdir").join(name), data).expect("create entry");
    }
}

#[derive(Debug, Clone, Default)]
struct FileInfo {
    ino: u32,
    generation: u32,
    file_acl: u64,
    /// Data blocks in logical order (`debugfs blocks`).
    blocks: Vec<u64>,
    /// Inode-table block and byte offset (`debugfs imap`).
    imap: (u64, usize),
    /// Extent tree blocks below the inode root (`debugfs ex`).
    tree_blocks: Vec<u64>,
}

#[derive(Debug, Clone, Default)]
struct GroupInfo {
    block_bitmap: u64,
    inode_bitmap: u64,
}

struct Image {
    dir: TempDir,
    bytes: Vec<u8>,
    bs: usize,
    desc_size: usize,
    ipg: u32,
    bpg: u32,
    gdt: (u64, u64),
    groups: Vec<GroupInfo>,
    files: HashMap<&'static str, FileInfo>,
    csum: CsumCtx,
}

fn field<'a>(text: &'a str, key: &str) -> &'a str {
    let rest = text
        .split(key)
        .nth(1)
        .unwrap_or_else(|| panic!("no {key:?} in:\n{text}"));
    rest.split_whitespace().next().unwrap_or("")
}

fn num(s: &str) -> u64 {
    let s = s.trim_end_matches(',');
    if let Some(h) = s.strip_prefix("0x") {
        u64::from_str_radix(h, 16).unwrap_or_else(|_| panic!("bad hex {s:?}"))
    } else {
        s.parse().unwrap_or_else(|_| panic!("bad number {s:?}"))
    }
}

fn file_info(img: &Path, path: &str) -> FileInfo {
    let stat = debugfs(img, &format!("stat {path}"));
    let imap = debugfs(img, &format!("imap {path}"));
    let blocks = debugfs(img, &format!("blocks {path}"));
    let ex = debugfs(img, &format!("ex {path}"));
    // Index lines of `ex` (level < max level): their physical column is a tree block.
    let mut tree_blocks = Vec::new();
    for line in ex.lines() {
        let l = line.replace('/', " / ");
        let t: Vec<&str> = l.split_whitespace().collect();
        if t.len() >= 10 && t[1] == "/" && t[4] == "/" && t[7] == "-" {
            let (Ok(level), Ok(max)) = (t[0].parse::<u32>(), t[2].parse::<u32>()) else {
                continue;
            };
            if level < max {
                tree_blocks.push(num(t[9]));
            }
        }
    }
    let loc_blk = field(&imap, "located at block");
    // `blocks` also lists the extent tree blocks (before the data they map); without
    // them the list is the data in logical order.
    let tree: HashSet<u64> = tree_blocks.iter().copied().collect();
    FileInfo {
        ino: num(field(&stat, "Inode:")) as u32,
        generation: num(field(&stat, "Generation:")) as u32,
        file_acl: num(field(&stat, "File ACL:")),
        blocks: blocks
            .split_whitespace()
            .filter(|w| w.chars().all(|c| c.is_ascii_digit()))
            .map(num)
            .filter(|b| !tree.contains(b))
            .collect(),
        imap: (num(loc_blk), num(field(&imap, "offset")) as usize),
        tree_blocks,
    }
}

const FILES: [&str; 10] = [
    "<8>",
    "/",
    "/small.txt",
    "/medium.bin",
    "/dir",
    "/sparse",
    "/bigdir",
    "/slowlink",
    "/fastlink",
    "/dir/sub/deeper",
];

fn build_image(bs: usize) -> Image {
    let dir = TempDir::new(&format!("{bs}"));
    let src = dir.0.join("src");
    std::fs::create_dir(&src).expect("mkdir src");
    make_source(&src);
    let path = dir.0.join("img");
    let p = path.to_str().expect("utf-8 path");
    let size = if bs == 1024 { "16M" } else { "32M" };
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
            src.to_str().expect("utf-8"),
            p,
            size,
        ],
    );
    assert_eq!(rc, 0, "mkfs.ext4: {out}");
    let big = dir.0.join("value");
    std::fs::write(&big, vec![b'v'; 900]).expect("write value");
    for cmd in [
        "ea_set /small.txt user.note hello".to_string(),
        format!("ea_set -f {} /medium.bin user.big", big.display()),
        "ea_set /medium.bin user.small tiny".to_string(),
        "ea_set /dir trusted.t 0123456789".to_string(),
    ] {
        let (rc, out) = run("debugfs", &["-w", "-R", &cmd, p]);
        assert_eq!(rc, 0, "debugfs {cmd}: {out}");
    }
    let (rc, out) = run("e2fsck", &["-fyD", p]);
    assert!(rc <= 1, "e2fsck -fyD rc {rc}: {out}");
    let r = fsck(&path);
    assert!(r.is_clean(), "fresh image not clean:\n{}", r.output);

    let (rc, head) = run("dumpe2fs", &["-h", p]);
    assert_eq!(rc, 0, "dumpe2fs -h: {head}");
    let (rc, full) = run("dumpe2fs", &[p]);
    assert_eq!(rc, 0, "dumpe2fs: {full}");
    let desc_size = head
        .lines()
        .find(|l| l.starts_with("Group descriptor size:"))
        .map(|l| num(field(l, ":")) as usize)
        .unwrap_or(32);
    let mut groups = Vec::new();
    let mut gdt = (0, 0);
    for chunk in full
        .split("\nGroup ")
        .skip(1)
        .filter(|c| c.starts_with(|ch: char| ch.is_ascii_digit()))
    {
        if chunk.starts_with("0:") {
            let g = field(chunk, "Group descriptors at ");
            let (a, b) = g.split_once('-').expect("gdt range");
            gdt = (num(a), num(b));
        }
        groups.push(GroupInfo {
            block_bitmap: num(field(chunk, "Block bitmap at ")),
            inode_bitmap: num(field(chunk, "Inode bitmap at ")),
        });
    }
    let files = FILES.iter().map(|&f| (f, file_info(&path, f))).collect();
    let bytes = std::fs::read(&path).expect("read image");
    let sb = Superblock::parse(&bytes[1024..2048]).expect("superblock");
    assert_eq!(sb.block_size(), bs);
    Image {
        bs,
        desc_size,
        ipg: num(field(&head, "Inodes per group:")) as u32,
        bpg: num(field(&head, "Blocks per group:")) as u32,
        gdt,
        groups,
        files,
        csum: CsumCtx {
            enabled: sb.metadata_csum(),
            fs_seed: sb.csum_seed(),
        },
        bytes,
        dir,
    }
}

// -------------------------------------------------------------------------------------
// Targets
// -------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Kind {
    Superblock,
    GroupDesc,
    BlockBitmap,
    InodeBitmap,
    InodeTable,
    DirLeaf,
    HtreeLeaf,
    DxRoot,
    DxNode,
    ExtentBlock,
    XattrBlock,
    JournalSuperblock,
}

/// How to recompute the checksum after a structural edit.
#[derive(Debug, Clone, Copy)]
enum Fix {
    Superblock,
    GroupDesc { group: u32 },
    Inode { ino: u32 },
    Leaf { seed: u32 },
    Dx { seed: u32, co: usize },
    Extent { seed: u32 },
    Xattr { blk: u64 },
    Journal,
    None,
}

/// A structure in the image: its bytes `[start, start + len)`, of which
/// `[start, start + covered)` is protected by its checksum.
#[derive(Debug, Clone)]
struct Target {
    kind: Kind,
    what: String,
    start: usize,
    len: usize,
    covered: usize,
    /// Whether a checksum protects `covered` (counts for the detection rate).
    checksummed: bool,
    fix: Fix,
}

fn targets(img: &Image) -> Vec<Target> {
    let bs = img.bs;
    let mut t = Vec::new();
    let f = |p: &str| img.files.get(p).expect("file info").clone();
    let seed_of = |fi: &FileInfo| img.csum.inode_seed(fi.ino, fi.generation);
    t.push(Target {
        kind: Kind::Superblock,
        what: "primary superblock".into(),
        start: 1024,
        len: 1024,
        covered: 1024,
        checksummed: true,
        fix: Fix::Superblock,
    });
    let ngroups = img.groups.len() as u32;
    for g in [0, ngroups - 1] {
        let start = img.gdt.0 as usize * bs + g as usize * img.desc_size;
        t.push(Target {
            kind: Kind::GroupDesc,
            what: format!("descriptor of group {g}"),
            start,
            len: img.desc_size,
            covered: img.desc_size,
            checksummed: true,
            fix: Fix::GroupDesc { group: g },
        });
    }
    let g0 = &img.groups[0];
    t.push(Target {
        kind: Kind::BlockBitmap,
        what: format!("block bitmap of group 0 at {}", g0.block_bitmap),
        start: g0.block_bitmap as usize * bs,
        len: bs,
        covered: img.bpg as usize / 8,
        checksummed: true,
        fix: Fix::None,
    });
    t.push(Target {
        kind: Kind::InodeBitmap,
        what: format!("inode bitmap of group 0 at {}", g0.inode_bitmap),
        start: g0.inode_bitmap as usize * bs,
        len: bs,
        covered: img.ipg as usize / 8,
        checksummed: true,
        fix: Fix::None,
    });
    let isz = 256;
    for p in [
        "/",
        "/small.txt",
        "/dir",
        "/sparse",
        "/bigdir",
        "/slowlink",
        "/medium.bin",
    ] {
        let fi = f(p);
        t.push(Target {
            kind: Kind::InodeTable,
            what: format!("inode {} ({p})", fi.ino),
            start: fi.imap.0 as usize * bs + fi.imap.1,
            len: isz,
            covered: isz,
            checksummed: true,
            fix: Fix::Inode { ino: fi.ino },
        });
    }
    let d = f("/dir");
    assert_eq!(d.blocks.len(), 1, "/dir is one linear block");
    t.push(Target {
        kind: Kind::DirLeaf,
        what: format!("leaf of /dir at {}", d.blocks[0]),
        start: d.blocks[0] as usize * bs,
        len: bs,
        covered: bs,
        checksummed: true,
        fix: Fix::Leaf { seed: seed_of(&d) },
    });
    let r = f("/");
    t.push(Target {
        kind: Kind::DirLeaf,
        what: format!("leaf of / at {}", r.blocks[0]),
        start: r.blocks[0] as usize * bs,
        len: bs,
        covered: bs,
        checksummed: true,
        fix: Fix::Leaf { seed: seed_of(&r) },
    });
    // The htree: root at logical 0; with indirect levels, its entries name the nodes.
    let b = f("/bigdir");
    let root_off = b.blocks[0] as usize * bs;
    let root = &img.bytes[root_off..root_off + bs];
    let levels = root[0x1E];
    let count = u16::from_le_bytes([root[0x22], root[0x23]]) as usize;
    t.push(Target {
        kind: Kind::DxRoot,
        what: format!("htree root of /bigdir at {} (levels {levels})", b.blocks[0]),
        start: root_off,
        len: bs,
        covered: dx::ROOT_COUNT_OFFSET + 8 * count,
        checksummed: true,
        fix: Fix::Dx {
            seed: seed_of(&b),
            co: dx::ROOT_COUNT_OFFSET,
        },
    });
    let mut index_lblks = HashSet::from([0u32]);
    if levels > 0 {
        for i in 0..count {
            let lblk = u32::from_le_bytes(root[0x24 + 8 * i..0x28 + 8 * i].try_into().expect("4"));
            index_lblks.insert(lblk & dx::BLOCK_MASK);
        }
        for (n, &lblk) in index_lblks.iter().filter(|&&l| l != 0).take(2).enumerate() {
            let pblk = b.blocks[lblk as usize];
            let off = pblk as usize * bs;
            let ncount = u16::from_le_bytes([img.bytes[off + 0xA], img.bytes[off + 0xB]]);
            t.push(Target {
                kind: Kind::DxNode,
                what: format!("htree node {n} of /bigdir at {pblk}"),
                start: off,
                len: bs,
                covered: dx::NODE_COUNT_OFFSET + 8 * ncount as usize,
                checksummed: true,
                fix: Fix::Dx {
                    seed: seed_of(&b),
                    co: dx::NODE_COUNT_OFFSET,
                },
            });
        }
    }
    let leaves: Vec<u64> = b
        .blocks
        .iter()
        .enumerate()
        .filter(|(l, _)| !index_lblks.contains(&(*l as u32)))
        .map(|(_, &p)| p)
        .collect();
    for &p in [
        leaves[0],
        leaves[leaves.len() / 2],
        leaves[leaves.len() - 1],
    ]
    .iter()
    {
        t.push(Target {
            kind: Kind::HtreeLeaf,
            what: format!("htree leaf of /bigdir at {p}"),
            start: p as usize * bs,
            len: bs,
            covered: bs,
            checksummed: true,
            fix: Fix::Leaf { seed: seed_of(&b) },
        });
    }
    let s = f("/sparse");
    assert!(!s.tree_blocks.is_empty(), "/sparse has extent tree blocks");
    for &blk in s.tree_blocks.iter().take(4) {
        let off = blk as usize * bs;
        let entries = u16::from_le_bytes([img.bytes[off + 2], img.bytes[off + 3]]) as usize;
        t.push(Target {
            kind: Kind::ExtentBlock,
            what: format!("extent tree block of /sparse at {blk}"),
            start: off,
            len: bs,
            covered: 12 + 12 * entries,
            checksummed: true,
            fix: Fix::Extent { seed: seed_of(&s) },
        });
    }
    let m = f("/medium.bin");
    assert!(m.file_acl != 0, "/medium.bin has an xattr block");
    t.push(Target {
        kind: Kind::XattrBlock,
        what: format!("xattr block of /medium.bin at {}", m.file_acl),
        start: m.file_acl as usize * bs,
        len: bs,
        covered: bs,
        checksummed: true,
        fix: Fix::Xattr { blk: m.file_acl },
    });
    // The journal superblock (journal block 0): checksummed only with csum v2/v3.
    let j = f("<8>");
    let jsb_off = j.blocks[0] as usize * bs;
    let jsb = commitfs_format::jbd2::JournalSuperblock::parse(
        &img.bytes[jsb_off..jsb_off + 1024],
        j.blocks[0],
    )
    .expect("journal superblock");
    t.push(Target {
        kind: Kind::JournalSuperblock,
        what: format!("journal superblock at {}", j.blocks[0]),
        start: jsb_off,
        len: 1024,
        covered: 1024,
        checksummed: jsb.has_csum_v2or3(),
        fix: Fix::Journal,
    });
    t
}

/// Recompute the checksum of a target after an edit.
fn fix_csum(img: &Image, bytes: &mut [u8], t: &Target) {
    let csum = img.csum;
    let s = &mut bytes[t.start..t.start + t.len];
    match t.fix {
        Fix::Superblock => {
            let raw: [u8; 1024] = s[..1024].try_into().expect("1024 bytes");
            let fixed = Superblock::from_raw_unchecked(&raw).to_bytes();
            s[..1024].copy_from_slice(&fixed);
        }
        Fix::GroupDesc { group } => {
            let c = group_desc::compute_checksum(s, group, &csum);
            s[0x1E..0x20].copy_from_slice(&c.to_le_bytes());
        }
        Fix::Inode { ino } => {
            let generation = u32::from_le_bytes(s[0x64..0x68].try_into().expect("4"));
            let c = inode::compute_checksum(s, ino, generation, &csum);
            s[0x7C..0x7E].copy_from_slice(&(c as u16).to_le_bytes());
            if u16::from_le_bytes([s[0x80], s[0x81]]) >= 4 {
                s[0x82..0x84].copy_from_slice(&((c >> 16) as u16).to_le_bytes());
            }
        }
        Fix::Leaf { seed } => {
            if dirent::tail_fields_ok(s) {
                dirent::set_leaf_csum(s, seed);
            }
        }
        Fix::Dx { seed, co } => {
            let _ = dx::set_csum(s, co, seed);
        }
        Fix::Extent { seed } => {
            let cap = extent::block_capacity(s.len());
            let max = u16::from_le_bytes([s[4], s[5]]);
            let max = if max == 0 || max > cap { cap } else { max };
            let c = extent::block_checksum(seed, s, max);
            let off = extent::tail_offset(max);
            s[off..off + 4].copy_from_slice(&c.to_le_bytes());
        }
        Fix::Xattr { blk } => xattr::update_block_checksum(s, blk, &csum),
        Fix::Journal => {
            let c = commitfs_format::jbd2::compute_checksum(s);
            let o = commitfs_format::jbd2::S_CHECKSUM;
            s[o..o + 4].copy_from_slice(&c.to_be_bytes());
        }
        Fix::None => {}
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Mode {
    /// One bit flipped in the checksummed part (counts for the detection rate).
    FlipBit,
    /// 1–8 random bytes in the checksummed part (counts for the detection rate).
    RandomBytes,
    /// The whole structure zeroed.
    Zero,
    /// The whole structure random.
    Random,
    /// Fields set to edge values, checksum recomputed: exercises the checks behind
    /// the checksum.
    FieldsFixedCsum,
    /// Random bytes in the checksummed part, checksum recomputed.
    BytesFixedCsum,
}

const MODES: [(Mode, usize); 6] = [
    (Mode::FlipBit, 4),
    (Mode::RandomBytes, 3),
    (Mode::Zero, 1),
    (Mode::Random, 1),
    (Mode::FieldsFixedCsum, 6),
    (Mode::BytesFixedCsum, 3),
];

/// Corrupt a copy; returns false if the mutation left the bytes unchanged.
fn corrupt(img: &Image, bytes: &mut [u8], t: &Target, mode: Mode, rng: &mut StdRng) -> bool {
    let before = bytes[t.start..t.start + t.len].to_vec();
    let covered = t.covered.clamp(1, t.len);
    match mode {
        Mode::FlipBit => {
            let at = t.start + rng.gen_range(0..covered);
            bytes[at] ^= 1 << rng.gen_range(0..8);
        }
        Mode::RandomBytes => {
            for _ in 0..rng.gen_range(1..=8) {
                let at = t.start + rng.gen_range(0..covered);
                bytes[at] = rng.gen();
            }
        }
        Mode::Zero => bytes[t.start..t.start + t.len].fill(0),
        Mode::Random => rng.fill(&mut bytes[t.start..t.start + t.len]),
        Mode::FieldsFixedCsum => {
            let edges: [u32; 8] = [0, 1, 2, 0xFF, 0xFFFF, 0x8000, 0xFFFF_FFFF, 0x7FFF_FFFF];
            for _ in 0..rng.gen_range(1..=3) {
                let at = rng.gen_range(0..covered.saturating_sub(4).max(1)) & !1;
                let v = edges[rng.gen_range(0..edges.len())];
                let w = if rng.gen() { 2 } else { 4 };
                let b = v.to_le_bytes();
                let end = (at + w).min(t.len);
                bytes[t.start + at..t.start + end].copy_from_slice(&b[..end - at]);
            }
            fix_csum(img, bytes, t);
        }
        Mode::BytesFixedCsum => {
            for _ in 0..rng.gen_range(1..=4) {
                let at = t.start + rng.gen_range(0..covered);
                bytes[at] = rng.gen();
            }
            fix_csum(img, bytes, t);
        }
    }
    bytes[t.start..t.start + t.len] != before[..]
}

// -------------------------------------------------------------------------------------
// The walk
// -------------------------------------------------------------------------------------

#[derive(Debug, Default, Clone)]
struct Outcome {
    ops: usize,
    ok: usize,
    corrupt: Vec<String>,
    other: Vec<String>,
    mount_error: Option<String>,
}

impl Outcome {
    fn note<T>(&mut self, what: &str, r: &Result<T, FsError>) {
        self.ops += 1;
        match r {
            Ok(_) => self.ok += 1,
            Err(e) if e.is_corruption() => self.corrupt.push(format!("{what}: {e}")),
            Err(e) => self.other.push(format!("{what}: {e}")),
        }
    }
    fn detected(&self) -> bool {
        !self.corrupt.is_empty()
            || self
                .mount_error
                .as_deref()
                .is_some_and(|m| m.starts_with("corrupt:"))
    }
}

/// Walk everything reachable from the root; bounded so a corrupt image cannot make
/// the walk itself endless.
fn walk(fs: &Fs, out: &mut Outcome) {
    let mut seen = HashSet::new();
    let mut queue = vec![ROOT_INO];
    let mut buf = vec![0u8; 64 * 1024];
    while let Some(dir) = queue.pop() {
        if !seen.insert(dir) || seen.len() > 10_000 {
            continue;
        }
        let r = fs.readdir_all(dir);
        out.note("readdir", &r);
        let Ok(entries) = r else { continue };
        for e in entries.iter().take(5000) {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let r = fs.lookup(dir, &e.name);
            out.note("lookup", &r);
            let Ok(attr) = r else { continue };
            out.note("getattr", &fs.getattr(attr.ino));
            let r = fs.listxattr(attr.ino);
            out.note("listxattr", &r);
            if let Ok(names) = r {
                for n in names.iter().take(16) {
                    out.note("getxattr", &fs.getxattr(attr.ino, n));
                }
            }
            match attr.kind {
                FileType::Directory => queue.push(attr.ino),
                FileType::Symlink => out.note("readlink", &fs.readlink(attr.ino)),
                FileType::Regular => {
                    let mut off = 0u64;
                    let end = attr.size.min(8 << 20);
                    while off < end {
                        let r = fs.read(attr.ino, off, &mut buf);
                        let n = match &r {
                            Ok(n) => *n,
                            Err(_) => 0,
                        };
                        out.note("read", &r);
                        if n == 0 {
                            break;
                        }
                        off += n as u64;
                    }
                }
                _ => {}
            }
        }
    }
    out.note("statfs", &fs.statfs());
    out.note("resolve", &fs.resolve("/dir/sub/deeper/leaf.txt"));
}

fn writes(fs: &Fs, out: &mut Outcome) {
    let r = fs.create(ROOT_INO, b"new-file", 0o644, 0, 0);
    out.note("create", &r);
    if let Ok(a) = r {
        out.note("write", &fs.write(a.ino, 0, &filler(70_000, 9)));
        out.note(
            "setxattr",
            &fs.setxattr(a.ino, b"user.x", b"1", XattrFlags::default()),
        );
    }
    out.note("mkdir", &fs.mkdir(ROOT_INO, b"new-dir", 0o755, 0, 0));
    if let Ok(b) = fs.resolve("/bigdir") {
        out.note("create in htree", &fs.create(b, b"zz-new", 0o644, 0, 0));
        out.note(
            "unlink in htree",
            &fs.unlink(b, format!("entry-00007-{}", "n".repeat(50)).as_bytes()),
        );
    }
    if let Ok(s) = fs.resolve("/small.txt") {
        out.note(
            "setxattr",
            &fs.setxattr(s, b"user.more", &[7u8; 300], XattrFlags::default()),
        );
        out.note("append", &fs.write(s, 16, b"more data"));
    }
    if let Ok(m) = fs.resolve("/medium.bin") {
        out.note("removexattr", &fs.removexattr(m, b"user.big"));
        let set = SetAttr {
            size: Some(1000),
            ..Default::default()
        };
        out.note("truncate", &fs.setattr(m, &set));
    }
    if let Ok(sp) = fs.resolve("/sparse") {
        out.note("fill hole", &fs.write(sp, 4096 * 3, &[1u8; 4096]));
        let set = SetAttr {
            size: Some(100 * 4096),
            ..Default::default()
        };
        out.note("truncate sparse", &fs.setattr(sp, &set));
    }
    out.note("unlink", &fs.unlink(ROOT_INO, b"empty"));
    out.note(
        "rename",
        &fs.rename(
            ROOT_INO,
            b"fastlink",
            ROOT_INO,
            b"renamed",
            RenameFlags::default(),
        ),
    );
    out.note(
        "symlink",
        &fs.symlink(ROOT_INO, b"newlink", b"target", 0, 0),
    );
    out.note("sync", &fs.sync());
}

/// Mount `bytes` in memory, walk, write, unmount. Returns the outcome.
fn exercise(bytes: Vec<u8>, do_writes: bool) -> Outcome {
    let mut out = Outcome::default();
    let dev: DeviceRef = Arc::new(MemDevice::from_vec(bytes));
    let fs = match Fs::open(dev, MountOptions::default()) {
        Ok(fs) => fs,
        Err(e) => {
            let tag = if e.is_corruption() {
                "corrupt"
            } else {
                "other"
            };
            out.mount_error = Some(format!("{tag}: {e}"));
            return out;
        }
    };
    walk(&fs, &mut out);
    if do_writes {
        writes(&fs, &mut out);
        walk(&fs, &mut out);
    }
    out.note("unmount", &fs.unmount());
    out
}

/// Run `f` on its own thread with a time limit; `Err` describes a panic or a hang.
/// Panics on the file system's own threads are collected by the panic hook and
/// checked with [`background_panics`].
fn guarded<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::Builder::new()
        .name(CASE_THREAD.into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r);
        })
        .expect("spawn");
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => {
            let _ = h.join();
            Ok(v)
        }
        Ok(Err(e)) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panicked: {msg}"))
        }
        Err(_) => Err(format!("did not finish within {limit:?}")),
    }
}

const CASE_THREAD: &str = "corruption-case";

/// Panics seen on the file system's own threads (named `commitfs-*`, e.g. the
/// commit thread), which no `catch_unwind` of ours sees.
fn background_panics() -> Vec<String> {
    PANIC_MSGS
        .lock()
        .map(|m| {
            m.iter()
                .filter(|p| p.starts_with("[commitfs"))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

fn image_hash(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

// -------------------------------------------------------------------------------------
// Tests
// -------------------------------------------------------------------------------------

#[derive(Default)]
struct Tally {
    cases: usize,
    detected: usize,
    /// Cases in the detection-rate modes.
    rate_cases: usize,
    rate_detected: usize,
    mount_refused: usize,
    undetected: Vec<String>,
}

fn corruption_campaign(bs: usize) {
    install_panic_counter();
    let img = Arc::new(build_image(bs));

    // Baseline: the uncorrupted image walks without a single error, the writes work,
    // and e2fsck accepts the result.
    let base = {
        let bytes = img.bytes.clone();
        guarded(Duration::from_secs(120), move || {
            let dev = Arc::new(MemDevice::from_vec(bytes));
            let d2: DeviceRef = dev.clone();
            let mut out = Outcome::default();
            let fs = Fs::open(d2, MountOptions::default()).expect("mount clean image");
            walk(&fs, &mut out);
            writes(&fs, &mut out);
            walk(&fs, &mut out);
            out.note("unmount", &fs.unmount());
            drop(fs);
            (out, dev.contents())
        })
        .unwrap_or_else(|e| panic!("{bs}: baseline run failed: {e}"))
    };
    let (out, after) = base;
    assert!(
        out.corrupt.is_empty() && out.other.is_empty(),
        "{bs}: errors on the clean image: {:?} {:?}",
        out.corrupt,
        out.other
    );
    assert!(
        out.ops > 2000,
        "{bs}: the walk did too little ({} ops)",
        out.ops
    );
    let checked = img.dir.0.join("after-writes.img");
    std::fs::write(&checked, &after).expect("write image");
    let r = fsck(&checked);
    assert!(
        r.is_clean(),
        "{bs}: e2fsck after the baseline writes:\n{}",
        problem_lines(&r.output).join("\n")
    );
    let _ = std::fs::remove_file(&checked);

    let targets = targets(&img);
    let mut rng = StdRng::seed_from_u64(0xC0FF_EE00 ^ bs as u64);
    let mut tallies: HashMap<Kind, Tally> = HashMap::new();
    let mut failures = Vec::new();
    let mut case_no = 0;
    let mut slowest: Vec<(Duration, String)> = Vec::new();
    for t in &targets {
        for (mode, reps) in MODES {
            for _ in 0..reps {
                case_no += 1;
                let mut bytes = img.bytes.clone();
                if !corrupt(&img, &mut bytes, t, mode, &mut rng) {
                    continue;
                }
                // Writes in every other case keep the campaign short.
                // Bitmaps are only read by allocations.
                let do_writes = case_no % 2 == 0
                    || matches!(mode, Mode::FieldsFixedCsum | Mode::BytesFixedCsum)
                    || matches!(t.kind, Kind::BlockBitmap | Kind::InodeBitmap);
                let what = format!("{bs}: {} {mode:?} (case {case_no})", t.what);
                let t0 = std::time::Instant::now();
                let res = guarded(Duration::from_secs(60), move || exercise(bytes, do_writes));
                slowest.push((t0.elapsed(), what.clone()));
                match res {
                    Err(e) => failures.push(format!("{what}: {e}")),
                    Ok(out) => {
                        let tally = tallies.entry(t.kind).or_default();
                        tally.cases += 1;
                        if out.mount_error.is_some() {
                            tally.mount_refused += 1;
                        }
                        let det = out.detected();
                        tally.detected += det as usize;
                        if t.checksummed && matches!(mode, Mode::FlipBit | Mode::RandomBytes) {
                            tally.rate_cases += 1;
                            tally.rate_detected += det as usize;
                            if !det {
                                tally.undetected.push(format!(
                                    "{what}: ops {} ok {} other {:?}",
                                    out.ops,
                                    out.ok,
                                    out.other.iter().take(3).collect::<Vec<_>>()
                                ));
                            }
                        }
                    }
                }
            }
        }
    }

    let mut kinds: Vec<_> = tallies.keys().copied().collect();
    kinds.sort();
    eprintln!("corruption campaign, {bs}-byte blocks:");
    eprintln!("  kind          cases detected refused | csum-covered detected");
    let mut low = Vec::new();
    for k in kinds {
        let t = &tallies[&k];
        eprintln!(
            "  {:<13} {:>5} {:>8} {:>7} | {:>5} {:>5}",
            format!("{k:?}"),
            t.cases,
            t.detected,
            t.mount_refused,
            t.rate_cases,
            t.rate_detected
        );
        for u in t.undetected.iter().take(3) {
            eprintln!("      undetected: {u}");
        }
        // Checksum-covered flips must be reported as corruption.
        let min = MIN_DETECTION_PERCENT;
        if t.rate_cases > 0 && t.rate_detected * 100 < t.rate_cases * min {
            low.push(format!(
                "{k:?}: {}/{} detected (< {min}%); e.g. {:?}",
                t.rate_detected,
                t.rate_cases,
                t.undetected.first()
            ));
        }
    }
    slowest.sort();
    for (d, w) in slowest.iter().rev().take(5) {
        eprintln!("  slow: {d:?} {w}");
    }
    assert!(
        failures.is_empty(),
        "{bs}: {} case(s) panicked or hung:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let bg = background_panics();
    assert!(
        bg.is_empty(),
        "panics on background threads:\n{}",
        bg.join("\n")
    );
    assert!(
        low.is_empty(),
        "{bs}: detection rate too low:\n{}",
        low.join("\n")
    );
}

/// Minimum share of checksum-covered corruptions that must be reported as such.
const MIN_DETECTION_PERCENT: usize = 90;

#[test]
fn corrupted_metadata_1k() {
    corruption_campaign(1024);
}

#[test]
fn corrupted_metadata_4k() {
    corruption_campaign(4096);
}

/// Read-only mounts of corrupted images (one per kind of structure, plus the clean
/// image) never write: the file is byte-identical afterwards and the device counted
/// no writes or flushes, even though writes are attempted.
#[test]
fn read_only_mount_of_corrupted_image_never_writes() {
    install_panic_counter();
    for bs in [1024usize, 4096] {
        let img = build_image(bs);
        let targets = targets(&img);
        let mut rng = StdRng::seed_from_u64(7 + bs as u64);
        let mut seen = HashSet::new();
        let mut cases: Vec<(String, Vec<u8>)> = vec![("clean image".into(), img.bytes.clone())];
        for t in &targets {
            if !seen.insert(t.kind) {
                continue;
            }
            for mode in [
                Mode::RandomBytes,
                Mode::FieldsFixedCsum,
                Mode::BytesFixedCsum,
            ] {
                let mut bytes = img.bytes.clone();
                corrupt(&img, &mut bytes, t, mode, &mut rng);
                cases.push((format!("{} {mode:?}", t.what), bytes));
            }
        }
        for (what, bytes) in cases {
            let path = img.dir.0.join("ro.img");
            std::fs::write(&path, &bytes).expect("write copy");
            let before = image_hash(&bytes);
            let p2 = path.clone();
            let r = guarded(Duration::from_secs(60), move || {
                let opts = MountOptions {
                    read_only: true,
                    ..Default::default()
                };
                let mut out = Outcome::default();
                let fs = match Fs::open_path(&p2, opts) {
                    Ok(fs) => fs,
                    Err(e) => {
                        out.mount_error = Some(e.to_string());
                        return (out, None);
                    }
                };
                assert!(fs.is_read_only());
                walk(&fs, &mut out);
                let mut w = Outcome::default();
                writes(&fs, &mut w);
                let attempted_ok = w.ok;
                out.note("unmount", &fs.unmount());
                let stats = fs.io_stats();
                drop(fs);
                (out, Some((stats, attempted_ok, w)))
            });
            let (out, info) = r.unwrap_or_else(|e| panic!("{bs}: read-only {what}: {e}"));
            let after = std::fs::read(&path).expect("read copy back");
            assert_eq!(
                image_hash(&after),
                before,
                "{bs}: read-only mount changed the image ({what})"
            );
            assert!(
                after == bytes,
                "{bs}: read-only mount changed the image ({what})"
            );
            if let Some((stats, attempted_ok, w)) = info {
                assert_eq!(
                    stats.total_writes(),
                    0,
                    "{bs}: read-only mount wrote ({what}): {stats:?}"
                );
                assert_eq!(stats.flushes, 0, "{bs}: read-only mount flushed ({what})");
                // Only `sync` (a no-op on a read-only mount) may succeed.
                assert!(
                    attempted_ok <= 1,
                    "{bs}: writes succeeded on a read-only mount ({what}): {} ok, errors {:?}",
                    attempted_ok,
                    w.other
                );
            }
            drop(out);
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// A superblock whose 64-bit block count wraps the group count (checksum valid) must
/// be refused at mount, not overflow.
#[test]
fn huge_block_count_superblock_is_refused() {
    install_panic_counter();
    let img = build_image(4096);
    let mut bytes = img.bytes.clone();
    let sb = Superblock::parse(&bytes[1024..2048]).expect("superblock");
    assert!(sb.is_64bit());
    // + 2^32 groups' worth of blocks, times 32: the wrapped group count is unchanged
    // and blocks_count * block_size overflows u64.
    let add_hi = (sb.blocks_per_group() as u64) * 32;
    let off = 1024 + 0x150;
    let hi = u32::from_le_bytes(bytes[off..off + 4].try_into().expect("4")) as u64;
    bytes[off..off + 4].copy_from_slice(&((hi + add_hi) as u32).to_le_bytes());
    let raw: [u8; 1024] = bytes[1024..2048].try_into().expect("1024");
    let fixed = Superblock::from_raw_unchecked(&raw).to_bytes();
    bytes[1024..2048].copy_from_slice(&fixed);
    let r = guarded(Duration::from_secs(30), move || {
        let dev: DeviceRef = Arc::new(MemDevice::from_vec(bytes));
        Fs::open(dev, MountOptions::default())
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    match r {
        Err(e) => panic!("mount of a superblock with a huge block count: {e}"),
        Ok(Ok(())) => panic!("mounted a superblock claiming 2^52 blocks"),
        Ok(Err(_)) => {}
    }
}

/// A group descriptor (checksum valid) whose `bg_itable_unused` exceeds the inodes
/// per group: creating a file must fail cleanly (or work), not overflow.
#[test]
fn descriptor_with_itable_unused_over_inodes_per_group() {
    install_panic_counter();
    let img = build_image(4096);
    let t = targets(&img)
        .into_iter()
        .find(|t| t.kind == Kind::GroupDesc)
        .expect("descriptor target");
    let mut bytes = img.bytes.clone();
    // bg_itable_unused_lo (0x1C) and _hi (0x32).
    bytes[t.start + 0x1C..t.start + 0x1E].copy_from_slice(&0xFFFFu16.to_le_bytes());
    fix_csum(&img, &mut bytes, &t);
    let r = guarded(Duration::from_secs(30), move || {
        let dev: DeviceRef = Arc::new(MemDevice::from_vec(bytes));
        let fs = Fs::open(dev, MountOptions::default()).map_err(|e| e.to_string())?;
        fs.create(ROOT_INO, b"f", 0o644, 0, 0)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    if let Err(e) = r {
        panic!("create with bg_itable_unused 0xFFFF: {e}");
    }
}

/// A journal superblock with a bad magic is on-disk corruption: mounting must fail
/// with an error that `FsError::is_corruption` recognises (EUCLEAN at the FUSE
/// boundary), like every other corrupt structure.
#[test]
fn bad_journal_superblock_is_reported_as_corruption() {
    install_panic_counter();
    let img = build_image(4096);
    let t = targets(&img)
        .into_iter()
        .find(|t| t.kind == Kind::JournalSuperblock)
        .expect("journal superblock target");
    for mode in [Mode::Zero, Mode::Random] {
        let mut bytes = img.bytes.clone();
        let mut rng = StdRng::seed_from_u64(3);
        corrupt(&img, &mut bytes, &t, mode, &mut rng);
        let r = guarded(Duration::from_secs(30), move || {
            let dev: DeviceRef = Arc::new(MemDevice::from_vec(bytes));
            Fs::open(dev, MountOptions::default()).err()
        });
        match r {
            Err(e) => panic!("{mode:?} journal superblock: {e}"),
            Ok(None) => panic!("{mode:?} journal superblock: mounted"),
            Ok(Some(e)) => assert!(
                e.is_corruption(),
                "{mode:?} journal superblock: mount failed with {e:?}, which \
                 is_corruption() does not report as corruption"
            ),
        }
    }
}
