//! Our JBD2 log is replayed identically by commitfs, by e2fsck and by the kernel:
//! a copy of the image taken after fsync (a "crash" with the log live) must come
//! back with everything fsynced, and e2fsck must be clean afterwards.

use std::path::Path;
use std::process::Command;

use commitfs_fs::testutil::{assert_fsck_clean, mkfs};
use commitfs_fs::*;

mod common;
use common::*;

/// Tests in this file run in parallel; kernel loop mounts detach asynchronously and
/// e2fsck then sometimes believes an unrelated image is mounted (it matches loop
/// devices by inode). Every test that mounts with the kernel holds this lock.
static KERNEL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn kernel_lock() -> std::sync::MutexGuard<'static, ()> {
    KERNEL.lock().unwrap_or_else(|e| e.into_inner())
}

fn workload(fs: &Fs) {
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap();
    for i in 0..300u32 {
        let f = fs
            .create(d.ino, format!("f{i}").as_bytes(), 0o644, 0, 0)
            .unwrap();
        let data = vec![(i % 200) as u8 + 1; (i as usize * 37) % 9000 + 1];
        fs.write(f.ino, 0, &data).unwrap();
        if i % 50 == 0 {
            fs.fsync(f.ino, false).unwrap();
        }
    }
    for i in (0..300).step_by(7) {
        fs.unlink(d.ino, format!("f{i}").as_bytes()).unwrap();
    }
    fs.symlink(ROOT_INO, b"link", &[b'y'; 100], 0, 0).unwrap();
    fs.rename(d.ino, b"f1", ROOT_INO, b"top", RenameFlags::default())
        .unwrap();
    fs.fsync(d.ino, false).unwrap();
}

/// `Journal start` from dumpe2fs: 0 means the log is empty.
fn journal_start(img: &Path) -> u64 {
    let out = Command::new("dumpe2fs")
        .arg("-h")
        .arg(img)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("Journal start:"))
        .map(|v| v.trim().parse().unwrap())
        .expect("dumpe2fs shows the journal start")
}

