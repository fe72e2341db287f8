//! Kernel-written images (acceptance point 2).
//!
//! The kernel (loop mount) builds an image with an htree directory of 10,000+
//! entries, a file whose extent tree has depth >= 2, sparse and preallocated files,
//! a > 4 GiB sparse file, long symlinks, device nodes, hard links, explicit times and
//! xattrs in blocks (including a block shared by several inodes). commitfs must see
//! exactly the kernel's tree; then commitfs modifies it (names added to and removed
//! from the big directory, writes/punch/truncate in the deep-tree file, xattr
//! changes on shared blocks); `e2fsck -fn` must be clean and the kernel must see
//! exactly commitfs's tree. Finally the kernel modifies commitfs's result once more
//! and e2fsck and commitfs must agree again.

mod common;

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::process::Command;

use commitfs_fs::{FallocFlags, Fs, Ino, RenameFlags, SetAttr, SetTime, Timestamp, XattrFlags};
use common::*;

const GIB: u64 = 1 << 30;
const BIG_DIR_ENTRIES: usize = 10_500;

/// Deterministic block content for the deep file (never all zero).
fn block_pattern(tag: u64, lblk: u64, bs: usize) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; bs];
    rand::rngs::StdRng::seed_from_u64((tag << 40) ^ lblk).fill_bytes(&mut v);
    // Never all zero (a zero block would read like a hole).
    v[0] |= 1;
    v
}

fn big_name(i: usize) -> String {
    // Names of varying length (8..~120 bytes) so leaf blocks fill unevenly.
    let pad = "abcdefghijklmnopqrstuvwxyz0123456789".repeat(4);
    let extra = (i * 7919) % 110;
    format!("e{i:05}_{}", &pad[..extra])
}

fn set_times(p: &Path, atime: (i64, i64), mtime: (i64, i64)) {
    let c = cpath(p);
    let ts = [
        libc::timespec {
            tv_sec: atime.0,
            tv_nsec: atime.1,
        },
        libc::timespec {
            tv_sec: mtime.0,
            tv_nsec: mtime.1,
        },
    ];
    // SAFETY: valid path and a two-element timespec array.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(
        r,
        0,
        "utimensat {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

/// Extent tree depth of a file as debugfs reports it (`ex` prints "level/depth").
fn extent_depth(image: &Path, path: &str) -> u32 {
    let out = run(Command::new("debugfs")
        .arg("-R")
        .arg(format!("ex {path}"))
        .arg(image))
    .expect("debugfs ex");
    out.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let (_, rest) = l.split_once('/')?;
            rest.split_whitespace().next()?.parse::<u32>().ok()
        })
        .max()
        .unwrap_or(0)
}

/// Whether a directory has the htree index flag (EXT4_INDEX_FL via FS_IOC_GETFLAGS).
fn has_index_flag(p: &Path) -> bool {
    let f = std::fs::File::open(p).expect("open dir");
    let mut flags: libc::c_long = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one long into `flags`.
    let r = unsafe {
        libc::ioctl(
            std::os::unix::io::AsRawFd::as_raw_fd(&f),
            0x8008_6601,
            &mut flags,
        )
    };
    assert_eq!(r, 0, "FS_IOC_GETFLAGS: {}", std::io::Error::last_os_error());
    flags & 0x1000 != 0
}

/// What the test expects of the deep file: its full content.
struct Deep {
    bs: usize,
    content: Vec<u8>,
}

impl Deep {
    fn write(&mut self, off: u64, data: &[u8]) {
        let end = off as usize + data.len();
        if self.content.len() < end {
            self.content.resize(end, 0);
        }
        self.content[off as usize..end].copy_from_slice(data);
    }
}

