//! Mount lifecycle through the real `commitfs` binary (issue #9, items 4, 6, 8):
//! `commitfs umount` waits until the image is written home; a mount whose daemon
//! died is reported and cleaned up; `mount -t fuse.commitfs`, fstab lines and plain
//! `umount` through the installed helpers; the daemon's log (file, syslog) has no
//! colour codes and no warnings on normal use. Needs root, /dev/fuse, fuse3.

mod common;

use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use commitfs::testutil::mkfs;
use common::{check_fsck, is_mounted, unique_path, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_commitfs");

fn require_fuse() {
    assert!(
        Path::new("/dev/fuse").exists(),
        "these tests need /dev/fuse (modprobe fuse) and fuse3 (fusermount3, mount.fuse3)"
    );
}

fn commitfs(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("COMMITFS_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run commitfs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Is a process with this pid still running (not a zombie)?
fn alive(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => false,
        Ok(s) => !matches!(
            s.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next()),
            Some("Z") | Some("X")
        ),
    }
}

/// A mount point directory; Drop unmounts whatever is still mounted there (lazily
/// if it must), kills the daemon named by the pid file if it is still running,
/// and removes the directory and pid file, also when the test panics.
struct MountDir {
    dir: TempDir,
    pid_file: PathBuf,
}

impl MountDir {
    fn new(tag: &str) -> MountDir {
        let dir = TempDir::new(tag);
        let pid_file = dir.path.with_extension("pid");
        MountDir { dir, pid_file }
    }

    fn path(&self) -> &Path {
        &self.dir.path
    }

    fn pid(&self) -> i32 {
        fs::read_to_string(&self.pid_file)
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid in pid file")
    }

    /// `commitfs mount IMAGE DIR --pid-file P [extra]` (daemon mode).
    fn mount(&self, image: &Path, extra: &[&str]) {
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "mount".as_ref(),
            image.as_os_str(),
            self.path().as_os_str(),
            "--pid-file".as_ref(),
            self.pid_file.as_os_str(),
        ];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        let out = commitfs(&args);
        assert!(out.status.success(), "mount failed: {}", text(&out));
        assert!(is_mounted(self.path(), "fuse"), "not mounted after mount");
    }
}

