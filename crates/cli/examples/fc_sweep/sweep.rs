//! The fast-commit sweep of the fast-commit issue, shared by the CI test
//! (`crates/cli/tests/fc_sweep.rs`) and the benchmark printout
//! (`cargo run --release --example fc_sweep`).
//!
//! Workload: `files` x (create, append 4 KiB, close) in the root directory, with
//! an fsync of every n-th file (files `i` with `(i + 1) % n == 0`, so the last
//! file is always fsynced), for kernel ext4 and for commitfs (library API), each
//! on a fresh `mkfs.ext4 -O fast_commit` of the *same* loop device.
//!
//! Measurement window, identical for both systems: from right after the mount
//! (kernel `mount`, commitfs `Fs::open_path`) to right after the last close. The
//! unmount (a full commit and checkpoint in both systems) is outside the window.
//! Periodic commits are pushed out of the window for both (`commit=600`, i.e.
//! `MountOptions::commit_interval = 600`), so the counts are reproducible; the
//! images are made with `lazy_itable_init=0,lazy_journal_init=0` so that the
//! kernel's `ext4lazyinit` thread never journals anything during the window, and
//! with a fixed UUID and directory-hash seed so that the htree of the root
//! directory splits the same way at every mkfs. The kernel workload's thread is
//! pinned to one CPU (ext4 allocates small files from per-CPU locality groups).
//!
//! Counters (all exact):
//! - device flushes: `/sys/block/loopN/stat` field 16 (flush requests completed).
//!   This is the judge for both systems: the loop device has a volatile write
//!   cache and no FUA, so the block layer turns the kernel's PREFLUSH|FUA commit
//!   write into flush + write + flush, and commitfs's `FileDevice` turns a FUA
//!   write into write + `fdatasync` (one flush request) and a flush into
//!   `fdatasync` (one flush request).
//! - journal bytes at the device: the bytes of every write request issued to the
//!   loop device (tracepoint `block/block_rq_issue`) that fall inside the journal
//!   inode's blocks (from `debugfs -R "stat <8>"`). Also the judge for both: JBD2
//!   log blocks, journal superblock updates and fast-commit blocks, whoever writes
//!   them.
//! - journal bytes as each system accounts them: kernel = (sum of `blocks_logged`
//!   of `jbd2/jbd2_run_stats` + sum of `nblks` of `ext4/ext4_fc_commit_stop`) x
//!   block size (the journal superblock is not in these); commitfs = write bytes
//!   of its `Journal` and `FastCommit` I/O categories (these include its journal
//!   superblock writes).
//! - fast commits: kernel = `ext4_fc_commit_stop` events with status OK (cross-
//!   checked against `/proc/fs/ext4/loopN/fc_info`); commitfs = `Fs::fc_stats()`.
//! - full commits: kernel = `jbd2_run_stats` events (cross-checked against
//!   `/proc/fs/jbd2/loopN-8/info`); commitfs = `JournalStats::commits`.
//!
//! Tracing uses a private tracefs instance (`instances/commitfs-fc-sweep-PID`),
//! so the global trace buffer, `tracing_on` and other users' events are never
//! touched; the instance is removed on drop, also during a panic. Every mount,
//! the loop device and the image are cleaned up by `Rig`'s `Drop`; what a sweep
//! killed by a signal left behind is reaped by the next one.
//!
//! After each commitfs run (outside the window): unmount, `e2fsck -fn` must be
//! clean, and every file must be there with its 4 KiB when remounted by commitfs
//! and by the kernel. After each kernel run every file is read back too.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use commitfs::{Fs, MountOptions, ROOT_INO};

/// Which file system runs the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum System {
    Kernel,
    /// commitfs with `MountOptions::default()` (fast commits on).
    Commitfs,
    /// commitfs with `fc_data_csum: true`.
    CommitfsCsum,
}

impl System {
    pub const ALL: [System; 3] = [System::Kernel, System::Commitfs, System::CommitfsCsum];
    pub fn label(self) -> &'static str {
        match self {
            System::Kernel => "kernel ext4",
            System::Commitfs => "commitfs",
            System::CommitfsCsum => "commitfs fc_data_csum",
        }
    }
}

/// Sweep parameters.
#[derive(Debug, Clone)]
pub struct Config {
    /// Files per run (1024 in the issue).
    pub files: usize,
    /// Values of n (fsync every n-th file).
    pub ns: Vec<usize>,
    /// Size of the sparse image behind the loop device.
    pub image_mib: u64,
    /// Directory of the image (tmpfs keeps flushes cheap and the test fast).
    pub image_dir: PathBuf,
    /// `commit=` for both systems: long enough that no periodic commit falls
    /// into a run.
    pub commit_secs: u32,
    /// Per-CPU trace buffer of the private tracefs instance.
    pub trace_buffer_kb: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            files: 1024,
            ns: (0..=10).map(|k| 1usize << k).collect(),
            image_mib: 256,
            image_dir: default_image_dir(),
            commit_secs: 600,
            trace_buffer_kb: 4096,
        }
    }
}

