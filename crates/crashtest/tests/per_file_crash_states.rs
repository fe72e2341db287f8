//! Crash states under `-o data_order=file` (ext4's per-file data ordering;
//! docs/ARCHITECTURE.md "Per-file data ordering"): 4,200 states over five
//! workloads (two with 4 threads), JBD2 and fast commits, 1 KiB and 4 KiB
//! blocks, torn writes included. The checker's rule: the tree is a snapshot in
//! the crash window as always (namespace, permissions, links, xattrs); each
//! regular file's size is that of one of its own versions since its last
//! fsync (or sync), and every byte comes from that version or a later one: no
//! stale or foreign data. A last test shows the mode is really in effect:
//! the same crash states fail the prefix rule.

use commitfs_crashtest::{
    base_image_with, check_states, plan_states, record_options, record_with, run, Config,
};
use commitfs_fs::{DataOrder, MountOptions};

fn suite(workload: &str, states: usize, seed: u64, block_size: u32, fast_commit: bool) {
    let cfg = Config {
        workload: workload.into(),
        states,
        seed,
        torn: true,
        save_failures: std::env::var_os("CRASHTEST_SAVE_FAILURES").map(Into::into),
        block_size,
        fast_commit,
        data_order_file: true,
        ..Config::default()
    };
    let s = run(&cfg).unwrap_or_else(|e| panic!("{workload} seed {seed}: {e}"));
    println!("[data_order=file] {s}");
    assert!(
        s.failures.is_empty(),
        "{s}\nfirst failures (CRASHTEST_SAVE_FAILURES=DIR saves the images):\n{}",
        s.failure_report(5)
    );
    assert_eq!(s.passed, states);
    assert!(s.distinct_snapshots > 5, "{s}");
    assert!(s.torn_states > 0, "{s}");
    if fast_commit {
        assert!(
            s.fast_commits > 0,
            "the recording wrote no fast commit: {s}"
        );
    }
}

#[test]
fn per_file_jbd2_1k() {
    for (w, seed) in [
        ("data", 11),
        ("mixed", 12),
        ("churn", 13),
        ("mt4", 14),
        ("mtsync", 15),
    ] {
        suite(w, 400, seed, 1024, false);
    }
}

#[test]
fn per_file_fc_1k() {
    for (w, seed) in [
        ("data", 21),
        ("mixed", 22),
        ("churn", 23),
        ("mt4", 24),
        ("mtsync", 25),
    ] {
        suite(w, 400, seed, 1024, true);
    }
}

#[test]
fn per_file_4k() {
    suite("data", 100, 31, 4096, false);
    suite("data", 100, 32, 4096, true);
}

/// The per-file rule is needed: a `data` recording under `data_order=file`
/// has crash states whose files are older than the tree (the prefix rule
/// rejects them), and none that the per-file rule rejects. Guards against a
/// mode that silently still cuts at every commit (the suites above would then
/// pass without testing anything new).
#[test]
fn data_order_file_really_leaves_files_behind_the_tree() {
    let base = base_image_with(1024, true).unwrap();
    let spec = commitfs_crashtest::find("data").unwrap();
    let opts = MountOptions {
        data_order: DataOrder::File,
        ..record_options()
    };
    let mut rec = record_with(spec, &base, 41, opts).unwrap();
    assert!(rec.per_file);
    let states = plan_states(&rec.log, 300, 41, false);
    let per_file_failures = check_states(&rec, &states, 0, None)
        .iter()
        .filter(|r| r.is_err())
        .count();
    assert_eq!(per_file_failures, 0);
    rec.per_file = false;
    let prefix_failures = check_states(&rec, &states, 0, None)
        .iter()
        .filter(|r| r.is_err())
        .count();
    assert!(
        prefix_failures > 0,
        "no crash state of a data_order=file recording breaks the prefix rule"
    );
}
