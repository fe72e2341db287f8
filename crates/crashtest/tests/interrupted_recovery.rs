//! A crash during journal replay: the device I/O of a recovery (an `Fs::open` of
//! a crash image with a live log) is recorded, crash states are built at every
//! point of it, and recovery is run again on each. The result must be identical to
//! the uninterrupted recovery: the same image (up to mount counters and times),
//! the same tree and data, and e2fsck clean.

use std::sync::Arc;

use commitfs_crashtest::jlog::journal_blocks;
use commitfs_crashtest::observe::{observe, Observed};
use commitfs_crashtest::{base_image, check_image, find, record, ScratchFile};
use commitfs_device::{CrashSpec, IoCategory, LogOp, MemDevice, RecordingDevice};
use commitfs_format::jbd2;
use commitfs_format::superblock as sbf;
use commitfs_fs::{Fs, MountOptions};

fn opts() -> MountOptions {
    MountOptions {
        read_only: false,
        commit_interval: 0,
        // Reading what recovery made must not change it (no atime updates).
        atime: commitfs_fs::AtimeMode::Never,
        ..Default::default()
    }
}

/// Fields a second mount legitimately changes: the ext4 superblock's mount count,
/// mount/write times, lifetime writes and checksum; the journal superblock's
/// sequence (one more mount opens one more log) and checksum. With `counts`, also
/// the free counts: while mounted they may lag (like the kernel, commitfs rewrites
/// them at unmount and refreshes them at mount only when it replayed a log itself).
fn mask_block(block: &mut [u8], block_off: usize, jsb_offsets: &[u64], counts: bool) {
    let sb = sbf::SUPERBLOCK_OFFSET as usize;
    let mut fields = vec![
        (sb + sbf::S_MTIME, 4),
        (sb + sbf::S_WTIME, 4),
        (sb + sbf::S_MNT_COUNT, 2),
        (sb + sbf::S_KBYTES_WRITTEN, 8),
        (sb + sbf::S_WTIME_HI, 1),
        (sb + sbf::S_MTIME_HI, 1),
        (sb + sbf::S_CHECKSUM, 4),
    ];
    if counts {
        fields.extend([
            (sb + sbf::S_FREE_BLOCKS_COUNT_LO, 4),
            (sb + sbf::S_FREE_BLOCKS_COUNT_HI, 4),
            (sb + sbf::S_FREE_INODES_COUNT, 4),
        ]);
    }
    for &j in jsb_offsets {
        fields.push((j as usize + jbd2::S_SEQUENCE, 4));
        fields.push((j as usize + jbd2::S_CHECKSUM, 4));
    }
    for (off, len) in fields {
        if off >= block_off && off + len <= block_off + block.len() {
            block[off - block_off..off - block_off + len].fill(0);
        }
    }
}

/// Blocks (with their first differing byte offsets) where `a` and `b` differ
/// beyond the masked fields.
fn diff_masked(
    a: &[u8],
    b: &[u8],
    bs: usize,
    jsbs: &[u64],
    counts: bool,
) -> Vec<(usize, Vec<usize>)> {
    let mut out = Vec::new();
    for (i, (x, y)) in a.chunks(bs).zip(b.chunks(bs)).enumerate() {
        if x == y {
            continue;
        }
        let (mut x, mut y) = (x.to_vec(), y.to_vec());
        mask_block(&mut x, i * bs, jsbs, counts);
        mask_block(&mut y, i * bs, jsbs, counts);
        if x != y {
            out.push((i, (0..bs).filter(|&o| x[o] != y[o]).take(8).collect()));
            if out.len() == 8 {
                break;
            }
        }
    }
    out
}

fn same_tree(a: &Observed, b: &Observed) -> bool {
    a.canonical() == b.canonical() && a.paths.keys().all(|p| a.content(p) == b.content(p))
}

