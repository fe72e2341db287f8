//! The workloads. Built-in ones run over [`Api`] (so they also run on the
//! commitfs library); external tools (fs_mark, dbench, postmark) run on the
//! mount point. Each point is prepared (file sets made, not measured), then the
//! harness syncs and snapshots the device, then it executes.

use std::io;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::measure::{self, LatSummary};
use super::ops::Api;
use super::sys;

/// Workloads run when none are named: all but the sequential ones, which need
/// a device larger than the default.
pub fn default_set() -> Vec<String> {
    ALL.iter()
        .filter(|w| !w.starts_with("seq-"))
        .map(|s| s.to_string())
        .collect()
}

/// Every workload id, in report order.
pub const ALL: &[&str] = &[
    "fc-micro",
    "varmail-shared",
    "varmail-split",
    "fsmark",
    "dbench",
    "postmark",
    "postmark-lite",
    "cp-a",
    "nfs-async",
    "nfs-sync",
    "seq-write",
    "seq-read",
];

/// Workloads that run on the library too (our own code, no external tool).
pub fn builtin(id: &str) -> bool {
    matches!(
        id,
        "fc-micro"
            | "varmail-shared"
            | "varmail-split"
            | "nfs-async"
            | "nfs-sync"
            | "seq-write"
            | "seq-read"
    ) || id == "postmark-lite"
}

pub fn describe(id: &str) -> &'static str {
    match id {
        "fc-micro" => "FastCommit §6 microbenchmark: 1,024 x (create, append 4 KiB, close), fsync every n-th file (4 n files when n > 256)",
        "varmail-shared" => "varmail-like (filebench flow: delete; create-append-fsync; read-append-fsync; read), one shared directory",
        "varmail-split" => "varmail-like, one directory per thread (CJFS varmail-split)",
        "fsmark" => "fs_mark -S 1 (fsync before close), 4 KiB files",
        "dbench" => "dbench with the client.txt load (Flush = fsync)",
        "postmark" => "postmark (NetApp): small-file create/delete/read/append, no fsync",
        "postmark-lite" => "built-in postmark-like transactions (read or append, create or delete), no fsync; runs on the library too",
        "cp-a" => "cp -a of a generated source tree (files of 100 B to 64 KiB, a few executables and symlinks, in nested directories) from the host's file system, caches dropped first; the copy is timed",
        "nfs-async" => "postmark-like transactions, fsync on every close of a written file (NFS async COMMIT on close)",
        "nfs-sync" => "postmark-like transactions, fsync after every write and every metadata op (NFS sync export)",
        "seq-write" => "one file written sequentially in 1 MiB writes, then fsync (1 GiB; 4 GiB without --quick: give --size 6G)",
        "seq-read" => "the same file read back sequentially in 1 MiB reads, the kernel's caches dropped first",
        _ => "",
    }
}

/// One measured point of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub workload: String,
    /// e.g. "n=16", "t=4".
    pub variant: String,
    /// The x value for plots (n, threads, clients).
    pub x: f64,
    pub threads: usize,
    /// fc-micro: fsync every n files; fs_mark: files per thread; pool size.
    pub n: usize,
    pub files: usize,
    pub secs: f64,
}

/// Sizes of the run.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub quick: bool,
}

impl Scale {
    /// Seconds per timed point; `COMMITFS_BENCH_SECS` overrides it (longer
    /// points for A/B comparisons whose difference is within a 2 s point's noise).
    fn secs(&self) -> f64 {
        if let Some(s) = std::env::var("COMMITFS_BENCH_SECS")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
        {
            return s;
        }
        if self.quick {
            2.0
        } else {
            8.0
        }
    }
}

