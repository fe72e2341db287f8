//! The crash-state suite with fast commits (fast-commit issue, acceptance 1):
//! images made with `-O fast_commit`, workloads recorded with fast commits on
//! (the default), 5,050 crash states in the default mode and 5,050 with
//! `fc_data_csum`, over every workload, 1 KiB and 4 KiB blocks, torn writes
//! included. Every state must recover (JBD2 replay, then fast-commit replay) to a
//! legal tree with legal data, be e2fsck clean and keep working; the suites also
//! check that recovery really replayed fast commits in a good share of the states.
//!
//! Runtime on 2 cores: about a minute per mode (`cargo test --release`).

use commitfs_crashtest::{run, Config, Summary};

/// Run one recording's crash states; `min_fc_replays`: states whose recovery
/// must have replayed at least one fast commit.
fn suite(
    workload: &str,
    states: usize,
    seed: u64,
    block_size: u32,
    fc_data_csum: bool,
    min_fc_replays: usize,
) -> Summary {
    let cfg = Config {
        workload: workload.into(),
        states,
        seed,
        torn: true,
        save_failures: std::env::var_os("CRASHTEST_SAVE_FAILURES").map(Into::into),
        block_size,
        workers: 0,
        torn_superblock: false,
        fast_commit: true,
        fc_data_csum,
        data_order_file: false,
    };
    // Several threads: whether an fsync writes a fast commit or finds itself
    // covered by another thread's full commit (group commit) depends on timing.
    // A recording with no fast commit, or with fewer crash states that replay
    // one than wanted (a loaded CI machine turns fast commits into full
    // commits: mtsync_1k once had 14 fast and 71 full commits, 32 replaying
    // states of 35), is still checked in full, then the next seed is recorded
    // (at most 3), so that fast commits are exercised.
    let mut cfg = cfg;
    let s = loop {
        let s = run(&cfg).unwrap_or_else(|e| panic!("{workload} seed {}: {e}", cfg.seed));
        println!("{}{s}", if fc_data_csum { "[fc_data_csum] " } else { "" });
        assert!(
            s.failures.is_empty(),
            "fc_data_csum={fc_data_csum}: {s}\nfirst failures (CRASHTEST_SAVE_FAILURES=DIR saves the images):\n{}",
            s.failure_report(5)
        );
        if (s.fast_commits > 0 && s.fc_replay_states >= min_fc_replays) || cfg.seed >= seed + 2000 {
            break s;
        }
        cfg.seed += 1000;
    };
    assert_eq!(s.passed, states);
    assert!(s.distinct_snapshots > 5, "{s}");
    assert!(s.torn_states > 0, "{s}");
    assert!(
        s.fast_commits > 0,
        "the recording wrote no fast commit: {s}"
    );
    assert!(
        s.fc_replay_states >= min_fc_replays,
        "only {} states replayed fast commits (want {min_fc_replays}): {s}",
        s.fc_replay_states
    );
    // The kernel must accept every default-mode area too (a HEAD of the
    // expected tid without a valid TAIL fails its recovery): the first fast
    // commit after a full commit writes its block 0 last.
    assert_eq!(
        s.fc_kernel_error_states, 0,
        "fc_data_csum={fc_data_csum}: states whose area the kernel would refuse: {s}"
    );
    s
}

// ---- default mode: 3,700 states on 1 KiB blocks, 1,350 on 4 KiB -----------------

#[test]
fn fc_data_1k() {
    suite("data", 700, 201, 1024, false, 280);
}

#[test]
fn fc_churn_1k() {
    suite("churn", 800, 202, 1024, false, 200);
}

#[test]
fn fc_mtsync_1k() {
    // Fsyncs racing other threads' changes: timing-dependent, two recordings.
    for seed in [203, 204] {
        suite("mtsync", 350, seed, 1024, false, 35);
    }
}

#[test]
fn fc_mixed_1k() {
    suite("mixed", 500, 245, 1024, false, 1);
}

#[test]
fn fc_mt4_1k() {
    suite("mt4", 400, 206, 1024, false, 1);
}

#[test]
fn fc_namespace_1k() {
    suite("namespace", 300, 207, 1024, false, 1);
}

#[test]
fn fc_xattr_1k() {
    // Seed 208 no longer writes any fast commit: its few eligible windows unlinked
    // a file with xattrs, now a full commit for e2fsck's sake (`unlink_last`).
    suite("xattr", 300, 4208, 1024, false, 1);
}

#[test]
fn fc_data_4k() {
    suite("data", 400, 209, 4096, false, 160);
}

#[test]
fn fc_churn_4k() {
    suite("churn", 400, 210, 4096, false, 100);
}

#[test]
fn fc_mtsync_4k() {
    suite("mtsync", 350, 211, 4096, false, 35);
}

#[test]
fn fc_mixed_4k() {
    suite("mixed", 200, 212, 4096, false, 1);
}

// ---- fc_data_csum: the same shape, other seeds ------------------------------------

#[test]
fn fc_data_csum_data_1k() {
    suite("data", 700, 301, 1024, true, 280);
}

#[test]
fn fc_data_csum_churn_1k() {
    suite("churn", 800, 302, 1024, true, 200);
}

#[test]
fn fc_data_csum_mtsync_1k() {
    for seed in [303, 304] {
        suite("mtsync", 350, seed, 1024, true, 35);
    }
}

#[test]
fn fc_data_csum_mixed_1k() {
    suite("mixed", 500, 305, 1024, true, 1);
}

#[test]
fn fc_data_csum_mt4_1k() {
    suite("mt4", 400, 306, 1024, true, 1);
}

#[test]
fn fc_data_csum_namespace_1k() {
    suite("namespace", 300, 307, 1024, true, 1);
}

#[test]
fn fc_data_csum_xattr_1k() {
    suite("xattr", 300, 308, 1024, true, 1);
}

#[test]
fn fc_data_csum_data_4k() {
    suite("data", 400, 309, 4096, true, 160);
}

#[test]
fn fc_data_csum_churn_4k() {
    suite("churn", 400, 310, 4096, true, 100);
}

#[test]
fn fc_data_csum_mtsync_4k() {
    suite("mtsync", 350, 311, 4096, true, 35);
}

#[test]
fn fc_data_csum_mixed_4k() {
    suite("mixed", 200, 312, 4096, true, 1);
}
