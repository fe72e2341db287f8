//! The mount daemon's sandbox: once the image and `/dev/fuse` are open, the process
//! that parses the image and serves requests (the *worker*) gives up root, so a
//! parser bug reachable from a hostile image cannot be turned into root access.
//!
//! The worker drops to an unprivileged user (`nobody` unless `-o sandbox_user=`),
//! with no supplementary groups, empty capability sets (bounding set too),
//! `no_new_privs` and a seccomp filter that allows only the system calls serving
//! needs. Unmounting needs privilege, so before anything is opened the daemon
//! forks: the original process stays privileged as a tiny *monitor* that only
//! waits for signals and the worker's exit, unmounts on SIGTERM/SIGINT/SIGHUP,
//! and exits with the worker's status (it is the process the pid file names,
//! since it exits last). `-o keep_privileges` skips all of this.

use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};

/// Who the worker becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// User the worker runs as unless `-o sandbox_user=` names another.
pub const DEFAULT_USER: &str = "nobody";

/// Decide whether to sandbox: only a root daemon has privileges to drop (an
/// unprivileged one mounts through fusermount3, which it also needs to unmount).
pub fn plan(keep_privileges: bool, user: Option<&str>) -> Result<Option<Identity>> {
    // SAFETY: geteuid cannot fail.
    if keep_privileges || unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    resolve_user(user.unwrap_or(DEFAULT_USER)).map(Some)
}

/// A user name or numeric uid; the group is the user's primary group (or the uid
/// for an unknown number).
pub fn resolve_user(name: &str) -> Result<Identity> {
    let c = CString::new(name).map_err(|_| anyhow!("bad user name {name:?}"))?;
    // SAFETY: passwd is plain data; all-zero is a valid (empty) value.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwnam_r writes into pw and buf (sizes passed) and sets out.
    let r = unsafe { libc::getpwnam_r(c.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) };
    let id = if r == 0 && !out.is_null() {
        Identity {
            uid: pw.pw_uid,
            gid: pw.pw_gid,
        }
    } else if let Ok(uid) = name.parse::<u32>() {
        Identity { uid, gid: uid }
    } else {
        bail!("sandbox_user={name}: no such user (or use -o keep_privileges)");
    };
    if id.uid == 0 || id.gid == 0 {
        bail!("sandbox_user={name}: the sandbox user must have a non-zero uid and group");
    }
    Ok(id)
}

/// The worker's side of the sandbox, set in the worker: the monitor's pid and
/// the write end of the pipe to it (the worker, once unprivileged, cannot signal
/// a root process).
struct ToMonitor {
    pid: libc::pid_t,
    fd: libc::c_int,
}

static MONITOR: OnceLock<ToMonitor> = OnceLock::new();

/// Messages on the worker-to-monitor pipe.
const MSG_MOUNTED: u8 = b'M';
const MSG_UNMOUNT: u8 = b'U';
/// The worker serves the stats socket (so it is this mount's to remove).
const MSG_STATS_SOCKET: u8 = b'S';

/// The pid that stands for the mount (pid file): the monitor when sandboxed.
pub fn service_pid() -> u32 {
    MONITOR
        .get()
        .map(|m| m.pid as u32)
        .unwrap_or_else(std::process::id)
}

/// The privileged monitor, when sandboxed.
pub fn monitor_pid() -> Option<libc::pid_t> {
    MONITOR.get().map(|m| m.pid)
}

fn sigset(sigs: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a local sigset_t.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in sigs {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Fork the monitor. Must run before any thread exists and before anything is
/// opened. Returns in the worker (the child); the monitor never returns: it exits
/// with the worker's exit status.
pub fn fork_monitor(dir: &Path, foreground: bool) -> Result<()> {
    let cdir = CString::new(dir.as_os_str().as_bytes()).context("mount point path")?;
    // The stats socket lives in a root-owned directory: the monitor removes it
    // (when the worker says it served it).
    let sock = CString::new(crate::cmd::stats::socket_path(dir).as_os_str().as_bytes())
        .context("stats socket path")?;
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("pipe (sandbox monitor)");
    }
    // Blocked before the fork, so no SIGCHLD is lost in between.
    let set = sigset(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGCHLD]);
    // SAFETY: changing this (single) thread's mask with a valid set.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    // SAFETY: getpid cannot fail; fork is called while single-threaded (see
    // above), so the child may go on running ordinary Rust code.
    let monitor = unsafe { libc::getpid() };
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error()).context("fork (sandbox monitor)");
    }
    if pid == 0 {
        // The worker keeps only the termination signals blocked (as before).
        let extra = sigset(&[libc::SIGCHLD]);
        // SAFETY: as above; closing the read end, which is the monitor's.
        unsafe {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &extra, std::ptr::null_mut());
            libc::close(fds[0]);
        }
        let _ = MONITOR.set(ToMonitor {
            pid: monitor,
            fd: fds[1],
        });
        return Ok(());
    }
    monitor_loop(pid, fds[0], &cdir, &sock, foreground, &set)
}

