//! `-o data_order=file` (docs/ARCHITECTURE.md "Per-file data ordering"):
//! ext4's delayed-allocation semantics beside the default prefix rule. What an
//! fsync writes (counts), what `sync`, a rename over an existing file and a
//! close after a truncate to zero write, the periodic commit's age rule, and
//! the option that is refused with it. Crash behaviour: the crash harness
//! (`crates/crashtest/tests/per_file_crash_states.rs`).

use std::sync::Arc;

use commitfs_device::{DeviceRef, FileDevice, IoCategory};
use commitfs_fs::testutil::{assert_fsck_clean, mkfs, read_all, TempImage};
use commitfs_fs::*;

fn opts(order: DataOrder, fast_commit: bool) -> MountOptions {
    MountOptions {
        // No background commits: the tests decide when data goes out.
        commit_interval: 0,
        fast_commit,
        data_order: order,
        ..Default::default()
    }
}

fn open(img: &TempImage, o: MountOptions) -> (Fs, DeviceRef) {
    let dev: DeviceRef = Arc::new(FileDevice::open(&img.path, false).unwrap());
    (Fs::open(dev.clone(), o).unwrap(), dev)
}

fn data_bytes(dev: &DeviceRef) -> u64 {
    dev.stats()
        .snapshot()
        .category(IoCategory::Data)
        .write_bytes
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8) | 1)
        .collect()
}

const BIG: usize = 1 << 20;
const SMALL: usize = 8192;

/// Under `data_order=file` an fsync writes its own file's data and nothing
/// of another file's 1 MiB still cached (ext4's cost); under the default
/// prefix rule the same fsync writes both. JBD2 and fast commits alike.
#[test]
fn an_fsync_writes_only_its_own_file_under_data_order_file() {
    for fc in [false, true] {
        for order in [DataOrder::Prefix, DataOrder::File] {
            let img = mkfs("order-fsync", 32, &["-b", "4096", "-O", "fast_commit"]);
            let (fs, dev) = open(&img, opts(order, fc));
            let big = fs.create(ROOT_INO, b"big", 0o644, 0, 0).unwrap().ino;
            let small = fs.create(ROOT_INO, b"small", 0o644, 0, 0).unwrap().ino;
            fs.write(big, 0, &pattern(1, BIG)).unwrap();
            fs.write(small, 0, &pattern(2, SMALL)).unwrap();
            let before = data_bytes(&dev);
            fs.fsync(small, false).unwrap();
            let wrote = data_bytes(&dev) - before;
            match order {
                DataOrder::File => assert_eq!(
                    wrote, SMALL as u64,
                    "fc={fc}: the fsync of an 8 KiB file wrote {wrote} data bytes"
                ),
                DataOrder::Prefix => assert!(
                    wrote >= (BIG + SMALL) as u64,
                    "fc={fc}: the prefix rule's fsync wrote only {wrote} bytes"
                ),
            }
            // Reads see every write either way; unmount writes the rest.
            assert_eq!(read_all(&fs, big), pattern(1, BIG));
            fs.unmount().unwrap();
            drop(fs);
            drop(dev);
            assert_fsck_clean(&img.path);
            let (fs, _) = open(&img, opts(order, fc));
            assert_eq!(read_all(&fs, big), pattern(1, BIG));
            assert_eq!(read_all(&fs, small), pattern(2, SMALL));
            fs.unmount().unwrap();
        }
    }
}

/// `sync` writes every file's cached data under `data_order=file` too.
#[test]
fn sync_writes_every_cached_file() {
    let img = mkfs("order-sync", 32, &["-b", "4096", "-O", "fast_commit"]);
    let (fs, dev) = open(&img, opts(DataOrder::File, true));
    let mut inos = Vec::new();
    for i in 0..5u8 {
        let ino = fs
            .create(ROOT_INO, &[b'f', b'0' + i], 0o644, 0, 0)
            .unwrap()
            .ino;
        fs.write(ino, 0, &pattern(i, SMALL)).unwrap();
        inos.push(ino);
    }
    let before = data_bytes(&dev);
    fs.sync().unwrap();
    assert_eq!(data_bytes(&dev) - before, 5 * SMALL as u64);
    assert_eq!(fs.cache_stats().unwrap().dirty_bytes, 0);
    fs.unmount().unwrap();
}

