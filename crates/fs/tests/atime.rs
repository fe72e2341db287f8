//! Library semantics the Linux regression suite checks (issue #9, item 14):
//! atime policies on read/readdir, setuid/setgid clearing by unprivileged
//! fallocate, and removed directories that stay alive while referenced.
//! Every image is judged by `e2fsck -fn` after unmount.

use commitfs_fs::testutil::{assert_fsck_clean, mkfs, TempImage};
use commitfs_fs::*;

fn ts(sec: i64) -> Timestamp {
    Timestamp::new(sec, 0)
}

fn now_sec() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn opts(atime: AtimeMode, nodiratime: bool, lazytime: bool) -> MountOptions {
    MountOptions {
        commit_interval: 0,
        atime,
        nodiratime,
        lazytime,
        ..Default::default()
    }
}

/// Set a file's times explicitly (ctime too, which a setattr would otherwise
/// stamp with "now" and so make every relatime access due).
fn set_times(fs: &Fs, ino: Ino, a: i64, m: i64, c: i64) {
    fs.setattr(
        ino,
        &SetAttr {
            atime: Some(SetTime::At(ts(a))),
            mtime: Some(SetTime::At(ts(m))),
            ctime: Some(ts(c)),
            ..Default::default()
        },
    )
    .unwrap();
}

fn read1(fs: &Fs, ino: Ino) {
    let mut b = [0u8; 16];
    fs.read(ino, 0, &mut b).unwrap();
}

fn handles(fs: &Fs) -> u64 {
    fs.stats().journal.handles
}

/// An image with /f (some data) and /d (a directory); returns their numbers.
fn setup(o: MountOptions) -> (TempImage, Fs, Ino, Ino) {
    let img = mkfs("atime", 32, &["-b", "4096"]);
    let fs = Fs::open_path(&img.path, o).unwrap();
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, b"hello").unwrap();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    (img, fs, f, d)
}

#[test]
fn relatime_updates_only_stale_atimes() {
    let (img, fs, f, d) = setup(opts(AtimeMode::Relative, false, false));
    let n = now_sec();
    // atime newer than mtime and ctime, and recent: no update, no journal work.
    set_times(&fs, f, n - 100, n - 1000, n - 1000);
    let h0 = handles(&fs);
    read1(&fs, f);
    assert_eq!(fs.getattr(f).unwrap().atime, ts(n - 100));
    assert_eq!(
        handles(&fs),
        h0,
        "an access that changes nothing started a handle"
    );
    // atime older than mtime: updated to now.
    set_times(&fs, f, n - 1000, n - 100, n - 1000);
    read1(&fs, f);
    assert!(fs.getattr(f).unwrap().atime.sec >= n);
    // atime equal to ctime (but newer than mtime): updated.
    set_times(&fs, f, n - 100, n - 1000, n - 100);
    read1(&fs, f);
    assert!(fs.getattr(f).unwrap().atime.sec >= n);
    // Newer than both but more than a day old: updated.
    set_times(&fs, f, n - 90_000, n - 100_000, n - 100_000);
    read1(&fs, f);
    let a = fs.getattr(f).unwrap().atime;
    assert!(a.sec >= n);
    // ... and the next access leaves it alone.
    read1(&fs, f);
    assert_eq!(fs.getattr(f).unwrap().atime, a);
    // readdir follows the same rule on directories.
    set_times(&fs, d, n - 1000, n - 100, n - 1000);
    fs.readdir_all(d).unwrap();
    assert!(fs.getattr(d).unwrap().atime.sec >= n);
    // The update is journalled with the inode and survives a remount.
    drop(fs);
    assert_fsck_clean(&img.path);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    assert_eq!(fs.getattr(f).unwrap().atime, a);
}

/// A read's atime update takes no file-system lock and no journal handle: it
/// lands in the cached inode, and the next commit (here a sync) writes it.
#[test]
fn atime_update_forces_no_commit() {
    let (img, fs, f, _d) = setup(opts(AtimeMode::Strict, false, false));
    let n = now_sec();
    set_times(&fs, f, n - 1000, n - 2000, n - 2000);
    fs.sync().unwrap();
    let c0 = fs.stats().journal.commits;
    let h0 = handles(&fs);
    for _ in 0..50 {
        read1(&fs, f);
    }
    let a = fs.getattr(f).unwrap().atime;
    assert!(a.sec >= n, "strictatime read left atime at {a:?}");
    assert_eq!(handles(&fs), h0, "reads started journal handles");
    assert_eq!(
        fs.stats().journal.commits,
        c0,
        "atime updates forced commits"
    );
    // The next commit carries it.
    fs.sync().unwrap();
    assert!(handles(&fs) > h0, "the sync wrote no atime");
    let copy = img.path.with_extension("synced.img");
    std::fs::copy(&img.path, &copy).unwrap();
    let back = Fs::open_path(&copy, MountOptions::default()).unwrap();
    let got = back.getattr(f).unwrap().atime;
    drop(back);
    let _ = std::fs::remove_file(&copy);
    assert_eq!(got, a, "the synced image lost the read's atime");
}