/// The monitor: waits for termination signals, the worker's messages and its
/// exit. No logging (its descriptors are closed). Single-threaded (the parent of
/// the fork), so ordinary Rust is fine here.
fn monitor_loop(
    worker: libc::pid_t,
    rd: libc::c_int,
    dir: &CStr,
    sock: &CStr,
    foreground: bool,
    set: &libc::sigset_t,
) -> ! {
    // Hold nothing of the worker's (the report pipe, whose EOF the caller of a
    // daemon mount waits for; the image; the log file), only our pipe end.
    // SAFETY: closing descriptors this process owns; redirecting stdio to /dev/null.
    unsafe {
        if rd > 3 {
            libc::syscall(libc::SYS_close_range, 3u32, (rd - 1) as u32, 0u32);
        }
        libc::syscall(libc::SYS_close_range, (rd + 1) as u32, u32::MAX, 0u32);
        if !foreground {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            if null >= 0 {
                libc::dup2(null, 0);
                libc::dup2(null, 1);
                libc::dup2(null, 2);
                libc::close(null);
            }
            libc::setsid();
        }
    }
    // SAFETY: a signalfd for the blocked set.
    let sfd = unsafe { libc::signalfd(-1, set, libc::SFD_CLOEXEC) };
    let mut rd = rd;
    let mut mounted = false;
    let mut want_unmount = false;
    let mut own_sock = false;
    loop {
        let mut pfd = [
            libc::pollfd {
                fd: sfd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: rd,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: polling two descriptors (a negative one is ignored).
        if unsafe { libc::poll(pfd.as_mut_ptr(), 2, 1000) } < 0 {
            continue;
        }
        let mut sig = None;
        if pfd[0].revents & libc::POLLIN != 0 {
            // SAFETY: reading one siginfo record into a zeroed struct of its size.
            let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
            let n = unsafe {
                libc::read(
                    sfd,
                    (&mut info as *mut libc::signalfd_siginfo).cast(),
                    std::mem::size_of::<libc::signalfd_siginfo>(),
                )
            };
            if n == std::mem::size_of::<libc::signalfd_siginfo>() as isize {
                sig = Some(info.ssi_signo as libc::c_int);
            }
        }
        if pfd[1].revents != 0 {
            let mut b = 0u8;
            // SAFETY: reading one byte into a local.
            match unsafe { libc::read(rd, (&mut b as *mut u8).cast(), 1) } {
                1 if b == MSG_MOUNTED => {
                    mounted = true;
                    if want_unmount {
                        unmount(dir);
                    }
                }
                1 if b == MSG_UNMOUNT => sig = Some(libc::SIGTERM),
                1 if b == MSG_STATS_SOCKET => own_sock = true,
                1 => {}
                _ => {
                    // EOF: the worker is exiting; SIGCHLD follows.
                    // SAFETY: closing our pipe end.
                    unsafe { libc::close(rd) };
                    rd = -1;
                }
            }
        }
        // Also check without a SIGCHLD (a missed one would hang the monitor).
        let mut status = 0;
        // SAFETY: reaping our own child.
        if unsafe { libc::waitpid(worker, &mut status, libc::WNOHANG) } == worker {
            let code = if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                128 + libc::WTERMSIG(status)
            };
            // A worker that failed or was killed may leave its mount behind (a
            // dead one: "transport endpoint is not connected"); a clean exit
            // follows the kernel's unmount.
            if code != 0 && mounted && fuse_mounted_at(dir) {
                unmount(dir);
            }
            // Only a socket the worker served: another mount at the same
            // directory may own the path.
            if own_sock {
                // SAFETY: unlinking a path; failure (already gone) is fine.
                unsafe { libc::unlink(sock.as_ptr()) };
            }
            std::process::exit(code);
        }
        match sig {
            None | Some(libc::SIGCHLD) => {}
            Some(_) if mounted => unmount(dir),
            // Not mounted yet: unmount as soon as it is.
            Some(_) => want_unmount = true,
        }
    }
}

/// Whether a FUSE file system is mounted at `dir` (the monitor is single-threaded,
/// so it may allocate).
fn fuse_mounted_at(dir: &CStr) -> bool {
    let want = dir.to_string_lossy();
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|t| {
            t.lines().any(|l| {
                l.split(' ').nth(4) == Some(&*want)
                    && l.split(" - ").nth(1).is_some_and(|r| r.starts_with("fuse"))
            })
        })
        .unwrap_or(false)
}

