//! `commitfs bench`: commitfs beside kernel ext4 (JBD2 and fast_commit), XFS and
//! fuse2fs on the same device, with a report (`report.md`, PNG plots) and
//! machine-readable results (`results.json`); `commitfs bench compare A B` diffs
//! two runs.
//!
//! For each system: make the file system on the device, mount it, run the
//! workloads (each point: prepare, sync, snapshot the device, run, snapshot),
//! unmount, check it (`e2fsck -fn` / `xfs_repair -n`). commitfs's own journal
//! breakdown comes from a separate pass through the library (`Fs::stats`) on the
//! same device, since the FUSE daemon's counters are not reachable from outside
//! (unless `commitfs stats DIR --json` exists: then it is used too).

mod cost;
mod device;
/// The emulated device (nbdkit + latency filter); public for its own tests.
pub mod emu;
mod measure;
pub mod ops;
mod plot;
mod report;
mod results;
/// Processes, mounts and temporary paths; public for the emulated-device tests.
pub mod sys;
mod systems;
pub mod workloads;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use device::{BenchDevice, DeviceKind};
use measure::Sampler;
use ops::{Api, Lib, Posix};
use results::{CommitfsBreakdown, Cpu, JournalSplit, Results, Run, SystemOutcome, WorkloadInfo};
use systems::{Regions, SysKind, System};
use workloads::{Point, Scale};

/// `commitfs bench` arguments.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub cmd: Option<BenchCmd>,
    /// Fewer points and shorter runs (under 10 minutes on 2 cores).
    #[arg(long)]
    pub quick: bool,
    /// Systems (comma-separated): ext4, ext4-fc, xfs, fuse2fs, commitfs,
    /// commitfs-fc, commitfs-fc-csum. Default: all.
    #[arg(long, value_delimiter = ',')]
    pub systems: Vec<String>,
    /// Workloads (comma-separated): fc-micro, varmail-shared, varmail-split,
    /// fsmark, dbench, postmark, postmark-lite, cp-a, nfs-async, nfs-sync,
    /// seq-write, seq-read. Default: all but seq-write and seq-read (they need
    /// --size 3G, 6G without --quick).
    #[arg(long, value_delimiter = ',')]
    pub workloads: Vec<String>,
    /// loop (a loop device over an image file) or emulated:PROFILE
    /// (nbdkit + our latency filter; profiles none, nvme, sata-ssd, cloud).
    #[arg(long, default_value = "loop")]
    pub device: String,
    /// Device size (e.g. 2G).
    #[arg(long, default_value = "2G")]
    pub size: String,
    /// Where images and mount points go (default: the temp directory).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Skip commitfs's library pass (its own journal breakdown).
    #[arg(long)]
    pub no_library_pass: bool,
    /// Output directory for report.md, results.json and the plots.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Compare two runs (directories with results.json, or the files).
    Compare { a: PathBuf, b: PathBuf },
    /// Rewrite report.md and the plots of a run from its results.json.
    Report { dir: PathBuf },
}