/// The points of a workload.
pub fn plan(id: &str, s: Scale) -> Vec<Point> {
    let p = |variant: String, x: f64, threads: usize, n: usize, files: usize, secs: f64| Point {
        workload: id.to_string(),
        variant,
        x,
        threads,
        n,
        files,
        secs,
    };
    let threads: Vec<usize> = if s.quick {
        vec![1, 4, 16]
    } else {
        vec![1, 2, 4, 8, 16]
    };
    match id {
        "fc-micro" => {
            let ns: Vec<usize> = if s.quick {
                vec![1, 4, 16, 64, 256, 1024]
            } else {
                (0..=10).map(|k| 1usize << k).collect()
            };
            // At least four fsyncs per point: at n=1024 one fsync of 1,024
            // files took 30 ms, and the kernel's own rate varied threefold
            // between runs.
            ns.into_iter()
                .map(|n| p(format!("n={n}"), n as f64, 1, n, 1024.max(4 * n), 0.0))
                .collect()
        }
        "varmail-shared" | "varmail-split" => {
            let files = if s.quick { 400 } else { 1000 };
            threads
                .iter()
                .map(|&t| p(format!("t={t}"), t as f64, t, 0, files, s.secs()))
                .collect()
        }
        "fsmark" => {
            let total = if s.quick { 1024 } else { 4096 };
            [1usize, 4, 16]
                .iter()
                .map(|&t| p(format!("t={t}"), t as f64, t, total / t, total, 0.0))
                .collect()
        }
        "dbench" => [1usize, 10]
            .iter()
            .map(|&c| {
                p(
                    format!("c={c}"),
                    c as f64,
                    c,
                    0,
                    0,
                    if s.quick { 3.0 } else { 10.0 },
                )
            })
            .collect(),
        "postmark" => {
            let (files, tx) = if s.quick { (500, 2000) } else { (2000, 10000) };
            vec![p("t=1".into(), 1.0, 1, tx, files, 0.0)]
        }
        "postmark-lite" => {
            let files = if s.quick { 500 } else { 2000 };
            vec![p("t=1".into(), 1.0, 1, 0, files, s.secs())]
        }
        "cp-a" => {
            // files: regular files in the tree (plus directories and symlinks).
            let files = if s.quick { 3000 } else { 8000 };
            vec![p("tree".into(), 1.0, 1, 0, files, 0.0)]
        }
        "nfs-async" | "nfs-sync" => {
            let files = if s.quick { 300 } else { 1000 };
            vec![p("t=4".into(), 4.0, 4, 0, files, s.secs())]
        }
        "seq-write" | "seq-read" => {
            // n: the file's size in MiB.
            let mib = if s.quick { 1024 } else { 4096 };
            vec![p(format!("{mib}MiB"), mib as f64, 1, mib, 1, 0.0)]
        }
        _ => Vec::new(),
    }
}

/// What a point measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkResult {
    /// Application operations (files, filebench ops, transactions, ...).
    pub ops: u64,
    pub secs: f64,
    pub throughput: f64,
    pub unit: String,
    pub fsyncs: u64,
    /// Latency of each fsync, where we issue them (built-in workloads).
    pub fsync_lat: Option<LatSummary>,
    /// Tool-reported fsync latency (dbench's Flush row): mean and max, µs.
    pub tool_fsync_mean_us: Option<f64>,
    pub tool_fsync_max_us: Option<f64>,
    pub notes: Vec<String>,
}

/// Seeded generator, so runs are reproducible per seed.
fn seeded(seed: u64) -> rand::rngs::StdRng {
    rand::SeedableRng::seed_from_u64(seed)
}

/// Per-run latency collection (µs), merged across threads.
#[derive(Default)]
struct Lat(Mutex<Vec<f64>>);

impl Lat {
    fn add(&self, v: Vec<f64>) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).extend(v);
    }
    fn take(&self) -> Vec<f64> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

fn timed_fsync(api: &dyn Api, f: &mut super::ops::Fh, lat: &mut Vec<f64>) -> io::Result<()> {
    let t = Instant::now();
    api.fsync(f)?;
    lat.push(t.elapsed().as_secs_f64() * 1e6);
    Ok(())
}

fn timed_fsync_dir(api: &dyn Api, dir: &str, lat: &mut Vec<f64>) -> io::Result<()> {
    let t = Instant::now();
    api.fsync_dir(dir)?;
    lat.push(t.elapsed().as_secs_f64() * 1e6);
    Ok(())
}

