//! `commitfs mount IMAGE DIR [-o OPTS] [--foreground]`.
//!
//! Without `--foreground` the command starts itself again as the daemon, which opens
//! the image, mounts the FUSE session and only then tells the parent, on its stdout,
//! that the mount is usable (or why it failed); the parent exits 0 or non-zero with
//! the message. `commitfs umount DIR` (which waits), `umount DIR`, `fusermount3 -u
//! DIR` or SIGINT/SIGTERM make the daemon write everything home (`Fs::unmount`) and
//! exit 0.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use commitfs_fs::{AtimeMode, Fs, MountOptions};
use commitfs_fuse::FuseConfig;
use nix::mount::MntFlags;
use nix::sys::signal::{SigSet, Signal};

use super::logging::{self, LogSink};

/// Options given with `-o`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountCmdOptions {
    pub read_only: bool,
    /// `commit=N` seconds.
    pub commit: u32,
    pub writeback_cache: bool,
    /// `noreaddirplus`: plain READDIR only.
    pub noreaddirplus: bool,
    /// `io_uring` / `noio_uring`: serve FUSE over io_uring (one ring per
    /// CPU); `None`: when the kernel allows it.
    pub io_uring: Option<bool>,
    pub allow_other: bool,
    /// `nofast_commit`: full JBD2 commits only, even on `fast_commit` images.
    pub no_fast_commit: bool,
    /// `fast_commit`: write fast commits (the default; accepted for symmetry).
    pub fast_commit: bool,
    /// `fc_data_csum`: checksum fsynced data in the fast-commit log (one flush).
    pub fc_data_csum: bool,
    /// `errors=continue|remount-ro|panic`; `None`: the superblock's `s_errors`.
    pub errors: Option<commitfs_fs::ErrorsBehavior>,
    /// `noacl`: no POSIX ACLs (`acl`, the default, turns them back on).
    pub noacl: bool,
    /// `strictatime` / `relatime` (default) / `noatime`.
    pub atime: AtimeMode,
    /// `nodiratime`: directories keep their atime.
    pub nodiratime: bool,
    /// `lazytime`: atime updates are written lazily.
    pub lazytime: bool,
    /// `nodev`: device nodes cannot be opened (`dev`, the default, for root).
    pub nodev: bool,
    /// `nosuid`: setuid/setgid bits are ignored on exec (`suid` is the default).
    pub nosuid: bool,
    /// `keep_privileges`: a root daemon keeps root instead of sandboxing its
    /// worker (crate::sandbox).
    pub keep_privileges: bool,
    /// `sandbox_user=NAME|UID`: whom the sandboxed worker runs as (`nobody`).
    pub sandbox_user: Option<String>,
    /// `max_inflight=N`, `max_versions=N`, `min_batch_time=US`,
    /// `max_batch_time=US`: the journal's commit pipeline (CJFS).
    pub pipeline: commitfs_journal::PipelineOptions,
    /// `threads=N`: FUSE event-loop threads (default `min(16, ncpu)`).
    pub threads: Option<usize>,
    /// `fsync_threads=N`: threads serving fsyncs (default 2 × threads, at least 32).
    pub fsync_threads: Option<usize>,
    /// `fuse_poll=US`: serving `/dev/fuse`, one event loop keeps reading this
    /// long after each request before it sleeps (0: never).
    pub fuse_poll_us: u64,
    /// `nocache`: no page cache in the daemon (file data written at `write()`).
    pub nocache: bool,
    /// `cache_size=MiB`: memory for all of the daemon's caches together.
    pub cache_mb: u32,
    /// `data_order=prefix|file` (see [`commitfs_fs::DataOrder`]).
    pub data_order: commitfs_fs::DataOrder,
    /// `read_ahead_kb=N`: the kernel's readahead on this mount (root only;
    /// default 1024, 0 keeps the kernel's 128).
    pub read_ahead_kb: u32,
}

