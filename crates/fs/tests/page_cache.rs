//! The page cache and delayed allocation (issue #11; docs/ARCHITECTURE.md
//! "Design: the page cache and the commit cut"): what reaches the device and
//! when (counts), space reservation at `write()`, the memory cap, times and
//! sizes of cached writes, and that nothing acknowledged is lost.

use std::sync::Arc;

use commitfs_device::{DeviceRef, FileDevice, IoCategory};
use commitfs_fs::testutil::{assert_fsck_clean, mkfs, read_all, TempImage};
use commitfs_fs::*;

fn opts() -> MountOptions {
    MountOptions {
        // No background commits: the tests decide when data goes out.
        commit_interval: 0,
        ..Default::default()
    }
}

/// `cache_size=1`: 512 KiB of pages (a 128 KiB dirty limit).
fn small_cache() -> MountOptions {
    MountOptions {
        cache_mb: 1,
        ..opts()
    }
}

fn open(img: &TempImage, o: MountOptions) -> (Fs, DeviceRef) {
    let dev: DeviceRef = Arc::new(FileDevice::open(&img.path, false).unwrap());
    (Fs::open(dev.clone(), o).unwrap(), dev)
}

fn data_writes(dev: &DeviceRef) -> (u64, u64) {
    let s = dev.stats().snapshot();
    let d = s.category(IoCategory::Data);
    (d.writes, d.write_bytes)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(131).wrapping_add(i as u64 * 7) % 251) as u8 | 1)
        .collect()
}

/// Append `chunk` at `start` onwards until ENOSPC; returns the bytes the
/// writes acknowledged (short writes included).
fn write_until_nospace(fs: &Fs, ino: Ino, start: u64, chunk: &[u8]) -> u64 {
    let mut acked = 0u64;
    loop {
        match fs.write(ino, start + acked, chunk) {
            Ok(n) => acked += n as u64,
            Err(FsError::NoSpace) => return acked,
            Err(e) => panic!("write: {e}"),
        }
        assert!(acked < 1 << 30, "never ran out of space");
    }
}

/// Small appends stay in memory (no device write at all, the size and
/// `st_blocks` already show them, reads see them); the fsync allocates the
/// whole file at once and writes it as one contiguous run.
#[test]
fn appends_reach_the_device_once_as_one_run() {
    for fc in [false, true] {
        let img = mkfs("pc-append", 32, &["-b", "4096", "-O", "fast_commit"]);
        let (fs, dev) = open(
            &img,
            MountOptions {
                fast_commit: fc,
                ..opts()
            },
        );
        let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
        fs.sync().unwrap();
        let before = data_writes(&dev);
        let piece = pattern(1, 100);
        let mut want = Vec::new();
        for k in 0..300u64 {
            assert_eq!(fs.write(f, k * 100, &piece).unwrap(), 100);
            want.extend_from_slice(&piece);
        }
        assert_eq!(
            data_writes(&dev),
            before,
            "fc={fc}: cached appends wrote data"
        );
        let a = fs.getattr(f).unwrap();
        assert_eq!(a.size, 30_000, "fc={fc}: visible size");
        assert_eq!(
            a.blocks,
            8 * 8,
            "fc={fc}: delayed blocks count in st_blocks"
        );
        assert_eq!(read_all(&fs, f), want, "fc={fc}: read of cached data");
        assert_eq!(
            data_writes(&dev),
            before,
            "fc={fc}: reads came from the cache"
        );
        fs.fsync(f, false).unwrap();
        let after = data_writes(&dev);
        assert_eq!(
            after.0 - before.0,
            1,
            "fc={fc}: one device write for the whole file (one contiguous run)"
        );
        assert_eq!(after.1 - before.1, 8 * 4096, "fc={fc}: eight blocks");
        let st = fs.cache_stats().unwrap();
        assert_eq!(st.dirty_bytes, 0, "fc={fc}: nothing dirty after the fsync");
        assert_eq!(st.bytes_written, 30_000);
        // A second fsync has nothing to write.
        fs.fsync(f, false).unwrap();
        assert_eq!(data_writes(&dev), after);
        fs.unmount().unwrap();
        drop(fs);
        drop(dev);
        assert_fsck_clean(&img.path);
        let (fs, _) = open(&img, opts());
        let f = fs.resolve("/f").unwrap();
        assert_eq!(read_all(&fs, f), want, "fc={fc}: after remount");
        fs.unmount().unwrap();
    }
}