static DATA: [u8; 65536] = [0x5a; 65536];

fn ctx<T>(r: io::Result<T>, what: &str) -> Result<T> {
    r.map_err(|e| anyhow!("{what}: {e}"))
}

/// A prepared built-in point: its directory and per-thread file slots.
pub struct Prepared {
    dir: String,
    /// Per thread: (directory, file names, exists?).
    sets: Vec<(String, Vec<String>, Vec<bool>)>,
}

/// Make the point's directory and file set (not measured).
pub fn prepare(api: &dyn Api, p: &Point, tag: &str) -> Result<Prepared> {
    let dir = format!("{}-{}-{tag}", p.workload, p.variant.replace('=', ""));
    ctx(api.mkdir(&dir), "mkdir")?;
    let mut sets = Vec::new();
    match p.workload.as_str() {
        "fc-micro" | "seq-write" => sets.push((dir.clone(), Vec::new(), Vec::new())),
        "seq-read" => {
            let name = format!("{dir}/seq");
            seq_write_file(api, &name, p.n)?;
            sets.push((dir.clone(), vec![name], vec![true]));
        }
        "varmail-shared" | "varmail-split" | "nfs-async" | "nfs-sync" | "postmark-lite" => {
            let t = p.threads.max(1);
            let split = p.workload != "varmail-shared";
            let mut rng = seeded(7);
            for th in 0..t {
                let d = if split {
                    let d = format!("{dir}/d{th}");
                    ctx(api.mkdir(&d), "mkdir")?;
                    d
                } else {
                    dir.clone()
                };
                let per = (p.files / t).max(4);
                let names: Vec<String> = (0..per).map(|i| format!("{d}/t{th}f{i}")).collect();
                let mut exists = vec![false; per];
                // Half full for the postmark-like pool, full for varmail.
                let fill = if p.workload.starts_with("varmail") {
                    per
                } else {
                    per / 2
                };
                for (i, name) in names.iter().enumerate().take(fill) {
                    let mut f = ctx(api.create(name), "create")?;
                    let sz = 1024 + rng.gen_range(0..31 * 1024) as usize;
                    ctx(api.append(&mut f, &DATA[..sz]), "write")?;
                    ctx(api.close(f), "close")?;
                    exists[i] = true;
                }
                sets.push((d, names, exists));
            }
        }
        _ => {}
    }
    Ok(Prepared { dir, sets })
}

/// Run a prepared built-in point (measured).
pub fn execute(api: &dyn Api, p: &Point, prep: Prepared) -> Result<WorkResult> {
    match p.workload.as_str() {
        "fc-micro" => fc_micro(api, p, &prep),
        "varmail-shared" | "varmail-split" => varmail(api, p, prep),
        "nfs-async" => postmark_like(api, p, prep, Policy::Close),
        "nfs-sync" => postmark_like(api, p, prep, Policy::Sync),
        "postmark-lite" => postmark_like(api, p, prep, Policy::None),
        "seq-write" => seq_write(api, p, &prep),
        "seq-read" => seq_read(api, p, &prep),
        w => bail!("{w} is not a built-in workload"),
    }
}

/// Write `mib` MiB to a new file `name` in 1 MiB writes, then fsync.
fn seq_write_file(api: &dyn Api, name: &str, mib: usize) -> Result<()> {
    let chunk = vec![0x5au8; 1 << 20];
    let mut f = ctx(api.create(name), "create")?;
    for _ in 0..mib {
        ctx(api.append(&mut f, &chunk), "write")?;
    }
    ctx(api.fsync(&mut f), "fsync")?;
    ctx(api.close(f), "close")
}

fn mib_result(mib: usize, secs: f64, fsyncs: u64) -> WorkResult {
    WorkResult {
        ops: mib as u64,
        secs,
        throughput: mib as f64 / secs,
        unit: "MiB/s".into(),
        fsyncs,
        ..Default::default()
    }
}