/// `read_ahead_kb` unless told otherwise: a FUSE read request carries at most
/// 1 MiB (the kernel's `max_pages_limit`), and the 128 KiB the kernel grants a
/// FUSE mount makes every sequential read a round trip per 128 KiB (measured:
/// 306 MB/s reading a 1 GiB file, 1.8 GB/s at 1024).
pub const DEFAULT_READ_AHEAD_KB: u32 = 1024;

impl Default for MountCmdOptions {
    fn default() -> Self {
        MountCmdOptions {
            read_only: false,
            commit: MountOptions::default().commit_interval,
            writeback_cache: false,
            noreaddirplus: false,
            io_uring: None,
            allow_other: false,
            no_fast_commit: false,
            fast_commit: false,
            fc_data_csum: false,
            errors: None,
            noacl: false,
            atime: AtimeMode::default(),
            nodiratime: false,
            lazytime: false,
            nodev: false,
            nosuid: false,
            keep_privileges: false,
            sandbox_user: None,
            pipeline: Default::default(),
            threads: None,
            fsync_threads: None,
            fuse_poll_us: commitfs_fuse::DEFAULT_POLL_US,
            nocache: false,
            cache_mb: default_cache_mb(),
            data_order: Default::default(),
            read_ahead_kb: DEFAULT_READ_AHEAD_KB,
        }
    }
}

/// The mount's default `cache_size=` (MiB): a sixteenth of the machine's
/// memory, at least the library's default (256) and at most 4 GiB. The
/// kernel's page cache grows with the machine (its dirty limits are 10-20 % of
/// memory); a fixed 256 MiB left 64 MiB for dirty data, so with
/// `data_order=file` dbench's files were written back under pressure instead of
/// being deleted first (docs/ARCHITECTURE.md "Per-file data ordering").
/// Unlike the kernel's, this memory cannot be reclaimed under pressure: hence
/// the small share and the cap.
pub fn default_cache_mb() -> u32 {
    let floor = MountOptions::default().cache_mb;
    // SAFETY: sysinfo fills the struct it is given and touches nothing else.
    let total = unsafe {
        let mut si: libc::sysinfo = std::mem::zeroed();
        if libc::sysinfo(&mut si) != 0 {
            return floor;
        }
        (si.totalram as u64).saturating_mul(si.mem_unit.max(1) as u64)
    };
    ((total >> 20) / 16).clamp(floor as u64, 4096) as u32
}

