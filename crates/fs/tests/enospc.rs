//! Running out of space: small images (8 MiB, 1 KiB and 4 KiB blocks) are filled
//! through the library until blocks, then inodes, run out. The error must be
//! `FsError::NoSpace`, data written before must read back intact, the image must pass
//! `e2fsck -fn` after unmount, deleting everything must give the free counts back
//! (exactly, apart from directory blocks that legitimately stay allocated), and the
//! file system must be usable again afterwards.

use commitfs_fs::testutil::{fsck, mkfs, problem_lines};
use commitfs_fs::{
    Attr, FallocFlags, Fs, FsError, Ino, MountOptions, SetAttr, StatFs, XattrFlags, ROOT_INO,
};
use std::path::Path;

const CHUNK: usize = 48 * 1024;
const FILE_SIZE: usize = 300 * 1024;

/// Deterministic content of file `n`.
fn content(n: usize, len: usize) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(n as u64 + 1).fill_bytes(&mut v);
    v
}

fn assert_clean(path: &Path, when: &str) {
    let r = fsck(path);
    assert!(
        r.is_clean(),
        "e2fsck -fn after {when} (exit {}):\n{}\n--- full output ---\n{}",
        r.code,
        problem_lines(&r.output).join("\n"),
        r.output
    );
}

fn open(path: &Path) -> Fs {
    Fs::open_path(path, MountOptions::default()).expect("mount")
}

/// Blocks (of the file system's size) charged to an inode.
fn fs_blocks(a: &Attr, bs: u32) -> u64 {
    a.blocks * 512 / bs as u64
}

fn is_nospace<T: std::fmt::Debug>(r: &Result<T, FsError>) -> bool {
    matches!(r, Err(FsError::NoSpace))
}

/// Files written so far: (parent, name, bytes that were accepted).
struct Written {
    files: Vec<(Ino, Vec<u8>, usize)>,
}

impl Written {
    fn verify(&self, fs: &Fs, when: &str) {
        let mut buf = vec![0u8; FILE_SIZE];
        for (i, (parent, name, len)) in self.files.iter().enumerate() {
            let a = fs.lookup(*parent, name).unwrap_or_else(|e| {
                panic!("{when}: lookup {:?}: {e}", String::from_utf8_lossy(name))
            });
            assert_eq!(a.size as usize, *len, "{when}: size of file {i}");
            let n = fs.read(a.ino, 0, &mut buf[..*len]).expect("read back");
            assert_eq!(n, *len, "{when}: short read of file {i}");
            assert!(
                buf[..*len] == content(i, FILE_SIZE)[..*len],
                "{when}: content of file {i} differs"
            );
        }
    }
}

/// Fill with data until the first `NoSpace`; returns what was written.
fn fill_with_data(fs: &Fs, dirs: &[Ino]) -> Written {
    let mut w = Written { files: Vec::new() };
    'files: for i in 0.. {
        assert!(i < 10_000, "never ran out of space");
        let parent = dirs[i % dirs.len()];
        let name = format!("data-{i:04}").into_bytes();
        let r = fs.create(parent, &name, 0o644, 0, 0);
        if is_nospace(&r) {
            break;
        }
        let a = r.unwrap_or_else(|e| panic!("create file {i}: {e}"));
        let data = content(i, FILE_SIZE);
        let mut off = 0;
        w.files.push((parent, name, 0));
        while off < FILE_SIZE {
            let end = (off + CHUNK).min(FILE_SIZE);
            let want = end - off;
            let size_of = |fs: &Fs| fs.getattr(a.ino).expect("getattr").size as usize;
            match fs.write(a.ino, off as u64, &data[off..end]) {
                Ok(n) => {
                    assert!(n <= want);
                    off += n;
                    w.files.last_mut().expect("pushed").2 = off;
                    assert_eq!(
                        size_of(fs),
                        off,
                        "file {i}: size after a write that returned Ok({n}) of {want}"
                    );
                    if n < want {
                        // A short write means the space ran out within this chunk;
                        // the next write must say so, and change nothing.
                        let again = fs.write(a.ino, off as u64, &data[off..end]);
                        assert!(is_nospace(&again), "write after a short write: {again:?}");
                        assert_eq!(size_of(fs), off, "file {i}: size after a NoSpace write");
                        break 'files;
                    }
                }
                Err(FsError::NoSpace) => {
                    assert_eq!(size_of(fs), off, "file {i}: size after a NoSpace write");
                    break 'files;
                }
                Err(e) => panic!("write to file {i} at {off}: {e} (expected NoSpace)"),
            }
        }
    }
    w
}

