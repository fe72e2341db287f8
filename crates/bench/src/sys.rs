//! Process, mount and loop-device helpers with guaranteed cleanup.
//!
//! Every resource the benchmark creates (image file, loop device, mount, nbdkit or
//! FUSE daemon) is registered here when created and unregistered when its guard
//! releases it. Guards release on drop (normal exit, error, panic); a signal thread
//! (SIGINT, SIGTERM, SIGHUP) releases whatever is still registered, newest first,
//! and exits with 130, so an interrupted run leaves no mount, loop device or
//! daemon behind. Children run in their own process group, so a terminal Ctrl-C
//! reaches only us and we tear things down in order (unmount before the device
//! under it disappears).
//!
//! This file is also compiled into `tests/bench_device.rs` (via `#[path]`), so it
//! depends on std, libc and anyhow only.

// Shared with tests/bench_device.rs, which uses a different subset.
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

type Action = Box<dyn FnOnce() + Send>;

static REGISTRY: Mutex<Vec<(u64, String, Action)>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> std::sync::MutexGuard<'static, Vec<(u64, String, Action)>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// A registered cleanup action; runs it on drop unless [`Cleanup::disarm`]ed.
pub struct Cleanup {
    id: u64,
}

impl Cleanup {
    pub fn new(what: impl Into<String>, f: impl FnOnce() + Send + 'static) -> Cleanup {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        registry().push((id, what.into(), Box::new(f)));
        Cleanup { id }
    }

    fn take(&self) -> Option<Action> {
        let mut r = registry();
        let pos = r.iter().position(|(i, _, _)| *i == self.id)?;
        Some(r.remove(pos).2)
    }

    /// Run the action now (at most once).
    pub fn run(&self) {
        if let Some(f) = self.take() {
            f();
        }
    }

    /// Forget the action (the resource was released by other means).
    pub fn disarm(&self) {
        drop(self.take());
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.run();
    }
}

/// Run every registered action, newest first (the signal path).
pub fn cleanup_all() {
    loop {
        let next = registry().pop();
        match next {
            Some((_, what, f)) => {
                eprintln!("commitfs bench: cleanup: {what}");
                f();
            }
            None => break,
        }
    }
}

fn term_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a local sigset_t.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Block the termination signals in this thread (call before any other thread is
/// started, so all inherit the mask) and start the thread that cleans up on them.
pub fn install_signal_cleanup() {
    let set = term_signals();
    // SAFETY: changing this thread's signal mask with a valid set.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    let _ = std::thread::Builder::new()
        .name("bench-signals".into())
        .spawn(move || loop {
            let mut sig = 0;
            // SAFETY: waiting for one of the blocked signals in `set`.
            if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                continue;
            }
            eprintln!("\ncommitfs bench: signal {sig}: cleaning up");
            cleanup_all();
            std::process::exit(130);
        });
}