impl Drop for MountDir {
    fn drop(&mut self) {
        let d = self.dir.path.clone();
        if is_mounted(&d, "fuse") {
            let ok = Command::new("fusermount3")
                .arg("-u")
                .arg(&d)
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                let _ = Command::new("fusermount3").arg("-uz").arg(&d).status();
            }
        }
        if let Some(pid) = fs::read_to_string(&self.pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
        {
            let deadline = Instant::now() + Duration::from_secs(20);
            while alive(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if alive(pid) {
                // SAFETY: kill(2) has no memory-safety preconditions.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
        let _ = fs::remove_file(&self.pid_file);
    }
}

/// The image is clean right now: `e2fsck -fn` finds nothing and `commitfs info`
/// says clean with nothing to recover.
fn assert_image_clean(image: &Path, what: &str) {
    if let Err(e) = check_fsck(image, what) {
        panic!("{e}");
    }
    let out = commitfs(&["info".as_ref(), "--json".as_ref(), image.as_os_str()]);
    assert!(out.status.success(), "info: {}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("info json");
    assert_eq!(v["state"], "clean", "{what}: info {v}");
    assert_eq!(v["needs_recovery"], false, "{what}: info {v}");
}

/// A dirty workload: many small files, a few directories, one larger file,
/// renames and unlinks, nothing fsynced.
fn dirty_workload(dir: &Path, round: usize, files: usize) {
    for d in 0..4 {
        let sub = dir.join(format!("r{round}-d{d}"));
        fs::create_dir(&sub).unwrap();
        for i in 0..files / 4 {
            fs::write(
                sub.join(format!("f{i}")),
                format!("round {round} dir {d} file {i}\n"),
            )
            .unwrap();
        }
    }
    let big: Vec<u8> = (0..(3 << 20))
        .map(|i: u32| (i * 7 + round as u32) as u8)
        .collect();
    fs::write(dir.join(format!("r{round}-big")), &big).unwrap();
    fs::rename(
        dir.join(format!("r{round}-d0/f0")),
        dir.join(format!("r{round}-renamed")),
    )
    .unwrap();
    fs::remove_file(dir.join(format!("r{round}-d1/f1"))).unwrap();
}

/// What the image holds, read through the library (read-only).
fn count_files(image: &Path, round: usize) -> usize {
    let lib = commitfs::Fs::open_path(
        image,
        commitfs::MountOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .expect("open image");
    let mut n = 0;
    for d in 0..4 {
        let ino = lib
            .resolve(&format!("/r{round}-d{d}"))
            .expect("dir on image");
        n += lib
            .readdir_all(ino)
            .expect("readdir")
            .iter()
            .filter(|e| e.name != b"." && e.name != b"..")
            .count();
    }
    n
}

#[test]
fn commitfs_umount_waits_until_the_image_is_clean() {
    require_fuse();
    let img = mkfs("lc-umount", 128, &[]);
    let m = MountDir::new("lc-umount");
    for round in 0..3 {
        m.mount(&img.path, &[]);
        let pid = m.pid();
        if round == 0 {
            // A second mount on top of a live one is refused, naming the first.
            let out = commitfs(&["mount".as_ref(), img.path.as_os_str(), m.path().as_os_str()]);
            assert!(!out.status.success(), "stacked mount succeeded");
            assert!(
                text(&out).contains("already a commitfs mount"),
                "{}",
                text(&out)
            );
        }
        dirty_workload(m.path(), round, 400);
        let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
        assert!(out.status.success(), "commitfs umount: {}", text(&out));
        // No waiting here: the command's return is the promise.
        assert!(!alive(pid), "round {round}: daemon {pid} still running");
        assert!(!is_mounted(m.path(), "fuse"));
        assert_image_clean(&img.path, &format!("round {round}"));
        // 4 x 100 files, one renamed away, one removed.
        assert_eq!(count_files(&img.path, round), 398, "round {round}");
    }
    // Not a mount point any more: a clear error, not a hang.
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(!out.status.success());
    assert!(text(&out).contains("not a mount point"), "{}", text(&out));
}

#[test]
fn busy_mount_is_refused_unless_lazy_and_lazy_waits_for_the_last_user() {
    require_fuse();
    let img = mkfs("lc-busy", 64, &[]);
    let m = MountDir::new("lc-busy");
    m.mount(&img.path, &[]);
    let pid = m.pid();
    let mut f = fs::File::create(m.path().join("open")).unwrap();
    f.write_all(b"still open").unwrap();
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(!out.status.success(), "busy unmount succeeded");
    assert!(text(&out).contains("busy"), "{}", text(&out));
    assert!(is_mounted(m.path(), "fuse") && alive(pid));
    // --lazy detaches now and returns once the file is closed and written home.
    let child = Command::new(BIN)
        .args(["umount", "--lazy"])
        .arg(m.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while is_mounted(m.path(), "fuse") {
        assert!(Instant::now() < deadline, "not detached");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert!(alive(pid), "daemon exited while a file was open");
    drop(f);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "umount --lazy: {}", text(&out));
    assert!(!alive(pid));
    assert_image_clean(&img.path, "after lazy unmount");
    // --no-wait (what `umount -l` becomes through the helper) returns at once.
    m.mount(&img.path, &[]);
    let pid = m.pid();
    let f = fs::File::create(m.path().join("open2")).unwrap();
    let out = commitfs(&[
        "umount".as_ref(),
        "--lazy".as_ref(),
        "--no-wait".as_ref(),
        m.path().as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "umount --lazy --no-wait: {}",
        text(&out)
    );
    assert!(!is_mounted(m.path(), "fuse"));
    assert!(alive(pid), "daemon gone while a file was open");
    drop(f);
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(pid) {
        assert!(Instant::now() < deadline, "daemon did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_image_clean(&img.path, "after lazy unmount without waiting");
}

#[test]
fn dead_mount_is_reported_cleaned_up_and_recovered() {
    require_fuse();
    let img = mkfs("lc-dead", 64, &[]);
    let m = MountDir::new("lc-dead");
    m.mount(&img.path, &[]);
    let pid = m.pid();
    let synced = m.path().join("synced");
    {
        let mut f = fs::File::create(&synced).unwrap();
        f.write_all(b"fsynced before the crash").unwrap();
        f.sync_all().unwrap();
    }
    // The whole daemon dies: a root daemon is a privileged monitor and its
    // sandboxed worker (crates/cli/src/sandbox.rs), one process group (setsid).
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(-pid, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        match fs::metadata(m.path()) {
            // A request in flight when the connection died gets ECONNABORTED
            // (ECANCELED when it was queued on a FUSE-over-io_uring ring);
            // every later one ENOTCONN.
            Err(e)
                if !alive(pid)
                    && !matches!(
                        e.raw_os_error(),
                        Some(libc::ECONNABORTED) | Some(libc::ECANCELED)
                    ) =>
            {
                break e
            }
            _ => {
                assert!(Instant::now() < deadline, "daemon survived SIGKILL");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");
    // Mounting again over the dead mount: says what happened and what to do.
    let out = commitfs(&["mount".as_ref(), img.path.as_os_str(), m.path().as_os_str()]);
    assert!(!out.status.success(), "mount over a dead mount succeeded");
    let t = text(&out);
    assert!(
        t.contains("daemon has died") && t.contains("commitfs umount") && t.contains("recover"),
        "{t}"
    );
    // The image needs recovery: the crash left the journal in use.
    let info = commitfs(&["info".as_ref(), "--json".as_ref(), img.path.as_os_str()]);
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(v["needs_recovery"], true, "{v}");
    // `commitfs umount` cleans it up and says the image will be recovered.
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(
        out.status.success(),
        "umount of a dead mount: {}",
        text(&out)
    );
    assert!(text(&out).contains("recovers it"), "{}", text(&out));
    assert!(!is_mounted(m.path(), "fuse"));
    // Remount: recovery keeps what was fsynced.
    m.mount(&img.path, &[]);
    assert_eq!(fs::read(&synced).unwrap(), b"fsynced before the crash");
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_image_clean(&img.path, "after recovery and unmount");
}

/// Installs the mount/umount helper links in /sbin for the test and restores
/// whatever was there before on drop.
struct HelperLinks {
    saved: Vec<(PathBuf, Option<PathBuf>)>,
}

impl HelperLinks {
    fn install() -> HelperLinks {
        let names = ["mount.fuse.commitfs", "umount.fuse.commitfs", "umount.fuse"];
        let mut saved = Vec::new();
        for n in names {
            let p = Path::new("/sbin").join(n);
            let prev = match fs::symlink_metadata(&p) {
                Ok(md) if md.file_type().is_symlink() => Some(fs::read_link(&p).unwrap()),
                Ok(_) => panic!("{} exists and is not a symlink", p.display()),
                Err(_) => None,
            };
            saved.push((p, prev));
        }
        let h = HelperLinks { saved };
        let out = commitfs(&["install-helper".as_ref()]);
        assert!(out.status.success(), "install-helper: {}", text(&out));
        for (p, _) in &h.saved {
            assert_eq!(
                fs::canonicalize(p).unwrap(),
                fs::canonicalize(BIN).unwrap(),
                "{}",
                p.display()
            );
        }
        h
    }
}

impl Drop for HelperLinks {
    fn drop(&mut self) {
        for (p, prev) in &self.saved {
            let _ = fs::remove_file(p);
            if let Some(t) = prev {
                let _ = std::os::unix::fs::symlink(t, p);
            }
        }
    }
}

/// `mount(8)` with a temporary fstab: `mount -T FILE DIR`.
fn mount_cmd(args: &[&std::ffi::OsStr]) -> Output {
    Command::new("mount")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run mount")
}

#[test]
fn mount_t_fuse_commitfs_fstab_and_plain_umount_through_the_helpers() {
    require_fuse();
    let img = mkfs("lc-helper", 128, &[]);
    let m = MountDir::new("lc-helper");
    {
        let _links = HelperLinks::install();
        // mount -t fuse.commitfs with options copied from an ext4 fstab line.
        let out = mount_cmd(&[
            "-t".as_ref(),
            "fuse.commitfs".as_ref(),
            img.path.as_os_str(),
            m.path().as_os_str(),
            "-o".as_ref(),
            "user_xattr,data=ordered,barrier,discard,nofail".as_ref(),
        ]);
        assert!(
            out.status.success(),
            "mount -t fuse.commitfs: {}",
            text(&out)
        );
        assert!(is_mounted(m.path(), "fuse.commitfs"));
        dirty_workload(m.path(), 0, 400);
        // Plain umount runs /sbin/umount.fuse, which waits for the daemon.
        let out = Command::new("umount").arg(m.path()).output().unwrap();
        assert!(out.status.success(), "umount: {}", text(&out));
        assert_image_clean(&img.path, "after plain umount");
        assert_eq!(count_files(&img.path, 0), 398);

        // An fstab line, mounted by its mount point.
        let fstab = unique_path("lc-fstab");
        let _fstab_guard = common::TempFile {
            path: fstab.clone(),
        };
        fs::write(
            &fstab,
            format!(
                "# copied from an ext4 line\n{} {} fuse.commitfs \
                 defaults,noauto,user_xattr,data=ordered,barrier=1,nodiscard,_netdev,\
                 x-systemd.device-timeout=10 0 0\n",
                img.path.display(),
                m.path().display()
            ),
        )
        .unwrap();
        let out = mount_cmd(&["-T".as_ref(), fstab.as_os_str(), m.path().as_os_str()]);
        assert!(out.status.success(), "mount -T fstab DIR: {}", text(&out));
        assert!(is_mounted(m.path(), "fuse.commitfs"));
        assert!(m.path().join("r0-big").exists());
        dirty_workload(m.path(), 1, 200);
        let out = Command::new("umount").arg(m.path()).output().unwrap();
        assert!(out.status.success(), "umount: {}", text(&out));
        assert_image_clean(&img.path, "after fstab mount and umount");
        assert_eq!(count_files(&img.path, 1), 198);
        // An unknown option is refused by name through mount(8) too.
        let out = mount_cmd(&[
            "-t".as_ref(),
            "fuse.commitfs".as_ref(),
            "-o".as_ref(),
            "data=journal".as_ref(),
            img.path.as_os_str(),
            m.path().as_os_str(),
        ]);
        assert!(!out.status.success());
        assert!(text(&out).contains("data=journal"), "{}", text(&out));
        assert!(!is_mounted(m.path(), "fuse"));
    }
    for n in ["mount.fuse.commitfs", "umount.fuse"] {
        let p = Path::new("/sbin").join(n);
        assert!(
            fs::canonicalize(&p).ok() != fs::canonicalize(BIN).ok(),
            "{} left behind",
            p.display()
        );
    }
    // Without our helper, mount.fuse3 runs `commitfs SOURCE DIR -o OPTS` from PATH.
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("mount.fuse3")
        .arg(&img.path)
        .arg(m.path())
        .args(["-t", "fuse.commitfs", "-o", "user_xattr,noauto,nofail"])
        .env("PATH", path)
        .stdin(Stdio::null())
        .output()
        .expect("run mount.fuse3");
    assert!(out.status.success(), "mount.fuse3: {}", text(&out));
    assert!(is_mounted(m.path(), "fuse.commitfs"));
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(out.status.success(), "{}", text(&out));
    assert_image_clean(&img.path, "after mount.fuse3");
}

/// Calls on a file the FUSE file system does not support but programs probe:
/// a terminal ioctl (TCGETS) and FS_IOC_GETFLAGS (lsattr).
fn probe_ioctls(p: &Path) {
    let f = fs::File::open(p).unwrap();
    let mut buf = [0u8; 256];
    for req in [libc::TCGETS, 0x8008_6601] {
        // SAFETY: the buffer is larger than either request's argument.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), req as _, buf.as_mut_ptr()) };
        assert_eq!(r, -1, "ioctl {req:#x} succeeded");
    }
}

/// The log must show the mount and the unmount, and nothing at WARN or ERROR, and
/// no escape codes.
fn assert_quiet_plain_log(log: &str, what: &str) {
    assert!(
        log.contains("mounted") && log.contains("unmounted"),
        "{what}:\n{log}"
    );
    assert!(
        !log.contains('\x1b'),
        "{what}: escape codes in the log:\n{log}"
    );
    for l in log.lines() {
        assert!(
            !l.contains("WARN") && !l.contains("ERROR"),
            "{what}: warning on normal use: {l}\n{log}"
        );
    }
}

fn normal_use(dir: &Path, tag: &str) {
    let p = |n: &str| dir.join(format!("{tag}-{n}"));
    fs::write(p("a"), b"x").unwrap();
    fs::rename(p("a"), p("b")).unwrap();
    probe_ioctls(&p("b"));
    fs::create_dir(p("d")).unwrap();
    let f = fs::File::create(p("d").join("c")).unwrap();
    f.sync_all().unwrap();
    fs::remove_file(p("b")).unwrap();
}

#[test]
fn daemon_log_file_has_no_colour_and_no_warnings_on_normal_use() {
    require_fuse();
    let img = mkfs("lc-log", 64, &[]);
    let m = MountDir::new("lc-log");
    let log = common::TempFile {
        path: unique_path("lc-log").with_extension("log"),
    };
    m.mount(&img.path, &["--log-file", log.path.to_str().unwrap()]);
    normal_use(m.path(), "daemon");
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(out.status.success(), "{}", text(&out));
    let t = fs::read_to_string(&log.path).unwrap();
    assert_quiet_plain_log(&t, "log file");
    // --foreground logging to a stderr that is not a terminal: no colour either.
    let err = common::TempFile {
        path: unique_path("lc-log-fg").with_extension("log"),
    };
    let ef = fs::File::create(&err.path).unwrap();
    let mut child = Command::new(BIN)
        .arg("mount")
        .arg(&img.path)
        .arg(m.path())
        .arg("--foreground")
        .env_remove("COMMITFS_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(ef)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !is_mounted(m.path(), "fuse") {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("foreground mount exited: {st}");
        }
        assert!(Instant::now() < deadline, "foreground mount not up");
        std::thread::sleep(Duration::from_millis(20));
    }
    normal_use(m.path(), "foreground");
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(child.wait().unwrap().success());
    assert_quiet_plain_log(&fs::read_to_string(&err.path).unwrap(), "foreground stderr");
    assert_image_clean(&img.path, "after logging runs");
}

#[test]
fn daemon_logs_to_syslog_without_a_log_file() {
    require_fuse();
    let img = mkfs("lc-syslog", 64, &[]);
    let m = MountDir::new("lc-syslog");
    let sock_path = unique_path("lc-syslog").with_extension("sock");
    let _sock_guard = common::TempFile {
        path: sock_path.clone(),
    };
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let out = Command::new(BIN)
        .arg("mount")
        .arg(&img.path)
        .arg(m.path())
        .arg("--pid-file")
        .arg(&m.pid_file)
        .env("COMMITFS_SYSLOG_SOCKET", &sock_path)
        .env_remove("COMMITFS_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "mount: {}", text(&out));
    // Nothing on the terminal: the log goes to syslog.
    assert!(out.stderr.is_empty(), "{}", text(&out));
    let pid = m.pid();
    normal_use(m.path(), "syslog");
    let out = commitfs(&["umount".as_ref(), m.path().as_os_str()]);
    assert!(out.status.success(), "{}", text(&out));
    let mut msgs = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = sock.recv(&mut buf) {
        msgs.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    let all = msgs.join("\n");
    // RFC 3164: <facility*8+severity>; daemon (3) info (6) = 30, warning = 28.
    let tag = format!("commitfs[{pid}]");
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("<30>") && m.contains(&tag) && m.contains("mounted")),
        "no info message from {tag}:\n{all}"
    );
    assert!(msgs.iter().any(|m| m.contains("unmounted")), "{all}");
    assert!(
        !msgs
            .iter()
            .any(|m| m.starts_with("<28>") || m.starts_with("<27>")),
        "warnings on normal use:\n{all}"
    );
    assert!(!all.contains('\x1b'), "{all}");
    assert_image_clean(&img.path, "after syslog run");
}

#[test]
fn umount_refuses_what_is_not_commitfs() {
    // A tmpfs is a mount point but not ours: refused by type, left mounted.
    let d = TempDir::new("lc-tmpfs");
    let out = mount_cmd(&[
        "-t".as_ref(),
        "tmpfs".as_ref(),
        "none".as_ref(),
        d.path.as_os_str(),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let out = commitfs(&["umount".as_ref(), d.path.as_os_str()]);
    let still = is_mounted(&d.path, "tmpfs");
    let _ = Command::new("umount").arg(&d.path).status();
    assert!(!out.status.success());
    assert!(text(&out).contains("tmpfs"), "{}", text(&out));
    assert!(still, "commitfs umount unmounted a tmpfs");
}