/// Parse `-o` values (each may hold several comma-separated options).
pub fn parse_options(values: &[String]) -> Result<MountCmdOptions> {
    let mut o = MountCmdOptions::default();
    for opt in values
        .iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        match opt {
            "ro" => o.read_only = true,
            "rw" => o.read_only = false,
            "writeback_cache" => o.writeback_cache = true,
            "noreaddirplus" => o.noreaddirplus = true,
            "readdirplus" => o.noreaddirplus = false,
            "io_uring" => o.io_uring = Some(true),
            "noio_uring" => o.io_uring = Some(false),
            "allow_other" => o.allow_other = true,
            "nofast_commit" => o.no_fast_commit = true,
            "fast_commit" => o.fast_commit = true,
            "fc_data_csum" => o.fc_data_csum = true,
            "errors=continue" => o.errors = Some(commitfs_fs::ErrorsBehavior::Continue),
            "errors=remount-ro" => o.errors = Some(commitfs_fs::ErrorsBehavior::RemountRo),
            "errors=panic" => o.errors = Some(commitfs_fs::ErrorsBehavior::Panic),
            "acl" => o.noacl = false,
            "noacl" => o.noacl = true,
            // Copied from ext4 fstab lines: user xattrs are always on; data is
            // always written before the metadata that points at it is committed
            // (data=ordered), which is also at least what data=writeback promises.
            "user_xattr" | "data=ordered" | "data=writeback" => {}
            // commitfs always flushes at commit and never discards: accepting these
            // keeps copied fstab lines working and changes nothing (see README).
            "barrier" | "barrier=1" | "nobarrier" | "barrier=0" | "discard" | "nodiscard" => {}
            // For mount(8), systemd and mount.fuse3, not for the file system.
            "auto" | "noauto" | "nofail" | "_netdev" | "user" | "nouser" | "users" | "owner"
            | "group" | "subtype=commitfs" | "loop" => {}
            "nouser_xattr" => bail!(
                "mount option \"nouser_xattr\" is not supported: user extended attributes \
                 are always on (as in current kernels)"
            ),
            "data=journal" => bail!(
                "mount option \"data=journal\" is not supported: commitfs journals metadata \
                 only (data=ordered)"
            ),
            _ if opt.starts_with("x-") || opt.starts_with("comment=") => {}
            "strictatime" => o.atime = AtimeMode::Strict,
            "relatime" => o.atime = AtimeMode::Relative,
            "noatime" => o.atime = AtimeMode::Never,
            "nodiratime" => o.nodiratime = true,
            "diratime" => o.nodiratime = false,
            "lazytime" => o.lazytime = true,
            "nolazytime" => o.lazytime = false,
            "nodev" => o.nodev = true,
            "dev" => o.nodev = false,
            "nosuid" => o.nosuid = true,
            "suid" => o.nosuid = false,
            "keep_privileges" => o.keep_privileges = true,
            "nocache" => o.nocache = true,
            "cache" => o.nocache = false,
            "data_order=prefix" => o.data_order = commitfs_fs::DataOrder::Prefix,
            "data_order=file" => o.data_order = commitfs_fs::DataOrder::File,
            // ext4's default: with data_order=file, renaming a file over an
            // existing one writes the renamed file's data back first.
            "auto_da_alloc" => {}
            "noauto_da_alloc" => bail!(
                "mount option \"noauto_da_alloc\" is not supported: a rename over an \
                 existing file always writes the renamed file's cached data first"
            ),
            // Always on / the default anyway.
            "defaults" | "default_permissions" | "async" | "exec" => {}
            _ => {
                if let Some(v) = opt.strip_prefix("sandbox_user=") {
                    o.sandbox_user = Some(v.to_string());
                } else if opt
                    .split_once('=')
                    .map(|(k, v)| o.pipeline.set(k, v))
                    .transpose()?
                    .unwrap_or(false)
                {
                    // A pipeline option (max_inflight, max_versions,
                    // min_batch_time, max_batch_time), applied.
                } else if let Some(v) = opt.strip_prefix("cache_size=") {
                    o.cache_mb = match v.parse::<u32>() {
                        Ok(n) if (1..=1 << 20).contains(&n) => n,
                        _ => bail!("bad mount option {opt:?}: cache_size=MiB (1 to 1048576)"),
                    };
                } else if let Some(v) = opt.strip_prefix("read_ahead_kb=") {
                    o.read_ahead_kb = match v.parse::<u32>() {
                        Ok(n) if n <= 1 << 20 => n,
                        _ => bail!("bad mount option {opt:?}: read_ahead_kb=KiB (0 to 1048576)"),
                    };
                } else if let Some(v) = opt.strip_prefix("threads=") {
                    o.threads = Some(thread_count(opt, v)?);
                } else if let Some(v) = opt.strip_prefix("fsync_threads=") {
                    o.fsync_threads = Some(thread_count(opt, v)?);
                } else if let Some(v) = opt.strip_prefix("fuse_poll=") {
                    o.fuse_poll_us = match v.parse::<u64>() {
                        Ok(n) if n <= 100_000 => n,
                        _ => bail!("bad mount option {opt:?}: fuse_poll=US (0 to 100000)"),
                    };
                } else if let Some(v) = opt.strip_prefix("commit=") {
                    let n: u32 = v
                        .parse()
                        .map_err(|_| anyhow!("bad mount option {opt:?}: commit=SECONDS"))?;
                    // The kernel treats 0 as "the default".
                    o.commit = if n == 0 {
                        MountOptions::default().commit_interval
                    } else {
                        n
                    };
                } else {
                    bail!(
                        "unknown mount option {opt:?} (supported: ro, rw, commit=N, \
                         writeback_cache, readdirplus, noreaddirplus, io_uring, noio_uring, \
                         allow_other, fast_commit, \
                         nofast_commit, fc_data_csum, \
                         errors=continue|remount-ro|panic, acl, noacl, strictatime, relatime, \
                         noatime, nodiratime, lazytime, dev, nodev, suid, nosuid, \
                         keep_privileges, sandbox_user=USER, threads=N, fsync_threads=N, fuse_poll=US, \
                         cache, nocache, cache_size=MiB, read_ahead_kb=N, \
                         max_inflight=N, max_versions=N, min_batch_time=US, max_batch_time=US, \
                         and from ext4 fstab lines user_xattr, data=ordered, barrier, discard)"
                    );
                }
            }
        }
    }
    Ok(o)
}