/// Without any sync, the periodic commit writes a read's atime within its
/// interval (as the kernel's commit of the running transaction does): an
/// image copied while mounted, after the interval, recovers with it.
#[test]
fn periodic_commit_writes_read_atimes() {
    let o = MountOptions {
        commit_interval: 1,
        ..opts(AtimeMode::Relative, false, false)
    };
    let (img, fs, f, _d) = setup(o);
    let n = now_sec();
    set_times(&fs, f, n - 1000, n - 100, n - 1000);
    fs.sync().unwrap();
    read1(&fs, f);
    let a = fs.getattr(f).unwrap().atime;
    assert!(a.sec >= n, "relatime read of a stale atime left {a:?}");
    let copy = img.path.with_extension("periodic.img");
    let mut got = None;
    // The committer wakes every second; allow a few intervals on a busy machine.
    for _ in 0..10 {
        std::thread::sleep(std::time::Duration::from_millis(1000));
        std::fs::copy(&img.path, &copy).unwrap();
        let back = Fs::open_path(&copy, MountOptions::default()).unwrap();
        got = Some(back.getattr(f).unwrap().atime);
        drop(back);
        if got == Some(a) {
            break;
        }
    }
    let _ = std::fs::remove_file(&copy);
    assert_eq!(got, Some(a), "no periodic commit wrote the read's atime");
    drop(fs);
    assert_fsck_clean(&img.path);
}

#[test]
fn strictatime_updates_every_access() {
    let (img, fs, f, d) = setup(opts(AtimeMode::Strict, false, false));
    let n = now_sec();
    // Newer than mtime/ctime and recent: relatime would skip it, strict does not.
    set_times(&fs, f, n - 100, n - 1000, n - 1000);
    read1(&fs, f);
    assert!(fs.getattr(f).unwrap().atime.sec >= n);
    set_times(&fs, d, n - 100, n - 1000, n - 1000);
    fs.readdir_all(d).unwrap();
    assert!(fs.getattr(d).unwrap().atime.sec >= n);
    drop(fs);
    assert_fsck_clean(&img.path);
}

