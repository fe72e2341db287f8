//! Benchmark for acceptance point 5 (not a test): create 100,000 empty files in one
//! directory, and copy a source tree, through (i) the commitfs library, (ii) the
//! commitfs FUSE mount, (iii) kernel ext4 on a loop device — all on fresh copies of
//! one image — and print the times and ratios.
//!
//! Run as root:
//!   cargo build --release -p commitfs
//!   cargo run --release -p commitfs --example bench_create -- [--files N] [--src DIR]
//! `COMMITFS_BIN` overrides the commitfs binary (default: next to this example's
//! directory, i.e. target/<profile>/commitfs).

#[path = "../tests/common/mod.rs"]
mod common;

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use commitfs_fs::{Fs, Ino, ROOT_INO};
use common::*;

struct Times {
    create: Duration,
    create_total: Duration,
    copy: Duration,
    copy_total: Duration,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Recursive copy of `src` into directory `dst` through the library (files, dirs,
/// symlinks; data in 1 MiB chunks; modes and mtimes kept like `cp -a`).
fn lib_copy_tree(fs: &Fs, src: &Path, dst: Ino) -> std::io::Result<u64> {
    let mut n = 0;
    let mut buf = vec![0u8; 1 << 20];
    let mut stack: Vec<(PathBuf, Ino)> = vec![(src.to_path_buf(), dst)];
    while let Some((dir, ino)) = stack.pop() {
        for de in std::fs::read_dir(&dir)? {
            let de = de?;
            let name = de.file_name();
            let md = std::fs::symlink_metadata(de.path())?;
            use std::os::unix::fs::MetadataExt;
            let perm = (md.mode() & 0o7777) as u16;
            let lib_err = |e: commitfs_fs::FsError| {
                std::io::Error::other(format!("{}: {e}", de.path().display()))
            };
            let child = if md.is_dir() {
                let a = fs
                    .mkdir(ino, name.as_bytes(), perm, md.uid(), md.gid())
                    .map_err(lib_err)?;
                stack.push((de.path(), a.ino));
                a.ino
            } else if md.file_type().is_symlink() {
                let t = std::fs::read_link(de.path())?;
                fs.symlink(
                    ino,
                    name.as_bytes(),
                    t.as_os_str().as_bytes(),
                    md.uid(),
                    md.gid(),
                )
                .map_err(lib_err)?
                .ino
            } else if md.is_file() {
                let a = fs
                    .create(ino, name.as_bytes(), perm, md.uid(), md.gid())
                    .map_err(lib_err)?;
                let f = std::fs::File::open(de.path())?;
                use std::os::unix::fs::FileExt;
                let mut off = 0u64;
                loop {
                    let r = f.read_at(&mut buf, off)?;
                    if r == 0 {
                        break;
                    }
                    let mut done = 0;
                    while done < r {
                        done += fs
                            .write(a.ino, off + done as u64, &buf[done..r])
                            .map_err(lib_err)?;
                    }
                    off += r as u64;
                }
                a.ino
            } else {
                continue;
            };
            if !md.file_type().is_symlink() {
                let set = commitfs_fs::SetAttr {
                    mtime: Some(commitfs_fs::SetTime::At(commitfs_fs::Timestamp::new(
                        md.mtime(),
                        md.mtime_nsec() as u32,
                    ))),
                    ..Default::default()
                };
                fs.setattr(child, &set).map_err(lib_err)?;
            }
            n += 1;
        }
    }
    Ok(n)
}

fn bench_lib(image: &Path, files: usize, src: &Path) -> Times {
    let fs = open_lib(image, false).expect("commitfs mount");
    let t = Instant::now();
    let d = fs.mkdir(ROOT_INO, b"many", 0o755, 0, 0).expect("mkdir").ino;
    for i in 0..files {
        fs.create(d, format!("f{i:06}").as_bytes(), 0o644, 0, 0)
            .expect("create");
    }
    let create = t.elapsed();
    fs.sync().expect("sync");
    let create_total = t.elapsed();
    let t = Instant::now();
    let d = fs.mkdir(ROOT_INO, b"copy", 0o755, 0, 0).expect("mkdir").ino;
    let n = lib_copy_tree(&fs, src, d).expect("copy tree");
    let copy = t.elapsed();
    fs.unmount().expect("unmount");
    let copy_total = t.elapsed();
    eprintln!("library: copied {n} entries");
    Times {
        create,
        create_total,
        copy,
        copy_total,
    }
}

/// Creates and the copy through a mounted file system; `flush` makes the work
/// durable (sync for kernel, unmount for FUSE) and is timed into the totals.
fn bench_posix(root: &Path, files: usize, src: &Path, mut flush: impl FnMut()) -> Times {
    let t = Instant::now();
    let d = root.join("many");
    std::fs::create_dir(&d).expect("mkdir");
    for i in 0..files {
        std::fs::File::create(d.join(format!("f{i:06}"))).expect("create");
    }
    let create = t.elapsed();
    run(Command::new("sync").arg("-f").arg(root)).expect("sync");
    let create_total = t.elapsed();
    let t = Instant::now();
    run(Command::new("cp").arg("-a").arg(src).arg(root.join("copy"))).expect("cp -a");
    let copy = t.elapsed();
    flush();
    let copy_total = t.elapsed();
    Times {
        create,
        create_total,
        copy,
        copy_total,
    }
}

fn main() {
    let mut files = 100_000usize;
    let mut src = PathBuf::from("/usr/share/doc");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--files" => files = args.next().and_then(|v| v.parse().ok()).expect("--files N"),
            "--src" => src = PathBuf::from(args.next().expect("--src DIR")),
            _ => {
                eprintln!("usage: bench_create [--files N] [--src DIR]");
                std::process::exit(2);
            }
        }
    }
    let bin = std::env::var_os("COMMITFS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().expect("current exe");
            exe.parent()
                .and_then(|p| p.parent())
                .expect("target dir")
                .join("commitfs")
        });
    umask0();
    let fresh = mkfs("bench", 2048, &["-b", "4096"]);
    println!(
        "image: 2 GiB, 4 KiB blocks; {files} files in one directory; source tree {}",
        src.display()
    );

    let li = copy_sparse(&fresh.path, "bench-lib");
    let lib = bench_lib(&li.path, files, &src);
    check_fsck(&li.path, "library image").expect("fsck library image");
    drop(li);

    let fi = copy_sparse(&fresh.path, "bench-fuse");
    let mut fm = FuseMount::mount(&bin, &fi.path, &[]).expect("FUSE mount");
    let root = fm.path().to_path_buf();
    let mut unmount_err = None;
    let fuse = bench_posix(&root, files, &src, || {
        if let Err(e) = fm.unmount() {
            unmount_err = Some(e);
        }
    });
    if let Some(e) = unmount_err {
        panic!("FUSE unmount: {e}");
    }
    drop(fm);
    check_fsck(&fi.path, "FUSE image").expect("fsck FUSE image");
    drop(fi);

    let ki = copy_sparse(&fresh.path, "bench-kernel");
    let mut km = KernelMount::mount(&ki.path, "defaults").expect("kernel mount");
    let root = km.path().to_path_buf();
    let mut unmount_err = None;
    let kernel = bench_posix(&root, files, &src, || {
        if let Err(e) = km.unmount() {
            unmount_err = Some(e);
        }
    });
    if let Some(e) = unmount_err {
        panic!("kernel unmount: {e}");
    }
    drop(km);
    drop(ki);

    println!(
        "{:<28} {:>10} {:>10} {:>10}",
        "seconds", "library", "FUSE", "kernel"
    );
    let row = |name: &str, f: fn(&Times) -> Duration| {
        println!(
            "{:<28} {:>10.3} {:>10.3} {:>10.3}   lib/kernel {:>6.2}x  FUSE/kernel {:>6.2}x",
            name,
            secs(f(&lib)),
            secs(f(&fuse)),
            secs(f(&kernel)),
            secs(f(&lib)) / secs(f(&kernel)),
            secs(f(&fuse)) / secs(f(&kernel)),
        );
    };
    row("create (ops only)", |t| t.create);
    row("create + sync", |t| t.create_total);
    row("copy tree (ops only)", |t| t.copy);
    row("copy tree + unmount", |t| t.copy_total);
}
