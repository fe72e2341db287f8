//! commitfs crash-state harness.
//!
//! 1. A workload ([`workload`]) runs on a [`commitfs_device::RecordingDevice`]
//!    holding a fresh mkfs.ext4 image, while a model ([`model`]) records the tree
//!    after every operation and every acknowledged fsync.
//! 2. Crash states are built from the device log ([`plan_states`]): every flush
//!    boundary, plus random crash points where each write issued since the last
//!    flush survives or not (optionally torn into 512-byte sectors).
//! 3. Each state is mounted with commitfs (journal recovery, then fast-commit
//!    replay on `fast_commit` images) and checked ([`check`]): e2fsck clean, the
//!    tree a snapshot within the crash window, no stale or foreign data, and the
//!    file system still usable. What each state's fast-commit area offered
//!    recovery is counted ([`jlog::fast_commit_scan`]): states that replayed fast
//!    commits, and states whose area the kernel's recovery would refuse.
//!
//! This crate sits on top of everything; nothing in the file system depends on it.

pub mod check;
pub mod concurrent;
pub mod inflight;
pub mod jlog;
pub mod model;
pub mod observe;
pub mod workload;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use commitfs_device::{CrashLog, CrashSpec, Materializer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use check::{check_image, ScratchFile};
pub use concurrent::{run_conc, ConcConfig, ConcSummary, CONC_WORKLOADS};
pub use inflight::MIN_INFLIGHT;
pub use workload::{find, record, record_options, record_with, Recording, WorkloadSpec, WORKLOADS};

/// A fresh image made once per block size and process: 16 MiB with 1 KiB blocks,
/// 32 MiB with 4 KiB blocks (mkfs.ext4 defaults otherwise).
pub fn base_image(block_size: u32) -> Result<Arc<Vec<u8>>, String> {
    base_image_with(block_size, false)
}

/// [`base_image`], optionally with the `fast_commit` feature (a fast-commit area
/// in the journal; fsync then writes fast commits where it can).
pub fn base_image_with(block_size: u32, fast_commit: bool) -> Result<Arc<Vec<u8>>, String> {
    /// Base images by (block size, fast_commit).
    type Cache = Mutex<HashMap<(u32, bool), Arc<Vec<u8>>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(img) = c.get(&(block_size, fast_commit)) {
        return Ok(img.clone());
    }
    let mib = match block_size {
        1024 => 16,
        4096 => 32,
        b => return Err(format!("unsupported block size {b} (1024 or 4096)")),
    };
    let bs = block_size.to_string();
    let mut args = vec!["-b", bs.as_str()];
    if fast_commit {
        args.extend(["-O", "fast_commit"]);
    }
    let tmp = commitfs_fs::testutil::mkfs("crashtest-base", mib, &args);
    let bytes = std::fs::read(&tmp.path).map_err(|e| format!("read base image: {e}"))?;
    let img = Arc::new(bytes);
    c.insert((block_size, fast_commit), img.clone());
    Ok(img)
}

/// Crash points for `log`: every flush boundary (up to half of `n`; evenly
/// sampled beyond), the rest random, half of them close to a flush or FUA write
/// where commits happen. Sorted by crash point.
pub fn plan_states(log: &CrashLog, n: usize, seed: u64, torn: bool) -> Vec<CrashSpec> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5EED_CA5E);
    let len = log.len();
    let mut bounds: Vec<usize> = std::iter::once(0)
        .chain(log.flush_indices().into_iter().map(|f| f + 1))
        .chain(std::iter::once(len))
        .collect();
    bounds.dedup();
    let max_bounds = (n / 2).max(1).min(n);
    if bounds.len() > max_bounds {
        let step = bounds.len() as f64 / max_bounds as f64;
        bounds = (0..max_bounds)
            .map(|i| bounds[(i as f64 * step) as usize])
            .collect();
    }
    let mut out: Vec<CrashSpec> = bounds
        .iter()
        .map(|&k| CrashSpec {
            k,
            seed: rng.gen(),
            keep_256: 0,
            torn: false,
        })
        .collect();
    out.truncate(n);
    // Interesting points: just before/after flushes and FUA writes.
    let hot: Vec<usize> = log
        .ops()
        .iter()
        .enumerate()
        .filter(|(_, o)| match o {
            commitfs_device::LogOp::Flush => true,
            commitfs_device::LogOp::Write { fua, .. } => *fua,
        })
        .map(|(i, _)| i)
        .collect();
    while out.len() < n {
        let k = if !hot.is_empty() && rng.gen_bool(0.5) {
            let h = hot[rng.gen_range(0..hot.len())] as i64 + rng.gen_range(-6i64..=2);
            h.clamp(0, len as i64) as usize
        } else {
            rng.gen_range(0..=len)
        };
        let keep_256 = match rng.gen_range(0..4) {
            0 => 0,
            1 => 255,
            _ => rng.gen(),
        };
        out.push(CrashSpec {
            k,
            seed: rng.gen(),
            keep_256,
            torn: torn && rng.gen_bool(0.5),
        });
    }
    out.sort_by_key(|s| (s.k, s.seed));
    out
}

