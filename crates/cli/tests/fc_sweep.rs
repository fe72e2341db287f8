//! Fast-commit issue, acceptance test 2 (exact counts, so a CI test): 1,024 x
//! (create, append 4 KiB, close) with an fsync every n files, n = 1, 2, 4, ..
//! 1024, on the same loop device for kernel ext4 (`mkfs.ext4 -O fast_commit`,
//! default mount options but `commit=600`) and for commitfs (library,
//! `MountOptions::default()`, i.e. fast commits on, `commit_interval = 600`):
//!
//! 1. per n, commitfs writes no more journal bytes per fsync than the kernel;
//! 2. per n, commitfs makes the loop device complete no more flushes per fsync
//!    than the kernel;
//! 3. over the sweep, at least 80% of commitfs's fast commits are one block;
//! 4. with `fc_data_csum`, at most 1.0 device flush per fsync at n = 1.
//!
//! Also: the instruments agree with each other (tracepoints, procfs, the block
//! layer, commitfs's own counters), the kernel did fast commits, and every
//! commitfs result is clean for `e2fsck -fn` and shows every file with its
//! content when remounted by commitfs and by the kernel (checked inside each run).
//!
//! What is counted and how, and the measurement window (mount to last close,
//! unmount excluded for both), is documented in `../examples/fc_sweep/sweep.rs`,
//! shared with the benchmark printout `cargo run --release --example fc_sweep`.
//! The judges are the device's own counts: flushes from `/sys/block/loopN/stat`
//! and journal bytes from the block layer's write requests into the journal
//! inode's blocks (tracepoint `block/block_rq_issue`), the same instrument for
//! both systems.
//!
//! Needs root (loop devices, mount, tracefs); fails, never skips, without it.
//! The sweep runs once (about 20 s) and every test judges its result.

#[path = "../examples/fc_sweep/sweep.rs"]
mod sweep;

use std::sync::OnceLock;

use sweep::{Config, Run, Sweep, System};

