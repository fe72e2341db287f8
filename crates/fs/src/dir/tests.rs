//! Tests of directory operations on real images: large directories on 1 KiB and
//! 4 KiB blocks, random operation sequences against a model, readdir stability,
//! ENOSPC, a full htree, corruption. Every image is judged by `e2fsck -fn` (output,
//! not just exit code) and, where it matters, by the kernel through a read-only loop
//! mount.

use std::collections::{HashMap, HashSet};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use commitfs_format::dx;
use commitfs_format::inode::FL_INDEX;

use crate::testutil::{self, TempImage};
use crate::{Fs, FsError, MountOptions, RenameFlags, ROOT_INO};

// ---- helpers -------------------------------------------------------------------------

fn image(tag: &str, bs: u32, mib: u64, extra: &[&str]) -> TempImage {
    let bs = bs.to_string();
    let mut args = vec!["-b", bs.as_str()];
    args.extend_from_slice(extra);
    testutil::mkfs(tag, mib, &args)
}

fn open(img: &TempImage) -> Fs {
    Fs::open_path(&img.path, MountOptions::default()).expect("mount")
}

/// A random file name: mostly short, sometimes up to 255 bytes, with bytes >= 0x80
/// (signed vs unsigned hashing) but never '/' or NUL, never "." or "..".
fn random_name(rng: &mut StdRng) -> Vec<u8> {
    let len = match rng.gen_range(0..10) {
        0 => rng.gen_range(1..=255),
        1..=2 => rng.gen_range(1..=4),
        _ => rng.gen_range(5..=40),
    };
    loop {
        let n: Vec<u8> = (0..len)
            .map(|_| loop {
                let b: u8 = if rng.gen_bool(0.1) {
                    rng.gen_range(0x80..=0xFF)
                } else {
                    rng.gen_range(0x21..0x7F)
                };
                if b != b'/' {
                    break b;
                }
            })
            .collect();
        if n != b"." && n != b".." {
            return n;
        }
    }
}

/// Names -> inode, with O(1) random choice.
#[derive(Default)]
struct Model {
    v: Vec<(Vec<u8>, u32)>,
    pos: HashMap<Vec<u8>, usize>,
}

impl Model {
    fn insert(&mut self, name: Vec<u8>, ino: u32) {
        if let Some(&p) = self.pos.get(&name) {
            self.v[p].1 = ino;
            return;
        }
        self.pos.insert(name.clone(), self.v.len());
        self.v.push((name, ino));
    }
    fn remove(&mut self, name: &[u8]) -> Option<u32> {
        let p = self.pos.remove(name)?;
        let (_, ino) = self.v.swap_remove(p);
        if p < self.v.len() {
            let moved = self.v[p].0.clone();
            self.pos.insert(moved, p);
        }
        Some(ino)
    }
    fn get(&self, name: &[u8]) -> Option<u32> {
        self.pos.get(name).map(|&p| self.v[p].1)
    }
    fn pick(&self, rng: &mut StdRng) -> Option<(Vec<u8>, u32)> {
        if self.v.is_empty() {
            return None;
        }
        Some(self.v[rng.gen_range(0..self.v.len())].clone())
    }
    fn len(&self) -> usize {
        self.v.len()
    }
    fn names(&self) -> HashSet<Vec<u8>> {
        self.v.iter().map(|(n, _)| n.clone()).collect()
    }
}

/// Compare a directory's readdir with the model, and look every name up.
fn check_dir(fs: &Fs, dir: u32, m: &Model) {
    let entries = fs.readdir_all(dir).unwrap();
    assert_eq!(entries[0].name, b".");
    assert_eq!(entries[0].ino, dir);
    assert_eq!(entries[1].name, b"..");
    let mut seen = HashMap::new();
    for e in &entries[2..] {
        assert!(e.next_offset >= 3 && e.next_offset <= i64::MAX as u64);
        assert!(
            seen.insert(e.name.clone(), e.ino).is_none(),
            "duplicate {:?}",
            e.name
        );
    }
    assert_eq!(seen.len(), m.len());
    for (name, ino) in &m.v {
        assert_eq!(seen.get(name), Some(ino), "readdir of {name:?}");
        assert_eq!(fs.lookup(dir, name).unwrap().ino, *ino);
    }
}

