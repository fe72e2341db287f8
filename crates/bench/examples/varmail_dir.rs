//! Profiling aid (not a test): the bench's varmail flow on an emulated device,
//! long enough for a profiler to watch the file system.
//!
//!   cargo run --release -p commitfs-bench --example varmail_dir -- \
//!       SYSTEM(commitfs-fc|commitfs|ext4|ext4-fc) [THREADS] [SECS] [split] [PROFILE]
//!
//! Prints `ready PID` (the commitfs daemon, or 0) before the measured run.
use std::time::Duration;

use anyhow::{bail, Result};
use commitfs_bench::emu::{profile, Emulated};
use commitfs_bench::ops::{Api, Fh, Posix};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Time per operation kind (ns, count), to see where a run's time goes.
struct Timed<'a> {
    a: Box<dyn Api + 'a>,
    t: [(AtomicU64, AtomicU64); 10],
}
const NAMES: [&str; 10] = [
    "mkdir",
    "create",
    "open",
    "append",
    "read_all",
    "fsync",
    "close",
    "unlink",
    "fsync_dir",
    "sync",
];
impl Timed<'_> {
    fn time<T>(&self, k: usize, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let r = f();
        self.t[k]
            .0
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.t[k].1.fetch_add(1, Ordering::Relaxed);
        r
    }
    fn report(&self) {
        for (i, n) in NAMES.iter().enumerate() {
            let (ns, c) = (
                self.t[i].0.load(Ordering::Relaxed),
                self.t[i].1.load(Ordering::Relaxed),
            );
            if c > 0 {
                println!(
                    "  {n:10} {c:8} calls, mean {:8.0} us",
                    ns as f64 / c as f64 / 1000.0
                );
            }
        }
    }
}
impl Api for Timed<'_> {
    fn mkdir(&self, rel: &str) -> io::Result<()> {
        self.time(0, || self.a.mkdir(rel))
    }
    fn create(&self, rel: &str) -> io::Result<Fh> {
        self.time(1, || self.a.create(rel))
    }
    fn open(&self, rel: &str, w: bool) -> io::Result<Fh> {
        self.time(2, || self.a.open(rel, w))
    }
    fn append(&self, f: &mut Fh, d: &[u8]) -> io::Result<()> {
        self.time(3, || self.a.append(f, d))
    }
    fn read_all(&self, f: &mut Fh, b: &mut [u8]) -> io::Result<u64> {
        self.time(4, || self.a.read_all(f, b))
    }
    fn fsync(&self, f: &mut Fh) -> io::Result<()> {
        self.time(5, || self.a.fsync(f))
    }
    fn close(&self, f: Fh) -> io::Result<()> {
        self.time(6, || self.a.close(f))
    }
    fn unlink(&self, rel: &str) -> io::Result<()> {
        self.time(7, || self.a.unlink(rel))
    }
    fn fsync_dir(&self, rel: &str) -> io::Result<()> {
        self.time(8, || self.a.fsync_dir(rel))
    }
    fn sync(&self) -> io::Result<()> {
        self.time(9, || self.a.sync())
    }
}
use commitfs_bench::sys;
use commitfs_bench::workloads::{execute, plan, prepare, Scale};