/// A thread count of `threads=` / `fsync_threads=`: 1 to 256.
fn thread_count(opt: &str, v: &str) -> Result<usize> {
    match v.parse::<usize>() {
        Ok(n) if (1..=256).contains(&n) => Ok(n),
        _ => bail!("bad mount option {opt:?}: a thread count from 1 to 256"),
    }
}

/// Everything `commitfs mount` was asked.
#[derive(Debug, Clone)]
pub struct MountRequest {
    pub image: PathBuf,
    pub dir: PathBuf,
    pub options: MountCmdOptions,
    /// The `-o` values as given (handed on to the daemon process).
    pub raw_options: Vec<String>,
    pub foreground: bool,
    pub pid_file: Option<PathBuf>,
    pub log_file: Option<PathBuf>,
    /// This process is the daemon started by a `commitfs mount` without
    /// `--foreground`: report the outcome on stdout, then detach.
    pub daemon_child: bool,
}

/// `commitfs mount`.
pub fn run(req: &MountRequest) -> Result<()> {
    check_mount_point(&req.dir)?;
    let image = std::fs::canonicalize(&req.image)
        .with_context(|| format!("image {}", req.image.display()))?;
    let dir = std::fs::canonicalize(&req.dir)
        .with_context(|| format!("mount point {}", req.dir.display()))?;
    if !dir.is_dir() {
        bail!("mount point {} is not a directory", dir.display());
    }
    // Stacking a second mount on a live one hides the first; almost always a mistake.
    if let Ok(Some(m)) = super::umount::find_mount(&dir) {
        if m.fstype == "fuse.commitfs" {
            bail!(
                "{} is already a commitfs mount (of {}); `commitfs umount {}` first",
                dir.display(),
                m.source,
                dir.display()
            );
        }
    }
    let abs = |p: &Option<PathBuf>| -> Result<Option<PathBuf>> {
        Ok(match p {
            Some(p) if p.is_relative() => Some(std::env::current_dir()?.join(p)),
            other => other.clone(),
        })
    };
    let req = MountRequest {
        image,
        dir,
        pid_file: abs(&req.pid_file)?,
        log_file: abs(&req.log_file)?,
        ..req.clone()
    };
    if req.daemon_child {
        daemon_main(&req)
    } else if req.foreground {
        logging::init(&LogSink::for_foreground(req.log_file.as_deref()), false)?;
        serve(&req, |_| Ok(()))
    } else {
        spawn_daemon(&req)
    }
}

/// The kernel's readahead knob of a mount (`/sys/class/bdi/MAJ:MIN/read_ahead_kb`),
/// opened before the sandbox (root only) and written once the kernel processed
/// the FUSE INIT reply, which lowers readahead to the `max_readahead` it carries.
struct ReadAhead {
    file: std::fs::File,
    knob: String,
    kb: u32,
    dir: PathBuf,
}

impl ReadAhead {
    /// Best effort: `None` when `kb` is 0 or the knob cannot be opened.
    fn open(dir: &Path, kb: u32) -> Option<ReadAhead> {
        if kb == 0 {
            return None;
        }
        let dev = super::umount::find_mount(dir).ok()??.dev;
        let knob = format!("/sys/class/bdi/{dev}/read_ahead_kb");
        match std::fs::OpenOptions::new().write(true).open(&knob) {
            Ok(file) => Some(ReadAhead {
                file,
                knob,
                kb,
                dir: dir.to_path_buf(),
            }),
            Err(e) => {
                tracing::debug!("{knob}: {e}; readahead stays the kernel's");
                None
            }
        }
    }