/// Sequential write with the fsync that makes it durable (as `dd conv=fsync`):
/// what reaches the device is timed, not only what the page cache absorbs.
fn seq_write(api: &dyn Api, p: &Point, prep: &Prepared) -> Result<WorkResult> {
    let name = format!("{}/seq", prep.dir);
    let t = Instant::now();
    seq_write_file(api, &name, p.n)?;
    let r = mib_result(p.n, t.elapsed().as_secs_f64(), 1);
    // Not measured: the space goes back for seq-read's own file (4 GiB twice
    // did not fit the 6 GiB device the full run asks for).
    ctx(api.unlink(&name), "unlink")?;
    Ok(r)
}

/// Sequential read of the file `prepare` wrote, after the kernel's caches are
/// dropped (commitfs's own page cache keeps what it holds: at most its cap).
fn seq_read(api: &dyn Api, p: &Point, prep: &Prepared) -> Result<WorkResult> {
    let name = &prep.sets[0].1[0];
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    let mut buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    let mut f = ctx(api.open(name, false), "open")?;
    let got = ctx(api.read_all(&mut f, &mut buf), "read")?;
    ctx(api.close(f), "close")?;
    let secs = t.elapsed().as_secs_f64();
    if got != (p.n as u64) << 20 {
        bail!("read {got} bytes of {} MiB", p.n);
    }
    Ok(mib_result(p.n, secs, 0))
}

fn fc_micro(api: &dyn Api, p: &Point, prep: &Prepared) -> Result<WorkResult> {
    let mut lat = Vec::new();
    let n = p.n.max(1);
    let t = Instant::now();
    for i in 0..p.files {
        let name = format!("{}/f{i}", prep.dir);
        let mut f = ctx(api.create(&name), "create")?;
        ctx(api.append(&mut f, &DATA[..4096]), "write")?;
        if (i + 1) % n == 0 {
            ctx(timed_fsync(api, &mut f, &mut lat), "fsync")?;
        }
        ctx(api.close(f), "close")?;
    }
    let secs = t.elapsed().as_secs_f64();
    let fsyncs = lat.len() as u64;
    Ok(WorkResult {
        ops: p.files as u64,
        secs,
        throughput: p.files as f64 / secs,
        unit: "files/s".into(),
        fsyncs,
        fsync_lat: measure::summarize(lat),
        ..Default::default()
    })
}

