//! The emulated device: nbdkit's `memory` plugin behind our latency filter
//! (`nbd/commitfs-latency-filter.c`), served to the kernel as a file by `nbdfuse`
//! and turned into a block device by a loop device (direct I/O). The kernel
//! file systems and commitfs use the same `/dev/loopN`, so they are compared on
//! one device. (No nbd kernel module on this machine: `CONFIG_BLK_DEV_NBD` unset.)
//!
//! Path of a request: fs -> /dev/loopN -> O_DIRECT pwrite/fsync on the nbdfuse
//! file -> NBD over a Unix socket -> filter (counts, sleeps) -> memory plugin.
//! The loop device has a volatile write cache but no FUA: the block layer turns a
//! FUA write into write + flush, so the device's FUA latency applies only to
//! clients that speak NBD directly; what loop clients see is flush latency.
//!
//! The counters are the device's own (the filter's shared file), never the file
//! system's. This file is also compiled into `tests/bench_device.rs`.

// Shared with tests/bench_device.rs, which uses a different subset.
#![allow(dead_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::sys::{self, ChildGuard, Cleanup, LoopDev, TempPath};

/// The latency/throughput model of a device profile (see the filter's header).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub name: String,
    pub what: String,
    /// Time for a write to land in the device's volatile cache, µs.
    pub lat_write_us: u64,
    pub lat_read_us: u64,
    /// Base time of a cache flush, µs (plus dirty bytes / destage bandwidth).
    pub lat_flush_us: u64,
    /// Extra time of a FUA write (through to media), µs.
    pub lat_fua_us: u64,
    /// IOPS cap (0 = none).
    pub iops: u64,
    /// Bandwidth cap, MB/s (0 = none).
    pub bw_mbps: u64,
    /// Cache-to-media bandwidth charged at flush/FUA, MB/s (0 = free).
    pub destage_mbps: u64,
}

/// The profiles. Numbers are typical published figures, not measurements of a
/// particular product: a consumer NVMe SSD with a volatile cache, a SATA SSD
/// whose cache flush costs 1-2 ms, and a cloud virtual disk provisioned at
/// 150 MB/s and 15,000 IOPS (FastCommit §6's VBD) whose writes are already
/// durable when acknowledged (so flush is a cheap round trip).
pub fn profiles() -> Vec<Profile> {
    let p = |name: &str, what: &str, w, r, f, fua, iops, bw, destage| Profile {
        name: name.into(),
        what: what.into(),
        lat_write_us: w,
        lat_read_us: r,
        lat_flush_us: f,
        lat_fua_us: fua,
        iops,
        bw_mbps: bw,
        destage_mbps: destage,
    };
    vec![
        p(
            "none",
            "no added latency (device-side counters and traces only)",
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        ),
        p(
            "nvme",
            "local NVMe SSD, volatile write cache",
            20,
            60,
            250,
            40,
            400_000,
            2500,
            2000,
        ),
        p(
            "sata-ssd",
            "SATA SSD, ~1.5 ms cache flush",
            60,
            120,
            1500,
            1000,
            80_000,
            500,
            400,
        ),
        p(
            "cloud",
            "cloud virtual disk, 150 MB/s, 15,000 IOPS",
            400,
            600,
            100,
            0,
            15_000,
            150,
            0,
        ),
    ]
}

impl Profile {
    /// A model with flush latency `flush_us` and nothing else (tests).
    pub fn flush_only(flush_us: u64) -> Profile {
        Profile {
            name: "test".into(),
            what: "flush latency only".into(),
            lat_write_us: 0,
            lat_read_us: 0,
            lat_flush_us: flush_us,
            lat_fua_us: 0,
            iops: 0,
            bw_mbps: 0,
            destage_mbps: 0,
        }
    }
}

/// An emulated device in a work directory of its own (tests): fields drop in
/// order, so the device (and its nbdfuse mount inside the directory) goes
/// before the directory.
pub struct ScratchDevice {
    pub e: Emulated,
    pub w: super::sys::TempPath,
}