/// Unmount; lazily when busy (as the unprivileged daemon did before).
fn unmount(dir: &CStr) {
    // SAFETY: umount2 with a valid NUL-terminated path.
    unsafe {
        if libc::umount2(dir.as_ptr(), 0) != 0 {
            libc::umount2(dir.as_ptr(), libc::MNT_DETACH);
        }
    }
}

fn tell_monitor(msg: u8) -> bool {
    match MONITOR.get() {
        Some(m) => {
            // SAFETY: writing one byte to our pipe end.
            unsafe { libc::write(m.fd, (&msg as *const u8).cast(), 1) };
            true
        }
        None => false,
    }
}

/// Tell the monitor the file system is mounted (it may unmount it from now on).
pub fn notify_mounted() {
    tell_monitor(MSG_MOUNTED);
}

/// Tell the monitor the worker bound the stats socket: the monitor removes
/// it when the worker exits (the sandboxed worker may not).
pub fn notify_stats_socket() {
    tell_monitor(MSG_STATS_SOCKET);
}

/// Ask the monitor to unmount (the worker cannot); false when not sandboxed.
pub fn forward_signal(_sig: libc::c_int) -> bool {
    tell_monitor(MSG_UNMOUNT)
}

/// Drop privileges for good in the worker: groups, gid, uid, every capability,
/// `no_new_privs`, then the seccomp filter on every thread.
pub fn enter(id: Identity) -> Result<()> {
    if monitor_pid().is_none() {
        bail!("sandbox: no monitor process");
    }
    let prog = filter()?;
    // SAFETY: plain system calls with valid arguments; results checked.
    unsafe {
        // The bounding set first: dropping it needs CAP_SETPCAP, gone after
        // setresuid. Without CAP_SETPCAP (some containers) it stays: it only
        // limits what an exec could gain, and exec is refused below.
        let mut cap = 0;
        while libc::prctl(libc::PR_CAPBSET_READ, cap) >= 0 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap) != 0 {
                tracing::warn!(
                    "sandbox: cannot empty the capability bounding set: {}",
                    std::io::Error::last_os_error()
                );
                break;
            }
            cap += 1;
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        if libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(std::io::Error::last_os_error()).context("setgroups");
        }
        // glibc applies set*id to every thread of the process.
        if libc::setresgid(id.gid, id.gid, id.gid) != 0 {
            return Err(std::io::Error::last_os_error()).context("setresgid");
        }
        if libc::setresuid(id.uid, id.uid, id.uid) != 0 {
            return Err(std::io::Error::last_os_error()).context("setresuid");
        }
        // Leaving uid 0 cleared the permitted and effective sets; check, and that
        // root cannot be regained.
        if libc::setresuid(0, 0, 0) == 0 || libc::geteuid() == 0 {
            bail!("sandbox: could regain root after dropping it");
        }
    }
    // Sets no_new_privs, then installs the filter on every thread (TSYNC).
    seccompiler::apply_filter_all_threads(&prog).context("installing the seccomp filter")?;
    tracing::info!(
        "sandboxed: uid {} gid {}, no capabilities, seccomp filter",
        id.uid,
        id.gid
    );
    Ok(())
}