/// filebench varmail's flow; 13 filebench operations per iteration.
fn varmail(api: &dyn Api, p: &Point, prep: Prepared) -> Result<WorkResult> {
    let lats = Lat::default();
    let ops = std::sync::atomic::AtomicU64::new(0);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_secs_f64(p.secs);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (th, (_d, names, _e)) in prep.sets.iter().enumerate() {
            let (lats, ops, failed, stop) = (&lats, &ops, &failed, &stop);
            s.spawn(move || {
                let mut rng = seeded(th as u64 + 1);
                let mut lat = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                let r = (|| -> io::Result<()> {
                    while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                        let n = names.len() as u64;
                        let a = &names[rng.gen_range(0..n) as usize];
                        match api.unlink(a) {
                            Ok(()) => {}
                            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                            Err(e) => return Err(e),
                        }
                        let mut f = api.create(a)?;
                        api.append(&mut f, &DATA[..8192 + rng.gen_range(0..16384) as usize])?;
                        timed_fsync(api, &mut f, &mut lat)?;
                        api.close(f)?;
                        let b = &names[rng.gen_range(0..n) as usize];
                        let mut f = api.open(b, true)?;
                        api.read_all(&mut f, &mut buf)?;
                        api.append(&mut f, &DATA[..8192 + rng.gen_range(0..16384) as usize])?;
                        timed_fsync(api, &mut f, &mut lat)?;
                        api.close(f)?;
                        let c = &names[rng.gen_range(0..n) as usize];
                        let mut f = api.open(c, false)?;
                        api.read_all(&mut f, &mut buf)?;
                        api.close(f)?;
                        ops.fetch_add(13, Ordering::Relaxed);
                    }
                    Ok(())
                })();
                if let Err(e) = r {
                    stop.store(true, Ordering::Relaxed);
                    *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                }
                lats.add(lat);
            });
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        bail!("varmail: {e}");
    }
    let secs = t0.elapsed().as_secs_f64();
    let ops = ops.into_inner();
    let lat = lats.take();
    Ok(WorkResult {
        ops,
        secs,
        throughput: ops as f64 / secs,
        unit: "ops/s".into(),
        fsyncs: lat.len() as u64,
        fsync_lat: measure::summarize(lat),
        ..Default::default()
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Policy {
    /// No fsync (postmark).
    None,
    /// fsync before closing a written file (NFS async: COMMIT at close).
    Close,
    /// fsync after every write and every namespace change (NFS sync export).
    Sync,
}

/// Postmark-like transactions: (read or append) + (create or delete), on a
/// pool of small files; one file set per thread.
fn postmark_like(api: &dyn Api, p: &Point, prep: Prepared, pol: Policy) -> Result<WorkResult> {
    let lats = Lat::default();
    let txs = std::sync::atomic::AtomicU64::new(0);
    let failed: Mutex<Option<String>> = Mutex::new(None);
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_secs_f64(p.secs.max(0.001));
    let max_tx = if p.n > 0 { p.n as u64 } else { u64::MAX };
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (th, (dir, names, exists)) in prep.sets.into_iter().enumerate() {
            let (lats, txs, failed, stop) = (&lats, &txs, &failed, &stop);
            s.spawn(move || {
                let mut exists = exists;
                let mut rng = seeded(100 + th as u64);
                let mut lat = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                let n = names.len() as u64;
                let r = (|| -> io::Result<()> {
                    loop {
                        if stop.load(Ordering::Relaxed)
                            || (p.secs > 0.0 && Instant::now() >= deadline)
                            || txs.fetch_add(1, Ordering::Relaxed) >= max_tx
                        {
                            return Ok(());
                        }
                        // Read or append an existing file.
                        let i = rng.gen_range(0..n) as usize;
                        if exists[i] {
                            if rng.gen_range(0..2) == 0 {
                                let mut f = api.open(&names[i], false)?;
                                api.read_all(&mut f, &mut buf)?;
                                api.close(f)?;
                            } else {
                                let mut f = api.open(&names[i], true)?;
                                api.append(&mut f, &DATA[..512 + rng.gen_range(0..8192) as usize])?;
                                if pol != Policy::None {
                                    timed_fsync(api, &mut f, &mut lat)?;
                                }
                                api.close(f)?;
                            }
                        }
                        // Create or delete.
                        let j = rng.gen_range(0..n) as usize;
                        if exists[j] {
                            api.unlink(&names[j])?;
                            exists[j] = false;
                            if pol == Policy::Sync {
                                timed_fsync_dir(api, &dir, &mut lat)?;
                            }
                        } else {
                            let mut f = api.create(&names[j])?;
                            if pol == Policy::Sync {
                                // The create is a metadata op of its own.
                                timed_fsync_dir(api, &dir, &mut lat)?;
                            }
                            api.append(&mut f, &DATA[..512 + rng.gen_range(0..16384) as usize])?;
                            if pol != Policy::None {
                                timed_fsync(api, &mut f, &mut lat)?;
                            }
                            api.close(f)?;
                            exists[j] = true;
                        }
                    }
                })();
                if let Err(e) = r {
                    stop.store(true, Ordering::Relaxed);
                    *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                }
                lats.add(lat);
            });
        }
    });
    if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        bail!("{}: {e}", p.workload);
    }
    let secs = t0.elapsed().as_secs_f64();
    // The check that ended a loop on the cap counted one too many: cap it.
    let done = txs.into_inner().min(max_tx);
    let lat = lats.take();
    Ok(WorkResult {
        ops: done,
        secs,
        throughput: done as f64 / secs,
        unit: "tx/s".into(),
        fsyncs: lat.len() as u64,
        fsync_lat: measure::summarize(lat),
        ..Default::default()
    })
}

