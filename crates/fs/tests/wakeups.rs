//! The journal's threads sleep while nobody needs them: the end of a handle
//! wakes the commit thread only when a locked transaction waits for it (jbd2's
//! `j_wait_updates`). Waking every thread on the journal's condition variable
//! at each handle's end cost a single-threaded `cp -a` through the mount two
//! or three context switches per operation (docs/ARCHITECTURE.md). Its own
//! test binary: the journal threads are found by name in this process.

use commitfs_fs::testutil::{assert_fsck_clean, mkfs};
use commitfs_fs::*;

/// Voluntary context switches of this process's threads named `name` (as the
/// kernel keeps it: at most 15 bytes).
fn switches(name: &str) -> u64 {
    let mut n = 0;
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() != &name[..name.len().min(15)] {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        n += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    n
}

#[test]
fn metadata_operations_do_not_wake_the_journal_threads() {
    let img = mkfs("wakeups", 64, &["-b", "4096"]);
    let fs = Fs::open_path(
        &img.path,
        MountOptions {
            commit_interval: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap().ino;
    let names = ["commitfs-jcommit", "commitfs-jflush"];
    // Found once each has slept at least once: a thread just spawned on a
    // busy machine (CI runs test binaries in parallel on 2 cores) may not
    // have run yet.
    let found = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !names.iter().all(|n| switches(n) > 0) && std::time::Instant::now() < found {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        names.iter().all(|n| switches(n) > 0),
        "journal threads not found"
    );
    let before: u64 = names.iter().map(|n| switches(n)).sum();
    let t0 = std::time::Instant::now();
    const OPS: u64 = 1000;
    for i in 0..OPS {
        let name = format!("f{i}");
        let f = fs.create(d, name.as_bytes(), 0o644, 0, 0).unwrap().ino;
        fs.setattr(
            f,
            &SetAttr {
                mode: Some(0o600),
                ..Default::default()
            },
        )
        .unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let woke: u64 = names.iter().map(|n| switches(n)).sum::<u64>() - before;
    // Their own timeouts (50 ms slices) wake them about 40 times a second
    // together; 2,000 operations (about 10 ms) used to wake them 172 times.
    let allowed = 20 + (secs * 60.0) as u64;
    assert!(
        woke <= allowed,
        "journal threads woke {woke} times for {} operations in {secs:.2} s (at most {allowed})",
        2 * OPS
    );
    fs.unmount().unwrap();
    assert_fsck_clean(&img.path);
}
