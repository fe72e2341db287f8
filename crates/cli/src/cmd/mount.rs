//! `commitfs mount IMAGE DIR [-o OPTS] [--foreground]`.
//!
//! Without `--foreground` the command forks: the child (the daemon) opens the image,
//! mounts the FUSE session and only then tells the parent, through a pipe, that the
//! mount is usable (or why it failed); the parent exits 0 or non-zero with the
//! message. `umount DIR`, `fusermount3 -u DIR` or SIGINT/SIGTERM make the daemon
//! write everything home (`Fs::unmount`) and exit 0.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use commitfs_fs::{Fs, MountOptions};
use commitfs_fuse::FuseConfig;

/// Options given with `-o`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountCmdOptions {
    pub read_only: bool,
    /// `commit=N` seconds.
    pub commit: u32,
    pub writeback_cache: bool,
    pub allow_other: bool,
    /// `nofast_commit`: full JBD2 commits only, even on `fast_commit` images.
    pub no_fast_commit: bool,
    /// `fast_commit`: write fast commits (the default; accepted for symmetry).
    pub fast_commit: bool,
    /// `fc_data_csum`: checksum fsynced data in the fast-commit log (one flush).
    pub fc_data_csum: bool,
    /// `keep_privileges`: a root daemon keeps root instead of sandboxing its
    /// worker (crate::sandbox).
    pub keep_privileges: bool,
    /// `sandbox_user=NAME|UID`: whom the sandboxed worker runs as (`nobody`).
    pub sandbox_user: Option<String>,
}

impl Default for MountCmdOptions {
    fn default() -> Self {
        MountCmdOptions {
            read_only: false,
            commit: MountOptions::default().commit_interval,
            writeback_cache: false,
            allow_other: false,
            no_fast_commit: false,
            fast_commit: false,
            fc_data_csum: false,
            keep_privileges: false,
            sandbox_user: None,
        }
    }
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
            "allow_other" => o.allow_other = true,
            "nofast_commit" => o.no_fast_commit = true,
            "fast_commit" => o.fast_commit = true,
            "fc_data_csum" => o.fc_data_csum = true,
            "keep_privileges" => o.keep_privileges = true,
            // Always on / the default anyway.
            "defaults" | "default_permissions" | "async" | "dev" | "suid" | "exec" => {}
            _ => {
                if let Some(v) = opt.strip_prefix("sandbox_user=") {
                    o.sandbox_user = Some(v.to_string());
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
                         writeback_cache, allow_other, fast_commit, nofast_commit, fc_data_csum, \
                         keep_privileges, sandbox_user=USER)"
                    );
                }
            }
        }
    }
    Ok(o)
}

/// Everything `commitfs mount` was asked.
#[derive(Debug, Clone)]
pub struct MountRequest {
    pub image: PathBuf,
    pub dir: PathBuf,
    pub options: MountCmdOptions,
    pub foreground: bool,
    pub pid_file: Option<PathBuf>,
    pub log_file: Option<PathBuf>,
}

/// `commitfs mount`.
pub fn run(req: &MountRequest) -> Result<()> {
    let image = std::fs::canonicalize(&req.image)
        .with_context(|| format!("image {}", req.image.display()))?;
    let dir = std::fs::canonicalize(&req.dir)
        .with_context(|| format!("mount point {}", req.dir.display()))?;
    if !dir.is_dir() {
        bail!("mount point {} is not a directory", dir.display());
    }
    let req = MountRequest {
        image,
        dir,
        ..req.clone()
    };
    if req.foreground {
        init_logging(req.log_file.as_deref(), "info")?;
        serve(&req, |_| Ok(()))
    } else {
        daemonize(&req)
    }
}

fn init_logging(file: Option<&Path>, default_level: &str) -> Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("COMMITFS_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new(default_level));
    let b = tracing_subscriber::fmt().with_env_filter(filter);
    let r = match file {
        Some(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("log file {}", p.display()))?;
            b.with_ansi(false)
                .with_writer(std::sync::Mutex::new(f))
                .try_init()
        }
        None => b.with_writer(std::io::stderr).try_init(),
    };
    // Already initialised (e.g. by a test harness): keep that one.
    drop(r);
    Ok(())
}

