//! `commitfs crashtest`: record a workload, build crash states of its device I/O,
//! recover each with commitfs and check it against the model (crates/crashtest).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use commitfs_crashtest::concurrent::find_conc;
use commitfs_crashtest::{run_conc, ConcConfig, Config, CONC_WORKLOADS, WORKLOADS};

#[derive(Args, Debug)]
pub struct CrashtestArgs {
    /// Workload name, or `list` to print the names.
    #[arg(long)]
    pub workload: String,
    /// Number of crash states to build and check.
    #[arg(long, default_value_t = 200)]
    pub states: usize,
    /// Seed of the workload and of the crash states.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also tear unflushed writes into 512-byte sectors.
    #[arg(long)]
    pub torn: bool,
    /// With --torn, let the 1 KiB primary superblock tear too (its checksum is in
    /// its last sector: ext4 cannot survive that without e2fsck).
    #[arg(long)]
    pub torn_superblock: bool,
    /// Make the test image with the fast_commit feature (fsync writes fast
    /// commits where it can; recovery replays them).
    #[arg(long)]
    pub fast_commit: bool,
    /// Record the workload mounted with -o fc_data_csum (fast commits carry
    /// checksums of their data ranges; implies --fast-commit). Recovery mounts
    /// with the defaults.
    #[arg(long)]
    pub fc_data_csum: bool,
    /// Record the workload mounted with -o data_order=file (ext4's per-file
    /// data ordering); the checker holds each file's size and data to its own
    /// fsyncs (concurrent workloads: an append waits for its own fsync).
    #[arg(long)]
    pub data_order_file: bool,
    /// Save each failing crash image (before recovery) and a description here.
    #[arg(long, value_name = "DIR")]
    pub save_failures: Option<PathBuf>,
    /// File-system block size of the test image: 1024 (16 MiB) or 4096 (32 MiB).
    #[arg(long, default_value_t = 1024)]
    pub block_size: u32,
    /// Checking threads (0 = one per CPU).
    #[arg(long, default_value_t = 0)]
    pub jobs: usize,
}

pub fn run(a: CrashtestArgs) -> Result<()> {
    if a.workload == "list" {
        for w in WORKLOADS {
            println!("{:<10} {} thread(s), {}", w.name, w.threads, w.about);
        }
        for w in CONC_WORKLOADS {
            println!(
                "{:<18} {} threads, {:?}, no workload lock: per-thread prefix checker, commits in flight counted",
                w.name, w.threads, w.shape
            );
        }
        return Ok(());
    }
    if a.block_size != 1024 && a.block_size != 4096 {
        bail!("--block-size must be 1024 or 4096");
    }
    if find_conc(&a.workload).is_some() {
        return run_concurrent(a);
    }
    let cfg = Config {
        workload: a.workload,
        states: a.states,
        seed: a.seed,
        torn: a.torn,
        save_failures: a.save_failures,
        block_size: a.block_size,
        workers: a.jobs,
        torn_superblock: a.torn_superblock,
        fast_commit: a.fast_commit || a.fc_data_csum,
        fc_data_csum: a.fc_data_csum,
        data_order_file: a.data_order_file,
    };
    let summary = commitfs_crashtest::run(&cfg).map_err(anyhow::Error::msg)?;
    for f in summary.failures.iter().take(10) {
        eprintln!(
            "FAIL k={} seed={:#x} keep={}/256 torn={} window={:?}: {}{}",
            f.spec.k,
            f.spec.seed,
            f.spec.keep_256,
            f.spec.torn,
            f.window,
            f.message,
            f.saved
                .as_ref()
                .map(|p| format!(" [saved {}]", p.display()))
                .unwrap_or_default()
        );
    }
    println!("{summary}");
    if !summary.failures.is_empty() {
        bail!(
            "{} of {} crash states failed",
            summary.failures.len(),
            summary.states
        );
    }
    Ok(())
}

/// A concurrent workload (crates/crashtest/src/concurrent.rs): 8 or 16 threads,
/// checked per thread; prints how many commits were in flight at once.
fn run_concurrent(a: CrashtestArgs) -> Result<()> {
    let cfg = ConcConfig {
        workload: a.workload,
        states: a.states,
        seed: a.seed,
        torn: a.torn,
        block_size: a.block_size,
        workers: a.jobs,
        fast_commit: a.fast_commit || a.fc_data_csum,
        fc_data_csum: a.fc_data_csum,
        data_order_file: a.data_order_file,
        save_failures: a.save_failures,
        ..ConcConfig::default()
    };
    let summary = run_conc(&cfg).map_err(anyhow::Error::msg)?;
    for line in summary.failure_report(10).lines() {
        eprintln!("FAIL {line}");
    }
    println!("{summary}");
    if !summary.failures.is_empty() {
        bail!(
            "{} of {} crash states failed",
            summary.failures.len(),
            summary.states
        );
    }
    Ok(())
}