/// Build the tree with the kernel. Returns the deep file's expected content.
fn build_with_kernel(root: &Path, bs: usize) -> Deep {
    let r = |p: &str| root.join(p);
    // 1. The big htree directory.
    std::fs::create_dir(r("big")).unwrap();
    for i in 0..BIG_DIR_ENTRIES {
        let p = r("big").join(big_name(i));
        match i % 500 {
            0 => std::fs::create_dir(&p).unwrap(),
            250 => std::os::unix::fs::symlink(format!("target-of-{i}"), &p).unwrap(),
            333 => std::fs::hard_link(r("big").join(big_name(1)), &p).unwrap(),
            _ => {
                std::fs::File::create(&p).unwrap();
            }
        }
    }
    std::fs::write(r("big").join(big_name(1)), b"hard-linked content").unwrap();
    assert!(has_index_flag(&r("big")), "the kernel did not index /big");

    // 2. The deep extent tree: one block every other block. A leaf holds
    //    (bs-12)/12 extents and the in-inode root 4, so depth 2 needs more than
    //    4 leaves' worth.
    let per_leaf = (bs - 12) / 12;
    let nblocks = (4 * per_leaf + 200) as u64;
    let mut deep = Deep {
        bs,
        content: vec![],
    };
    {
        let f = std::fs::File::create(r("deep")).unwrap();
        for k in 0..nblocks {
            let data = block_pattern(1, 2 * k, bs);
            f.write_all_at(&data, 2 * k * bs as u64).unwrap();
            deep.write(2 * k * bs as u64, &data);
            if k % 64 == 63 {
                f.sync_data().unwrap(); // allocate in pieces, as a real workload would
            }
        }
        f.sync_all().unwrap();
    }

    // 3. Sparse and preallocated files.
    {
        let f = std::fs::File::create(r("sparse1")).unwrap();
        f.write_all_at(b"middle", 1 << 20).unwrap();
        f.write_all_at(&block_pattern(2, 0, 3000), 5 << 20).unwrap();
        f.set_len(9 << 20).unwrap();
        let g = std::fs::File::create(r("prealloc")).unwrap();
        g.write_all_at(&block_pattern(3, 0, 10_000), 0).unwrap();
        let fd = std::os::unix::io::AsRawFd::as_raw_fd(&g);
        // SAFETY: plain fallocate calls on an open file.
        unsafe {
            assert_eq!(libc::fallocate(fd, 0, 20_000, 300_000), 0);
            assert_eq!(
                libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, 400_000, 500_000),
                0
            );
        }
        g.write_all_at(b"inside-unwritten", 100_000).unwrap();
        std::fs::File::create(r("empty")).unwrap();
    }

    // 4. A sparse file above 4 GiB, with a write straddling the 4 GiB boundary.
    {
        let f = std::fs::File::create(r("huge")).unwrap();
        f.write_all_at(b"start", 0).unwrap();
        f.write_all_at(&block_pattern(4, 0, 5000), 4 * GIB - 2000)
            .unwrap();
        f.write_all_at(b"five gib", 5 * GIB).unwrap();
        f.set_len(6 * GIB + 123).unwrap();
    }

    // 5. Symlinks: fast, exactly at the boundary, slow, and as long as allowed.
    std::fs::create_dir(r("links")).unwrap();
    for (name, len) in [
        ("short", 10usize),
        ("fifty_nine", 59),
        ("sixty", 60),
        ("long", 300),
        ("max", bs - 1),
    ] {
        let t: String = (0..len).map(|i| (b'a' + (i % 26) as u8) as char).collect();
        std::os::unix::fs::symlink(t, r("links").join(name)).unwrap();
    }

    // 6. Extended attributes: in-inode only, block only, both, shared blocks.
    std::fs::create_dir(r("xa")).unwrap();
    for i in 0..6 {
        let p = r("xa").join(format!("f{i}"));
        std::fs::write(&p, format!("file {i}")).unwrap();
        set_xattr(&p, "user.small", b"v");
        if i < 4 {
            // Identical sets: the kernel shares one xattr block among f0..f3.
            set_xattr(&p, "user.big", &vec![b'B'; bs / 3]);
            set_xattr(&p, "trusted.shared", &[b'S'; 100]);
        } else {
            set_xattr(&p, "user.big", &vec![b'0' + i as u8; bs / 2]);
        }
    }
    set_xattr(&r("xa"), "user.on_dir", &vec![b'D'; bs / 4]);
    set_xattr(&r("deep"), "user.deep", b"deep attr");

    // 7. Special files, owners, modes, explicit times (incl. pre-1970, post-2038).
    std::fs::create_dir(r("special")).unwrap();
    let mk = |name: &str, mode: u32, dev: libc::dev_t| {
        let c = cpath(&r("special").join(name));
        // SAFETY: valid path.
        assert_eq!(
            unsafe { libc::mknod(c.as_ptr(), mode, dev) },
            0,
            "mknod {name}"
        );
    };
    mk("fifo", libc::S_IFIFO | 0o640, 0);
    mk("sock", libc::S_IFSOCK | 0o600, 0);
    mk("chr_old", libc::S_IFCHR | 0o666, libc::makedev(4, 64));
    mk("blk_new", libc::S_IFBLK | 0o660, libc::makedev(259, 70_000));
    std::fs::write(r("special/suid"), b"#!/bin/true\n").unwrap();
    let cs = cpath(&r("special/suid"));
    // SAFETY: valid path.
    unsafe {
        assert_eq!(libc::chmod(cs.as_ptr(), 0o4755), 0);
        assert_eq!(libc::lchown(cs.as_ptr(), 100_000, 4_000_000_000), 0);
    }
    set_times(
        &r("special/suid"),
        (-1_000_000, 123),
        (3_000_000_000, 999_999_999),
    );
    set_times(&r("special/fifo"), (12345, 0), (-5, 500_000_000));
    set_times(&r("links/long"), (1, 1), (2, 2));
    std::fs::hard_link(r("xa/f5"), r("special/link_to_f5")).unwrap();
    deep
}