impl ScratchDevice {
    /// Start a device of `size` bytes with no latency yet (mkfs stays fast) in a
    /// fresh directory under the temp directory named after `tag`.
    pub fn start(tag: &str, size: u64, trace_cap: u64) -> Result<ScratchDevice> {
        available().context(
            "emulated device unavailable (apt-get install nbdkit nbdkit-plugin-dev libnbd-bin gcc)",
        )?;
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "commitfs-emu-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).with_context(|| format!("create {}", p.display()))?;
        let w = super::sys::TempPath::new(p);
        let e = Emulated::start(&Profile::flush_only(0), size, &w.path, trace_cap)?;
        Ok(ScratchDevice { e, w })
    }
}

pub fn profile(name: &str) -> Result<Profile> {
    profiles()
        .into_iter()
        .find(|p| p.name == name)
        .with_context(|| {
            let names: Vec<String> = profiles().into_iter().map(|p| p.name).collect();
            format!(
                "unknown device profile {name:?} (known: {})",
                names.join(", ")
            )
        })
}

/// The filter's C source, built at run time with `cc` against the system's
/// nbdkit headers (so the binary carries it; `nbd/build.sh` does the same by hand).
const FILTER_SRC: &str = include_str!("../../../nbd/commitfs-latency-filter.c");

/// The device's counters (the filter's `struct shared`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmuCounters {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub fua_writes: u64,
    pub flushes: u64,
    pub trims: u64,
    pub trim_bytes: u64,
    pub zeroes: u64,
    pub zero_bytes: u64,
    pub delay_ns: u64,
    pub flush_ns: u64,
    pub trace_next: u64,
}

const MAGIC: u64 = 0x3153_4d4c_4354_4643;
const HEADER_BYTES: u64 = 4096;
const REC_BYTES: u64 = 32;

/// One request seen by the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRec {
    pub t_ns: u64,
    pub offset: u64,
    pub count: u32,
    /// 1 read, 2 write, 3 flush, 4 trim, 5 zero.
    pub op: u8,
    pub fua: bool,
}

pub const OP_READ: u8 = 1;
pub const OP_WRITE: u8 = 2;
pub const OP_FLUSH: u8 = 3;

/// A running emulated device.
pub struct Emulated {
    pub profile: Profile,
    /// The block device to use (`/dev/loopN`).
    pub dev: PathBuf,
    pub trace_cap: u64,
    stats: File,
    // Drop order: loop device, then nbdfuse's mount, then the processes.
    loopdev: Option<LoopDev>,
    fuse_mount: Option<Cleanup>,
    _nbdfuse: ChildGuard,
    _nbdkit: ChildGuard,
    _stats_file: TempPath,
    _dir: TempPath,
}

fn le(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i * 8..i * 8 + 8]);
    u64::from_le_bytes(a)
}

/// Compile the filter into `dir` (cached by content hash under `cache_dir`).
pub fn build_filter(cache_dir: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("COMMITFS_NBD_FILTER") {
        return Ok(PathBuf::from(p));
    }
    if !Path::new("/usr/include/nbdkit-filter.h").exists() {
        bail!("nbdkit headers missing (apt-get install nbdkit-plugin-dev)");
    }
    // FNV-1a of the source: rebuild when it changes.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in FILTER_SRC.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    std::fs::create_dir_all(cache_dir)?;
    let so = cache_dir.join(format!("nbdkit-commitfs-latency-filter-{h:016x}.so"));
    if so.exists() {
        return Ok(so);
    }
    let src = cache_dir.join(format!("commitfs-latency-filter-{h:016x}.c"));
    std::fs::write(&src, FILTER_SRC)?;
    // Unique per build: two threads (or processes) building at once on a fresh
    // cache each rename their own file into place.
    static BUILDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = BUILDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = so.with_extension(format!("tmp{}-{n}", std::process::id()));
    sys::run(
        "cc",
        &[
            "-std=gnu11",
            "-O2",
            "-fPIC",
            "-shared",
            "-Wall",
            "-o",
            &tmp.to_string_lossy(),
            &src.to_string_lossy(),
            "-lpthread",
        ],
    )
    .context("building the nbdkit latency filter")?;
    std::fs::rename(&tmp, &so)?;
    Ok(so)
}