/// Options of one harness run.
#[derive(Debug, Clone)]
pub struct Config {
    pub workload: String,
    pub states: usize,
    pub seed: u64,
    pub torn: bool,
    pub save_failures: Option<PathBuf>,
    pub block_size: u32,
    /// Checking threads (0 = one per CPU).
    pub workers: usize,
    /// Let torn writes tear the primary superblock too (see
    /// [`workload::superblock_range`]); off by default.
    pub torn_superblock: bool,
    /// Make the image with `-O fast_commit`.
    pub fast_commit: bool,
    /// Record the workload mounted with `fc_data_csum` (fast commits carry
    /// checksums of their data ranges; implies `fast_commit`). Recovery of the
    /// crash states mounts with the defaults, as after a reboot.
    pub fc_data_csum: bool,
    /// Record the workload mounted with `data_order=file` (ext4's per-file
    /// data ordering; the checker then holds each file's size and data to its
    /// own fsyncs only, check.rs).
    pub data_order_file: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workload: "mixed".into(),
            states: 200,
            seed: 1,
            torn: false,
            save_failures: None,
            block_size: 1024,
            workers: 0,
            torn_superblock: false,
            fast_commit: false,
            fc_data_csum: false,
            data_order_file: false,
        }
    }
}

/// One failed crash state.
#[derive(Debug, Clone)]
pub struct Failure {
    pub spec: CrashSpec,
    pub window: (usize, usize),
    pub message: String,
    pub saved: Option<PathBuf>,
    /// What recovery found in the image's fast-commit area.
    pub fc: FcFound,
}

/// What the fast-commit area of a crash image offered recovery
/// ([`jlog::fast_commit_scan`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FcFound {
    /// Valid fast commits (replayed by recovery).
    pub commits: u32,
    /// The kernel's scan would fail recovery (and the mount) on this area, e.g. a
    /// HEAD of the expected tid with no valid TAIL after it (ext4-format.md §9.6).
    /// Never set on `fc_data_csum` images (the kernel refuses those anyway: their
    /// incompat bit).
    pub kernel_error: bool,
}

/// One passed crash state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatePass {
    /// The snapshot the recovered tree equalled.
    pub j: usize,
    /// What recovery found in the fast-commit area.
    pub fc: FcFound,
}

/// Outcome of a run.
#[derive(Debug, Clone)]
pub struct Summary {
    pub workload: String,
    pub block_size: u32,
    pub seed: u64,
    pub ops: usize,
    pub syncs: usize,
    pub log_len: usize,
    pub flushes: usize,
    /// Metadata writes to home locations before the final unmount (checkpoints and
    /// the superblock written at mount).
    pub home_writes: usize,
    /// Fast commits and full commits the recorded run wrote before unmount.
    pub fast_commits: u64,
    pub full_commits: u64,
    /// fdatasyncs of the run that committed nothing (C.5).
    pub data_only_fdatasyncs: u64,
    pub states: usize,
    pub torn_states: usize,
    /// States whose recovery replayed at least one fast commit.
    pub fc_replay_states: usize,
    /// States whose fast-commit area the kernel's recovery would refuse
    /// ([`FcFound::kernel_error`]; commitfs replays the valid prefix).
    pub fc_kernel_error_states: usize,
    pub passed: usize,
    pub failures: Vec<Failure>,
    /// Distinct snapshots the recovered trees equalled.
    pub distinct_snapshots: usize,
    pub record_time: Duration,
    pub check_time: Duration,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "crashtest workload={} states={} passed={} failed={} bs={} seed={} torn={} fc_replay_states={} fc_kernel_error_states={} ops={} syncs={} log={} flushes={} home_writes={} fast_commits={} full_commits={} data_only_fdatasyncs={} snapshots_seen={} record={:.2}s check={:.2}s",
            self.workload,
            self.states,
            self.passed,
            self.failures.len(),
            self.block_size,
            self.seed,
            self.torn_states,
            self.fc_replay_states,
            self.fc_kernel_error_states,
            self.ops,
            self.syncs,
            self.log_len,
            self.flushes,
            self.home_writes,
            self.fast_commits,
            self.full_commits,
            self.data_only_fdatasyncs,
            self.distinct_snapshots,
            self.record_time.as_secs_f64(),
            self.check_time.as_secs_f64()
        )
    }
}