/// Expected-state checks after commitfs's modifications.
fn check_expectations(s: &Snapshot, added: &[String], removed: &[String], deep: &Deep, ctx: &str) {
    let mut errs = vec![];
    let big: Vec<&String> = s
        .entries
        .keys()
        .filter(|p| p.starts_with("/big/"))
        .collect();
    for a in added {
        if !s.entries.contains_key(a) {
            errs.push(format!("added {a} missing"));
        }
    }
    for r in removed {
        if s.entries.contains_key(r) {
            errs.push(format!("removed {r} still present"));
        }
    }
    let want_top = BIG_DIR_ENTRIES + added.len() - removed.len();
    let top = big.iter().filter(|p| p[5..].find('/').is_none()).count();
    if top != want_top {
        errs.push(format!("/big has {top} entries, expected {want_top}"));
    }
    match s.entries.get("/deep") {
        Some(e) => {
            if e.size != deep.content.len() as u64 {
                errs.push(format!(
                    "/deep size {} expected {}",
                    e.size,
                    deep.content.len()
                ));
            }
            if e.content != Some(content_hash_of(&deep.content)) {
                errs.push("/deep content differs from the expected bytes".into());
            }
        }
        None => errs.push("/deep missing".into()),
    }
    let want_x: &[(&str, &[&str])] = &[
        ("/xa/f0", &["trusted.shared", "user.big", "user.small"]),
        (
            "/xa/f1",
            &["trusted.shared", "user.big", "user.new", "user.small"],
        ),
        ("/xa/f2", &[]),
        ("/xa/f3", &["trusted.shared", "user.big", "user.small"]),
        ("/xa/f4", &["user.small"]),
        ("/xa/new", &["user.a", "user.b", "user.c"]),
    ];
    for (p, names) in want_x {
        match s.entries.get(*p) {
            Some(e) => {
                let have: Vec<String> = e
                    .xattrs
                    .keys()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .collect();
                if have != *names {
                    errs.push(format!("{p}: xattrs {have:?}, expected {names:?}"));
                }
            }
            None => errs.push(format!("{p} missing")),
        }
    }
    if let Some(e) = s.entries.get("/xa/f1") {
        if e.xattrs.get(&b"user.big"[..]).map(|v| v.len()) != Some(deep.bs / 3 + 7) {
            errs.push("/xa/f1 user.big was not replaced".into());
        }
    }
    if let Some(e) = s.entries.get("/huge") {
        if e.size != 4 * GIB + 1 {
            errs.push(format!("/huge size {}", e.size));
        }
    }
    assert!(
        errs.is_empty(),
        "{ctx}: commitfs's changes are not what was asked:\n  {}",
        errs.join("\n  ")
    );
}

struct Lib<'a> {
    fs: &'a Fs,
}

