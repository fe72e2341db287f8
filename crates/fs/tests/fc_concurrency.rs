//! Concurrent fsyncs and fast commits: "Inline commit: the fsync caller's thread
//! performs the fast commit; concurrent fsyncs that arrive during a fast commit
//! wait for it or ride on the next one instead of each issuing their own."
//!
//! A device with a slow cache flush and slow FUA writes (like a SATA SSD) makes
//! fsyncs overlap: 8 threads each create their own files, write 4 KiB and fsync,
//! 50 times. Checked: fewer fast commits than fsyncs (riding), no fallback to a
//! full commit, every fast-commit write issued by an fsync caller's thread, and
//! every fsync durable: the image a power cut leaves right after an fsync returned
//! (only flushed and FUA writes survive) recovers with that file and its data.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

mod common;

use commitfs_device::RecordingDevice;
use commitfs_fs::testutil::mkfs;
use commitfs_fs::*;
use common::{check_fsyncs_durable, FsyncDone, SlowDevice};

const THREADS: u32 = 8;
const ROUNDS: u32 = 50;
const FILE_BYTES: usize = 4096;

fn content(t: u32, i: u32) -> Vec<u8> {
    (0..FILE_BYTES)
        .map(|b| (t * 131 + i * 17 + b as u32 / 13) as u8 | 1)
        .collect()
}

fn concurrent_fsyncs(latency: Duration) {
    let img = mkfs(
        "fcconc",
        128,
        &[
            "-b",
            "4096",
            "-O",
            "fast_commit",
            "-J",
            "size=32,fast_commit_size=4096",
        ],
    );
    let dev = Arc::new(SlowDevice {
        inner: RecordingDevice::new(std::fs::read(&img.path).unwrap()),
        latency,
        fc_writers: Mutex::new(HashSet::new()),
        flushes: AtomicU64::new(0),
    });
    let fs = Fs::open(
        dev.clone(),
        MountOptions {
            commit_interval: 0, // no background commits: only the fsyncs write
            ..Default::default()
        },
    )
    .unwrap();
    // Directories are not fast-commit material: made and fully committed first.
    let dirs: Vec<Ino> = (0..THREADS)
        .map(|t| {
            fs.mkdir(ROOT_INO, format!("t{t}").as_bytes(), 0o755, 0, 0)
                .unwrap()
                .ino
        })
        .collect();
    fs.sync().unwrap();
    // Mount and setup wrote in the area too (mount clears its first sector).
    dev.fc_writers.lock().unwrap().clear();
    let fc0 = fs.fc_stats();
    let full0 = fs.stats().journal.commits;
    let flushes0 = dev.flushes.load(Ordering::Relaxed);

    let done = Mutex::new(Vec::<FsyncDone>::new());
    let workers = Mutex::new(HashSet::<ThreadId>::new());
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (fs, dev, done, workers, dir) = (&fs, &dev, &done, &workers, dirs[t as usize]);
            s.spawn(move || {
                workers.lock().unwrap().insert(std::thread::current().id());
                for i in 0..ROUNDS {
                    let a = fs
                        .create(dir, format!("f{i}").as_bytes(), 0o644, 0, 0)
                        .unwrap();
                    fs.write(a.ino, 0, &content(t, i)).unwrap();
                    fs.fsync(a.ino, false).unwrap();
                    let ops = dev.inner.op_count();
                    done.lock().unwrap().push(FsyncDone { t, i, ops });
                }
            });
        }
    });
    let elapsed = started.elapsed();
    let fsyncs = (THREADS * ROUNDS) as u64;
    let fc = fs.fc_stats();
    let commits = fc.commits - fc0.commits;
    let full = fs.stats().journal.commits - full0;
    let flushes = dev.flushes.load(Ordering::Relaxed) - flushes0;
    eprintln!(
        "latency {latency:?}: {fsyncs} fsyncs in {elapsed:.2?}: {commits} fast commits \
         ({} blocks, {} skipped), {} fsyncs rode on another's commit, {full} full commits, \
         {flushes} flushes, fallbacks {:?}",
        fc.blocks - fc0.blocks,
        fc.skipped - fc0.skipped,
        fsyncs - commits,
        fc.ineligible
    );
    assert!(commits > 0, "no fast commits at all: {fc:?}");
    assert!(
        commits < fsyncs,
        "every fsync issued its own fast commit ({commits} for {fsyncs} fsyncs)"
    );
    assert_eq!(
        fc.ineligible, fc0.ineligible,
        "no fallback to a full commit"
    );
    assert_eq!(full, 0, "no full commit while the threads ran");
    let writers = dev.fc_writers.lock().unwrap().clone();
    let workers = workers.into_inner().unwrap();
    assert!(
        !writers.is_empty() && writers.is_subset(&workers),
        "fast commits are written by the fsync callers' threads ({} writer threads, \
         {} of them callers)",
        writers.len(),
        writers.intersection(&workers).count()
    );

    // Durability, without a clean unmount: power cuts right after fsyncs returned.
    let done = done.into_inner().unwrap();
    check_fsyncs_durable(&dev.inner, done, content, 12, &img.path, "fast commits");
    fs.unmount().unwrap();
}

/// SATA-SSD-like: 2 ms per flush and per FUA write.
#[test]
fn concurrent_fsyncs_ride_on_fast_commits() {
    concurrent_fsyncs(Duration::from_millis(2));
}
