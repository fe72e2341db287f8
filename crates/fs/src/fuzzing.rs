//! Fuzzing a whole mount: mutate a small real ext4 image in memory, mount it with
//! [`Fs::open`] and run a fixed mix of operations. Shared by the cargo-fuzz target
//! `mount_ops` (fuzz/) and the bounded stable run `crates/fs/tests/fuzz_mount.rs`,
//! so both exercise the same code. Not used by the file system itself.
//!
//! The property is robustness only: whatever the image holds, mounting and every
//! operation return (an error is fine) without panicking, hanging or asking for
//! unbounded memory. Panics and hangs are caught by the callers (libFuzzer, or
//! the test's `catch_unwind` + watchdog); memory by the test's allocator.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use commitfs_device::{BlockDevice, DeviceRef, IoCategory, IoStats, MemDevice};

use crate::{
    FallocFlags, FileType, Fs, FsError, Ino, MountOptions, RenameFlags, SetAttr, XattrFlags,
    ROOT_INO,
};

/// Why the template images could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("mkfs.ext4: {0}")]
    Mkfs(String),
    #[error("template image: {0}")]
    Io(#[from] std::io::Error),
    #[error("populating the template image: {0}")]
    Fs(#[from] FsError),
}

/// One image to mutate and the byte ranges (whole blocks) that hold metadata,
/// where most mutations go.
#[derive(Clone)]
pub struct Template {
    pub name: &'static str,
    pub image: Vec<u8>,
    /// Block numbers read while mounting and walking the tree without reading
    /// file data: superblock, descriptors, bitmaps, inode tables, directories,
    /// extent and xattr blocks, the journal.
    pub meta_blocks: Vec<u64>,
    pub block_size: usize,
}

/// The four templates: with and without `metadata_csum` (without it corrupted
/// structures reach the parsers instead of failing their checksum), each clean
/// and "crashed" (fsynced operations only in the journal and the fast-commit
/// area, so every mount replays them).
pub struct Templates {
    pub all: Vec<Template>,
}

/// Image geometry: 6 MiB of 1 KiB blocks in groups of 2048 blocks (3 groups, so
/// there are several descriptors and a backup superblock), a 1 MiB journal with a
/// fast-commit area.
const IMAGE_BYTES: u64 = 6 << 20;

impl Templates {
    /// Build the templates with `mkfs.ext4` in `tmp_dir` and this library.
    pub fn build(tmp_dir: &Path) -> Result<Templates, TemplateError> {
        let mut all = Vec::new();
        for (csum, name) in [(true, "csum"), (false, "nocsum")] {
            let base = mkfs_image(tmp_dir, csum)?;
            let (clean, crashed) = populate(base)?;
            all.push(template(
                if csum { "csum-clean" } else { "nocsum-clean" },
                clean,
            )?);
            let crashed_name = if name == "csum" {
                "csum-crashed"
            } else {
                "nocsum-crashed"
            };
            all.push(template(crashed_name, crashed)?);
        }
        Ok(Templates { all })
    }
}

fn mkfs_image(tmp_dir: &Path, csum: bool) -> Result<Vec<u8>, TemplateError> {
    let path = tmp_dir.join(format!(
        "commitfs-fuzz-template-{}-{}.img",
        std::process::id(),
        csum
    ));
    let f = std::fs::File::create(&path)?;
    f.set_len(IMAGE_BYTES)?;
    drop(f);
    let features = if csum {
        "fast_commit"
    } else {
        "fast_commit,^metadata_csum,^uninit_bg"
    };
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-b", "1024", "-g", "2048", "-N", "1024", "-O"])
        .arg(features)
        .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(&path)
        .output();
    let r = match out {
        Ok(o) if o.status.success() => Ok(std::fs::read(&path)?),
        Ok(o) => Err(TemplateError::Mkfs(
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )),
        Err(e) => Err(TemplateError::Mkfs(e.to_string())),
    };
    let _ = std::fs::remove_file(&path);
    r
}

fn mount(image: Vec<u8>) -> Result<(Arc<MemDevice>, Fs), FsError> {
    let dev = Arc::new(MemDevice::from_vec(image));
    let fs = Fs::open(dev.clone() as DeviceRef, opts())?;
    Ok((dev, fs))
}

/// No background commit thread: cases are short and single-threaded.
fn opts() -> MountOptions {
    MountOptions {
        commit_interval: 0,
        ..MountOptions::default()
    }
}

/// Fill a fresh image with every structure worth corrupting; return the cleanly
/// unmounted image and one captured right after fsyncs (journal to replay).
fn populate(image: Vec<u8>) -> Result<(Vec<u8>, Vec<u8>), TemplateError> {
    let (dev, fs) = mount(image)?;
    let r = ROOT_INO;
    let d1 = fs.mkdir(r, b"dir", 0o755, 0, 0)?.ino;
    let d2 = fs.mkdir(d1, b"sub", 0o700, 1000, 1000)?.ino;
    let small = fs.create(d1, b"small", 0o644, 0, 0)?.ino;
    fs.write(small, 0, b"hello, fuzz\n")?;
    // Fragmented file: every other block, so its extent tree needs index blocks.
    let frag = fs.create(r, b"fragmented", 0o644, 0, 0)?.ino;
    let blk = vec![0xA5u8; 1024];
    for i in 0..400u64 {
        fs.write(frag, i * 2048, &blk)?;
    }
    let big = fs.create(d2, b"big", 0o600, 1000, 1000)?.ino;
    fs.write(big, 0, &vec![7u8; 64 << 10])?;
    fs.fallocate(
        big,
        128 << 10,
        16 << 10,
        FallocFlags {
            keep_size: true,
            ..Default::default()
        },
    )?;
    // A directory large enough for an htree index.
    let many = fs.mkdir(r, b"many", 0o755, 0, 0)?.ino;
    // Each with data, so reading them parses every inode's extent root.
    for i in 0..300u32 {
        let name = format!("entry-{i:04}-with-a-longish-name");
        let f = fs.create(many, name.as_bytes(), 0o644, 0, 0)?.ino;
        fs.write(f, 0, &i.to_le_bytes())?;
    }
    fs.symlink(r, b"short-link", b"dir/small", 0, 0)?;
    fs.symlink(r, b"long-link", &[b'x'; 200], 0, 0)?;
    fs.link(small, r, b"hardlink")?;
    fs.mknod(r, b"chardev", 0o020644, (1 << 8) | 3, 0, 0)?;
    fs.mknod(r, b"fifo", 0o010600, 0, 0, 0)?;
    fs.setxattr(small, b"user.small", b"v", XattrFlags::default())?;
    // Too large for the in-inode area: an xattr block.
    fs.setxattr(small, b"user.large", &[b'L'; 600], XattrFlags::default())?;
    fs.setxattr(d1, b"user.dir", b"on a directory", XattrFlags::default())?;
    fs.unmount()?;
    drop(fs);
    let clean = dev.contents();

    // The crash image: a full commit, then fsynced changes (fast commits) and
    // one more transaction left committed but not checkpointed.
    let (dev, fs) = mount(clean.clone())?;
    let d3 = fs.mkdir(r, b"after", 0o755, 0, 0)?.ino;
    let f = fs.create(d3, b"journaled", 0o644, 0, 0)?.ino;
    fs.write(f, 0, &[1u8; 5000])?;
    fs.sync()?;
    let g = fs.create(r, b"fsynced", 0o644, 0, 0)?.ino;
    fs.write(g, 0, &[2u8; 3000])?;
    fs.setxattr(g, b"user.fc", b"x", XattrFlags::default())?;
    fs.fsync(g, false)?;
    fs.rename(r, b"fsynced", d3, b"moved", RenameFlags::default())?;
    fs.unlink(d1, b"small")?;
    fs.fsync(d3, false)?;
    fs.fsync(g, false)?;
    let crashed = dev.contents();
    drop(fs);
    Ok((clean, crashed))
}

/// A device that records which blocks are read.
struct Tracer {
    inner: Arc<MemDevice>,
    bs: u64,
    read: Mutex<BTreeSet<u64>>,
}

impl BlockDevice for Tracer {
    fn read_at(&self, offset: u64, buf: &mut [u8], cat: IoCategory) -> commitfs_device::Result<()> {
        if let Ok(mut s) = self.read.lock() {
            let end = offset + buf.len() as u64;
            s.extend(offset / self.bs..end.div_ceil(self.bs));
        }
        self.inner.read_at(offset, buf, cat)
    }
    fn write_at(
        &self,
        offset: u64,
        buf: &[u8],
        cat: IoCategory,
        fua: bool,
    ) -> commitfs_device::Result<()> {
        self.inner.write_at(offset, buf, cat, fua)
    }
    fn flush(&self) -> commitfs_device::Result<()> {
        self.inner.flush()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_read_only(&self) -> bool {
        self.inner.is_read_only()
    }
    fn stats(&self) -> &IoStats {
        self.inner.stats()
    }
}

fn template(name: &'static str, image: Vec<u8>) -> Result<Template, TemplateError> {
    let bs = 1024u64;
    let tracer = Arc::new(Tracer {
        inner: Arc::new(MemDevice::from_vec(image.clone())),
        bs,
        read: Mutex::new(BTreeSet::new()),
    });
    let fs = Fs::open(tracer.clone() as DeviceRef, opts())?;
    walk(&fs, false);
    drop(fs);
    let mut meta: BTreeSet<u64> = tracer.read.lock().map(|s| s.clone()).unwrap_or_default();
    // Block 0 holds the superblock at 1024 with 1 KiB blocks: block 1.
    meta.insert(1);
    Ok(Template {
        name,
        image,
        meta_blocks: meta.into_iter().collect(),
        block_size: bs as usize,
    })
}

// -------------------------------------------------------------------------------------
// Mutations
// -------------------------------------------------------------------------------------

/// Bytes of input per mutation: kind, 2 bytes block selector, 2 bytes offset,
/// 2 bytes value.
const MUTATION_BYTES: usize = 7;
/// At most this many mutations per case (more rarely reach past the superblock).
pub const MAX_MUTATIONS: usize = 48;

/// Values that tend to break size and count checks.
const SPECIAL_U32: [u32; 8] = [
    0,
    1,
    0xFFFF_FFFF,
    0x8000_0000,
    0x7FFF_FFFF,
    0xFFFF,
    0x1_0000,
    0xF30A,
];

/// Apply the mutations encoded in `data` to `t.image`. The first byte picks the
/// template (done by the caller); each following 7-byte chunk is one mutation.
pub fn mutate(t: &Template, data: &[u8]) -> Vec<u8> {
    let mut img = t.image.clone();
    let bs = t.block_size;
    for m in data.chunks_exact(MUTATION_BYTES).take(MAX_MUTATIONS) {
        let kind = m[0];
        let sel = u16::from_le_bytes([m[1], m[2]]) as usize;
        let off = u16::from_le_bytes([m[3], m[4]]) as usize;
        let val = u16::from_le_bytes([m[5], m[6]]);
        // Where: 7 in 8 into a metadata block (1 in 8 of those the superblock),
        // the rest anywhere in the image.
        let pos = match kind >> 5 {
            7 => (sel * 0x1_0000 + off) % img.len(),
            6 => 1024 + off % 1024,
            _ if t.meta_blocks.is_empty() => (sel * 0x1_0000 + off) % img.len(),
            _ => t.meta_blocks[sel % t.meta_blocks.len()] as usize * bs + off % bs,
        };
        let v = val.to_le_bytes();
        match kind & 7 {
            0 | 1 => {
                if let Some(b) = img.get_mut(pos) {
                    *b ^= 1 << (val & 7);
                }
            }
            2 => {
                if let Some(b) = img.get_mut(pos) {
                    *b = v[0];
                }
            }
            3 => put(&mut img, pos, &v),
            4 | 5 => {
                let w = SPECIAL_U32[(val as usize) % SPECIAL_U32.len()];
                put(&mut img, pos, &w.to_le_bytes());
            }
            6 => {
                let w = (val as u32) << 16 | val as u32;
                put(&mut img, pos, &w.to_le_bytes());
            }
            _ => {
                // Zero a run (a lost sector, a truncated structure).
                let end = (pos + 1 + (val as usize % 64)).min(img.len());
                img[pos..end].fill(0);
            }
        }
    }
    img
}

fn put(img: &mut [u8], pos: usize, bytes: &[u8]) {
    if let Some(s) = img.get_mut(pos..pos + bytes.len()) {
        s.copy_from_slice(bytes);
    }
}

// -------------------------------------------------------------------------------------
// The operation mix
// -------------------------------------------------------------------------------------

/// Limits of the tree walk (a corrupt image may hold loops and huge directories).
const WALK_MAX_ENTRIES: usize = 2000;
const WALK_MAX_DEPTH: usize = 16;
/// At most this much of each file is read.
const READ_MAX: usize = 64 << 10;

/// What the walk found, for the modifying operations that follow.
#[derive(Default)]
struct Found {
    files: Vec<(Ino, Ino, Vec<u8>)>,
    dirs: Vec<(Ino, Ino, Vec<u8>)>,
}

/// Read everything reachable (entries, attributes, link targets, xattrs and, with
/// `data`, file contents), bounded; errors are expected and ignored.
fn walk(fs: &Fs, data: bool) -> Found {
    let mut found = Found::default();
    let mut seen = HashSet::new();
    let mut stack = vec![(ROOT_INO, 0usize)];
    let mut entries = 0usize;
    let mut buf = vec![0u8; READ_MAX];
    seen.insert(ROOT_INO);
    let _ = fs.statfs();
    while let Some((dir, depth)) = stack.pop() {
        let mut list = Vec::new();
        let _ = fs.readdir(dir, 0, |e| {
            list.push(e);
            list.len() < WALK_MAX_ENTRIES
        });
        for e in list {
            entries += 1;
            if entries > WALK_MAX_ENTRIES {
                return found;
            }
            if e.name == b"." || e.name == b".." {
                continue;
            }
            let _ = fs.lookup(dir, &e.name);
            let Ok(a) = fs.getattr(e.ino) else { continue };
            if let Ok(names) = fs.listxattr(e.ino) {
                for n in names.iter().take(32) {
                    let _ = fs.getxattr(e.ino, n);
                }
            }
            match a.kind {
                FileType::Regular => {
                    if data && fs.open_inode(e.ino).is_ok() {
                        let _ = fs.read(e.ino, 0, &mut buf);
                        if a.size > READ_MAX as u64 {
                            let _ = fs.read(e.ino, a.size - 4096, &mut buf[..8192]);
                        }
                        let _ = fs.release(e.ino);
                    }
                    found.files.push((dir, e.ino, e.name));
                }
                FileType::Symlink => {
                    let _ = fs.readlink(e.ino);
                }
                FileType::Directory => {
                    found.dirs.push((dir, e.ino, e.name));
                    if depth < WALK_MAX_DEPTH && seen.insert(e.ino) {
                        stack.push((e.ino, depth + 1));
                    }
                }
                _ => {}
            }
        }
    }
    found
}

/// Modify the file system: new objects and changes to existing (possibly corrupt)
/// ones, fsynced so the fast-commit and journal writers run too.
fn modify(fs: &Fs, found: &Found) {
    let r = ROOT_INO;
    let flags = XattrFlags::default();
    if let Ok(a) = fs.create(r, b"fz-new", 0o644, 0, 0) {
        let f = a.ino;
        let _ = fs.write(f, 0, &[0x5A; 3000]);
        let _ = fs.write(f, 1 << 20, b"far");
        let _ = fs.setxattr(f, b"user.fz", b"value", flags);
        let _ = fs.setxattr(f, b"user.fz-big", &[b'B'; 700], flags);
        let _ = fs.fsync(f, false);
        let _ = fs.fallocate(f, 8192, 8192, FallocFlags::default());
        let _ = fs.setattr(
            f,
            &SetAttr {
                size: Some(1500),
                mode: Some(0o4755),
                uid: Some(1000),
                ..Default::default()
            },
        );
        let _ = fs.link(f, r, b"fz-link");
        let _ = fs.fsync(f, true);
    }
    if let Ok(d) = fs.mkdir(r, b"fz-dir", 0o755, 0, 0) {
        let _ = fs.rename(r, b"fz-new", d.ino, b"moved", RenameFlags::default());
        let _ = fs.symlink(d.ino, b"ln", &[b'y'; 100], 0, 0);
        let _ = fs.mknod(d.ino, b"dev", 0o060600, 0x0801, 0, 0);
        let _ = fs.fsyncdir(d.ino);
    }
    // Existing objects: their extent trees, directories and xattrs are the
    // mutated ones.
    for (i, (dir, ino, name)) in found.files.iter().take(6).enumerate() {
        let _ = fs.open_inode(*ino);
        match i % 3 {
            0 => {
                let _ = fs.write(*ino, 512, &[0xC3; 2048]);
                let _ = fs.fsync(*ino, false);
            }
            1 => {
                let _ = fs.setattr(
                    *ino,
                    &SetAttr {
                        size: Some(700),
                        ..Default::default()
                    },
                );
                let _ = fs.setxattr(*ino, b"user.more", b"x", flags);
                let _ = fs.removexattr(*ino, b"user.small");
            }
            _ => {
                let _ = fs.fallocate(
                    *ino,
                    0,
                    4096,
                    FallocFlags {
                        punch_hole: true,
                        keep_size: true,
                        ..Default::default()
                    },
                );
                let _ = fs.unlink(*dir, name);
            }
        }
        let _ = fs.release(*ino);
    }
    for (dir, ino, name) in found.dirs.iter().take(4) {
        let _ = fs.create(*ino, b"fz-in-dir", 0o600, 0, 0);
        let _ = fs.rename(*dir, name, r, b"fz-renamed-dir", RenameFlags::default());
        let _ = fs.rmdir(r, b"fz-renamed-dir");
        let _ = fs.fsyncdir(*ino);
    }
    let _ = fs.unlink(r, b"fz-link");
}

/// One fuzz case: pick a template with `data[0]`, mutate it with the rest, mount,
/// walk, modify; take a crash image while mounted; unmount; mount both results
/// again (journal and fast-commit replay) and walk them. Returns the number of
/// mounts that succeeded (0..=3), for statistics.
pub fn run_case(t: &Templates, data: &[u8]) -> usize {
    let Some((&pick, rest)) = data.split_first() else {
        return 0;
    };
    let tpl = &t.all[pick as usize % t.all.len()];
    let img = mutate(tpl, rest);
    let mut mounts = 0;
    let Ok((dev, fs)) = mount(img) else {
        return mounts;
    };
    mounts += 1;
    let found = walk(&fs, true);
    let crash = if fs.is_read_only() {
        None
    } else {
        modify(&fs, &found);
        Some(dev.contents())
    };
    let _ = fs.unmount();
    drop(fs);
    let after = dev.contents();
    drop(dev);
    for img in [Some(after), crash].into_iter().flatten() {
        if let Ok((_, fs)) = mount(img) {
            mounts += 1;
            walk(&fs, true);
            let _ = fs.unmount();
        }
    }
    mounts
}