/// `/dev/shm` when it has room for what a run writes into the sparse image
/// (about 30 MiB: inode tables, journal, data), else the temp dir.
pub fn default_image_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let free = || -> Option<u64> {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(shm.as_os_str().as_bytes()).ok()?;
        // SAFETY: statvfs fills the zeroed struct we pass; `c` is a valid C string.
        unsafe {
            let mut st: libc::statvfs = std::mem::zeroed();
            (libc::statvfs(c.as_ptr(), &mut st) == 0)
                .then(|| st.f_bavail as u64 * st.f_frsize as u64)
        }
    };
    if shm.is_dir() && free().is_some_and(|f| f >= 128 << 20) {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// The measured counts of one run (one system, one n).
#[derive(Debug, Clone, Default)]
pub struct Run {
    pub system: Option<System>,
    pub n: usize,
    pub files: usize,
    pub fsyncs: u64,
    pub block_size: u64,
    /// Bytes of device write requests inside the journal inode's blocks.
    pub journal_bytes_dev: u64,
    /// Journal bytes as the system accounts them (see the module docs), and the
    /// split: JBD2 part (kernel: `blocks_logged`; commitfs: `Journal` category,
    /// incl. journal superblock writes) and fast-commit part (kernel: `nblks`;
    /// commitfs: `FastCommit` category, incl. zeroing the area's first block).
    pub journal_bytes_own: u64,
    pub jbd2_bytes_own: u64,
    pub fc_bytes_own: u64,
    /// Flush requests completed by the loop device (`/sys/block/.../stat`).
    pub flushes_dev: u64,
    /// Flush requests seen by the `block_rq_issue` tracepoint (cross-check).
    pub flushes_traced: u64,
    /// commitfs: flushes + FUA writes it issued (each is one `fdatasync`);
    /// kernel: same as `flushes_traced`.
    pub flushes_own: u64,
    /// Write requests / bytes of the whole device in the window.
    pub writes_dev: u64,
    pub write_bytes_dev: u64,
    /// Full (JBD2) commits in the window.
    pub full_commits: u64,
    /// Fast commits, their blocks and how many were one block.
    pub fast_commits: u64,
    pub fc_blocks: u64,
    pub fc_single_block: u64,
    /// Kernel: fsyncs whose fast commit fell back to a full commit
    /// (`ext4_fc_commit_stop` status ineligible or failed); commitfs: fallbacks
    /// by reason.
    pub fc_fallbacks: u64,
    pub fc_fallback_reasons: BTreeMap<String, u64>,
    /// Kernel cross-checks: fast commits in `fc_info`, transactions in the jbd2
    /// `info` file (both since mount, i.e. the window plus nothing).
    pub fc_info_commits: Option<u64>,
    pub jbd2_info_transactions: Option<u64>,
    pub wall: Duration,
}

impl Run {
    pub fn per_fsync(&self, v: u64) -> f64 {
        v as f64 / self.fsyncs.max(1) as f64
    }
    pub fn journal_kib_per_fsync_dev(&self) -> f64 {
        self.per_fsync(self.journal_bytes_dev) / 1024.0
    }
    pub fn journal_kib_per_fsync_own(&self) -> f64 {
        self.per_fsync(self.journal_bytes_own) / 1024.0
    }
    pub fn flushes_per_fsync(&self) -> f64 {
        self.per_fsync(self.flushes_dev)
    }
    pub fn single_block_pct(&self) -> f64 {
        if self.fast_commits == 0 {
            return 0.0;
        }
        100.0 * self.fc_single_block as f64 / self.fast_commits as f64
    }
    pub fn fsyncs_per_sec(&self) -> f64 {
        self.fsyncs as f64 / self.wall.as_secs_f64().max(1e-9)
    }
    pub fn label(&self) -> &'static str {
        self.system.map(System::label).unwrap_or("?")
    }
}

// ---------------------------------------------------------------- helpers

type R<T> = Result<T, String>;

fn run_cmd(cmd: &mut Command) -> R<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("{cmd:?} exited with {}: {text}", out.status))
    }
}

fn write_file(path: &Path, text: &str) -> R<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    f.write_all(text.as_bytes())
        .map_err(|e| format!("write {:?} to {}: {e}", text, path.display()))
}

fn read_file(path: &Path) -> R<String> {
    std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))
}

/// Block-layer counters of `/sys/block/NAME/stat` (Documentation/block/stat.rst).
#[derive(Debug, Clone, Copy, Default)]
struct DiskStat {
    writes: u64,
    write_sectors: u64,
    flushes: u64,
}

fn disk_stat(name: &str) -> R<DiskStat> {
    let s = read_file(&PathBuf::from(format!("/sys/block/{name}/stat")))?;
    let v: Vec<u64> = s
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    if v.len() < 17 {
        return Err(format!(
            "/sys/block/{name}/stat has {} fields; the flush counter (field 16) needs Linux 5.5+",
            v.len()
        ));
    }
    Ok(DiskStat {
        writes: v[4],
        write_sectors: v[6],
        flushes: v[15],
    })
}

/// Pins the calling thread to its current CPU until dropped (then restores the
/// old mask). ext4's mballoc serves small files from per-CPU locality groups, so
/// a workload that migrates between CPUs allocates from different groups and a
/// full commit logs a bitmap block more or less from run to run.
struct PinCpu {
    old: libc::cpu_set_t,
}

