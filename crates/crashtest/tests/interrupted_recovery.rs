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
        ..Default::default()
    }
}

/// Zero the fields a second mount legitimately changes: the ext4 superblock's
/// mount count, mount/write times, lifetime writes and checksum; the journal
/// superblock's sequence (one more mount opens one more log) and checksum.
fn masked(img: &[u8], jsb_offsets: &[u64]) -> Vec<u8> {
    let mut m = img.to_vec();
    let sb = sbf::SUPERBLOCK_OFFSET as usize;
    for (off, len) in [
        (sbf::S_MTIME, 4),
        (sbf::S_WTIME, 4),
        (sbf::S_MNT_COUNT, 2),
        (sbf::S_KBYTES_WRITTEN, 8),
        (sbf::S_WTIME_HI, 1),
        (sbf::S_MTIME_HI, 1),
        (sbf::S_CHECKSUM, 4),
    ] {
        m[sb + off..sb + off + len].fill(0);
    }
    for &j in jsb_offsets {
        let j = j as usize;
        m[j + jbd2::S_SEQUENCE..j + jbd2::S_SEQUENCE + 4].fill(0);
        m[j + jbd2::S_CHECKSUM..j + jbd2::S_CHECKSUM + 4].fill(0);
    }
    m
}

fn first_diff_blocks(a: &[u8], b: &[u8], bs: usize) -> Vec<usize> {
    a.chunks(bs)
        .zip(b.chunks(bs))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i)
        .take(8)
        .collect()
}

fn same_tree(a: &Observed, b: &Observed) -> bool {
    a.canonical() == b.canonical()
        && a.paths
            .keys()
            .all(|p| a.content(p) == b.content(p))
}

fn interrupted_recovery(workload: &str, seed: u64, bs: u32) {
    let base = base_image(bs).unwrap();
    let rec = record(find(workload).unwrap(), &base, seed).unwrap();
    let bsz = rec.bs;
    // Crash just before the final unmount: the log holds the last transactions.
    let k = rec.unmount_start;
    let crash = rec.log.full_image(k);
    let scratch = ScratchFile::new("interrupted");
    let (lo, hi) = rec.window(k);
    check_image(&rec, crash.clone(), lo, hi, hi, &scratch)
        .unwrap_or_else(|e| panic!("the crash image itself fails: {e}"));

    // The uninterrupted recovery, recorded.
    let rdev = Arc::new(RecordingDevice::new(crash.clone()));
    let fs = Fs::open(rdev.clone(), opts()).expect("recovery");
    let reference = rdev.contents();
    let rlog = rdev.crash_log();
    let ref_tree = observe(&fs, rec.max_file_size).unwrap();
    drop(fs);
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
    let want = masked(&reference, &jsbs);

    let mut states = 0;
    for k2 in 0..=rlog.len() {
        for (n, keep_256) in [0u8, 255, 97].into_iter().enumerate() {
            let spec = CrashSpec {
                k: k2,
                seed: seed ^ (k2 as u64) << 8 ^ n as u64,
                keep_256,
                torn: n == 2,
            };
            let img = rlog.image(&spec);
            let dev = Arc::new(MemDevice::from_vec(img));
            let fs = Fs::open(dev.clone(), opts())
                .unwrap_or_else(|e| panic!("recovery after a crash at {k2}/{}: {e}", rlog.len()));
            let got = dev.contents();
            let gm = masked(&got, &jsbs);
            assert!(
                gm == want,
                "crash at recovery I/O {k2}/{} ({spec:?}): image differs from the uninterrupted recovery in blocks {:?}",
                rlog.len(),
                first_diff_blocks(&gm, &want, bsz)
            );
            let tree = observe(&fs, rec.max_file_size).unwrap();
            assert!(same_tree(&tree, &ref_tree), "tree differs after crash at {k2}");
            fs.unmount().unwrap();
            drop(fs);
            if n == 2 || k2 % 4 == 0 {
                commitfs_crashtest::check::fsck_image(&dev.contents(), &scratch, "after re-recovery")
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