/// The system calls the worker makes after the drop: file I/O on the image and
/// `/dev/fuse` (already open), memory, threads (no new processes: `clone` only
/// with `CLONE_THREAD`, `clone3` gets ENOSYS so libc falls back to `clone`),
/// futexes, clocks, signals to itself, the monitor pipe, the stats socket.
///
/// Anything else fails with ENOSYS rather than killing the process: a killed
/// daemon leaves a dead mount and loses unsynced data, while a refused call only
/// fails (libc falls back from new system calls it probes on ENOSYS), and the
/// refused call does nothing either way.
fn filter() -> Result<seccompiler::BpfProgram> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition as Cond, SeccompFilter,
        SeccompRule, TargetArch,
    };
    let arch = if cfg!(target_arch = "x86_64") {
        TargetArch::x86_64
    } else if cfg!(target_arch = "aarch64") {
        TargetArch::aarch64
    } else {
        bail!("sandbox: no seccomp filter for this architecture (use -o keep_privileges)");
    };
    let mut allow: Vec<libc::c_long> = vec![
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_readv,
        libc::SYS_writev,
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_preadv,
        libc::SYS_pwritev,
        libc::SYS_preadv2,
        libc::SYS_pwritev2,
        libc::SYS_close,
        libc::SYS_fstat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_lseek,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_fallocate,
        libc::SYS_sync_file_range,
        libc::SYS_fcntl,
        libc::SYS_ppoll,
        libc::SYS_mmap,
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_mprotect,
        libc::SYS_madvise,
        libc::SYS_brk,
        libc::SYS_futex,
        libc::SYS_set_robust_list,
        libc::SYS_rseq,
        libc::SYS_exit,
        libc::SYS_exit_group,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigaction,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        libc::SYS_rt_sigtimedwait,
        libc::SYS_getpid,
        libc::SYS_gettid,
        libc::SYS_getppid,
        libc::SYS_getuid,
        libc::SYS_geteuid,
        libc::SYS_getgid,
        libc::SYS_getegid,
        libc::SYS_clock_gettime,
        libc::SYS_clock_getres,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_gettimeofday,
        libc::SYS_sched_yield,
        libc::SYS_sched_getaffinity,
        libc::SYS_getrandom,
        libc::SYS_accept4,
        libc::SYS_connect,
        libc::SYS_sendto,
        libc::SYS_recvfrom,
        libc::SYS_shutdown,
        libc::SYS_unlinkat,
        libc::SYS_restart_syscall,
        libc::SYS_membarrier,
        // The device's rings (device/src/uring.rs), set up before the filter
        // and restricted to writes: no io_uring_setup or _register here.
        libc::SYS_io_uring_enter,
    ];
    #[cfg(target_arch = "x86_64")]
    allow.extend([
        libc::SYS_poll,
        libc::SYS_accept,
        libc::SYS_unlink,
        libc::SYS_stat,
        libc::SYS_lstat,
    ]);
    let mut rules: std::collections::BTreeMap<i64, Vec<SeccompRule>> =
        allow.into_iter().map(|s| (s, vec![])).collect();
    let cond = |arg: u8, op: SeccompCmpOp, v: u64| {
        Cond::new(arg, SeccompCmpArgLen::Qword, op, v).map_err(|e| anyhow!("seccomp rule: {e}"))
    };
    let rule = |c: Vec<Cond>| SeccompRule::new(c).map_err(|e| anyhow!("seccomp rule: {e}"));
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(
            0,
            SeccompCmpOp::MaskedEq(thread),
            thread,
        )?])?],
    );
    // Signals: only to this process and its threads.
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() } as u64;
    rules.insert(
        libc::SYS_tgkill,
        vec![rule(vec![cond(0, SeccompCmpOp::Eq, me)?])?],
    );
    rules.insert(
        libc::SYS_kill,
        vec![rule(vec![cond(0, SeccompCmpOp::Eq, me)?])?],
    );
    // Unix sockets only (the stats socket wakes its own accept loop on exit).
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![cond(
            0,
            SeccompCmpOp::Eq,
            libc::AF_UNIX as u64,
        )?])?],
    );
    // Read-only opens, for `/proc/PID/status` of a caller (its groups and
    // CAP_FSETID decide whether a data change clears setgid, crates/fuse
    // convert::caller_of): nothing can be created, truncated or written, and as
    // `nobody` with no capabilities only world-readable files open at all.
    let writing =
        (libc::O_ACCMODE | libc::O_CREAT | libc::O_TRUNC | libc::O_APPEND | 0o20000000) as u64;
    let read_only = |arg: u8| -> Result<SeccompRule> {
        rule(vec![Cond::new(
            arg,
            SeccompCmpArgLen::Dword,
            SeccompCmpOp::MaskedEq(writing),
            0,
        )
        .map_err(|e| anyhow!("seccomp rule: {e}"))?])
    };
    rules.insert(libc::SYS_openat, vec![read_only(2)?]);
    // Thread names.
    rules.insert(
        libc::SYS_prctl,
        vec![
            rule(vec![cond(0, SeccompCmpOp::Eq, libc::PR_SET_NAME as u64)?])?,
            rule(vec![cond(0, SeccompCmpOp::Eq, libc::PR_GET_NAME as u64)?])?,
        ],
    );
    let f = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::ENOSYS as u32),
        SeccompAction::Allow,
        arch,
    )
    .map_err(|e| anyhow!("seccomp filter: {e}"))?;
    f.try_into().map_err(|e| anyhow!("seccomp filter: {e}"))
}