/// A command whose child starts with the termination signals unblocked (they are
/// blocked in our threads) in a process group of its own.
pub fn command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(program);
    c.process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(|| {
            let set = term_signals();
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    c
}

/// Run a command to completion; error (with its stderr) unless it exits 0.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = command(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {program} (not installed?)"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Is `program` on PATH (or an existing path)?
pub fn have(program: &str) -> bool {
    if program.contains('/') {
        return Path::new(program).exists();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false)
}

/// A child process that is stopped (SIGTERM, then SIGKILL) on drop.
pub struct ChildGuard {
    pub pid: u32,
    _cleanup: Cleanup,
}

impl ChildGuard {
    pub fn spawn(mut cmd: Command, what: &str) -> Result<ChildGuard> {
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {what}"))?;
        Ok(ChildGuard::adopt(child, what))
    }

    pub fn adopt(child: Child, what: &str) -> ChildGuard {
        let pid = child.id();
        let child = Mutex::new(child);
        ChildGuard {
            pid,
            _cleanup: Cleanup::new(format!("stop {what} (pid {pid})"), move || {
                let mut c = child.lock().unwrap_or_else(|e| e.into_inner());
                stop_child(&mut c);
            }),
        }
    }

    /// Has the process exited (reaping it if so)?
    pub fn exited(&self) -> bool {
        !Path::new(&format!("/proc/{}", self.pid)).exists() || is_zombie(self.pid)
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit(')')
                .next()
                .map(|r| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

fn stop_child(c: &mut Child) {
    if let Ok(Some(_)) = c.try_wait() {
        return;
    }
    // SAFETY: signalling our own child by pid.
    unsafe {
        libc::kill(c.id() as i32, libc::SIGTERM);
    }
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
}

/// Wait until a process (not necessarily our child) has gone.
pub fn wait_pid_gone(pid: u32, timeout: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if !Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Is `dir` a mount point (listed in /proc/self/mounts)?
pub fn is_mounted(dir: &Path) -> bool {
    let Ok(m) = std::fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    let d = dir.to_string_lossy();
    // /proc/self/mounts escapes spaces as \040; our paths have none.
    m.lines().any(|l| l.split_whitespace().nth(1) == Some(&d))
}

/// A mount point at or below `dir`, if any.
pub fn mounted_below(dir: &Path) -> Option<String> {
    let m = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let d = dir.to_string_lossy().to_string();
    m.lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .find(|p| *p == d || p.starts_with(&format!("{d}/")))
        .map(str::to_string)
}

/// Unmount `dir`, retrying while busy; lazily detach as a last resort.
pub fn unmount(dir: &Path) -> Result<()> {
    let d = dir.to_string_lossy().to_string();
    let mut last = String::new();
    for _ in 0..50 {
        if !is_mounted(dir) {
            return Ok(());
        }
        match run("umount", &[&d]) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = run("umount", &["-l", &d]);
    Err(anyhow!("umount {d}: {last} (detached lazily)"))
}

/// A mounted file system, unmounted on drop.
pub struct MountGuard {
    pub dir: PathBuf,
    cleanup: Cleanup,
}

impl MountGuard {
    /// Take ownership of an existing mount at `dir`.
    pub fn adopt(dir: &Path) -> MountGuard {
        let d = dir.to_path_buf();
        MountGuard {
            dir: dir.to_path_buf(),
            cleanup: Cleanup::new(format!("umount {}", dir.display()), move || {
                if let Err(e) = unmount(&d) {
                    eprintln!("commitfs bench: {e}");
                }
            }),
        }
    }

    /// Unmount now, reporting failure.
    pub fn unmount(self) -> Result<()> {
        self.cleanup.disarm();
        unmount(&self.dir)
    }
}

/// A loop device attached to a file, detached on drop.
pub struct LoopDev {
    pub dev: PathBuf,
    cleanup: Cleanup,
}

impl LoopDev {
    /// `losetup -f --show` with direct I/O on (no second page cache between the
    /// device and its backing file: requests reach the backing store as issued).
    pub fn attach(file: &Path) -> Result<LoopDev> {
        let f = file.to_string_lossy().to_string();
        let mut last = String::new();
        // Other processes may grab the same free device between the kernel's
        // answer and our configure: retry.
        for _ in 0..10 {
            match run("losetup", &["-f", "--show", "--direct-io=on", &f]) {
                Ok(out) => {
                    let dev = PathBuf::from(out.trim());
                    let d = dev.clone();
                    return Ok(LoopDev {
                        dev,
                        cleanup: Cleanup::new(format!("losetup -d {}", d.display()), move || {
                            detach_loop(&d)
                        }),
                    });
                }
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("cannot attach a loop device to {f}: {last}")
    }

    /// The device's name under /sys/block (e.g. `loop3`).
    pub fn name(&self) -> String {
        self.dev
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    pub fn detach(self) {
        self.cleanup.run();
    }
}

fn detach_loop(dev: &Path) {
    let d = dev.to_string_lossy().to_string();
    for _ in 0..50 {
        if run("losetup", &["-d", &d]).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("commitfs bench: could not detach {d}");
}

/// A file or directory removed on drop.
pub struct TempPath {
    pub path: PathBuf,
    _cleanup: Cleanup,
}

impl TempPath {
    pub fn new(path: PathBuf) -> TempPath {
        let p = path.clone();
        TempPath {
            path,
            _cleanup: Cleanup::new(format!("remove {}", p.display()), move || {
                if p.is_dir() {
                    // Never recurse into something still mounted below it.
                    if let Some(m) = mounted_below(&p) {
                        eprintln!(
                            "commitfs bench: not removing {}: {} is still mounted",
                            p.display(),
                            m
                        );
                        return;
                    }
                    let _ = std::fs::remove_dir_all(&p);
                } else {
                    let _ = std::fs::remove_file(&p);
                }
            }),
        }
    }
}

/// Block-layer counters of `/sys/block/NAME/stat` (Documentation/block/stat.rst).
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockStat {
    pub reads: u64,
    pub read_sectors: u64,
    pub writes: u64,
    pub write_sectors: u64,
    pub discards: u64,
    pub flushes: u64,
}

pub fn block_stat(name: &str) -> Result<BlockStat> {
    let s = std::fs::read_to_string(format!("/sys/block/{name}/stat"))
        .with_context(|| format!("/sys/block/{name}/stat"))?;
    let v: Vec<u64> = s
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let g = |i: usize| v.get(i).copied().unwrap_or(0);
    Ok(BlockStat {
        reads: g(0),
        read_sectors: g(2),
        writes: g(4),
        write_sectors: g(6),
        discards: g(11),
        flushes: g(15),
    })
}