    /// Write the knob on a thread once a stat of the mount point returns (the
    /// kernel holds requests until INIT is done). Start it only once the
    /// sandbox is entered: a thread waiting for a FUSE answer cannot take the
    /// signal glibc's setresuid sends every thread, and the answer would need
    /// the event loops that start after it.
    fn start(self) {
        let _ = std::thread::Builder::new()
            .name("commitfs-ra".into())
            .spawn(move || {
                use std::io::Write;
                let ReadAhead {
                    mut file,
                    knob,
                    kb,
                    dir,
                } = self;
                let _ = std::fs::metadata(&dir);
                match file.write_all(format!("{kb}\n").as_bytes()) {
                    Ok(()) => tracing::info!("readahead {kb} KiB ({knob})"),
                    Err(e) => tracing::warn!("{knob}: {e}; readahead stays the kernel's"),
                }
            });
    }
}

/// Refuse a mount point that is a FUSE mount whose daemon has died (every access
/// fails with ENOTCONN), saying how to clean it up.
fn check_mount_point(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => bail!(
            "{}: {e}: a FUSE mount whose daemon has died is still attached there.\n\
             Clean it up with `commitfs umount {}` (or `fusermount3 -uz {}`), then mount \
             again. If it was a commitfs mount, its image was not unmounted cleanly: the next \
             mount recovers it from the journal (what was fsynced is kept).",
            dir.display(),
            dir.display(),
            dir.display()
        ),
        _ => Ok(()),
    }
}

/// Signals that unmount the file system.
fn term_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        set.add(s);
    }
    set
}