/// Is everything the emulated device needs installed?
pub fn available() -> Result<()> {
    for (p, pkg) in [
        ("nbdkit", "nbdkit"),
        ("nbdfuse", "libnbd-bin"),
        ("cc", "gcc"),
        ("losetup", "util-linux"),
    ] {
        if !sys::have(p) {
            bail!("{p} not found (apt-get install {pkg})");
        }
    }
    if !Path::new("/usr/include/nbdkit-filter.h").exists() {
        bail!("nbdkit headers missing (apt-get install nbdkit-plugin-dev)");
    }
    if !Path::new("/dev/fuse").exists() {
        bail!("/dev/fuse missing");
    }
    Ok(())
}

impl Emulated {
    /// Start nbdkit (memory plugin, `size` bytes) with the profile, mount it with
    /// nbdfuse under `work` and attach a loop device to it.
    pub fn start(profile: &Profile, size: u64, work: &Path, trace_cap: u64) -> Result<Emulated> {
        available()?;
        let filter = build_filter(&std::env::temp_dir().join("commitfs-nbd-filter"))?;
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = TempPath::new(work.join(format!("emu-{}-{seq}", std::process::id())));
        std::fs::create_dir_all(dir.path.join("mnt"))?;
        let sock = dir.path.join("nbd.sock");
        // The counters (and the trace ring) live in shared memory when possible,
        // so tracing adds no disk traffic of its own.
        let shm = Path::new("/dev/shm");
        let stats_path = if shm.is_dir() {
            shm.join(format!(
                "commitfs-bench-{}-{}.stats",
                std::process::id(),
                dir.path
                    .file_name()
                    .map(|s| s.to_string_lossy())
                    .unwrap_or_default()
            ))
        } else {
            dir.path.join("stats")
        };
        let stats_tmp = TempPath::new(stats_path.clone());
        let mut cmd = sys::command("nbdkit");
        cmd.args(["-f", "--exit-with-parent", "-U"])
            .arg(&sock)
            .arg(format!("--filter={}", filter.display()))
            .args(["memory", &size.to_string()])
            // Every parameter is passed explicitly: the Rust table is the truth.
            .arg("profile=none")
            .arg(format!("stats={}", stats_path.display()))
            .arg(format!("trace={trace_cap}"))
            .arg(format!("lat-write={}", profile.lat_write_us))
            .arg(format!("lat-read={}", profile.lat_read_us))
            .arg(format!("lat-flush={}", profile.lat_flush_us))
            .arg(format!("lat-fua={}", profile.lat_fua_us))
            .arg(format!("iops={}", profile.iops))
            .arg(format!("bw={}", profile.bw_mbps))
            .arg(format!("destage-bw={}", profile.destage_mbps))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(dir.path.join("nbdkit.log"))?);
        let nbdkit = ChildGuard::spawn(cmd, "nbdkit")?;
        let log = dir.path.join("nbdkit.log");
        wait_for(
            || sock.exists() && stats_ready(&stats_path),
            "nbdkit socket",
            &nbdkit,
            &log,
        )?;
        let stats = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&stats_path)?;
        let file = dir.path.join("mnt/disk");
        let mut cmd = sys::command("nbdfuse");
        cmd.arg(&file)
            .arg("--unix")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(dir.path.join("nbdfuse.log"))?);
        let nbdfuse = ChildGuard::spawn(cmd, "nbdfuse")?;
        let mnt = dir.path.join("mnt");
        let fuse_mount = {
            let m = mnt.clone();
            Cleanup::new(format!("fusermount3 -u {}", mnt.display()), move || {
                for _ in 0..50 {
                    if !sys::is_mounted(&m) {
                        return;
                    }
                    if sys::run("fusermount3", &["-u", &m.to_string_lossy()]).is_ok() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                let _ = sys::run("umount", &["-l", &m.to_string_lossy()]);
            })
        };
        wait_for(
            || sys::is_mounted(&mnt) && file.exists(),
            "nbdfuse mount",
            &nbdfuse,
            &dir.path.join("nbdfuse.log"),
        )?;
        let loopdev = LoopDev::attach(&file)?;
        let dev = loopdev.dev.clone();
        Ok(Emulated {
            profile: profile.clone(),
            dev,
            trace_cap,
            stats,
            loopdev: Some(loopdev),
            fuse_mount: Some(fuse_mount),
            _nbdfuse: nbdfuse,
            _nbdkit: nbdkit,
            _stats_file: stats_tmp,
            _dir: dir,
        })
    }

    /// The device's counters now.
    pub fn counters(&self) -> Result<EmuCounters> {
        read_counters(&self.stats)
    }

    /// Change the latency model while the device runs (the filter reads it from
    /// the shared file at every request).
    pub fn set_model(&mut self, p: &Profile) -> Result<()> {
        let vals = [
            p.lat_write_us,
            p.lat_read_us,
            p.lat_flush_us,
            p.lat_fua_us,
            p.iops,
            p.bw_mbps * 1_000_000,
            p.destage_mbps * 1_000_000,
        ];
        let mut b = Vec::with_capacity(vals.len() * 8);
        for v in vals {
            b.extend_from_slice(&v.to_le_bytes());
        }
        self.stats.write_all_at(&b, 16 * 8)?;
        self.profile = p.clone();
        Ok(())
    }

    /// A second handle on the counters (for a sampling thread).
    pub fn counters_file(&self) -> Result<File> {
        Ok(self.stats.try_clone()?)
    }
}