impl PinCpu {
    fn here() -> R<PinCpu> {
        // SAFETY: plain libc calls on a zeroed cpu_set_t we own; pid 0 = this thread.
        unsafe {
            let mut old: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old) != 0 {
                return Err(format!(
                    "sched_getaffinity: {}",
                    std::io::Error::last_os_error()
                ));
            }
            let cpu = libc::sched_getcpu();
            if cpu < 0 {
                return Err(format!("sched_getcpu: {}", std::io::Error::last_os_error()));
            }
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu as usize, &mut one);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) != 0 {
                return Err(format!(
                    "sched_setaffinity: {}",
                    std::io::Error::last_os_error()
                ));
            }
            Ok(PinCpu { old })
        }
    }
}

impl Drop for PinCpu {
    fn drop(&mut self) {
        // SAFETY: restores the mask read in `here`.
        unsafe {
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.old);
        }
    }
}

/// A cross-process lock (flock on a file in the temp dir): one sweep at a time on
/// this machine, whether from the test or from the example.
struct HostLock {
    _f: std::fs::File,
}

impl HostLock {
    fn take() -> R<HostLock> {
        use std::os::unix::io::AsRawFd;
        let p = std::env::temp_dir().join("commitfs-fc-sweep.lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| format!("open {}: {e}", p.display()))?;
        // SAFETY: flock on a file descriptor we own.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if r != 0 {
            return Err(format!(
                "flock {}: {}",
                p.display(),
                std::io::Error::last_os_error()
            ));
        }
        Ok(HostLock { _f: f })
    }
}

// ---------------------------------------------------------------- tracing

const TRACEFS: &str = "/sys/kernel/tracing";
const EVENTS: [&str; 3] = [
    "jbd2/jbd2_run_stats",
    "ext4/ext4_fc_commit_stop",
    "block/block_rq_issue",
];

/// A private tracefs instance with our events, filtered on one device.
struct Tracer {
    dir: PathBuf,
    enabled: Vec<PathBuf>,
    /// We mounted tracefs ourselves (unmounted again on drop).
    mounted_tracefs: bool,
}

impl Tracer {
    fn new(dev_t: u64, buffer_kb: u64) -> R<Tracer> {
        let root = Path::new(TRACEFS);
        let mut mounted_tracefs = false;
        if !root.join("instances").is_dir() {
            run_cmd(
                Command::new("mount")
                    .args(["-t", "tracefs", "nodev"])
                    .arg(root),
            )
            .map_err(|e| format!("tracefs is needed (CONFIG_FTRACE): {e}"))?;
            mounted_tracefs = true;
        }
        let dir = root
            .join("instances")
            .join(format!("{TAG}{}", std::process::id()));
        if dir.exists() {
            // Left over by a killed run of this very pid number: start afresh.
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir)
            .map_err(|e| format!("create tracefs instance {}: {e}", dir.display()))?;
        let mut t = Tracer {
            dir,
            enabled: Vec::new(),
            mounted_tracefs,
        };
        write_file(&t.dir.join("buffer_size_kb"), &buffer_kb.to_string())?;
        for ev in EVENTS {
            let d = t.dir.join("events").join(ev);
            if !d.is_dir() {
                return Err(format!(
                    "tracepoint {ev} missing (kernel without ext4/jbd2/block tracepoints?)"
                ));
            }
            write_file(&d.join("filter"), &format!("dev == {dev_t}"))?;
            write_file(&d.join("enable"), "1")?;
            t.enabled.push(d);
        }
        write_file(&t.dir.join("tracing_on"), "1")?;
        Ok(t)
    }

    fn clear(&self) -> R<()> {
        write_file(&self.dir.join("trace"), "")
    }

    /// Text of the trace buffer; fails if any event was lost.
    fn take(&self) -> R<String> {
        let text = read_file(&self.dir.join("trace"))?;
        let mut lost = 0u64;
        if let Ok(rd) = std::fs::read_dir(self.dir.join("per_cpu")) {
            for e in rd.flatten() {
                let Ok(s) = std::fs::read_to_string(e.path().join("stats")) else {
                    continue;
                };
                for l in s.lines() {
                    for key in ["overrun:", "dropped events:"] {
                        if let Some(v) = l.strip_prefix(key) {
                            lost += v.trim().parse::<u64>().unwrap_or(0);
                        }
                    }
                }
            }
        }
        if lost > 0 {
            return Err(format!(
                "{lost} trace events lost: raise Config::trace_buffer_kb"
            ));
        }
        self.clear()?;
        Ok(text)
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        for d in &self.enabled {
            let _ = write_file(&d.join("enable"), "0");
            let _ = write_file(&d.join("filter"), "0");
        }
        let _ = write_file(&self.dir.join("tracing_on"), "0");
        let _ = write_file(&self.dir.join("trace"), "");
        // Removing the instance frees its buffer and its event settings.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if self.mounted_tracefs {
            let _ = run_cmd(Command::new("umount").arg(TRACEFS));
        }
    }
}

/// What one run's trace says.
#[derive(Debug, Default)]
struct Traced {
    full_commits: u64,
    blocks_logged: u64,
    fc_ok: u64,
    fc_blocks: u64,
    fc_single: u64,
    fc_fallback: u64,
    fc_status: BTreeMap<String, u64>,
    journal_write_bytes: u64,
    flushes: u64,
}