fn interrupted_recovery(workload: &str, seed: u64, bs: u32) {
    let base = base_image(bs).unwrap();
    let rec = record(find(workload).unwrap(), &base, seed).unwrap();
    let bsz = rec.bs;
    // Crash right after an fsync a third into the run: the log holds every
    // transaction so far (no checkpoint yet).
    let syncs: Vec<_> = rec.syncs.iter().filter(|s| s.what != "unmount").collect();
    let k = syncs[syncs.len() / 3].ret_idx;
    let crash = rec.log.full_image(k);
    let scratch = ScratchFile::new("interrupted");
    check_image(&rec, crash.clone(), k, &scratch)
        .unwrap_or_else(|e| panic!("the crash image itself fails: {e}"));

    // The uninterrupted recovery, recorded.
    let rdev = Arc::new(RecordingDevice::new(crash.clone()));
    let fs = Fs::open(rdev.clone(), opts()).expect("recovery");
    let reference = rdev.contents();
    let rlog = rdev
        .crash_log()
        .with_atomic(vec![commitfs_crashtest::workload::superblock_range()]);
    let ref_tree = observe(&fs, rec.max_file_size).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    let reference_final = rdev.contents();
    let replayed = rlog
        .ops()
        .iter()
        .filter(|o| {
            matches!(
                o,
                LogOp::Write {
                    cat: IoCategory::Metadata,
                    ..
                }
            )
        })
        .count();
    assert!(
        replayed > 10,
        "the recovery must replay a real log ({replayed} home writes)"
    );
    let jsbs: Vec<u64> = journal_blocks(&rlog, bsz, rlog.len())
        .into_iter()
        .filter(|b| b.is_superblock())
        .map(|b| b.offset)
        .collect();
    assert!(!jsbs.is_empty());

    let mut states = 0;
    for k2 in 0..=rlog.len() {
        // Nothing volatile survives; or a random part of it, torn.
        for n in 0..2u64 {
            let spec = CrashSpec {
                k: k2,
                seed: seed ^ (k2 as u64) << 8 ^ n,
                keep_256: if n == 0 { 0 } else { 97 },
                torn: n == 1,
            };
            let img = rlog.image(&spec);
            let dev = Arc::new(MemDevice::from_vec(img));
            let fs = Fs::open(dev.clone(), opts())
                .unwrap_or_else(|e| panic!("recovery after a crash at {k2}/{}: {e}", rlog.len()));
            let d = diff_masked(&dev.contents(), &reference, bsz, &jsbs, true);
            assert!(
                d.is_empty(),
                "crash at recovery I/O {k2}/{} ({spec:?}): image differs from the uninterrupted recovery in blocks {d:?}",
                rlog.len(),
            );
            let tree = observe(&fs, rec.max_file_size).unwrap();
            assert!(
                same_tree(&tree, &ref_tree),
                "tree differs after crash at {k2}"
            );
            fs.unmount().unwrap();
            drop(fs);
            let fin = dev.contents();
            let d = diff_masked(&fin, &reference_final, bsz, &jsbs, false);
            assert!(
                d.is_empty(),
                "crash at recovery I/O {k2}/{} ({spec:?}): image after unmount differs from the uninterrupted one in blocks {d:?}",
                rlog.len(),
            );
            if n == 1 || k2 % 4 == 0 {
                commitfs_crashtest::check::fsck_image(&fin, &scratch, "after re-recovery")
                    .unwrap_or_else(|e| panic!("crash at {k2}: {e}"));
            }
            states += 1;
        }
    }
    println!(
        "interrupted recovery {workload} bs={bs}: {} recovery I/Os, {replayed} blocks replayed, {states} crash states, all identical",
        rlog.len()
    );
}

#[test]
fn crash_during_replay_1k() {
    interrupted_recovery("mixed", 31, 1024);
}

#[test]
fn crash_during_replay_4k() {
    interrupted_recovery("namespace", 32, 4096);
}
