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

use commitfs_device::{CrashSpec, MemDevice, RecordingDevice};
use commitfs_fs::testutil::{fsck, mkfs, problem_lines};
use commitfs_fs::*;
use common::SlowDevice;

const THREADS: u32 = 8;
const ROUNDS: u32 = 50;
const FILE_BYTES: usize = 4096;

fn content(t: u32, i: u32) -> Vec<u8> {
    (0..FILE_BYTES)
        .map(|b| (t * 131 + i * 17 + b as u32 / 13) as u8 | 1)
        .collect()
}

/// One completed fsync: which file, and the device log length when it returned.
struct Done {
    t: u32,
    i: u32,
    ops: usize,
}

/// Mount the image a power cut leaves after the first `k` device requests, keeping
/// only what was durable; check that every file of `must` is there with its data.
/// Returns the recovered image (cleanly unmounted).
fn check_durable(dev: &SlowDevice, k: usize, must: &[(u32, u32)], what: &str) -> Vec<u8> {
    let log = dev.inner.crash_log();
    let img = log.image(&CrashSpec {
        k,
        seed: 0,
        keep_256: 0,
        torn: false,
    });
    let mem = Arc::new(MemDevice::from_vec(img));
    let fs = Fs::open(mem.clone(), MountOptions::default())
        .unwrap_or_else(|e| panic!("{what}: recovery failed: {e}"));
    for &(t, i) in must {
        let path = format!("/t{t}/f{i}");
        let ino = fs
            .resolve(&path)
            .unwrap_or_else(|e| panic!("{what}: {path} was fsynced but is missing: {e}"));
        let a = fs.getattr(ino).unwrap();
        assert_eq!(a.size, FILE_BYTES as u64, "{what}: size of {path}");
        let mut buf = vec![0u8; FILE_BYTES];
        fs.read(ino, 0, &mut buf).unwrap();
        assert!(buf == content(t, i), "{what}: data of {path}");
    }
    fs.unmount().unwrap();
    drop(fs);
    Arc::try_unwrap(mem)
        .ok()
        .expect("the file system let go of the device")
        .into_vec()
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

    let done = Mutex::new(Vec::<Done>::new());
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
                    done.lock().unwrap().push(Done { t, i, ops });
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
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|d| d.ops);
    let samples: Vec<usize> = {
        let n = done.len();
        let mut v: Vec<usize> = (1..=12).map(|j| j * n / 12 - 1).collect();
        v.insert(0, 0);
        v.dedup();
        v
    };
    for &j in &samples {
        let k = done[j].ops;
        let must: Vec<(u32, u32)> = done
            .iter()
            .filter(|d| d.ops <= k)
            .map(|d| (d.t, d.i))
            .collect();
        check_durable(
            &dev,
            k,
            &must,
            &format!("after fsync {} of {}", j + 1, done.len()),
        );
    }
    // The end: every file, and the recovered image is clean.
    let all: Vec<(u32, u32)> = done.iter().map(|d| (d.t, d.i)).collect();
    let end = check_durable(&dev, dev.inner.op_count(), &all, "at the end");
    let scratch = img.path.with_extension("recovered.img");
    std::fs::write(&scratch, &end).unwrap();
    let r = fsck(&scratch);
    let _ = std::fs::remove_file(&scratch);
    assert!(
        r.is_clean(),
        "e2fsck -fn after recovery: {:?}\n{}",
        problem_lines(&r.output),
        r.output
    );
    fs.unmount().unwrap();
}

/// SATA-SSD-like: 2 ms per flush and per FUA write.
#[test]
fn concurrent_fsyncs_ride_on_fast_commits() {
    concurrent_fsyncs(Duration::from_millis(2));
}