#[test]
fn noatime_and_nodiratime() {
    let (img, fs, f, d) = setup(opts(AtimeMode::Never, false, false));
    let n = now_sec();
    set_times(&fs, f, n - 1000, n - 100, n - 100);
    set_times(&fs, d, n - 1000, n - 100, n - 100);
    let h0 = handles(&fs);
    read1(&fs, f);
    fs.readdir_all(d).unwrap();
    assert_eq!(fs.getattr(f).unwrap().atime, ts(n - 1000));
    assert_eq!(fs.getattr(d).unwrap().atime, ts(n - 1000));
    assert_eq!(handles(&fs), h0);
    drop(fs);
    assert_fsck_clean(&img.path);

    // nodiratime: files still follow relatime, directories never change.
    let fs = Fs::open_path(&img.path, opts(AtimeMode::Relative, true, false)).unwrap();
    read1(&fs, f);
    fs.readdir_all(d).unwrap();
    assert!(fs.getattr(f).unwrap().atime.sec >= n);
    assert_eq!(fs.getattr(d).unwrap().atime, ts(n - 1000));
    // A read-only mount never writes an atime.
    drop(fs);
    let fs = Fs::open_path(
        &img.path,
        MountOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    fs.readdir_all(d).unwrap();
    assert_eq!(fs.getattr(d).unwrap().atime, ts(n - 1000));
}

#[test]
fn lazytime_keeps_atime_in_memory_until_written() {
    let (img, fs, f, _d) = setup(opts(AtimeMode::Relative, false, true));
    let n = now_sec();
    set_times(&fs, f, n - 1000, n - 100, n - 100);
    fs.sync().unwrap();
    let h0 = handles(&fs);
    read1(&fs, f);
    // Visible at once, but no journal work for it.
    let a = fs.getattr(f).unwrap().atime;
    assert!(a.sec >= n);
    assert_eq!(handles(&fs), h0, "lazytime atime went to the journal");
    // Another change of the inode carries it along.
    fs.write(f, 0, b"j").unwrap();
    assert_eq!(fs.getattr(f).unwrap().atime, a);
    // fsync writes it; so does unmount.
    set_times(&fs, f, n - 1000, n - 100, n - 100);
    read1(&fs, f);
    let a2 = fs.getattr(f).unwrap().atime;
    assert!(a2.sec >= n);
    let h1 = handles(&fs);
    fs.fsync(f, false).unwrap();
    assert!(handles(&fs) > h1, "fsync did not write the lazy atime");
    drop(fs);
    assert_fsck_clean(&img.path);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    assert_eq!(fs.getattr(f).unwrap().atime, a2);
    // Unmount writes a pending one.
    drop(fs);
    let fs = Fs::open_path(&img.path, opts(AtimeMode::Strict, false, true)).unwrap();
    read1(&fs, f);
    let a3 = fs.getattr(f).unwrap().atime;
    assert!(a3 > a2);
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    assert_eq!(fs.getattr(f).unwrap().atime, a3);
}

#[test]
fn unprivileged_fallocate_clears_setuid_setgid() {
    let (img, fs, f, _d) = setup(opts(AtimeMode::Never, false, false));
    let nobody = Caller {
        uid: 65534,
        gid: 65534,
        groups: vec![],
        cap_fsetid: false,
    };
    let in_group = Caller {
        groups: vec![0],
        ..nobody.clone()
    };
    let root = Caller {
        uid: 0,
        gid: 0,
        groups: vec![0],
        cap_fsetid: true,
    };
    let modes = [
        FallocFlags::default(),
        FallocFlags {
            keep_size: true,
            ..Default::default()
        },
        FallocFlags {
            keep_size: true,
            punch_hole: true,
            ..Default::default()
        },
        FallocFlags {
            zero_range: true,
            ..Default::default()
        },
    ];
    // (mode before, caller, mode after): the kernel's setattr_should_drop_suidgid.
    let cases: [(u16, &Caller, u16); 7] = [
        (0o4666, &nobody, 0o0666),
        (0o2666, &nobody, 0o0666),   // not in the file's group
        (0o2666, &in_group, 0o2666), // no group exec, in the group: kept
        (0o2676, &in_group, 0o0676), // group exec: always cleared
        (0o6766, &nobody, 0o0766),
        (0o6777, &root, 0o6777), // CAP_FSETID keeps everything
        (0o0666, &nobody, 0o0666),
    ];
    for flags in modes {
        for (before, who, after) in cases {
            fs.setattr(
                f,
                &SetAttr {
                    mode: Some(before),
                    ..Default::default()
                },
            )
            .unwrap();
            let lookup = || who.clone();
            fs.fallocate_by(f, 0, 8192, flags, Some(&lookup)).unwrap();
            let got = fs.getattr(f).unwrap().perm;
            assert_eq!(
                got, after,
                "{flags:?} by uid {} on {before:o}: mode {got:o}",
                who.uid
            );
        }
    }
    // Writes and truncates by the caller follow the same rule.
    for (before, who, after) in cases {
        for truncate in [false, true] {
            fs.setattr(
                f,
                &SetAttr {
                    mode: Some(before),
                    ..Default::default()
                },
            )
            .unwrap();
            let lookup = || who.clone();
            if truncate {
                let set = SetAttr {
                    size: Some(100),
                    ..Default::default()
                };
                fs.setattr_by(f, &set, Some(&lookup)).unwrap();
            } else {
                fs.write_by(f, 10, b"abc", Some(&lookup)).unwrap();
            }
            let got = fs.getattr(f).unwrap().perm;
            assert_eq!(
                got, after,
                "truncate {truncate} by {} on {before:o}",
                who.uid
            );
        }
    }
    // The plain calls are privileged ones.
    fs.setattr(
        f,
        &SetAttr {
            mode: Some(0o6666),
            ..Default::default()
        },
    )
    .unwrap();
    fs.write(f, 0, b"x").unwrap();
    assert_eq!(fs.getattr(f).unwrap().perm, 0o6666);
    fs.setattr(
        f,
        &SetAttr {
            mode: Some(0o6666),
            ..Default::default()
        },
    )
    .unwrap();
    fs.fallocate(f, 0, 4096, FallocFlags::default()).unwrap();
    assert_eq!(fs.getattr(f).unwrap().perm, 0o6666);
    drop(fs);
    assert_fsck_clean(&img.path);
}

#[test]
fn removed_directory_stays_until_released() {
    let (img, fs, _f, d) = setup(opts(AtimeMode::Never, false, false));
    let b = fs.mkdir(ROOT_INO, b"b", 0o755, 0, 0).unwrap().ino;
    let c = fs.mkdir(ROOT_INO, b"c", 0o755, 0, 0).unwrap().ino;
    let root_links = fs.getattr(ROOT_INO).unwrap().nlink;
    // rename(b, d) replaces the open directory d.
    fs.open_inode(d).unwrap();
    fs.rename(ROOT_INO, b"b", ROOT_INO, b"d", RenameFlags::default())
        .unwrap();
    let a = fs
        .getattr(d)
        .expect("getattr of an open replaced directory");
    assert_eq!(a.nlink, 0);
    assert_eq!(a.kind, FileType::Directory);
    assert_eq!(fs.lookup(ROOT_INO, b"d").unwrap().ino, b);
    // rmdir of an open directory.
    fs.open_inode(c).unwrap();
    fs.rmdir(ROOT_INO, b"c").unwrap();
    assert_eq!(fs.getattr(c).unwrap().nlink, 0);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, root_links - 2);
    // Crash-safe meanwhile: both are on the orphan list.
    fs.sync().unwrap();
    assert_ne!(fs.superblock().last_orphan(), 0);
    // The last release frees them.
    let free0 = fs.statfs().unwrap().files_free;
    fs.release(d).unwrap();
    fs.release(c).unwrap();
    assert!(matches!(fs.getattr(d), Err(FsError::NotFound)));
    assert!(matches!(fs.getattr(c), Err(FsError::NotFound)));
    assert_eq!(fs.statfs().unwrap().files_free, free0 + 2);
    fs.sync().unwrap();
    assert_eq!(fs.superblock().last_orphan(), 0);
    drop(fs);
    assert_fsck_clean(&img.path);
}