/// A file written and removed before any write-back costs no data I/O, and
/// its reserved space comes back.
#[test]
fn data_of_a_file_removed_before_write_back_is_never_written() {
    let img = mkfs("pc-unlink", 32, &["-b", "4096"]);
    let (fs, dev) = open(&img, opts());
    fs.sync().unwrap();
    let free0 = fs.statfs().unwrap().blocks_free;
    let before = data_writes(&dev);
    for k in 0..20u64 {
        let name = format!("tmp{k}");
        let f = fs
            .create(ROOT_INO, name.as_bytes(), 0o644, 0, 0)
            .unwrap()
            .ino;
        fs.write(f, 0, &pattern(k, 64 * 1024)).unwrap();
        assert!(fs.statfs().unwrap().blocks_free <= free0 - 16, "reserved");
        fs.unlink(ROOT_INO, name.as_bytes()).unwrap();
    }
    fs.sync().unwrap();
    assert_eq!(
        data_writes(&dev),
        before,
        "data of removed files was written"
    );
    assert_eq!(fs.statfs().unwrap().blocks_free, free0, "space back");
    assert!(fs.cache_stats().unwrap().dropped_dirty >= 20 * 16);
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

/// ENOSPC is decided at `write()` (space is reserved for delayed blocks):
/// on a file system filled by cached writes alone, the writer gets ENOSPC or a
/// short write, and every byte it was told was written is on the device after
/// sync and a remount.
#[test]
fn enospc_at_write_time_and_nothing_acknowledged_is_lost() {
    for bs in ["1024", "4096"] {
        let img = mkfs("pc-enospc", 8, &["-b", bs]);
        let (fs, _) = open(&img, opts());
        let chunk = 48 * 1024;
        let mut files = Vec::new();
        'fill: for k in 0..1000u64 {
            let name = format!("f{k}");
            let f = match fs.create(ROOT_INO, name.as_bytes(), 0o644, 0, 0) {
                Ok(a) => a.ino,
                Err(FsError::NoSpace) => break,
                Err(e) => panic!("{bs}: create: {e}"),
            };
            let data = pattern(k, chunk);
            let mut done = 0;
            while done < chunk {
                match fs.write(f, done as u64, &data[done..]) {
                    Ok(0) => panic!("{bs}: a zero-length write instead of ENOSPC"),
                    Ok(n) => done += n,
                    Err(FsError::NoSpace) => {
                        files.push((name, data[..done].to_vec()));
                        break 'fill;
                    }
                    Err(e) => panic!("{bs}: write: {e}"),
                }
            }
            files.push((name, data));
        }
        assert!(files.len() > 10, "{bs}: filled after {} files", files.len());
        // Nothing was written back yet: it all fits when it is.
        fs.sync().unwrap();
        assert_eq!(
            fs.cache_stats().unwrap().dirty_bytes,
            0,
            "{bs}: all written"
        );
        fs.unmount().unwrap();
        drop(fs);
        assert_fsck_clean(&img.path);
        let (fs, _) = open(&img, opts());
        for (name, want) in &files {
            let f = fs.resolve(&format!("/{name}")).unwrap();
            assert!(
                read_all(&fs, f) == *want,
                "{bs}: {name} lost acknowledged data"
            );
        }
        fs.unmount().unwrap();
    }
}

/// The cap bounds the cache: a file many times larger than it is written
/// without an fsync; the cached bytes stay under the cap (dirty pages are
/// written back by their writer past half of it, clean ones evicted), and
/// the data is all there.
#[test]
fn memory_cap_bounds_a_large_sequential_write() {
    let img = mkfs("pc-cap", 64, &["-b", "4096"]);
    let (fs, _) = open(&img, small_cache());
    let f = fs.create(ROOT_INO, b"big", 0o644, 0, 0).unwrap().ino;
    let piece = 128 * 1024;
    let total = 24 << 20;
    let mut peak = 0;
    for k in 0..(total / piece) as u64 {
        fs.write(f, k * piece as u64, &pattern(k, piece)).unwrap();
        peak = peak.max(fs.cache_stats().unwrap().cached_bytes);
    }
    assert!(
        peak <= (1 << 20) + piece as u64,
        "cache peaked at {peak} bytes with a 1 MiB cap"
    );
    fs.fsync(f, false).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
    let (fs, _) = open(&img, opts());
    let f = fs.resolve("/big").unwrap();
    let mut buf = vec![0u8; piece];
    for k in 0..(total / piece) as u64 {
        assert_eq!(fs.read(f, k * piece as u64, &mut buf).unwrap(), piece);
        assert!(buf == pattern(k, piece), "piece {k}");
    }
    fs.unmount().unwrap();
}

