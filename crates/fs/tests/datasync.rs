//! fdatasync's own rule (issue #10 part 3, docs/ARCHITECTURE.md C.5; ext4's
//! `i_datasync_tid`): after an in-place overwrite, whose only metadata change is
//! the timestamps, fdatasync commits nothing and costs exactly one device flush;
//! a size or mapping change still commits; fsync still commits the timestamps.
//! Checked by counts (journal commits, fast commits, device flushes) and by a
//! power cut right after the fdatasync returned: the recovered file holds the
//! new data. In every journal mode.

use std::sync::Arc;

use commitfs_device::{CrashSpec, MemDevice, RecordingDevice};
use commitfs_fs::testutil::{fsck, mkfs, problem_lines};
use commitfs_fs::*;

const BS: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Jbd2,
    FastCommit,
    FcDataCsum,
}

fn block(seed: u8) -> Vec<u8> {
    (0..BS)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed | 1)
        .collect()
}

/// (journal commits, fast commits, device flushes, data-only fdatasyncs).
fn counts(fs: &Fs) -> (u64, u64, u64, u64) {
    let s = fs.stats();
    (
        s.journal.commits,
        fs.fc_stats().commits,
        s.device.flushes,
        s.fdatasyncs_data_only,
    )
}

/// Between two [`counts`]: a fdatasync or fsync that had to commit did (a
/// full or fast commit), and was not counted as data-only.
fn assert_committed(before: (u64, u64, u64, u64), after: (u64, u64, u64, u64), what: &str) {
    assert_eq!(after.3, before.3, "{what}: counted as data-only");
    assert!(
        after.0 + after.1 > before.0 + before.1,
        "{what}: committed nothing: {before:?} -> {after:?}"
    );
}

/// The file `/f` in the image a power cut leaves at device request `k`.
fn recovered(dev: &RecordingDevice, k: usize) -> Vec<u8> {
    let img = dev.crash_log().image(&CrashSpec {
        k,
        seed: 0,
        keep_256: 0,
        torn: false,
    });
    let mem = Arc::new(MemDevice::from_vec(img));
    let fs = Fs::open(mem, MountOptions::default()).expect("recovery");
    let ino = fs.resolve("/f").expect("/f after recovery");
    let size = fs.getattr(ino).unwrap().size as usize;
    let mut buf = vec![0u8; size];
    assert_eq!(fs.read(ino, 0, &mut buf).unwrap(), size);
    fs.unmount().unwrap();
    buf
}

fn run(mode: Mode) {
    let mut args = vec!["-b", "4096"];
    if mode != Mode::Jbd2 {
        args.extend(["-O", "fast_commit"]);
    }
    let img = mkfs("datasync", 64, &args);
    let dev = Arc::new(RecordingDevice::new(std::fs::read(&img.path).unwrap()));
    let fs = Fs::open(
        dev.clone(),
        MountOptions {
            commit_interval: 0,
            fast_commit: mode != Mode::Jbd2,
            fc_data_csum: mode == Mode::FcDataCsum,
            ..Default::default()
        },
    )
    .unwrap();
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    let mut want: Vec<u8> = [block(1), block(2), block(3)].concat();
    fs.write(f, 0, &want).unwrap();
    // A new file's fdatasync commits: its creation and size are its metadata.
    let c0 = counts(&fs);
    fs.fsync(f, true).unwrap();
    let c1 = counts(&fs);
    assert_committed(c0, c1, &format!("{mode:?}: fdatasync of a new file"));

    // In-place overwrite: one flush, no commit of any kind.
    want[BS..2 * BS].copy_from_slice(&block(4));
    fs.write(f, BS as u64, &block(4)).unwrap();
    fs.fsync(f, true).unwrap();
    let c2 = counts(&fs);
    assert_eq!(
        c2.3,
        c1.3 + 1,
        "{mode:?}: overwrite's fdatasync was not data-only"
    );
    assert_eq!(
        (c2.0, c2.1),
        (c1.0, c1.1),
        "{mode:?}: overwrite's fdatasync committed"
    );
    assert_eq!(
        c2.2,
        c1.2 + 1,
        "{mode:?}: overwrite's fdatasync: flushes {c1:?} -> {c2:?}"
    );
    assert_eq!(
        recovered(&dev, dev.op_count()),
        want,
        "{mode:?}: data after a power cut"
    );

    // Nothing written since: nothing to do.
    fs.fsync(f, true).unwrap();
    let c3 = counts(&fs);
    assert_eq!(c3.3, c2.3 + 1);
    assert_eq!(
        (c3.0, c3.1, c3.2),
        (c2.0, c2.1, c2.2),
        "{mode:?}: idle fdatasync did I/O"
    );

    // An append changes the size: fdatasync commits it.
    want.extend_from_slice(&block(5));
    fs.write(f, 3 * BS as u64, &block(5)).unwrap();
    fs.fsync(f, true).unwrap();
    let c4 = counts(&fs);
    assert_committed(c3, c4, &format!("{mode:?}: append's fdatasync"));
    assert_eq!(
        recovered(&dev, dev.op_count()),
        want,
        "{mode:?}: appended data after a power cut"
    );

    // fsync (not fdatasync) after an overwrite commits the new timestamps.
    want[..BS].copy_from_slice(&block(6));
    fs.write(f, 0, &block(6)).unwrap();
    fs.fsync(f, false).unwrap();
    let c5 = counts(&fs);
    assert_committed(c4, c5, &format!("{mode:?}: fsync after an overwrite"));
    assert_eq!(recovered(&dev, dev.op_count()), want);

    fs.unmount().unwrap();
    drop(fs);
    let end = dev.crash_log().full_image(dev.op_count());
    std::fs::write(&img.path, end).unwrap();
    let r = fsck(&img.path);
    assert!(
        r.is_clean(),
        "{mode:?}: e2fsck -fn: {:?}\n{}",
        problem_lines(&r.output),
        r.output
    );
}

#[test]
fn fdatasync_after_overwrite_jbd2() {
    run(Mode::Jbd2);
}

#[test]
fn fdatasync_after_overwrite_fast_commit() {
    run(Mode::FastCommit);
}

#[test]
fn fdatasync_after_overwrite_fc_data_csum() {
    run(Mode::FcDataCsum);
}
