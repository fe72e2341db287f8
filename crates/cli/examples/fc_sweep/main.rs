//! Benchmark printout of the fast-commit sweep (the CI test with exact counts is
//! `crates/cli/tests/fc_sweep.rs`; both use `sweep.rs`, whose docs say what is
//! measured and how). Needs root.
//!
//! ```sh
//! cargo run --release --example fc_sweep -- [--files N] [--max-n N] [--dir DIR]
//!                                           [--systems kernel,commitfs,csum]
//! ```
//!
//! `--dir` holds the sparse image behind the loop device (default `/dev/shm`,
//! where a flush is cheap: the wall times then measure CPU and request overhead,
//! not a disk; use a directory on a real disk for disk-bound timings).

mod sweep;

use std::path::PathBuf;

use sweep::{Config, System};

fn main() {
    let mut cfg = Config::default();
    let mut systems = System::ALL.to_vec();
    let mut repeat = 1usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || {
            args.next().unwrap_or_else(|| {
                eprintln!("{a} needs a value");
                std::process::exit(2)
            })
        };
        match a.as_str() {
            "--files" => cfg.files = val().parse().expect("--files N"),
            "--max-n" => {
                let max: usize = val().parse().expect("--max-n N");
                cfg.ns = (0..=20)
                    .map(|k| 1usize << k)
                    .filter(|n| *n <= max)
                    .collect();
            }
            "--dir" => cfg.image_dir = PathBuf::from(val()),
            "--repeat" => repeat = val().parse::<usize>().expect("--repeat K").max(1),
            "--systems" => {
                systems = val()
                    .split(',')
                    .map(|s| match s {
                        "kernel" => System::Kernel,
                        "commitfs" => System::Commitfs,
                        "csum" | "fc_data_csum" => System::CommitfsCsum,
                        _ => {
                            eprintln!("unknown system {s} (kernel, commitfs, csum)");
                            std::process::exit(2)
                        }
                    })
                    .collect()
            }
            "-h" | "--help" => {
                println!(
                    "fc_sweep [--files N] [--max-n N] [--dir DIR] [--systems kernel,commitfs,csum] [--repeat K]"
                );
                return;
            }
            _ => {
                eprintln!("unknown argument {a}");
                std::process::exit(2)
            }
        }
    }
    cfg.ns.retain(|n| *n > 0 && cfg.files.is_multiple_of(*n));
    eprintln!(
        "fast-commit sweep: {} x (create, append 4 KiB, close), fsync every n-th file, n in {:?}; image in {}",
        cfg.files,
        cfg.ns,
        cfg.image_dir.display()
    );
    let mut sw: Option<sweep::Sweep> = None;
    for k in 0..repeat {
        let this = match sweep::sweep(&cfg, &systems, |r| {
            eprintln!(
                "  [{}/{repeat}] n = {:>4}  {:<22} {:>8.1} ms",
                k + 1,
                r.n,
                r.label(),
                r.wall.as_secs_f64() * 1e3
            )
        }) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("sweep failed: {e}");
                std::process::exit(1);
            }
        };
        // Counts are exact and must repeat; wall time is the best of the runs.
        match &mut sw {
            None => sw = Some(this),
            Some(best) => {
                for (key, r) in this.runs {
                    let Some(b) = best.runs.get_mut(&key) else {
                        continue;
                    };
                    if (
                        b.journal_bytes_dev,
                        b.flushes_dev,
                        b.fast_commits,
                        b.full_commits,
                    ) != (
                        r.journal_bytes_dev,
                        r.flushes_dev,
                        r.fast_commits,
                        r.full_commits,
                    ) {
                        eprintln!(
                            "note: counts differ between repeats for {} at n = {}",
                            r.label(),
                            r.n
                        );
                    }
                    b.wall = b.wall.min(r.wall);
                }
            }
        }
    }
    let sw = sw.expect("at least one sweep");
    println!(
        "device {} (loop, image in {}); per fsync: journal KiB written into the journal \
         (dev = block layer, own = the system's accounting), device flushes \
         (dev = /sys/block stat, own = flushes + FUA writes issued); full/fast = commits; \
         1blk% = single-block fast commits; wall = best of {repeat}",
        sw.device,
        sw.image_dir.display()
    );
    print!("{}", sweep::table(&sw));
    println!();
    for s in &systems {
        let (fast, single) = sw
            .runs
            .values()
            .filter(|r| r.system == Some(*s))
            .fold((0, 0), |(f, o), r| {
                (f + r.fast_commits, o + r.fc_single_block)
            });
        println!(
            "{:<22} over the sweep: {fast} fast commits, {single} single-block ({:.1}%)",
            s.label(),
            100.0 * single as f64 / fast.max(1) as f64
        );
    }
    println!();
    print!("{}", sweep::detail(&sw));
}
