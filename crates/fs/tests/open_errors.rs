//! What `Fs::open_path` says about images it cannot open (issue #9, item 11): an
//! empty or all-zero image, a damaged primary superblock (naming the e2fsck command
//! that restores it from the backup, which must then really work), and an incompat
//! feature commitfs cannot read, with `-o ro` too.

use std::os::unix::fs::FileExt;
use std::process::Command;

use commitfs_fs::probe::OpenError;
use commitfs_fs::testutil::{assert_fsck_clean, mkfs, TempImage};
use commitfs_fs::*;

fn open_err(img: &TempImage, read_only: bool) -> FsError {
    match Fs::open_path(
        &img.path,
        MountOptions {
            read_only,
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("{} opened", img.path.display()),
        Err(e) => e,
    }
}

#[test]
fn empty_and_all_zero_images_say_there_is_no_file_system() {
    let img = mkfs("open-empty", 8, &[]);
    std::fs::File::create(&img.path).unwrap(); // truncate to 0 bytes
    for ro in [false, true] {
        let e = open_err(&img, ro);
        assert!(
            matches!(e, FsError::Open(OpenError::Empty { size: 0 })),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains("empty (0 bytes)"), "{msg}");
        assert!(msg.contains("commitfs mkfs"), "{msg}");
    }
    std::fs::File::create(&img.path)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let e = open_err(&img, false);
    assert!(matches!(e, FsError::Open(OpenError::Unformatted)), "{e:?}");
    assert!(e.to_string().contains("only zeros"), "{e}");
}

/// Damage the primary superblock (zeros, and garbage), check the message names the
/// backup e2fsck needs, run exactly that command, and open the repaired image.
fn damaged_superblock(block_size: u32, size_mib: u64, want_backup: u64) {
    for garbage in [false, true] {
        let img = mkfs("open-badsb", size_mib, &["-b", &block_size.to_string()]);
        let bytes: Vec<u8> = if garbage {
            (0..1024u32).map(|i| (i * 7 + 3) as u8).collect()
        } else {
            vec![0; 1024]
        };
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&img.path)
            .unwrap();
        f.write_all_at(&bytes, 1024).unwrap();
        drop(f);
        let e = open_err(&img, false);
        assert!(e.is_corruption(), "{e:?}");
        let FsError::Open(OpenError::DamagedSuperblock {
            backup,
            block_size: bs,
            ..
        }) = &e
        else {
            panic!("expected a damaged-superblock diagnosis, got {e:?}");
        };
        assert_eq!((*backup, *bs), (want_backup, block_size));
        let msg = e.to_string();
        let cmd = format!(
            "e2fsck -b {want_backup} -B {block_size} {}",
            img.path.display()
        );
        assert!(msg.contains(&cmd), "{msg}");
        // The advice works: e2fsck restores the primary from that backup.
        let out = Command::new("e2fsck")
            .args(["-fy", "-b", &want_backup.to_string()])
            .args(["-B", &block_size.to_string()])
            .arg(&img.path)
            .output()
            .unwrap();
        assert!(
            out.status.code().is_some_and(|c| c <= 1),
            "{cmd}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_fsck_clean(&img.path);
        let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
        fs.mkdir(ROOT_INO, b"after-repair", 0o755, 0, 0).unwrap();
        fs.unmount().unwrap();
        drop(fs);
        assert_fsck_clean(&img.path);
    }
}

#[test]
fn a_damaged_superblock_names_the_backup_1k() {
    damaged_superblock(1024, 16, 8193);
}

#[test]
fn a_damaged_superblock_names_the_backup_4k() {
    damaged_superblock(4096, 256, 32768);
}

#[test]
fn a_damaged_superblock_without_backup_is_plain_corruption() {
    // 4 KiB blocks, 64 MiB: one group, no backup superblock.
    let img = mkfs("open-nobackup", 64, &["-b", "4096"]);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&img.path)
        .unwrap();
    f.write_all_at(&[0xA5; 1024], 1024).unwrap();
    drop(f);
    let e = open_err(&img, false);
    assert!(e.is_corruption(), "{e:?}");
    assert!(!e.to_string().contains("e2fsck -b"), "{e}");
}

#[test]
fn an_unreadable_feature_is_named_also_read_only() {
    let img = mkfs("open-inline", 16, &["-O", "inline_data"]);
    for ro in [false, true] {
        let e = open_err(&img, ro);
        assert!(
            matches!(&e, FsError::Open(OpenError::UnsupportedIncompat(f)) if f == "inline_data"),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains("inline_data"), "{msg}");
        assert!(msg.contains("not even read-only"), "{msg}");
        assert!(!msg.contains("cannot mount read-write"), "{msg}");
    }
}
