//! The `commitfs` command: mount, umount, info, mkfs, stats, demo, bench.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};
use commitfs::cmd::{demo, helper, info, mkfs, mount, size, stats, umount};

use commitfs_bench as bench;
mod crashtest_cmd;

/// Memory freed by the page cache's evictions goes back to the system
/// (docs/ARCHITECTURE.md "Memory").
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        /// Mount options: ro, rw, commit=N, fast_commit, nofast_commit,
        /// fc_data_csum, errors=continue|remount-ro|panic, acl, noacl, relatime,
        /// strictatime, noatime, nodiratime, lazytime, dev, nodev, suid, nosuid,
        /// writeback_cache, noreaddirplus, allow_other, keep_privileges, sandbox_user=USER, and those
        /// of ext4 fstab lines (comma-separated; may be repeated; README lists them).
        #[arg(short = 'o', value_name = "OPTS")]
        options: Vec<String>,
        /// Stay in the foreground instead of daemonizing.
        #[arg(long, short = 'f')]
        foreground: bool,
        /// Write the serving process's pid here once mounted.
        #[arg(long, value_name = "FILE")]
        pid_file: Option<PathBuf>,
        /// Append the daemon's log here instead of the journal/syslog (level from
        /// COMMITFS_LOG or RUST_LOG).
        #[arg(long, value_name = "FILE")]
        log_file: Option<PathBuf>,
        /// Internal: this process is the daemon a `commitfs mount` started.
        #[arg(long, hide = true)]
        daemon_child: bool,
    },
    /// Unmount and wait until the image is written home (plain `umount` does not
    /// wait); also cleans up a mount whose daemon died.
    Umount {
        /// Mount point.
        dir: PathBuf,
        /// Give up waiting for the daemon after this many seconds.
        #[arg(long, default_value_t = 300, value_name = "SECS")]
        timeout: u64,
        /// Detach now even if files are open; wait until they are closed.
        #[arg(long, short = 'l')]
        lazy: bool,
        /// Do not wait for the daemon (as plain umount; the image is consistent
        /// only once the daemon has exited).
        #[arg(long)]
        no_wait: bool,
        /// Internal (run as /sbin/umount.fuse): unmount any other FUSE mount with
        /// `umount` and these flags.
        #[arg(long, hide = true, value_name = "FLAGS", allow_hyphen_values = true)]
        other_fuse: Option<String>,
    },
    /// Install /sbin/mount.fuse.commitfs, /sbin/umount.fuse.commitfs and
    /// /sbin/umount.fuse (symlinks to this program) so `mount -t fuse.commitfs` and
    /// fstab entries work and `umount` waits (other FUSE mounts unmount as before).
    InstallHelper {
        /// Install into this directory instead.
        #[arg(long, default_value = helper::HELPER_DIR)]
        dir: PathBuf,
        /// Remove the links instead.
        #[arg(long)]
        remove: bool,
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
    /// Make everything written through a mount durable now (sync(1) and
    /// syncfs(2) never reach a FUSE file system: the kernel does not pass them on).
    Sync {
        /// Mount point.
        dir: PathBuf,
    },
    /// Crash-state harness: record a workload, check every crash state's recovery.
    Crashtest(crashtest_cmd::CrashtestArgs),
    /// Benchmark commitfs beside kernel ext4, XFS and fuse2fs on one device.
    Bench(bench::BenchArgs),
    /// What commitfs is for, in under a minute: fsync cost beside kernel ext4,
    /// then a power cut and the recovery.
    Demo {
        /// Work in this directory instead of a temporary one.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Keep the images afterwards.
        #[arg(long)]
        keep: bool,
        /// Messages (one fsync each) per system; the power cut uses half as many.
        #[arg(long, value_name = "N", default_value_t = demo::DEFAULT_MESSAGES)]
        messages: usize,
    },
}

/// Report commands end quietly when their reader goes away (`commitfs stats
/// DIR | head`), as Unix tools do, instead of panicking on EPIPE: Rust
/// ignores SIGPIPE by default. Not for the daemon, whose clients may hang up.
fn quiet_on_closed_pipe() {
    // SAFETY: restoring the default disposition of one signal.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
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
            daemon_child,
        } => {
            // Logging is set up by the serving process itself.
            let parsed = mount::parse_options(&options)?;
            mount::run(&mount::MountRequest {
                image,
                dir,
                options: parsed,
                raw_options: options,
                foreground,
                pid_file,
                log_file,
                daemon_child,
            })
        }
        Cmd::Umount {
            dir,
            timeout,
            lazy,
            no_wait,
            other_fuse,
        } => {
            init_cli_logging();
            umount::run(&umount::UmountRequest {
                dir,
                timeout: std::time::Duration::from_secs(timeout),
                lazy,
                wait: !no_wait,
                other_fuse,
            })
        }
        Cmd::InstallHelper { dir, remove } => {
            for l in helper::install(&dir, remove)? {
                println!(
                    "{} {}",
                    if remove { "removed" } else { "installed" },
                    l.display()
                );
            }
            Ok(())
        }
        Cmd::Info { image, json } => {
            init_cli_logging();
            quiet_on_closed_pipe();
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
            quiet_on_closed_pipe();
            stats::run(&dir, json)
        }
        Cmd::Sync { dir } => {
            init_cli_logging();
            stats::sync(&dir)
        }
        Cmd::Crashtest(a) => {
            init_cli_logging();
            crashtest_cmd::run(a)
        }
        Cmd::Bench(a) => bench::run(a),
        Cmd::Demo {
            dir,
            keep,
            messages,
        } => {
            init_cli_logging();
            demo::run(dir.as_deref(), keep, messages)
        }
    }
}

fn main() -> ExitCode {
    let names: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let args = match helper::rewrite_args(std::env::args_os().collect(), &names) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("commitfs: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    match run(Cli::parse_from(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("commitfs: {e:#}");
            ExitCode::FAILURE
        }
    }
}