/// Open the image, mount, call `on_mounted` once the kernel can use the mount, then
/// serve until unmounted and write everything home.
fn serve(req: &MountRequest, on_mounted: impl FnOnce(&MountRequest) -> Result<()>) -> Result<()> {
    // A root daemon sandboxes the process that parses the image and serves
    // requests; the privileged monitor forked here never returns.
    let sandbox = crate::sandbox::plan(
        req.options.keep_privileges,
        req.options.sandbox_user.as_deref(),
    )?;
    if sandbox.is_some() {
        crate::sandbox::fork_monitor(&req.dir, req.foreground)?;
    }
    // Block the termination signals before any thread exists, so every thread
    // inherits the mask and only the sigwait thread below sees them.
    let set = term_signals();
    set.thread_block().context("blocking signals")?;
    let o = &req.options;
    let fs = Fs::open_path(
        &req.image,
        MountOptions {
            read_only: o.read_only,
            commit_interval: o.commit,
            fast_commit: !o.no_fast_commit,
            fc_data_csum: o.fc_data_csum && !o.no_fast_commit,
            errors: o.errors,
            acl: !o.noacl,
            atime: o.atime,
            nodiratime: o.nodiratime,
            lazytime: o.lazytime,
            pipeline: o.pipeline,
            page_cache: !o.nocache,
            cache_mb: o.cache_mb,
            data_order: o.data_order,
        },
    )
    .map_err(|e| anyhow!("cannot mount {}: {e}", req.image.display()))?;
    let fs = Arc::new(fs);
    // errors=panic: stop serving at once, like a kernel panic (the mount is left
    // dead; the journal is recovered at the next mount).
    fs.on_shutdown(|| {
        tracing::error!("errors=panic: commitfs daemon exiting after an I/O error");
        std::process::exit(2);
    });
    let threads = o.threads.unwrap_or_else(commitfs_fuse::default_threads);
    let cfg = FuseConfig {
        read_only: o.read_only || fs.is_read_only(),
        writeback_cache: o.writeback_cache && !o.read_only,
        readdirplus: !o.noreaddirplus,
        io_uring: o.io_uring != Some(false),
        io_uring_asked: o.io_uring == Some(true),
        allow_other: o.allow_other,
        fsname: req.image.display().to_string().replace(',', "_"),
        acl: !o.noacl,
        dev: !o.nodev,
        suid: !o.nosuid,
        threads: o.threads,
        fsync_threads: o.fsync_threads.unwrap_or((2 * threads).max(32)),
        poll_us: o.fuse_poll_us,
    };
    // Live counters for `commitfs stats DIR` (not fatal if the socket fails),
    // served before the mount appears: a user (or test) that sees the mount
    // may ask at once.
    let stats_server = super::stats::serve(fs.clone(), &req.dir)
        .map_err(|e| tracing::warn!("stats socket unavailable: {e:#}"))
        .ok();
    if stats_server.is_some() {
        crate::sandbox::notify_stats_socket();
    }
    let mut session = commitfs_fuse::mount(fs.clone(), &req.dir, &cfg)
        .map_err(|e| anyhow!("FUSE mount at {} failed: {e}", req.dir.display()))?;
    let mut unmounter = session.unmounter();
    let dir = req.dir.clone();
    std::thread::Builder::new()
        .name("commitfs-signals".into())
        .spawn(move || loop {
            let Ok(sig) = set.wait() else {
                continue;
            };
            if crate::sandbox::forward_signal(sig as i32) {
                continue;
            }
            tracing::info!("{sig}: unmounting {}", dir.display());
            if let Err(e) = unmounter.unmount() {
                // Busy (open files): normal for a signal; the session ends when the
                // last user leaves.
                tracing::info!("unmount: {e}; detaching lazily");
                lazy_unmount(&dir);
            }
        })
        .context("starting the signal thread")?;
    tracing::info!(
        "mounted {} at {}{}",
        req.image.display(),
        req.dir.display(),
        if cfg.read_only { " (read-only)" } else { "" }
    );
    if let Some(st) = &stats_server {
        st.attach(session.stats());
    }
    let read_ahead = ReadAhead::open(&req.dir, req.options.read_ahead_kb);
    crate::sandbox::notify_mounted();
    on_mounted(req)?;
    // fuser clones its /dev/fuse descriptors when the session starts, which the
    // sandbox forbids: enter it once they are cloned, before any request is served.
    let r = match sandbox {
        Some(id) => session.run_with(|| {
            crate::sandbox::enter(id).map_err(|e| format!("{e:#}"))?;
            if let Some(ra) = read_ahead {
                ra.start();
            }
            Ok::<(), String>(())
        }),
        None => {
            if let Some(ra) = read_ahead {
                ra.start();
            }
            session.run()
        }
    };
    let stats = fs.io_stats();
    tracing::info!(
        "unmounted {}: {} device writes ({} bytes), {} flushes",
        req.image.display(),
        stats.total_writes(),
        stats.total_write_bytes(),
        stats.flushes
    );
    r.map_err(|e| anyhow!("{}: {e}", req.image.display()))
}

/// Detach the mount even while busy (the session ends when the last user leaves).
fn lazy_unmount(dir: &Path) {
    if nix::mount::umount2(dir, MntFlags::MNT_DETACH).is_ok() {
        return;
    }
    let _ = std::process::Command::new("fusermount3")
        .arg("-uz")
        .arg(dir)
        .status();
}

/// The first line the daemon writes to its stdout once mounted.
const READY: &str = "OK";
/// Prefix of the daemon's failure report.
const FAILED: &str = "ERR ";