/// Demand a silent `e2fsck -fn`: exit 0 and nothing but banners and the summary.
/// (The summary reads "N/M files (x% non-contiguous), ..." once files are
/// fragmented, which `testutil::problem_lines` does not recognise yet.)
fn assert_fsck_clean(path: &Path) {
    let r = testutil::fsck(path);
    let problems: Vec<String> = testutil::problem_lines(&r.output)
        .into_iter()
        .filter(|l| {
            !(l.contains(" files (") && l.contains("non-contiguous") && l.ends_with(" blocks"))
        })
        .collect();
    assert!(
        r.code == 0 && problems.is_empty(),
        "e2fsck -fn reported problems (exit {}):\n{}",
        r.code,
        r.output
    );
}

/// Commit now and then so a long test never builds one oversized transaction.
fn tick(fs: &Fs, step: usize) {
    if step % 256 == 255 {
        fs.sync().unwrap();
    }
}

/// Unmount, then demand a silent `e2fsck -fn`.
fn finish(fs: Fs, img: &TempImage) {
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

/// A read-only kernel loop mount, unmounted (and its mount point removed) on drop.
struct KernelMount {
    dir: PathBuf,
    /// Loop device, e.g. "loop3".
    dev: String,
    /// Kernel log lines before the mount.
    log_start: usize,
}

fn kernel_log() -> Vec<String> {
    let out = Command::new("dmesg").output().expect("run dmesg");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

impl KernelMount {
    fn new(img: &Path) -> KernelMount {
        let dir = img.with_extension("mnt");
        std::fs::create_dir_all(&dir).unwrap();
        let log_start = kernel_log().len();
        let out = Command::new("mount")
            .args(["-t", "ext4", "-o", "ro,loop"])
            .arg(img)
            .arg(&dir)
            .output()
            .expect("run mount");
        if !out.status.success() {
            let _ = std::fs::remove_dir(&dir);
            panic!(
                "kernel mount failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let src = Command::new("findmnt")
            .args(["-n", "-o", "SOURCE"])
            .arg(&dir)
            .output()
            .expect("run findmnt");
        let dev = String::from_utf8_lossy(&src.stdout)
            .trim()
            .trim_start_matches("/dev/")
            .to_owned();
        KernelMount {
            dir,
            dev,
            log_start,
        }
    }

    /// Names in `rel` as the kernel lists them; each is also looked up (stat), which
    /// goes through the kernel's htree lookup.
    fn list(&self, rel: &str) -> HashSet<Vec<u8>> {
        let d = self.dir.join(rel);
        let mut out = HashSet::new();
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().as_bytes().to_vec();
            std::fs::symlink_metadata(d.join(e.file_name()))
                .unwrap_or_else(|err| panic!("kernel lookup of {name:?}: {err}"));
            assert!(out.insert(name), "kernel lists a name twice");
        }
        out
    }

    /// The kernel logged no ext4 error or warning for our device while mounted
    /// (the loop device is ours alone until the unmount).
    fn assert_no_kernel_complaints(&self) {
        let tag_e = format!("EXT4-fs error (device {})", self.dev);
        let tag_w = format!("EXT4-fs warning (device {})", self.dev);
        let log = kernel_log();
        let bad: Vec<&String> = log
            .iter()
            .skip(self.log_start)
            .filter(|l| l.contains(&tag_e) || l.contains(&tag_w))
            .collect();
        assert!(bad.is_empty(), "kernel complained:\n{bad:#?}");
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Mount the image with the kernel and compare each directory with its model.
fn kernel_check(img: &TempImage, dirs: &[(&str, &Model)]) {
    let m = KernelMount::new(&img.path);
    for (rel, model) in dirs {
        let got = m.list(rel);
        assert_eq!(got.len(), model.len(), "kernel entry count in {rel}");
        assert_eq!(got, model.names(), "kernel names in {rel}");
    }
    m.assert_no_kernel_complaints();
}

fn dir_index_state(fs: &Fs, dir: u32) -> (bool, Option<(u8, usize)>) {
    let mut g = fs.inner.lock();
    let i = g.read_inode(dir).unwrap();
    g.dir_lookup(dir, b".").unwrap();
    let dirs = g.dirs.clone();
    let d = dirs.lock();
    let st = d.map.get(&dir).unwrap();
    (
        i.has_flag(FL_INDEX),
        st.dx.as_ref().map(|d| (d.levels, d.root.len())),
    )
}

// ---- tests ---------------------------------------------------------------------------

/// 20,000+ names in one directory: add, look up, remove, add again.
fn many_names(bs: u32) {
    let img = image("dir-many", bs, 128, &["-N", "40000"]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let mut rng = StdRng::seed_from_u64(bs as u64);
    let mut m = Model::default();
    for i in 0..22_000u32 {
        tick(&fs, i as usize);
        let name = if i % 3 == 0 {
            random_name(&mut rng)
        } else {
            format!("file-{i:06}").into_bytes()
        };
        if m.get(&name).is_some() {
            continue;
        }
        let a = fs.create(d, &name, 0o644, 0, 0).unwrap();
        m.insert(name, a.ino);
    }
    check_dir(&fs, d, &m);
    let (indexed, dx) = dir_index_state(&fs, d);
    assert!(indexed);
    if bs == 1024 {
        assert_eq!(
            dx.unwrap().0,
            1,
            "20k names on 1 KiB blocks need an interior level"
        );
    }
    // Remove about half, add new ones, check again.
    for i in 0..11_000 {
        tick(&fs, i);
        let (name, _) = m.pick(&mut rng).unwrap();
        fs.unlink(d, &name).unwrap();
        m.remove(&name);
        assert!(matches!(fs.lookup(d, &name), Err(FsError::NotFound)));
    }
    for i in 0..5000u32 {
        tick(&fs, i as usize);
        let name = format!("again-{i}").into_bytes();
        let a = fs.create(d, &name, 0o644, 0, 0).unwrap();
        m.insert(name, a.ino);
    }
    check_dir(&fs, d, &m);
    // A fresh mount rebuilds the in-memory index from disk.
    finish(fs, &img);
    let fs = open(&img);
    check_dir(&fs, d, &m);
    drop(fs);
    assert_fsck_clean(&img.path);
    kernel_check(&img, &[("d", &m)]);
}

#[test]
fn many_names_1k_blocks() {
    many_names(1024);
}

#[test]
fn many_names_4k_blocks() {
    many_names(4096);
}

/// Random interleavings of create/unlink/rename/rename-over/mkdir/rmdir in two
/// directories, checked against a model.
fn random_ops(bs: u32, seed: u64, ops: usize) {
    let img = image("dir-rand", bs, 96, &["-N", "30000"]);
    let fs = open(&img);
    let a = fs.mkdir(ROOT_INO, b"a", 0o755, 0, 0).unwrap().ino;
    let b = fs.mkdir(ROOT_INO, b"b", 0o755, 0, 0).unwrap().ino;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ma = Model::default();
    let mut mb = Model::default();
    let mut subdirs: HashSet<u32> = HashSet::new();
    for step in 0..ops {
        tick(&fs, step);
        let (dir, other) = if rng.gen_bool(0.7) { (a, b) } else { (b, a) };
        let (m, mo) = if dir == a {
            (&mut ma, &mut mb)
        } else {
            (&mut mb, &mut ma)
        };
        match rng.gen_range(0..100) {
            0..=49 => {
                let name = random_name(&mut rng);
                let r = if rng.gen_range(0..20) == 0 {
                    fs.mkdir(dir, &name, 0o755, 0, 0)
                } else {
                    fs.create(dir, &name, 0o644, 0, 0)
                };
                match m.get(&name) {
                    Some(_) => assert!(matches!(r, Err(FsError::Exists))),
                    None => {
                        let at = r.unwrap();
                        if at.kind == crate::FileType::Directory {
                            subdirs.insert(at.ino);
                        }
                        m.insert(name, at.ino);
                    }
                }
            }
            50..=74 => {
                if let Some((name, ino)) = m.pick(&mut rng) {
                    if subdirs.remove(&ino) {
                        fs.rmdir(dir, &name).unwrap();
                    } else {
                        fs.unlink(dir, &name).unwrap();
                    }
                    m.remove(&name);
                }
            }
            75..=89 => {
                // rename, possibly across directories, possibly over an existing file
                if let Some((name, ino)) = m.pick(&mut rng) {
                    let to_other = rng.gen_bool(0.3);
                    let (tdir, tm) = if to_other {
                        (other, &mut *mo)
                    } else {
                        (dir, &mut *m)
                    };
                    let target = if rng.gen_bool(0.3) {
                        tm.pick(&mut rng).map(|x| x.0)
                    } else {
                        None
                    }
                    .unwrap_or_else(|| random_name(&mut rng));
                    if target == name && !to_other {
                        continue;
                    }
                    let existing = tm.get(&target);
                    let src_dir = subdirs.contains(&ino);
                    let dst_dir = existing.map(|i| subdirs.contains(&i));
                    let r = fs.rename(dir, &name, tdir, &target, RenameFlags::default());
                    match dst_dir {
                        Some(true) if !src_dir => assert!(matches!(r, Err(FsError::IsDir))),
                        Some(false) if src_dir => assert!(matches!(r, Err(FsError::NotDir))),
                        _ => {
                            r.unwrap();
                            if let Some(old) = existing {
                                subdirs.remove(&old);
                            }
                            m.remove(&name);
                            let tm = if to_other { &mut *mo } else { &mut *m };
                            tm.insert(target, ino);
                        }
                    }
                }
            }
            _ => {
                let name = random_name(&mut rng);
                let got = fs.lookup(dir, &name).map(|x| x.ino).ok();
                assert_eq!(got, m.get(&name));
            }
        }
        if step % 3000 == 0 {
            check_dir(&fs, a, &ma);
            check_dir(&fs, b, &mb);
        }
    }
    check_dir(&fs, a, &ma);
    check_dir(&fs, b, &mb);
    finish(fs, &img);
    kernel_check(&img, &[("a", &ma), ("b", &mb)]);
}

#[test]
fn random_ops_1k_blocks() {
    random_ops(1024, 1, 25_000);
}

#[test]
fn random_ops_4k_blocks() {
    random_ops(4096, 2, 25_000);
}

/// A readdir resumed at a returned offset, after adds/removes that split leaves and
/// grow the index, returns every entry present throughout exactly once.
#[test]
fn readdir_offsets_stable_under_modification() {
    let img = image("dir-rd", 1024, 96, &["-N", "60000"]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let mut rng = StdRng::seed_from_u64(7);
    let mut m = Model::default();
    for i in 0..3000 {
        tick(&fs, i);
        let name = format!("base-{i}").into_bytes();
        let ino = fs.create(d, &name, 0o644, 0, 0).unwrap().ino;
        m.insert(name, ino);
    }
    for round in 0..4 {
        let initial = m.names();
        let mut removed: HashSet<Vec<u8>> = HashSet::new();
        let mut seen: HashMap<Vec<u8>, u32> = HashMap::new();
        let mut offset = 0u64;
        let mut added = 0;
        loop {
            // Read a small chunk.
            let mut got = Vec::new();
            let chunk = rng.gen_range(1..60);
            fs.readdir(d, offset, |e| {
                got.push(e);
                got.len() < chunk
            })
            .unwrap();
            if got.is_empty() {
                break;
            }
            for e in &got {
                assert!(e.next_offset != 0 && e.next_offset <= i64::MAX as u64);
                *seen.entry(e.name.clone()).or_insert(0) += 1;
            }
            offset = got.last().unwrap().next_offset;
            fs.sync().unwrap();
            // Modify the directory between chunks: enough inserts to split leaves
            // and grow the index, and removals of seen and unseen names.
            for _ in 0..rng.gen_range(0..40) {
                let name = format!("r{round}-{added}").into_bytes();
                added += 1;
                let ino = fs.create(d, &name, 0o644, 0, 0).unwrap().ino;
                m.insert(name, ino);
            }
            for _ in 0..rng.gen_range(0..20) {
                let (name, _) = m.pick(&mut rng).unwrap();
                fs.unlink(d, &name).unwrap();
                m.remove(&name);
                removed.insert(name);
            }
        }
        for name in &initial {
            if removed.contains(name) {
                continue;
            }
            assert_eq!(seen.get(name), Some(&1), "round {round}: {name:?}");
        }
        for (name, n) in &seen {
            assert_eq!(*n, 1, "round {round}: {name:?} returned {n} times");
        }
        assert!(seen.contains_key(b".".as_slice()) && seen.contains_key(b"..".as_slice()));
    }
    let (_, dx) = dir_index_state(&fs, d);
    assert_eq!(
        dx.unwrap().0,
        1,
        "the test should have grown an interior level"
    );
    check_dir(&fs, d, &m);
    finish(fs, &img);
    kernel_check(&img, &[("d", &m)]);
}

/// Resuming at every offset returned gives exactly the rest of the listing.
#[test]
fn readdir_resume_at_each_offset() {
    let img = image("dir-rd2", 4096, 32, &[]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    for i in 0..300 {
        fs.create(d, format!("n{i}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    let all = fs.readdir_all(d).unwrap();
    assert_eq!(all.len(), 302);
    for (i, e) in all.iter().enumerate() {
        let mut rest = Vec::new();
        fs.readdir(d, e.next_offset, |x| {
            rest.push(x.name);
            true
        })
        .unwrap();
        let want: Vec<Vec<u8>> = all[i + 1..].iter().map(|x| x.name.clone()).collect();
        assert_eq!(rest, want);
    }
    finish(fs, &img);
}

/// Running out of blocks while a directory grows returns NoSpace and leaves a
/// consistent directory.
#[test]
fn enospc_leaves_directory_consistent() {
    for bs in [1024u32, 4096] {
        let img = image("dir-enospc", bs, 8, &["-N", "4096"]);
        let fs = open(&img);
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
        // Entries are hard links to one file, so only the directory needs space.
        let t = fs.create(ROOT_INO, b"target", 0o644, 0, 0).unwrap().ino;
        // Fill the data area with one file.
        let f = fs.create(ROOT_INO, b"fill", 0o644, 0, 0).unwrap().ino;
        let chunk = vec![0xA5u8; 64 * 1024];
        let mut off = 0u64;
        loop {
            match fs.write(f, off, &chunk) {
                Ok(n) if n > 0 => off += n as u64,
                Ok(_) | Err(FsError::NoSpace) => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        let mut m = Model::default();
        let mut nospace = 0;
        for i in 0..3000 {
            tick(&fs, i);
            let name = format!("entry-with-a-longer-name-{i:05}").into_bytes();
            match fs.link(t, d, &name) {
                Ok(_) => m.insert(name, t),
                Err(FsError::NoSpace) => {
                    nospace += 1;
                    assert!(matches!(fs.lookup(d, &name), Err(FsError::NotFound)));
                    if nospace > 20 {
                        break;
                    }
                }
                Err(e) => panic!("link: {e}"),
            }
        }
        assert!(nospace > 0, "the directory should have run out of space");
        check_dir(&fs, d, &m);
        finish(fs, &img);
        kernel_check(&img, &[("d", &m)]);
        // Freeing space lets the directory grow again (freed blocks become reusable
        // once the freeing transaction commits).
        let fs = open(&img);
        fs.unlink(ROOT_INO, b"fill").unwrap();
        fs.sync().unwrap();
        for i in 0..200 {
            let name = format!("after-{i}").into_bytes();
            let a = fs
                .create(d, &name, 0o644, 0, 0)
                .unwrap_or_else(|e| panic!("bs {bs}: create after freeing space ({i}): {e}"));
            m.insert(name, a.ino);
        }
        check_dir(&fs, d, &m);
        finish(fs, &img);
        kernel_check(&img, &[("d", &m)]);
    }
}

/// Long names fill a 1 KiB-block htree (123 x 126 leaves); when the index is full,
/// NoSpace comes back and the directory stays valid.
#[test]
fn full_htree_returns_nospace() {
    let img = image("dir-full", 1024, 96, &["-N", "8192"]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let targets: Vec<u32> = (0..4)
        .map(|i| {
            fs.create(ROOT_INO, format!("t{i}").as_bytes(), 0o644, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    let mut m = Model::default();
    let mut full = false;
    for i in 0..80_000u32 {
        tick(&fs, i as usize);
        let mut name = format!("{i:08}-").into_bytes();
        name.resize(255, b'x');
        let t = targets[(i / 60_000) as usize];
        match fs.link(t, d, &name) {
            Ok(_) => m.insert(name, t),
            Err(FsError::NoSpace) => {
                full = true;
                break;
            }
            Err(e) => panic!("link {i}: {e}"),
        }
    }
    assert!(full, "index never filled");
    let (_, dx) = dir_index_state(&fs, d);
    let (levels, root_len) = dx.unwrap();
    let geo = fs.inner.lock().dx_geo();
    assert_eq!(levels, 1);
    assert_eq!(root_len, geo.root_limit());
    check_dir(&fs, d, &m);
    // Removing entries and re-adding works (into leaves that have room).
    let (name, _) = m.pick(&mut StdRng::seed_from_u64(1)).unwrap();
    fs.unlink(d, &name).unwrap();
    m.remove(&name);
    fs.link(targets[0], d, &name).unwrap();
    m.insert(name, targets[0]);
    finish(fs, &img);
    kernel_check(&img, &[("d", &m)]);
}

/// With `large_dir` the index grows a third level instead of failing.
#[test]
fn largedir_adds_second_interior_level() {
    let img = image("dir-large", 1024, 128, &["-N", "8192", "-O", "large_dir"]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let targets: Vec<u32> = (0..2)
        .map(|i| {
            fs.create(ROOT_INO, format!("t{i}").as_bytes(), 0o644, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    let mut m = Model::default();
    let mut i = 0u32;
    loop {
        let mut name = format!("{i:08}-").into_bytes();
        name.resize(255, b'y');
        let t = targets[(i / 60_000) as usize];
        fs.link(t, d, &name).unwrap();
        m.insert(name, t);
        i += 1;
        tick(&fs, i as usize);
        if i.is_multiple_of(1000) && dir_index_state(&fs, d).1.unwrap().0 == 2 {
            break;
        }
        assert!(i < 100_000, "no second level");
    }
    check_dir(&fs, d, &m);
    finish(fs, &img);
    kernel_check(&img, &[("d", &m)]);
}

/// Without dir_index a directory grows linearly; without metadata_csum blocks carry
/// no tails. Both stay e2fsck-clean and kernel-readable.
#[test]
fn feature_variants() {
    for (tag, opts) in [
        ("nodirindex", &["-O", "^dir_index"][..]),
        ("nocsum", &["-O", "^metadata_csum"][..]),
    ] {
        for bs in [1024u32, 4096] {
            let img = image(tag, bs, 64, &[&["-N", "20000"][..], opts].concat());
            let fs = open(&img);
            let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
            let mut rng = StdRng::seed_from_u64(bs as u64);
            let mut m = Model::default();
            for i in 0..4000 {
                tick(&fs, i);
                let name = random_name(&mut rng);
                if m.get(&name).is_some() {
                    continue;
                }
                let a = fs.create(d, &name, 0o644, 0, 0).unwrap();
                m.insert(name, a.ino);
            }
            for i in 0..1000 {
                tick(&fs, i);
                let (name, _) = m.pick(&mut rng).unwrap();
                fs.unlink(d, &name).unwrap();
                m.remove(&name);
            }
            let (indexed, _) = dir_index_state(&fs, d);
            assert_eq!(indexed, tag != "nodirindex", "{tag}");
            check_dir(&fs, d, &m);
            finish(fs, &img);
            kernel_check(&img, &[("d", &m)]);
        }
    }
}

/// Directories the kernel toolchain built (mkfs -d, e2fsck -D) are read and
/// extended correctly.
#[test]
fn extends_directories_built_by_e2fsprogs() {
    let src = std::env::temp_dir().join(format!("commitfs-dir-src-{}", std::process::id()));
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = Rm(src.clone());
    std::fs::create_dir_all(src.join("big")).unwrap();
    for i in 0..5000 {
        std::fs::write(src.join("big").join(format!("pre-{i}-\u{e9}")), b"").unwrap();
    }
    let img = image(
        "dir-pre",
        1024,
        64,
        &["-N", "20000", "-d", src.to_str().unwrap()],
    );
    let out = Command::new("e2fsck")
        .arg("-fyD")
        .arg(&img.path)
        .output()
        .unwrap();
    assert!(out.status.code().unwrap_or(9) <= 1);
    assert_fsck_clean(&img.path);
    let fs = open(&img);
    let d = fs.resolve("/big").unwrap();
    let mut m = Model::default();
    for e in fs.readdir_all(d).unwrap().into_iter().skip(2) {
        m.insert(e.name, e.ino);
    }
    assert_eq!(m.len(), 5000);
    assert!(dir_index_state(&fs, d).0);
    let mut rng = StdRng::seed_from_u64(3);
    for i in 0..4000 {
        tick(&fs, i);
        let name = format!("new-{i}").into_bytes();
        let a = fs.create(d, &name, 0o644, 0, 0).unwrap();
        m.insert(name, a.ino);
        if i % 2 == 0 {
            let (n, _) = m.pick(&mut rng).unwrap();
            fs.unlink(d, &n).unwrap();
            m.remove(&n);
        }
    }
    check_dir(&fs, d, &m);
    finish(fs, &img);
    kernel_check(&img, &[("big", &m)]);
}

/// Damaged directory blocks give typed corruption errors, never panics.
#[test]
fn corrupt_blocks_give_typed_errors() {
    let img = image("dir-bad", 1024, 16, &[]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    for i in 0..200 {
        fs.create(d, format!("name-{i}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    let pblocks = {
        let mut g = fs.inner.lock();
        g.dir_lookup(d, b".").unwrap();
        let p = g.dirs.lock().map[&d].pblocks.clone();
        p
    };
    finish(fs, &img);
    assert!(pblocks.len() >= 3);
    let bs = 1024u64;
    let original = std::fs::read(&img.path).unwrap();
    // (block, byte offset, xor): root checksum area, a leaf record, a leaf rec_len.
    for (lblk, off, x) in [
        (0usize, 0x28usize, 0x01u8),
        (1, 20, 0x40),
        (2, 4, 0x03),
        (1, 1020, 0xFF),
    ] {
        let mut data = original.clone();
        data[(pblocks[lblk] * bs) as usize + off] ^= x;
        std::fs::write(&img.path, &data).unwrap();
        let fs = Fs::open_path(
            &img.path,
            MountOptions {
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
        let e = fs.lookup(d, b"name-1").unwrap_err();
        assert!(e.is_corruption(), "block {lblk} offset {off}: {e}");
        let e = fs.readdir_all(d).unwrap_err();
        assert!(e.is_corruption());
        drop(fs);
    }
    std::fs::write(&img.path, &original).unwrap();
}

/// The on-disk index keeps dx limits and checksums that the format layer verifies.
#[test]
fn index_blocks_verify_after_growth() {
    let img = image("dir-verify", 4096, 64, &["-N", "20000"]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    for i in 0..6000 {
        tick(&fs, i);
        fs.create(d, format!("verify-{i}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    let mut g = fs.inner.lock();
    g.dir_lookup(d, b".").unwrap();
    let st = g.dirs.lock().map.remove(&d).unwrap();
    let geo = g.dx_geo();
    let b0 = g.read_meta(st.pblocks[0]).unwrap().data().to_vec();
    dx::verify_csum(&b0, dx::ROOT_COUNT_OFFSET, st.seed, 0).unwrap();
    let root = dx::parse_root(&b0, &geo, 0).unwrap();
    assert_eq!(root.entries.len(), st.dx.as_ref().unwrap().root.len());
    drop(g);
    finish(fs, &img);
}

/// 100,000 names in one directory: inserts, lookups, a cold reload and readdir all
/// stay fast (the in-memory index makes each operation O(1) average).
#[test]
fn hundred_thousand_names() {
    let img = image("dir-100k", 4096, 512, &["-N", "120000"]);
    let fs = open(&img);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let t = std::time::Instant::now();
    let mut m = Model::default();
    for i in 0..100_000usize {
        tick(&fs, i);
        let name = format!("entry-{i:07}").into_bytes();
        let a = fs.create(d, &name, 0o644, 0, 0).unwrap();
        m.insert(name, a.ino);
    }
    let create = t.elapsed();
    let t = std::time::Instant::now();
    for (name, ino) in &m.v {
        assert_eq!(fs.lookup(d, name).unwrap().ino, *ino);
    }
    let lookup = t.elapsed();
    fs.sync().unwrap();
    // Cold: drop the in-memory index and rebuild it from disk.
    fs.inner.lock().dir_forget(d);
    let t = std::time::Instant::now();
    let n = fs.readdir_all(d).unwrap().len();
    let reload = t.elapsed();
    assert_eq!(n, 100_002);
    eprintln!("100k: create {create:?}, lookup {lookup:?}, reload+readdir {reload:?}");
    finish(fs, &img);
    kernel_check(&img, &[("d", &m)]);
}

/// Every hash algorithm, signed and unsigned (§2.5, §6.7), with names that contain
/// bytes >= 0x80: e2fsck and the kernel find every name where we put it.
#[test]
fn hash_algorithms_and_signedness() {
    for (alg, unsigned) in [
        ("legacy", false),
        ("legacy", true),
        ("half_md4", true),
        ("tea", false),
        ("tea", true),
    ] {
        let img = image("dir-hash", 1024, 32, &["-N", "8192"]);
        let run = |cmd: &str, args: &[&str]| {
            let out = Command::new(cmd)
                .args(args)
                .arg(&img.path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{cmd}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run("tune2fs", &["-E", &format!("hash_alg={alg}")]);
        if unsigned {
            run("debugfs", &["-w", "-R", "ssv flags 2"]);
        }
        let fs = open(&img);
        assert_eq!(fs.superblock().flags() & 2 != 0, unsigned);
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
        let mut rng = StdRng::seed_from_u64(11);
        let mut m = Model::default();
        for i in 0..3000 {
            tick(&fs, i);
            let name = random_name(&mut rng);
            if m.get(&name).is_some() {
                continue;
            }
            let a = fs.create(d, &name, 0o644, 0, 0).unwrap();
            m.insert(name, a.ino);
        }
        for i in 0..500 {
            tick(&fs, i);
            let (name, _) = m.pick(&mut rng).unwrap();
            fs.unlink(d, &name).unwrap();
            m.remove(&name);
        }
        assert!(dir_index_state(&fs, d).0, "{alg}");
        check_dir(&fs, d, &m);
        finish(fs, &img);
        kernel_check(&img, &[("d", &m)]);
    }
}

/// Moving an indexed and a linear directory to another parent rewrites '..' (in the
/// dx root, resp. the first leaf) with valid checksums.
#[test]
fn rename_across_parents_updates_dotdot() {
    for bs in [1024u32, 4096] {
        let img = image("dir-mv", bs, 32, &["-N", "8192"]);
        let fs = open(&img);
        let p1 = fs.mkdir(ROOT_INO, b"p1", 0o755, 0, 0).unwrap().ino;
        let p2 = fs.mkdir(ROOT_INO, b"p2", 0o755, 0, 0).unwrap().ino;
        let big = fs.mkdir(p1, b"big", 0o755, 0, 0).unwrap().ino;
        let small = fs.mkdir(p1, b"small", 0o755, 0, 0).unwrap().ino;
        let mut m = Model::default();
        for i in 0..2000 {
            let name = format!("f{i}").into_bytes();
            let a = fs.create(big, &name, 0o644, 0, 0).unwrap();
            m.insert(name, a.ino);
        }
        assert!(dir_index_state(&fs, big).0);
        assert!(!dir_index_state(&fs, small).0);
        let none = RenameFlags::default();
        fs.rename(p1, b"big", p2, b"big2", none).unwrap();
        fs.rename(p1, b"small", p2, b"small", none).unwrap();
        for d in [big, small] {
            assert_eq!(fs.lookup(d, b"..").unwrap().ino, p2);
        }
        assert_eq!(fs.getattr(p1).unwrap().nlink, 2);
        assert_eq!(fs.getattr(p2).unwrap().nlink, 4);
        finish(fs, &img);
        // A fresh mount reads '..' back from disk.
        let fs = open(&img);
        assert_eq!(fs.lookup(big, b"..").unwrap().ino, p2);
        assert_eq!(fs.lookup(small, b"..").unwrap().ino, p2);
        drop(fs);
        assert_fsck_clean(&img.path);
        kernel_check(&img, &[("p2/big2", &m)]);
    }
}
