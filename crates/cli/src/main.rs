//! The `commitfs` command: mount, info, mkfs, demo.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use commitfs::cmd::{demo, info, mkfs, mount, size, stats};

use commitfs_bench as bench;
mod crashtest_cmd;

#[derive(Parser)]
#[command(
    name = "commitfs",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("COMMITFS_COMMIT"), ")"),
    about = "A user-space file system for real ext4 images"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Mount an ext4 image with FUSE (returns once the mount is usable).
    Mount {
        /// Image file or block device.
        image: PathBuf,
        /// Mount point.
        dir: PathBuf,
        /// Mount options: ro, rw, commit=N, writeback_cache, allow_other,
        /// fast_commit, nofast_commit, fc_data_csum (comma-separated; may be repeated).
        #[arg(short = 'o', value_name = "OPTS")]
        options: Vec<String>,
        /// Stay in the foreground instead of daemonizing.
        #[arg(long, short = 'f')]
        foreground: bool,
        /// Write the serving process's pid here once mounted.
        #[arg(long, value_name = "FILE")]
        pid_file: Option<PathBuf>,
        /// Append the daemon's log here (level from COMMITFS_LOG or RUST_LOG).
        #[arg(long, value_name = "FILE")]
        log_file: Option<PathBuf>,
    },
    /// Show features, space, state and the journal of an image (no mount needed).
    Info {
        image: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Create (or resize) an image file and format it with mkfs.ext4.
    Mkfs {
        image: PathBuf,
        /// Image size, e.g. 64M, 1G (required unless IMAGE is a block device).
        #[arg(long)]
        size: Option<String>,
        /// Reserve a fast-commit area in the journal.
        #[arg(long)]
        fast_commit: bool,
        /// File-system block size: 1024, 2048 or 4096.
        #[arg(long, value_name = "N")]
        block_size: Option<u32>,
        /// Volume label.
        #[arg(long, short = 'L')]
        label: Option<String>,
        /// Overwrite an existing file system (and shrink a larger image file).
        #[arg(long, short = 'f')]
        force: bool,
    },
    /// Live counters of a mounted file system (I/O by category, journal, fast commit).
    Stats {
        /// Mount point.
        dir: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Crash-state harness: record a workload, check every crash state's recovery.
    Crashtest(crashtest_cmd::CrashtestArgs),
    /// Benchmark commitfs beside kernel ext4, XFS and fuse2fs on one device.
    Bench(bench::BenchArgs),
    /// Make an image, mount it, run a workload, verify, unmount, e2fsck, report.
    Demo {
        /// Work in this directory instead of a temporary one.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Keep the image afterwards.
        #[arg(long)]
        keep: bool,
    },
}

fn init_cli_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("COMMITFS_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Mount {
            image,
            dir,
            options,
            foreground,
            pid_file,
            log_file,
        } => {
            // Logging is set up by the serving process itself (after the fork).
            let options = mount::parse_options(&options)?;
            mount::run(&mount::MountRequest {
                image,
                dir,
                options,
                foreground,
                pid_file,
                log_file,
            })
        }
        Cmd::Info { image, json } => {
            init_cli_logging();
            info::run(&image, json)
        }
        Cmd::Mkfs {
            image,
            size,
            fast_commit,
            block_size,
            label,
            force,
        } => {
            init_cli_logging();
            let size = size.as_deref().map(size::parse_size).transpose()?;
            mkfs::run(
                &image,
                &mkfs::MkfsOptions {
                    size,
                    fast_commit,
                    block_size,
                    label,
                    force,
                },
            )
        }
        Cmd::Stats { dir, json } => {
            init_cli_logging();
            stats::run(&dir, json)
        }
        Cmd::Crashtest(a) => {
            init_cli_logging();
            crashtest_cmd::run(a)
        }
        Cmd::Bench(a) => bench::run(a),
        Cmd::Demo { dir, keep } => {
            init_cli_logging();
            demo::run(dir.as_deref(), keep)
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("commitfs: {e:#}");
            ExitCode::FAILURE
        }
    }
}