/// ext4's `auto_da_alloc`: renaming a file over an existing one writes the
/// renamed file's data first (write-to-temporary-then-rename survives a crash
/// without fsync); a rename to a new name does not. A close after a truncate
/// to zero writes the file back too.
#[test]
fn rename_over_a_file_and_close_after_truncate_write_data_back() {
    let img = mkfs("order-rename", 32, &["-b", "4096", "-O", "fast_commit"]);
    let (fs, dev) = open(&img, opts(DataOrder::File, true));
    let old = fs.create(ROOT_INO, b"config", 0o644, 0, 0).unwrap().ino;
    fs.write(old, 0, &pattern(1, SMALL)).unwrap();
    fs.fsync(old, false).unwrap();

    // A rename to a free name: nothing written.
    let tmp = fs.create(ROOT_INO, b"config.tmp", 0o644, 0, 0).unwrap().ino;
    fs.write(tmp, 0, &pattern(2, SMALL)).unwrap();
    let before = data_bytes(&dev);
    fs.rename(
        ROOT_INO,
        b"config.tmp",
        ROOT_INO,
        b"config.new",
        Default::default(),
    )
    .unwrap();
    assert_eq!(
        data_bytes(&dev),
        before,
        "a rename to a new name wrote data"
    );
    // Over the existing file: its data first.
    fs.rename(
        ROOT_INO,
        b"config.new",
        ROOT_INO,
        b"config",
        Default::default(),
    )
    .unwrap();
    assert_eq!(data_bytes(&dev) - before, SMALL as u64);
    assert_eq!(fs.cache_stats().unwrap().dirty_bytes, 0);

    // Truncate to zero, rewrite, close: written at the close.
    fs.open_inode(tmp).unwrap();
    fs.setattr(
        tmp,
        &SetAttr {
            size: Some(0),
            ..Default::default()
        },
    )
    .unwrap();
    fs.write(tmp, 0, &pattern(3, SMALL)).unwrap();
    let before = data_bytes(&dev);
    fs.release(tmp).unwrap();
    assert_eq!(data_bytes(&dev) - before, SMALL as u64);
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

/// Through FUSE a close sends no request, so the close-time write-back above
/// cannot be relied on: a commit (full or fast, here another file's fsync)
/// that carries a truncate to zero must carry the rewritten data too, or a
/// crash leaves the file empty. The image copied right after the fsync
/// returns (a power cut then) recovers with the new content.
#[test]
fn a_commit_carrying_a_truncate_to_zero_writes_the_rewrite() {
    for fc in [false, true] {
        let img = mkfs("order-trunc", 32, &["-b", "4096", "-O", "fast_commit"]);
        let (fs, _dev) = open(&img, opts(DataOrder::File, fc));
        let a = fs.create(ROOT_INO, b"a", 0o644, 0, 0).unwrap().ino;
        let b = fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap().ino;
        fs.write(a, 0, &pattern(1, SMALL)).unwrap();
        fs.fsync(a, false).unwrap();
        fs.open_inode(a).unwrap();
        fs.setattr(
            a,
            &SetAttr {
                size: Some(0),
                ..Default::default()
            },
        )
        .unwrap();
        fs.write(a, 0, &pattern(4, SMALL)).unwrap();
        fs.write(b, 0, &pattern(5, SMALL)).unwrap();
        fs.fsync(b, false).unwrap();
        let crash = mkfs("order-trunc-crash", 1, &[]);
        std::fs::copy(&img.path, &crash.path).unwrap();
        fs.release(a).unwrap();
        fs.unmount().unwrap();
        drop(fs);
        let (fs2, _) = open(&crash, opts(DataOrder::File, fc));
        let a2 = fs2.lookup(ROOT_INO, b"a").unwrap().ino;
        assert_eq!(
            read_all(&fs2, a2),
            pattern(4, SMALL),
            "fast_commit={fc}: the truncate went out without the rewritten data"
        );
        assert_eq!(
            read_all(&fs2, fs2.lookup(ROOT_INO, b"b").unwrap().ino),
            pattern(5, SMALL)
        );
        fs2.unmount().unwrap();
        drop(fs2);
        assert_fsck_clean(&crash.path);
    }
}

/// The periodic commit writes back only data dirty for 30 s under
/// `data_order=file` (the kernel's dirty_expire_centisecs), so a fresh write
/// is not forced out by it; under the prefix rule it is.
#[test]
fn the_periodic_commit_leaves_fresh_data_cached_under_data_order_file() {
    for order in [DataOrder::Prefix, DataOrder::File] {
        let img = mkfs("order-periodic", 32, &["-b", "4096", "-O", "fast_commit"]);
        let (fs, dev) = open(
            &img,
            MountOptions {
                commit_interval: 1,
                ..opts(order, true)
            },
        );
        let ino = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
        fs.write(ino, 0, &pattern(1, SMALL)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2500));
        let wrote = data_bytes(&dev);
        match order {
            DataOrder::File => assert_eq!(wrote, 0, "fresh data written by the periodic commit"),
            DataOrder::Prefix => assert_eq!(wrote, SMALL as u64),
        }
        fs.unmount().unwrap();
        assert_eq!(data_bytes(&dev), SMALL as u64, "{order:?}: unmount");
    }
}

/// `fc_data_csum` relies on every commit's cut; with `data_order=file` it is
/// refused by name.
#[test]
fn data_order_file_with_fc_data_csum_is_refused() {
    let img = mkfs("order-csum", 32, &["-b", "4096", "-O", "fast_commit"]);
    let dev: DeviceRef = Arc::new(FileDevice::open(&img.path, false).unwrap());
    let e = Fs::open(
        dev,
        MountOptions {
            fc_data_csum: true,
            ..opts(DataOrder::File, true)
        },
    )
    .err()
    .expect("mounted");
    assert!(e.to_string().contains("data_order=file"), "{e}");
}