pub fn run(a: BenchArgs) -> Result<()> {
    match &a.cmd {
        Some(BenchCmd::Compare { a: x, b: y }) => {
            let ra = report::load(x)?;
            let rb = report::load(y)?;
            print!("{}", report::compare(&ra, &rb, x, y));
            return Ok(());
        }
        Some(BenchCmd::Report { dir }) => {
            let r = report::load(dir)?;
            let plots = plot::all(&r, dir);
            std::fs::write(dir.join("report.md"), report::markdown(&r, &plots))?;
            eprintln!(
                "commitfs bench: rewrote {}",
                dir.join("report.md").display()
            );
            return Ok(());
        }
        None => {}
    }
    let out = a
        .out
        .clone()
        .ok_or_else(|| anyhow!("--out DIR is required (or use `bench compare A B`)"))?;
    let kind = DeviceKind::parse(&a.device)?;
    let size = commitfs_device::size::parse_size(&a.size)?;
    let all = systems::all_systems();
    let selected: Vec<System> = if a.systems.is_empty() {
        all.clone()
    } else {
        let mut v = Vec::new();
        for id in &a.systems {
            let s = all.iter().find(|s| &s.id == id).ok_or_else(|| {
                let ids: Vec<&str> = all.iter().map(|s| s.id.as_str()).collect();
                anyhow!("unknown system {id:?} (known: {})", ids.join(", "))
            })?;
            v.push(s.clone());
        }
        v
    };
    let wl: Vec<String> = if a.workloads.is_empty() {
        workloads::default_set()
    } else {
        for w in &a.workloads {
            if !workloads::ALL.contains(&w.as_str()) {
                bail!(
                    "unknown workload {w:?} (known: {})",
                    workloads::ALL.join(", ")
                );
            }
        }
        a.workloads.clone()
    };
    device::preflight(&kind)?;
    std::fs::create_dir_all(&out).with_context(|| format!("--out {}", out.display()))?;
    sys::install_signal_cleanup();
    let work_root = a.work_dir.clone().unwrap_or_else(std::env::temp_dir);
    let work = sys::TempPath::new(work_root.join(format!("commitfs-bench-{}", std::process::id())));
    std::fs::create_dir_all(&work.path)?;

    let scale = Scale { quick: a.quick };
    let mut bench = Bench {
        scale,
        bin: std::env::current_exe().context("locating the commitfs binary")?,
        work: work.path.clone(),
        results: Results {
            schema: results::SCHEMA,
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            quick: a.quick,
            command: std::env::args().collect::<Vec<_>>().join(" "),
            machine: report::machine_info(),
            versions: report::versions(),
            price_model: Default::default(),
            ..Default::default()
        },
        pb: ProgressBar::hidden(),
        stats_cmd: false,
    };
    let (commit, dirty) = report::git_info();
    bench.results.git_commit = commit;
    bench.results.git_dirty = dirty;
    bench.stats_cmd = sys::command(&bench.bin)
        .args(["stats", "--help"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);

    // The work list, for the progress bar.
    let lib_pass = !a.no_library_pass;
    let mut total = 0u64;
    for s in &selected {
        for w in &wl {
            let n = workloads::plan(w, scale).len() as u64;
            total += n;
            if lib_pass && matches!(s.kind, SysKind::Commitfs(_)) && workloads::builtin(w) {
                total += n;
            }
        }
    }
    bench.pb = progress(total);
    let t0 = Instant::now();
    bench.say(&format!(
        "commitfs bench: {} systems x {} workloads on {} ({}), output in {}",
        selected.len(),
        wl.len(),
        kind.label(),
        a.size,
        out.display()
    ));
    bench.workload_info(&wl);

    let dev = BenchDevice::create(&kind, size, &work.path)
        .with_context(|| format!("preparing the {} device", kind.label()))?;
    bench.results.device = Some(dev.info());
    bench.say(&format!("device: {}", dev.dev.display()));
    for s in &all {
        if !selected.iter().any(|x| x.id == s.id) {
            bench.results.systems.push(SystemOutcome {
                id: s.id.clone(),
                label: s.label.clone(),
                status: "not selected".into(),
                message: "not in --systems".into(),
                ..Default::default()
            });
        }
    }
    for s in &selected {
        bench.system(s, &dev, &wl, lib_pass);
    }
    dev.stop();
    bench.pb.finish_and_clear();
    bench.results.duration_secs = t0.elapsed().as_secs_f64();
    bench.finish_costs();
    bench.add_notes(&kind);
    let r = &bench.results;
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(r)?)?;
    let plots = plot::all(r, &out);
    std::fs::write(out.join("report.md"), report::markdown(r, &plots))?;
    eprintln!(
        "commitfs bench: done in {:.0} s: {}, {} and {} plots",
        r.duration_secs,
        out.join("report.md").display(),
        out.join("results.json").display(),
        plots.iter().filter(|p| p.ok).count()
    );
    for p in plots.iter().filter(|p| !p.ok) {
        eprintln!("commitfs bench: plot {}: {}", p.file, p.message);
    }
    drop(work);
    Ok(())
}

fn progress(total: u64) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.enable_steady_tick(Duration::from_millis(250));
    pb
}

struct Bench {
    scale: Scale,
    bin: PathBuf,
    work: PathBuf,
    results: Results,
    pb: ProgressBar,
    /// Does `commitfs stats` exist in this build?
    stats_cmd: bool,
}