/// Start this program again as the daemon (`mount --daemon-child`, in a session of
/// its own) and wait until it reports on its stdout that the mount is usable, or
/// why it is not. Running a fresh process instead of forking this one needs no
/// unsafe code and no care about threads at fork time.
fn spawn_daemon(req: &MountRequest) -> Result<()> {
    let exe = std::env::current_exe().context("finding the commitfs executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("mount")
        .arg(&req.image)
        .arg(&req.dir)
        .arg("--daemon-child");
    for o in &req.raw_options {
        cmd.arg("-o").arg(o);
    }
    if let Some(p) = &req.pid_file {
        cmd.arg("--pid-file").arg(p);
    }
    if let Some(p) = &req.log_file {
        cmd.arg("--log-file").arg(p);
    }
    // stderr stays the caller's until the daemon detaches, so early messages show.
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the mount daemon")?;
    let mut msg = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut msg);
    }
    if msg.starts_with(READY) {
        // The daemon runs on; it is reparented to init when we exit.
        return Ok(());
    }
    let status = child.wait().context("waiting for the mount daemon")?;
    match msg.strip_prefix(FAILED) {
        Some(e) => bail!("{}", e.trim_end()),
        None => bail!("the mount daemon exited before mounting ({status})"),
    }
}

/// The daemon: detach from the terminal's session, serve, report to the parent.
fn daemon_main(req: &MountRequest) -> Result<()> {
    // Not a process-group leader (spawned into the parent's group), so this works;
    // it leaves the controlling terminal behind.
    let _ = nix::unistd::setsid();
    let mut report = Some(std::io::stdout());
    let sink = LogSink::for_daemon(req.log_file.as_deref());
    // Only until it detaches does a daemon logging to stderr have a terminal:
    // keep that quiet.
    let r = logging::init(&sink, sink == LogSink::Stderr).and_then(|()| {
        serve(req, |req| {
            if let Some(p) = &req.pid_file {
                std::fs::write(p, format!("{}\n", crate::sandbox::service_pid()))
                    .with_context(|| format!("pid file {}", p.display()))?;
            }
            if sink == LogSink::Stderr {
                eprintln!(
                    "commitfs: no journald or syslog socket: the daemon's log is discarded \
                     (--log-file FILE keeps it)"
                );
            } else {
                tracing::info!("logging to {}", sink.describe());
            }
            if let Some(mut w) = report.take() {
                let _ = writeln!(w, "{READY}");
                let _ = w.flush();
            }
            detach_stdio();
            Ok(())
        })
    });
    match r {
        Ok(()) => Ok(()),
        // Not mounted yet: the parent prints the message.
        Err(e) if report.is_some() => {
            let mut w = std::io::stdout();
            let _ = write!(w, "{FAILED}{e:#}");
            let _ = w.flush();
            std::process::exit(1);
        }
        Err(e) => {
            tracing::error!("{e:#}");
            Err(e)
        }
    }
}