fn data_exhaustion(bs: &str) {
    let img = mkfs("enospc-data", 8, &["-b", bs]);
    let bsz: u32 = bs.parse().expect("block size");
    let (start, root_before, written) = {
        let fs = open(&img.path);
        let start: StatFs = fs.statfs().expect("statfs");
        let root_before = fs_blocks(&fs.getattr(ROOT_INO).expect("root"), bsz);
        let sub = fs.mkdir(ROOT_INO, b"sub", 0o755, 0, 0).expect("mkdir").ino;
        let written = fill_with_data(&fs, &[ROOT_INO, sub]);
        assert!(
            written.files.len() > 3,
            "{bs}: too few files before NoSpace"
        );
        let st = fs.statfs().expect("statfs");
        // Out of space means (almost) nothing left: at most one chunk's worth of
        // blocks may remain that the last write could not use in one piece, plus the
        // blocks a metadata allocation may still hold back.
        assert!(
            st.blocks_free * (bsz as u64) < 4 * CHUNK as u64 + 64 * bsz as u64,
            "{bs}: NoSpace with {} blocks still free",
            st.blocks_free
        );
        // Further allocations fail the same way, nothing else.
        let r = fs.create(ROOT_INO, b"late", 0o644, 0, 0);
        match r {
            Ok(a) => {
                let w = fs.write(a.ino, 0, &vec![1u8; 8 * CHUNK]);
                assert!(
                    is_nospace(&w) || matches!(w, Ok(n) if n < 8 * CHUNK),
                    "{bs}: a big write on a full fs returned {w:?}"
                );
                fs.unlink(ROOT_INO, b"late").expect("unlink late");
            }
            Err(FsError::NoSpace) => {}
            Err(e) => panic!("{bs}: create on a full fs: {e}"),
        }
        let r = fs.mkdir(sub, b"more", 0o755, 0, 0);
        assert!(
            r.is_ok() || is_nospace(&r),
            "{bs}: mkdir on a full fs returned {r:?}"
        );
        if r.is_ok() {
            fs.rmdir(sub, b"more").expect("rmdir more");
        }
        // Other kinds of block allocation on the full file system.
        let f0 = fs
            .lookup(ROOT_INO, &written.files[0].1)
            .expect("file 0")
            .ino;
        let big = vec![b'x'; bsz as usize / 2];
        let r = fs.setxattr(f0, b"user.big", &big, XattrFlags::default());
        assert!(
            r.is_ok() || is_nospace(&r),
            "{bs}: setxattr on a full fs: {r:?}"
        );
        let long = vec![b'l'; 300];
        let r = fs.symlink(sub, b"longlink", &long, 0, 0);
        assert!(
            r.is_ok() || is_nospace(&r),
            "{bs}: long symlink on a full fs: {r:?}"
        );
        if r.is_ok() {
            fs.unlink(sub, b"longlink").expect("unlink longlink");
        }
        let r = fs.fallocate(
            f0,
            FILE_SIZE as u64,
            16 * CHUNK as u64,
            FallocFlags::default(),
        );
        assert!(
            r.is_ok() || is_nospace(&r),
            "{bs}: fallocate on a full fs: {r:?}"
        );
        if r.is_ok() {
            let set = SetAttr {
                size: Some(written.files[0].2 as u64),
                ..Default::default()
            };
            fs.setattr(f0, &set).expect("truncate back");
        }
        // Many new names in the sub directory: its blocks fill up at some point.
        let mut names = Vec::new();
        for k in 0..400 {
            let name = format!("name-{k:04}-{}", "p".repeat(40)).into_bytes();
            match fs.link(f0, sub, &name) {
                Ok(_) => names.push(name),
                Err(FsError::NoSpace) => break,
                Err(e) => panic!("{bs}: link on a full fs: {e}"),
            }
        }
        for n in &names {
            fs.unlink(sub, n).expect("unlink extra name");
        }
        written.verify(&fs, "after NoSpace");
        fs.unmount().expect("unmount");
        (start, root_before, written)
    };
    assert_clean(&img.path, &format!("{bs}: filling to NoSpace"));

    // Remount, check, delete everything: the counts come back.
    {
        let fs = open(&img.path);
        written.verify(&fs, "after remount");
        for (parent, name, _) in &written.files {
            fs.unlink(*parent, name).expect("unlink");
        }
        fs.rmdir(ROOT_INO, b"sub").expect("rmdir sub");
        fs.sync().expect("sync");
        let st = fs.statfs().expect("statfs");
        let root_after = fs_blocks(&fs.getattr(ROOT_INO).expect("root"), bsz);
        let kept = root_after - root_before;
        assert_eq!(
            st.files_free, start.files_free,
            "{bs}: free inodes after deleting everything"
        );
        assert_eq!(
            st.blocks_free + kept,
            start.blocks_free,
            "{bs}: free blocks after deleting everything (root directory grew by {kept})"
        );
        fs.unmount().expect("unmount");
    }
    assert_clean(&img.path, &format!("{bs}: deleting everything"));

    // Usable again: fill half the space and read it back after a remount.
    {
        let fs = open(&img.path);
        let st = fs.statfs().expect("statfs");
        let half = (st.blocks_free * bsz as u64 / 2) as usize;
        let a = fs
            .create(ROOT_INO, b"again", 0o644, 0, 0)
            .expect("create again");
        let data = content(77, half);
        let mut off = 0;
        while off < half {
            let end = (off + CHUNK).min(half);
            let n = fs
                .write(a.ino, off as u64, &data[off..end])
                .expect("write after freeing space");
            assert_eq!(n, end - off);
            off = end;
        }
        fs.unmount().expect("unmount");
        drop(fs);
        let fs = open(&img.path);
        let ino = fs.resolve("/again").expect("resolve");
        let mut back = vec![0u8; half];
        assert_eq!(fs.read(ino, 0, &mut back).expect("read"), half);
        assert!(
            back == data,
            "{bs}: data written after freeing space differs"
        );
        fs.unmount().expect("unmount");
    }
    assert_clean(&img.path, &format!("{bs}: writing again"));
}