/// Where a point runs.
enum Target<'a> {
    Mount { dir: &'a Path, fs_pid: Option<u32> },
    Library(&'a commitfs_fs::Fs),
}

impl Bench {
    fn say(&self, msg: &str) {
        if self.pb.is_hidden() {
            eprintln!("{msg}");
        } else {
            self.pb.println(msg);
        }
    }

    fn workload_info(&mut self, wl: &[String]) {
        for w in wl {
            let how = match w.as_str() {
                "fsmark" | "dbench" => match workloads::external_available(w) {
                    Ok(()) => format!(
                        "{} {}",
                        if w == "fsmark" { "fs_mark" } else { "dbench" },
                        self.results
                            .versions
                            .get(if w == "fsmark" { "fsmark" } else { "dbench" })
                            .cloned()
                            .unwrap_or_default()
                    ),
                    Err(e) => format!("not run: {e}"),
                },
                "postmark" => {
                    if sys::have("postmark") {
                        format!(
                            "postmark {}",
                            self.results
                                .versions
                                .get("postmark")
                                .cloned()
                                .unwrap_or_default()
                        )
                    } else {
                        "built-in postmark-like workload (postmark not installed)".into()
                    }
                }
                "cp-a" => "cp -a (coreutils)".into(),
                _ => "built-in".into(),
            };
            self.results.workloads.push(WorkloadInfo {
                id: w.clone(),
                description: workloads::describe(w).into(),
                how,
            });
        }
    }

    /// Everything for one system; failures are recorded, never fatal.
    fn system(&mut self, s: &System, dev: &BenchDevice, wl: &[String], lib_pass: bool) {
        let t = Instant::now();
        let npoints: u64 = wl
            .iter()
            .map(|w| {
                let n = workloads::plan(w, self.scale).len() as u64;
                if lib_pass && matches!(s.kind, SysKind::Commitfs(_)) && workloads::builtin(w) {
                    2 * n
                } else {
                    n
                }
            })
            .sum();
        let pos0 = self.pb.position();
        let mut outcome = SystemOutcome {
            id: s.id.clone(),
            label: s.label.clone(),
            mkfs: s.mkfs_desc(),
            mount: s.mount_desc(),
            ..Default::default()
        };
        if let Err(e) = s.available() {
            self.say(&format!("- {}: missing: {e}", s.label));
            outcome.status = "missing".into();
            outcome.message = e.to_string();
            self.results.systems.push(outcome);
            self.pb.set_position(pos0 + npoints);
            return;
        }
        self.say(&format!("- {}", s.label));
        let r = self.system_inner(s, dev, wl, &mut outcome);
        let r = r.and_then(|()| {
            if lib_pass && matches!(s.kind, SysKind::Commitfs(_)) {
                self.library_pass(s, dev, wl, &mut outcome)
            } else {
                Ok(())
            }
        });
        match r {
            Ok(()) => {
                outcome.status = "ok".into();
                let failed = self
                    .results
                    .runs
                    .iter()
                    .filter(|r| r.system == s.id && !r.ok())
                    .count();
                if failed > 0 {
                    outcome.message = format!("{failed} point(s) failed (see the runs)");
                }
            }
            Err(e) => {
                self.say(&format!("  x {} failed: {e:#}", s.label));
                outcome.status = "failed".into();
                outcome.message = format!("{e:#}");
            }
        }
        outcome.secs = t.elapsed().as_secs_f64();
        self.results.systems.push(outcome);
        self.pb.set_position(pos0 + npoints);
    }

    fn system_inner(
        &mut self,
        s: &System,
        dev: &BenchDevice,
        wl: &[String],
        outcome: &mut SystemOutcome,
    ) -> Result<()> {
        self.pb.set_message(format!("{}: mkfs", s.id));
        s.mkfs(&dev.dev).context("mkfs")?;
        let regions = if dev.has_trace() {
            match s.regions(&dev.dev) {
                Ok(r) => Some(r),
                Err(e) => {
                    outcome
                        .notes
                        .push(format!("journal location unknown ({e}): no journal split"));
                    None
                }
            }
        } else {
            None
        };
        self.pb.set_message(format!("{}: mount", s.id));
        let mnt = self.work.join(format!("mnt-{}", s.id));
        let mounted = s.mount(&dev.dev, &mnt, &self.bin).context("mount")?;
        let mut result = Ok(());
        for w in wl {
            let points = workloads::plan(w, self.scale);
            if let Err(e) = workloads::external_available(w) {
                for p in &points {
                    self.push_failed(s, "mount", p, &e.to_string());
                    self.pb.inc(1);
                }
                continue;
            }
            for p in points {
                let mut p = p;
                if p.workload == "postmark" && !sys::have("postmark") {
                    p.workload = "postmark-lite".into();
                }
                self.pb
                    .set_message(format!("{}: {} {}", s.id, w, p.variant));
                let target = Target::Mount {
                    dir: &mounted.dir,
                    fs_pid: mounted.daemon_pid.or(mounted.kthread_pid),
                };
                let mut run = self.point(s, dev, &target, &p, regions.as_ref());
                run.workload = w.clone();
                if let Some(e) = &run.error {
                    self.say(&format!("  x {} {} {}: {e}", s.id, w, p.variant));
                }
                self.results.runs.push(run);
                self.pb.inc(1);
                if !sys::is_mounted(&mounted.dir) {
                    result = Err(anyhow!(
                        "{} is no longer mounted (daemon died?)",
                        mnt.display()
                    ));
                    break;
                }
            }
            if result.is_err() {
                break;
            }
        }
        self.pb.set_message(format!("{}: unmount", s.id));
        let u = mounted.unmount();
        result?;
        u.context("unmount")?;
        self.pb.set_message(format!("{}: check", s.id));
        outcome.fsck = match s.check(&dev.dev) {
            Ok(m) => m,
            Err(e) => bail!("after the run: {e}"),
        };
        let mine = || {
            self.results
                .runs
                .iter()
                .filter(|r| r.system == s.id && r.ok())
        };
        if let SysKind::Commitfs(m) = &s.kind {
            if m.expects_fast_commit {
                let traced: u64 = mine().filter_map(|r| r.journal.map(|j| j.fc_writes)).sum();
                let own: u64 = mine()
                    .filter_map(|r| r.commitfs.as_ref().map(|c| c.fc_writes))
                    .sum();
                let known = dev.has_trace() || mine().any(|r| r.commitfs.is_some());
                if known && traced + own == 0 {
                    outcome.notes.push(
                        "no fast-commit block was written: this build does not write fast commits (it ran as JBD2)".into(),
                    );
                }
            }
        }
        if dev.has_trace() && regions.is_some() {
            let j: u64 = mine()
                .filter_map(|r| r.journal.map(|j| j.journal_writes + j.fc_writes))
                .sum();
            if j == 0 && mine().count() > 0 {
                outcome.notes.push(
                    "no write reached the journal area during the runs: this system wrote metadata in place without journaling".into(),
                );
            }
        }
        Ok(())
    }

    /// commitfs through the library on the same device: its own breakdown.
    fn library_pass(
        &mut self,
        s: &System,
        dev: &BenchDevice,
        wl: &[String],
        outcome: &mut SystemOutcome,
    ) -> Result<()> {
        let SysKind::Commitfs(mode) = &s.kind else {
            return Ok(());
        };
        self.pb.set_message(format!("{} (library): mkfs", s.id));
        s.mkfs(&dev.dev).context("library pass: mkfs")?;
        let regions = if dev.has_trace() {
            s.regions(&dev.dev).ok()
        } else {
            None
        };
        let d: commitfs_device::DeviceRef = Arc::new(
            commitfs_device::FileDevice::open(&dev.dev, false)
                .map_err(|e| anyhow!("library pass: open {}: {e}", dev.dev.display()))?,
        );
        // The journal modes of the mount's options (COMMITFS_BENCH_MOUNT_OPTS
        // included), so that the library pass measures the same journal.
        let all = systems::commitfs_opts(mode.mount_opts);
        let has = |name: &str| all.split(',').any(|o| o == name);
        let mut opts = commitfs_fs::MountOptions {
            fast_commit: !has("nofast_commit"),
            fc_data_csum: has("fc_data_csum"),
            data_order: if has("data_order=file") {
                commitfs_fs::DataOrder::File
            } else {
                commitfs_fs::DataOrder::Prefix
            },
            ..Default::default()
        };
        for (k, v) in all.split(',').filter_map(|o| o.split_once('=')) {
            opts.pipeline
                .set(k, v)
                .map_err(|e| anyhow!("library pass: {e}"))?;
        }
        let fs = commitfs_fs::Fs::open(d, opts).map_err(|e| anyhow!("library pass: mount: {e}"))?;
        for w in wl.iter().filter(|w| workloads::builtin(w)) {
            for p in workloads::plan(w, self.scale) {
                self.pb
                    .set_message(format!("{} (library): {} {}", s.id, w, p.variant));
                let run = self.point(s, dev, &Target::Library(&fs), &p, regions.as_ref());
                if let Some(e) = &run.error {
                    self.say(&format!("  x {} (library) {} {}: {e}", s.id, w, p.variant));
                }
                self.results.runs.push(run);
                self.pb.inc(1);
            }
        }
        fs.unmount()
            .map_err(|e| anyhow!("library pass: unmount: {e}"))?;
        drop(fs);
        match s.check(&dev.dev) {
            Ok(m) => outcome.notes.push(format!("library pass: {m}")),
            Err(e) => bail!("library pass, after the run: {e}"),
        }
        Ok(())
    }

    fn push_failed(&mut self, s: &System, pass: &str, p: &Point, msg: &str) {
        self.results.runs.push(Run {
            system: s.id.clone(),
            pass: pass.into(),
            workload: p.workload.clone(),
            variant: p.variant.clone(),
            x: p.x,
            error: Some(msg.into()),
            ..Default::default()
        });
    }

    /// Prepare, sync, snapshot, run, snapshot.
    fn point(
        &self,
        s: &System,
        dev: &BenchDevice,
        target: &Target,
        p: &Point,
        regions: Option<&Regions>,
    ) -> Run {
        let mut run = Run {
            system: s.id.clone(),
            pass: match target {
                Target::Mount { .. } => "mount".into(),
                Target::Library(_) => "library".into(),
            },
            workload: p.workload.clone(),
            variant: p.variant.clone(),
            x: p.x,
            ..Default::default()
        };
        if let Err(e) = self.point_inner(dev, target, p, regions, &mut run) {
            run.error = Some(format!("{e:#}"));
        }
        run
    }

    fn point_inner(
        &self,
        dev: &BenchDevice,
        target: &Target,
        p: &Point,
        regions: Option<&Regions>,
        run: &mut Run,
    ) -> Result<()> {
        let tag = format!("{}", self.results.runs.len());
        let posix;
        let lib;
        let api: &dyn Api = match target {
            Target::Mount { dir, .. } => {
                posix = Posix {
                    root: dir.to_path_buf(),
                };
                &posix
            }
            Target::Library(fs) => {
                lib = Lib::new(fs);
                &lib
            }
        };
        let external = !workloads::builtin(&p.workload);
        // Prepare (not measured), then make everything durable and let the
        // device settle so the window holds only this point's I/O.
        let (prepared, ext_dir) = if external {
            let Target::Mount { dir, .. } = target else {
                bail!("external tools need a mount");
            };
            (None, Some(workloads::prepare_external(dir, p, &tag)?))
        } else {
            (Some(workloads::prepare(api, p, &tag)?), None)
        };
        api.sync()
            .map_err(|e| anyhow!("sync before the run: {e}"))?;
        if let Some(d) = &ext_dir {
            let _ = std::fs::File::open(d).and_then(|f| f.sync_all());
        } else {
            let _ = api.fsync_dir("");
        }
        std::thread::sleep(Duration::from_millis(200));
        let stats0 = self.fs_stats(target);
        let fs_pid = match target {
            Target::Mount { fs_pid, .. } => *fs_pid,
            Target::Library(_) => None,
        };
        let cpu0 = fs_pid.and_then(measure::proc_cpu_secs);
        let app0 = measure::rusage_secs(external);
        let c0 = dev.counters()?;
        let sampler = Sampler::start(dev);
        let res = match (prepared, &ext_dir) {
            (Some(prep), _) => workloads::execute(api, p, prep),
            (None, Some(d)) => workloads::execute_external(p, d),
            _ => Err(anyhow!("nothing to run")),
        };
        let peak = sampler.finish();
        let c1 = dev.counters()?;
        let app1 = measure::rusage_secs(external);
        let cpu1 = fs_pid.and_then(measure::proc_cpu_secs);
        let stats1 = self.fs_stats(target);
        if let Target::Mount { dir, .. } = target {
            run.null_rt_us = measure::null_round_trip_us(dir);
        }
        run.result = res?;
        run.device = c1.delta(&c0);
        run.peak = peak;
        run.cpu = Cpu {
            app_secs: app1 - app0,
            fs_secs: match (cpu0, cpu1) {
                (Some(a), Some(b)) => Some(b - a),
                _ => None,
            },
        };
        if let (Some(r), Some(tr)) = (regions, dev.trace(&c0, &c1)) {
            run.journal = Some(split(r, &tr));
        }
        match (stats0, stats1) {
            (Some(FsStats::Lib(a)), Some(FsStats::Lib(b))) => {
                run.commitfs = Some(breakdown(&a, &b));
            }
            (Some(FsStats::Json(a)), Some(FsStats::Json(b))) => {
                let mut d = json_delta(&a, &b);
                rederive(&mut d, &b);
                run.commitfs = breakdown_from_json(&d);
                run.commitfs_stats = Some(d);
            }
            _ => {}
        }
        Ok(())
    }

    fn fs_stats(&self, target: &Target) -> Option<FsStats> {
        match target {
            Target::Library(fs) => Some(FsStats::Lib(Box::new(fs.stats()))),
            Target::Mount { dir, .. } if self.stats_cmd => {
                let out = sys::command(&self.bin)
                    .arg("stats")
                    .arg(dir)
                    .arg("--json")
                    .output()
                    .ok()?;
                if !out.status.success() {
                    return None;
                }
                serde_json::from_slice(&out.stdout).ok().map(FsStats::Json)
            }
            _ => None,
        }
    }

    /// Cost of each run (measured bill, and per 1,000 application ops/s).
    fn finish_costs(&mut self) {
        let pm = self.results.price_model.clone();
        for r in self.results.runs.iter_mut().filter(|r| r.error.is_none()) {
            r.cost = pm.estimate(r.peak.p95_iops, r.peak.p95_mbps, r.result.throughput);
        }
        // Report order of systems.
        let order: Vec<String> = systems::all_systems().into_iter().map(|s| s.id).collect();
        self.results
            .systems
            .sort_by_key(|s| order.iter().position(|o| *o == s.id).unwrap_or(usize::MAX));
    }

    fn add_notes(&mut self, kind: &DeviceKind) {
        let n = &mut self.results.notes;
        n.push(format!(
            "Device counters come from the device ({}), never from the system under test.",
            self.results
                .device
                .as_ref()
                .map(|d| d.counters_from.clone())
                .unwrap_or_default()
        ));
        n.push("The loop device has a volatile write cache but no FUA support: the block layer turns each FUA write into write + flush, so FUA counts are 0 and flushes include those post-flushes, for every system alike.".into());
        if *kind == DeviceKind::Loop {
            n.push("Loop device: a flush costs an fdatasync of the image file on this VM's shared virtual disk: cheap at the median, with long and erratic tails, so journaling's flush cost is mostly hidden and latencies are noisy; use --device emulated:sata-ssd for a device with a realistic, steady flush cost.".into());
            n.push("Journal split by disk region needs the emulated device's request trace; on the loop device only commitfs's library pass gives a journal breakdown.".into());
        }
        if !self.stats_cmd {
            n.push("`commitfs stats DIR --json` does not exist in this build: commitfs's journal breakdown is measured through the library (`Fs::stats`) on the same device in a separate pass (rows marked 'library').".into());
        }
        n.push("fc-micro on the kernel file systems: data of files that were never fsynced may still be in the page cache at the end of the window (delayed allocation), while commitfs writes file data at write() time; device bytes per fsync include that difference.".into());
        n.push("Other engineers' builds and tests may run on this 2-core machine at the same time; throughput and latency are noisy, device counts are not.".into());
    }
}

enum FsStats {
    Lib(Box<commitfs_fs::Stats>),
    Json(serde_json::Value),
}

fn split(r: &Regions, tr: &[emu::TraceRec]) -> JournalSplit {
    let mut j = JournalSplit::default();
    for t in tr {
        match t.op {
            emu::OP_WRITE | 5 => {
                let b = t.count as u64;
                if r.in_fast_commit(t.offset) {
                    j.fc_writes += 1;
                    j.fc_bytes += b;
                } else if r.in_journal(t.offset) {
                    j.journal_writes += 1;
                    j.journal_bytes += b;
                } else {
                    j.other_writes += 1;
                    j.other_bytes += b;
                }
                if t.fua {
                    j.fua_writes += 1;
                }
            }
            emu::OP_FLUSH => j.flushes += 1,
            _ => {}
        }
    }
    j
}

fn breakdown(a: &commitfs_fs::Stats, b: &commitfs_fs::Stats) -> CommitfsBreakdown {
    let d = |x: u64, y: u64| y.saturating_sub(x);
    let (ad, bd) = (&a.device, &b.device);
    CommitfsBreakdown {
        journal_mode: b.journal_mode.to_string(),
        data_writes: d(ad.data.writes, bd.data.writes),
        data_bytes: d(ad.data.write_bytes, bd.data.write_bytes),
        metadata_writes: d(ad.metadata.writes, bd.metadata.writes),
        metadata_bytes: d(ad.metadata.write_bytes, bd.metadata.write_bytes),
        journal_writes: d(ad.journal.writes, bd.journal.writes),
        journal_bytes: d(ad.journal.write_bytes, bd.journal.write_bytes),
        fc_writes: d(ad.fast_commit.writes, bd.fast_commit.writes),
        fc_bytes: d(ad.fast_commit.write_bytes, bd.fast_commit.write_bytes),
        fua_writes: d(ad.total_fua(), bd.total_fua()),
        flushes: d(ad.flushes, bd.flushes),
        commits: d(a.journal.commits, b.journal.commits),
        log_blocks: d(a.journal.log_blocks, b.journal.log_blocks),
        checkpoints: d(a.journal.checkpoints, b.journal.checkpoints),
        revokes: d(a.journal.revokes, b.journal.revokes),
        handles: d(a.journal.handles, b.journal.handles),
        fc_commits: 0,
        source: "Fs::stats (library)".into(),
    }
}

/// The same breakdown from `commitfs stats --json` deltas (through the mount).
fn breakdown_from_json(d: &serde_json::Value) -> Option<CommitfsBreakdown> {
    let u = |path: &[&str]| -> u64 {
        let mut v = d;
        for k in path {
            v = match v.get(k) {
                Some(x) => x,
                None => return 0,
            };
        }
        v.as_i64().map(|x| x.max(0) as u64).unwrap_or(0)
    };
    d.get("journal")?;
    Some(CommitfsBreakdown {
        journal_mode: d
            .get("journal_mode")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string(),
        data_writes: u(&["device", "data", "writes"]),
        data_bytes: u(&["device", "data", "write_bytes"]),
        metadata_writes: u(&["device", "metadata", "writes"]),
        metadata_bytes: u(&["device", "metadata", "write_bytes"]),
        journal_writes: u(&["device", "journal", "writes"]),
        journal_bytes: u(&["device", "journal", "write_bytes"]),
        fc_writes: u(&["device", "fast_commit", "writes"]),
        fc_bytes: u(&["device", "fast_commit", "write_bytes"]),
        fua_writes: u(&["fua_writes"]),
        flushes: u(&["flushes"]),
        commits: u(&["journal", "commits"]),
        fc_commits: u(&["fast_commit", "commits"]),
        log_blocks: u(&["journal", "log_blocks"]),
        checkpoints: u(&["journal", "checkpoints"]),
        revokes: u(&["journal", "revokes"]),
        handles: u(&["journal", "handles"]),
        source: "commitfs stats (mount)".into(),
    })
}

trait TotalFua {
    fn total_fua(&self) -> u64;
}

impl TotalFua for commitfs_device::StatsSnapshot {
    fn total_fua(&self) -> u64 {
        self.data.fua_writes
            + self.metadata.fua_writes
            + self.journal.fua_writes
            + self.fast_commit.fua_writes
    }
}

/// Numeric leaves of `b - a` (other leaves taken from `b`).
fn json_delta(a: &serde_json::Value, b: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => Value::Object(
            y.iter()
                .map(|(k, v)| {
                    let d = match x.get(k) {
                        Some(u) => json_delta(u, v),
                        None => v.clone(),
                    };
                    (k.clone(), d)
                })
                .collect(),
        ),
        (Value::Number(x), Value::Number(y)) => match (x.as_u64(), y.as_u64()) {
            (Some(p), Some(q)) => Value::from(q.wrapping_sub(p) as i64),
            _ => Value::from(y.as_f64().unwrap_or(0.0) - x.as_f64().unwrap_or(0.0)),
        },
        _ => b.clone(),
    }
}