/// Signals that unmount the file system.
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
    // SAFETY: changing this thread's signal mask with a valid set.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    let o = &req.options;
    let fs = Fs::open_path(
        &req.image,
        MountOptions {
            read_only: o.read_only,
            commit_interval: o.commit,
            fast_commit: !o.no_fast_commit,
            fc_data_csum: o.fc_data_csum && !o.no_fast_commit,
        },
    )
    .map_err(|e| anyhow!("cannot mount {}: {e}", req.image.display()))?;
    let fs = Arc::new(fs);
    let cfg = FuseConfig {
        read_only: o.read_only || fs.is_read_only(),
        writeback_cache: o.writeback_cache && !o.read_only,
        allow_other: o.allow_other,
        fsname: req.image.display().to_string().replace(',', "_"),
        ..FuseConfig::default()
    };
    let mut session = commitfs_fuse::mount(fs.clone(), &req.dir, &cfg)
        .map_err(|e| anyhow!("FUSE mount at {} failed: {e}", req.dir.display()))?;
    let mut unmounter = session.unmounter();
    let dir = req.dir.clone();
    std::thread::Builder::new()
        .name("commitfs-signals".into())
        .spawn(move || loop {
            let mut sig = 0;
            // SAFETY: waiting for one of the blocked signals in `set`.
            let r = unsafe { libc::sigwait(&set, &mut sig) };
            if r != 0 {
                continue;
            }
            if crate::sandbox::forward_signal(sig) {
                continue;
            }
            tracing::info!("signal {sig}: unmounting {}", dir.display());
            if let Err(e) = unmounter.unmount() {
                tracing::warn!("unmount failed ({e}); detaching lazily");
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
    // Live counters for `commitfs stats DIR` (not fatal if the socket fails).
    let _stats = super::stats::serve(fs.clone(), &req.dir)
        .map_err(|e| tracing::warn!("stats socket unavailable: {e:#}"))
        .ok();
    crate::sandbox::notify_mounted();
    on_mounted(req)?;
    if let Some(id) = sandbox {
        crate::sandbox::enter(id)?;
    }
    let r = session.run();
    let stats = fs.io_stats();
    tracing::info!(
        "unmounted: {} device writes ({} bytes), {} flushes",
        stats.total_writes(),
        stats.total_write_bytes(),
        stats.flushes
    );
    r.map_err(|e| anyhow!("{}: {e}", req.image.display()))
}

/// Detach the mount even while busy (the session ends when the last user leaves).
fn lazy_unmount(dir: &Path) {
    if let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) {
        // SAFETY: umount2 with a valid NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
            return;
        }
    }
    let _ = std::process::Command::new("fusermount3")
        .arg("-uz")
        .arg(dir)
        .status();
}

/// Fork; the child serves, the parent waits until the child reports the mount
/// usable (exit 0) or failed (error with the child's message).
fn daemonize(req: &MountRequest) -> Result<()> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("pipe");
    }
    // SAFETY: the process is single-threaded here (nothing has spawned a thread
    // yet), so the child may continue running ordinary Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error()).context("fork");
    }
    if pid == 0 {
        // Child: the daemon.
        // SAFETY: fds[0] is ours to close; fds[1] is owned by the File from here on.
        unsafe {
            libc::close(fds[0]);
            libc::setsid();
        }
        let report = unsafe { File::from_raw_fd(fds[1]) };
        std::process::exit(daemon_main(req, report));
    }
    // Parent.
    // SAFETY: closing our copy of the write end; reading the read end we own.
    unsafe {
        libc::close(fds[1]);
    }
    let mut rd = unsafe { File::from_raw_fd(fds[0]) };
    let mut msg = String::new();
    let _ = rd.read_to_string(&mut msg);
    if msg.starts_with("OK") {
        return Ok(());
    }
    if let Some(e) = msg.strip_prefix("ERR ") {
        let mut status = 0;
        // SAFETY: reaping our own child.
        unsafe {
            libc::waitpid(pid, &mut status, 0);
        }
        bail!("{}", e.trim_end());
    }
    let mut status = 0;
    // SAFETY: reaping our own child.
    unsafe {
        libc::waitpid(pid, &mut status, 0);
    }
    bail!("the mount daemon exited before mounting (wait status {status:#x})")
}

fn daemon_main(req: &MountRequest, mut report: File) -> i32 {
    // A daemon without a log file only has the terminal until it detaches.
    let level = if req.log_file.is_some() {
        "info"
    } else {
        "warn"
    };
    if let Err(e) = init_logging(req.log_file.as_deref(), level) {
        let _ = write!(report, "ERR {e:#}");
        return 1;
    }
    let mut report = Some(report);
    let r = serve(req, |req| {
        if let Some(p) = &req.pid_file {
            std::fs::write(p, format!("{}\n", crate::sandbox::service_pid()))
                .with_context(|| format!("pid file {}", p.display()))?;
        }
        detach_stdio();
        if let Some(mut w) = report.take() {
            let _ = w.write_all(b"OK\n");
        }
        Ok(())
    });
    match r {
        Ok(()) => 0,
        Err(e) => {
            match report.take() {
                // Not mounted yet: the parent prints the message.
                Some(mut w) => {
                    let _ = write!(w, "ERR {e:#}");
                }
                None => tracing::error!("{e:#}"),
            }
            1
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
        use std::os::fd::AsRawFd;
        let n = null.as_raw_fd();
        // SAFETY: duplicating a valid descriptor over the standard ones.
        unsafe {
            libc::dup2(n, 0);
            libc::dup2(n, 1);
            libc::dup2(n, 2);
        }
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
        let e = p(&["bogus"]).unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
        assert_eq!(p(&[]).unwrap(), MountCmdOptions::default());
        let o = p(&["keep_privileges,sandbox_user=daemon"]).unwrap();
        assert!(o.keep_privileges && o.sandbox_user.as_deref() == Some("daemon"));
        assert!(!MountCmdOptions::default().keep_privileges);
    }
}