fn the_sweep() -> &'static Sweep {
    static S: OnceLock<Result<Sweep, String>> = OnceLock::new();
    let r = S.get_or_init(|| {
        let cfg = Config::default();
        let t0 = std::time::Instant::now();
        let r = std::panic::catch_unwind(|| {
            sweep::sweep(&cfg, &System::ALL, |r| {
                eprintln!(
                    "fc_sweep: n = {:>4}  {:<22} done ({:.0} ms)",
                    r.n,
                    r.label(),
                    r.wall.as_secs_f64() * 1e3
                )
            })
        })
        .unwrap_or_else(|p| {
            Err(format!(
                "the sweep panicked: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ))
        });
        if let Ok(sw) = &r {
            eprintln!(
                "fc_sweep: {} runs in {:.1} s on {}\n{}\n{}",
                sw.runs.len(),
                t0.elapsed().as_secs_f64(),
                sw.device,
                sweep::table(sw),
                sweep::detail(sw)
            );
        }
        r
    });
    match r {
        Ok(s) => s,
        Err(e) => panic!("fast-commit sweep failed: {e}"),
    }
}

fn run(sw: &Sweep, s: System, n: usize) -> &Run {
    sw.get(s, n)
        .unwrap_or_else(|| panic!("no run for {} at n = {n}", s.label()))
}

fn ns() -> Vec<usize> {
    Config::default().ns
}

/// The counters of each run agree across instruments; the kernel really did fast
/// commits (otherwise the comparison would be against plain JBD2).
#[test]
fn instruments_agree_and_kernel_does_fast_commits() {
    let sw = the_sweep();
    let mut bad = Vec::new();
    for n in ns() {
        let k = run(sw, System::Kernel, n);
        if k.fsyncs != (1024 / n) as u64 {
            bad.push(format!("n = {n}: {} fsyncs", k.fsyncs));
        }
        // Every fsync but the first one after mount (a full commit) can be fast.
        if k.fsyncs > 1 && k.fast_commits == 0 {
            bad.push(format!("n = {n}: the kernel made no fast commit: {k:?}"));
        }
        if k.fc_info_commits != Some(k.fast_commits) {
            bad.push(format!(
                "n = {n}: kernel fc_info says {:?} fast commits, the tracepoint {}",
                k.fc_info_commits, k.fast_commits
            ));
        }
        if k.jbd2_info_transactions != Some(k.full_commits) {
            bad.push(format!(
                "n = {n}: jbd2 info says {:?} transactions, jbd2_run_stats {}",
                k.jbd2_info_transactions, k.full_commits
            ));
        }
        // Every fsync is either a fast commit or a full commit (nothing else ran).
        if k.fast_commits + k.fc_fallbacks != k.fsyncs {
            bad.push(format!(
                "n = {n}: kernel {} fast commits + {} fallbacks != {} fsyncs",
                k.fast_commits, k.fc_fallbacks, k.fsyncs
            ));
        }
        // The kernel's own journal accounting lacks only journal superblock
        // writes, so it is at most what reached the journal's blocks.
        if k.journal_bytes_own > k.journal_bytes_dev {
            bad.push(format!(
                "n = {n}: kernel logged {} B but only {} B reached the journal",
                k.journal_bytes_own, k.journal_bytes_dev
            ));
        }
        for s in System::ALL {
            let r = run(sw, s, n);
            if r.flushes_traced != r.flushes_dev {
                bad.push(format!(
                    "n = {n}, {}: {} flush requests traced, {} completed",
                    s.label(),
                    r.flushes_traced,
                    r.flushes_dev
                ));
            }
            if s == System::Kernel {
                continue;
            }
            // commitfs's FileDevice: each flush and each FUA write is one fdatasync
            // of the block device, i.e. exactly one flush request.
            if r.flushes_own != r.flushes_dev {
                bad.push(format!(
                    "n = {n}, {}: issued {} flushes + FUA writes, the device completed {} flushes",
                    s.label(),
                    r.flushes_own,
                    r.flushes_dev
                ));
            }
            // Nothing but commitfs writes into the journal; the page cache may
            // merge rewrites of one block, never add bytes.
            if r.journal_bytes_dev > r.journal_bytes_own {
                bad.push(format!(
                    "n = {n}, {}: {} B reached the journal, commitfs counted {} B",
                    s.label(),
                    r.journal_bytes_dev,
                    r.journal_bytes_own
                ));
            }
            if r.fast_commits + r.full_commits < r.fsyncs {
                bad.push(format!(
                    "n = {n}, {}: {} fast + {} full commits for {} fsyncs",
                    s.label(),
                    r.fast_commits,
                    r.full_commits,
                    r.fsyncs
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Criterion 1: journal bytes per fsync, judged at the device for both systems,
/// as the issue states it. commitfs's bytes include the 512-byte write that
/// clears the first sector of the fast-commit area after a full commit that
/// follows fast commits (e2fsck 1.47 aborts the whole recovery on the stale HEAD
/// the kernel leaves there); it reaches the device as one sector (`O_DIRECT`),
/// which is checked here too. Full commits taken so that e2fsck 1.47 can replay
/// the log too (issue #9 item 7) are allowed, and must stay rare.
#[test]
fn commitfs_writes_no_more_journal_bytes_per_fsync_than_kernel() {
    let sw = the_sweep();
    let mut bad = Vec::new();
    for n in ns() {
        let k = run(sw, System::Kernel, n);
        let c = run(sw, System::Commitfs, n);
        let zeroing = c.fc_bytes_own.saturating_sub(c.fc_blocks * c.block_size);
        assert!(
            zeroing <= c.full_commits * 512,
            "n = {n}: {zeroing} B of fast-commit writes beyond the fast commits: \
             more than one 512-byte head-zeroing write per full commit"
        );
        // Full commits taken so that e2fsck 1.47 and the kernel can replay the log
        // (issue #9 item 7: a directory grown or converted to htree within a
        // fast-commit window, docs/FORMAT.md "Fast commits other tools replay") cost
        // bytes the kernel does not spend, by design. Each is allowed the average
        // size of this run's other full commits (like them, it writes the metadata
        // dirtied since the previous full commit); they must stay rare.
        let replay_commits: u64 = ["dir_grow", "unlink_last", "journal_inode_block"]
            .iter()
            .filter_map(|r| c.fc_fallback_reasons.get(*r))
            .sum();
        assert!(
            replay_commits <= 2,
            "n = {n}: {replay_commits} full commits for other replayers (at most 2 expected \
             for 1,024 creates in one directory): {:?}",
            c.fc_fallback_reasons
        );
        let full_bytes = c.journal_bytes_dev.saturating_sub(c.fc_bytes_own);
        let allowance =
            replay_commits * full_bytes / c.full_commits.saturating_sub(replay_commits).max(1);
        if c.journal_bytes_dev > k.journal_bytes_dev + allowance {
            bad.push(format!(
                "n = {n:>4}: commitfs {:.2} KiB/fsync > kernel {:.2} KiB/fsync \
                 (journal bytes {} vs {} + {allowance} for {replay_commits} replayability \
                 commits; full commits {} vs {}, fast commits {} vs {}, \
                 fast-commit blocks {} vs {}; commitfs fallbacks {:?})",
                c.journal_kib_per_fsync_dev(),
                k.journal_kib_per_fsync_dev(),
                c.journal_bytes_dev,
                k.journal_bytes_dev,
                c.full_commits,
                k.full_commits,
                c.fast_commits,
                k.fast_commits,
                c.fc_blocks,
                k.fc_blocks,
                c.fc_fallback_reasons
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "commitfs writes more journal bytes per fsync than kernel ext4:\n{}",
        bad.join("\n")
    );
}

/// Criterion 2: device flushes per fsync.
#[test]
fn commitfs_issues_no_more_flushes_per_fsync_than_kernel() {
    let sw = the_sweep();
    let mut bad = Vec::new();
    for n in ns() {
        let k = run(sw, System::Kernel, n);
        let c = run(sw, System::Commitfs, n);
        if c.flushes_dev > k.flushes_dev {
            bad.push(format!(
                "n = {n:>4}: commitfs {:.3} flushes/fsync > kernel {:.3} ({} vs {})",
                c.flushes_per_fsync(),
                k.flushes_per_fsync(),
                c.flushes_dev,
                k.flushes_dev
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "commitfs makes the device flush more per fsync than kernel ext4:\n{}",
        bad.join("\n")
    );
}

/// Criterion 3: at least 80% of commitfs's fast commits are one block.
#[test]
fn most_commitfs_fast_commits_are_single_block() {
    let sw = the_sweep();
    let (mut commits, mut single) = (0u64, 0u64);
    for n in ns() {
        let c = run(sw, System::Commitfs, n);
        commits += c.fast_commits;
        single += c.fc_single_block;
    }
    assert!(
        commits > 0,
        "commitfs made no fast commit in the whole sweep"
    );
    assert!(
        single * 10 >= commits * 8,
        "only {single} of {commits} commitfs fast commits ({:.1}%) are single-block",
        100.0 * single as f64 / commits as f64
    );
}

/// Criterion 4: with `fc_data_csum`, at most 1.0 device flush per fsync at n = 1
/// (the issue's check, over the whole run).
///
/// Every fast-commit fsync costs one flush and no FUA (data, log blocks and TAIL
/// under one flush; DATA_CSUM records let recovery detect lost data). The
/// 63-block fast-commit area fills every 63 fsyncs; the full commit that empties
/// it is a *single-flush* commit in this mode (log blocks and commit block without
/// FUA, then one flush; its commit block carries the CRC32C of the data it makes
/// reachable, and recovery verifies the last transaction completely), so it costs
/// one flush too, not a flush plus a FUA commit block.
#[test]
fn fc_data_csum_at_most_one_flush_per_fsync_at_n1() {
    let sw = the_sweep();
    let c = run(sw, System::CommitfsCsum, 1);
    let d = run(sw, System::Commitfs, 1);
    assert!(
        c.fast_commits * 10 >= c.fsyncs * 9,
        "fc_data_csum at n = 1: only {} fast commits for {} fsyncs",
        c.fast_commits,
        c.fsyncs
    );
    assert!(
        d.flushes_dev >= 2 * d.fast_commits,
        "default mode should take a flush and a FUA write per fast commit: {} flushes",
        d.flushes_dev
    );
    assert!(
        c.flushes_dev <= c.fsyncs,
        "fc_data_csum at n = 1: {} device flushes for {} fsyncs ({:.3} per fsync); \
         {} full commits, {} fast commits, fallbacks {:?}",
        c.flushes_dev,
        c.fsyncs,
        c.flushes_per_fsync(),
        c.full_commits,
        c.fast_commits,
        c.fc_fallback_reasons
    );
}