/// `key value` pairs after an event name (`"dev 7,0 nblks 1, reason 0, ..."`).
fn field(rest: &str, key: &str) -> Option<u64> {
    let mut it = rest.split_whitespace();
    while let Some(t) = it.next() {
        if t == key {
            let v = it.next()?;
            return v.trim_end_matches(',').parse().ok();
        }
    }
    None
}

fn parse_trace(text: &str, journal: &[(u64, u64)]) -> R<Traced> {
    let mut t = Traced::default();
    for l in text.lines() {
        if l.starts_with('#') || l.trim().is_empty() {
            continue;
        }
        if let Some((_, rest)) = l.split_once(" jbd2_run_stats: ") {
            t.full_commits += 1;
            t.blocks_logged += field(rest, "blocks_logged")
                .ok_or_else(|| format!("unparsable jbd2_run_stats line: {l}"))?;
        } else if let Some((_, rest)) = l.split_once(" ext4_fc_commit_stop: ") {
            let nblks = field(rest, "nblks").ok_or_else(|| format!("unparsable fc line: {l}"))?;
            let reason = field(rest, "reason").ok_or_else(|| format!("unparsable fc line: {l}"))?;
            // fs/ext4/ext4.h: EXT4_FC_STATUS_{OK, INELIGIBLE, SKIPPED, FAILED}.
            let status = match reason {
                0 => "ok",
                1 => "ineligible",
                2 => "skipped",
                3 => "failed",
                _ => "other",
            };
            *t.fc_status.entry(status.to_string()).or_default() += 1;
            match reason {
                0 => {
                    t.fc_ok += 1;
                    t.fc_blocks += nblks;
                    t.fc_single += (nblks == 1) as u64;
                }
                1 | 3 => t.fc_fallback += 1,
                _ => {}
            }
        } else if let Some((_, rest)) = l.split_once(" block_rq_issue: ") {
            // "7,0 WSM 4096 () 295184 + 8 be,0,3 [comm]"
            let toks: Vec<&str> = rest.split_whitespace().collect();
            let rwbs = toks.get(1).copied().unwrap_or("");
            if rwbs.starts_with("FF") {
                t.flushes += 1;
            }
            if !rwbs.contains('W') {
                continue;
            }
            let Some(plus) = toks.iter().position(|x| *x == "+") else {
                return Err(format!("unparsable block_rq_issue line: {l}"));
            };
            let sector: u64 = toks[plus - 1]
                .parse()
                .map_err(|_| format!("unparsable block_rq_issue line: {l}"))?;
            let nr: u64 = toks
                .get(plus + 1)
                .and_then(|x| x.parse().ok())
                .ok_or_else(|| format!("unparsable block_rq_issue line: {l}"))?;
            let (a, b) = (sector, sector + nr);
            for &(js, je) in journal {
                let (lo, hi) = (a.max(js), b.min(je));
                if lo < hi {
                    t.journal_write_bytes += (hi - lo) * 512;
                }
            }
        }
    }
    Ok(t)
}

// ---------------------------------------------------------------- the rig

const TAG: &str = "commitfs-fc-sweep-";

/// The pid in a name `...commitfs-fc-sweep-PID...` if that process is gone.
fn dead_owner(name: &str) -> Option<u32> {
    let rest = &name[name.find(TAG)? + TAG.len()..];
    let pid: u32 = rest
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    (!Path::new(&format!("/proc/{pid}")).exists()).then_some(pid)
}

