//! End-to-end smoke test of the library on real mkfs.ext4 images: namespace
//! operations, data, unmount, e2fsck, remount, then the kernel reads the result.

use commitfs_fs::testutil::{assert_fsck_clean, mkfs};
use commitfs_fs::*;

fn run(block_size: &str, extra: &[&str]) {
    let mut args = vec!["-b", block_size];
    args.extend_from_slice(extra);
    let img = mkfs("smoke", 64, &args);
    {
        let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
        let d = fs.mkdir(ROOT_INO, b"dir", 0o755, 1000, 1000).unwrap();
        let f = fs.create(d.ino, b"file", 0o644, 1000, 1000).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(fs.write(f.ino, 0, &data).unwrap(), data.len());
        let mut back = vec![0u8; data.len()];
        assert_eq!(fs.read(f.ino, 0, &mut back).unwrap(), data.len());
        assert_eq!(back, data);
        // Sparse write far away, then read the hole.
        fs.write(f.ino, 10 << 20, b"tail").unwrap();
        let mut hole = vec![1u8; 4096];
        fs.read(f.ino, 5 << 20, &mut hole).unwrap();
        assert!(hole.iter().all(|&b| b == 0));
        fs.symlink(d.ino, b"short", b"file", 0, 0).unwrap();
        let long = vec![b'x'; 200];
        fs.symlink(d.ino, b"long", &long, 0, 0).unwrap();
        assert_eq!(
            fs.readlink(fs.lookup(d.ino, b"long").unwrap().ino).unwrap(),
            long
        );
        fs.link(f.ino, ROOT_INO, b"hardlink").unwrap();
        assert_eq!(fs.getattr(f.ino).unwrap().nlink, 2);
        for i in 0..500 {
            fs.create(d.ino, format!("n{i}").as_bytes(), 0o600, 0, 0)
                .unwrap();
        }
        for i in (0..500).step_by(3) {
            fs.unlink(d.ino, format!("n{i}").as_bytes()).unwrap();
        }
        fs.rename(d.ino, b"n1", ROOT_INO, b"moved", RenameFlags::default())
            .unwrap();
        let sub = fs.mkdir(d.ino, b"sub", 0o700, 0, 0).unwrap();
        fs.rename(d.ino, b"sub", ROOT_INO, b"sub2", RenameFlags::default())
            .unwrap();
        assert_eq!(fs.lookup(sub.ino, b"..").unwrap().ino, ROOT_INO);
        fs.setattr(
            f.ino,
            &SetAttr {
                size: Some(1000),
                ..Default::default()
            },
        )
        .unwrap();
        fs.fsync(f.ino, false).unwrap();
        fs.unmount().unwrap();
    }
    assert_fsck_clean(&img.path);
    let fs = Fs::open_path(&img.path, MountOptions::default()).unwrap();
    let d = fs.resolve("/dir").unwrap();
    let names = fs.readdir_all(d).unwrap();
    // ".", "..", file, short, long, 500 - 167 unlinked - 1 moved
    assert_eq!(names.len(), 2 + 3 + 500 - 167 - 1, "{:?}", names.len());
    let f = fs.resolve("/dir/file").unwrap();
    assert_eq!(fs.getattr(f).unwrap().size, 1000);
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

#[test]
fn smoke_1k() {
    run("1024", &[]);
}

#[test]
fn smoke_4k_fast_commit_upstream_defaults() {
    run(
        "4096",
        &["-O", "fast_commit,metadata_csum_seed,orphan_file"],
    );
}