fn main() -> Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let system = a.get(1).cloned().unwrap_or_else(|| "commitfs-fc".into());
    let threads: usize = a.get(2).map(|s| s.parse()).transpose()?.unwrap_or(16);
    let secs: f64 = a.get(3).map(|s| s.parse()).transpose()?.unwrap_or(10.0);
    let w = match a.get(4).map(|s| s.as_str()) {
        Some("split") => "varmail-split",
        Some("fsmark") => "fsmark",
        _ => "varmail-shared",
    };
    let prof = profile(a.get(5).map(|s| s.as_str()).unwrap_or("sata-ssd"))?;
    let work = std::path::PathBuf::from("/work/prof");
    std::fs::create_dir_all(work.join("mnt"))?;
    let emu = Emulated::start(&prof, 2 << 30, &work, 0)?;
    let dev = emu.dev.to_string_lossy().to_string();
    let fc = system.ends_with("-fc");
    sys::run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-O",
            if fc { "fast_commit" } else { "^fast_commit" },
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            &dev,
        ],
    )?;
    let mnt = work.join("mnt");
    let m = mnt.to_string_lossy().to_string();
    let bin = std::env::var("COMMITFS_BIN").unwrap_or("/work/main/target/release/commitfs".into());
    let pidf = work.join("daemon.pid");
    match system.as_str() {
        "commitfs-fc" | "commitfs" => {
            let o = if fc { "fast_commit" } else { "nofast_commit" };
            let pf = pidf.to_string_lossy().to_string();
            let extra = std::env::var("MOUNT_OPTS").unwrap_or_default();
            let o = if extra.is_empty() {
                o.to_string()
            } else {
                format!("{o},{extra}")
            };
            sys::run(&bin, &["mount", "--pid-file", &pf, "-o", &o, &dev, &m])?;
        }
        "lib" | "lib-fc" => {}
        "ext4" | "ext4-fc" => {
            sys::run("mount", &["-t", "ext4", &dev, &m])?;
        }
        s => bail!("unknown system {s}"),
    }
    let pid = std::fs::read_to_string(&pidf).unwrap_or_else(|_| "0".into());
    let mut p = plan(w, Scale { quick: true }).pop().unwrap();
    p.threads = threads;
    p.secs = secs;
    let lib = if system.starts_with("lib") {
        let d: commitfs_device::DeviceRef = std::sync::Arc::new(commitfs_device::FileDevice::open(
            std::path::Path::new(&dev),
            false,
        )?);
        let opts = commitfs_fs::MountOptions {
            fast_commit: fc,
            ..Default::default()
        };
        Some(commitfs_fs::Fs::open(d, opts)?)
    } else {
        None
    };
    let api = Timed {
        a: match &lib {
            Some(fs) => Box::new(commitfs_bench::ops::Lib::new(fs)),
            None => Box::new(Posix { root: mnt.clone() }),
        },
        t: Default::default(),
    };
    if w == "fsmark" {
        p.n = (secs as usize * 50).max(16);
        let d = commitfs_bench::workloads::prepare_external(&mnt, &p, "prof")?;
        sys::run("sync", &[])?;
        println!("ready {}", pid.trim());
        let r = commitfs_bench::workloads::execute_external(&p, &d);
        if system.starts_with("commitfs") {
            if let Ok(o) = sys::run(&bin, &["stats", &m]) {
                println!("{o}");
            }
            let _ = sys::run(&bin, &["umount", &m]);
        } else {
            let _ = sys::run("umount", &[&m]);
        }
        drop(emu);
        let r = r?;
        println!(
            "{system} fsmark t={threads}: {:.0} files/s ({} files)",
            r.throughput, r.ops
        );
        return Ok(());
    }
    let r = (|| {
        let prep = prepare(&api, &p, "prof")?;
        sys::run("sync", &[])?;
        println!("ready {}", pid.trim());
        std::thread::sleep(Duration::from_millis(500));
        for t in &api.t {
            t.0.store(0, Ordering::Relaxed);
            t.1.store(0, Ordering::Relaxed);
        }
        execute(&api, &p, prep)
    })();
    if system.starts_with("commitfs") {
        if let Ok(o) = sys::run(&bin, &["stats", &m]) {
            println!("{o}");
        }
    }
    if let Some(fs) = &lib {
        let f = fs.fc_stats();
        let st = fs.stats();
        println!(
            "fc: {} commits, {} skipped, avg io {:.0} us, avg total {:.0} us; flushes {}, fsyncs {}",
            f.commits,
            f.skipped,
            f.io_ns as f64 / f.commits.max(1) as f64 / 1000.0,
            f.total_ns as f64 / f.commits.max(1) as f64 / 1000.0,
            st.device.flushes,
            st.fsyncs
        );
        fs.unmount()?;
    }
    if system.starts_with("commitfs") {
        let _ = sys::run(&bin, &["umount", &m]);
    } else {
        let _ = sys::run("umount", &[&m]);
    }
    drop(emu);
    let r = r?;
    api.report();
    println!(
        "{system} {w} t={threads}: {:.0} ops/s, {} fsyncs, fsync p50 {:.0} p95 {:.0} us",
        r.throughput,
        r.fsyncs,
        r.fsync_lat.as_ref().map_or(0.0, |l| l.p50_us),
        r.fsync_lat.as_ref().map_or(0.0, |l| l.p95_us)
    );
    Ok(())
}