/// Undo what a sweep killed by a signal (no unwinding, so no `Drop`) left
/// behind: its mount, loop device, tracefs instance and image. Called under the
/// host lock, so no live sweep is half-way through setting these up.
fn reap_stale(image_dir: &Path) {
    if let Ok(mi) = std::fs::read_to_string("/proc/self/mountinfo") {
        for l in mi.lines() {
            if let Some(mp) = l.split(' ').nth(4) {
                if dead_owner(mp).is_some() {
                    let _ = run_cmd(Command::new("umount").arg("-l").arg(mp));
                }
            }
        }
    }
    if let Ok(out) = run_cmd(Command::new("losetup").arg("-a")) {
        for l in out.lines() {
            // "/dev/loop0: []: (/dev/shm/commitfs-fc-sweep-123-456.img)"
            if dead_owner(l).is_some() {
                if let Some((dev, _)) = l.split_once(':') {
                    let _ = run_cmd(Command::new("losetup").arg("-d").arg(dev));
                }
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir(Path::new(TRACEFS).join("instances")) {
        for e in rd.flatten() {
            if dead_owner(&e.file_name().to_string_lossy()).is_some() {
                let dir = e.path();
                for ev in EVENTS {
                    let _ = write_file(&dir.join("events").join(ev).join("enable"), "0");
                }
                let _ = std::fs::remove_dir(&dir);
            }
        }
    }
    for d in [image_dir.to_path_buf(), std::env::temp_dir()] {
        if let Ok(rd) = std::fs::read_dir(&d) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(TAG) && dead_owner(&name).is_some() {
                    if name.ends_with(".img") {
                        let _ = std::fs::remove_file(e.path());
                    } else if name.ends_with(".mnt") {
                        let _ = std::fs::remove_dir(e.path());
                    }
                }
            }
        }
    }
}

/// Fixed UUID and directory-hash seed: with a random seed (mkfs's default) the
/// names land in different htree leaves at every mkfs, and a full commit then
/// logs one directory block more or less from run to run.
const FS_UUID: &str = "5d1e7a0c-3b2f-4c5e-9a8d-0f1e2d3c4b5a";
const HASH_SEED: &str = "0b9c8d7e-6f5a-4b3c-8d2e-1f0a9b8c7d6e";

/// One sparse image, one loop device, one tracefs instance, one mount point;
/// everything is undone by `Drop`.
pub struct Rig {
    cfg: Config,
    _lock: HostLock,
    image: PathBuf,
    /// `/dev/loopN`; empty once detached.
    dev: String,
    name: String,
    mnt: PathBuf,
    mounted: bool,
    tracer: Option<Tracer>,
}

impl Rig {
    pub fn new(cfg: Config) -> R<Rig> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("the fast-commit sweep needs root (loop devices, mount, tracefs)".into());
        }
        for tool in [
            "losetup",
            "mkfs.ext4",
            "debugfs",
            "e2fsck",
            "mount",
            "umount",
        ] {
            if run_cmd(
                Command::new("sh")
                    .arg("-c")
                    .arg(format!("command -v {tool}")),
            )
            .is_err()
            {
                return Err(format!("{tool} not found (util-linux / e2fsprogs)"));
            }
        }
        let lock = HostLock::take()?;
        reap_stale(&cfg.image_dir);
        let tag = format!(
            "{TAG}{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
        );
        let image = cfg.image_dir.join(format!("{tag}.img"));
        let mnt = std::env::temp_dir().join(format!("{tag}.mnt"));
        let mut rig = Rig {
            cfg,
            _lock: lock,
            image,
            dev: String::new(),
            name: String::new(),
            mnt,
            mounted: false,
            tracer: None,
        };
        let f = std::fs::File::create(&rig.image)
            .map_err(|e| format!("create {}: {e}", rig.image.display()))?;
        f.set_len(rig.cfg.image_mib << 20)
            .map_err(|e| format!("size {}: {e}", rig.image.display()))?;
        drop(f);
        std::fs::create_dir_all(&rig.mnt).map_err(|e| format!("mkdir: {e}"))?;
        let mut last = String::new();
        for _ in 0..20 {
            match run_cmd(
                Command::new("losetup")
                    .arg("-f")
                    .arg("--show")
                    .arg(&rig.image),
            ) {
                Ok(out) if out.trim().starts_with("/dev/loop") => {
                    rig.dev = out.trim().to_string();
                    break;
                }
                Ok(out) => last = format!("unexpected losetup output {out:?}"),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if rig.dev.is_empty() {
            return Err(format!("losetup -f --show: {last}"));
        }
        rig.name = rig.dev.trim_start_matches("/dev/").to_string();
        let devnum = read_file(&PathBuf::from(format!("/sys/block/{}/dev", rig.name)))?;
        let (maj, min) = devnum
            .trim()
            .split_once(':')
            .ok_or_else(|| format!("bad /sys/block/{}/dev: {devnum:?}", rig.name))?;
        let maj: u64 = maj.parse().map_err(|_| "bad major".to_string())?;
        let min: u64 = min.parse().map_err(|_| "bad minor".to_string())?;
        // The kernel's internal dev_t (MINORBITS = 20), as tracepoints print it.
        let dev_t = (maj << 20) | min;
        rig.tracer = Some(Tracer::new(dev_t, rig.cfg.trace_buffer_kb)?);
        Ok(rig)
    }

    pub fn device(&self) -> &str {
        &self.dev
    }

    /// Fresh `mkfs.ext4 -O fast_commit` on the loop device; returns the journal
    /// inode's extents as `[start, end)` sector ranges.
    fn mkfs(&self) -> R<Vec<(u64, u64)>> {
        run_cmd(
            Command::new("mkfs.ext4")
                .args(["-F", "-q", "-b", "4096", "-O", "fast_commit"])
                .args(["-U", FS_UUID, "-E"])
                .arg(format!(
                    "lazy_itable_init=0,lazy_journal_init=0,hash_seed={HASH_SEED}"
                ))
                .arg(&self.dev),
        )?;
        let out = run_cmd(
            Command::new("debugfs")
                .arg("-R")
                .arg("stat <8>")
                .arg(&self.dev),
        )?;
        let ext = out
            .split_once("EXTENTS:")
            .map(|(_, e)| e)
            .ok_or_else(|| format!("no EXTENTS in debugfs stat <8>:\n{out}"))?;
        let mut ranges = Vec::new();
        for tok in ext.split([',', ' ', '\n']) {
            // "(0-4159):32768-36927" or "(7):123"; skip "(ETB0):..." index blocks.
            let Some((lpart, ppart)) = tok.trim().split_once("):") else {
                continue;
            };
            if lpart.contains("ETB") {
                continue;
            }
            let (a, b) = match ppart.split_once('-') {
                Some((a, b)) => (a.parse::<u64>(), b.parse::<u64>()),
                None => (ppart.parse::<u64>(), ppart.parse::<u64>()),
            };
            let (Ok(a), Ok(b)) = (a, b) else {
                return Err(format!("bad journal extent {tok:?} in:\n{out}"));
            };
            ranges.push((a * 8, (b + 1) * 8));
        }
        if ranges.is_empty() {
            return Err(format!("no journal extents in debugfs stat <8>:\n{out}"));
        }
        Ok(ranges)
    }

    fn tracer(&self) -> &Tracer {
        self.tracer.as_ref().expect("tracer set up in Rig::new")
    }

    fn umount(&mut self) -> R<()> {
        if !self.mounted {
            return Ok(());
        }
        let mut last = String::new();
        for _ in 0..50 {
            match run_cmd(Command::new("umount").arg(&self.mnt)) {
                Ok(_) => {
                    self.mounted = false;
                    return Ok(());
                }
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(last)
    }

    fn mount(&mut self, opts: &str) -> R<()> {
        run_cmd(
            Command::new("mount")
                .args(["-t", "ext4", "-o", opts])
                .arg(&self.dev)
                .arg(&self.mnt),
        )?;
        self.mounted = true;
        Ok(())
    }

    /// Check through a kernel mount that every file is there with its content.
    fn check_files_kernel(&self, files: usize) -> R<()> {
        let want = payload();
        for i in 0..files {
            let p = self.mnt.join(format!("f{i}"));
            let got = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            if got != want {
                return Err(format!(
                    "{}: {} bytes, expected the 4 KiB payload",
                    p.display(),
                    got.len()
                ));
            }
        }
        let n = std::fs::read_dir(&self.mnt)
            .map_err(|e| e.to_string())?
            .flatten()
            .filter(|e| e.file_name() != "lost+found")
            .count();
        if n != files {
            return Err(format!("{n} entries in the root, expected {files}"));
        }
        Ok(())
    }

    /// Run the workload on one system for one n.
    pub fn run(&mut self, system: System, n: usize) -> R<Run> {
        let files = self.cfg.files;
        let journal = self.mkfs()?;
        let mut run = Run {
            system: Some(system),
            n,
            files,
            fsyncs: (files / n) as u64,
            block_size: 4096,
            ..Default::default()
        };
        match system {
            System::Kernel => self.run_kernel(&mut run, &journal)?,
            System::Commitfs | System::CommitfsCsum => {
                self.run_commitfs(&mut run, &journal, system == System::CommitfsCsum)?
            }
        }
        Ok(run)
    }

    fn run_kernel(&mut self, run: &mut Run, journal: &[(u64, u64)]) -> R<()> {
        // Only the kernel allocates per CPU; commitfs's counts do not depend on it.
        let _pin = PinCpu::here()?;
        self.mount(&format!("commit={}", self.cfg.commit_secs))?;
        self.tracer().clear()?;
        let s0 = disk_stat(&self.name)?;
        let t0 = Instant::now();
        let buf = payload();
        for i in 0..run.files {
            let p = self.mnt.join(format!("f{i}"));
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(false)
                .mode(0o644)
                .open(&p)
                .map_err(|e| format!("create {}: {e}", p.display()))?;
            f.write_all(&buf)
                .map_err(|e| format!("write {}: {e}", p.display()))?;
            if (i + 1).is_multiple_of(run.n) {
                f.sync_all()
                    .map_err(|e| format!("fsync {}: {e}", p.display()))?;
            }
            drop(f);
        }
        run.wall = t0.elapsed();
        let s1 = disk_stat(&self.name)?;
        let text = self.tracer().take()?;
        let t = parse_trace(&text, journal)?;
        run.flushes_dev = s1.flushes - s0.flushes;
        run.writes_dev = s1.writes - s0.writes;
        run.write_bytes_dev = (s1.write_sectors - s0.write_sectors) * 512;
        run.flushes_traced = t.flushes;
        run.flushes_own = t.flushes;
        run.journal_bytes_dev = t.journal_write_bytes;
        run.jbd2_bytes_own = t.blocks_logged * run.block_size;
        run.fc_bytes_own = t.fc_blocks * run.block_size;
        run.journal_bytes_own = run.jbd2_bytes_own + run.fc_bytes_own;
        run.full_commits = t.full_commits;
        run.fast_commits = t.fc_ok;
        run.fc_blocks = t.fc_blocks;
        run.fc_single_block = t.fc_single;
        run.fc_fallbacks = t.fc_fallback;
        run.fc_fallback_reasons = t.fc_status;
        // Cross-checks from procfs (cumulative since mount = the window).
        let fc_info = read_file(&PathBuf::from(format!(
            "/proc/fs/ext4/{}/fc_info",
            self.name
        )))?;
        run.fc_info_commits = fc_info
            .lines()
            .find_map(|l| l.trim().strip_suffix(" commits"))
            .and_then(|v| v.trim().parse().ok());
        let jinfo = read_file(&PathBuf::from(format!(
            "/proc/fs/jbd2/{}-8/info",
            self.name
        )))?;
        run.jbd2_info_transactions = jinfo
            .lines()
            .next()
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok());
        self.check_files_kernel(run.files)?;
        self.umount()?;
        Ok(())
    }

    fn run_commitfs(&mut self, run: &mut Run, journal: &[(u64, u64)], csum: bool) -> R<()> {
        let opts = MountOptions {
            commit_interval: self.cfg.commit_secs,
            fc_data_csum: csum,
            ..Default::default()
        };
        let fs = Fs::open_path(Path::new(&self.dev), opts)
            .map_err(|e| format!("commitfs open {}: {e}", self.dev))?;
        if fs.block_size() != 4096 {
            return Err(format!("block size {}", fs.block_size()));
        }
        self.tracer().clear()?;
        let s0 = disk_stat(&self.name)?;
        let st0 = fs.stats();
        let fc0 = fs.fc_stats();
        let t0 = Instant::now();
        let buf = payload();
        let e = |what: &str, i: usize, err: commitfs::FsError| format!("{what} f{i}: {err}");
        for i in 0..run.files {
            let a = fs
                .create(ROOT_INO, format!("f{i}").as_bytes(), 0o644, 0, 0)
                .map_err(|x| e("create", i, x))?;
            fs.open_inode(a.ino).map_err(|x| e("open", i, x))?;
            let w = fs.write(a.ino, 0, &buf).map_err(|x| e("write", i, x))?;
            if w != buf.len() {
                return Err(format!("short write f{i}: {w}"));
            }
            if (i + 1).is_multiple_of(run.n) {
                fs.fsync(a.ino, false).map_err(|x| e("fsync", i, x))?;
            }
            fs.release(a.ino).map_err(|x| e("release", i, x))?;
        }
        run.wall = t0.elapsed();
        let s1 = disk_stat(&self.name)?;
        let st1 = fs.stats();
        let fc1 = fs.fc_stats();
        let text = self.tracer().take()?;
        let t = parse_trace(&text, journal)?;
        let d = st1.device.since(&st0.device);
        run.flushes_dev = s1.flushes - s0.flushes;
        run.writes_dev = s1.writes - s0.writes;
        run.write_bytes_dev = (s1.write_sectors - s0.write_sectors) * 512;
        run.flushes_traced = t.flushes;
        run.flushes_own = d.flushes
            + commitfs::device::IoCategory::ALL
                .iter()
                .map(|c| d.category(*c).fua_writes)
                .sum::<u64>();
        run.journal_bytes_dev = t.journal_write_bytes;
        run.jbd2_bytes_own = d.journal.write_bytes;
        run.fc_bytes_own = d.fast_commit.write_bytes;
        run.journal_bytes_own = run.jbd2_bytes_own + run.fc_bytes_own;
        run.full_commits = st1.journal.commits - st0.journal.commits;
        run.fast_commits = fc1.commits - fc0.commits;
        run.fc_blocks = fc1.blocks - fc0.blocks;
        run.fc_single_block = fc1.single_block - fc0.single_block;
        for (k, v) in &fc1.ineligible {
            let dv = v - fc0.ineligible.get(k).copied().unwrap_or(0);
            if dv > 0 {
                run.fc_fallbacks += dv;
                run.fc_fallback_reasons.insert(k.to_string(), dv);
            }
        }
        if fc1.skipped > fc0.skipped {
            run.fc_fallback_reasons
                .insert("skipped".into(), fc1.skipped - fc0.skipped);
        }
        // Out of the window: unmount, then judge the result.
        fs.unmount().map_err(|x| format!("commitfs unmount: {x}"))?;
        drop(fs);
        self.tracer().clear()?;
        let fsck = e2fsck(&self.dev)?;
        if !fsck.is_empty() {
            return Err(format!(
                "e2fsck -fn after commitfs (n = {}, fc_data_csum = {csum}) reported:\n{fsck}",
                run.n
            ));
        }
        // Remount with commitfs and with the kernel: every file, every byte.
        {
            let ro = MountOptions {
                read_only: true,
                ..Default::default()
            };
            let fs = Fs::open_path(Path::new(&self.dev), ro)
                .map_err(|x| format!("commitfs remount: {x}"))?;
            let mut got = vec![0u8; buf.len() + 1];
            for i in 0..run.files {
                let a = fs
                    .lookup(ROOT_INO, format!("f{i}").as_bytes())
                    .map_err(|x| e("lookup after remount", i, x))?;
                let r = fs.read(a.ino, 0, &mut got).map_err(|x| e("read", i, x))?;
                if a.size != buf.len() as u64 || r != buf.len() || got[..r] != buf[..] {
                    return Err(format!(
                        "after remount f{i} has size {} ({r} bytes read), expected the payload",
                        a.size
                    ));
                }
            }
            fs.unmount().map_err(|x| format!("ro unmount: {x}"))?;
        }
        self.mount("ro")?;
        let r = self.check_files_kernel(run.files);
        self.umount()?;
        r.map_err(|x| format!("kernel mount of commitfs's result: {x}"))?;
        self.tracer().clear()?;
        Ok(())
    }
}

/// The 4 KiB appended to every file.
fn payload() -> Vec<u8> {
    (0..4096u32).map(|i| (i * 7 + 13) as u8).collect()
}

/// Problem lines of `e2fsck -fn DEV` (empty = clean); exit code must be 0.
fn e2fsck(dev: &str) -> R<String> {
    let out = Command::new("e2fsck")
        .arg("-fn")
        .arg(dev)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("e2fsck: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let problems: Vec<String> = commitfs::testutil::problem_lines(&text)
        .into_iter()
        .filter(|l| {
            !(l.contains(" files (") && l.contains("non-contiguous), ") && l.ends_with(" blocks"))
        })
        .collect();
    if out.status.code() != Some(0) || !problems.is_empty() {
        return Ok(format!("(exit {:?})\n{text}", out.status.code()));
    }
    Ok(String::new())
}

impl Drop for Rig {
    fn drop(&mut self) {
        if self.mounted {
            if let Err(e) = self.umount() {
                eprintln!("warning: umount {}: {e}; lazy unmount", self.mnt.display());
                let _ = run_cmd(Command::new("umount").arg("-l").arg(&self.mnt));
                self.mounted = false;
            }
        }
        // Tracing first: nothing of ours stays enabled whatever else fails.
        self.tracer = None;
        if !self.dev.is_empty() {
            let mut ok = false;
            for _ in 0..50 {
                if run_cmd(Command::new("losetup").arg("-d").arg(&self.dev)).is_ok() {
                    ok = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if !ok {
                eprintln!("warning: could not detach {}", self.dev);
            }
            // Detaching completes asynchronously: wait until the image is free.
            for _ in 0..200 {
                match run_cmd(Command::new("losetup").arg("-j").arg(&self.image)) {
                    Ok(o) if !o.trim().is_empty() => std::thread::sleep(Duration::from_millis(10)),
                    _ => break,
                }
            }
        }
        let _ = std::fs::remove_file(&self.image);
        let _ = std::fs::remove_dir(&self.mnt);
    }
}

// ---------------------------------------------------------------- the sweep

/// All runs of a sweep, keyed by (system, n).
#[derive(Debug, Default, Clone)]
pub struct Sweep {
    pub runs: BTreeMap<(System, usize), Run>,
    pub device: String,
    pub image_dir: PathBuf,
}

impl Sweep {
    pub fn get(&self, s: System, n: usize) -> Option<&Run> {
        self.runs.get(&(s, n))
    }
}

/// Run `systems` for every n of `cfg` on one rig; `progress` gets each run.
pub fn sweep(cfg: &Config, systems: &[System], mut progress: impl FnMut(&Run)) -> R<Sweep> {
    let mut rig = Rig::new(cfg.clone())?;
    let mut out = Sweep {
        device: rig.device().to_string(),
        image_dir: cfg.image_dir.clone(),
        ..Default::default()
    };
    for &n in &cfg.ns {
        if n == 0 || !cfg.files.is_multiple_of(n) {
            return Err(format!("n = {n} must divide the file count {}", cfg.files));
        }
        for &s in systems {
            let r = rig
                .run(s, n)
                .map_err(|e| format!("{} at n = {n}: {e}", s.label()))?;
            progress(&r);
            out.runs.insert((s, n), r);
        }
    }
    Ok(out)
}

/// The benchmark table: one row per (n, system).
pub fn table(sw: &Sweep) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>5} {:>6}  {:<22} {:>11} {:>11} {:>9} {:>9} {:>5} {:>5} {:>6} {:>9} {:>9}",
        "n",
        "fsyncs",
        "system",
        "jKiB/fs dev",
        "jKiB/fs own",
        "fl/fs dev",
        "fl/fs own",
        "full",
        "fast",
        "1blk%",
        "wall ms",
        "fsyncs/s"
    );
    let mut last_n = None;
    for r in by_n(sw) {
        if last_n.is_some() && last_n != Some(r.n) {
            s.push('\n');
        }
        last_n = Some(r.n);
        let _ = writeln!(
            s,
            "{:>5} {:>6}  {:<22} {:>11.2} {:>11.2} {:>9.3} {:>9.3} {:>5} {:>5} {:>6.1} {:>9.1} {:>9.0}",
            r.n,
            r.fsyncs,
            r.label(),
            r.journal_kib_per_fsync_dev(),
            r.journal_kib_per_fsync_own(),
            r.flushes_per_fsync(),
            r.per_fsync(r.flushes_own),
            r.full_commits,
            r.fast_commits,
            r.single_block_pct(),
            r.wall.as_secs_f64() * 1e3,
            r.fsyncs_per_sec()
        );
    }
    s
}

/// Sort the runs by n first (the table reads per n).
pub fn by_n(sw: &Sweep) -> Vec<&Run> {
    let mut v: Vec<&Run> = sw.runs.values().collect();
    v.sort_by_key(|r| (r.n, r.system));
    v
}

/// A detail table (per run: raw counts behind the per-fsync figures). `wrKiB
/// dev` is everything written to the device in the window: commitfs writes file
/// data at `write` time, the kernel only the data of files it must make durable
/// (the others stay delayed-allocation in its page cache).
pub fn detail(sw: &Sweep) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>5}  {:<22} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>6} {:>9}  fallbacks",
        "n",
        "system",
        "jKiB dev",
        "jKiB own",
        "jbd2 KiB",
        "fc KiB",
        "fl dev",
        "fl own",
        "fl trc",
        "fcblk",
        "wrKiB dev"
    );
    for r in by_n(sw) {
        let _ = writeln!(
            s,
            "{:>5}  {:<22} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7} {:>6} {:>9}  {:?}",
            r.n,
            r.label(),
            r.journal_bytes_dev / 1024,
            r.journal_bytes_own / 1024,
            r.jbd2_bytes_own / 1024,
            r.fc_bytes_own / 1024,
            r.flushes_dev,
            r.flushes_own,
            r.flushes_traced,
            r.fc_blocks,
            r.write_bytes_dev / 1024,
            r.fc_fallback_reasons
        );
    }
    s
}