fn inode_exhaustion(bs: &str) {
    let img = mkfs("enospc-inodes", 8, &["-b", bs, "-N", "1024"]);
    let (start, created) = {
        let fs = open(&img.path);
        let start = fs.statfs().expect("statfs");
        assert!(start.files_free > 100 && start.files_free < 4096);
        let dirs: Vec<Ino> = (0..3)
            .map(|d| {
                fs.mkdir(ROOT_INO, format!("d{d}").as_bytes(), 0o755, 0, 0)
                    .expect("mkdir")
                    .ino
            })
            .collect();
        let mut created: Vec<(Ino, Vec<u8>, Ino)> = Vec::new();
        for i in 0.. {
            assert!(i < 100_000, "never ran out of inodes");
            let parent = dirs[i % dirs.len()];
            let name = format!("empty-file-{i:06}").into_bytes();
            match fs.create(parent, &name, 0o600, 1, 1) {
                Ok(a) => created.push((parent, name, a.ino)),
                Err(FsError::NoSpace) => break,
                Err(e) => panic!("{bs}: create {i}: {e} (expected NoSpace eventually)"),
            }
        }
        let st = fs.statfs().expect("statfs");
        assert_eq!(st.files_free, 0, "{bs}: NoSpace with inodes left");
        assert_eq!(
            created.len() as u64 + 3,
            start.files_free,
            "{bs}: every free inode is usable"
        );
        for r in [
            fs.mkdir(ROOT_INO, b"nodir", 0o755, 0, 0).map(|_| ()),
            fs.symlink(ROOT_INO, b"nolink", b"target", 0, 0).map(|_| ()),
            fs.create(dirs[0], b"one-more", 0o644, 0, 0).map(|_| ()),
        ] {
            assert!(
                is_nospace(&r),
                "{bs}: allocation with no inodes left: {r:?}"
            );
        }
        // Hard links need no inode.
        let ino = created[0].2;
        fs.link(ino, ROOT_INO, b"hardlink")
            .expect("link with no free inode");
        fs.unlink(ROOT_INO, b"hardlink").expect("unlink hardlink");
        fs.unmount().expect("unmount");
        (start, created)
    };
    assert_clean(&img.path, &format!("{bs}: running out of inodes"));
    {
        let fs = open(&img.path);
        for (parent, name, ino) in &created {
            let a = fs.lookup(*parent, name).expect("lookup after remount");
            assert_eq!(a.ino, *ino);
            assert_eq!((a.size, a.uid, a.gid), (0, 1, 1));
        }
        for (parent, name, _) in &created {
            fs.unlink(*parent, name).expect("unlink");
        }
        for d in 0..3 {
            fs.rmdir(ROOT_INO, format!("d{d}").as_bytes())
                .expect("rmdir");
        }
        fs.sync().expect("sync");
        let st = fs.statfs().expect("statfs");
        assert_eq!(
            st.files_free, start.files_free,
            "{bs}: free inodes restored"
        );
        // Usable again.
        for i in 0..50 {
            fs.create(ROOT_INO, format!("again-{i}").as_bytes(), 0o644, 0, 0)
                .expect("create after freeing inodes");
        }
        fs.unmount().expect("unmount");
    }
    assert_clean(
        &img.path,
        &format!("{bs}: freeing inodes and creating again"),
    );
}

#[test]
fn data_exhaustion_1k() {
    data_exhaustion("1024");
}

#[test]
fn data_exhaustion_4k() {
    data_exhaustion("4096");
}

#[test]
fn inode_exhaustion_1k() {
    inode_exhaustion("1024");
}

#[test]
fn inode_exhaustion_4k() {
    inode_exhaustion("4096");
}