impl Summary {
    /// The first `n` failures, one line each (crash spec, window, fast commits in the
    /// area, message, where the image was saved), for a test's panic message.
    pub fn failure_report(&self, n: usize) -> String {
        self.failures
            .iter()
            .take(n)
            .map(|f| {
                format!(
                    "k={} seed={:#x} keep={}/256 torn={} window={:?} fast commits in the area={}: {}{}",
                    f.spec.k,
                    f.spec.seed,
                    f.spec.keep_256,
                    f.spec.torn,
                    f.window,
                    f.fc.commits,
                    f.message,
                    f.saved
                        .as_ref()
                        .map(|p| format!(" [saved {}]", p.display()))
                        .unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Record `cfg.workload` and check `cfg.states` crash states of it.
pub fn run(cfg: &Config) -> Result<Summary, String> {
    let spec = find(&cfg.workload).ok_or_else(|| {
        format!(
            "unknown workload {:?} (known: {})",
            cfg.workload,
            WORKLOADS
                .iter()
                .map(|w| w.name)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let base = base_image_with(cfg.block_size, cfg.fast_commit || cfg.fc_data_csum)?;
    let t0 = Instant::now();
    let opts = commitfs_fs::MountOptions {
        fc_data_csum: cfg.fc_data_csum,
        data_order: if cfg.data_order_file {
            commitfs_fs::DataOrder::File
        } else {
            commitfs_fs::DataOrder::Prefix
        },
        ..record_options()
    };
    let mut rec = record_with(spec, &base, cfg.seed, opts)?;
    if cfg.torn_superblock {
        rec.log = rec.log.clone().with_atomic(Vec::new());
    }
    let record_time = t0.elapsed();
    let states = plan_states(&rec.log, cfg.states, cfg.seed, cfg.torn);
    let t1 = Instant::now();
    let results = check_states(&rec, &states, cfg.workers, cfg.save_failures.as_deref());
    let check_time = t1.elapsed();
    let mut failures = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    let (mut fc_replay_states, mut fc_kernel_error_states) = (0, 0);
    for r in results {
        let fc = match r {
            Ok(p) => {
                seen.insert(p.j);
                p.fc
            }
            Err(f) => {
                let fc = f.fc;
                failures.push(f);
                fc
            }
        };
        fc_replay_states += usize::from(fc.commits > 0);
        fc_kernel_error_states += usize::from(fc.kernel_error);
    }
    Ok(Summary {
        workload: spec.name.into(),
        block_size: cfg.block_size,
        seed: cfg.seed,
        ops: rec.op_start.len(),
        syncs: rec.syncs.len(),
        log_len: rec.log.len(),
        flushes: rec.log.flush_indices().len(),
        home_writes: rec.log.ops()[..rec.unmount_start]
            .iter()
            .filter(|o| {
                matches!(
                    o,
                    commitfs_device::LogOp::Write {
                        cat: commitfs_device::IoCategory::Metadata,
                        ..
                    }
                )
            })
            .count(),
        fast_commits: rec.fast_commits,
        full_commits: rec.full_commits,
        data_only_fdatasyncs: rec.data_only_fdatasyncs,
        states: states.len(),
        torn_states: states.iter().filter(|s| s.torn).count(),
        fc_replay_states,
        fc_kernel_error_states,
        passed: states.len() - failures.len(),
        failures,
        distinct_snapshots: seen.len(),
        record_time,
        check_time,
    })
}

/// Check `states` (sorted by crash point) on `workers` threads; returns per state
/// the snapshot matched or the failure.
pub fn check_states(
    rec: &Recording,
    states: &[CrashSpec],
    workers: usize,
    save: Option<&Path>,
) -> Vec<Result<StatePass, Failure>> {
    for_each_state(
        &rec.log,
        states,
        workers,
        "check",
        |mat, spec, scratch, buf| check_one(rec, mat, spec, scratch, buf, save),
    )
}

/// Run `f` on every crash state, on `workers` threads (0: one per CPU), each
/// with its own materializer, scratch file and image buffer; results in the
/// order of `states`.
pub(crate) fn for_each_state<T: Send>(
    log: &commitfs_device::CrashLog,
    states: &[CrashSpec],
    workers: usize,
    scratch_tag: &str,
    f: impl Fn(&mut Materializer, &CrashSpec, &ScratchFile, &mut Vec<u8>) -> T + Sync,
) -> Vec<T> {
    let workers = if workers == 0 {
        std::thread::available_parallelism().map_or(2, |n| n.get())
    } else {
        workers
    }
    .clamp(1, states.len().max(1));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<T>>> =
        Mutex::new(std::iter::repeat_with(|| None).take(states.len()).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut mat = Materializer::new(log.clone());
                let scratch = ScratchFile::new(scratch_tag);
                let mut buf = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(spec) = states.get(i) else { break };
                    let r = f(&mut mat, spec, &scratch, &mut buf);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .map(|r| r.expect("every state checked"))
        .collect()
}

fn check_one(
    rec: &Recording,
    mat: &mut Materializer,
    spec: &CrashSpec,
    scratch: &ScratchFile,
    buf: &mut Vec<u8>,
    save: Option<&Path>,
) -> Result<StatePass, Failure> {
    mat.image_into(spec, buf);
    let img = std::mem::take(buf);
    // What the fast-commit area offers recovery (for the counts; a scan error is
    // for the check below to find).
    let fc = jlog::fast_commit_scan(&img)
        .ok()
        .flatten()
        .map_or(FcFound::default(), |(_, s)| FcFound {
            commits: s.commits,
            kernel_error: s.kernel_error() && !jlog::has_fc_data_csum(&img),
        });
    let (lo, hi) = rec.window(spec.k);
    let keep = save.map(|_| img.clone());
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (r, back) = check::check_image_reusing(rec, img, spec.k, scratch);
        if let Some(b) = back {
            *buf = b;
        }
        r
    }))
    .unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(format!("panic during check: {msg}"))
    });
    match r {
        Ok(p) => Ok(StatePass { j: p.j, fc }),
        Err(message) => {
            let saved = match (save, keep) {
                (Some(dir), Some(img)) => save_failure(
                    rec,
                    spec,
                    (lo, hi),
                    &format!(
                        "{message}\nfast-commit area: {} valid fast commit(s){}",
                        fc.commits,
                        if fc.kernel_error {
                            " (the kernel would refuse it)"
                        } else {
                            ""
                        }
                    ),
                    dir,
                    &img,
                ),
                _ => None,
            };
            Err(Failure {
                spec: *spec,
                window: (lo, hi),
                message,
                saved,
                fc,
            })
        }
    }
}

/// Write a failing crash image (before recovery) and a description beside it.
fn save_failure(
    rec: &Recording,
    spec: &CrashSpec,
    window: (usize, usize),
    message: &str,
    dir: &Path,
    img: &[u8],
) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).ok()?;
    let stem = format!(
        "{}-bs{}-seed{}-k{}-s{:016x}{}",
        rec.workload,
        rec.bs,
        rec.seed,
        spec.k,
        spec.seed,
        if spec.torn { "-torn" } else { "" }
    );
    let path = dir.join(format!("{stem}.img"));
    std::fs::write(&path, img).ok()?;
    let (lo, hi) = window;
    let op_line = |(i, d): (usize, &String)| {
        format!(
            "  op {i} (-> snapshot {}), log index {}: {d}",
            i + 1,
            rec.op_start[i]
        )
    };
    let ops: Vec<String> = rec
        .op_desc
        .iter()
        .enumerate()
        .skip(lo.saturating_sub(3))
        .take(hi + 3 - lo.saturating_sub(3))
        .map(op_line)
        .collect();
    // Every operation on a path the failure names (its history, for a stale
    // block: which writes and syncs came before).
    let paths: Vec<&str> = message
        .split_whitespace()
        .filter(|w| w.starts_with('/') && w.len() > 1)
        .map(|w| w.trim_end_matches([':', ',', ')']))
        .collect();
    let names_path = |d: &str| {
        paths.iter().any(|p| {
            d.match_indices(p).any(|(at, _)| {
                !d[at + p.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_alphanumeric())
            })
        })
    };
    let history: Vec<String> = rec
        .op_desc
        .iter()
        .enumerate()
        .filter(|(_, d)| names_path(d))
        .map(op_line)
        .collect();
    let text = format!(
        "workload {} block size {} seed {}\ncrash point k={} of {} (state seed {:#x}, keep {}/256, torn {})\nwindow: snapshots {lo}..={hi}\nfailure: {message}\noperations around the window:\n{}\noperations on {}:\n{}\n",
        rec.workload,
        rec.bs,
        rec.seed,
        spec.k,
        rec.log.len(),
        spec.seed,
        spec.keep_256,
        spec.torn,
        ops.join("\n"),
        paths.join(", "),
        history.join("\n")
    );
    std::fs::write(dir.join(format!("{stem}.txt")), text).ok()?;
    Some(path)
}