/// After [`json_delta`] of two `commitfs stats --json` snapshots: averages
/// and ratios recomputed from the interval's sums and counts (their own
/// difference means nothing), gauges and maxima taken from the later
/// snapshot (`after`; they are since mount).
fn rederive(d: &mut serde_json::Value, after: &serde_json::Value) {
    use serde_json::Value;
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    if let Some(fr) = d.get_mut("fuse_requests").and_then(Value::as_object_mut) {
        for v in fr.values_mut() {
            let m = ratio(num(v, "total_us"), num(v, "count"));
            v["mean_us"] = Value::from(m);
        }
    }
    let fsyncs = d["journal"]["fsyncs"].as_f64().unwrap_or(0.0);
    let flushes = num(d, "flushes");
    let Some(j) = d.get_mut("journal").filter(|j| j.is_object()) else {
        return;
    };
    let t = j["totals"].clone();
    let commits = num(j, "commits");
    j["avg_durability_wait_us"] = Value::from(ratio(
        num(&t, "durability_wait_us"),
        num(j, "durability_waits"),
    ));
    j["commit_phases_us"] = serde_json::json!({
        "batch": ratio(num(&t, "batch_us"), commits),
        "lock": ratio(num(&t, "lock_us"), commits),
        "log_write": ratio(num(&t, "log_write_us"), commits),
        "to_durable": ratio(num(&t, "to_durable_us"), commits),
    });
    j["commits_per_flush"] = Value::from(ratio(
        num(&t, "commits_by_flush"),
        num(&t, "commit_flushes"),
    ));
    j["handles_per_commit"] = Value::from(ratio(num(&t, "commit_handles"), commits));
    j["flushes_per_fsync"] = Value::from(ratio(flushes, fsyncs));
    for k in [
        "in_flight",
        "max_in_flight",
        "max_commits_per_flush",
        "avg_flush_us",
    ] {
        j[k] = after["journal"][k].clone();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--help` names every system, workload and device profile the bench
    /// accepts (the lists are written out by hand in the doc comments).
    #[test]
    fn help_names_every_system_workload_and_profile() {
        use clap::CommandFactory;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: BenchArgs,
        }
        let help = Cli::command().render_long_help().to_string();
        let words: std::collections::HashSet<&str> = help
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .collect();
        let mut missing = Vec::new();
        for s in systems::all_systems() {
            if !words.contains(s.id.as_str()) {
                missing.push(s.id);
            }
        }
        for w in workloads::ALL {
            if !words.contains(w) {
                missing.push(w.to_string());
            }
        }
        for p in emu::profiles() {
            if !words.contains(p.name.as_str()) {
                missing.push(p.name);
            }
        }
        assert!(missing.is_empty(), "not in --help: {missing:?}\n{help}");
    }

    /// Averages of an interval come from its sums, not from the difference
    /// of two averages; maxima are the later snapshot's.
    #[test]
    fn stats_deltas_rederive_averages() {
        let snap = |waits: u64, wait_us: u64, commits: u64, batch_us: u64, maxf: u64| {
            serde_json::json!({
                "flushes": commits,
                "fuse_requests": { "lookup": { "count": waits, "total_us": wait_us, "mean_us": 0.0 } },
                "journal": {
                    "commits": commits, "fsyncs": waits, "durability_waits": waits,
                    "avg_durability_wait_us": 0.0, "max_in_flight": maxf,
                    "totals": { "durability_wait_us": wait_us, "batch_us": batch_us,
                                "commit_flushes": commits, "commits_by_flush": commits }
                }
            })
        };
        let a = snap(10, 1_000, 5, 500, 2);
        let b = snap(30, 7_000, 15, 2_500, 3);
        let mut d = json_delta(&a, &b);
        rederive(&mut d, &b);
        assert_eq!(d["journal"]["avg_durability_wait_us"], 300.0);
        assert_eq!(d["journal"]["commit_phases_us"]["batch"], 200.0);
        assert_eq!(d["journal"]["max_in_flight"], 3);
        assert_eq!(d["journal"]["commits_per_flush"], 1.0);
        assert_eq!(d["journal"]["flushes_per_fsync"], 0.5);
        assert_eq!(d["fuse_requests"]["lookup"]["mean_us"], 300.0);
    }

    #[test]
    fn journal_split_by_region() {
        let r = Regions {
            journal: vec![(1000, 2000)],
            fast_commit: vec![(1800, 2000)],
        };
        let rec = |op, offset, count| emu::TraceRec {
            t_ns: 0,
            offset,
            count,
            op,
            fua: false,
        };
        let tr = vec![
            rec(emu::OP_WRITE, 1000, 100),
            rec(emu::OP_WRITE, 1900, 50),
            rec(emu::OP_WRITE, 5000, 4096),
            rec(emu::OP_FLUSH, 0, 0),
            rec(emu::OP_READ, 1000, 4096),
        ];
        let j = split(&r, &tr);
        assert_eq!((j.journal_writes, j.journal_bytes), (1, 100));
        assert_eq!((j.fc_writes, j.fc_bytes), (1, 50));
        assert_eq!((j.other_writes, j.other_bytes), (1, 4096));
        assert_eq!(j.flushes, 1);
    }

    #[test]
    fn json_delta_subtracts_numbers() {
        let a = serde_json::json!({"journal": {"commits": 3, "mode": "x"}, "n": 1.5});
        let b = serde_json::json!({"journal": {"commits": 10, "mode": "y"}, "n": 2.0});
        let d = json_delta(&a, &b);
        assert_eq!(d["journal"]["commits"], 7);
        assert_eq!(d["journal"]["mode"], "y");
        assert_eq!(d["n"], 0.5);
    }

    #[test]
    fn device_kinds_parse() {
        assert_eq!(DeviceKind::parse("loop").unwrap(), DeviceKind::Loop);
        assert_eq!(
            DeviceKind::parse("emulated:sata-ssd").unwrap(),
            DeviceKind::Emulated("sata-ssd".into())
        );
        assert!(DeviceKind::parse("emulated:floppy").is_err());
    }
}