/// Point stdin/stdout/stderr at /dev/null and leave the caller's directory.
fn detach_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = nix::unistd::dup2_stdin(&null);
        let _ = nix::unistd::dup2_stdout(&null);
        let _ = nix::unistd::dup2_stderr(&null);
    }
    let _ = std::env::set_current_dir("/");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(v: &[&str]) -> Result<MountCmdOptions> {
        parse_options(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn options() {
        let o = p(&["ro,commit=30", "writeback_cache"]).unwrap();
        assert!(o.read_only && o.writeback_cache && !o.allow_other);
        assert_eq!(o.commit, 30);
        let o = p(&["ro", "rw,allow_other,nofast_commit,fc_data_csum"]).unwrap();
        assert!(!o.read_only && o.allow_other && o.no_fast_commit && o.fc_data_csum);
        assert_eq!(p(&["commit=0"]).unwrap().commit, 5);
        assert!(p(&["commit=x"]).is_err());
        let o =
            p(&["max_inflight=2,max_versions=5,min_batch_time=100,max_batch_time=900"]).unwrap();
        assert_eq!((o.pipeline.max_inflight, o.pipeline.max_versions), (2, 5));
        assert_eq!(
            (o.pipeline.min_batch_us, o.pipeline.max_batch_us),
            (100, 900)
        );
        assert!(p(&["max_inflight=0"]).is_err());
        assert!(p(&["max_versions=x"]).is_err());
        let e = p(&["bogus"]).unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
        assert_eq!(p(&[]).unwrap(), MountCmdOptions::default());
        let o = p(&["keep_privileges,sandbox_user=daemon"]).unwrap();
        assert!(o.keep_privileges && o.sandbox_user.as_deref() == Some("daemon"));
        assert!(!MountCmdOptions::default().keep_privileges);
        let o = p(&["threads=8,fsync_threads=3"]).unwrap();
        assert_eq!((o.threads, o.fsync_threads), (Some(8), Some(3)));
        assert_eq!(p(&[]).unwrap().threads, None);
        assert_eq!(p(&[]).unwrap().fuse_poll_us, commitfs_fuse::DEFAULT_POLL_US);
        assert_eq!(p(&["fuse_poll=0"]).unwrap().fuse_poll_us, 0);
        assert_eq!(p(&["fuse_poll=2000"]).unwrap().fuse_poll_us, 2000);
        for bad in [
            "threads=0",
            "threads=x",
            "fsync_threads=257",
            "threads=",
            "fuse_poll=x",
            "fuse_poll=100001",
        ] {
            let e = p(&[bad]).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn errors_option() {
        use commitfs_fs::ErrorsBehavior as E;
        assert_eq!(p(&[]).unwrap().errors, None);
        assert_eq!(p(&["errors=continue"]).unwrap().errors, Some(E::Continue));
        assert_eq!(
            p(&["rw,errors=remount-ro"]).unwrap().errors,
            Some(E::RemountRo)
        );
        assert_eq!(p(&["errors=panic"]).unwrap().errors, Some(E::Panic));
        assert!(p(&["errors=explode"]).is_err());
    }

    #[test]
    fn acl_options() {
        assert!(!p(&[]).unwrap().noacl, "ACLs are on by default, as in ext4");
        assert!(p(&["noacl"]).unwrap().noacl);
        assert!(!p(&["noacl,acl"]).unwrap().noacl);
        assert!(p(&["acl", "rw,noacl"]).unwrap().noacl);
    }

    #[test]
    fn options_from_ext4_fstab_lines_and_mount_tools() {
        // Accepted, and change nothing we model.
        let o = p(&[
            "defaults,user_xattr,data=ordered,barrier,discard,noauto,nofail,_netdev",
            "users,x-systemd.automount,x-systemd.device-timeout=10,comment=x,subtype=commitfs",
            "barrier=1,nobarrier,nodiscard,data=writeback",
        ])
        .unwrap();
        assert_eq!(o, MountCmdOptions::default());
        // Refused by name, with the reason.
        for bad in ["data=journal", "nouser_xattr", "data=bogus", "subtype=ext4"] {
            let e = p(&[bad]).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
        assert!(p(&["data=journal"])
            .unwrap_err()
            .to_string()
            .contains("not supported"));
    }

    #[test]
    fn data_order_options() {
        use commitfs_fs::DataOrder;
        assert_eq!(p(&[]).unwrap().data_order, DataOrder::Prefix);
        assert_eq!(p(&["data_order=file"]).unwrap().data_order, DataOrder::File);
        assert_eq!(
            p(&["data_order=file,data_order=prefix,auto_da_alloc"])
                .unwrap()
                .data_order,
            DataOrder::Prefix
        );
        for bad in ["data_order=bogus", "noauto_da_alloc"] {
            let e = p(&[bad]).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn atime_and_device_options() {
        let d = p(&[]).unwrap();
        assert_eq!(d.atime, AtimeMode::Relative);
        assert!(!d.nodiratime && !d.lazytime && !d.nodev && !d.nosuid);
        let o = p(&["strictatime,nodiratime,lazytime,nodev,nosuid"]).unwrap();
        assert_eq!(o.atime, AtimeMode::Strict);
        assert!(o.nodiratime && o.lazytime && o.nodev && o.nosuid);
        let o = p(&["noatime", "nodev,dev,nosuid,suid,relatime"]).unwrap();
        assert_eq!(o.atime, AtimeMode::Relative);
        assert!(!o.nodev && !o.nosuid);
        assert_eq!(p(&["noatime"]).unwrap().atime, AtimeMode::Never);
    }
}