#[test]
fn removed_open_directory_freed_at_unmount() {
    let (img, fs, _f, d) = setup(opts(AtimeMode::Never, false, false));
    fs.open_inode(d).unwrap();
    fs.rmdir(ROOT_INO, b"d").unwrap();
    assert_eq!(fs.getattr(d).unwrap().nlink, 0);
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

/// A change of owner or group clears setuid of a non-directory, whoever asks
/// (root included), and setgid when the file is group-executable or the
/// caller is neither in its group nor privileged: the VFS's chown rule, which
/// the daemon applies itself under FUSE_HANDLE_KILLPRIV_V2. A directory keeps
/// both; a mode given in the same call wins (the kernel without KILLPRIV_V2
/// sends the cleared mode along).
#[test]
fn chown_clears_setuid_and_setgid_by_the_vfs_rule() {
    let (img, fs, f, d) = setup(opts(AtimeMode::Never, false, false));
    let root = Caller {
        uid: 0,
        gid: 0,
        groups: vec![0],
        cap_fsetid: true,
    };
    let outsider = Caller {
        uid: 1000,
        gid: 1000,
        groups: vec![],
        cap_fsetid: false,
    };
    // (target, mode before, caller, mode after)
    let cases = [
        (f, 0o4755, &root, 0o755),
        (f, 0o6755, &root, 0o755),
        (f, 0o2745, &root, 0o2745),
        (f, 0o2745, &outsider, 0o745),
        (f, 0o0755, &outsider, 0o755),
        (d, 0o6755, &root, 0o6755),
    ];
    for (ino, before, who, after) in cases {
        fs.setattr(
            ino,
            &SetAttr {
                mode: Some(before),
                uid: Some(0),
                gid: Some(0),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(fs.getattr(ino).unwrap().perm, before, "mode with the owner");
        let lookup = || who.clone();
        let set = SetAttr {
            uid: Some(1000),
            ..Default::default()
        };
        fs.setattr_by(ino, &set, Some(&lookup)).unwrap();
        let a = fs.getattr(ino).unwrap();
        assert_eq!(
            (a.perm, a.uid),
            (after, 1000),
            "chown by uid {} of {before:o}",
            who.uid
        );
    }
    fs.unmount().unwrap();
    assert_fsck_clean(&img.path);
}