impl Lib<'_> {
    fn ino(&self, p: &str) -> Ino {
        self.fs
            .resolve(p)
            .unwrap_or_else(|e| panic!("resolve {p}: {e}"))
    }
    fn write(&self, p: &str, off: u64, data: &[u8]) {
        let ino = self.ino(p);
        let mut done = 0;
        while done < data.len() {
            let n = self
                .fs
                .write(ino, off + done as u64, &data[done..])
                .unwrap_or_else(|e| panic!("write {p} at {off}: {e}"));
            assert!(n > 0, "zero-length write to {p}");
            done += n;
        }
    }
}

/// commitfs's modifications. Returns (added paths, removed paths).
fn modify_with_commitfs(fs: &Fs, deep: &mut Deep) -> (Vec<String>, Vec<String>) {
    let l = Lib { fs };
    let bs = deep.bs;
    let big = l.ino("/big");
    let mut added = vec![];
    let mut removed = vec![];
    // 1,000 new names of assorted types and lengths.
    for i in 0..1000usize {
        let name = format!("added_{i:04}_{}", "x".repeat((i * 31) % 150));
        let p = format!("/big/{name}");
        match i % 100 {
            7 => {
                fs.mkdir(big, name.as_bytes(), 0o755, 0, 0)
                    .unwrap_or_else(|e| panic!("mkdir {p}: {e}"));
            }
            8 => {
                fs.symlink(big, name.as_bytes(), "x".repeat(100).as_bytes(), 0, 0)
                    .unwrap_or_else(|e| panic!("symlink {p}: {e}"));
            }
            _ => {
                fs.create(big, name.as_bytes(), 0o644, 1000, 1000)
                    .unwrap_or_else(|e| panic!("create {p}: {e}"));
            }
        }
        added.push(p);
    }
    // Remove every 7th original file/symlink/hard link and every 5th new name.
    for i in (0..BIG_DIR_ENTRIES).step_by(7) {
        let name = big_name(i);
        let p = format!("/big/{name}");
        if i % 500 == 0 {
            if i % 1000 == 0 {
                fs.rmdir(big, name.as_bytes())
                    .unwrap_or_else(|e| panic!("rmdir {p}: {e}"));
                removed.push(p);
            }
            continue;
        }
        fs.unlink(big, name.as_bytes())
            .unwrap_or_else(|e| panic!("unlink {p}: {e}"));
        removed.push(p);
    }
    for i in (0..1000usize).step_by(5) {
        let p = added[i].clone();
        let name = p.trim_start_matches("/big/");
        if i % 100 == 7 {
            fs.rmdir(big, name.as_bytes())
                .unwrap_or_else(|e| panic!("rmdir {p}: {e}"));
        } else {
            fs.unlink(big, name.as_bytes())
                .unwrap_or_else(|e| panic!("unlink {p}: {e}"));
        }
        removed.push(p.clone());
    }
    added.retain(|p| !removed.contains(p));
    let removed_orig: Vec<String> = removed
        .iter()
        .filter(|p| !p.starts_with("/big/added_"))
        .cloned()
        .collect();
    // A rename inside the big directory and one out of it.
    let a = big_name(2);
    let b = "renamed_inside";
    fs.rename(big, a.as_bytes(), big, b.as_bytes(), RenameFlags::default())
        .expect("rename in /big");
    let root = l.ino("/");
    let c = big_name(3);
    fs.rename(
        big,
        c.as_bytes(),
        root,
        b"moved_out_of_big",
        RenameFlags::default(),
    )
    .expect("rename out of /big");
    let mut removed_all = removed_orig;
    removed_all.push(format!("/big/{a}"));
    removed_all.push(format!("/big/{c}"));
    added.push(format!("/big/{b}"));

    // The deep file: fill some holes (merges extents), overwrite some data,
    // write past the end, punch a hole, then truncate into the middle.
    let nb = (deep.content.len() / bs) as u64;
    for k in (1..nb).step_by(6) {
        let d = block_pattern(9, k, bs);
        l.write("/deep", k * bs as u64, &d);
        deep.write(k * bs as u64, &d);
    }
    for k in (0..nb).step_by(10) {
        let d = block_pattern(10, k, 100);
        l.write("/deep", k * bs as u64 + 17, &d);
        deep.write(k * bs as u64 + 17, &d);
    }
    let tail = block_pattern(11, 0, 3 * bs + 5);
    let end = deep.content.len() as u64 + 5 * bs as u64;
    l.write("/deep", end, &tail);
    deep.write(end, &tail);
    let ino = l.ino("/deep");
    let (ps, pl) = (40 * bs as u64 + 3, 30 * bs as u64);
    fs.fallocate(
        ino,
        ps,
        pl,
        FallocFlags {
            keep_size: true,
            punch_hole: true,
            zero_range: false,
        },
    )
    .expect("punch hole in /deep");
    deep.content[ps as usize..(ps + pl) as usize].fill(0);
    let new_size = (deep.content.len() as u64 * 6 / 10) / bs as u64 * bs as u64 + 77;
    fs.setattr(
        ino,
        &SetAttr {
            size: Some(new_size),
            ..Default::default()
        },
    )
    .expect("truncate /deep");
    deep.content.truncate(new_size as usize);

    // Xattrs: change one inode of the shared block (must copy, not edit in place),
    // drop everything from another, add to a new file.
    let x = XattrFlags::default();
    let f1 = l.ino("/xa/f1");
    fs.setxattr(f1, b"user.new", b"new value", x)
        .expect("setxattr f1");
    fs.setxattr(
        f1,
        b"user.big",
        &vec![b'R'; bs / 3 + 7],
        XattrFlags {
            replace: true,
            create: false,
        },
    )
    .expect("replace f1 user.big");
    let f2 = l.ino("/xa/f2");
    for n in ["user.small", "user.big", "trusted.shared"] {
        fs.removexattr(f2, n.as_bytes())
            .unwrap_or_else(|e| panic!("removexattr f2 {n}: {e}"));
    }
    let f4 = l.ino("/xa/f4");
    fs.removexattr(f4, b"user.big")
        .expect("removexattr f4 user.big");
    let xa = l.ino("/xa");
    let new = fs
        .create(xa, b"new", 0o600, 0, 0)
        .expect("create /xa/new")
        .ino;
    fs.setxattr(new, b"user.a", &[1u8; 20], x)
        .expect("setxattr new a");
    fs.setxattr(new, b"user.b", &vec![2u8; bs / 2], x)
        .expect("setxattr new b");
    fs.setxattr(new, b"user.c", b"", x).expect("setxattr new c");

    // The huge file: write above 4 GiB, then cut it to just above 4 GiB.
    let huge = l.ino("/huge");
    l.write("/huge", 4 * GIB + 500 * 1024, b"late write");
    fs.setattr(
        huge,
        &SetAttr {
            size: Some(4 * GIB + 1),
            ..Default::default()
        },
    )
    .expect("truncate /huge");
    // A few attribute changes.
    fs.setattr(
        l.ino("/special/fifo"),
        &SetAttr {
            mode: Some(0o600),
            uid: Some(77),
            gid: Some(88),
            mtime: Some(SetTime::At(Timestamp::new(-123_456, 789))),
            ..Default::default()
        },
    )
    .expect("setattr fifo");
    (added, removed_all)
}