/// Make the directory an external tool works in (not measured).
pub fn prepare_external(root: &Path, p: &Point, tag: &str) -> Result<std::path::PathBuf> {
    let d = root.join(format!(
        "{}-{}-{tag}",
        p.workload,
        p.variant.replace('=', "")
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// The `cp-a` workload's source: `files` regular files of 100 B to 64 KiB
/// (log-uniform, like a source tree's), 1 in 16 executable, a symlink per 64
/// files, in directories of about 20 entries nested up to three deep,
/// generated once per size in the host's temporary directory (outside every
/// measured device) and reused by later runs.
pub fn cp_source_tree(files: usize) -> Result<std::path::PathBuf> {
    cp_source_tree_in(&std::env::temp_dir(), files)
}

fn cp_source_tree_in(base: &Path, files: usize) -> Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let root = base.join(format!("commitfs-bench-cp-src-{files}"));
    let done = root.join(".complete");
    if done.exists() {
        return Ok(root.join("tree"));
    }
    let _ = std::fs::remove_dir_all(&root);
    let tree = root.join("tree");
    let mut rng = seeded(11);
    let mut dirs = vec![tree.clone()];
    std::fs::create_dir_all(&tree)?;
    let mut buf = vec![0u8; 64 * 1024];
    for i in 0..files {
        if i % 20 == 0 && i > 0 {
            // A new directory under a random existing one (depth <= 3).
            let parent = dirs[rng.gen_range(0..dirs.len())].clone();
            let depth = parent
                .strip_prefix(&tree)
                .map_or(0, |r| r.components().count());
            let d = if depth < 3 {
                parent.join(format!("d{i}"))
            } else {
                tree.join(format!("d{i}"))
            };
            std::fs::create_dir_all(&d)?;
            dirs.push(d);
        }
        let d = dirs.last().expect("the root at least");
        let len = (100f64 * (655.36f64).powf(rng.gen::<f64>())) as usize;
        for b in buf[..len].iter_mut() {
            // Text-like bytes.
            *b = b'a' + rng.gen_range(0..26u8);
        }
        let f = d.join(format!("f{i}.rs"));
        std::fs::write(&f, &buf[..len])?;
        if i % 16 == 0 {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755))?;
        }
        if i % 64 == 0 {
            std::os::unix::fs::symlink(format!("f{i}.rs"), d.join(format!("l{i}")))?;
        }
    }
    std::fs::write(&done, b"")?;
    Ok(tree)
}

/// Calls `f` for every entry under `dir` (files, directories, symlinks; not
/// `dir` itself), depth first.
fn walk(dir: &Path, f: &mut dyn FnMut(&std::fs::DirEntry) -> Result<()>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let e = e?;
        f(&e)?;
        if e.file_type()?.is_dir() {
            walk(&e.path(), f)?;
        }
    }
    Ok(())
}

/// Entries (files, directories, symlinks) under `dir`, itself included.
fn count_entries(dir: &Path) -> Result<u64> {
    let mut n = 1;
    walk(dir, &mut |_| {
        n += 1;
        Ok(())
    })?;
    Ok(n)
}

/// Is the external tool of a workload installed? (postmark falls back to the
/// built-in postmark-like workload.)
pub fn external_available(id: &str) -> Result<()> {
    let (prog, pkg) = match id {
        "fsmark" => ("fs_mark", "fsmark"),
        "dbench" => ("dbench", "dbench"),
        _ => return Ok(()),
    };
    if !sys::have(prog) {
        bail!("{prog} not found (apt-get install {pkg})");
    }
    if id == "dbench" && dbench_loadfile().is_none() {
        bail!("dbench's client.txt load file not found");
    }
    Ok(())
}

fn dbench_loadfile() -> Option<&'static str> {
    [
        "/usr/share/dbench/client.txt",
        "/usr/local/share/client.txt",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists())
}