/// Read the counters from the shared file.
pub fn read_counters(stats: &File) -> Result<EmuCounters> {
    let mut b = [0u8; 192];
    stats.read_exact_at(&mut b, 0)?;
    if le(&b, 0) != MAGIC {
        bail!("emulated device: bad stats header");
    }
    {
        Ok(EmuCounters {
            reads: le(&b, 2),
            read_bytes: le(&b, 3),
            writes: le(&b, 4),
            write_bytes: le(&b, 5),
            fua_writes: le(&b, 6),
            flushes: le(&b, 7),
            trims: le(&b, 8),
            trim_bytes: le(&b, 9),
            zeroes: le(&b, 10),
            zero_bytes: le(&b, 11),
            delay_ns: le(&b, 12),
            flush_ns: le(&b, 13),
            trace_next: le(&b, 14),
        })
    }
}

impl Emulated {
    /// Requests `from..to` (trace indices from [`EmuCounters::trace_next`]);
    /// `None` if the ring has already overwritten some of them.
    pub fn trace(&self, from: u64, to: u64) -> Result<Option<Vec<TraceRec>>> {
        if self.trace_cap == 0 || to < from || to - from > self.trace_cap {
            return Ok(None);
        }
        let now = self.counters()?.trace_next;
        if now.saturating_sub(from) > self.trace_cap {
            return Ok(None);
        }
        let mut out = Vec::with_capacity((to - from) as usize);
        let mut buf = vec![0u8; REC_BYTES as usize];
        for i in from..to {
            let off = HEADER_BYTES + (i % self.trace_cap) * REC_BYTES;
            self.stats.read_exact_at(&mut buf, off)?;
            out.push(TraceRec {
                t_ns: le(&buf, 0),
                offset: le(&buf, 1),
                count: u32::from_le_bytes([buf[16], buf[17], buf[18], buf[19]]),
                op: buf[20],
                fua: buf[21] & 1 != 0,
            });
        }
        Ok(Some(out))
    }

    /// Tear down in order: loop device, nbdfuse mount, processes, files.
    pub fn stop(mut self) {
        if let Some(l) = self.loopdev.take() {
            l.detach();
        }
        if let Some(m) = self.fuse_mount.take() {
            m.run();
        }
    }
}

impl Drop for Emulated {
    fn drop(&mut self) {
        if let Some(l) = self.loopdev.take() {
            l.detach();
        }
        if let Some(m) = self.fuse_mount.take() {
            m.run();
        }
    }
}

fn stats_ready(p: &Path) -> bool {
    let Ok(f) = File::open(p) else { return false };
    let mut b = [0u8; 8];
    f.read_exact_at(&mut b, 0).is_ok() && u64::from_le_bytes(b) == MAGIC
}

fn wait_for(
    mut ok: impl FnMut() -> bool,
    what: &str,
    child: &ChildGuard,
    log: &Path,
) -> Result<()> {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        if ok() {
            return Ok(());
        }
        if child.exited() {
            let msg = std::fs::read_to_string(log).unwrap_or_default();
            bail!(
                "{what}: the process exited before it was ready: {}",
                msg.trim()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("{what}: not ready after 20 s")
}