/// The kernel's turn again on commitfs's result: more names, more data.
fn modify_with_kernel(root: &Path, bs: usize) {
    let big = root.join("big");
    for i in 0..300 {
        std::fs::write(big.join(format!("kernel_again_{i}")), b"k").unwrap();
    }
    for i in (0..300).step_by(3) {
        std::fs::remove_file(big.join(format!("kernel_again_{i}"))).unwrap();
    }
    for i in (0..1000usize).step_by(13) {
        let name = format!("added_{i:04}_{}", "x".repeat((i * 31) % 150));
        let p = big.join(&name);
        if let Ok(m) = std::fs::symlink_metadata(&p) {
            if m.is_dir() {
                std::fs::remove_dir(&p).unwrap();
            } else {
                std::fs::remove_file(&p).unwrap();
            }
        }
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(root.join("deep"))
        .unwrap();
    for k in 0..50u64 {
        f.write_all_at(&block_pattern(12, k, bs), (3 * k + 1) * bs as u64)
            .unwrap();
    }
    f.sync_all().unwrap();
    set_xattr(&root.join("xa/f3"), "user.kernel", b"again");
}

fn kernel_image_case(tag: &str, mkfs_args: &[&str], bs: usize) {
    umask0();
    let ctx = format!("[{tag}]");
    let img = mkfs(tag, 256, mkfs_args);

    // The kernel builds the tree.
    let mut km = KernelMount::mount(&img.path, "noatime").expect("kernel mount");
    let mut deep = build_with_kernel(km.path(), bs);
    km.unmount().expect("kernel unmount");
    check_fsck(&img.path, "kernel-built image")
        .unwrap_or_else(|e| panic!("{ctx} harness problem: {e}"));
    let depth = extent_depth(&img.path, "/deep");
    assert!(
        depth >= 2,
        "{ctx}: the kernel built /deep with extent depth {depth}, need >= 2"
    );
    eprintln!("{ctx}: /deep has extent depth {depth}");

    // What the kernel sees (read-only, no atime updates: the image stays as built).
    let mut km = KernelMount::mount(&img.path, "ro,noatime").expect("kernel ro mount");
    let k0 = snapshot_posix(km.path(), SnapOpts::default());
    km.unmount().expect("kernel unmount");
    assert!(
        k0.entries.len() > BIG_DIR_ENTRIES,
        "{ctx}: kernel snapshot too small"
    );

    // commitfs must see exactly the same.
    let fs = open_lib(&img.path, false).unwrap_or_else(|e| panic!("{ctx}: commitfs mount: {e}"));
    let c0 = snapshot_lib(&fs, SnapOpts::default());
    let exact = CompareOpts {
        times: TimeMode::Exact,
        dir_sizes: true,
        atime: true,
    };
    assert_same(
        &k0,
        "kernel",
        &c0,
        "commitfs",
        exact,
        &format!("{ctx} kernel-built image"),
    );

    // commitfs modifies it.
    let (added, removed) = modify_with_commitfs(&fs, &mut deep);
    let c1 = snapshot_lib(&fs, SnapOpts::default());
    check_expectations(&c1, &added, &removed, &deep, &ctx);
    fs.unmount()
        .unwrap_or_else(|e| panic!("{ctx}: commitfs unmount: {e}"));
    drop(fs);
    check_fsck(&img.path, "image after commitfs's changes")
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    eprintln!(
        "{ctx}: /deep has extent depth {} after commitfs's changes",
        extent_depth(&img.path, "/deep")
    );

    // The kernel must see exactly commitfs's tree.
    let mut km = KernelMount::mount(&img.path, "ro,noatime").expect("kernel ro mount");
    let k1 = snapshot_posix(km.path(), SnapOpts::default());
    let indexed = has_index_flag(&km.path().join("big"));
    km.unmount().expect("kernel unmount");
    assert_same(
        &c1,
        "commitfs",
        &k1,
        "kernel",
        exact,
        &format!("{ctx} commitfs-modified image"),
    );
    assert!(indexed, "{ctx}: /big lost its htree index flag");

    // And the kernel can keep working on it; then both agree once more.
    let mut km = KernelMount::mount(&img.path, "noatime").expect("kernel mount");
    modify_with_kernel(km.path(), bs);
    km.unmount().expect("kernel unmount");
    check_fsck(&img.path, "image after the kernel's second round")
        .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let mut km = KernelMount::mount(&img.path, "ro,noatime").expect("kernel ro mount");
    let k2 = snapshot_posix(km.path(), SnapOpts::default());
    km.unmount().expect("kernel unmount");
    let fs = open_lib(&img.path, true).unwrap_or_else(|e| panic!("{ctx}: commitfs mount: {e}"));
    let c2 = snapshot_lib(&fs, SnapOpts::default());
    drop(fs);
    assert_same(
        &k2,
        "kernel",
        &c2,
        "commitfs",
        exact,
        &format!("{ctx} after the kernel's second round"),
    );
}

#[test]
fn kernel_images_1k() {
    kernel_image_case(
        "kimg-1k",
        &["-b", "1024", "-O", "metadata_csum_seed,orphan_file"],
        1024,
    );
}

#[test]
fn kernel_images_4k_fast_commit() {
    kernel_image_case("kimg-4k", &["-b", "4096", "-O", "fast_commit"], 4096);
}