/// Run an external tool with a time limit; its output.
fn run_tool(
    mut cmd: std::process::Command,
    stdin: Option<&str>,
    limit: Duration,
) -> Result<(String, f64)> {
    use std::io::Write;
    let t = Instant::now();
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = cmd.spawn().context("starting the tool")?;
    if let (Some(input), Some(mut w)) = (stdin, child.stdin.take()) {
        let _ = w.write_all(input.as_bytes());
    }
    let pid = child.id();
    // Kill it if it overruns (a hung file system must not hang the run).
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let d2 = done.clone();
    let watchdog = std::thread::spawn(move || {
        let t = Instant::now();
        while !d2.load(Ordering::Relaxed) {
            if t.elapsed() > limit {
                // SAFETY: signalling our own child by pid.
                unsafe {
                    libc::kill(pid as i32, libc::SIGKILL);
                }
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    });
    let out = child.wait_with_output()?;
    done.store(true, Ordering::Relaxed);
    let killed = watchdog.join().unwrap_or(false);
    let secs = t.elapsed().as_secs_f64();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if killed {
        bail!("timed out after {} s", limit.as_secs());
    }
    if !out.status.success() {
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let head = lines
            .iter()
            .take(3)
            .copied()
            .collect::<Vec<_>>()
            .join(" | ");
        bail!("{}: {head}", out.status);
    }
    Ok((text, secs))
}

/// Run an external-tool point in `dir` (measured).
pub fn execute_external(p: &Point, dir: &Path) -> Result<WorkResult> {
    match p.workload.as_str() {
        "fsmark" => {
            // fs_mark wants directory names shorter than 40 bytes: run it in
            // the parent with a relative name; its log goes nowhere.
            let mut c = sys::command("fs_mark");
            if let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) {
                c.current_dir(parent).arg("-d").arg(name);
            } else {
                c.arg("-d").arg(dir);
            }
            c.args(["-l", "/dev/null"])
                .args(["-t", &p.threads.to_string()])
                .args(["-n", &p.n.to_string()])
                .args(["-s", "4096", "-S", "1", "-L", "1", "-k"]);
            let (out, secs) = run_tool(c, None, Duration::from_secs(600))?;
            // "FSUse% Count Size Files/sec App Overhead" then the numbers.
            let fps = out
                .lines()
                .skip_while(|l| !l.contains("Files/sec"))
                .nth(1)
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or_else(|| anyhow!("fs_mark: no Files/sec in its output"))?;
            let files = (p.n * p.threads) as u64;
            Ok(WorkResult {
                ops: files,
                secs,
                throughput: fps,
                unit: "files/s".into(),
                fsyncs: files,
                ..Default::default()
            })
        }
        "dbench" => {
            let load = dbench_loadfile().ok_or_else(|| anyhow!("no dbench load file"))?;
            let mut c = sys::command("dbench");
            c.arg("-D")
                .arg(dir)
                .args(["-t", &format!("{}", p.secs as u64)])
                .args(["-c", load, &p.threads.to_string()]);
            let (out, secs) = run_tool(c, None, Duration::from_secs_f64(p.secs * 4.0 + 120.0))?;
            let mbps = out
                .lines()
                .find(|l| l.trim_start().starts_with("Throughput"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or_else(|| anyhow!("dbench: no Throughput line"))?;
            // " Flush   731   4.887   34.408" (count, avg ms, max ms)
            let flush: Vec<f64> = out
                .lines()
                .find(|l| l.trim_start().starts_with("Flush "))
                .map(|l| {
                    l.split_whitespace()
                        .skip(1)
                        .filter_map(|v| v.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            Ok(WorkResult {
                ops: (mbps * p.secs) as u64,
                secs,
                throughput: mbps,
                unit: "MB/s".into(),
                fsyncs: flush.first().copied().unwrap_or(0.0) as u64,
                tool_fsync_mean_us: flush.get(1).map(|v| v * 1000.0),
                tool_fsync_max_us: flush.get(2).map(|v| v * 1000.0),
                ..Default::default()
            })
        }
        "postmark" => {
            let script = format!(
                "set location {}\nset number {}\nset transactions {}\nset size 512 16384\nrun\nquit\n",
                dir.display(),
                p.files,
                p.n
            );
            let mut c = sys::command("postmark");
            c.current_dir(dir);
            let (out, secs) = run_tool(c, Some(&script), Duration::from_secs(600))?;
            // Count every file operation postmark reports ("N created", ...).
            let count = |word: &str| -> u64 {
                out.lines()
                    .map(str::trim)
                    .find(|l| l.split_whitespace().nth(1) == Some(word))
                    .and_then(|l| l.split_whitespace().next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            let ops = count("created") + count("read") + count("appended") + count("deleted");
            if ops == 0 {
                bail!("postmark: no file counts in its output");
            }
            Ok(WorkResult {
                ops,
                secs,
                throughput: ops as f64 / secs,
                unit: "file ops/s".into(),
                notes: vec![format!(
                    "{} transactions on {} files; whole run timed (postmark's own timer has 1 s resolution)",
                    p.n, p.files
                )],
                ..Default::default()
            })
        }
        "cp-a" => {
            let src = cp_source_tree(p.files)?;
            // The source from disk, as a fresh checkout would be read (root
            // only; otherwise whatever the page cache holds). Written back
            // first: dirty pages (a tree just generated) are not dropped.
            // SAFETY: sync has no preconditions.
            unsafe { libc::sync() };
            let dropped = std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
            let mut c = sys::command("cp");
            c.arg("-a").arg(&src).arg(dir.join("copy"));
            let (_, secs) = run_tool(c, None, Duration::from_secs(600))?;
            let entries = count_entries(&dir.join("copy"))?;
            if entries < p.files as u64 {
                bail!("cp -a copied {entries} entries of at least {}", p.files);
            }
            Ok(WorkResult {
                ops: entries,
                secs,
                throughput: entries as f64 / secs,
                unit: "entries/s".into(),
                notes: vec![format!(
                    "{entries} entries ({} files); {}",
                    p.files,
                    if dropped {
                        "caches dropped before the copy"
                    } else {
                        "caches not dropped (not root)"
                    }
                )],
                ..Default::default()
            })
        }
        w => bail!("{w} is not an external workload"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_cover_the_issue() {
        let q = Scale { quick: true };
        let f = Scale { quick: false };
        assert_eq!(plan("fc-micro", f).len(), 11);
        assert_eq!(plan("fc-micro", f)[10].n, 1024);
        assert_eq!(plan("fc-micro", f)[10].files, 4096);
        assert_eq!(plan("fc-micro", f)[8].files, 1024);
        assert_eq!(plan("fc-micro", q)[0].n, 1);
        assert_eq!(
            plan("varmail-shared", f).iter().map(|p| p.threads).max(),
            Some(16)
        );
        assert_eq!(
            plan("fsmark", q)
                .iter()
                .map(|p| p.threads)
                .collect::<Vec<_>>(),
            vec![1, 4, 16]
        );
        assert_eq!(
            plan("dbench", q)
                .iter()
                .map(|p| p.threads)
                .collect::<Vec<_>>(),
            vec![1, 10]
        );
        assert_eq!(plan("cp-a", f)[0].files, 8000);
        for w in ALL {
            assert!(!plan(w, q).is_empty(), "{w}");
            assert!(!describe(w).is_empty());
        }
    }

    #[test]
    fn cp_source_tree_is_made_once_with_every_kind() {
        let base =
            std::env::temp_dir().join(format!("commitfs-cp-src-test-{}", std::process::id()));
        let t = cp_source_tree_in(&base, 130).unwrap();
        // 130 files, 6 directories besides the root, 3 symlinks.
        assert_eq!(count_entries(&t).unwrap(), 1 + 130 + 6 + 3);
        let again = cp_source_tree_in(&base, 130).unwrap();
        assert_eq!(t, again);
        let mut exec = 0;
        walk(&t, &mut |e| {
            use std::os::unix::fs::PermissionsExt;
            let m = e.metadata()?;
            if m.is_file() && m.permissions().mode() & 0o111 != 0 {
                exec += 1;
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(exec, 9, "1 in 16 files executable");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn rng_is_deterministic() {
        use rand::Rng;
        let (mut a, mut b) = (seeded(3), seeded(3));
        for _ in 0..10 {
            assert_eq!(a.gen::<u64>(), b.gen::<u64>());
        }
    }
}