fn crash_then_replay(bs: &str, extra: &[&str]) {
    let _k = kernel_lock();
    let mut args = vec!["-b", bs];
    args.extend_from_slice(extra);
    let img = mkfs("replay", 64, &args);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    workload(&fs);
    let expected = lib_tree(&fs);
    // The "crash": copies of the device while the log is live.
    let by_us = copy_image(&img.path, "us");
    let by_fsck = copy_image(&img.path, "fsck");
    let by_kernel = copy_image(&img.path, "kernel");
    drop(fs);
    assert_ne!(
        journal_start(&by_us.path),
        0,
        "the crash copy must have a live log"
    );

    // commitfs replays.
    {
        let fs = Fs::open_path(&by_us.path, MountOptions::default()).unwrap();
        assert_eq!(lib_tree(&fs), expected);
        fs.unmount().unwrap();
    }
    assert_eq!(journal_start(&by_us.path), 0);
    assert_fsck_clean(&by_us.path);

    // e2fsck replays our log.
    let out = Command::new("e2fsck")
        .arg("-fy")
        .arg(&by_fsck.path)
        .output()
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code == 0 || code == 1,
        "e2fsck -fy failed ({code}): {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_fsck_clean(&by_fsck.path);
    {
        let fs = Fs::open_path(
            &by_fsck.path,
            MountOptions {
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(lib_tree(&fs), expected);
    }

    // The kernel replays our log.
    {
        let m = KernelMount::new(&by_kernel.path, "rw");
        assert_eq!(host_tree(&m.dir), expected);
    }
    assert_fsck_clean(&by_kernel.path);
}

#[test]
fn replay_1k() {
    crash_then_replay("1024", &[]);
}

#[test]
fn replay_4k_upstream_defaults() {
    crash_then_replay("4096", &["-O", "metadata_csum_seed,orphan_file"]);
}

/// The other direction: a dirty journal written by the kernel (an image copied
/// while mounted, after sync) is replayed by commitfs with the kernel's result.
fn kernel_crash_then_replay(bs: &str) {
    let _k = kernel_lock();
    let img = mkfs("kreplay", 64, &["-b", bs, "-O", "^fast_commit"]);
    let crash = copy_image(&img.path, "crash");
    {
        let m = KernelMount::new(&img.path, "rw");
        let d = m.dir.join("d");
        std::fs::create_dir(&d).unwrap();
        for i in 0..200u32 {
            std::fs::write(
                d.join(format!("k{i}")),
                vec![(i % 250) as u8; (i as usize * 53) % 7000],
            )
            .unwrap();
        }
        for i in (0..200).step_by(9) {
            std::fs::remove_file(d.join(format!("k{i}"))).unwrap();
        }
        std::os::unix::fs::symlink("t".repeat(90), m.dir.join("sl")).unwrap();
        let st = Command::new("sync").arg("-f").arg(&m.dir).status().unwrap();
        assert!(st.success());
        std::fs::copy(&img.path, &crash.path).unwrap();
    }
    assert_ne!(
        journal_start(&crash.path),
        0,
        "kernel copy must have a live log"
    );
    let by_kernel = copy_image(&crash.path, "bykernel");
    let expected = {
        let m = KernelMount::new(&by_kernel.path, "rw");
        host_tree(&m.dir)
    };
    assert!(expected.len() > 150);
    {
        let fs = Fs::open_path(&crash.path, MountOptions::default()).unwrap();
        assert_eq!(lib_tree(&fs), expected);
        fs.unmount().unwrap();
    }
    assert_fsck_clean(&crash.path);
    assert_fsck_clean(&by_kernel.path);
}

#[test]
fn kernel_log_replayed_by_commitfs_1k() {
    kernel_crash_then_replay("1024");
}

#[test]
fn kernel_log_replayed_by_commitfs_4k() {
    kernel_crash_then_replay("4096");
}

/// A file unlinked while open is on the orphan list: after a crash, commitfs and
/// the kernel both free it at mount; e2fsck is clean either way.
#[test]
fn open_unlinked_file_is_freed_after_crash() {
    let _k = kernel_lock();
    let img = mkfs("orphan", 64, &["-b", "1024"]);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    let before = fs.statfs().unwrap();
    let f = fs.create(ROOT_INO, b"victim", 0o644, 0, 0).unwrap();
    fs.open_inode(f.ino).unwrap();
    fs.write(f.ino, 0, &vec![7u8; 200_000]).unwrap();
    fs.unlink(ROOT_INO, b"victim").unwrap();
    // Still readable through the open handle.
    let mut b = [0u8; 10];
    fs.read(f.ino, 1000, &mut b).unwrap();
    assert_eq!(b, [7u8; 10]);
    fs.sync().unwrap();
    let by_us = copy_image(&img.path, "us");
    let by_kernel = copy_image(&img.path, "kernel");
    fs.release(f.ino).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
    {
        let fs = Fs::open_path(&by_us.path, MountOptions::default()).unwrap();
        assert!(fs.lookup(ROOT_INO, b"victim").is_err());
        let after = fs.statfs().unwrap();
        assert_eq!(
            after.blocks_free, before.blocks_free,
            "orphan's blocks freed"
        );
        assert_eq!(after.files_free, before.files_free, "orphan inode freed");
        fs.unmount().unwrap();
    }
    assert_fsck_clean(&by_us.path);
    {
        let _m = KernelMount::new(&by_kernel.path, "rw");
    }
    assert_fsck_clean(&by_kernel.path);
}

/// Fast commits written by commitfs are replayed by the kernel (and e2fsck): after
/// one full commit, fsyncs of creates/appends/truncates/unlinks/renames go out as
/// fast commits; a crash copy mounted by the kernel shows every fsynced change.
fn fc_crash_kernel_replay(bs: &str) {
    let _k = kernel_lock();
    let img = mkfs("fcreplay", 64, &["-b", bs, "-O", "fast_commit"]);
    let opts = MountOptions {
        fast_commit: true,
        ..Default::default()
    };
    let fs = Fs::open_path(&img.path, opts).unwrap();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap();
    fs.fsync(d.ino, false).unwrap(); // full commit (mkdir is ineligible)
    for i in 0..40u32 {
        let f = fs
            .create(d.ino, format!("f{i}").as_bytes(), 0o640, 1000, 100)
            .unwrap();
        let data = vec![(i % 200) as u8 + 1; 3000 + i as usize * 211];
        fs.write(f.ino, 0, &data).unwrap();
        if i % 5 == 4 {
            fs.setattr(
                f.ino,
                &SetAttr {
                    size: Some(1000),
                    ..Default::default()
                },
            )
            .unwrap();
        }
        fs.fsync(f.ino, false).unwrap();
    }
    fs.unlink(d.ino, b"f3").unwrap();
    fs.rename(d.ino, b"f7", d.ino, b"f7-renamed", RenameFlags::default())
        .unwrap();
    fs.link(fs.lookup(d.ino, b"f8").unwrap().ino, ROOT_INO, b"f8-link")
        .unwrap();
    let last = fs.lookup(d.ino, b"f9").unwrap().ino;
    fs.fsync(last, false).unwrap();
    let fc = fs.fc_stats();
    // A 64 MiB image has a small fast-commit area: when it fills, a full commit
    // restarts it, so not every fsync is a fast commit.
    assert!(fc.commits >= 30, "fast commits expected: {fc:?}");
    assert!(fc.single_block * 10 >= fc.commits * 8, "{fc:?}");
    let expected = lib_tree(&fs);
    let by_kernel = copy_image(&img.path, "kernel");
    drop(fs);
    assert_ne!(journal_start(&by_kernel.path), 0);
    {
        let m = KernelMount::new(&by_kernel.path, "rw");
        assert_eq!(host_tree(&m.dir), expected);
    }
    // (e2fsprogs 1.47's own fast-commit replay is not a judge here: it does not
    // drop the last link on UNLINK, ext4-format.md §9.8.)
    assert_fsck_clean(&by_kernel.path);
}

#[test]
fn fast_commits_replayed_by_kernel_1k() {
    fc_crash_kernel_replay("1024");
}

#[test]
fn fast_commits_replayed_by_kernel_4k() {
    fc_crash_kernel_replay("4096");
}

/// Issue 3, kernel as judge (a): 50+ crash images of commitfs (copies of the
/// device at every fsync of a mixed workload, with live JBD2 and, on fast_commit
/// images, fast-commit logs) are recovered by the kernel and by commitfs with the
/// same tree, and e2fsck is clean after either.
#[test]
fn kernel_judges_50_commitfs_crash_images() {
    let _k = kernel_lock();
    let mut images = 0;
    for (bs, feats) in [("1024", "^fast_commit"), ("4096", "fast_commit")] {
        let img = mkfs("judge-a", 48, &["-b", bs, "-O", feats]);
        let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
        let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap();
        let mut copies = Vec::new();
        for i in 0..26u32 {
            let name = format!("f{i}");
            let f = fs.create(d.ino, name.as_bytes(), 0o644, 0, 0).unwrap();
            fs.write(f.ino, 0, &vec![i as u8 + 1; 1500 + i as usize * 997])
                .unwrap();
            match i % 6 {
                1 => fs.unlink(d.ino, format!("f{}", i - 1).as_bytes()).unwrap(),
                2 => fs
                    .rename(
                        d.ino,
                        name.as_bytes(),
                        ROOT_INO,
                        format!("top{i}").as_bytes(),
                        RenameFlags::default(),
                    )
                    .unwrap(),
                3 => {
                    fs.setattr(
                        f.ino,
                        &SetAttr {
                            size: Some(700),
                            ..Default::default()
                        },
                    )
                    .unwrap();
                }
                4 => {
                    fs.mkdir(d.ino, format!("sub{i}").as_bytes(), 0o700, 0, 0)
                        .unwrap();
                }
                _ => {}
            }
            fs.fsync(f.ino, false).unwrap();
            let expected = lib_tree(&fs);
            let us = copy_image(&img.path, &format!("a{i}"));
            let k = copy_image(&img.path, &format!("k{i}"));
            copies.push((expected, us, k));
        }
        drop(fs);
        for (expected, us, k) in copies {
            {
                let fs = Fs::open_path(&us.path, MountOptions::default()).unwrap();
                assert_eq!(
                    lib_tree(&fs),
                    expected,
                    "commitfs recovery of {}",
                    us.path.display()
                );
                fs.unmount().unwrap();
            }
            assert_fsck_clean(&us.path);
            {
                let m = KernelMount::new(&k.path, "rw");
                assert_eq!(
                    host_tree(&m.dir),
                    expected,
                    "kernel recovery of {}",
                    k.path.display()
                );
            }
            assert_fsck_clean(&k.path);
            images += 1;
        }
    }
    assert!(images >= 50);
}

/// Issue 3, kernel as judge (b): 50+ images left with a dirty journal by kernel
/// ext4 (copies taken mid-workload while mounted) are recovered by commitfs with
/// the same result as the kernel's own recovery; e2fsck is clean after both.
#[test]
fn commitfs_judges_50_kernel_crash_images() {
    let _k = kernel_lock();
    let mut images = 0;
    for bs in ["1024", "4096"] {
        let img = mkfs("judge-b", 48, &["-b", bs, "-O", "^fast_commit"]);
        let mut copies = Vec::new();
        {
            let m = KernelMount::new(&img.path, "rw");
            let d = m.dir.join("d");
            std::fs::create_dir(&d).unwrap();
            for i in 0..26u32 {
                let p = d.join(format!("k{i}"));
                std::fs::write(&p, vec![i as u8 + 7; 900 + i as usize * 1311]).unwrap();
                if i % 4 == 1 {
                    std::fs::remove_file(d.join(format!("k{}", i - 1))).unwrap();
                }
                if i % 4 == 2 {
                    std::fs::rename(&p, m.dir.join(format!("moved{i}"))).unwrap();
                }
                if i % 4 == 3 {
                    std::fs::create_dir(d.join(format!("dir{i}"))).unwrap();
                }
                // Half the copies after an fsync-like sync, half mid-flight.
                if i % 2 == 0 {
                    let st = Command::new("sync").arg("-f").arg(&m.dir).status().unwrap();
                    assert!(st.success());
                }
                let c1 = copy_image(&img.path, &format!("b{i}"));
                let c2 = copy_image(&img.path, &format!("c{i}"));
                copies.push((c1, c2));
            }
        }
        for (ours, theirs) in copies {
            let expected = {
                let m = KernelMount::new(&theirs.path, "rw");
                host_tree(&m.dir)
            };
            assert_fsck_clean(&theirs.path);
            {
                let fs = Fs::open_path(&ours.path, MountOptions::default()).unwrap();
                assert_eq!(
                    lib_tree(&fs),
                    expected,
                    "commitfs recovery of {}",
                    ours.path.display()
                );
                fs.unmount().unwrap();
            }
            assert_fsck_clean(&ours.path);
            images += 1;
        }
    }
    assert!(images >= 50);
}