/// Times and sizes of cached writes behave as the kernel's: an explicit mtime
/// set after a write wins (cp -a, tar), a chmod after a write keeps the
/// write's mtime, and a truncate below cached data then an extension reads
/// zeros, before and after a remount.
#[test]
fn times_and_truncates_of_cached_writes() {
    let img = mkfs("pc-times", 32, &["-b", "4096"]);
    let (fs, _) = open(&img, opts());
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, &pattern(3, 10_000)).unwrap();
    let old = commitfs_format::inode::Timestamp::new(1_000_000_000, 5);
    fs.setattr(
        f,
        &SetAttr {
            mtime: Some(SetTime::At(old)),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(fs.getattr(f).unwrap().mtime, old, "utimens after a write");
    let g = fs.create(ROOT_INO, b"g", 0o644, 0, 0).unwrap().ino;
    fs.write(g, 0, b"hello").unwrap();
    let written = fs.getattr(g).unwrap().mtime;
    assert!(written.sec > old.sec);
    fs.setattr(
        g,
        &SetAttr {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    let a = fs.getattr(g).unwrap();
    assert_eq!(a.mtime, written, "chmod keeps the write's mtime");
    assert!(a.ctime >= written);
    // Truncate into cached data, then extend: zeros, not the old bytes.
    fs.setattr(
        f,
        &SetAttr {
            size: Some(5000),
            ..Default::default()
        },
    )
    .unwrap();
    fs.write(f, 9000, b"end").unwrap();
    let mut want = pattern(3, 10_000);
    want.truncate(5000);
    want.resize(9000, 0);
    want.extend_from_slice(b"end");
    assert_eq!(read_all(&fs, f), want, "truncate then extend");
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
    let (fs, _) = open(&img, opts());
    let f = fs.resolve("/f").unwrap();
    assert_eq!(read_all(&fs, f), want, "after remount");
    let g = fs.resolve("/g").unwrap();
    assert_eq!(
        fs.getattr(g).unwrap().mtime,
        written,
        "the write's mtime is durable"
    );
    assert_eq!(fs.getattr(g).unwrap().perm, 0o600);
    fs.unmount().unwrap();
}

/// `-o nocache` keeps the write-through path: data reaches the device at
/// `write()`.
#[test]
fn nocache_writes_through() {
    let img = mkfs("pc-nocache", 32, &["-b", "4096"]);
    let (fs, dev) = open(
        &img,
        MountOptions {
            page_cache: false,
            ..opts()
        },
    );
    assert!(fs.cache_stats().is_none());
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    let before = data_writes(&dev);
    fs.write(f, 0, &pattern(1, 8192)).unwrap();
    assert!(data_writes(&dev).0 > before.0, "written at write()");
    fs.unmount().unwrap();
}

/// Space granted to cached writes is not given to other allocations: after a
/// small cached write, a fallocate of what is left cannot take the blocks the
/// cache may still reserve without asking, so a later write gets ENOSPC at
/// `write()` rather than at write-back.
#[test]
fn fallocate_cannot_take_space_promised_to_cached_writes() {
    let img = mkfs("pc-grant", 64, &["-b", "4096"]);
    let (fs, _) = open(&img, opts());
    let a = fs.create(ROOT_INO, b"a", 0o644, 0, 0).unwrap().ino;
    fs.write(a, 0, &pattern(1, 4096)).unwrap();
    let b = fs.create(ROOT_INO, b"b", 0o644, 0, 0).unwrap().ino;
    // Take everything fallocate can get, in pieces.
    let mut off = 0u64;
    loop {
        match fs.fallocate(b, off, 1 << 20, FallocFlags::default()) {
            Ok(()) => off += 1 << 20,
            Err(FsError::NoSpace) => break,
            Err(e) => panic!("fallocate: {e}"),
        }
    }
    // Cached writes until ENOSPC: every acknowledged one must reach the disk.
    let acked = write_until_nospace(&fs, a, 4096, &pattern(2, 64 * 1024));
    fs.fsync(a, false).expect("every acknowledged byte fits");
    assert_eq!(fs.getattr(a).unwrap().size, 4096 + acked);
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

/// A truncate on a full file system drops the cached pages past the new size
/// instead of writing them back first (which would need the space that is
/// not there).
#[test]
fn truncate_on_a_full_file_system_drops_cached_pages() {
    let img = mkfs("pc-trunc-full", 8, &["-b", "4096"]);
    let (fs, _) = open(&img, opts());
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    let off = write_until_nospace(&fs, f, 0, &pattern(3, 64 * 1024));
    assert!(fs.cache_stats().unwrap().dirty_bytes > 0);
    for size in [off / 2, 0] {
        fs.setattr(
            f,
            &SetAttr {
                size: Some(size),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("truncate to {size}: {e}"));
        assert_eq!(fs.getattr(f).unwrap().size, size);
    }
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

/// The largest file offsets (the last of 2^32 blocks) go through the cache
/// without overflowing a block number.
#[test]
fn writes_at_the_largest_offsets() {
    let img = mkfs("pc-maxoff", 32, &["-b", "4096"]);
    let (fs, _) = open(&img, opts());
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, b"x").unwrap();
    let last = (1u64 << 32) * 4096 - 4096;
    assert_eq!(fs.write(f, last, &[7u8; 4095]).unwrap(), 4095);
    assert!(matches!(
        fs.write(f, last, &[7u8; 4096]),
        Err(FsError::FileTooBig)
    ));
    let mut buf = [0u8; 10];
    assert_eq!(fs.read(f, last, &mut buf).unwrap(), 10);
    assert_eq!(buf, [7u8; 10]);
    fs.fsync(f, false).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    assert_fsck_clean(&img.path);
}

/// Eviction spares what is read again (second chance; written-only pages go
/// first, the kernel's use-once rule): the first 64 KiB of a file, read again
/// between the write-backs of a 2 MiB stream appended to the same file under a
/// 512 KiB cap, are still answered from memory at the end, though eviction
/// walks a file from its first block and evicted the stream.
#[test]
fn eviction_keeps_pages_that_are_read_again() {
    let img = mkfs("pc-lru", 32, &["-b", "4096"]);
    let (fs, dev) = open(&img, small_cache());
    let ino = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    const HOT: u64 = 64 << 10;
    let hot_data = pattern(5, HOT as usize);
    fs.write(ino, 0, &hot_data).unwrap();
    fs.fsync(ino, false).unwrap();
    let chunk = pattern(6, 64 << 10);
    let data_reads = || dev.stats().snapshot().category(IoCategory::Data).reads;
    let read_hot = || {
        let mut b = vec![0u8; HOT as usize];
        assert_eq!(fs.read(ino, 0, &mut b).unwrap(), HOT as usize);
        assert_eq!(b, hot_data);
    };
    for k in 0..32u64 {
        fs.write(ino, HOT + k * (64 << 10), &chunk).unwrap();
        fs.fsync(ino, false).unwrap();
        read_hot();
    }
    let s = fs.cache_stats().unwrap();
    assert!(s.evicted >= 256, "the stream was not evicted: {s:?}");
    let before = data_reads();
    read_hot();
    assert_eq!(data_reads(), before, "the re-read range was evicted: {s:?}");
    fs.unmount().unwrap();
    assert_fsck_clean(&img.path);
}

/// A truncate writes the file's dirty pages back first, those past its new
/// size too: the size that exposes them may already be in a transaction that
/// commits before the truncate's (another thread's fsync), and a crash between
/// the two must find their bytes. Dropping them unwritten showed the file's
/// older bytes there after such a crash (crash harness, `fc_crash_states`
/// mt4). Counted: the device writes the pages past the new size, then the
/// truncate leaves the right bytes and a clean file system.
#[test]
fn truncate_writes_back_pages_past_the_new_size() {
    let img = mkfs("pc-trunc", 16, &["-b", "1024"]);
    {
        let (fs, dev) = open(&img, opts());
        let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap();
        let a = pattern(1, 8192);
        fs.write(f.ino, 0, &a).unwrap();
        fs.fsync(f.ino, false).unwrap();
        // Cached: an overwrite of blocks 5..7 and an extension into 8..9.
        let b = pattern(2, 5120);
        fs.write(f.ino, 5120, &b).unwrap();
        let (_, before) = data_writes(&dev);
        fs.setattr(
            f.ino,
            &SetAttr {
                size: Some(2048),
                ..Default::default()
            },
        )
        .unwrap();
        let (_, after) = data_writes(&dev);
        assert!(
            after - before >= 5 * 1024,
            "the pages past the new size were not written back: {} bytes",
            after - before
        );
        assert_eq!(fs.getattr(f.ino).unwrap().size, 2048);
        assert_eq!(read_all(&fs, f.ino), a[..2048].to_vec());
        fs.unmount().unwrap();
    }
    assert_fsck_clean(&img.path);
}

/// A cut that runs out of space part-way (the last free blocks went to a
/// hole's block and the extent block a fifth extent needs) still writes the
/// pages after that which overwrite blocks in place inside the file's size;
/// only what needs space stays dirty. Left dirty, such a page's block could
/// be in the data checksums of the commit the cut served (`fc_data_csum`) and
/// be rewritten in place after it without the overwrite check, and recovery
/// would drop that acknowledged commit (found by a review). The file's last,
/// partial block is such a page here, with an append past it: once written,
/// the size covers it (clean, its bytes past the size would read as zeros
/// once evicted). Checked on the device as another file's fsync left it, in
/// both fast-commit modes; the cut left a hole unfilled, or the test says it
/// never ran out of space.
#[test]
fn a_cut_out_of_space_still_writes_in_place_pages() {
    const BS: usize = 4096;
    let size0 = 6 * BS + BS / 2;
    for csum in [false, true] {
        let img = mkfs("pc-cut-enospc", 8, &["-b", "4096", "-O", "fast_commit"]);
        let o = MountOptions {
            fast_commit: true,
            fc_data_csum: csum,
            ..opts()
        };
        let (fs, _) = open(&img, o.clone());
        // f: blocks 0, 2, 4 and 6 (half full) mapped (four extents: the
        // inode's room), 1, 3 and 5 holes.
        let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
        let base = pattern(1, size0);
        fs.write(f, 0, &base).unwrap();
        fs.sync().unwrap();
        let punch = FallocFlags {
            punch_hole: true,
            keep_size: true,
            ..Default::default()
        };
        for l in [1u64, 3, 5] {
            fs.fallocate(f, l * BS as u64, BS as u64, punch).unwrap();
        }
        let g = fs.create(ROOT_INO, b"g", 0o644, 0, 0).unwrap().ino;
        fs.write(g, 0, &pattern(2, BS)).unwrap();
        fs.sync().unwrap();
        // Cached: holes 3 and 5 filled (a block reserved for each), an
        // append over the rest of block 6 (in place) into block 7 (a block
        // reserved), g's block overwritten in place.
        fs.write(f, 3 * BS as u64, &pattern(3, BS)).unwrap();
        fs.write(f, 5 * BS as u64, &pattern(5, BS)).unwrap();
        fs.write(f, size0 as u64, &pattern(6, BS)).unwrap();
        fs.write(g, 0, &pattern(4, BS)).unwrap();
        // Every other free block to h: the reserved ones are all that is left.
        let h = fs.create(ROOT_INO, b"h", 0o644, 0, 0).unwrap().ino;
        let mut off = 0u64;
        for chunk in [256 * BS as u64, BS as u64] {
            loop {
                match fs.fallocate(h, off, chunk, FallocFlags::default()) {
                    Ok(()) => off += chunk,
                    Err(FsError::NoSpace) => break,
                    Err(e) => panic!("fallocate: {e}"),
                }
            }
        }
        // g's fsync cuts every dirty page.
        fs.fsync(g, false).unwrap();
        // Only what needs space waits: the two holes and block 7.
        assert_eq!(
            fs.cache_stats().unwrap().dirty_bytes,
            3 * BS as u64,
            "csum={csum}: dirty after the cut"
        );
        let crashed = TempImage {
            path: img.path.with_extension("crash.img"),
        };
        std::fs::copy(&img.path, &crashed.path).unwrap();
        drop(fs);
        let (rec, _) = open(&crashed, o);
        let fr = rec.resolve("/f").unwrap();
        let got = read_all(&rec, fr);
        assert_eq!(
            got.len(),
            7 * BS,
            "csum={csum}: size after the cut (block 6 written, block 7 not)"
        );
        assert!(
            got[5 * BS..6 * BS].iter().all(|&b| b == 0),
            "csum={csum}: hole 5 was filled: the cut never ran out of space"
        );
        assert!(got[..BS] == base[..BS], "csum={csum}: block 0");
        assert!(
            got[6 * BS..size0] == base[6 * BS..],
            "csum={csum}: block 6's first half"
        );
        assert!(
            got[size0..] == pattern(6, BS)[..7 * BS - size0],
            "csum={csum}: block 6's second half, written in place, stayed dirty in the cut"
        );
        let gr = rec.resolve("/g").unwrap();
        assert_eq!(read_all(&rec, gr), pattern(4, BS), "csum={csum}: g");
        rec.unmount().unwrap();
        drop(rec);
        assert_fsck_clean(&crashed.path);
    }
}
